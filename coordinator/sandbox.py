"""A sandbox for code that a model wrote: rewards and tools run it here, never in the coordinator.

In an unaudited group a dishonest node may have chosen that code itself, and the coordinator holds the
signing key, the TLS keys and the store. So each run happens in a bubblewrap container (new user, PID,
network, mount, IPC and UTS namespaces; no capabilities; read-only ``/usr`` and the interpreter's prefix,
nothing else of the host's filesystem; a fresh size-capped tmpfs as its working folder; an empty
environment; no network but a loopback of its own; a seccomp filter refusing the system calls behind
many kernel escapes, see coordinator/seccomp.py) as an unprivileged user, under kernel resource limits (CPU
time, address space, processes, file size, open files, no core dumps), with the wall time and the output
bounded by this process. When a run ends, for any reason, its whole process tree is killed: the
container's PID namespace dies with its init.

Speed: ``SandboxPool`` keeps ``size`` containers started ahead, each a Python interpreter that has imported
what it needs and waits on its stdin for ONE job. A run hands a warm one its code, reads its answer and
throws it away (fresh filesystem and processes for every run) while a replacement starts. A trivial run
then costs a few milliseconds instead of an interpreter start (``benchmarks/sandbox.py``).

Fail closed: where bubblewrap is missing or cannot create its namespaces, creating a pool raises
``SandboxUnavailable`` saying what is missing. Only ``mode="unsafe-subprocess"``, chosen by name, runs code
without the container (limits still apply; no isolation of files, network or processes), with a warning
at creation and ``pool.isolated`` False for a status page. See docs/sandbox.md.

    with SandboxPool(size=4, limits=SandboxLimits()) as pool:
        result = await pool.run("print(input()[::-1])", stdin="abc\\n")
        result.stdout  # "cba\\n"
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from veriroll.coordinator.seccomp import SeccompUnsupported, refusing_filter

log = logging.getLogger("veriroll.coordinator.sandbox")

BWRAP_MODE = "bwrap"
UNSAFE_SUBPROCESS_MODE = "unsafe-subprocess"  # the one named weaker mode: no isolation, limits only
MODES = (BWRAP_MODE, UNSAFE_SUBPROCESS_MODE)

NOBODY = 65534  # the uid and gid sandboxes run as when the coordinator runs as root
MEMORY_EXIT_CODE = 86  # the worker's exit status when the code raised MemoryError (under RLIMIT_AS)
NO_JOB_EXIT_CODE = 87  # the worker's exit status when its stdin closed before a whole job arrived
PROBE_TIMEOUT_S = 30.0  # creating a pool starts one container to prove it can; generous on a loaded host
READ_CHUNK = 65536

# The job protocol: a 4-byte big-endian length, that many bytes of JSON ({"code", "rlimits"}), then the
# code's stdin until EOF. The worker reads the header with os.read only, so nothing of the stdin is
# buffered away from the code; it sets the limits (hard = soft, so they cannot be raised again without
# CAP_SYS_RESOURCE, which the container does not have) and runs the code as ``__main__``.
WORKER_SOURCE = f"""
import os, resource, sys, traceback

