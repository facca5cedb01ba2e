"""Real traffic for the HTTP and dashboard tests: signed nodes that get groups accepted and rejected,
one node struck until banned, and a trainer history in the store the way the trainer writes it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
from support import channel_to

from veriroll.coordinator import store as st
from veriroll.coordinator.http import TRAINER_HISTORY_KEY
from veriroll.protos.identity import PrivateKey
from veriroll.protos.service import CallError, SignedStub
from veriroll.protos.v1 import coordinator_pb2 as pb


def shaped_group(lease: pb.Lease, *, n: int | None = None, logprob: float = -1.0) -> pb.SubmitGroupRequest:
    """A group with the right shape for ``lease`` (the tests run with ``intake.verify = false``)."""
    n = lease.group_size if n is None else n
    samples = [pb.Sample(token_ids=[5 + (i % 3)] * lease.max_new_tokens,
                         logprobs=np.full(lease.max_new_tokens, logprob, dtype="<f4").tobytes(),
                         proof=b"p" * 16, finish_reason="length") for i in range(n)]
    return pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version, samples=samples)


def trainer_history(steps: int, t0_ms: int, step_ms: int = 30_000) -> list[dict]:
    """A plausible trainer history, in the shape ``coordinator/trainer/loop.py`` writes to kv ``trainer_history``."""
    out = []
    for i in range(steps):
        out.append({
            "step": i + 1, "version": i + 1, "time": (t0_ms + i * step_ms) / 1000,
            "reward": round(0.2 + 0.6 * i / max(1, steps - 1), 4), "reward_by_env": {"arithmetic": 0.5},
            "loss": -0.01, "approx_kl": round(0.002 + 0.001 * (i % 4), 5), "clipfrac": round(0.05 + 0.01 * (i % 3), 4),
            "entropy": 1.2, "grad_norm": 0.4, "mismatch_kl": 1e-5, "lr": 1e-4, "frac_stale": 0.0,
            "dropped_stale_groups": 0, "staleness_hist": {"0": 40 - i, "1": 20 + i, "2": 4}, "groups": 16,
            "tokens": 1024, "groups_per_s": 1.5, "tokens_per_s": 96.0 + i, "zero_adv_groups": 2, "queue_depth": 3,
            "step_seconds": 2.0,
        })
    return out


@dataclass
class Traffic:
    nodes: dict[str, str] = field(default_factory=dict)  # display name -> node id
    accepted: dict[str, int] = field(default_factory=dict)  # node id -> accepted groups
    tokens: dict[str, int] = field(default_factory=dict)  # node id -> accepted tokens
    rejected: dict[str, dict[str, int]] = field(default_factory=dict)  # node id -> reason -> n
    history: list[dict] = field(default_factory=list)


async def _lease(stub: SignedStub) -> pb.Lease:
    return (await stub.lease_work(pb.LeaseRequest(max_leases=1))).leases[0]


async def make_traffic(coord, *, spread_ms: int = 0, history_steps: int = 12) -> Traffic:
    """Drive ``coord`` through signed gRPC: 3 nodes, accepted and rejected groups, one ban.

    With ``spread_ms``, arrival and rejection times are spread back over that span afterwards, so
    timelines have more than one bucket (the rows themselves come from real submissions).
    """
    t = Traffic()
    names = {"alice": 3, "<b>bob</b>": 1, "mallory": 0}  # display name -> honest groups
    async with contextlib.AsyncExitStack() as stack:
        for name, honest in names.items():
            key = PrivateKey.generate()
            channel = channel_to(coord)
            stack.push_async_callback(channel.close)
            stub = SignedStub(channel, key, timeout=20)
            await stub.register(pb.RegisterRequest(public_key=key.public.raw, software_version="test", display_name=name))
            nid = key.node_id
            t.nodes[name] = nid
            t.accepted[nid], t.tokens[nid], t.rejected[nid] = 0, 0, {}
            for _ in range(honest):
                ok = await stub.submit_group(shaped_group(await _lease(stub)))
                t.accepted[nid] += 1
                t.tokens[nid] += ok.credited_tokens
            if name == "<b>bob</b>":
                bad = [("wrong_group_size", {"n": 1})]
            elif name == "mallory":
                bad = [("bad_logprobs", {"logprob": 0.5})] * coord.cfg.intake.max_strikes
            else:
                bad = []
            for reason, kwargs in bad:
                try:
                    await stub.submit_group(shaped_group(await _lease(stub), **kwargs))
                except CallError as err:
                    assert err.reason == reason, err
                    t.rejected[nid][reason] = t.rejected[nid].get(reason, 0) + 1
                else:
                    raise AssertionError(f"expected {reason}")
            if name == "alice":
                # An unknown lease: not a strike, but counted against alice.
                fake = pb.SubmitGroupRequest(lease_id="f" * 24, policy_version=0, samples=[])
                try:
                    await stub.submit_group(fake)
                except CallError as err:
                    t.rejected[nid][err.reason] = t.rejected[nid].get(err.reason, 0) + 1
    now = coord.service.clock()
    t.history = trainer_history(history_steps, now - history_steps * 30_000)
    history = t.history

    def write(conn):
        if history:
            st.kv_set(conn, TRAINER_HISTORY_KEY, history)
        if spread_ms:
            gids = [r[0] for r in conn.execute("SELECT group_id FROM groups ORDER BY group_id")]
            for i, gid in enumerate(gids):
                conn.execute("UPDATE groups SET arrival_ms = arrival_ms - ? WHERE group_id = ?",
                             (spread_ms * (len(gids) - 1 - i) // max(1, len(gids) - 1), gid))
            rids = [r[0] for r in conn.execute("SELECT id FROM rejections ORDER BY id")]
            for i, rid in enumerate(rids):
                conn.execute("UPDATE rejections SET time_ms = time_ms - ? WHERE id = ?",
                             (spread_ms * (len(rids) - 1 - i) // max(1, len(rids) - 1), rid))

    await coord.db.run(write)
    if history:  # what the trainer exports after its last step
        metrics = coord.service.metrics
        metrics.trainer.set(history[-1]["reward"], metric="reward")
        metrics.trainer.set(history[-1]["approx_kl"], metric="approx_kl")
        for s, n in history[-1]["staleness_hist"].items():
            metrics.trainer_staleness.set(n, staleness=s)
    return t


async def refuse_unknown_key(coord, times: int) -> None:
    """``times`` requests signed by a key the coordinator never registered: refused (``unknown_key``) before
    the node is identified, so counted in the totals but never kept as an event on the timeline."""
    key = PrivateKey.generate()
    channel = channel_to(coord)
    try:
        stub = SignedStub(channel, key, timeout=20)
        for _ in range(times):
            try:
                await stub.lease_work(pb.LeaseRequest(max_leases=1))
            except CallError as err:
                assert err.reason == "unknown_key", err
            else:
                raise AssertionError("an unregistered key got work")
    finally:
        await channel.close()
