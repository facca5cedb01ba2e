"""The swarm's peer directory, shared by edge processes (shardcast/swarm/hints.py PeerDirectory).

On one SQLite process the directory lives in memory; edges sharing a PostgreSQL store each write what their
heartbeats said and read every edge's, every ``resign_s``, in one transaction (``exchange_swarm_directory``).
Both tables are bounded: at most ``max_listings`` listings (a node silent for the TTL is forgotten), reports
about at most ``max_listings`` peers, each peer's ``reports_per_peer`` newest networks (enough to decide
whether it is withheld), forgotten after the report TTL.
"""

from __future__ import annotations

import json

from veriroll.coordinator.store.db import Connection

SwarmListing = tuple[str, str, tuple[str, ...], tuple[int, ...], int]  # node id, peer id, addrs, versions, seen ms
SwarmReport = tuple[str, str, int]  # reported peer id, reporter's network, reported ms


def _present(conn: Connection, sql: str, keys: list[str]) -> set[str]:
    """Those of ``keys`` that ``sql`` (a query with one ``IN ({marks})``) finds."""
    if not keys:
        return set()
    return {r[0] for r in conn.execute(sql.format(marks=",".join("?" * len(keys))), keys)}


def write_swarm_listings(conn: Connection, listed: list[SwarmListing], dropped: list[tuple[str, int]],
                         now_ms: int, ttl_ms: int, max_listings: int) -> None:
    """Forget listings silent for ``ttl_ms``; write ``listed`` (a listing older than the stored one changes
    nothing) and take ``dropped`` (node id, when its heartbeat unlisted it) off. A node not listed yet is
    added only while fewer than ``max_listings`` are; edges that add at the same moment may overshoot, and
    the last listed go first."""
    # Every edge forgets the same expired rows: SKIP LOCKED (PostgreSQL) leaves a row another edge is deleting
    # to that edge instead of waiting on it inside a batch that holds other locks (a deadlock to retry).
    conn.execute("DELETE FROM swarm_listings WHERE node_id IN "
                 "(SELECT node_id FROM swarm_listings WHERE seen_ms < ? /*SKIP LOCKED*/)", (now_ms - ttl_ms,))
    if dropped:
        conn.executemany("DELETE FROM swarm_listings WHERE node_id = ? AND seen_ms <= ?", dropped)
    if listed:
        known = _present(conn, "SELECT node_id FROM swarm_listings WHERE node_id IN ({marks})", [x[0] for x in listed])
        room = max_listings - int(conn.execute("SELECT COUNT(*) FROM swarm_listings").fetchone()[0])
        rows = []
        for node_id, peer_id, addrs, versions, seen_ms in sorted(listed):  # rows locked in key order
            if node_id not in known:
                if room <= 0:
                    continue
                room -= 1
            rows.append((node_id, peer_id, json.dumps(list(addrs)), json.dumps(list(versions)), seen_ms, seen_ms))
        conn.executemany(
            "INSERT INTO swarm_listings(node_id, peer_id, addrs, versions, listed_ms, seen_ms) VALUES(?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(node_id) DO UPDATE SET peer_id = excluded.peer_id, addrs = excluded.addrs, "
            "versions = excluded.versions, seen_ms = excluded.seen_ms WHERE excluded.seen_ms >= swarm_listings.seen_ms",
            rows)
    over = int(conn.execute("SELECT COUNT(*) FROM swarm_listings").fetchone()[0]) - max_listings
    if over > 0:
        conn.execute("DELETE FROM swarm_listings WHERE node_id IN "
                     "(SELECT node_id FROM swarm_listings ORDER BY listed_ms DESC, node_id DESC LIMIT ?)", (over,))


def refresh_swarm_listings(conn: Connection, node_ids: list[str], seen_ms: int) -> None:
    """Nodes whose listing did not change beat again: seen at ``seen_ms``, in one statement."""
    if node_ids:
        node_ids = sorted(node_ids)
        conn.execute(f"UPDATE swarm_listings SET seen_ms = ? WHERE seen_ms < ? AND node_id IN ({','.join('?' * len(node_ids))})",
                     (seen_ms, seen_ms, *node_ids))


