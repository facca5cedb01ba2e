"""The event loop the coordinator serves on (``server.event_loop``).

uvloop (libuv) runs the same asyncio code with cheaper loop machinery: scheduling a task step, a
thread's ``call_soon_threadsafe`` (every store commit answers through one), timers and the selector.
Measured on this 2-core machine (benchmarks/intake.py's load on one SQLite coordinator, asyncio and uvloop
alternating, the clients on asyncio): 354-396 -> 412-499 accepted groups/s in one session of runs, 471-533 ->
463-617 (means 500 -> 534) in a later one; CPU per group 2.05-2.91 -> 1.76-2.62 ms (-5 to -10% on average).
A bare insecure grpc.aio echo: ~2,700 -> ~3,100 calls/s. ``auto`` takes it where it is installed (it is a dependency on
Linux and macOS) and says at start which loop runs.

Seen with uvloop 0.23: once it has run in a process, one write of more than a pipe's 64 KiB to stdout can
come back short and ``sys.stdout.write`` drops the rest without an error. The coordinator writes log
lines, far below that; a process that hands a large result to its parent over a pipe writes it with
``os.write`` until all is out (benchmarks/scale.py's client processes).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, get_args

from veriroll.coordinator.config import EventLoop
from veriroll.protos.config import ConfigError

EVENT_LOOPS = get_args(EventLoop)


def loop_runner(choice: str) -> tuple[str, Callable[[Coroutine], Any], str]:
    """(the loop's name, a function that runs a coroutine on a new loop of it, why this one)."""
    if choice not in EVENT_LOOPS:
        raise ConfigError(f"server.event_loop: {choice!r} is not one of {', '.join(EVENT_LOOPS)}")
    if choice == "asyncio":
        return "asyncio", asyncio.run, "server.event_loop = 'asyncio'"
    try:
        import uvloop
    except ImportError as exc:
        if choice == "uvloop":
            raise ConfigError(f"server.event_loop = 'uvloop', but uvloop cannot be imported ({exc}); install it "
                              f"(pip install uvloop) or set server.event_loop = 'asyncio'") from exc
        return "asyncio", asyncio.run, f"uvloop cannot be imported here ({exc})"
    return "uvloop", uvloop.run, f"server.event_loop = {choice!r}"