def _read_exact(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            os._exit({NO_JOB_EXIT_CODE})
        data += chunk
    return data

import json
_job = json.loads(_read_exact(int.from_bytes(_read_exact(4), "big")))
for _name, (_soft, _hard) in _job["rlimits"].items():
    resource.setrlimit(getattr(resource, _name), (_soft, _hard))
_code = _job["code"]
del _job, _name, _soft, _hard
sys.argv = ["<sandbox>"]

def _finish(status):
    # os._exit, not the interpreter's shutdown: 3-4 ms less per run. The code's atexit handlers and
    # non-daemon threads are not waited for: the run ends when its main program does.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(status)

try:
    exec(compile(_code, "<sandbox>", "exec"), {{"__name__": "__main__", "__builtins__": __builtins__}})
except SystemExit as stop:
    if stop.code is None or isinstance(stop.code, int):
        _finish((stop.code or 0) & 0xFF)
    print(stop.code, file=sys.stderr)
    _finish(1)
except MemoryError:
    traceback.print_exc()
    _finish({MEMORY_EXIT_CODE})
except BaseException:
    traceback.print_exc()
    _finish(1)
_finish(0)
"""


class KillReason(enum.StrEnum):
    """Why a run did not end on its own terms. ``None`` on a result means it did (any exit status)."""

    TIMEOUT = "timeout"  # wall time past the run's timeout; killed by the pool
    CPU_LIMIT = "cpu_limit"  # RLIMIT_CPU: SIGKILL at ``cpu_s`` CPU seconds
    MEMORY_LIMIT = "memory_limit"  # RLIMIT_AS: the code raised MemoryError
    OUTPUT_LIMIT = "output_limit"  # stdout or stderr past ``output_bytes``; killed by the pool
    INPUT_LIMIT = "input_limit"  # code or stdin past their caps; nothing ran
    CRASH = "crash"  # died of a signal (SIGSEGV, SIGABRT, ...), or chose an exit status 129..191
    SANDBOX_ERROR = "sandbox_error"  # no container could be started, or it ended before reading the job
    CLOSED = "closed"  # the pool was closed while the code ran


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot be created here (bubblewrap missing, namespaces refused); the message says which."""


class SandboxClosed(RuntimeError):
    """``run`` on a pool that was closed."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. The defaults suit a reward or tool call on a test case, not a build."""

    wall_s: float = 10.0
    """Wall time of a run unless ``run`` is given ``timeout_s``; the pool kills the container after it."""
    cpu_s: int = 5
    """CPU seconds of each of the code's processes (RLIMIT_CPU); the kernel SIGKILLs a process at this."""
    memory_bytes: int = 512 * 2**20
    """Address space of each process (RLIMIT_AS); an allocation past it raises MemoryError."""
    processes: int = 16
    """Processes and threads of the sandbox's user (RLIMIT_NPROC; counted within its user namespace)."""
    file_bytes: int = 16 * 2**20
    """Largest file the code may write (RLIMIT_FSIZE)."""
    tmpfs_bytes: int = 64 * 2**20
    """Size of the fresh tmpfs that is the code's working folder (``/tmp``); all its files together."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: int = 1 * 2**20
    """Bytes read from each of stdout and stderr; one more and the pool kills the container."""
    code_bytes: int = 256 * 2**10
    """Largest code accepted (UTF-8 bytes); longer is refused before anything runs."""
    stdin_bytes: int = 4 * 2**20
    """Largest stdin accepted (UTF-8 bytes); longer is refused before anything runs."""

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "processes", "file_bytes", "tmpfs_bytes",
                     "open_files", "output_bytes", "code_bytes", "stdin_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, not {getattr(self, name)}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """The kernel limits the worker sets on itself before running the code: name -> (soft, hard)."""
        return {
            # The worker is its PID namespace's init, which ignores SIGXCPU: the hard limit's SIGKILL ends it.
            "RLIMIT_CPU": (self.cpu_s, self.cpu_s),
            "RLIMIT_AS": (self.memory_bytes, self.memory_bytes),
            "RLIMIT_NPROC": (self.processes, self.processes),
            "RLIMIT_FSIZE": (self.file_bytes, self.file_bytes),
            "RLIMIT_NOFILE": (self.open_files, self.open_files),
            # A core dump would go to the host's core_pattern, which may be a program run as root.
            "RLIMIT_CORE": (0, 0),
        }


@dataclass(frozen=True)
class SandboxResult:
    """What a run did. ``exit_code`` is None when the pool killed it (timeout, output) or nothing ran;
    a death by signal N reads as 128 + N, as a shell shows it. ``cpu_s`` is the user + system time of the
    container's processes that were reaped before it ended (a killed run may have used more).
    """

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: KillReason | None
    cpu_s: float
    wall_s: float

    @property
    def ok(self) -> bool:
        """The code ended on its own with status 0."""
        return self.exit_code == 0 and self.killed_reason is None


def default_python() -> str:
    """The interpreter sandboxes run: the system's ``/usr/bin/python3`` where there is one (it lives in
    ``/usr``, which is bound anyway, and an unprivileged user can read it), else this process's base one."""
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(os.path.join(sys.base_prefix, "bin", "python3"))


