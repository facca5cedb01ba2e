"""Reward functions run in worker processes, with a time limit per sample.

An environment's rubric is code the operator brought (or a library's): it may raise, loop forever, or
block in C. It must never stall intake, so it runs neither on the store's writer thread nor on the
event loop, and not even in a thread of the coordinator: a hung thread cannot be stopped, a process
can. A :class:`RewardRunner` keeps ``workers`` processes, each of which loads the environment from its
spec (name + kwargs, as the coordinator did) once, then scores whole groups:

    parent ── (prompt, completions) ──▶ worker        one message per group
    parent ◀── "done" ── worker                       one message per group (plus one per failed sample)
    shared memory: each sample's reward and error kind; the index of the sample being scored and
    when it started

The shared progress is what makes the limit per sample at the cost of one message each way: the
parent waits until the sample in progress has run ``timeout_s``. Then the worker is killed, that
sample gets reward 0 and a ``timeout`` error, the samples before it keep their rewards, and a fresh
worker scores the rest of the group. A reward function that raises
gives its sample reward 0 and an ``exception`` error; a non-finite or non-numeric result is an
``invalid`` error; a worker that dies mid-group (a segfault, ``os._exit``) is a ``crash``. Every error
is counted by kind (:attr:`RewardRunner.errors`) and returned with the group, so the coordinator can
export and log it; the group itself is scored and accepted as usual.

The one exception: a rubric whose every function is declared ``bounded`` (linear in the completion,
cannot block: the built-in exact match) is scored in the caller's thread when the runner is given the
loaded environment (``inline``); a process round trip would cost the coordinator more than the rubric.
Its errors are counted the same way; a time limit does not apply, as nothing bounded needs one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import queue
import signal
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

from veriroll.coordinator.environments import Prompt
from veriroll.protos.errors import VerirollError

__all__ = ["REWARD_ERROR_KINDS", "GroupRewards", "RewardRunner", "RewardWorkerError"]

log = logging.getLogger("veriroll.coordinator.rewards")

REWARD_ERROR_KINDS = ("exception", "timeout", "invalid", "crash")
"""Why a sample's reward was replaced by 0: the function raised, ran past the limit, returned a
non-finite or non-numeric value, or took its worker process down."""


class RewardWorkerError(VerirollError, RuntimeError):
    """A reward worker could not start (the environment does not load in a fresh process)."""


@dataclass
class GroupRewards:
    """The rewards of one group, in sample order, and per sample the kind of error that zeroed it (or None)."""

    rewards: list[float]
    errors: list[str | None] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    """One line per error, for the coordinator's log."""
    sandbox_kills: Counter[str] = field(default_factory=Counter)
    """Sandbox runs of model-written code killed while scoring the group, by reason (an environment that
    runs code, ``take_sandbox_kills``); lost with a worker killed mid-group (that sample is a ``timeout``)."""


_KINDS = (None, "exception", "invalid")
"""Error kinds a worker itself reports, by their code in the shared ``kinds`` array."""
CAPACITY = 1024
"""Samples per request to a worker (the size of its shared result arrays); larger groups go in chunks."""


def _score_one(env, prompt: Prompt, completion: str) -> tuple[float, int, str]:
    """(reward, error kind code, detail) of one completion; never raises."""
    try:
        value = env.reward(prompt, completion)
    except Exception as e:  # noqa: BLE001 - any failure of the operator's code is that sample's 0
        last = traceback.extract_tb(e.__traceback__)[-1:]
        where = f" at {last[0].filename}:{last[0].lineno}" if last else ""
        return 0.0, 1, f"{type(e).__name__}: {e}{where}"
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0, 2, f"returned {type(value).__name__} {value!r:.80}"
    if not math.isfinite(value):
        return 0.0, 2, f"returned {value}"
    return value, 0, ""


