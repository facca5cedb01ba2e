"""Publishing policy versions: the coordinator's origin relay and ``publish_version``.

At start the origin relay (a shardcast :class:`RelayServer` over ``shardcast.store``) comes up and the
current policy version is published if the store lacks it. The trainer calls
``coord.publish_version(v)`` after installing each new version; publishing (hashing, copying,
signing, and the delta against the previous version) runs in a worker thread. Nodes learn the relay
list and the manifest path via GetPolicy.
"""

from __future__ import annotations

import asyncio
import logging

from veriroll.coordinator import store as st
from veriroll.protos.config import resolve_path
from veriroll.protos.identity import PrivateKey
from veriroll.shardcast.publish import publish_checkpoint
from veriroll.shardcast.relay import RelayConfig, RelayServer
from veriroll.shardcast.store import list_versions

log = logging.getLogger("veriroll.coordinator.publisher")

ANNOUNCEMENT_KEY = "policy_announcement"
"""kv key of the newest published version, its manifest path and the relays that serve it."""


async def start_publisher(coord, key: PrivateKey) -> None:
    cfg = coord.cfg.shardcast
    store = resolve_path(coord.base_dir, cfg.store)
    store.mkdir(parents=True, exist_ok=True)
    budget = coord.descriptors
    shares = {} if budget is None else {"max_connections": budget.origin_connections,
                                        "max_transfers": budget.origin_transfers}
    relay = RelayServer(store, key.public, RelayConfig(
        host=coord.cfg.server.host, port=cfg.origin_port, keep=cfg.keep_versions, **shares,
        max_transfers_per_address=cfg.max_transfers_per_address or None,
        max_connections_per_address=cfg.max_connections_per_address or None))
    await relay.start()
    coord.origin_url = cfg.origin_url or relay.url
    coord.closers.append(relay.stop)
    lock = asyncio.Lock()

    async def publish_version(version: int) -> None:
        async with lock:
            if version in list_versions(store):
                return
            src = coord.policy_store.version_dir(version)
            # Also as a delta against the newest version published before it: nodes that hold that one
            # fetch a fraction of the bytes (shardcast/delta.py).
            older = [v for v in list_versions(store) if v < version]
            # Hard links, not copies: installed versions are never modified in place.
            result = await asyncio.to_thread(publish_checkpoint, src, store, key, version, shard_size=cfg.shard_bytes,
                                             keep=cfg.keep_versions, link=True,
                                             delta_from=older[-1] if older and cfg.deltas else None)
            relay.refresh(force=True)
            coord.service.policy.manifest_path = f"/versions/{version}/manifest"
            # Edge processes (role 'edge') read where the version is announced from the store.
            announcement = {"version": version, "manifest_path": coord.service.policy.manifest_path,
                            "relays": list(coord.service.policy.relays)}
            await coord.db.run(lambda c: st.kv_set(c, ANNOUNCEMENT_KEY, announcement))
            log.info("published version %d (%d bytes, delta %d bytes, in %.2fs)", version, result.total_bytes,
                     result.delta_bytes, result.seconds)

    coord.publish_version = publish_version
    # Announce configured relays first (they exist to take load off the origin), the origin last.
    coord.service.policy.relays = [*cfg.relays, coord.origin_url]
    await publish_version(coord.service.policy.version)