SECCOMP_FD_PLACEHOLDER = "{seccomp_fd}"  # replaced per container by the descriptor its filter is read from


def bwrap_command(python: str, limits: SandboxLimits, *, seccomp: bool = True) -> list[str]:
    """The bubblewrap command line that starts one warm worker, as the unprivileged user. With
    ``seccomp``, it holds ``SECCOMP_FD_PLACEHOLDER`` where the filter's descriptor goes."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (bwrap) is not on PATH: install it (Debian/Ubuntu: apt-get install -y bubblewrap), "
            f"or create the pool with mode={UNSAFE_SUBPROCESS_MODE!r} to run model code WITHOUT isolation"
        )
    # --as-pid-1: the worker is the PID namespace's init, so bwrap waits for it and its CPU time reaches
    # this process through wait4 (with bwrap's own reaper as init it does not). When the worker exits,
    # the kernel kills everything left in the namespace. As init, signals it has no handler for are
    # ignored unless the kernel forces them: SIGKILL (RLIMIT_CPU's hard limit) and faults still end it.
    command = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--as-pid-1", "--die-with-parent",
               "--new-session", "--cap-drop", "ALL", "--clearenv", "--hostname", "sandbox",
               "--ro-bind", "/usr", "/usr"]
    # /bin, /lib, /lib64, /sbin: symlinks into /usr on a merged-/usr system, else read-only binds.
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            command += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            command += ["--ro-bind", top, top]
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if prefix not in ("/", "/usr"):
        command += ["--ro-bind", prefix, prefix]
    command += ["--proc", "/proc", "--dev", "/dev",
                "--size", str(limits.tmpfs_bytes), "--tmpfs", "/tmp",
                "--remount-ro", "/",  # only /tmp is writable
                "--chdir", "/tmp",
                "--setenv", "HOME", "/tmp", "--setenv", "PATH", "/usr/bin:/bin",
                "--setenv", "LANG", "C.UTF-8"]
    if seccomp:
        command += ["--seccomp", SECCOMP_FD_PLACEHOLDER]
    if os.geteuid() == 0:
        # As root, bwrap would map the sandbox's user to host root, which RLIMIT_NPROC does not count:
        # drop to nobody first (setpriv keeps the spawn a cheap vfork; Popen(user=) would fork).
        command = [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                   "--clear-groups", "--", *command]
    return [*command, python, "-I", "-S", "-c", WORKER_SOURCE]


def unsafe_command(python: str) -> list[str]:
    """The command line of a worker in the named weaker mode: the same worker, no container."""
    command = [python, "-I", "-S", "-c", WORKER_SOURCE]
    if os.geteuid() == 0:
        command = [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                   "--clear-groups", "--", *command]
    return command


@dataclass(eq=False)  # hashed by identity: kept in a set while running
class _Worker:
    """One started container waiting for its job (or running it)."""

    process: subprocess.Popen
    workdir: str | None = None  # unsafe mode only: its own folder, removed when it ends


class SandboxPool:
    """At most ``size`` runs at once, each in its own container; ``size`` more started ahead when ``warm``.

    Used from one thread (one event loop at a time): the containers die with the thread that started
    them (``--die-with-parent``). ``kill_counts`` counts runs per ``KillReason``; ``runs`` counts all.
    """

    def __init__(self, size: int = 4, limits: SandboxLimits | None = None, *, mode: str = BWRAP_MODE,
                 warm: bool = True, python: str | None = None, seccomp: bool = True):
        if size < 1:
            raise ValueError(f"size must be at least 1, not {size}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
        self.size = size
        self.limits = limits or SandboxLimits()
        self.mode = mode
        self.warm = warm
        self.python = python or default_python()
        self.kill_counts: Counter[KillReason] = Counter()
        self.runs = 0
        self._closed = False
        self._ready: deque[_Worker] = deque()
        self._running: set[_Worker] = set()
        self._slots = 0  # runs under way or about to be
        self._slot_waiters: deque[asyncio.Future] = deque()
        self._seccomp_filter: bytes | None = None
        if mode == BWRAP_MODE:
            self._command = bwrap_command(self.python, self.limits, seccomp=seccomp)
            if seccomp:
                try:
                    self._seccomp_filter = refusing_filter()
                except SeccompUnsupported as error:
                    raise SandboxUnavailable(f"{error}; pass seccomp=False to run without a syscall filter "
                                             "(namespaces and limits still apply)") from error
            else:
                log.warning("sandbox pool without a seccomp filter: model code can reach every system call "
                            "an unprivileged user can")
            self._probe()
        else:
            self._command = unsafe_command(self.python)
            log.warning("sandbox pool in mode %r: model code runs WITHOUT isolation (files, network and "
                        "processes of this host are reachable); only resource limits apply", mode)
        if warm:
            for _ in range(size):
                self._ready.append(self._spawn())

    @property
    def isolated(self) -> bool:
        """Whether code runs in a container (False only in the named weaker mode); for a status page."""
        return self.mode == BWRAP_MODE

    def _probe(self) -> None:
        """Start one container that runs ``pass``, so a host that cannot create one fails here, loudly."""
        job = _job_bytes("pass", self.limits, b"")
        try:
            with self._filter_fd() as fd:
                done = subprocess.run(self._command_with(fd), input=job, capture_output=True,
                                      timeout=PROBE_TIMEOUT_S, cwd="/", start_new_session=True, check=False,
                                      pass_fds=(fd,) if fd is not None else ())
        except (OSError, subprocess.TimeoutExpired) as error:
            raise SandboxUnavailable(f"could not start a bubblewrap sandbox: {error}") from error
        if done.returncode != 0:
            raise SandboxUnavailable(
                f"bubblewrap could not create a sandbox (exit status {done.returncode}): "
                f"{done.stderr.decode(errors='replace').strip()[-2000:]} -- it needs unprivileged user "
                "namespaces (sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0, "
                "no seccomp profile refusing clone/unshare in a container) and the interpreter "
                f"{self.python} readable by uid {NOBODY if os.geteuid() == 0 else os.geteuid()}; or create "
                f"the pool with mode={UNSAFE_SUBPROCESS_MODE!r} to run model code WITHOUT isolation"
            )

    def _spawn(self) -> _Worker:
        workdir = None
        if self.mode == UNSAFE_SUBPROCESS_MODE:
            workdir = tempfile.mkdtemp(prefix="veriroll-sandbox-")
            os.chmod(workdir, 0o777)  # the worker may run as nobody
        with self._filter_fd() as fd:
            process = subprocess.Popen(
                self._command_with(fd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                cwd=workdir or "/", env={"PATH": "/usr/bin:/bin", "HOME": workdir or "/", "LANG": "C.UTF-8"},
                start_new_session=True,  # its own process group, killed as one
                pass_fds=(fd,) if fd is not None else (),
            )
        return _Worker(process, workdir)

    @contextlib.contextmanager
    def _filter_fd(self) -> Iterator[int | None]:
        """A pipe's read end holding the seccomp filter, for one container's bwrap to read to EOF."""
        if self._seccomp_filter is None:
            yield None
            return
        read_end, write_end = os.pipe()
        try:
            os.write(write_end, self._seccomp_filter)  # a few hundred bytes: fits the pipe
            os.close(write_end)
            write_end = -1
            yield read_end
        finally:
            os.close(read_end)
            if write_end != -1:
                os.close(write_end)

    def _command_with(self, fd: int | None) -> list[str]:
        if fd is None:
            return self._command
        return [str(fd) if part == SECCOMP_FD_PLACEHOLDER else part for part in self._command]

    async def run(self, code: str, stdin: str = "", timeout_s: float | None = None) -> SandboxResult:
        """Run ``code`` as a Python program with ``stdin``; its stdout, stderr, status and why it was
        stopped, if it was. Never raises for anything the code does; raises ``SandboxClosed`` after close.
        """
        if self._closed:
            raise SandboxClosed("the sandbox pool is closed")
        code_bytes = code.encode("utf-8", errors="surrogatepass")
        stdin_bytes = stdin.encode("utf-8", errors="surrogatepass")
        if len(code_bytes) > self.limits.code_bytes or len(stdin_bytes) > self.limits.stdin_bytes:
            what = "code" if len(code_bytes) > self.limits.code_bytes else "stdin"
            return self._counted(SandboxResult(None, "", f"{what} too large", False, KillReason.INPUT_LIMIT,
                                               0.0, 0.0))
        await self._take_slot()
        try:
            if self._closed:
                raise SandboxClosed("the sandbox pool is closed")
            try:
                worker = self._take_worker()
            except OSError as error:  # this host is out of processes or descriptors: not the code's doing
                log.warning("could not start a sandbox: %s", error)
                return self._counted(SandboxResult(None, "", f"could not start a sandbox: {error}", False,
                                                   KillReason.SANDBOX_ERROR, 0.0, 0.0))
            self._running.add(worker)
            try:
                result = await _execute(worker, _job_bytes(code, self.limits, stdin_bytes), self.limits,
                                        timeout_s if timeout_s is not None else self.limits.wall_s,
                                        self._is_closed, after_handoff=self._refill)
            finally:
                self._running.discard(worker)
                _end(worker)
        finally:
            self._give_slot()
        return self._counted(result)

    def run_sync(self, code: str, stdin: str = "", timeout_s: float | None = None) -> SandboxResult:
        """``run`` for plain code with no event loop running in this thread (a reward worker process)."""
        return asyncio.run(self.run(code, stdin, timeout_s))

    def _is_closed(self) -> bool:
        return self._closed

    def _counted(self, result: SandboxResult) -> SandboxResult:
        self.runs += 1
        if result.killed_reason is not None:
            self.kill_counts[result.killed_reason] += 1
        return result

    def _refill(self) -> None:
        """Start containers until ``size`` are warm (called once a job is handed over: it costs a spawn)."""
        while self.warm and not self._closed and len(self._ready) < self.size:
            try:
                self._ready.append(self._spawn())
            except OSError as error:  # out of processes or descriptors: the next run starts a cold one
                log.warning("could not start a warm sandbox: %s", error)
                return

    def _take_worker(self) -> _Worker:
        """A warm worker still alive, else a cold one; ``_refill`` starts the replacement."""
        while self._ready:
            worker = self._ready.popleft()
            if worker.process.poll() is None:
                return worker
            log.warning("a warm sandbox had died before its job (status %s)", worker.process.returncode)
            _end(worker)
        return self._spawn()

    async def _take_slot(self) -> None:
        """Wait until fewer than ``size`` runs are under way (first come, first served)."""
        if self._slots < self.size and not self._slot_waiters:
            self._slots += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._slot_waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            with contextlib.suppress(ValueError):
                self._slot_waiters.remove(waiter)
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._give_slot()  # handed a slot, then cancelled: pass it on
            raise

    def _give_slot(self) -> None:
        self._slots -= 1
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                self._slots += 1
                waiter.set_result(None)
                return

    def close(self) -> None:
        """Kill every container, warm or running (running ones answer ``closed``); returns within a second."""
        self._closed = True
        for worker in list(self._ready) + list(self._running):
            _kill(worker)
        for worker in list(self._ready):
            _end(worker)
        self._ready.clear()
        for waiter in self._slot_waiters:
            if not waiter.done():
                waiter.set_exception(SandboxClosed("the sandbox pool is closed"))
        self._slot_waiters.clear()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _job_bytes(code: str, limits: SandboxLimits, stdin: bytes) -> bytes:
    """What the worker reads: a 4-byte length, the JSON header (code and rlimits), then the code's stdin."""
    header = json.dumps({"code": code, "rlimits": limits.rlimits()}).encode()
    return len(header).to_bytes(4, "big") + header + stdin


