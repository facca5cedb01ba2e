"""Per-request cost against the number of registered nodes: Register (a new key), Heartbeat (a known
key) and a request from an unknown key, at 50 and at 5,000 registered nodes, in the same run.

Each call goes through the coordinator's whole request path (``CoordinatorService.call``: envelope,
signature, replay window, identity lookup, the handler, the store commit), in process, without the
gRPC transport, whose cost does not depend on the node count. The node table is filled with real
registrations of fresh keys; the two sizes are measured alternately, round by round, so drift on a
shared machine falls on both, in alternating order. Figures are the median server time per call and the ratio 5,000 / 50.

    .venv/bin/python benchmarks/abuse_scale.py [--quick]

Prints one human line per method, then one JSON line: ``register_cost_ratio_5000_vs_50``,
``heartbeat_cost_ratio_5000_vs_50``, ``unknown_key_cost_ratio_5000_vs_50`` and the medians in ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SIZES = (50, 5000)
REGISTER_OVERRIDES = {"identity.pow_bits": 0}  # the proof of work is paid by the client; not measured here


def _overrides() -> dict:
    from veriroll.coordinator.config import CoordinatorConfig

    fields = CoordinatorConfig.model_fields
    out = {"server.key_rate_per_s": 1e6, "server.key_burst": 1e6, "server.peer_rate_per_s": 1e6, "server.peer_burst": 1e6}
    if "identity" in fields:  # new identities per address are limited; this measures cost, not the limit
        out.update(REGISTER_OVERRIDES)
        sub = fields["identity"].annotation.model_fields
        for name in ("new_per_hour_per_address", "new_per_hour_per_prefix"):
            if name in sub:
                out[f"identity.{name}"] = 1e9
    return out


async def _fill(coord, n: int) -> None:
    """``n`` registered nodes, written as Register writes them."""
    from veriroll.coordinator import store as st
    from veriroll.protos.identity import PrivateKey

    keys = [PrivateKey.generate().public for _ in range(n)]
    await coord.db.run(lambda c: [st.register_node(c, k.node_id, k.raw, 0, {}, "bench", "") for k in keys])


async def _time(coord, name: str, key, body: bytes, peer: str) -> float:
    from veriroll.coordinator.edge import Refusal
    from veriroll.protos.envelope import sign_request
    from veriroll.protos.service import full_method

    metadata = sign_request(key, full_method(name), body)
    start = time.perf_counter()
    try:
        await coord.service.call(name, body, metadata, peer)
    except Refusal:
        pass
    return time.perf_counter() - start


async def measure(rounds: int) -> dict:
    from support import make_coordinator_dir, running_coordinator

    from veriroll.protos.identity import PrivateKey
    from veriroll.protos.v1 import coordinator_pb2 as pb

    root = Path(tempfile.mkdtemp(prefix="veriroll-abuse-scale-"))
    times: dict[tuple[str, int], list[float]] = {}
    async with running_coordinator(make_coordinator_dir(root / "small", _overrides())) as small, \
            running_coordinator(make_coordinator_dir(root / "large", _overrides())) as large:
        coords = {SIZES[0]: small, SIZES[1]: large}
        for n, coord in coords.items():
            await _fill(coord, n)
        known = {}
        for n, coord in coords.items():  # heartbeat senders: registered through the real path
            known[n] = [PrivateKey.generate() for _ in range(32)]
            for k in known[n]:
                body = pb.RegisterRequest(public_key=k.public.raw, software_version="bench").SerializeToString()
                await _time(coord, "Register", k, body, "10.0.0.1")
        for r in range(rounds):
            order = list(coords.items()) if r % 2 == 0 else list(coords.items())[::-1]
            for n, coord in order:
                new = PrivateKey.generate()
                body = pb.RegisterRequest(public_key=new.public.raw, software_version="bench").SerializeToString()
                # A different address per new key: the per-address limit on new identities is not what is timed.
                peer = f"10.{r % 250}.{(r // 250) % 250}.{n % 250}"
                times.setdefault(("Register", n), []).append(await _time(coord, "Register", new, body, peer))
                key = known[n][r % len(known[n])]
                body = pb.HeartbeatRequest(loaded_version=0).SerializeToString()
                times.setdefault(("Heartbeat", n), []).append(await _time(coord, "Heartbeat", key, body, "10.0.0.1"))
                stranger = PrivateKey.generate()
                times.setdefault(("unknown_key", n), []).append(
                    await _time(coord, "Heartbeat", stranger, body, "10.0.0.2"))
    out = {}
    for method in ("Register", "Heartbeat", "unknown_key"):
        small_ms = statistics.median(times[(method, SIZES[0])]) * 1000
        large_ms = statistics.median(times[(method, SIZES[1])]) * 1000
        label = method.lower() if method != "unknown_key" else "unknown_key"
        out[f"{label}_ms_at_{SIZES[0]}"] = round(small_ms, 3)
        out[f"{label}_ms_at_{SIZES[1]}"] = round(large_ms, 3)
        out[f"{label}_cost_ratio_{SIZES[1]}_vs_{SIZES[0]}"] = round(large_ms / small_ms, 3)
    return out


def node_count_cost(quick: bool = True) -> dict:
    return asyncio.run(measure(150 if quick else 600))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    out = node_count_cost(args.quick)
    for method in ("register", "heartbeat", "unknown_key"):
        print(f"{method:12s} {out[f'{method}_ms_at_50']:7.3f} ms at 50 nodes, {out[f'{method}_ms_at_5000']:7.3f} ms "
              f"at 5,000: ratio {out[f'{method}_cost_ratio_5000_vs_50']:.2f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
