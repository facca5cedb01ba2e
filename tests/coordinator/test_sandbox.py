"""The sandbox for model-written code: real bubblewrap containers, no mocks.

Every escape attempt (tests/coordinator/sandbox_escapes.py) must be contained, end with the right reason
and leave the pool serving the next job. Skipped as a whole where bubblewrap cannot create a sandbox
(the pool refusing to start there is itself tested).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from veriroll.coordinator import sandbox
from veriroll.coordinator.sandbox import (
    KillReason,
    SandboxClosed,
    SandboxLimits,
    SandboxPool,
    SandboxUnavailable,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sandbox_escapes import ATTEMPTS, attempt_escape, host_targets, leftover_processes

# Small limits keep each attempt to a few seconds; the wall limit is generous for a loaded machine.
LIMITS = SandboxLimits(wall_s=3.0, cpu_s=2, memory_bytes=256 * 2**20, processes=16, output_bytes=2**20)
TIMEOUT_S = 3.0


def _bwrap_works() -> str | None:
    try:
        SandboxPool(1, LIMITS, warm=False).close()
    except SandboxUnavailable as error:
        return str(error)
    return None


UNAVAILABLE = _bwrap_works()
needs_bwrap = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"no bubblewrap sandbox here: {UNAVAILABLE}")


def run(coroutine):
    return asyncio.run(coroutine)


@needs_bwrap
@pytest.mark.parametrize("attempt", ATTEMPTS, ids=[attempt.name for attempt in ATTEMPTS])
def test_escape_attempt_is_contained_and_the_pool_serves_on(attempt, tmp_path):
    async def scenario():
        with SandboxPool(1, LIMITS) as pool, host_targets(tmp_path / "host") as host:
            result, escaped = await attempt_escape(pool, attempt, host, TIMEOUT_S)
            assert escaped == [], f"{attempt.name} escaped: {escaped}\n{result}"
            assert pool.kill_counts[result.killed_reason] == (1 if result.killed_reason else 0)

    run(scenario())


@needs_bwrap
def test_stdin_reaches_stdout_and_exit_codes_come_back():
    async def scenario():
        with SandboxPool(2, LIMITS) as pool:
            echoed = await pool.run("import sys\nprint(sys.stdin.read().upper(), end='')", stdin="héllo\nworld\n")
            assert (echoed.exit_code, echoed.stdout, echoed.killed_reason) == (0, "HÉLLO\nWORLD\n", None)
            assert echoed.ok
            exited = await pool.run("import sys\nprint('bye', file=sys.stderr)\nsys.exit(3)")
            assert (exited.exit_code, exited.stderr, exited.killed_reason) == (3, "bye\n", None)
            failed = await pool.run("raise ValueError('model bug')")
            assert failed.exit_code == 1 and "ValueError: model bug" in failed.stderr
            assert failed.killed_reason is None and not failed.ok
            assert pool.runs == 3 and sum(pool.kill_counts.values()) == 0

    run(scenario())


@needs_bwrap
def test_each_run_gets_a_fresh_filesystem():
    async def scenario():
        with SandboxPool(1, LIMITS) as pool:
            wrote = await pool.run("import os\nopen('left.txt', 'w').write('x')\nprint(os.getcwd(), os.listdir('.'))")
            assert wrote.stdout == "/tmp ['left.txt']\n"
            looked = await pool.run("import os\nprint(os.listdir('.'), os.path.exists('/tmp/left.txt'))")
            assert looked.stdout == "[] False\n"

    run(scenario())


@needs_bwrap
def test_environment_is_empty_and_the_user_unprivileged():
    async def scenario():
        with SandboxPool(1, LIMITS) as pool:
            seen = await pool.run("import os\nprint(sorted(os.environ), os.getuid() == 0, os.listdir('/'))")
            names, is_root, top = seen.stdout.rsplit("] ", 1)[0] + "]", *seen.stdout.rsplit("] ", 1)[1].split(" ", 1)
            assert names == "['HOME', 'LANG', 'PATH', 'PWD']"
            assert is_root == "False"
            assert "work" not in top and "root" not in top and "home" not in top

    run(scenario())


@needs_bwrap
def test_oversized_code_and_stdin_are_refused_before_running():
    async def scenario():
        limits = SandboxLimits(code_bytes=100, stdin_bytes=100)
        with SandboxPool(1, limits) as pool:
            long_code = await pool.run("print(1)" + " " * 200)
            long_stdin = await pool.run("print(1)", stdin="x" * 200)
            for result in (long_code, long_stdin):
                assert (result.exit_code, result.killed_reason) == (None, KillReason.INPUT_LIMIT)
            assert pool.kill_counts[KillReason.INPUT_LIMIT] == 2
            assert (await pool.run("print(1)")).stdout == "1\n"

    run(scenario())


@needs_bwrap
def test_runs_beyond_size_wait_for_a_slot_and_all_complete():
    async def scenario():
        with SandboxPool(2, LIMITS) as pool:
            results = await asyncio.gather(*(pool.run(f"print({n} * 2)") for n in range(6)))
            assert [result.stdout for result in results] == [f"{n * 2}\n" for n in range(6)]

    run(scenario())


@needs_bwrap
def test_close_stops_running_code_and_refuses_new_runs():
    async def scenario():
        pool = SandboxPool(1, LIMITS)
        running = asyncio.ensure_future(pool.run("import time\ntime.sleep(60)", timeout_s=60))
        await asyncio.sleep(0.3)
        pool.close()
        result = await running  # the kill ends it at once; pytest's timeout guards a hang
        assert result.killed_reason == KillReason.CLOSED and result.exit_code is None
        with pytest.raises(SandboxClosed):
            await pool.run("print(1)")

    run(scenario())


def test_missing_bubblewrap_fails_closed(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match="bubblewrap"):
        SandboxPool(1, LIMITS)


@needs_bwrap
def test_sandbox_that_cannot_start_fails_closed():
    with pytest.raises(SandboxUnavailable, match="could not create a sandbox.*nonexistent"):
        SandboxPool(1, LIMITS, python="/nonexistent/bin/python3")


def test_named_weaker_mode_warns_and_says_it_is_not_isolated(caplog):
    async def scenario():
        with caplog.at_level(logging.WARNING, logger="veriroll.coordinator.sandbox"):
            pool = SandboxPool(1, LIMITS, mode=sandbox.UNSAFE_SUBPROCESS_MODE)
        with pool:
            assert not pool.isolated
            assert "WITHOUT isolation" in caplog.text
            result = await pool.run("print(input() + '!')", stdin="hi\n")
            assert result.stdout == "hi!\n"
            slept = await pool.run("import time\ntime.sleep(60)", timeout_s=0.5)
            assert slept.killed_reason == KillReason.TIMEOUT

    run(scenario())


def test_architecture_without_a_filter_fails_closed_unless_told(monkeypatch):
    monkeypatch.setattr(sandbox, "refusing_filter", lambda: (_ for _ in ()).throw(
        sandbox.SeccompUnsupported("no seccomp filter is written for 'riscv64'")))
    with pytest.raises(SandboxUnavailable, match="riscv64.*seccomp=False"):
        SandboxPool(1, LIMITS)


@needs_bwrap
def test_without_seccomp_by_name_the_calls_reach_the_kernel(caplog, tmp_path):
    attempt = next(attempt for attempt in ATTEMPTS if attempt.name == "reach_kernel_attack_surface")

    async def scenario():
        with caplog.at_level(logging.WARNING, logger="veriroll.coordinator.sandbox"):
            pool = SandboxPool(1, LIMITS, seccomp=False)
        assert "without a seccomp filter" in caplog.text
        with pool, host_targets(tmp_path / "host") as host:
            _, escaped = await attempt_escape(pool, attempt, host, TIMEOUT_S)
            assert any("system calls reached the kernel" in line for line in escaped)

    run(scenario())


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode"):
        SandboxPool(1, LIMITS, mode="subprocess")


@pytest.mark.parametrize("name", ["read_secret_files", "write_outside", "connect_sockets", "list_host_processes",
                                  "daemon_left_behind", "reach_kernel_attack_surface"])
def test_the_escape_checks_notice_an_escape_without_isolation(name, tmp_path):
    """The same attempts without the container do get out: the checks above are not vacuous."""
    attempt = next(attempt for attempt in ATTEMPTS if attempt.name == name)

    async def scenario():
        # Without a user namespace, RLIMIT_NPROC counts every process of the uid on this host: leave room.
        limits = SandboxLimits(wall_s=TIMEOUT_S, cpu_s=2, memory_bytes=256 * 2**20, processes=256)
        with SandboxPool(1, limits, mode=sandbox.UNSAFE_SUBPROCESS_MODE) as pool, \
                host_targets(tmp_path / "host") as host:
            _, escaped = await attempt_escape(pool, attempt, host, TIMEOUT_S)
            assert escaped, f"{name} got out without isolation, but no check noticed"

    run(scenario())


@needs_bwrap
def test_files_are_capped_per_file_and_in_all():
    async def scenario():
        limits = SandboxLimits(file_bytes=2**20, tmpfs_bytes=3 * 2**20)
        with SandboxPool(1, limits) as pool:
            big = await pool.run("open('big', 'wb').write(b'x' * 2 * 2**20)")
            # Python ignores SIGXFSZ, so the write fails with EFBIG.
            assert big.exit_code == 1 and "File too large" in big.stderr
            many = await pool.run("for n in range(8):\n    open(f'f{n}', 'wb').write(b'x' * (2**20 - 1))")
            assert many.exit_code == 1 and "No space left on device" in many.stderr

    run(scenario())


@needs_bwrap
def test_cpu_time_of_a_run_is_measured():
    async def scenario():
        with SandboxPool(1, LIMITS) as pool:
            busy = await pool.run("n = 0\nfor i in range(3 * 10**6):\n    n += i\nprint(n)")
            assert busy.ok and busy.cpu_s > 0.05

    run(scenario())


@needs_bwrap
def test_a_container_that_cannot_start_answers_sandbox_error():
    with SandboxPool(1, LIMITS, warm=False) as pool:
        def out_of_processes():
            raise BlockingIOError(11, "Resource temporarily unavailable")

        pool._spawn = out_of_processes
        result = pool.run_sync("print(1)")
        assert (result.exit_code, result.killed_reason) == (None, KillReason.SANDBOX_ERROR)
        assert "Resource temporarily unavailable" in result.stderr
        assert pool.kill_counts[KillReason.SANDBOX_ERROR] == 1


@needs_bwrap
def test_run_sync_serves_plain_code():
    with SandboxPool(1, LIMITS) as pool:
        assert pool.run_sync("print(int(input()) + 1)", stdin="41\n").stdout == "42\n"
        assert pool.run_sync("print('again')").stdout == "again\n"


COORDINATOR_THAT_DIES = """
import asyncio, os, sys
from veriroll.coordinator.sandbox import SandboxLimits, SandboxPool
pool = SandboxPool(2, SandboxLimits(wall_s=60))
print(*[worker.process.pid for worker in pool._ready], flush=True)