def _kill(worker: _Worker) -> None:
    """SIGKILL the container: bwrap's process group, then bwrap itself. Its init has PDEATHSIG set, and
    when a PID namespace's init dies the kernel kills every process in it: the whole tree goes."""
    pid = worker.process.pid
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def _end(worker: _Worker) -> None:
    """Kill and reap the worker, close its pipes and remove its folder (unsafe mode)."""
    _kill(worker)
    process = worker.process
    if process.returncode is None:
        with contextlib.suppress(ChildProcessError):
            _, status = os.waitpid(process.pid, 0)  # it was SIGKILLed: this returns at once
            process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode is None:
            process.returncode = -signal.SIGKILL
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
    if worker.workdir is not None:
        # In unsafe mode the code could have left a process behind in its group; it was killed above.
        shutil.rmtree(worker.workdir, ignore_errors=True)


async def _execute(worker: _Worker, job: bytes, limits: SandboxLimits, timeout_s: float,
                   closed: Callable[[], bool], after_handoff: Callable[[], None]) -> SandboxResult:
    """Hand ``job`` to the worker, collect its output within the caps, wait for it to end or kill it.
    ``after_handoff`` runs once the job's first bytes are written (so a replacement's spawn waits).
    """
    loop = asyncio.get_running_loop()
    process = worker.process
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    stdin_fd, out_fd, err_fd = process.stdin.fileno(), process.stdout.fileno(), process.stderr.fileno()
    for fd in (stdin_fd, out_fd, err_fd):
        os.set_blocking(fd, False)
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    open_outputs = {out_fd, err_fd}
    pending = memoryview(job)
    over_output = False
    finished = loop.create_future()  # set when the container has ended and both outputs are at EOF
    exited: list[tuple[int, float]] = []  # (wait status, cpu seconds) once reaped

    def maybe_finish() -> None:
        if exited and not open_outputs and not finished.done():
            finished.set_result(None)

    def on_output(fd: int) -> bool:
        """Read one chunk; False when there is nothing more to read now (EOF or would block)."""
        nonlocal over_output
        try:
            chunk = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            chunk = b""
        if not chunk:
            loop.remove_reader(fd)
            open_outputs.discard(fd)
            maybe_finish()
            return False
        buffer = buffers[fd]
        room = limits.output_bytes - len(buffer)
        buffer += chunk[:room]
        if len(chunk) > room and not over_output:
            over_output = True
            _kill(worker)
        return not over_output

    def on_stdin_writable() -> None:
        nonlocal pending
        try:
            written = os.write(stdin_fd, pending[:READ_CHUNK])
        except BlockingIOError:
            return
        except OSError:  # the code exited or closed its stdin without reading all of it
            written = len(pending)
        pending = pending[written:]
        if not pending:
            # Closed at once, so the code sees EOF; the fd number may then be reused by another run's
            # pipe, so nothing here touches it again (the writer is only removed while it is ours).
            loop.remove_writer(stdin_fd)
            with contextlib.suppress(OSError):
                process.stdin.close()

    def on_exit() -> None:
        loop.remove_reader(pidfd)
        try:
            _, status, usage = os.wait4(process.pid, 0)
        except ChildProcessError:  # reaped elsewhere (close)
            status, usage = -1, None
        process.returncode = os.waitstatus_to_exitcode(status) if status != -1 else -signal.SIGKILL
        exited.append((status, usage.ru_utime + usage.ru_stime if usage else 0.0))
        # Everything that could still write was in the container, which is gone: what the pipes hold is
        # all there is. (In unsafe mode a process that left the group could hold them open: not waited for.)
        for fd in list(open_outputs):
            while on_output(fd):
                pass
            loop.remove_reader(fd)
            open_outputs.discard(fd)
        maybe_finish()

    started = time.monotonic()
    pidfd = os.pidfd_open(process.pid)
    timed_out = False
    try:
        loop.add_reader(pidfd, on_exit)
        loop.add_reader(out_fd, on_output, out_fd)
        loop.add_reader(err_fd, on_output, err_fd)
        on_stdin_writable()  # a small job fits the pipe at once
        if pending:
            loop.add_writer(stdin_fd, on_stdin_writable)
        after_handoff()
        try:
            await asyncio.wait_for(asyncio.shield(finished), timeout_s)
        except TimeoutError:
            timed_out = not exited
            _kill(worker)
            # After SIGKILL the container is gone within milliseconds; the outputs reach EOF with it.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(finished), 1.0)
    finally:
        for fd in (pidfd, out_fd, err_fd):
            with contextlib.suppress(ValueError, OSError):
                loop.remove_reader(fd)
        if pending:
            loop.remove_writer(stdin_fd)
        os.close(pidfd)
        if not exited:
            _kill(worker)
    wall_s = time.monotonic() - started
    status, cpu_s = exited[0] if exited else (-1, 0.0)
    exit_code = os.waitstatus_to_exitcode(status) if status != -1 else None
    reason = _kill_reason(exit_code, cpu_s, limits, timed_out=timed_out, over_output=over_output,
                          closed=closed())
    if reason in (KillReason.TIMEOUT, KillReason.OUTPUT_LIMIT, KillReason.CLOSED):
        exit_code = None  # the pool's SIGKILL, not the code's status
    elif exit_code is not None and exit_code < 0:
        exit_code = 128 - exit_code  # bwrap itself died of a signal
    return SandboxResult(exit_code, buffers[out_fd].decode(errors="replace"),
                         buffers[err_fd].decode(errors="replace"), timed_out, reason, cpu_s, wall_s)


