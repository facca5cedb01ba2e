"""A throwaway PostgreSQL cluster for the tests: initdb and pg_ctl from Debian's packages, run as the
``postgres`` user (PostgreSQL refuses to run as root), listening only on a Unix socket in a temp dir.

One cluster per test session; each test gets a fresh database in it. Skipped, with the reason, where
the binaries or psycopg are missing. ``fsync`` is off in this cluster: the tests check behaviour, and
durability is PostgreSQL's own (the store commits before it answers, as on SQLite).
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import tempfile
import uuid
from pathlib import Path


def find_bin() -> Path | None:
    for candidate in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if (Path(candidate) / "initdb").exists():
            return Path(candidate)
    found = shutil.which("initdb")
    return Path(found).parent if found else None


def unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    try:
        import psycopg  # noqa: F401 - only probing the install
    except ImportError:
        return "psycopg is not installed (pip install 'veriroll[postgres]')"
    if find_bin() is None:
        return "PostgreSQL is not installed (apt-get install postgresql)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: cannot start PostgreSQL as another user"
    return None


class Cluster:
    def __init__(self):
        self.bin = find_bin()
        self.dir = Path(tempfile.mkdtemp(prefix="veriroll-pg-"))
        self.data, self.sock = self.dir / "data", self.dir / "sock"
        self.sock.mkdir()
        as_root = os.geteuid() == 0
        self._prefix = ["runuser", "-u", "postgres", "--"] if as_root else []
        if as_root:
            os.chmod(self.dir, 0o755)
            shutil.chown(self.dir, "postgres", "postgres")
            shutil.chown(self.sock, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        self.start_server()

    def start_server(self) -> None:
        """Start the server (again), waiting until it accepts connections."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "start",
                  "-o", f"-k {self.sock} -h '' -F -c max_connections=200")

    def stop_server(self) -> None:
        """Stop the server as an operator would (``-m fast``: every session is closed, open transactions
        rolled back), keeping the data: a fault for the tests; :meth:`start_server` brings it back."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every client's connection is closed under it."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-m", "fast", "-w", "restart",
                  "-o", f"-k {self.sock} -h '' -F -c max_connections=200")

    def freeze(self) -> list[int]:
        """SIGSTOP the server and every backend: it accepts connections and reads nothing, answers nothing (a
        hung server, or a network path that drops packets without a reset). The pids, for :meth:`thaw`."""
        import psutil

        master = psutil.Process(int((self.data / "postmaster.pid").read_text().split()[0]))
        pids = [master.pid, *(p.pid for p in master.children(recursive=True))]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        return pids

    def thaw(self, pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run([*self._prefix, str(self.bin / tool), *args], check=True, capture_output=True, timeout=120)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@/{database}?host={self.sock}"

    def new_database(self) -> str:
        import psycopg

        name = "t_" + uuid.uuid4().hex[:16]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")
        except subprocess.CalledProcessError:
            pass  # a test stopped the server and failed before it started it again
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def throwaway_cluster():
    """Start a throwaway cluster, yield it, stop it (a fixture's body); skip the test where none can run."""
    import pytest

    why = unavailable()
    if why is not None:
        pytest.skip(why)
    cluster = Cluster()
    yield cluster
    cluster.stop()