def _worker_main(conn, spec: str, kwargs: dict, progress, values, kinds) -> None:
    """A reward worker: load the environment, say ready (or why not), then score groups until told to stop.

    Results go to the shared ``values`` / ``kinds`` arrays as each sample finishes, and ``progress``
    holds (index of the sample being scored, when it started): so a group costs one message each way,
    and the parent still knows which sample is over its limit, and keeps the ones before it, when it
    has to kill this process.
    """
    # Ctrl-C in the coordinator's terminal reaches the whole process group; the coordinator stops
    # its workers itself, so they ignore it instead of printing a traceback each.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from veriroll.coordinator.environments import load_environment

        env = load_environment(spec, **kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it there
        conn.send(("load_error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    take_kills = getattr(env, "take_sandbox_kills", None)
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        prompt, completions, first = request
        for j, completion in enumerate(completions):
            # Start time first, then the index: a parent reading between the two sees the new time
            # with the old index, which only lets it wait longer, never kill early.
            progress[1] = time.monotonic()
            progress[0] = first + j
            values[j], kinds[j], detail = _score_one(env, prompt, completion)
            if kinds[j]:  # errors are rare: their details go at once, so a later kill cannot lose them
                conn.send(("error", first + j, detail))
        # Counted here, where the sandbox ran; the coordinator exports them (veriroll_sandbox_kills_total).
        conn.send(("done", None, take_kills() if take_kills else None))


class _Worker:
    """One worker process, the parent's end of its pipe, and the shared result arrays."""

    def __init__(self, ctx, spec: str, kwargs: dict, start_timeout_s: float):
        self.conn, child = ctx.Pipe(duplex=True)
        self.progress = ctx.RawArray("d", 2)
        self.values = ctx.RawArray("d", CAPACITY)
        self.kinds = ctx.RawArray("b", CAPACITY)
        self.process = ctx.Process(target=_worker_main, args=(child, spec, kwargs, self.progress, self.values, self.kinds),
                                   daemon=True, name="veriroll-reward")
        self.process.start()
        child.close()
        # Loading may read a dataset file (datasets caches it after the coordinator's own load).
        if not self.conn.poll(start_timeout_s):
            self.kill()
            raise RewardWorkerError(f"reward worker for environment {spec!r} did not start within {start_timeout_s:g}s")
        try:
            status, detail = self.conn.recv()
        except EOFError:
            self.kill()
            raise RewardWorkerError(f"reward worker for environment {spec!r} exited while loading it") from None
        if status != "ready":
            self.kill()
            raise RewardWorkerError(f"reward worker cannot load environment {spec!r}: {detail}")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(timeout=2)
        self.kill()


class RewardRunner:
    """Scores groups in worker processes loaded from an environment spec, ``timeout_s`` per sample.

    Up to ``workers`` groups are scored at once (one per worker); further callers wait for a free
    worker. Workers start on first use, so a coordinator that never scores never pays for them.
    :meth:`score` is for the event loop; :meth:`score_group` blocks, for threads and plain code.
    """

    def __init__(self, spec: str, kwargs: dict | None = None, *, timeout_s: float = 5.0, workers: int = 1,
                 start_timeout_s: float = 300.0, inline=None):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.spec, self.kwargs = spec, dict(kwargs or {})
        if inline is not None and not inline.rubric.bounded:
            raise ValueError(f"environment {inline.name!r} has reward functions not declared bounded: "
                             f"they run in worker processes, with a time limit")
        self.inline = inline
        """The loaded environment whose bounded rubric is scored in the caller's thread, or None."""
        self.timeout_s, self.start_timeout_s = float(timeout_s), float(start_timeout_s)
        # spawn, not fork: the coordinator has threads (gRPC, SQLite, this pool), and forking a
        # process with threads can copy a held lock into the child.
        self._ctx = multiprocessing.get_context("spawn")
        self._slots: queue.Queue[_Worker | None] = queue.Queue()
        self._workers = workers
        self._gate: asyncio.Semaphore | None = None  # see score()
        self._gate_loop: asyncio.AbstractEventLoop | None = None
        for _ in range(workers):
            self._slots.put(None)  # a free slot whose worker has not started yet
        self._lock = threading.Lock()
        self._live: set[_Worker] = set()
        self.errors: Counter[str] = Counter()
        """Reward errors so far, by kind (see :data:`REWARD_ERROR_KINDS`)."""
        self.restarts = 0
        """Workers killed and replaced after a timeout or crash."""

    def _start(self) -> _Worker:
        worker = _Worker(self._ctx, self.spec, self.kwargs, self.start_timeout_s)
        with self._lock:
            self._live.add(worker)
        return worker

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self._live.discard(worker)
            self.restarts += 1

    def score_group(self, prompt: Prompt, completions: list[str]) -> GroupRewards:
        """The reward of each completion for ``prompt`` (0 where the reward function failed, with the error's kind)."""
        n = len(completions)
        out = GroupRewards(rewards=[0.0] * n, errors=[None] * n)
        if n == 0:
            return out
        if self.inline is not None:
            return self._score_inline(prompt, completions, out)
        worker = self._slots.get()
        try:
            next_index = 0
            while next_index < n:
                if worker is None:
                    try:
                        worker = self._start()
                    except RewardWorkerError as e:
                        # The environment loaded in the coordinator but not in a fresh process (a
                        # module only on the coordinator's sys.path?): the rest of the group is 0, counted.
                        for i in range(next_index, n):
                            self._record(out, i, "exception", str(e))
                        break
                next_index, worker = self._run(worker, prompt, completions, next_index, out)
        finally:
            self._slots.put(worker)
        with self._lock:
            self.errors.update(kind for kind in out.errors if kind is not None)
        return out

    def _run(self, worker: _Worker, prompt: Prompt, completions: list[str], first: int,
             out: GroupRewards) -> tuple[int, _Worker | None]:
        """Score ``completions[first:]`` (up to :data:`CAPACITY`) on ``worker``. Returns the next index to score
        and the worker, or None in its place when it had to be killed (a timeout) or died (a crash)."""
        chunk = completions[first:first + CAPACITY]
        # The first sample's clock starts now, in case the worker is slow to pick the request up.
        worker.progress[1] = time.monotonic()
        worker.progress[0] = first
        try:
            worker.conn.send((prompt, chunk, first))
        except (OSError, ValueError):  # the worker died between groups: start another, lose nothing
            self._discard(worker)
            return first, None
        details: dict[int, str] = {}
        while True:
            if not worker.conn.poll(max(0.0, worker.progress[1] + self.timeout_s - time.monotonic())):
                if worker.progress[1] + self.timeout_s > time.monotonic():
                    continue  # the worker moved on to a later sample, whose own time runs
                self._discard(worker)
                index = self._collect(worker, first, out, partial=True, details=details)
                self._record(out, index, "timeout", f"no result within {self.timeout_s:g}s; worker killed and replaced")
                return index + 1, None
            try:
                what, index, detail = worker.conn.recv()
            except (EOFError, OSError):
                self._discard(worker)
                exitcode = worker.process.exitcode  # known once joined: the pipe can close before
                index = self._collect(worker, first, out, partial=True, details=details)
                self._record(out, index, "crash", f"the reward worker exited (code {exitcode}) while scoring it")
                return index + 1, None
            if what == "error":
                details[index] = detail
                continue
            out.sandbox_kills.update(detail or {})
            self._collect(worker, first, out, partial=False, count=len(chunk), details=details)
            return first + len(chunk), worker

    async def score(self, prompt: Prompt, completions: list[str]) -> GroupRewards:
        """:meth:`score_group` for the event loop: it waits on the worker's pipe as an I/O event, with no
        thread in between (each thread hand-off costs the coordinator a GIL round trip per group)."""
        n = len(completions)
        out = GroupRewards(rewards=[0.0] * n, errors=[None] * n)
        if n == 0:
            return out
        if self.inline is not None:
            return self._score_inline(prompt, completions, out)
        loop = asyncio.get_running_loop()
        if self._gate_loop is not loop:  # one gate per event loop (tests run one loop after another)
            self._gate, self._gate_loop = asyncio.Semaphore(self._workers), loop
        # Groups wait for a free worker here, on the loop. Waiting in the loop's default executor instead
        # cost a thread wake-up per group, and with more waiting groups than executor threads the
        # executor filled up, so that the _discard or _start a busy worker needed could not run.
        async with self._gate:
            return await self._score_on_a_worker(loop, prompt, completions, out)

    async def _score_on_a_worker(self, loop, prompt: Prompt, completions: list[str], out: GroupRewards) -> GroupRewards:
        n = len(completions)
        try:
            worker = self._slots.get_nowait()
        except queue.Empty:  # a blocking caller (a thread) holds the worker: wait for it off the loop
            worker = await loop.run_in_executor(None, self._slots.get)
        try:
            next_index = 0
            while next_index < n:
                if worker is None:
                    try:
                        worker = await loop.run_in_executor(None, self._start)  # spawning and loading take a while
                    except RewardWorkerError as e:
                        for i in range(next_index, n):
                            self._record(out, i, "exception", str(e))
                        break
                next_index, worker = await self._run_async(worker, prompt, completions, next_index, out)
        except BaseException:
            # Cancelled mid-group (the node hung up): the worker is still scoring, and its answer
            # would be read as the next group's. It goes; the slot gets a fresh one on next use.
            if worker is not None:
                self._discard(worker)
                worker = None
            raise
        finally:
            self._slots.put(worker)
        with self._lock:
            self.errors.update(kind for kind in out.errors if kind is not None)
        return out

    async def _run_async(self, worker: _Worker, prompt: Prompt, completions: list[str], first: int,
                         out: GroupRewards) -> tuple[int, _Worker | None]:
        """:meth:`_run` awaiting the pipe through the event loop's selector."""
        loop = asyncio.get_running_loop()
        chunk = completions[first:first + CAPACITY]
        worker.progress[1] = time.monotonic()
        worker.progress[0] = first
        try:
            worker.conn.send((prompt, chunk, first))
        except (OSError, ValueError):
            await loop.run_in_executor(None, self._discard, worker)
            return first, None
        # A bare future woken by the pipe's readiness or by the sample's deadline: cheaper per group
        # than an Event with wait_for (which wraps each wait in a task).
        waiting: list[asyncio.Future] = []

        def wake() -> None:
            if waiting and not waiting[0].done():
                waiting[0].set_result(None)

        fd = worker.conn.fileno()
        loop.add_reader(fd, wake)
        details: dict[int, str] = {}
        failure = None
        try:
            while True:
                if not worker.conn.poll(0):
                    remaining = worker.progress[1] + self.timeout_s - time.monotonic()
                    if remaining <= 0:
                        failure = "timeout"
                        break
                    waiting[:] = [loop.create_future()]
                    timer = loop.call_later(remaining, wake)
                    try:
                        await waiting[0]
                    finally:
                        timer.cancel()
                    continue
                try:
                    what, index, detail = worker.conn.recv()
                except (EOFError, OSError):
                    failure = "crash"
                    break
                if what == "error":
                    details[index] = detail
                    continue
                out.sandbox_kills.update(detail or {})
                break
        finally:
            loop.remove_reader(fd)  # before the pipe can be closed by a kill
        if failure is None:
            self._collect(worker, first, out, partial=False, count=len(chunk), details=details)
            return first + len(chunk), worker
        await loop.run_in_executor(None, self._discard, worker)
        exitcode = worker.process.exitcode
        index = self._collect(worker, first, out, partial=True, details=details)
        if failure == "timeout":
            self._record(out, index, "timeout", f"no result within {self.timeout_s:g}s; worker killed and replaced")
        else:
            self._record(out, index, "crash", f"the reward worker exited (code {exitcode}) while scoring it")
        return index + 1, None

    @staticmethod
    def _collect(worker: _Worker, first: int, out: GroupRewards, *, partial: bool, count: int = 0,
                 details: dict | None = None) -> int:
        """Copy finished results from the shared arrays into ``out``: all ``count`` of them, or (``partial``,
        the worker is dead) those before the sample it was scoring. Returns that sample's index."""
        if partial:
            count = int(worker.progress[0]) - first
        for j in range(count):
            i = first + j
            out.rewards[i] = worker.values[j]
            kind = _KINDS[worker.kinds[j]]
            if kind is not None:
                detail = (details or {}).get(i, "")
                RewardRunner._record(out, i, kind, detail)
        return first + count

    def _score_inline(self, prompt: Prompt, completions: list[str], out: GroupRewards) -> GroupRewards:
        for i, completion in enumerate(completions):
            value, kind, detail = _score_one(self.inline, prompt, completion)
            if kind:
                self._record(out, i, _KINDS[kind], detail)
            else:
                out.rewards[i] = value
        if any(out.errors):
            with self._lock:
                self.errors.update(kind for kind in out.errors if kind is not None)
        return out

    @staticmethod
    def _record(out: GroupRewards, index: int, kind: str, detail: str) -> None:
        out.rewards[index] = 0.0
        out.errors[index] = kind
        out.details.append(f"sample {index}: {kind}: {detail}")

    def close(self) -> None:
        """Stop every worker (one busy scoring is killed, and its sample counted as a crash); a later call
        starts fresh workers, so scoring after a coordinator stopped (a test re-checking rewards) still works."""
        with self._lock:
            live, self._live = list(self._live), set()
        for worker in live:
            worker.stop()
