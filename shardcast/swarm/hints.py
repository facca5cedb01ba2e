"""Peer hints: which nodes serve which versions, signed by the coordinator in the policy announcement.

Pure functions over plain data. A node dials only peers (and only at addresses) that the coordinator
announced, so a relay, a peer or a man in the middle cannot steer it towards hosts of its choosing (a
dial is a connection to an address the attacker picked: a port scan by proxy, or a way to learn the
node's address). The document travels as JSON::

    {"hints": {"version": 7, "peers": [{"peer_id": "12D3...", "addrs": ["/ip4/.../tcp/4001"],
                                         "versions": [6, 7]}]},
     "signature": "<128 hex>"}

signed with Ed25519 over ``SIGNING_CONTEXT + canonical JSON`` (sorted keys, no whitespace), like the
manifest.

:class:`PeerDirectory` is the coordinator's side: it keeps what each node's heartbeat says about its
swarm and signs the current list into the policy announcement. With several edge processes on one store,
each shares its directory through the store (``exchange``), so every edge announces every edge's nodes.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from veriroll.protos.identity import PrivateKey, PublicKey

from ..manifest import canonical_json
from .errors import PeerHintsError

log = logging.getLogger("veriroll.shardcast.swarm")

SIGNING_CONTEXT = b"veriroll-swarm-peer-hints-v1\x00"
MAX_HINTS_BYTES = 1024 * 1024
MAX_PEERS = 1000
MAX_ADDRS = 8
MAX_VERSIONS = 64
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,128}")  # base58btc
_ADDR = re.compile(r"/[A-Za-z0-9/._:-]{1,255}")
_DIALABLE = re.compile(r"/(ip4|ip6)/([0-9A-Fa-f.:]+)/tcp/(\d{1,5})")
_CIRCUIT = re.compile(r"(/(?:ip4|ip6)/[0-9A-Fa-f.:]+/tcp/\d{1,5})/p2p/([1-9A-HJ-NP-Za-km-z]{20,128})/p2p-circuit")


@dataclass(frozen=True)
class PeerHint:
    peer_id: str
    addrs: tuple[str, ...]
    versions: tuple[int, ...]


@dataclass(frozen=True)
class PeerHints:
    """The peers announced with policy ``version``."""

    version: int
    peers: tuple[PeerHint, ...]

    def to_dict(self) -> dict:
        return {"version": self.version,
                "peers": [{"peer_id": p.peer_id, "addrs": list(p.addrs), "versions": list(p.versions)}
                          for p in self.peers]}  # fmt: skip


def sign_peer_hints(key: PrivateKey, hints: PeerHints) -> bytes:
    """The wire document of ``hints``, signed with the coordinator's ``key``."""
    body = hints.to_dict()
    signature = key.sign(SIGNING_CONTEXT + canonical_json(body))
    return canonical_json({"hints": body, "signature": signature.hex()})


