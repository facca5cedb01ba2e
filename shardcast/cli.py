"""The ``veriroll shardcast`` and ``veriroll relay`` commands.

::

    veriroll shardcast publish CHECKPOINT_DIR --store STORE --key COORDINATOR_KEY --version N
                               [--shard-size BYTES] [--keep K] [--link]
    veriroll shardcast fetch --relay URL [--relay URL ...] --coordinator-key KEY.pub --out DIR
                             [--version N|latest] [--min-version N] [--concurrency C] [--timeout S]
    veriroll relay run --store DIR --port P --coordinator-key KEY.pub [--upstream URL ...]
                       [--host 127.0.0.1] [--keep K] [--poll-interval S] [--idle-timeout S]
                       [--max-connections N] [--max-connections-per-address N]
                       [--max-transfers N] [--max-transfers-per-address N]

``fetch`` exits 0 only with a complete, verified checkpoint in DIR. Other exit statuses: 3 no relay
reachable, 4 bad signature (or unreadable key), 5 version gone everywhere, 6 disk full, 7 a shard
could not be obtained intact, 8 invalid manifest, 9 publish failed, 10 output directory not ours,
1 anything else, 2 usage. ``relay run`` stops on SIGTERM or SIGINT within seconds and exits 0.
``register(subparsers)`` adds both commands to the main ``veriroll`` parser;
``python -m veriroll.shardcast.cli ...`` runs them standalone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from veriroll.protos.descriptors import raise_descriptor_limit
from veriroll.protos.signals import then_release_signals

from . import relay
from .errors import ShardcastError, exit_code_of
from .manifest import DEFAULT_SHARD_SIZE


def _size(text: str) -> int:
    """Bytes, with an optional K/M/G suffix (binary): 32M = 33554432."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 33554432 or 32M)") from exc


def _version(text: str) -> int | str:
    if text == "latest":
        return text
    if text.isdigit():
        return int(text)
    raise argparse.ArgumentTypeError(f"a version is a non-negative integer or 'latest', got {text!r}")


def _fail(exc: BaseException) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return exit_code_of(exc)


def cmd_publish(args: argparse.Namespace) -> int:
    from .publish import publish_checkpoint

    try:
        result = publish_checkpoint(
            args.checkpoint_dir,
            args.store,
            args.key,
            args.version,
            shard_size=args.shard_size,
            keep=args.keep,
            link=args.link,
            delta_from=args.delta_from,
        )
    except (ShardcastError, OSError) as exc:
        return _fail(exc)
    print(
        json.dumps(
            {
                "version": result.version,
                "path": str(result.path),
                "files": len(result.manifest.files),
                "shards": len(result.manifest.shards),
                "bytes": result.total_bytes,
                "delta_bytes": result.delta_bytes,
                "seconds": round(result.seconds, 3),
                "removed_versions": result.removed_versions,
            }
        )
    )
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    from .fetch import fetch_version

    try:
        result = asyncio.run(
            fetch_version(
                args.relay,
                args.coordinator_key,
                args.out,
                args.version,
                min_version=args.min_version,
                concurrency=args.concurrency,
                read_timeout=args.timeout,
                progress=None if not args.quiet else False,
                bases=args.base,
            )
        )
    except (ShardcastError, OSError) as exc:
        return _fail(exc)
    for incident in result.bad_relays:
        print(
            f"warning: relay {incident.relay} served bad data ({incident.kind}, shard {incident.shard}): "
            f"{incident.detail}",
            file=sys.stderr,
        )
    print(
        json.dumps(
            {
                "version": result.version,
                "path": str(result.path),
                "already_present": result.already_present,
                "bytes_downloaded": result.bytes_downloaded,
                "bytes_reused": result.bytes_reused,
                "delta_bytes": result.delta_bytes,
                "shards_rebuilt": result.shards_rebuilt,
                "delta_problems": result.delta_problems,
                "seconds": round(result.seconds, 3),
                "bad_relays": sorted(result.bad_relay_urls),
            }
        )
    )
    return 0


async def _relay_with_circuits(listen: str, serve) -> None:
    """``serve()`` (the HTTP relay, until a signal) beside a libp2p swarm that carries circuits for nodes
    with no inbound port (circuit relay v2): they reserve a slot on it (node config ``swarm_relays``)."""
    # The swarm extra: without libp2p an ImportError stops the relay at start.
    from .swarm.host import Swarm

    swarm = Swarm(listen=listen, relay=True)
    await swarm.start()
    try:
        for addr in swarm.addrs:
            print(f"circuit relay at {addr}/p2p/{swarm.peer_id}", flush=True)
        await serve()
    finally:
        await swarm.stop()


