"""How a relay's answer can fail a fetch: ``_Failure``, and the checks and names that make one."""

from __future__ import annotations

import asyncio
import re

import aiohttp

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_CLIENT_ERRORS = (TimeoutError, aiohttp.ClientError)


BUSY_STATUSES = (429, 503)
MAX_RETRY_AFTER_S = 30.0


class _Failure(Exception):
    """A download attempt failed; ``bad`` when the relay served wrong data (not just a flaky network)."""

    def __init__(self, kind: str, detail: str, *, bad: bool = False, connection: bool = False,
                 retry_after: float | None = None):
        super().__init__(detail)
        self.kind, self.detail, self.bad, self.connection = kind, detail, bad, connection
        self.retry_after = retry_after  # set when the relay was busy (429/503): come back then, it is not a fault


async def _read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The whole body, or a _Failure when it is longer than ``cap`` (a relay must not make us buffer more)."""
    if resp.content_length is not None and resp.content_length > cap:
        raise _Failure("too-large", f"body of {resp.content_length} bytes, more than {cap}")
    parts, size = [], 0
    while chunk := await resp.content.read(65536):
        size += len(chunk)
        if size > cap:
            raise _Failure("too-large", f"body longer than {cap} bytes")
        parts.append(chunk)
    return b"".join(parts)


def _check_range(resp: aiohttp.ClientResponse, start: int, end: int, what: str) -> None:
    """A 206 answer covers exactly bytes ``start..end-1``, or the relay is bad."""
    m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", ""))
    if not m or (int(m.group(1)), int(m.group(2))) != (start, end - 1):
        raise _Failure("wrong-length", f"asked {what} {start}-{end - 1}, got Content-Range "
                       f"{resp.headers.get('Content-Range')!r}", bad=True)


def _kind_of(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "truncated"
    return "connection"


def _is_connection(exc: BaseException) -> bool:
    return isinstance(exc, aiohttp.ClientConnectionError) and not isinstance(exc, aiohttp.ServerTimeoutError)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__



def _failure_of(exc: BaseException, read_timeout: float | None) -> _Failure:
    """A client error of a ranged download (``_CLIENT_ERRORS``) as the failure it counts as."""
    if isinstance(exc, TimeoutError):  # also aiohttp's ServerTimeoutError (connect or read)
        return _Failure("timeout", f"{_describe(exc)} (read timeout {read_timeout} s)")
    if isinstance(exc, aiohttp.ClientPayloadError):
        return _Failure("truncated", _describe(exc))
    return _Failure(_kind_of(exc), _describe(exc), connection=_is_connection(exc))


def retry_after_s(value: str | None) -> float:
    """A busy relay's ``Retry-After`` in seconds (delta form), in [0.5, MAX_RETRY_AFTER_S]; 1 s if absent or odd."""
    try:
        seconds = float(value) if value is not None else 1.0
    except ValueError:
        seconds = 1.0
    if seconds != seconds:  # NaN
        seconds = 1.0
    return min(MAX_RETRY_AFTER_S, max(0.5, seconds))
