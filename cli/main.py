"""The ``veriroll`` command: one entry point, each part registers its own subcommands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def cmd_keygen(args) -> int:
    from veriroll.node.config import default_key_path
    from veriroll.protos.identity import KeyFileError, load_private_key, write_keypair

    out = Path(args.out).expanduser() if args.out else default_key_path()
    if args.show:
        try:
            key = load_private_key(out, owner_only=True)
        except KeyFileError as exc:
            print(f"{exc}\n  → {exc.fix}" if exc.fix else exc, file=sys.stderr)
            return 1
        print(key.node_id)
        return 0
    try:
        key = write_keypair(out, force=args.force)
    except KeyFileError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(key.node_id)
    used = ("every `veriroll node` command uses it when --key is left out" if out == default_key_path() else
            f"pass it to `veriroll node` commands with --key {out} (or set VERIROLL_NODE_KEY={out})")
    print(f"wrote {out} (keep it safe: it is your node's identity and history) and {out}.pub; {used}", file=sys.stderr)
    return 0


class ShowVersion(argparse.Action):
    """``--version``: computed only when asked (it reads every installed package's metadata)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from veriroll.node.install import version_text

        print(version_text())
        parser.exit()


def _make_adversary(kind: str):
    """TESTING ONLY: ``veriroll node run --adversary KIND``'s adversary, from the test network's side (the node
    package ships none); imported only when a node is started as one."""
    from veriroll.deploy.adversary import make_adversary

    return make_adversary(kind)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="veriroll", description="verifiable asynchronous RL on untrusted hardware")
    parser.add_argument("--version", action=ShowVersion, help="print veriroll's and torch's versions, and what to "
                        "run if that torch build does not fit this machine")
    sub = parser.add_subparsers(dest="command", required=True)

    k = sub.add_parser("keygen", help="create an Ed25519 key (PATH, PATH.pub) and print its node id")
    k.add_argument("--out", help="private key path (default: $VERIROLL_NODE_KEY, else ~/.config/veriroll/node.key, "
                                 "which every `veriroll node` command reads when --key is left out)")
    k.add_argument("--force", action="store_true", help="overwrite an existing key (its identity is lost)")
    k.add_argument("--show", action="store_true", help="print the node id of the existing key at --out")
    k.set_defaults(func=cmd_keygen)

    # Every subcommand is first-party and shipped in the same wheel (none needs an optional extra), so
    # they are imported unconditionally: a broken install fails loudly here instead of losing commands.
    from veriroll.coordinator.cli import register as register_coordinator
    from veriroll.coordinator.plan import register as register_plan
    from veriroll.deploy.testnet import register as register_testnet
    from veriroll.node.cli import register as register_node
    from veriroll.shardcast.cli import register as register_shardcast

    register_coordinator(sub)
    register_node(sub, make_adversary=_make_adversary)
    register_shardcast(sub)
    register_testnet(sub)
    register_plan(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C before a command has its own stop handling (imports): no traceback
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
