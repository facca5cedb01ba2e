"""Helpers for shardcast tests: checkpoints, re-signed manifests, misbehaving relays, the CLI.

Everything runs over real sockets on 127.0.0.1 with ephemeral ports. Checkpoints are a few MiB with
small shards (256 KiB), so every path (many shards, several files, an empty file, a nested file) is
exercised without loading the shared 2-core machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from aiohttp import web

from veriroll.protos.identity import PrivateKey
from veriroll.shardcast.manifest import signing_message
from veriroll.shardcast.store import DELTA_NAME, MANIFEST_NAME, list_versions, version_dir

SHARD = 256 * 1024
REPO = Path(__file__).resolve().parents[2]


def make_checkpoint(path: Path, *, seed: int = 0, model_bytes: int = 3 * 1024 * 1024 + 12345) -> Path:
    """A small HF-like checkpoint: config, weights (not a multiple of the shard size), tokenizer, extras."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    (path / "model.safetensors").write_bytes(rng.randbytes(model_bytes))
    (path / "tokenizer.json").write_bytes(rng.randbytes(40_000))
    (path / "added_tokens.json").write_bytes(b"")
    (path / "extra").mkdir(exist_ok=True)
    (path / "extra" / "generation_config.json").write_text('{"temperature": 1}')
    (path / ".cache").mkdir(exist_ok=True)
    (path / ".cache" / "lock").write_text("not published")
    return path


def same_tree(a: Path, b: Path) -> bool:
    """True when every published file of checkpoint ``a`` is in ``b`` with the same bytes."""
    for f in a.rglob("*"):
        rel = f.relative_to(a)
        if f.is_dir() or rel.parts[0].startswith("."):
            continue
        if not (b / rel).is_file() or (b / rel).read_bytes() != f.read_bytes():
            return False
    return True


def copy_store(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def resign(
    store: Path, version: int, key: PrivateKey, mutate=None, *, as_version: int | None = None
) -> bytes:
    """The manifest of ``version`` in ``store``, altered by ``mutate(body)``, re-signed with ``key``.

    The raw body is signed (no validation), so tests can produce validly signed but invalid manifests.
    """
    body = json.loads((version_dir(store, version) / MANIFEST_NAME).read_bytes())["manifest"]
    if as_version is not None:
        body["version"] = as_version
    if mutate is not None:
        mutate(body)
    signature = key.sign(signing_message(body)).hex()
    return json.dumps(
        {"manifest": body, "signature": signature, "signer": key.public.to_line().strip()}
    ).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- misbehaving relays ------------------------------------------------------------------------------


class FakeRelay:
    """A relay speaking the shardcast URL scheme from a store, with hooks to misbehave.

    ``versions``: what /status claims (default: what the store holds). ``manifests``: version ->
    manifest bytes to serve instead of the stored one. ``on_file(version, name, start, data)``: may
    return altered bytes (``name`` is DELTA_NAME for ranges of the delta file). ``mode``: ``"silent-files"`` never answers file requests; ``"truncate"``
    announces the full length, sends half, and closes; ``"short"`` answers with a correct-looking but
    shorter 206. ``delay``: seconds to wait before answering each file request.
    """

    def __init__(
        self, store: Path, *, versions=None, manifests=None, on_file=None, mode: str | None = None, delay=0.0
    ):
        self.store, self.claimed, self.manifests = store, versions, manifests or {}
        self.on_file, self.mode, self.delay = on_file, mode, delay
        self.file_requests = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _status(self, request):
        versions = self.claimed if self.claimed is not None else list_versions(self.store)
        return web.json_response({"versions": versions, "latest": max(versions) if versions else None})

    async def _manifest(self, request):
        v = request.match_info["version"]
        if v == "latest":
            v = max(self.claimed if self.claimed is not None else list_versions(self.store))
        v = int(v)
        if v in self.manifests:
            return web.Response(body=self.manifests[v])
        path = version_dir(self.store, v) / MANIFEST_NAME
        if not path.exists():
            raise web.HTTPNotFound()
        return web.Response(body=path.read_bytes())

    async def _file(self, request):
        self.file_requests += 1
        v, name = int(request.match_info["version"]), request.match_info.get("name", DELTA_NAME)
        if self.mode == "silent-files":
            await asyncio.sleep(3600)
        if self.delay:
            await asyncio.sleep(self.delay)
        path = version_dir(self.store, v) / name
        if not path.is_file():
            raise web.HTTPNotFound()
        data = path.read_bytes()
        rng = request.http_range
        start, stop = rng.start or 0, len(data) if rng.stop is None else rng.stop
        body = data[start:stop]
        if self.on_file is not None:
            body = self.on_file(v, name, start, body)
        headers = {"Content-Range": f"bytes {start}-{stop - 1}/{len(data)}"}
        if self.mode == "short":
            body = body[: len(body) // 2]
            headers = {"Content-Range": f"bytes {start}-{start + len(body) - 1}/{len(data)}"}
        if self.mode == "truncate":
            resp = web.StreamResponse(status=206, headers=headers)
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body[: len(body) // 2])
            request.transport.close()
            return resp
        return web.Response(status=206, body=body, headers=headers)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/status", self._status)
        app.router.add_get("/versions/{version}/manifest", self._manifest)
        app.router.add_get("/versions/{version}/files/{name:.+}", self._file)
        app.router.add_get("/versions/{version}/delta", self._file)
        self.runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


class SilentServer:
    """Accepts TCP connections and never says a word (nor closes them)."""

    def __init__(self):
        self.server: asyncio.AbstractServer | None = None
        self.writers: list[asyncio.StreamWriter] = []
        self.url = ""

    async def start(self) -> str:
        async def hold(reader, writer):
            self.writers.append(writer)
            with contextlib.suppress(Exception):
                await reader.read()  # until the client gives up

        self.server = await asyncio.start_server(hold, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        for w in self.writers:
            w.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


def cli(*args: str, env=None, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``python -m veriroll.shardcast.cli ARGS``."""
    return subprocess.run(
        [sys.executable, "-m", "veriroll.shardcast.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def can_mount_tmpfs() -> bool:
    """True where ``unshare -m`` plus ``mount -t tmpfs`` work (root or user namespaces)."""
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d; rmdir $d",
        ],
        capture_output=True,
    )
    return probe.returncode == 0


async def until(predicate, what: str, *, tries: int = 600, pause: float = 0.05):
    """Poll ``await predicate()`` until it is truthy (a guard against hanging, not a time limit)."""
    for _ in range(tries):
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(pause)
    raise AssertionError(f"never happened: {what}")
