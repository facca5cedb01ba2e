"""Stop signals at the end of a process's event loop, shared by every long-running command (coordinator,
node, relay, WAN proxy).

While a command serves, its event loop takes SIGINT and SIGTERM (``loop.add_signal_handler``) and stops
cleanly. Once its main coroutine is over, ``asyncio.run`` still has work left that no handler of the
command's can cut short: it cancels the tasks left and waits for them, and waits, without a time limit on
Python 3.11, for every thread of the loop's default executor (a file open on a hung mount, a blocked
``to_thread`` call). A stop signal then only set an event nobody waited for any more: the process did not
stop. And asyncio closes a loop's self-pipe, its signal wakeup fd, before it removes its signal handlers: a
signal in between had the interpreter print "Exception ignored when trying to write to the signal wakeup
fd: ... Bad file descriptor" with a traceback.

:func:`then_release_signals` runs the main coroutine and, however it ends, takes both signals from the loop
while it still runs (the loop forgets them, so its close leaves them alone): from then on one more stop
signal leaves the process at once, quietly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def leave_now(_signum=None, _frame=None) -> None:
    """The handler once the event loop's work is over: a stop signal then means leave now (status 0)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(0)


def release_signals(handler: Callable = leave_now, loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Give SIGINT and SIGTERM to ``handler`` and make the running loop (or ``loop``) forget them, so that it
    neither writes them to its self-pipe (asyncio closes that before it removes its handlers) nor resets
    them to their defaults when it closes. Off the main thread, where no loop could take them, nothing changes.

    ``handler`` goes in first: only the Python-level handler changes, so a signal from here on is
    ``handler``'s. Removing the loop's handler then resets the signal to its default for the few
    microseconds until ``handler`` is set again; signals are not held back meanwhile, since a blocked main
    thread only diverts a signal to another thread, where its default action applies (seen: a SIGTERM so
    diverted ended the process, status -15, in 1 of 3 runs of a test whose second signal closely followed
    the first). Leaving the loop its handlers instead (set only ours) let its close reset them: a second
    Ctrl-C right after then raised KeyboardInterrupt (status -2, seen once in the suite). For SIGINT the
    removal's default is Python's ``default_int_handler``, which only raises KeyboardInterrupt in this
    thread: caught here and handed to ``handler`` (seen again, -2, once in the suite before that). For
    SIGTERM the microseconds of SIG_DFL remain."""
    if threading.current_thread() is not threading.main_thread():
        return
    loop = loop or asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
        try:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)  # the last one removed also clears asyncio's wakeup fd
            signal.signal(sig, handler)
        except KeyboardInterrupt:
            # A SIGINT in the instant the removal left Python's default_int_handler in place (it is a
            # Python-level handler: the signal was only noted, and raised here): it is ``handler``'s signal.
            signal.signal(sig, handler)
            handler(signal.SIGINT, None)


def leave_on_signals(handler: Callable = leave_now) -> None:
    """SIGINT and SIGTERM to ``handler`` (where no event loop has them: before one runs, after it closed)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)


async def then_release_signals(main: Awaitable[T], handler: Callable = leave_now) -> T:
    """``await main``; then, however it ended and while its loop still runs, :func:`release_signals`. For a
    command's entry point (``asyncio.run(then_release_signals(serve()))``), not for a library call: the
    process's stop signals keep ``handler`` afterwards."""
    try:
        return await main
    finally:
        release_signals(handler)
