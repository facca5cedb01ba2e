"""The mistakes of a volunteer's first hour (issue 15), each as a real ``veriroll`` command line.

Every one must end at once, exit code 2, with a message that names the fix: ``node run`` and
``node credits`` check what the doctor checks before their first call. The tests run them all
(tests/node/test_first_run_mistakes.py), and so does ``benchmarks/first_run.py``, which counts those
that end within its time limit with the fix in their output::

    setup = MistakeSetup(work=tmp, coordinator="127.0.0.1:50051", ca=base / "tls" / "ca.crt",
                         not_grpc_port=dashboard_port, other_ca=some_other_ca, key=node_key)
    for name, argv, fix in MISTAKES:
        done = subprocess.run(["veriroll", *argv(setup)], capture_output=True, text=True, timeout=60)
        # done.returncode == EXIT_CODE and fix in done.stderr
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

EXIT_CODE = 2  # a mistake that no retry fixes


@dataclass(frozen=True)
class MistakeSetup:
    """What the command lines are made from: a running TLS coordinator, and files around it."""

    work: Path  # a scratch folder; each mistake writes what it needs here
    coordinator: str  # HOST:PORT of the coordinator's gRPC server
    ca: Path  # the coordinator's CA certificate
    not_grpc_port: int  # a port on the same host that answers, but not gRPC (the dashboard)
    other_ca: Path  # the CA certificate of another coordinator
    key: Path  # a good node key (0600), with its .pub beside it


class Mistake(NamedTuple):
    name: str
    argv: Callable[[MistakeSetup], list[str]]  # the arguments after ``veriroll``
    fix: str  # words of the fix the output must contain


def _run(s: MistakeSetup, *, coordinator: str | None = None, ca: str | None = "", key: Path | None = None) -> list[str]:
    """``node run`` with the setup's values, except those given (``ca=""``: the setup's; ``None``: no ``--ca``)."""
    argv = ["node", "run", "--coordinator", coordinator or s.coordinator, "--key", str(key or s.key),
            "--cache-dir", str(s.work / "cache"), "--engine", "torch", "--threads", "1"]
    if ca is not None:
        argv += ["--ca", ca or str(s.ca)]
    return argv


def _garbage_ca(s: MistakeSetup) -> list[str]:
    path = s.work / "garbage.crt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("this is not a certificate\n")
    return _run(s, ca=str(path))


def _exposed_key(s: MistakeSetup) -> list[str]:
    path = s.work / "exposed" / "node.key"
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(s.key, path)
    os.chmod(path, 0o644)
    return _run(s, key=path)


def _host(s: MistakeSetup) -> str:
    return s.coordinator.rpartition(":")[0]


MISTAKES: list[Mistake] = [
    Mistake("another coordinator's CA", lambda s: _run(s, ca=str(s.other_ca)), "get the current ca.crt"),
    Mistake("a CA file that is not a certificate", _garbage_ca, "get the CA certificate (ca.crt, PEM)"),
    Mistake("a --ca file that does not exist", lambda s: _run(s, ca=str(s.work / "missing" / "ca.crt")),
            "get ca.crt from the coordinator's operator"),
    Mistake("no --ca against a TLS coordinator", lambda s: _run(s, ca=None), "--ca ca.crt"),
    Mistake("the dashboard's port instead of the gRPC port",
            lambda s: _run(s, coordinator=f"{_host(s)}:{s.not_grpc_port}"), "the coordinator's gRPC port"),
    Mistake("an address without a port", lambda s: _run(s, coordinator=_host(s)), "with the gRPC port the operator gave you"),
    Mistake("the .pub file as the key", lambda s: _run(s, key=Path(f"{s.key}.pub")), "pass the private key"),
    Mistake("a key file other users can read", _exposed_key, "chmod 600"),
    Mistake("`node credits` with no key file",
            lambda s: ["node", "credits", "--coordinator", s.coordinator, "--ca", str(s.ca),
                       "--key", str(s.work / "no-key" / "node.key")], "veriroll keygen"),
]