def _kill_reason(exit_code: int | None, cpu_s: float, limits: SandboxLimits, *, timed_out: bool,
                 over_output: bool, closed: bool) -> KillReason | None:
    """Why the run was stopped, from what this process saw first (its own kills), then the status.

    bwrap exits with 128 + N when the code died of signal N. Statuses the code can choose itself
    (``sys.exit(152)`` reads as cpu_limit) only ever misreport the code's own run, never another's.
    """
    if over_output:
        return KillReason.OUTPUT_LIMIT
    if timed_out:
        return KillReason.CLOSED if closed else KillReason.TIMEOUT
    if exit_code is None:
        return KillReason.SANDBOX_ERROR
    if exit_code < 0:  # bwrap itself was killed: by close(), or by the host (OOM killer)
        return KillReason.CLOSED if closed else KillReason.CRASH
    # A SIGKILL this pool did not send to the namespace's init (which ignores signals from inside) comes
    # from RLIMIT_CPU or the host (OOM killer). wait4's CPU figure is measured as a few percent below the
    # limit on a loaded host (0.988 s for 1 s), hence the margin.
    if exit_code == 128 + signal.SIGXCPU or (exit_code == 128 + signal.SIGKILL and cpu_s >= 0.8 * limits.cpu_s):
        return KillReason.CPU_LIMIT
    if exit_code == MEMORY_EXIT_CODE:
        return KillReason.MEMORY_LIMIT
    if exit_code == NO_JOB_EXIT_CODE:
        return KillReason.SANDBOX_ERROR
    if 128 < exit_code < 128 + signal.SIGRTMAX:
        return KillReason.CRASH
    return None


# RLIMIT names the worker sets must exist on this platform (Linux); fail at import, not in a container.
for _name in SandboxLimits().rlimits():
    getattr(resource, _name)