def _int(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**53:
        raise PeerHintsError(f"{what} must be a non-negative integer")
    return value


def verify_peer_hints(data: bytes, key: PublicKey) -> PeerHints:
    """The hints in ``data``, once its signature by ``key`` and its shape are checked."""
    if len(data) > MAX_HINTS_BYTES:
        raise PeerHintsError(f"peer hints of {len(data)} bytes, more than {MAX_HINTS_BYTES}")
    try:
        doc = json.loads(data)
        body, signature = doc["hints"], bytes.fromhex(doc["signature"])
    except (ValueError, TypeError, KeyError) as exc:
        raise PeerHintsError(f"peer hints do not parse: {exc}") from exc
    if not isinstance(body, dict) or not key.verify(signature, SIGNING_CONTEXT + canonical_json(body)):
        raise PeerHintsError("peer hints are not signed by the coordinator key")
    peers_raw = body.get("peers")
    if not isinstance(peers_raw, list) or len(peers_raw) > MAX_PEERS:
        raise PeerHintsError(f"peer hints must list at most {MAX_PEERS} peers")
    peers = []
    for p in peers_raw:
        if not isinstance(p, dict) or not isinstance(p.get("peer_id"), str) or not _PEER_ID.fullmatch(p["peer_id"]):
            raise PeerHintsError(f"bad peer id in peer hints: {p!r:.80}")
        addrs, versions = p.get("addrs"), p.get("versions")
        if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS or not all(
            isinstance(a, str) and _ADDR.fullmatch(a) for a in addrs
        ):
            raise PeerHintsError(f"peer {p['peer_id']}: addrs must be at most {MAX_ADDRS} multiaddrs")
        if not isinstance(versions, list) or len(versions) > MAX_VERSIONS:
            raise PeerHintsError(f"peer {p['peer_id']}: versions must be a list of at most {MAX_VERSIONS}")
        peers.append(PeerHint(p["peer_id"], tuple(addrs), tuple(_int(v, "a version") for v in versions)))
    return PeerHints(_int(body.get("version"), "the hints' version"), tuple(peers))


def peer_id_problem(peer_id: str) -> str | None:
    """Why ``peer_id`` (from a heartbeat; empty: no swarm) cannot be announced, or None."""
    if peer_id and not _PEER_ID.fullmatch(peer_id):
        return "swarm_peer_id is not a base58 libp2p peer id"
    return None


def _same_host(addr: str, observed: str) -> bool:
    """True when multiaddr ``addr`` is a TCP address at IP ``observed`` (where the node's request came from)."""
    m = _DIALABLE.fullmatch(addr)
    if m is None or not 0 < int(m.group(3)) < 65536:
        return False
    try:
        ip, seen = ipaddress.ip_address(m.group(2)), ipaddress.ip_address(observed)
    except ValueError:
        return False
    seen = getattr(seen, "ipv4_mapped", None) or seen
    return ip == seen


@dataclass
class _Listing:
    hint: PeerHint
    seen: float


ListingRow = tuple[str, str, tuple[str, ...], tuple[int, ...], int]
"""A listing as the shared store keeps it: (node id, peer id, addrs, versions, last seen in ms)."""
ReportRow = tuple[str, str, int]
"""A bad-peer report as the shared store keeps it: (reported peer id, reporter's network, when in ms)."""
Exchange = Callable[..., Awaitable[tuple[list[ListingRow], list[ReportRow]]]]
"""``exchange(listed, seen, dropped, reported, *, seen_ms, now_ms, listing_ttl_ms, report_ttl_ms, max_listings,
reports_per_peer)``: writes one edge's news to the shared store and returns the whole shared directory
(the coordinator's ``store.exchange_swarm_directory`` in a writer transaction)."""


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


class PeerDirectory:
    """Which nodes serve which versions, from their heartbeats; signed into the policy announcement.

    Only addresses at the IP a node's heartbeat came from are kept, and circuits through a listed node at
    its listed address (a node behind NAT): a node cannot make the coordinator send every other node to
    dial a host of its choosing. A node not heard from for ``ttl_s`` is dropped.
    The signed document is cached: signed again when the list changes, or every ``resign_s`` to drop the
    nodes gone silent (one Ed25519 signature per GetPolicy would be cheap, but the list is the same for all).

    With ``exchange`` (edge processes sharing a PostgreSQL store) the directory is shared: a heartbeat
    still only changes this process's memory (no store round trip per heartbeat), and :meth:`share_forever`
    writes what changed here to the store every ``resign_s``, in one transaction, and takes the store's
    directory, every edge's nodes and reports, as this process's view. A listing is written whole only
    when it changed; the nodes that only beat again are marked seen in one statement. A node heartbeating
    to one edge is so announced by every edge within two ``resign_s``, and reports through different edges
    add up. The clock must then be one that every process agrees on (the wall clock, the default with
    ``exchange``).
    """

    def __init__(self, key: PrivateKey, *, ttl_s: float = 60.0, resign_s: float = 5.0, max_peers: int = MAX_PEERS,
                 reports_to_withhold: int = 2, report_ttl_s: float = 3600.0,
                 clock: Callable[[], float] | None = None, exchange: Exchange | None = None):
        self.key, self.ttl_s, self.resign_s, self.max_peers = key, ttl_s, resign_s, max_peers
        self.clock = clock or (time.monotonic if exchange is None else time.time)
        self.reports_to_withhold, self.report_ttl_s = reports_to_withhold, report_ttl_s
        self.exchange = exchange
        self._listings: dict[str, _Listing] = {}  # node id -> its latest swarm listing
        self._reports: dict[str, dict[str, float]] = {}  # bad peer id -> reporter's network -> when
        self._signed: tuple[int, float, bytes] | None = None  # (version, when, document)
        # With ``exchange``: what this process heard since it last wrote to the store (the latest word wins).
        self._listed_here: dict[str, _Listing] = {}  # new or changed listings
        self._seen_here: dict[str, float] = {}  # node id -> when it last beat with its listing unchanged
        self._dropped_here: dict[str, float] = {}  # node id -> when its heartbeat unlisted it
        self._reported_here: dict[tuple[str, str], float] = {}  # (bad peer id, network) -> when

    def record(self, node_id: str, peer_id: str, addrs: Sequence[str], versions: Sequence[int], observed: str,
               bad_peers: Sequence[str] = ()) -> None:
        """What node ``node_id``'s heartbeat (from IP ``observed``) said about its swarm; an empty ``peer_id``
        (no swarm, or it stopped) removes the node. Raises PeerHintsError for a malformed peer id.

        ``bad_peers``: peers that sent the node bytes the manifest does not name. A report cannot be proved
        (a stream's bytes are not signed by the sender), so one network's word withholds nobody: a peer
        reported from ``reports_to_withhold`` different networks (/24, /64) is no longer announced.
        """
        self._report(peer_id, bad_peers, observed)
        if not peer_id:
            self._unlist(node_id)
            return
        problem = peer_id_problem(peer_id)
        if problem is not None:
            raise PeerHintsError(problem)
        dialable = tuple(a for a in dict.fromkeys(addrs) if _same_host(a, observed) or self._listed_circuit(a))
        dialable = dialable[:MAX_ADDRS]
        served = tuple(sorted({int(v) for v in versions if 0 <= v < 2**53}))[-MAX_VERSIONS:]
        if not dialable or not served:
            self._unlist(node_id)
            return
        if node_id not in self._listings and len(self._listings) >= self.max_peers:
            self._expire()
            if len(self._listings) >= self.max_peers:
                return  # full: the nodes already listed serve the swarm; this one still fetches from them
        hint = PeerHint(peer_id, dialable, served)
        old = self._listings.get(node_id)
        if old is None or old.hint != hint:
            self._signed = None  # the announcement changes at once; only a node's being seen again does not
        listing = self._listings[node_id] = _Listing(hint, self.clock())
        if self.exchange is not None:
            if old is None or old.hint != hint or node_id in self._listed_here:
                self._listed_here[node_id] = listing
                self._seen_here.pop(node_id, None)
            else:
                self._seen_here[node_id] = listing.seen
            self._dropped_here.pop(node_id, None)

    def _report(self, reporter: str, bad_peers: Sequence[str], observed: str) -> None:
        try:
            ip = ipaddress.ip_address(observed)
        except ValueError:
            return  # not an IP (a unix socket, a test transport): no network to count the report for
        network = str(ipaddress.ip_network((ip, 24 if ip.version == 4 else 64), strict=False))
        now = self.clock()
        for bad in dict.fromkeys(bad_peers):
            if bad == reporter or not _PEER_ID.fullmatch(bad):
                continue
            if bad not in self._reports and len(self._reports) >= self.max_peers:
                continue  # full of reports already: more of them withhold nobody new
            before = self.withheld(bad)
            self._add_report(bad, network, now)
            if self.exchange is not None:
                self._reported_here[(bad, network)] = now
            if self.withheld(bad) != before:
                self._signed = None

    def _add_report(self, bad: str, network: str, when: float) -> None:
        """Keep only the ``reports_to_withhold`` latest networks' reports of ``bad``: the newest that many
        decide :meth:`withheld` exactly, and a peer reported from every network costs no more memory."""
        networks = self._reports.setdefault(bad, {})
        networks[network] = max(when, networks.get(network, when))
        while len(networks) > self.reports_to_withhold:
            del networks[min(networks, key=networks.__getitem__)]

    def withheld(self, peer_id: str) -> bool:
        """True when ``peer_id`` was reported as serving bad bytes from enough networks to stop announcing it."""
        now = self.clock()
        recent = [t for t in self._reports.get(peer_id, {}).values() if now - t < self.report_ttl_s]
        return len(recent) >= self.reports_to_withhold

    def _listed_circuit(self, addr: str) -> bool:
        """True when ``addr`` is a circuit (``<relay addr>/p2p/<relay id>/p2p-circuit``) through a listed node,
        at an address that node is listed at: a node behind NAT is announced only through relays we know."""
        m = _CIRCUIT.fullmatch(addr)
        if m is None:
            return False
        relay_addr, relay_id = m.group(1), m.group(2)
        return any(listing.hint.peer_id == relay_id and relay_addr in listing.hint.addrs
                   for listing in self._listings.values())

    def _unlist(self, node_id: str) -> None:
        """The node's own heartbeat took it off the list (so it comes off every edge's, not only this one's)."""
        self._drop(node_id)
        if self.exchange is not None:
            self._listed_here.pop(node_id, None)
            self._seen_here.pop(node_id, None)
            if node_id in self._dropped_here or len(self._dropped_here) < self.max_peers:
                self._dropped_here[node_id] = self.clock()

    def _drop(self, node_id: str) -> None:
        if self._listings.pop(node_id, None) is not None:
            self._signed = None

    def _expire(self) -> None:
        now = self.clock()
        for node_id in [n for n, listing in self._listings.items() if now - listing.seen > self.ttl_s]:
            self._drop(node_id)

    def _announced(self) -> tuple[PeerHint, ...]:
        listed = (listing.hint for listing in self._listings.values() if not self.withheld(listing.hint.peer_id))
        return tuple(sorted(listed, key=lambda h: h.peer_id))

    def signed(self, version: int) -> bytes:
        """The signed hints to announce with policy ``version``: every node heard from lately."""
        now = self.clock()
        if self._signed is not None and self._signed[0] == version and now - self._signed[1] < self.resign_s:
            return self._signed[2]
        self._expire()
        document = sign_peer_hints(self.key, PeerHints(version, self._announced()))
        self._signed = (version, now, document)
        return document

    # --- sharing through the store (several edge processes) -----------------------------------------------

    async def share(self) -> None:
        """Write what this process heard since the last exchange to the shared store, and take the store's
        directory as this process's view. Raises what ``exchange`` raises (the store unavailable); what was
        not written is kept for the next exchange."""
        listed, seen, dropped, reported = self._listed_here, self._seen_here, self._dropped_here, self._reported_here
        self._listed_here, self._seen_here, self._dropped_here, self._reported_here = {}, {}, {}, {}
        try:
            listings, reports = await self.exchange(
                [(n, x.hint.peer_id, x.hint.addrs, x.hint.versions, _ms(x.seen)) for n, x in listed.items()],
                list(seen), [(n, _ms(when)) for n, when in dropped.items()],
                [(peer, network, _ms(when)) for (peer, network), when in reported.items()],
                # One time for every node that only beat again: the earliest, so none is kept longer than ttl_s.
                seen_ms=_ms(min(seen.values(), default=0)), now_ms=_ms(self.clock()), listing_ttl_ms=_ms(self.ttl_s),
                report_ttl_ms=_ms(self.report_ttl_s), max_listings=self.max_peers,
                reports_per_peer=self.reports_to_withhold)
        except BaseException:
            self._keep_unwritten(listed, seen, dropped, reported)
            raise
        before = self._announced()
        self._listings = {n: _Listing(PeerHint(peer, tuple(addrs), tuple(versions)), ms / 1000)
                          for n, peer, addrs, versions, ms in listings}
        self._reports = {}
        for peer, network, ms in reports:
            self._add_report(peer, network, ms / 1000)
        # Heard while the exchange ran: not in the store yet, and still this process's latest word.
        for n, listing in self._listed_here.items():
            self._listings[n] = listing
        for n, when in self._seen_here.items():
            if n in self._listings:
                self._listings[n].seen = when
        for n in self._dropped_here:
            self._listings.pop(n, None)
        for (peer, network), when in self._reported_here.items():
            self._add_report(peer, network, when)
        if self._announced() != before:
            self._signed = None

    def _keep_unwritten(self, listed: dict[str, _Listing], seen: dict[str, float], dropped: dict[str, float],
                        reported: dict[tuple[str, str], float]) -> None:
        """A failed exchange wrote nothing: what it carried is kept for the next, under what was heard meanwhile
        (newer, so it wins)."""
        for n in [n for n in self._seen_here if n in listed]:  # beat again, but its listing is still unwritten
            self._listed_here[n] = _Listing(listed[n].hint, self._seen_here.pop(n))
        newer = self._listed_here.keys() | self._seen_here.keys() | self._dropped_here.keys()
        self._listed_here.update({n: x for n, x in listed.items() if n not in newer})
        self._seen_here.update({n: when for n, when in seen.items() if n not in newer})
        self._dropped_here.update({n: when for n, when in dropped.items() if n not in newer})
        self._reported_here = {**reported, **self._reported_here}

    async def share_forever(self) -> None:
        """:meth:`share` every ``resign_s`` until cancelled; a failed exchange (the store restarting) is a
        warning line, and this process goes on announcing its last view meanwhile."""
        while True:
            try:
                await self.share()
            except Exception as exc:  # noqa: BLE001 - logged; the next exchange writes what this one did not
                log.warning("sharing the peer directory through the store failed (%s); again in %g s", exc,
                            self.resign_s)
            await asyncio.sleep(self.resign_s)
