"""The ledger: who the nodes are, their standing, what was refused and what they are credited.

It owns the ``nodes`` rows and the refusal counts. Every refusal of every request is counted here,
exactly once: in ``veriroll_rejections_total`` and in the store (per node and reason, the event itself
for authenticated nodes), with a strike for hard failures, and a ban at ``intake.max_strikes``.

Nodes are looked up one by one by id (the table's primary key) and kept in a bounded cache for a
couple of seconds, so a request costs the same at 10 or 10,000 registered nodes, and a ban or unban
made from another process (the operator's CLI writes the database) takes effect within that time.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from veriroll.coordinator import store as st
from veriroll.coordinator.metrics import CoordinatorMetrics
from veriroll.protos.reasons import Reason
from veriroll.protos.v1 import coordinator_pb2 as pb

log = logging.getLogger("veriroll.coordinator")

CACHE_TTL_MS = 60_000
"""How long a looked-up node is trusted before it is read again, whatever the feed of standing changes said
(a backstop: a change shows within ``follow_standing_changes``' period, a second in housekeeping)."""
CACHE_SIZE = 100_000
CHANGES_SLACK_MS = 10_000
"""Each read of the feed looks this far before the newest change it saw: a change noted earlier by a
transaction that committed later (another edge's) is still found; one already applied is skipped by its seq."""
CHANGES_PAGE = 1000
"""Most changes read at once; a full page means more are waiting: the whole cache is dropped instead, and the
feed read on past them."""


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    public_key: bytes
    standing: st.Standing
    ban_reason: str = ""


def _info(row: st.NodeRow) -> NodeInfo:
    return NodeInfo(row.node_id, row.public_key, row.standing, row.ban_reason)


class Ledger:
    def __init__(self, db: st.Database, metrics: CoordinatorMetrics, clock: Callable[[], int], *, max_strikes: int,
                 probation_groups: int, session_ttl_s: float):
        self.db = db
        self.metrics = metrics
        self.clock = clock
        self.max_strikes = max_strikes
        self.probation_groups = probation_groups
        self.session_ttl_ms = int(session_ttl_s * 1000)
        self._cache: OrderedDict[str, tuple[NodeInfo | None, int]] = OrderedDict()
        self._changes_since: int | None = None  # the feed's read position (the database's ms), None before it
        self._applied: dict[int, int] = {}  # seq -> changed ms of the changes inside the slack window
        self._past_seq = -1  # after a page overflowed: changes of _changes_since's millisecond up to it were covered

    # --- who is asking ------------------------------------------------------------------------------

    async def lookup(self, node_id: str) -> NodeInfo | None:
        """The registered node ``node_id``, or None: one primary-key read when it is not cached (first seen,
        its standing changed, or CACHE_TTL_MS passed)."""
        now = self.clock()
        hit = self._cache.get(node_id)
        if hit is not None and hit[0] is not None and now - hit[1] < CACHE_TTL_MS:
            self._cache.move_to_end(node_id)
            return hit[0]
        # Inline on SQLite (one row by key): every request of a node not seen for CACHE_TTL_MS comes here,
        # and the hop to the reader thread and back cost more than the read.
        row = await self.db.run_read(lambda c: st.node_by_id(c, node_id), inline=True)
        node = None if row is None else _info(row)
        if node is not None:  # unknown keys are not cached: a flood of them must not evict real nodes
            self._remember(node)
        return node

    def _remember(self, node: NodeInfo) -> None:
        self._cache[node.node_id] = (node, self.clock())
        self._cache.move_to_end(node.node_id)
        while len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)

    def forget(self, node_id: str) -> None:
        """Drop a cached node (its standing changed): the next lookup reads it again."""
        self._cache.pop(node_id, None)

    async def follow_standing_changes(self) -> int:
        """Drop the cached nodes whose standing changed since the last call, wherever it changed (another
        edge, the operator's CLI): one read of the store's feed (``st.standing_changes``), the same cost at
        10 or 10,000 nodes. Returns how many cached nodes were dropped."""
        if self._changes_since is None:  # start at the newest change, less the slack, like any later read
            newest = await self.db.run_read(st.newest_standing_change_ms)
            self._changes_since = 0 if newest is None else max(0, newest - CHANGES_SLACK_MS)
        since, past_seq = self._changes_since, self._past_seq
        rows = await self.db.run_read(lambda c: st.standing_changes(c, since, CHANGES_PAGE, past_seq))
        if len(rows) >= CHANGES_PAGE:
            # More changes than a page (a mass ban): drop the whole cache and go on past every change noted
            # before the drop; a node read again from here on is read as it is now. Past them is past the
            # newest change's seq within its millisecond, not past the millisecond: a change noted in that
            # same millisecond after the drop (seen: the next standing change, on a fast machine) still arrives.
            newest_ms, newest_seq = await self.db.run_read(st.newest_standing_change)
            dropped = len(self._cache)
            self._cache.clear()
            self._changes_since, self._past_seq, self._applied = newest_ms, newest_seq, {}
            return dropped
        dropped = 0
        for seq, node_id, changed_ms in rows:
            if seq not in self._applied:
                self._applied[seq] = changed_ms
                dropped += self._cache.pop(node_id, None) is not None
        if rows:
            self._changes_since = max(since, max(ms for _, _, ms in rows) - CHANGES_SLACK_MS)
            self._applied = {seq: ms for seq, ms in self._applied.items() if ms >= self._changes_since}
            if self._changes_since != since:  # moved past the millisecond the seq bound was for
                self._past_seq = -1
        return dropped

    # --- registration and liveness ------------------------------------------------------------------

    async def register(self, node_id: str, public_key: bytes, hardware: dict, software_version: str,
                       display_name: str, session: st.Session) -> NodeInfo | st.LiveSession:
        """Insert or refresh a node (fields already bounded; its standing is kept across registrations) and
        make ``session`` the key's live one; or, changing nothing, the other session that holds the key."""
        now = self.clock()

        def op(conn):
            live = st.other_live_session(conn, node_id, session, now, self.session_ttl_ms)
            if live is not None:
                return live
            return st.register_node(conn, node_id, public_key, now, hardware, software_version, display_name, session)

        row = await self.db.run(op)
        if isinstance(row, st.LiveSession):
            return row
        node = _info(row)
        self._remember(node)
        return node

    async def touch(self, node: NodeInfo, loaded_version: int, session: st.Session, *,
                    stopping: bool = False) -> int | st.LiveSession:
        """A heartbeat from ``session``: the time it was recorded at, or, changing nothing, the other
        session that holds the key. A ``stopping`` session gives the key and its open leases up."""
        now = self.clock()

        def op(conn):
            live = st.other_live_session(conn, node.node_id, session, now, self.session_ttl_ms)
            if live is not None:
                return live
            st.touch_node(conn, node.node_id, now, loaded_version, session)
            if stopping:
                st.end_session(conn, node.node_id, session.session_id)
                st.release_open_leases(conn, node.node_id)
            return now

        return await self.db.run(op)

    async def ledger(self, node: NodeInfo) -> pb.LedgerResponse:
        row = await self.db.run_read(lambda c: st.node_ledger(c, node.node_id))
        return pb.LedgerResponse(
            node_id=node.node_id, standing=row["standing"], accepted_groups=row["accepted_groups"],
            accepted_tokens=row["accepted_tokens"], strikes=row["strikes"],
            rejections_by_reason=row["rejections_by_reason"], credits=float(row["accepted_tokens"]),
            ban_reason=row["ban_reason"] if row["standing"] == st.Standing.BANNED else "",
        )

    # --- refusals -------------------------------------------------------------------------------------

    def refusal_op(self, node_id: str, reason: Reason, detail: str = "", lease_id: str = "",
                   also: Callable | None = None, *, log_event: bool = True) -> Callable:
        """The store op that records one refusal (and strike, and ban); ``also`` runs in the same transaction.
        ``log_event=False`` counts it without keeping the event itself."""
        now = self.clock()
        limit = self.max_strikes

        def op(conn):
            if also is not None:
                also(conn)
            return st.record_refusal(conn, node_id, reason.value, strike=reason.strike, strike_limit=limit,
                                     lease_id=lease_id, detail=detail, now_ms=now, log_event=log_event)

        return op

    async def refuse(self, node_id: str, reason: Reason, detail: str = "", lease_id: str = "",
                     also: Callable | None = None, *, log_event: bool = True) -> None:
        """Record one refusal, durably, then count it in the metrics: counted once committed even when the
        caller is cancelled meanwhile (gRPC ends a call it refused itself, an over-size body, while its handler
        is still recording the refusal), so the store and the metric never disagree."""
        stored = asyncio.ensure_future(self.db.run(self.refusal_op(node_id, reason, detail, lease_id, also,
                                                                   log_event=log_event)))

        def count(done: asyncio.Future) -> None:  # before the caller resumes: callbacks run in order
            if not done.cancelled() and done.exception() is None:
                self.counted(node_id, reason, done.result())

        stored.add_done_callback(count)
        await asyncio.shield(stored)

    def counted(self, node_id: str, reason: Reason, banned_at: int | None = None) -> None:
        """The metric side of a refusal whose store op has committed."""
        self.metrics.rejections.inc(reason=reason.value)
        if node_id and reason.strike:
            self.forget(node_id)
        if banned_at is not None:
            log.warning("banned node %s after %d strikes (last: %s)", node_id, banned_at, reason.value)
