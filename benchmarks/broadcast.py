"""Weight broadcast: what lossless deltas save on a real model, and the relay tree against direct fetches.

1. **Deltas.** SmolLM2-135M (the cached built-in, float32) takes one optimizer step: the trainer's own
   AdamW (``build_optimizer``: betas (0.9, 0.99), no weight decay) on the language-model loss of a
   small batch of text, at each learning rate. For a first AdamW step every weight moves by about the
   learning rate, whatever the gradient: the case of an RL step where every parameter changes. The
   weights before and after are written as HF checkpoints in float32 and in bfloat16 (float32 master
   weights published in bf16, as the trainer does) and published as versions 1 and 2 of a store,
   version 2 with a delta against version 1. For each (learning rate, dtype):

   - ``delta_ratio``: bytes a node that holds version 1 downloads for version 2 (the delta's pieces,
     plus the shards that have none) / bytes of version 2 whole;
   - ``delta_build_s``: what building the delta added to publishing;
   - ``whole_s`` / ``rebuild_s``: a node fetches version 1 whole, then version 2 with version 1 as its
     base (rebuilt from the delta and checked shard by shard), from an origin relay process on
     loopback (fsync off: the disk is not what is measured).

2. **Tree against direct** (``benchmarks/shardcast.py --skip-single --no-address-limits``, run as a
   child): clients through origin → 2 streaming mirror relays (``tree_s``) and straight from the
   origin (``direct_s``), each until the last client holds a verified checkpoint; with the library's
   default of 8 shards at once per client, and again with 2 (``*_2_streams``: see that benchmark's
   docstring for why).

    .venv/bin/python benchmarks/broadcast.py [--quick]

3. **Over an emulated WAN** (the same benchmark with ``--wan``: every host, origin, mirrors and
   clients, behind its own ``rtt=100ms,down=100mbit,up=100mbit`` link through ``veriroll.deploy.wan``):
   16 clients, 256 MiB; ``wan.time_to_95pct_s_tree`` / ``_direct`` is the time until 95 % of them hold a
   verified checkpoint, ``wan.origin_copies_tree`` / ``_direct`` the origin's bytes / the checkpoint's.
   ``--swarm`` adds the libp2p swarm over the same links (``time_to_95pct_s_swarm``,
   ``origin_copies_swarm``: :func:`swarm_over_wan`) and, on loopback, ``bad_peer_detected`` and
   ``nat_nodes_served_peers`` (:func:`swarm_adversity`).

``--quick``: the tree at 64 MiB and 4 clients instead of 256 MiB and 16, and the WAN scenario at 64 MiB
and 16 clients (the delta part is the same). ``--skip-deltas`` leaves out part 1 (no model needed).
Prints a line per measurement, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TEXTS = [
    "Reinforcement learning from verifiable rewards trains a policy on problems whose answers can be checked.",
    "The quick brown fox jumps over the lazy dog, and then it runs back into the forest to find its friends.",
    "Weights are broadcast to volunteer nodes through relays; every byte is checked against a signed manifest.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5, as any careful reader would expect",
]


def step_checkpoints(work: Path, lrs: list[float], dtypes: list[str]) -> dict[tuple[float, str], Path]:
    """Version 1 (``base-<dtype>``) and, per learning rate, version 2 (``step-<lr>-<dtype>``) as HF directories."""
    import torch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from veriroll.coordinator.config import TrainerConfig
    from veriroll.coordinator.models import cached_builtin_model, save_pretrained_checkpoint
    from veriroll.coordinator.trainer import build_optimizer

    source = cached_builtin_model()
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(source, torch_dtype=torch.float32)
    batch = tokenizer(TEXTS, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    dirs = {}
    for dtype in dtypes:
        dirs[(0.0, dtype)] = save_pretrained_checkpoint(model, source, work / f"base-{dtype}", dtype=torch_dtype[dtype])
    for lr in lrs:
        model.load_state_dict(before)
        optimizer = build_optimizer(model, TrainerConfig(lr=lr))
        t0 = time.perf_counter()
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        print(f"lr {lr:g}: one AdamW step, loss {loss.item():.3f}, {time.perf_counter() - t0:.1f} s")
        del optimizer
        for dtype in dtypes:
            dirs[(lr, dtype)] = save_pretrained_checkpoint(
                model, source, work / f"step-{lr:g}-{dtype}", dtype=torch_dtype[dtype]
            )
    return dirs


def measure_delta(work: Path, key, key_pub: Path, base: Path, stepped: Path) -> dict:
    from shardcast import start_relay, wait_up
    from veriroll.shardcast.fetch import fetch_version
    from veriroll.shardcast.publish import publish_checkpoint

    store = work / "store"
    publish_checkpoint(base, store, key, 1, link=True)
    published = publish_checkpoint(stepped, store, key, 2, link=True, delta_from=1)
    manifest = published.manifest
    covered = {p.shard for p in manifest.delta.pieces} if manifest.delta else set()
    shipped = published.delta_bytes + sum(s.size for s in manifest.shards if s.index not in covered)
    relay, url = start_relay(store, key_pub)
    try:
        wait_up(url)
        t0 = time.perf_counter()
        asyncio.run(fetch_version([url], key_pub, work / "node-v1", 1, progress=False, fsync=False))
        whole_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        result = asyncio.run(
            fetch_version([url], key_pub, work / "node-v2", 2, progress=False, fsync=False, bases=[work / "node-v1"])
        )
        rebuild_s = time.perf_counter() - t0
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=15)
    if result.delta_problems or result.bytes_shipped != shipped:
        raise RuntimeError(f"the rebuild did not go as published: {result.delta_problems}, {result.bytes_shipped}")
    for path in (store, work / "node-v1", work / "node-v2"):
        shutil.rmtree(path)
    return {
        "total_bytes": manifest.total_size,
        "delta_bytes": published.delta_bytes,
        "shipped_bytes": shipped,
        "delta_ratio": round(shipped / manifest.total_size, 4),
        "pieces": len(covered),
        "shards": len(manifest.shards),
        "delta_build_s": round(published.delta_seconds, 2),
        "whole_s": round(whole_s, 2),
        "rebuild_s": round(rebuild_s, 2),
    }


def tree_vs_direct(size_mib: int, clients: int, concurrency: int) -> dict:
    out = subprocess.run(
        [sys.executable, str(HERE / "shardcast.py"), "--skip-single", "--no-address-limits",
         "--size-mib", str(size_mib), "--clients", str(clients), "--client-concurrency", str(concurrency)],
        capture_output=True, text=True, timeout=1800, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def wan_tree_vs_direct(size_mib: int, clients: int, profile: str) -> dict:
    """Part 3: the tree against direct fetches with every host behind an emulated ``profile`` link."""
    out = subprocess.run(
        [sys.executable, str(HERE / "shardcast.py"), "--skip-single", "--no-address-limits",
         "--size-mib", str(size_mib), "--clients", str(clients), "--wan", profile],
        capture_output=True, text=True, timeout=3600, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


SWARM_SHARD_MIB = 4
"""Shards of the swarm run: a swarm trades pieces, so it needs many more shards than nodes (at the default
32 MiB a 64 MiB version is 2 shards, and 16 nodes could only all wait on the same two)."""


def swarm_over_wan(size_mib: int, clients: int, profile: str) -> dict:
    """The swarm's figures for part 3: ``time_to_95pct_s_swarm`` and ``origin_copies_swarm``.

    ``clients`` libp2p nodes (``shardcast.swarm.loopback.broadcast_over_swarm``, one process) fetch a
    ``size_mib`` checkpoint from an origin relay and from each other, every host behind a ``profile`` link
    (``veriroll.deploy.wan``, in this process): each node reaches the origin over its own link and the
    origin's; a peer is dialled through a proxy on the serving node's link (its upload, the bottleneck of
    a broadcast; the fetching node's download line is not applied to peer traffic, so with symmetric links
    this flatters the swarm a little, and with ``down`` > ``up`` not at all).
    """
    try:
        from veriroll.shardcast.swarm.loopback import broadcast_over_swarm
    except ImportError as exc:  # libp2p is the swarm extra: say why there is no swarm figure
        return {"swarm_skipped": f"the swarm is not importable: {exc}"}
    from shardcast import build_checkpoint, start_relay, wait_up
    from veriroll.deploy.wan import Link, Profile, Route, WanProxy, parse_profile
    from veriroll.protos.identity import load_public_key, write_keypair
    from veriroll.shardcast.publish import publish_checkpoint

    work = Path(tempfile.mkdtemp(prefix="broadcast-swarm-"))
    key = write_keypair(work / "coordinator.key", force=True)
    key_pub = work / "coordinator.key.pub"
    build_checkpoint(work / "ckpt", size_mib << 20)
    publish_checkpoint(work / "ckpt", work / "origin", key, 1, shard_size=SWARM_SHARD_MIB << 20)
    relay, origin_url = start_relay(work / "origin", key_pub, address_limits=False)
    link = parse_profile(profile)

    def port_of(url: str) -> tuple[str, int]:
        host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
        return host, int(port)

    async def run() -> dict:
        origin_link = Link(link)
        node_links = [Link(link) for _ in range(clients)]
        # Delay only, for the fetching side of a peer connection: the serving node's link carries the rate.
        far_end = Link(Profile(rtt_s=link.rtt_s))
        origin_routes = [Route(("127.0.0.1", 0), port_of(origin_url), client=node_links[i], server=origin_link)
                         for i in range(clients)]
        proxies = [WanProxy(origin_routes)]
        await proxies[0].start()

        async def peer_addr(i: int, addr: str) -> str:
            parts = addr.split("/")  # /ip4/HOST/tcp/PORT
            route = Route(("127.0.0.1", 0), (parts[2], int(parts[4])), client=far_end, server=node_links[i])
            proxy = WanProxy([route])
            await proxy.start()
            proxies.append(proxy)
            return f"/ip4/127.0.0.1/tcp/{route.port}"

        try:
            result = await broadcast_over_swarm(
                [[f"http://127.0.0.1:{r.port}"] for r in origin_routes], load_public_key(key_pub), 1, clients,
                work / "nodes", peer_addr=peer_addr, fsync=False)  # fmt: skip
        finally:
            for proxy in proxies:
                await proxy.stop()
        return {
            "time_to_95pct_s_swarm": round(result.time_to_fraction_s(0.95), 3),
            "time_to_100pct_s_swarm": round(max(result.completion_s), 3),
            "origin_copies_swarm": round(result.origin_copies, 3),
            "peer_copies_swarm": round(result.peer_bytes / result.version_bytes, 3),
            "bad_peers_swarm": result.bad_peers,
            "shard_mib_swarm": SWARM_SHARD_MIB,
        }

    try:
        wait_up(origin_url)
        return asyncio.run(run())
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.wait(timeout=15)
        shutil.rmtree(work, ignore_errors=True)


def swarm_adversity(size_mib: int = 16, nodes: int = 4) -> dict:
    """``bad_peer_detected`` and ``nat_nodes_served_peers``, on loopback.

    A liar (a swarm serving a copy with one byte flipped in every shard) is announced to ``nodes`` nodes
    fetching at once: detected when every node names it, none names anyone else, and every node's copy
    verified (the fetch checks every shard against the signed manifest and fails rather than install a
    bad one). Then a node with no inbound port (announced only at its circuit address through a swarm that
    relays) serves a whole version to another node: ``nat_nodes_served_peers`` counts such nodes that
    uploaded shards (1 of 1 here).
    """
    try:
        from veriroll.shardcast.swarm.hints import PeerHint, PeerHints
        from veriroll.shardcast.swarm.host import Swarm
    except ImportError as exc:
        return {"adversity_skipped": f"the swarm is not importable: {exc}"}
    from shardcast import build_checkpoint
    from veriroll.protos.identity import write_keypair
    from veriroll.shardcast.fetch import fetch_version
    from veriroll.shardcast.manifest import verify_manifest
    from veriroll.shardcast.publish import publish_checkpoint
    from veriroll.shardcast.relay import RelayServer
    from veriroll.shardcast.store import MANIFEST_NAME, version_dir

    work = Path(tempfile.mkdtemp(prefix="broadcast-adversity-"))
    key = write_keypair(work / "coordinator.key", force=True)
    build_checkpoint(work / "ckpt", size_mib << 20)
    publish_checkpoint(work / "ckpt", work / "origin", key, 1, shard_size=1 << 20)
    held = version_dir(work / "origin", 1)
    manifest = verify_manifest((held / MANIFEST_NAME).read_bytes(), key.public)
    liar_dir = work / "liar"
    shutil.copytree(held, liar_dir)
    for shard in manifest.shards:
        with open(liar_dir / shard.file, "r+b") as f:
            f.seek(shard.offset + 7)
            byte = f.read(1)
            f.seek(shard.offset + 7)
            f.write(bytes([byte[0] ^ 0xFF]))
    loopback = "/ip4/127.0.0.1/tcp/0"
    opts = {"progress": False, "fsync": False}

    async def liar_run() -> dict:
        liar = Swarm(listen=loopback)
        swarms = [Swarm(listen=loopback) for _ in range(nodes)]
        async with RelayServer(work / "origin", key.public, port=0) as origin:
            try:
                for sw in (liar, *swarms):
                    await sw.start()
                liar.serve(liar_dir, manifest)
                hints = PeerHints(1, tuple(PeerHint(sw.peer_id, tuple(sw.addrs), (1,)) for sw in (liar, *swarms)))
                for sw in swarms:
                    sw.announce(hints)
                results = await asyncio.gather(*(fetch_version([origin.url], key.public, work / f"node-{i}", 1,
                                                               swarm=sw, **opts) for i, sw in enumerate(swarms)),
                                               return_exceptions=True)
            finally:
                for sw in (liar, *swarms):
                    await sw.stop()
        named = [{bad.relay for bad in r.bad_peers} for r in results if not isinstance(r, BaseException)]
        failed = [repr(r)[:200] for r in results if isinstance(r, BaseException)]
        # What each node installed, byte for byte against the checkpoint that was published.
        good = (work / "ckpt" / "model.safetensors").read_bytes()
        bad_installs = sum((work / f"node-{i}" / "model.safetensors").read_bytes() != good for i in range(nodes)
                           if not isinstance(results[i], BaseException))
        return {"bad_peer_detected": not failed and not bad_installs and all(n == {liar.peer_id} for n in named),
                "nodes_naming_the_bad_peer": sum(n == {liar.peer_id} for n in named),
                "nodes_installed_bad_version": bad_installs, "fetch_failures": failed}

    async def nat_run() -> dict:
        relay, natted, node = Swarm(listen=loopback, relay=True), Swarm(listen=loopback), Swarm(listen=loopback)
        async with RelayServer(work / "origin", key.public, port=0) as origin:
            try:
                for sw in (relay, natted, node):
                    await sw.start()
                natted.serve(held, manifest)
                circuit = await natted.reserve(relay.peer_id, relay.addrs[0])
                node.announce(PeerHints(1, (PeerHint(natted.peer_id, (circuit,), (1,)),)))
                result = await fetch_version([origin.url], key.public, work / "via-circuit", 1, swarm=node, **opts)
            finally:
                for sw in (relay, natted, node):
                    await sw.stop()
        return {"nat_nodes_served_peers": int(natted.bytes_served > 0), "nat_nodes": 1,
                "nat_bytes_served": natted.bytes_served, "nat_version_bytes": result.manifest.total_size}

    try:
        return {**asyncio.run(liar_run()), **asyncio.run(nat_run())}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tree at 64 MiB and 4 clients, the WAN at 64 MiB")
    ap.add_argument("--lr", type=float, action="append", help="learning rates (default 1e-6 and 1e-5)")
    ap.add_argument("--wan", default="rtt=100ms,down=100mbit,up=100mbit", help="every host's emulated link in part 3")
    ap.add_argument("--swarm", action="store_true", help="part 3 with the libp2p swarm too (when importable)")
    ap.add_argument("--skip-deltas", action="store_true", help="leave out part 1 (the real model's deltas)")
    args = ap.parse_args()
    lrs = args.lr or [1e-6, 1e-5]
    dtypes = ["float32", "bfloat16"]
    size_mib, clients = (64, 4) if args.quick else (256, 16)
    wan_mib, wan_clients = (64, 16) if args.quick else (256, 16)

    from veriroll.protos.identity import write_keypair

    work = Path(tempfile.mkdtemp(prefix="broadcast-bench-"))
    try:
        key = write_keypair(work / "coordinator.key", force=True)
        key_pub = work / "coordinator.key.pub"
        dirs = {} if args.skip_deltas else step_checkpoints(work, lrs, dtypes)
        deltas = {}
        for lr in lrs if dirs else []:
            for dtype in dtypes:
                row = measure_delta(work, key, key_pub, dirs[(0.0, dtype)], dirs[(lr, dtype)])
                deltas[f"{dtype}_lr{lr:g}"] = row
                print(f"{dtype} lr {lr:g}: ships {row['shipped_bytes'] / 2**20:.1f} of {row['total_bytes'] / 2**20:.1f} "
                      f"MiB (ratio {row['delta_ratio']:.3f}, {row['pieces']}/{row['shards']} shards as pieces); "
                      f"delta built in {row['delta_build_s']} s; fetch whole {row['whole_s']} s, rebuilt "
                      f"{row['rebuild_s']} s")  # fmt: skip
        shutil.rmtree(work)
        trees = {}
        for concurrency in (8, 2):
            tree = trees[concurrency] = tree_vs_direct(size_mib, clients, concurrency)
            print(f"tree (streaming mirrors) {tree['tree_s']} s vs direct {tree['direct_s']} s for {clients} clients, "
                  f"{size_mib} MiB, {concurrency} shards at once per client; origin copies "
                  f"{tree['origin_copies_tree']} vs {tree['origin_copies_direct']}")  # fmt: skip
        tree = trees[8]
        wan = wan_tree_vs_direct(wan_mib, wan_clients, args.wan)
        print(f"over the WAN ({args.wan}), {wan_clients} clients, {wan_mib} MiB: 95 % of clients hold it after "
              f"{wan['time_to_95pct_s_tree']} s through the tree, {wan['time_to_95pct_s_direct']} s direct; origin "
              f"copies {wan['origin_copies_tree']} vs {wan['origin_copies_direct']}")  # fmt: skip
        swarm = swarm_over_wan(wan_mib, wan_clients, args.wan) if args.swarm else {}
        if args.swarm:
            swarm.update(swarm_adversity())
        if swarm:
            print(f"swarm: {swarm}")
        print(
            json.dumps(
                {
                    "delta_ratio": {k: v["delta_ratio"] for k, v in deltas.items()},
                    "rebuild_s": {k: v["rebuild_s"] for k, v in deltas.items()},
                    "whole_s": {k: v["whole_s"] for k, v in deltas.items()},
                    "tree_s": tree["tree_s"],
                    "direct_s": tree["direct_s"],
                    "origin_copies_tree": tree["origin_copies_tree"],
                    "origin_copies_direct": tree["origin_copies_direct"],
                    "tree_s_2_streams": trees[2]["tree_s"],
                    "direct_s_2_streams": trees[2]["direct_s"],
                    "tree_size_mib": size_mib,
                    "wan": {
                        "profile": args.wan, "size_mib": wan_mib, "clients": wan_clients,
                        **{k: v for k, v in wan.items() if k.startswith(("time_to_", "origin_copies_"))},
                        **swarm,
                    },
                    "time_to_95pct_s": {"tree": wan["time_to_95pct_s_tree"], "direct": wan["time_to_95pct_s_direct"],
                                        **({"swarm": swarm["time_to_95pct_s_swarm"]} if "time_to_95pct_s_swarm" in swarm else {})},
                    "origin_copies": {"tree": wan["origin_copies_tree"], "direct": wan["origin_copies_direct"],
                                      **({"swarm": swarm["origin_copies_swarm"]} if "origin_copies_swarm" in swarm else {})},
                    "tree_clients": clients,
                    **{k: swarm[k] for k in ("bad_peer_detected", "nat_nodes_served_peers") if k in swarm},
                    "deltas": deltas,
                    "model": "smollm2-135m-instruct",
                    "cpus": os.cpu_count(),
                }
            )
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
