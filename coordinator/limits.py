"""Per-address limits on the coordinator's listening sockets, the process's descriptor budget, and handing
freed memory back to the OS.

An address is keyed as the network hands one party its addresses (``protos.netaddr.address_key``): an
IPv4 address as it is, an IPv6 address by its /64, an IPv4-mapped IPv6 address as its IPv4 address.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from veriroll.protos.netaddr import address_key

log = logging.getLogger("veriroll.coordinator.limits")


class PeerGate:
    """At most ``limit`` things (requests in flight, open connections) at once per address.

    ``acquire`` answers False over the limit and counts the refusal; every True must be matched by one
    ``release``. Used from one event loop; not thread-safe. Addresses with nothing held are forgotten,
    so memory grows with the addresses active at once, never with the addresses ever seen.
    """

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit}")
        self.limit = limit
        self.refused = 0
        self._held: dict[str, int] = {}

    def acquire(self, address: str) -> bool:
        key = address_key(address)
        held = self._held.get(key, 0)
        if held >= self.limit:
            self.refused += 1
            return False
        self._held[key] = held + 1
        return True

    def release(self, address: str) -> None:
        key = address_key(address)
        held = self._held.get(key, 0)
        if held <= 0:
            raise RuntimeError(f"release without acquire for {key}")
        if held == 1:
            del self._held[key]
        else:
            self._held[key] = held - 1

    @contextlib.contextmanager
    def hold(self, address: str) -> Iterator[bool]:
        """``with gate.hold(address) as admitted:``; released on leaving the block if it was admitted."""
        admitted = self.acquire(address)
        try:
            yield admitted
        finally:
            if admitted:
                self.release(address)

    def held(self, address: str) -> int:
        """What ``address`` (with everything else in its /64 for IPv6) holds now."""
        return self._held.get(address_key(address), 0)

    def __len__(self) -> int:
        """Addresses holding anything now."""
        return len(self._held)


# --- file descriptors: every connection holds one, and so does every file the process opens ----------------

FD_RESERVE = 256
"""Descriptors kept for the process's own files whatever its ports hold: the store (SQLite's database, WAL
and shared memory per connection, or PostgreSQL's sockets), model and checkpoint files, reward workers'
pipes, the log."""

@dataclass(frozen=True)
class DescriptorBudget:
    """How the descriptor limit is shared: connections each port may hold at once, and the reserve for the
    process's own files. Past its share a port closes new connections at accept, so a flood of them can
    take the port's share and no more: the store, the checkpoints and the other ports keep theirs."""

    limit: int
    grpc_connections: int
    http_connections: int
    origin_connections: int
    origin_transfers: int
    reserve: int = FD_RESERVE

    @classmethod
    def plan(cls, limit: int, *, grpc: int = 0, http: int, origin: tuple[int, int] | None = None,
             reserve: int = FD_RESERVE) -> DescriptorBudget:
        """``grpc`` connections (0: what the rest leaves), ``http`` and the origin relay's (connections,
        transfers) as configured, each lowered where the limit cannot hold them all: the HTTP port to an
        eighth of the room and the origin relay to a quarter (nodes can fetch from other relays), and the
        gRPC port, the nodes' only way in, gets the rest (at least 16)."""
        reserve = min(reserve, limit // 4)  # a small limit keeps a quarter for files
        room = max(64, limit - reserve)
        http = min(http, max(8, room // 8))
        origin_connections, origin_transfers = origin or (0, 0)
        if origin_connections + origin_transfers > room // 4:
            share = room // 4
            origin_transfers = max(1, min(origin_transfers, share // 3))
            origin_connections = max(1, share - origin_transfers)
        left = max(16, room - http - origin_connections - origin_transfers)
        return cls(limit, min(grpc, left) if grpc else left, http, origin_connections, origin_transfers, reserve)

    def summary(self) -> str:
        origin = (f", the origin relay {self.origin_connections} connections and {self.origin_transfers} transfers"
                  if self.origin_connections else "")
        return (f"descriptor limit {self.limit}: gRPC {self.grpc_connections} connections, HTTP "
                f"{self.http_connections}{origin}, {self.reserve} kept for files")


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        log.info("no malloc_trim in the C library (%s): freed memory is handed back only as the allocator decides", name)
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Free the young generations' reference cycles, then hand freed heap pages back to the OS (glibc
    ``malloc_trim(0)``); False where the C library cannot do the second.

    Why the collection: an exception's traceback that holds a request handler's frame holds the request
    body with it, in a reference cycle, and a coordinator that goes quiet after a flood allocates too
    little to trigger the collector. The edge no longer makes that cycle for a refusal (the abort does not
    chain it; see ``server._Edge``), but a cancelled or failed call still can. Why the trim: glibc raises
    its mmap threshold to the largest block freed so far, so later large bodies come from the heap, and
    freed heap stays in the process. Measured, 36 unsigned 8 MiB requests: 280 MB still resident 7 s later without these,
    40-55 MB with them. A young collection and a trim with nothing to return cost well under a millisecond
    (a full collection would cost 100-200 ms with a model loaded, hence young generations only).
    """
    gc.collect(1)
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
