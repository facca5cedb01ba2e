"""What the benchmarks share about the processes they start (imported by sibling scripts, run from here)."""

from __future__ import annotations

import signal
import subprocess


def sigterm_as_interrupt() -> None:
    """A SIGTERM sent to this script alone (``kill PID``) raises KeyboardInterrupt, as Ctrl-C does, so that the
    script's ``finally`` blocks stop the processes it started; by default it ended the script on the spot and
    left them running. (``timeout`` and Ctrl-C signal the whole process group, children included.)"""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


def stop_processes(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM to every process still running, then wait ``timeout_s`` for each; one that does not exit
    is killed (a benchmark's figures are printed either way)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
