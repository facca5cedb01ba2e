"""The ``veriroll`` command: one entry point, each part registers its own subcommands."""

from __future__ import annotations

import argparse
import os
import sys


def cmd_keygen(args) -> int:
    from veriroll.protos.identity import KeyFileError, load_private_key, write_keypair

    if args.show:
        try:
            key = load_private_key(args.out)
        except KeyFileError as exc:
            print(exc, file=sys.stderr)
            return 1
        print(key.node_id)
        return 0
    try:
        key = write_keypair(args.out, force=args.force)
    except KeyFileError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(key.node_id)
    print(f"wrote {args.out} (keep it safe: it is your node's identity and history) and {args.out}.pub", file=sys.stderr)
    return 0


class ShowVersion(argparse.Action):
    """``--version``: computed only when asked (it reads every installed package's metadata)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from veriroll.cli.install import version_text

        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="veriroll", description="verifiable asynchronous RL on untrusted hardware")
    parser.add_argument("--version", action=ShowVersion, help="print veriroll's and torch's versions, and what to "
                        "run if that torch build does not fit this machine")
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("keygen", help="create an Ed25519 key (PATH, PATH.pub) and print its node id")
    k.add_argument("--out", default=os.path.expanduser("~/.config/veriroll/node.key"), help="private key path")
    k.add_argument("--force", action="store_true", help="overwrite an existing key (its identity is lost)")
    k.add_argument("--show", action="store_true", help="print the node id of the existing key at --out")
    k.set_defaults(func=cmd_keygen)

    # Every subcommand is first-party and shipped in the same wheel (none needs an optional extra), so
    # they are imported unconditionally: a broken install fails loudly here instead of losing commands.
    from veriroll.coordinator.cli import register as register_coordinator
    from veriroll.deploy.testnet import register as register_testnet
    from veriroll.node.cli import register as register_node
    from veriroll.shardcast.cli import register as register_shardcast

    register_coordinator(sub)
    register_node(sub)
    register_shardcast(sub)
    register_testnet(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