def write_swarm_reports(conn: Connection, reported: list[SwarmReport], now_ms: int, ttl_ms: int,
                        max_peers: int, per_peer: int) -> None:
    """Forget reports older than ``ttl_ms``; add ``reported``, about at most ``max_peers`` peers (the last
    reported go first when edges overshoot together), keeping each peer's ``per_peer`` newest networks."""
    conn.execute("DELETE FROM swarm_reports WHERE (peer_id, network) IN "
                 "(SELECT peer_id, network FROM swarm_reports WHERE reported_ms <= ? /*SKIP LOCKED*/)", (now_ms - ttl_ms,))
    if not reported:
        return
    peers = list(dict.fromkeys(x[0] for x in reported))
    known = _present(conn, "SELECT DISTINCT peer_id FROM swarm_reports WHERE peer_id IN ({marks})", peers)
    room = max_peers - int(conn.execute("SELECT COUNT(DISTINCT peer_id) FROM swarm_reports").fetchone()[0])
    for peer in peers:
        if peer not in known and room > 0:
            known.add(peer)
            room -= 1
    conn.executemany(
        "INSERT INTO swarm_reports(peer_id, network, reported_ms) VALUES(?, ?, ?) ON CONFLICT(peer_id, network) "
        "DO UPDATE SET reported_ms = excluded.reported_ms WHERE excluded.reported_ms > swarm_reports.reported_ms",
        [x for x in reported if x[0] in known])
    conn.executemany("DELETE FROM swarm_reports WHERE peer_id = ? AND network NOT IN (SELECT network FROM swarm_reports "
                     "WHERE peer_id = ? ORDER BY reported_ms DESC, network LIMIT ?)",
                     [(peer, peer, per_peer) for peer in peers if peer in known])
    over = int(conn.execute("SELECT COUNT(DISTINCT peer_id) FROM swarm_reports").fetchone()[0]) - max_peers
    if over > 0:
        conn.execute("DELETE FROM swarm_reports WHERE peer_id IN (SELECT peer_id FROM swarm_reports GROUP BY peer_id "
                     "ORDER BY MIN(reported_ms) DESC, peer_id DESC LIMIT ?)", (over,))


def swarm_directory(conn: Connection, now_ms: int, ttl_ms: int,
                    max_listings: int) -> tuple[list[SwarmListing], list[SwarmReport]]:
    """Every edge's listings seen within ``ttl_ms`` (at most ``max_listings``) and every stored report."""
    listings = [(r[0], r[1], tuple(json.loads(r[2])), tuple(json.loads(r[3])), int(r[4])) for r in conn.execute(
        "SELECT node_id, peer_id, addrs, versions, seen_ms FROM swarm_listings WHERE seen_ms >= ? "
        "ORDER BY listed_ms, node_id LIMIT ?", (now_ms - ttl_ms, max_listings))]
    reports = [(r[0], r[1], int(r[2])) for r in conn.execute("SELECT peer_id, network, reported_ms FROM swarm_reports")]
    return listings, reports


def exchange_swarm_directory(conn: Connection, listed: list[SwarmListing], seen: list[str],
                             dropped: list[tuple[str, int]], reported: list[SwarmReport], *, seen_ms: int, now_ms: int,
                             listing_ttl_ms: int, report_ttl_ms: int, max_listings: int,
                             reports_per_peer: int) -> tuple[list[SwarmListing], list[SwarmReport]]:
    """One edge's exchange (``PeerDirectory.share``): write what its heartbeats said (new or changed listings
    whole, the nodes in ``seen`` only seen again at ``seen_ms``), then read every edge's."""
    refresh_swarm_listings(conn, seen, seen_ms)
    write_swarm_listings(conn, listed, dropped, now_ms, listing_ttl_ms, max_listings)
    write_swarm_reports(conn, reported, now_ms, report_ttl_ms, max_listings, reports_per_peer)
    return swarm_directory(conn, now_ms, listing_ttl_ms, max_listings)
