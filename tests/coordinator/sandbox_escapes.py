"""Escape attempts against the sandbox, shared by tests/coordinator/test_sandbox.py and benchmarks/sandbox.py.

Each attempt is a program a dishonest node could have had a model write, aimed at something the host
sets up in ``host_targets``: secret files (a stand-in ``coordinator.key``, TLS key, store) in the test's
folder, in /root and in the current folder; loopback TCP, UDP and Unix servers; a victim process of the
sandbox's own uid. ``attempt_escape`` runs one, then says how it escaped, or None: a secret's token in the
output, a file written on the host, a server reached, the victim killed, a process left behind, the wrong
reason, or a pool that no longer serves the next job.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from veriroll.coordinator.sandbox import NOBODY, KillReason, SandboxPool, SandboxResult

LEFTOVER_GRACE_S = 1.0  # a killed container's processes are gone within this (checked, not slept)


@dataclass
class Host:
    """What a run must not reach. ``token`` marks the secrets and any process an attempt leaves behind."""

    token: str
    folder: Path
    secret_paths: list[Path]
    write_targets: list[Path]
    tcp: socket.socket
    udp: socket.socket
    unix: socket.socket
    unix_path: Path
    abstract: socket.socket
    abstract_name: str
    victim: subprocess.Popen
    inherited_fd: int  # an open secret this process would hand on to a careless child

    @property
    def tcp_port(self) -> int:
        return self.tcp.getsockname()[1]

    @property
    def udp_port(self) -> int:
        return self.udp.getsockname()[1]

    def servers_reached(self) -> list[str]:
        """The servers that got a connection or a datagram (all sockets are non-blocking)."""
        reached = []
        for name, server in (("tcp", self.tcp), ("unix", self.unix), ("abstract", self.abstract)):
            try:
                connection, _ = server.accept()
                connection.close()
                reached.append(name)
            except BlockingIOError:
                pass
        try:
            self.udp.recvfrom(65536)
            reached.append("udp")
        except BlockingIOError:
            pass
        return reached


def _listening(family: int, address: object) -> socket.socket:
    server = socket.socket(family, socket.SOCK_STREAM)
    server.bind(address)
    server.listen(8)
    server.setblocking(False)
    return server


@contextlib.contextmanager
def host_targets(folder: Path) -> Iterator[Host]:
    """Secrets, servers and a victim process on this host, for the length of the block; all removed after."""
    token = secrets.token_hex(8)  # in the secrets' contents only: the attempts print the paths they try
    name = secrets.token_hex(4)
    folder.mkdir(parents=True, exist_ok=True)
    secret_paths = [folder / "coordinator.key", folder / "tls.key", folder / "store.sqlite3"]
    for home in (Path("/root"), Path.cwd()):
        if os.access(home, os.W_OK):
            secret_paths.append(home / f"veriroll-sandbox-secret-{name}.key")
    for path in secret_paths:
        path.write_text(f"SECRET-{token}\n")
        path.chmod(0o644)  # readable by anyone who can reach it: only the sandbox's walls keep it out
    write_targets = [folder / f"written-{name}", Path("/root") / f"written-{name}", Path.cwd() / f"written-{name}",
                     Path("/tmp") / f"written-{name}"]
    unix_path = folder / "server.sock"
    abstract_name = f"veriroll-sandbox-{name}"
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    # The victim runs as the sandbox's uid, so only the namespaces (not file permissions) protect it.
    victim_command = ["sleep", f"600.{int(token[:6], 16)}"]
    if os.geteuid() == 0:
        victim_command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                          *victim_command]
    host = Host(
        token=token, folder=folder, secret_paths=secret_paths, write_targets=write_targets,
        tcp=_listening(socket.AF_INET, ("127.0.0.1", 0)), udp=udp,
        unix=_listening(socket.AF_UNIX, str(unix_path)), unix_path=unix_path,
        abstract=_listening(socket.AF_UNIX, "\0" + abstract_name), abstract_name=abstract_name,
        victim=subprocess.Popen(victim_command, start_new_session=True),
        inherited_fd=os.open(secret_paths[0], os.O_RDONLY),
    )
    os.set_inheritable(host.inherited_fd, True)
    os.chmod(unix_path, 0o777)
    try:
        yield host
    finally:
        host.victim.kill()
        host.victim.wait()
        os.close(host.inherited_fd)
        for server in (host.tcp, host.udp, host.unix, host.abstract):
            server.close()
        for path in [*secret_paths, *write_targets, unix_path]:
            with contextlib.suppress(OSError):
                path.unlink()
        for pid in leftover_processes(token):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def leftover_processes(token: str) -> list[int]:
    """Host pids whose command line carries ``token`` (an attempt's sleepers are named after it)."""
    marker = str(int(token[:6], 16)).encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline and b"sleep\x00600." not in cmdline:  # the victim is not a leftover
            found.append(int(entry))
    return found


def _sleeper(host: Host) -> str:
    """A line of Python that turns the current process into a sleeper named after the host's token."""
    return f"os.execv('/bin/sleep', ['sleep', '300.{int(host.token[:6], 16)}'])"


@dataclass(frozen=True)
class Attempt:
    """One escape program: ``code`` for a host, the reasons a contained run may end with."""

    name: str
    code: Callable[[Host], str]
    reasons: frozenset[KillReason | None]
    must_exit_zero: bool = False  # the program itself checks and prints; it should end normally


def _read_secrets(host: Host) -> str:
    paths = [str(path) for path in host.secret_paths]
    return f"""
import glob
for path in {paths!r} + glob.glob('/root/*') + glob.glob('/work/**/*.key', recursive=True) + ['/etc/shadow', '/proc/1/environ']:
    try:
        print(path, open(path).read())
    except OSError as error:
        print(path, 'refused', error.errno)
"""


def _write_outside(host: Host) -> str:
    paths = [str(path) for path in host.write_targets] + ["/usr/written", "/written", "/proc/written"]
    return f"""
for path in {paths!r}:
    try:
        open(path, 'w').write('ESCAPED')
        print(path, 'written')
    except OSError as error:
        print(path, 'refused', error.errno)
"""


def _sockets(host: Host) -> str:
    return f"""
import socket
attempts = [
    ('tcp', socket.AF_INET, socket.SOCK_STREAM, ('127.0.0.1', {host.tcp_port})),
    ('udp', socket.AF_INET, socket.SOCK_DGRAM, ('127.0.0.1', {host.udp_port})),
    ('unix', socket.AF_UNIX, socket.SOCK_STREAM, {str(host.unix_path)!r}),
    ('abstract', socket.AF_UNIX, socket.SOCK_STREAM, '\\0' + {host.abstract_name!r}),
    ('internet', socket.AF_INET, socket.SOCK_STREAM, ('1.1.1.1', 53)),
]
for name, family, kind, address in attempts:
    s = socket.socket(family, kind)
    s.settimeout(1)
    try:
        s.connect(address)
        s.send(b'ESCAPED')
        # A datagram "sent" says nothing (the sandbox has a loopback of its own): the host checks receipt.
        print(name, 'sent' if kind == socket.SOCK_DGRAM else 'CONNECTED')
    except OSError as error:
        print(name, 'refused', error.errno)
"""


def _signal_parent(host: Host) -> str:
    return f"""
import os, signal
for pid in (os.getppid(), {host.victim.pid}, {os.getpid()}, -1, 0):
    try:
        os.kill(pid, signal.SIGKILL)
        print(pid, 'signalled')
    except OSError as error:
        print(pid, 'refused', error.errno)
"""


def _ptrace(host: Host) -> str:
    return f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
PTRACE_ATTACH = 16
for pid in ({host.victim.pid}, {os.getpid()}, os.getppid()):
    answer = libc.ptrace(PTRACE_ATTACH, pid, None, None)
    print(pid, 'attached' if answer == 0 else 'refused', ctypes.get_errno())
"""


def _proc(host: Host) -> str:
    return """
import os
for entry in os.listdir('/proc'):
    if entry.isdigit():
        try:
            print(entry, repr(open(f'/proc/{entry}/cmdline', 'rb').read()[:60]))
        except OSError as error:
            print(entry, 'refused', error.errno)
"""


def _inherited_descriptors(host: Host) -> str:
    return f"""
import os
print('open:', sorted(os.listdir('/proc/self/fd')))
for fd in list(range(3, 1024)) + [{host.inherited_fd}]:
    try:
        os.lseek(fd, 0, 0)
        print(fd, os.read(fd, 100))
    except OSError:
        pass
"""


def _kernel_attack_surface(host: Host) -> str:
    # Each call must be refused before the kernel looks at it (EPERM from the seccomp filter), not merely
    # fail on these arguments: a call that reaches its subsystem reaches that subsystem's bugs.
    return """
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
# Arguments that do nothing where the call is allowed (ptrace: attach to pid 0, not PTRACE_TRACEME).
calls = {'io_uring_setup': (425, 0), 'bpf': (321, 0), 'keyctl': (250, 0), 'add_key': (248, 0),
         'userfaultfd': (323, 0), 'perf_event_open': (298, 0), 'unshare': (272, 0), 'setns': (308, -1),
         'mount': (165, 0), 'fsopen': (430, 0), 'ptrace': (101, 16)}
for name, (number, first) in calls.items():
    ctypes.set_errno(0)
    answer = libc.syscall(number, first, 0, 0, 0, 0)
    refused = answer == -1 and ctypes.get_errno() == errno.EPERM
    print(name, 'refused' if refused else f'REACHED ({answer}, errno {ctypes.get_errno()})')
"""


def _daemon(host: Host) -> str:
    # The sleeper writes one byte, then the pipe's write end closes on its exec: the program returns only
    # once the daemon exists, and fails (status 1, noticed) if it never came to be (a fork refused).
    return f"""
import os, sys
ready, exec_done = os.pipe()
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(exec_done, b'x')
        for fd in (0, 1, 2):
            os.close(fd)
        {_sleeper(host)}
    os._exit(0)
os.close(exec_done)
if os.read(ready, 1) != b'x' or os.read(ready, 1) != b'':
    sys.exit('the daemon was never started')
print('daemon started')
"""


def _fork_bomb(host: Host) -> str:
    return f"""
import os, time
while True:
    try:
        if os.fork() == 0:
            {_sleeper(host)}
    except OSError:
        time.sleep(0.01)
"""


ATTEMPTS = [
    Attempt("read_secret_files", _read_secrets, frozenset({None}), must_exit_zero=True),
    Attempt("write_outside", _write_outside, frozenset({None}), must_exit_zero=True),
    Attempt("connect_sockets", _sockets, frozenset({None}), must_exit_zero=True),
    Attempt("signal_parent_and_host", _signal_parent, frozenset({None}), must_exit_zero=True),
    Attempt("ptrace_host", _ptrace, frozenset({None}), must_exit_zero=True),
    Attempt("list_host_processes", _proc, frozenset({None}), must_exit_zero=True),
    Attempt("reach_kernel_attack_surface", _kernel_attack_surface, frozenset({None}), must_exit_zero=True),
    Attempt("read_inherited_descriptors", _inherited_descriptors, frozenset({None}), must_exit_zero=True),
    Attempt("daemon_left_behind", _daemon, frozenset({None}), must_exit_zero=True),
    Attempt("fork_bomb", _fork_bomb, frozenset({KillReason.TIMEOUT, KillReason.CPU_LIMIT})),
    Attempt("memory_bomb", lambda host: "chunks = []\nwhile True:\n    chunks.append(bytearray(2**24))\n",
            frozenset({KillReason.MEMORY_LIMIT})),
    Attempt("infinite_loop", lambda host: "while True:\n    pass\n",
            frozenset({KillReason.CPU_LIMIT, KillReason.TIMEOUT})),
    Attempt("gigabyte_of_output", lambda host: "import sys\nline = 'x' * 2**20\nfor _ in range(1024):\n"
            "    sys.stdout.write(line)\n", frozenset({KillReason.OUTPUT_LIMIT})),
    Attempt("sleep_past_limit", lambda host: "import time\ntime.sleep(3600)\n", frozenset({KillReason.TIMEOUT})),
]


def how_it_escaped(attempt: Attempt, result: SandboxResult, host: Host) -> list[str]:
    """Everything about the run and the host that shows the attempt got out; empty when contained."""
    found = []
    output = result.stdout + result.stderr
    if host.token in output:
        found.append("a secret's token appeared in the output")
    for path in host.write_targets:
        if path.exists():
            found.append(f"{path} was written on the host")
    if "CONNECTED" in output or host.servers_reached():
        found.append(f"a server was reached: {host.servers_reached()} / {output[-300:]!r}")
    if host.victim.poll() is not None:
        found.append(f"the victim process died (status {host.victim.returncode})")
    if "REACHED" in output:
        found.append(f"system calls reached the kernel: {[line for line in output.splitlines() if 'REACHED' in line]}")
    if " attached" in output:
        found.append("ptrace attached to a host process")
    if attempt.name == "list_host_processes":
        # In its own PID namespace the worker is pid 1 and alone: any other pid is someone else's.
        others = [line for line in result.stdout.splitlines() if line.split(" ", 1)[0] != "1"]
        if others:
            found.append(f"other processes were visible in /proc: {others[:5]}")
    if result.killed_reason not in attempt.reasons:
        found.append(f"ended with reason {result.killed_reason}, expected one of {sorted(map(str, attempt.reasons))} "
                     f"(exit status {result.exit_code}, {result.cpu_s:.3f} CPU s, {result.wall_s:.2f} s)")
    if attempt.must_exit_zero and result.exit_code != 0:
        found.append(f"exit status {result.exit_code}: {result.stderr[-500:]!r}")
    return found


async def attempt_escape(pool: SandboxPool, attempt: Attempt, host: Host, timeout_s: float) -> tuple[SandboxResult, list[str]]:
    """Run ``attempt`` in ``pool``; the result and how it escaped (empty: contained, and the pool serves on)."""
    result = await pool.run(attempt.code(host), timeout_s=timeout_s)
    found = how_it_escaped(attempt, result, host)
    leftovers = leftover_processes(host.token)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while leftovers and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        leftovers = leftover_processes(host.token)
    if leftovers:
        found.append(f"processes left behind on the host: {leftovers}")
    after = await pool.run("print(input() * 2)", stdin="ok\n", timeout_s=timeout_s)
    if after.stdout != "okok\n":
        found.append(f"the pool did not serve the next job: {after}")
    return result, found
