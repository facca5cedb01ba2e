"""Stop signals once a command's event loop has served (protos/signals.py): the loop hands SIGINT and SIGTERM
back before it closes, and one more signal leaves at once, even while ``asyncio.run`` waits on a thread that
never ends. On both event loops the coordinator can run (asyncio's and uvloop's)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from veriroll.coordinator.event_loop import loop_runner
from veriroll.protos.signals import STOP_SIGNALS, release_signals, then_release_signals

LOOPS = ["asyncio", "uvloop"]

# A command as the coordinator's, the relay's and the WAN proxy's: the loop takes the signals while it serves;
# after it, asyncio.run waits for a default-executor thread that never ends (a file open on a hung mount).
STUCK_AFTER_SERVING = r'''
import asyncio, signal, sys, threading
from veriroll.coordinator.event_loop import loop_runner
from veriroll.protos.signals import then_release_signals

async def serve():
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    loop.run_in_executor(None, threading.Event().wait)  # never returns
    print("serving", flush=True)
    await stop.wait()
    print("stopped serving", flush=True)
    return 0

main = serve() if sys.argv[2] == "bare" else then_release_signals(serve())
loop_runner(sys.argv[1])[1](main)
'''


@pytest.mark.parametrize("loop", LOOPS)
def test_the_loop_hands_the_signals_over_before_it_closes(loop):
    """Once the main coroutine is over, while the loop still runs: both signals go to the given handler, no
    asyncio wakeup fd is left for a signal to be written to (the self-pipe, which asyncio closes first), and
    closing the loop leaves them with the handler."""
    seen = []
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    def handler(signum, _frame):
        seen.append(signum)

    async def serve():
        running = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            running.add_signal_handler(sig, lambda: None)
        return "served"

    async def command():
        served = await then_release_signals(serve(), handler)
        wakeup = signal.set_wakeup_fd(-1)
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs at the interpreter's next check
            if seen:
                break
            await asyncio.sleep(0.01)
        return served, wakeup, {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}

    try:
        served, wakeup, handlers = loop_runner(loop)[1](command())
        assert (served, seen) == ("served", [signal.SIGTERM])
        assert handlers == {sig: handler for sig in STOP_SIGNALS}
        after_close = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        if loop == "asyncio":  # (uvloop's wakeup fd is its own socket until its run ends; it then restores it)
            assert wakeup == -1
        # The loop forgot them: closing it did not reset them to their defaults.
        assert after_close == handlers
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_signal_after_serving_leaves_at_once_while_asyncio_run_waits_on_a_stuck_thread(loop):
    """The first SIGTERM ends serving; asyncio.run then waits for a thread that never ends. One more SIGTERM
    leaves at once with status 0 and no traceback. Without the hand-back (``bare``) the process is still
    there after the same signals: the loop's handler only set an event nobody waited for any more."""
    outcomes, errs = {}, {}
    for how in ("released", "bare"):
        proc = subprocess.Popen([sys.executable, "-c", STUCK_AFTER_SERVING, loop, how], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "serving"
            proc.send_signal(signal.SIGTERM)
            assert proc.stdout.readline().strip() == "stopped serving"
            for _ in range(20):  # a signal every 0.1 s for 2 s (the first may come before the hand-back)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
            outcomes[how] = proc.poll()
        finally:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate(timeout=30)
        errs[how] = err[-800:]
        if how == "released":
            assert "Traceback" not in err and "Exception ignored" not in err, err
    assert outcomes == {"released": 0, "bare": None}, errs


def test_a_sigint_raised_while_the_loop_forgets_its_handler_is_handed_to_the_handler():
    """The loop's removal of its SIGINT handler puts Python's default_int_handler back for an instant; a SIGINT
    noted then is raised as KeyboardInterrupt in this thread. release_signals hands it to the handler (before,
    it escaped the command's end: status -2, seen in the suite) and leaves the handler in place."""


    class Loop:  # the removal, with a SIGINT landing in it
        def remove_signal_handler(self, sig):
            if sig == signal.SIGINT:
                raise KeyboardInterrupt

    got = []

    def handler(signum, _frame):
        got.append(signum)

    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        try:
            release_signals(handler, Loop())
        except KeyboardInterrupt:
            pytest.fail("the SIGINT escaped release_signals as KeyboardInterrupt")
        now = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    finally:
        for sig, old in before.items():
            signal.signal(sig, old)
    assert got == [signal.SIGINT]
    assert now == {sig: handler for sig in STOP_SIGNALS}
