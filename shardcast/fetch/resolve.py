"""Which version to fetch, and its manifest: ask every relay what it holds, then take the manifest of the
version wanted (``latest``: the newest any relay claims, falling back to older ones when the claim cannot be
backed by a valid manifest) from a relay that claims it, checking the signature first, then the manifest's
rules, then that its version is the one asked for (a relay serving an old version under a new name is
caught here)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import TYPE_CHECKING

import aiohttp

from ..errors import (
    ManifestError,
    ManifestSignatureError,
    NoRelayReachableError,
    VersionGoneError,
    WrongVersionError,
)
from ..manifest import MAX_MANIFEST_BYTES, Manifest, verify_manifest
from .failures import _describe, _Failure, _kind_of, _read_capped
from .relays import _Relay

if TYPE_CHECKING:
    from .version import _Fetch

SMALL_ANSWER_S = 5.0
"""The longest a relay may take to send a small answer (``/status``, a manifest) once connected, if less than
``read_timeout``. A healthy relay answers them from memory in milliseconds, even while it streams shards
to hundreds of clients; one that stopped answering (a paused machine, a path that drops packets) is given
up after this instead of the whole read timeout, which every fetch paid again (and a mirror twice per
round: its own probe, then the fetch's)."""


def small_answer_timeout(connect_timeout: float, read_timeout: float) -> aiohttp.ClientTimeout:
    """The whole-request timeout of a small answer (``/status``, a manifest): see ``SMALL_ANSWER_S``."""
    return aiohttp.ClientTimeout(total=connect_timeout + min(read_timeout, SMALL_ANSWER_S))


async def probe(fetch: _Fetch, relay: _Relay) -> None:
    """Ask ``relay`` for ``/status``: whether it is up, and the versions it holds or streams."""
    try:
        async with fetch.session.get(f"{relay.url}/status", timeout=fetch.small_timeout) as resp:
            if resp.status != 200:
                raise _Failure(f"http-{resp.status}", f"GET /status answered {resp.status}")
            body = await _read_capped(resp, 1024 * 1024)
        status = json.loads(body)
        versions = status.get("versions") if isinstance(status, dict) else None
        # A mirror lists what it holds whole in "versions" and what it is still mirroring, and already
        # serves shard by shard, in "streaming": either is a version to ask it for.
        streaming = status.get("streaming", []) if isinstance(status, dict) else None
        if not isinstance(versions, list) or not isinstance(streaming, list):
            raise _Failure("bad-status", "GET /status did not list versions")
        versions = versions + streaming
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in versions):
            raise _Failure("bad-status", "GET /status did not list versions as integers")
    except _Failure as exc:
        fetch.report(relay, exc.kind, None, exc.detail, bad=False)
        return
    except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as exc:
        fetch.report(relay, _kind_of(exc), None, f"GET /status: {_describe(exc)}", bad=False)
        return
    relay.stats.reachable = True
    relay.holds = set(versions)
    relay.stats.versions = sorted(versions)


async def manifest_from(fetch: _Fetch, relay: _Relay, version: int) -> tuple[Manifest, bytes] | None:
    """Version ``version``'s manifest from ``relay``, verified; None when it could not send one; raises a
    ManifestError (and reports the relay bad) for one it sent that is refused."""
    url = f"{relay.url}/versions/{version}/manifest"
    try:
        async with fetch.session.get(url, timeout=fetch.small_timeout) as resp:
            if resp.status == 404:
                relay.gone.add(version)
                fetch.report(relay, "gone", None, f"version {version} manifest: 404", bad=False)
                return None
            if resp.status != 200:
                fetch.report(
                    relay, f"http-{resp.status}", None, f"manifest answered {resp.status}", bad=False
                )
                return None
            data = await _read_capped(resp, MAX_MANIFEST_BYTES)
    except _Failure as exc:
        fetch.report(relay, exc.kind, None, f"manifest: {exc.detail}", bad=False)
        return None
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        fetch.report(relay, _kind_of(exc), None, f"manifest: {_describe(exc)}", bad=False)
        return None
    try:
        manifest = verify_manifest(data, fetch.key, expect_version=version)
    except ManifestSignatureError as exc:
        fetch.report(relay, "bad-signature", None, str(exc), bad=True)
        raise
    except WrongVersionError as exc:
        fetch.report(relay, "wrong-version", None, f"listed as version {version}: {exc}", bad=True)
        raise
    except ManifestError as exc:
        fetch.report(relay, "invalid-manifest", None, str(exc), bad=True)
        raise
    return manifest, data


async def resolve(fetch: _Fetch) -> tuple[Manifest, bytes]:
    """The manifest (and its bytes) of the version to fetch; raises when no relay can back one."""
    await asyncio.gather(*(probe(fetch, r) for r in fetch.relays))
    up = [r for r in fetch.relays if r.reachable]
    if not up:
        details = "; ".join(f"{i.relay}: {i.detail}" for i in fetch.failures) or "no answer"
        raise NoRelayReachableError(
            f"none of the {len(fetch.relays)} relays answered ({details}); check the URLs and that "
            "the relays are running"
        )
    if fetch.version_arg == "latest":
        claimed = sorted({v for r in up for v in r.holds}, reverse=True)
        if fetch.min_version is not None:
            claimed = [v for v in claimed if v >= fetch.min_version]
    else:
        claimed = [int(fetch.version_arg)]
    sig_errors: list[str] = []
    invalid: list[ManifestError] = []
    for version in claimed:
        holders = [r for r in up if r.has(version)]
        random.shuffle(holders)
        for relay in holders:
            try:
                got = await manifest_from(fetch, relay, version)
            except ManifestSignatureError as exc:
                sig_errors.append(f"{relay.url}: {exc}")
                continue
            except ManifestError as exc:
                invalid.append(type(exc)(f"{relay.url}: {exc}"))
                continue
            if got is not None:
                return got
    wanted = fetch.version_arg if fetch.version_arg != "latest" else "the latest version"
    if sig_errors:
        raise ManifestSignatureError(
            f"no relay served a manifest for {wanted} signed by the coordinator key; "
            + "; ".join(sig_errors)
        )
    if invalid:
        # All refusals were an old version passed off as the wanted one: say exactly that.
        cls = (
            WrongVersionError if all(isinstance(e, WrongVersionError) for e in invalid) else ManifestError
        )
        raise cls(f"every manifest served for {wanted} was refused: " + "; ".join(map(str, invalid)))
    floor = f" (at least version {fetch.min_version})" if fetch.min_version is not None else ""
    held = {r.url: sorted(r.holds) for r in up}
    raise VersionGoneError(
        f"no reachable relay holds {wanted}{floor}; they hold {held}. The version was never published "
        "or was pruned everywhere: fetch a newer one"
    )

    # ---- output directory
