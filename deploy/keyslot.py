"""Give each replica of a compose node service a key of its own that outlives its container.

    python -m veriroll.deploy.keyslot --dir /keys/node -- veriroll node run --coordinator ...

``docker compose up --scale node=N`` starts N identical containers. Their hostnames are container ids,
new after every ``docker compose down``, so a key named after the hostname would be a new identity each
time, with no credits. Instead each replica takes the first numbered slot (DIR/1, DIR/2, ...) that no
running replica holds, keeps an exclusive lock on DIR/K/lock for as long as its node runs (the lock is
handed to the node across ``exec``, so it is released only when the node exits), and runs the node with
the key in that slot, created on first use. N replicas hold slots 1..N between them: after a
``down``/``up`` the same N keys come back, and two running replicas never share one.

The lock is ``flock``: it holds between containers on one Docker host (one kernel, one local volume),
not across machines or on network filesystems that ignore it.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
from pathlib import Path

MAX_SLOTS = 4096


class SlotError(Exception):
    """No slot can be claimed; the message says why."""


def claim_slot(root: Path, max_slots: int = MAX_SLOTS) -> tuple[int, int]:
    """Lock the first free slot under ``root``; return its number and the open lock's file descriptor."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    for slot in range(1, max_slots + 1):
        folder = root / str(slot)
        folder.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        except OSError as exc:
            os.close(fd)
            raise SlotError(f"cannot lock {folder / 'lock'}: {exc} (the key volume must support flock, as a local "
                            "Docker volume does)") from exc
        return slot, fd
    raise SlotError(f"all {max_slots} key slots under {root} are held by running nodes")


def slot_command(command: list[str], root: Path, slot: int) -> list[str]:
    """``command`` (a ``veriroll node run``) with the key of ``slot``, created if missing, and a display name."""
    if "--key" in command:
        raise SlotError("the key comes from the slot: leave --key out of the node command")
    extra = ["--key", str(root / str(slot) / "node.key"), "--create-key"]
    if "--display-name" not in command:
        extra += ["--display-name", f"{root.name}-{slot}"]
    return [*command, *extra]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m veriroll.deploy.keyslot",
                                 description="run a node with the first free persistent key slot under DIR")
    ap.add_argument("--dir", required=True, type=Path, help="this service's folder on the shared key volume")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- veriroll node run ... (without --key)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print("keyslot: give the node command after --", file=sys.stderr)
        return 2
    try:
        slot, fd = claim_slot(args.dir)
        command = slot_command(command, args.dir, slot)
    except (SlotError, OSError) as exc:
        print(f"keyslot: {exc}", file=sys.stderr)
        return 2
    print(f"keyslot: slot {slot} of {args.dir}, key {args.dir / str(slot) / 'node.key'}", file=sys.stderr, flush=True)
    os.set_inheritable(fd, True)  # the node keeps the slot's lock for as long as it runs
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"keyslot: cannot run {command[0]}: {exc}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    raise SystemExit(main())