def cmd_relay_run(args: argparse.Namespace) -> int:
    try:
        config = relay.relay_config_from_args(args, port=args.port)
    except relay.RelayConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def serve():
        return relay.serve_relay(args.store, args.coordinator_key, config)

    raise_descriptor_limit()  # before the relay fits max_connections to the limit (systemd's soft 1,024)
    try:
        main = _relay_with_circuits(config.swarm_listen, serve) if config.swarm_listen else serve()
        asyncio.run(then_release_signals(main))  # once serving is over, one more signal leaves at once
    except ImportError as exc:
        print(f"error: --swarm-listen needs libp2p: pip install 'veriroll[swarm]' ({exc})", file=sys.stderr)
        return 2
    except (ShardcastError, OSError) as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        return 0
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``shardcast`` and ``relay`` commands to the main CLI's subparsers."""
    sc = subparsers.add_parser("shardcast", help="publish and fetch signed, sharded checkpoints")
    sc_sub = sc.add_subparsers(dest="shardcast_command", required=True, metavar="{publish,fetch}")

    p = sc_sub.add_parser("publish", help="publish a checkpoint directory into a store as a signed version")
    p.add_argument("checkpoint_dir", metavar="CHECKPOINT_DIR", help="HF checkpoint directory")
    p.add_argument("--store", required=True, help="store directory a relay serves (created if missing)")
    p.add_argument("--key", required=True, help="coordinator private key file (PEM)")
    p.add_argument("--version", required=True, type=int, help="version number (integer, new to the store)")
    p.add_argument(
        "--shard-size", type=_size, default=DEFAULT_SHARD_SIZE, help="bytes per shard (default 32M)"
    )
    p.add_argument("--keep", type=int, default=3, help="versions to keep in the store (default 3)")
    p.add_argument("--link", action="store_true", help="hard-link files into the store instead of copying")
    p.add_argument("--delta-from", type=int, default=None, metavar="VERSION",
                   help="also publish a delta against this older version of the store")  # fmt: skip
    p.set_defaults(func=cmd_publish)

    f = sc_sub.add_parser("fetch", help="fetch and verify a checkpoint version from relays")
    f.add_argument("--relay", action="append", required=True, metavar="URL", help="relay URL (repeatable)")
    f.add_argument("--coordinator-key", required=True, metavar="KEY.pub", help="coordinator public key file")
    f.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to create or replace")
    f.add_argument("--version", type=_version, default="latest", help="version number or 'latest' (default)")
    f.add_argument("--min-version", type=int, default=None, help="with 'latest': refuse anything older")
    f.add_argument("--concurrency", type=int, default=8, help="shards downloaded at once (default 8)")
    f.add_argument("--timeout", type=float, default=20.0, help="seconds a relay may stay silent (default 20)")
    f.add_argument("--quiet", action="store_true", help="no progress bar even on a terminal")
    f.add_argument("--base", action="append", default=[], metavar="DIR",
                   help="a checkpoint fetched before: rebuild from it where the version has a delta (repeatable)")  # fmt: skip
    f.set_defaults(func=cmd_fetch)

    r = subparsers.add_parser("relay", help="run a shardcast relay")
    r_sub = r.add_subparsers(dest="relay_command", required=True, metavar="{run}")
    run = r_sub.add_parser("run", help="serve a store (origin) or mirror upstream relays")
    run.add_argument("--store", required=True, help="directory of versions to serve or mirror into")
    run.add_argument("--port", type=int, required=True, help="TCP port (0: any free port)")
    run.add_argument(
        "--coordinator-key", required=True, metavar="KEY.pub", help="coordinator public key file"
    )
    relay.add_relay_flags(run)  # every other flag: one per RelayConfig field (shardcast/relay/config.py)
    run.set_defaults(func=cmd_relay_run)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m veriroll.shardcast.cli shardcast fetch ...``."""
    parser = argparse.ArgumentParser(prog="veriroll")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress and decisions")
    subparsers = parser.add_subparsers(dest="command", required=True)
    register(subparsers)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