async def main():
    running = asyncio.ensure_future(pool.run(sys.argv[1], timeout_s=60))
    await asyncio.sleep(0.5)
    print("running", flush=True)
    await running

asyncio.run(main())
"""


@needs_bwrap
def test_sandboxes_die_with_the_coordinator(tmp_path):
    """SIGKILL of the process that holds a pool leaves none of its containers, warm or running."""
    with host_targets(tmp_path / "host") as host:
        sleeper = f"import os\nos.execv('/bin/sleep', ['sleep', '300.{int(host.token[:6], 16)}'])"
        coordinator = subprocess.Popen([sys.executable, "-c", COORDINATOR_THAT_DIES, sleeper],
                                       stdout=subprocess.PIPE, text=True)
        try:
            warm_pids = [int(pid) for pid in coordinator.stdout.readline().split()]
            assert coordinator.stdout.readline() == "running\n"
            assert leftover_processes(host.token), "the sleeper should be running in its sandbox"
            assert _alive(warm_pids) == warm_pids
        finally:
            coordinator.kill()
            coordinator.wait()
        deadline = time.monotonic() + 30  # a guard, not a figure: they are gone within milliseconds
        while time.monotonic() < deadline and (leftover_processes(host.token) or _alive(warm_pids)):
            time.sleep(0.05)
        assert leftover_processes(host.token) == []
        assert _alive(warm_pids) == []


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (not gone, not a zombie waiting for its reaper)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive
