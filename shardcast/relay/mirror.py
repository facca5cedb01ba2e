"""Mirroring: every ``poll_interval`` seconds, fetch the newest ``keep`` versions the upstreams hold.

``_Mirror`` is part of ``RelayServer``; it uses the server's ``config``, ``key``, ``store``, ``fetch_options``,
the catalogue (``refresh``, ``versions``, ``held``, ``streaming``) and the mirror's state (``mirror_*``,
``_mirror_backoff``, ``_only_on_fallbacks``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from ..errors import ShardcastError
from ..fetch import DEFAULT_CONNECT_TIMEOUT, FetchResult, fetch_version, small_answer_timeout
from ..manifest import Manifest
from ..store import prune, remove_tree, version_dir
from .catalogue import StreamingVersion

log = logging.getLogger("veriroll.shardcast.relay")


class _Mirror:
    """The mirror's rounds: what the upstreams (and, when they fall behind, the fallbacks) hold, fetched."""

    async def _upstream_versions(self, session: aiohttp.ClientSession, urls: Sequence[str]) -> set[int]:
        timeout = small_answer_timeout(DEFAULT_CONNECT_TIMEOUT, self.fetch_options.get("read_timeout", 20.0))

        async def one(url: str) -> list[int]:
            try:
                async with session.get(f"{url}/status", timeout=timeout) as resp:
                    if resp.status != 200:
                        return []
                    status = json.loads(await resp.read())
            except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
                log.info("upstream %s did not answer /status: %s", url, exc)
                return []
            if not isinstance(status, dict):
                return []
            versions, streaming = status.get("versions"), status.get("streaming", [])
            if not isinstance(versions, list) or not isinstance(streaming, list):
                return []
            return [v for v in versions + streaming if isinstance(v, int) and not isinstance(v, bool) and v >= 0]

        results = await asyncio.gather(*(one(u) for u in urls))
        return {v for vs in results for v in vs}

    def _overdue_on_fallbacks(self, upstream: set[int], fallback: set[int], now: float) -> set[int]:
        """Versions a fallback has listed, and no upstream, for ``fallback_after`` seconds or more."""
        alone = {v for v in fallback - upstream if v not in self.held}
        for v in list(self._only_on_fallbacks):
            if v not in alone:
                del self._only_on_fallbacks[v]
        for v in alone:
            self._only_on_fallbacks.setdefault(v, now)
        return {v for v, since in self._only_on_fallbacks.items() if now - since >= self.config.fallback_after}

    async def mirror_once(self) -> list[int]:
        """One mirroring round: fetch the newest ``keep`` upstream versions not held yet; returns them.

        A version that only the fallbacks have listed, for ``fallback_after`` seconds, is fetched from them:
        an upstream that stopped answering (it lists nothing) or one stuck behind its own upstream (it
        lists older versions only) holds back no version for longer. While the upstreams keep up, the
        fallbacks are asked for their list and nothing else."""
        async with aiohttp.ClientSession(trust_env=False) as session:
            claimed, listed = await asyncio.gather(self._upstream_versions(session, self.upstreams),
                                                   self._upstream_versions(session, self.fallbacks))
        rescued = self._overdue_on_fallbacks(claimed, listed, time.monotonic()) if self.fallbacks else set()
        claimed |= rescued
        now = time.monotonic()
        # Versions that failed recently wait their turn, so an upstream claiming versions it cannot back
        # with a signed manifest does not crowd out the real ones.
        usable = sorted((v for v in claimed if self._mirror_backoff.get(v, (0, 0.0))[1] <= now), reverse=True)
        self.refresh(force=True)
        held = self.versions()
        floor = held[-self.config.keep] if len(held) >= self.config.keep else -1
        wanted = [v for v in usable[: self.config.keep] if v not in self.held and v > floor]
        fetched = []
        for v in wanted:
            self.mirror_fetching = v

            def staged(manifest: Manifest, manifest_bytes: bytes, staging: Path, v: int = v) -> None:
                self.streaming[v] = StreamingVersion(v, manifest, manifest_bytes, staging, version_dir(self.store, v))

            def verified(name: str, offset: int, size: int, v: int = v) -> None:
                if v in self.streaming:
                    self.streaming[v].add(name, offset, size)

            if v in rescued:
                log.warning("version %d is on the fallback upstreams only, for %.0f s or more: mirroring it from %s",
                            v, self.config.fallback_after, ", ".join(self.fallbacks))
            try:
                result = await _fetch_on_own_loop(
                    self.fallbacks if v in rescued else self.upstreams, self.key, version_dir(self.store, v), v,
                    bases=[version_dir(self.store, h) for h in reversed(self.versions())], keep_delta=True,
                    on_staged=staged, on_verified=verified, **self.fetch_options,
                )  # fmt: skip
            except ShardcastError as exc:
                failures = self._mirror_backoff.get(v, (0, 0.0))[0] + 1
                self._mirror_backoff[v] = (
                    failures,
                    time.monotonic() + min(300.0, self.config.poll_interval * 2**failures),
                )
                self.mirror_last_error = f"version {v}: {type(exc).__name__}: {exc}"
                log.error("mirroring version %d failed: %s", v, self.mirror_last_error)
                continue
            finally:
                self.mirror_fetching = None
                self.refresh(force=True)  # a version just renamed into place is held before waiters wake
                streaming = self.streaming.pop(v, None)
                if streaming is not None:
                    streaming.end()
            self._mirror_backoff.pop(v, None)
            self.mirror_last_error = None
            if result.bad_relays:
                log.warning("while mirroring version %d, bad upstreams: %s", v, sorted(result.bad_relay_urls))
            fetched.append(v)
            self.refresh(force=True)
        if fetched:
            prune(self.store, self.config.keep)
            self._remove_stale_partials()
            self.refresh(force=True)
        return fetched

    def _remove_stale_partials(self) -> None:
        held = self.versions()
        if not held:
            return
        for entry in self.store.glob(".v*.shardcast-partial"):
            number = entry.name[2:].split(".", 1)[0]
            if number.isdigit() and int(number) < held[0]:
                remove_tree(entry)

    async def _mirror_loop(self) -> None:
        while True:
            try:
                await self.mirror_once()
            except asyncio.CancelledError:
                raise
            # Blind on purpose: whatever one round hits (it is logged with its traceback and shown in
            # /status), the relay keeps serving what it holds and tries again next round.
            except Exception as exc:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise asyncio.CancelledError from exc  # stopping: whatever the round hit on its way out
                self.mirror_last_error = f"{type(exc).__name__}: {exc}"
                log.exception("mirror round failed")
            await asyncio.sleep(self.config.poll_interval)


