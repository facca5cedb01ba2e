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
while it still runs, and :func:`leave_on_signals` once it has closed: from then on one more stop signal
leaves the process at once, quietly.
"""

from __future__ import annotations

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


def release_signals(handler: Callable = leave_now) -> None:
    """Give SIGINT and SIGTERM to ``handler`` and clear the signal wakeup fd (the loop's self-pipe, about to
    be closed). Off the main thread, where no loop could take them either, nothing changes.

    The process-level handler stays installed throughout: only the Python-level one changes. Removing the
    loop's handlers (``loop.remove_signal_handler``) instead resets each signal to its default first, and a
    SIGTERM in that instant ended the process by the signal (status -15; seen when a second signal followed
    the first closely), a SIGINT raised KeyboardInterrupt. The loop keeps its record of them and resets both
    to their defaults when it closes: the command sets ``handler`` again once its loop is closed
    (:func:`leave_on_signals`)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)
    signal.set_wakeup_fd(-1)


def leave_on_signals(handler: Callable = leave_now) -> None:
    """SIGINT and SIGTERM to ``handler`` (once a command's event loop has closed)."""
    if threading.current_thread() is threading.main_thread():
        for sig in STOP_SIGNALS:
            signal.signal(sig, handler)


async def then_release_signals(main: Awaitable[T], handler: Callable = leave_now) -> T:
    """``await main``; then, however it ended and while its loop still runs, :func:`release_signals`. For a
    command's entry point (``asyncio.run(then_release_signals(serve()))``, then :func:`leave_on_signals`),
    not for a library call: the process's stop signals keep ``handler`` afterwards."""
    try:
        return await main
    finally:
        release_signals(handler)