async def _fetch_on_own_loop(*args, on_staged, on_verified, **kwargs) -> FetchResult:
    """``fetch_version`` on an event loop of its own, in a thread; its callbacks run on the caller's loop.

    A mirror serves while it fetches. On one loop, its download's socket reads queue behind the
    ``sendfile`` calls of every client it streams to, so the head of the pipeline slows as the tree
    fills (measured: the mirrors' download took as long as the whole tree). On a loop of its own the
    download is not starved, and both threads spend their time in system calls, without the GIL.
    Cancelling the caller cancels the fetch and waits for it to end.
    """
    caller = asyncio.get_running_loop()
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Task]] = []
    cancelled = threading.Event()

    async def fetch() -> FetchResult:
        running.append((asyncio.get_running_loop(), asyncio.current_task()))
        if cancelled.is_set():
            raise asyncio.CancelledError
        return await fetch_version(
            *args,
            on_staged=lambda *a: caller.call_soon_threadsafe(on_staged, *a),
            on_verified=lambda *a: caller.call_soon_threadsafe(on_verified, *a),
            **kwargs,
        )

    done = caller.run_in_executor(None, asyncio.run, fetch())
    try:
        return await asyncio.shield(done)
    except asyncio.CancelledError:
        # Set before looking, and the thread registers before it checks: one of the two sees the other.
        cancelled.set()
        for loop, task in running:
            # A loop already closed ran its fetch to the end: there is nothing left to cancel. (Raising here
            # turned the cancellation into a RuntimeError, which the mirror loop logged and went on from,
            # so that a relay stopping at that moment never stopped; seen under load.)
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(task.cancel)
        with contextlib.suppress(BaseException):
            await done
        raise

