"""The swarm's libp2p host: serves the shards this node holds and fetches shards from announced peers.

py-libp2p runs on trio; the node runs on asyncio. The host lives in its own thread with its own trio
loop, and :class:`Swarm` is the whole asyncio-facing surface: every call crosses into the trio thread
and its result (or error, always a :class:`SwarmError`) comes back as an asyncio future. Nothing of
trio is visible outside this module.

Serving (``serve``/``serve_shard``): a request names a shard by its SHA-256, the answer is that range of
a file this node verified against the coordinator's manifest. Each peer is bounded: streams open at
once, streams opened per second (token bucket), request size, and a timeout on every silence.

Fetching (``fetch_shard``): only peers the coordinator announced (``announce``), only at the addresses
it announced; the answer's length must be the manifest's size, and its hash the manifest's hash. A
peer that sends anything else is banned for the life of the swarm and listed in ``bad_peers``.

NAT: libp2p's circuit relay v2. A swarm started with ``relay=True`` relays for others (a node, or an
HTTP relay's machine, with an open port); a node with no inbound port ``reserve``s a slot on one and is
reachable at the circuit address it returns (``<relay addr>/p2p/<relay id>/p2p-circuit``), which the
node announces like any other; a peer dials it through the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import multiaddr
import trio
from libp2p import new_host
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.custom_types import TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.relay.circuit_v2 import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2 import CircuitV2Protocol, CircuitV2Transport, RelayLimits
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.tools.anyio_service import background_trio_service

from veriroll.protos.ratelimit import BucketMap

from ..manifest import Manifest, manifest_sha256
from .errors import (
    BadPeerError,
    PeerNotAnnouncedError,
    PeerUnavailableError,
    SwarmError,
    SwarmNotRunningError,
)
from .hints import PeerHint, PeerHints
from .wire import (
    BITFIELD_LENGTH_SIZE,
    PROTOCOL,
    SHARD_LENGTH_SIZE,
    Op,
    Refusal,
    Status,
    SwarmLimits,
    decode_bitfield,
    decode_request,
    encode_bitfield,
    encode_request,
)

log = logging.getLogger("veriroll.shardcast.swarm")

CHUNK = 1024 * 1024
STOP_TIMEOUT_S = 5.0
# What a relaying swarm gives the peers behind NAT: circuits of an hour and 4 GiB at most (a few versions),
# 64 at once, 128 reservations.
RELAY_LIMITS = RelayLimits(duration=3600, data=4 << 30, max_circuit_conns=64, max_reservations=128)
MAX_TRACKED_PEERS = 4096  # rate-limit buckets kept; past it, the peer quiet the longest is forgotten


@dataclass(frozen=True)
class BadPeer:
    """A peer that served bytes the manifest does not name; what the node reports to the coordinator."""

    peer_id: str
    reason: Refusal
    detail: str


def _read_range(path: Path, offset: int, size: int) -> bytes:
    with open(path, "rb") as f:
        data = os.pread(f.fileno(), size, offset)
    if len(data) != size:
        raise OSError(f"{path} is shorter than the manifest says")
    return data


async def _read_exactly(stream, n: int, timeout: float) -> bytes:
    """``n`` bytes from ``stream``; trio.TooSlowError when it is silent for ``timeout`` s, EOFError when it ends."""
    parts, got = [], 0
    while got < n:
        with trio.fail_after(timeout):
            chunk = await stream.read(min(CHUNK, n - got))
        if not chunk:
            raise EOFError(f"stream ended after {got} of {n} bytes")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


class Swarm:
    """A libp2p host in a thread of its own, driven from asyncio. ``start`` before use, ``stop`` after."""

    def __init__(self, *, listen: str = "/ip4/0.0.0.0/tcp/0", limits: SwarmLimits | None = None, relay: bool = False):
        self.listen = listen
        self.relay = relay
        self.limits = limits or SwarmLimits()
        self.peer_id = ""
        self.addrs: list[str] = []
        self.bad_peers: list[BadPeer] = []
        self.refusals: Counter[str] = Counter()  # by Refusal, serving and fetching alike
        self.bytes_served = 0
        self._lock = threading.Lock()  # the maps below are read by the trio thread, written from asyncio
        self._shards: dict[bytes, tuple[Path, int, int]] = {}  # sha256 -> (file, offset, size)
        self._held: dict[bytes, tuple[int, set[int]]] = {}  # manifest hash -> (shard count, shards held)
        self._announced: dict[str, PeerHint] = {}
        self._banned: set[str] = set()
        self._open: Counter[str] = Counter()
        # Streams a peer may still open; many peer ids (keys are free) push out those gone quiet longest.
        self._buckets = BucketMap(self.limits.stream_rate_per_peer, self.limits.stream_burst_per_peer,
                                  max_keys=MAX_TRACKED_PEERS)
        self._slots: dict[str, trio.Semaphore] = {}  # as a client, no more streams to one peer than it allows us
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._nursery: trio.Nursery | None = None
        self._host = None
        self._circuits: CircuitV2Transport | None = None
        self._last_key: tuple[Manifest, bytes] | None = None

    # ---- life cycle

    async def start(self) -> None:
        """Start the host and listen; ``peer_id`` and ``addrs`` are set when this returns."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()

        def report(exc: BaseException | None) -> None:
            if not ready.done():
                ready.set_exception(exc) if exc is not None else ready.set_result(None)

        def main() -> None:
            try:
                trio.run(self._run, lambda: loop.call_soon_threadsafe(report, None))
            except BaseException as exc:  # noqa: BLE001 - whatever stopped the host must reach start()
                loop.call_soon_threadsafe(report, SwarmError(f"the libp2p host failed: {exc!r}"))

        self._thread = threading.Thread(target=main, name="veriroll-swarm", daemon=True)
        self._thread.start()
        await ready

    async def _run(self, started: Callable[[], None]) -> None:
        self._host = new_host(key_pair=create_new_key_pair())
        self._host.set_stream_handler(TProtocol(PROTOCOL), self._handle)
        # Circuit relay v2: every swarm can be reached through a relay and dial through one; only a swarm
        # started with relay=True carries other peers' circuits (bounded by RELAY_LIMITS).
        circuits = CircuitV2Protocol(self._host, limits=RELAY_LIMITS, allow_hop=self.relay)
        roles = RelayRole.STOP | RelayRole.CLIENT | (RelayRole.HOP if self.relay else RelayRole(0))
        async with self._host.run(listen_addrs=[multiaddr.Multiaddr(self.listen)]), \
                background_trio_service(circuits), trio.open_nursery() as nursery:
            await circuits.event_started.wait()
            self._circuits = CircuitV2Transport(self._host, circuits, RelayConfig(roles=roles, limits=RELAY_LIMITS))
            # libp2p's auto-connector dials any peer in the peerstore (every peer that ever connected to us)
            # to keep 50+ connections: a node dials only the peers the coordinator announced.
            await self._host.get_network().auto_connector.stop()
            self._nursery, self._token = nursery, trio.lowlevel.current_trio_token()
            self.peer_id = self._host.get_id().to_base58()
            self.addrs = [str(a).split("/p2p/")[0] for a in self._host.get_addrs()]
            started()
            await trio.sleep_forever()

    async def stop(self) -> None:
        """Close every connection and end the thread (within a few seconds)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(self._nursery.cancel_scope.cancel, trio_token=self._token)
        await asyncio.get_running_loop().run_in_executor(None, thread.join, STOP_TIMEOUT_S)
        self._token = self._nursery = None

    async def _call(self, fn, *args):
        """Run trio coroutine ``fn(*args)`` in the host's thread; its result or SwarmError, as asyncio sees it."""
        if self._token is None:
            raise SwarmNotRunningError("the swarm is not running: call start() first")
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        scope = trio.CancelScope()

        def settle(result, exc) -> None:
            if not future.done():
                future.set_exception(exc) if exc is not None else future.set_result(result)

        async def runner() -> None:
            # Whatever ends the call (stop() cancels every call in flight) settles the future: never a hang.
            result, error = None, SwarmNotRunningError("the swarm stopped")
            try:
                with scope:
                    try:
                        result, error = await fn(*args), None
                    except SwarmError as exc:
                        error = exc
                    except Exception as exc:  # noqa: BLE001 - a libp2p failure becomes a SwarmError, never leaks trio types
                        error = SwarmError(f"{type(exc).__name__}: {exc}")
            finally:
                with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits any more
                    loop.call_soon_threadsafe(settle, result, error)

        try:
            trio.from_thread.run_sync(self._nursery.start_soon, runner, trio_token=self._token)
        except trio.RunFinishedError as exc:
            raise SwarmNotRunningError("the swarm stopped") from exc
        try:
            return await future
        except asyncio.CancelledError:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(scope.cancel, trio_token=self._token)
            raise

    # ---- what we serve

    def serve(self, path: str | os.PathLike, manifest: Manifest) -> None:
        """Serve every shard of ``manifest`` from checkpoint directory ``path`` (verified, e.g. a fetch's result)."""
        for shard in manifest.shards:
            self.serve_shard(path, manifest, shard.index)

    def serve_shard(self, path: str | os.PathLike, manifest: Manifest, index: int) -> None:
        """Serve shard ``index`` of ``manifest``, whose bytes were verified into ``path``/its file."""
        shard = manifest.shards[index]
        key = self._key_of(manifest)
        with self._lock:
            self._shards[bytes.fromhex(shard.sha256)] = (Path(path) / shard.file, shard.offset, shard.size)
            self._held.setdefault(key, (len(manifest.shards), set()))[1].add(index)

    def _key_of(self, manifest: Manifest) -> bytes:
        """The manifest's hash (what HAVE names a version by), kept for the manifest last asked about: hashing
        the canonical manifest for each of its shards would cost O(shards²)."""
        if self._last_key is None or self._last_key[0] is not manifest:
            self._last_key = (manifest, bytes.fromhex(manifest_sha256(manifest)))
        return self._last_key[1]

    def forget(self, manifest: Manifest) -> None:
        """Stop serving ``manifest``'s shards (its files are about to be pruned)."""
        with self._lock:
            self._held.pop(self._key_of(manifest), None)
            for shard in manifest.shards:
                self._shards.pop(bytes.fromhex(shard.sha256), None)

    # ---- whom we may ask

    def announce(self, hints: PeerHints) -> None:
        """Replace the peers we may dial by those of ``hints`` (verified: ``verify_peer_hints``), less ourselves."""
        with self._lock:
            self._announced = {p.peer_id: p for p in hints.peers if p.peer_id != self.peer_id}

    def peers_for(self, version: int) -> list[str]:
        """Announced peers that hold ``version`` and have not been banned."""
        with self._lock:
            return [p for p, h in self._announced.items() if version in h.versions and p not in self._banned]

    def _hint(self, peer_id: str, addr: str | None = None) -> PeerHint:
        with self._lock:
            hint = self._announced.get(peer_id)
        if hint is None or (addr is not None and addr not in hint.addrs):
            self.refusals[Refusal.NOT_ANNOUNCED] += 1
            where = f" at {addr}" if addr is not None else ""
            raise PeerNotAnnouncedError(peer_id, Refusal.NOT_ANNOUNCED, f"not in the coordinator's hints{where}")
        if peer_id in self._banned:
            raise PeerUnavailableError(peer_id, Refusal.BANNED, "banned for serving bad data")
        return hint

    # ---- asyncio-facing requests

    async def dial(self, peer_id: str, addr: str | None = None) -> None:
        """Connect to announced peer ``peer_id`` (at ``addr``, which must be one of its announced addresses)."""
        hint = self._hint(peer_id, addr)
        if addr is not None:
            hint = PeerHint(peer_id, (addr,), hint.versions)
        await self._call(self._connect_within_timeout, hint)

    async def reserve(self, relay_peer_id: str, relay_addr: str) -> str:
        """Reserve a slot on relay ``relay_peer_id`` (a swarm with ``relay=True``, at ``relay_addr``, which
        the caller got from the coordinator's hints or its own config); the circuit address peers reach this
        node at, which is added to ``addrs``."""
        circuit = await self._call(self._reserve, relay_peer_id, relay_addr)
        self.addrs.append(circuit)
        return circuit

    async def fetch_shard(self, peer_id: str, sha256: str, size: int) -> bytes:
        """The ``size`` bytes whose SHA-256 is ``sha256``, from ``peer_id``, hashed on arrival.

        Raises PeerNotAnnouncedError, BadPeerError (wrong bytes: the peer is banned), PeerUnavailableError
        (stalled, refused, not held, unreachable) or SwarmNotRunningError.
        """
        hint = self._hint(peer_id)
        return await self._call(self._get, hint, bytes.fromhex(sha256), size)

    async def shards_held_by(self, peer_id: str, manifest: Manifest) -> set[int]:
        """The indices of ``manifest``'s shards that ``peer_id`` says it holds (a claim: each is hashed on arrival)."""
        hint = self._hint(peer_id)
        return await self._call(self._have, hint, manifest)

    # ---- trio side: client

    async def _connect_within_timeout(self, hint: PeerHint) -> None:
        try:
            with trio.fail_after(self.limits.open_timeout_s):
                await self._connect_announced(hint)
        except trio.TooSlowError as exc:
            raise PeerUnavailableError(hint.peer_id, "unreachable", "not connected within the open timeout") from exc

    async def _reserve(self, relay_peer_id: str, relay_addr: str) -> str:
        relay = ID.from_base58(relay_peer_id)
        try:
            with trio.fail_after(self.limits.open_timeout_s):
                await self._host.connect(PeerInfo(relay, [multiaddr.Multiaddr(relay_addr)]))
                stream = await self._host.new_stream(relay, [HOP_PROTOCOL])
                reserved = await self._circuits.reserve(stream, relay, self._nursery)
        except Exception as exc:  # any dial, negotiation or refusal means the same: no slot on this relay
            raise PeerUnavailableError(relay_peer_id, "no-reservation", f"{type(exc).__name__}: {exc}") from exc
        if not reserved:
            raise PeerUnavailableError(relay_peer_id, "no-reservation", "the relay refused a reservation")
        return f"{relay_addr}/p2p/{relay_peer_id}/p2p-circuit"

    async def _connect_announced(self, hint: PeerHint) -> None:
        """Connect to ``hint``'s peer at its announced addresses: direct ones first, then through a relay."""
        peer = ID.from_base58(hint.peer_id)
        direct = [multiaddr.Multiaddr(a) for a in hint.addrs if "/p2p-circuit" not in a]
        if direct:
            try:
                await self._host.connect(PeerInfo(peer, direct))
                return
            except Exception:  # unreachable directly (behind NAT?): its circuits, if it announced any, remain
                if len(direct) == len(hint.addrs):
                    raise
        for addr in (a for a in hint.addrs if "/p2p-circuit" in a):
            await self._circuits.dial(multiaddr.Multiaddr(f"{addr}/p2p/{hint.peer_id}"))
            return

    async def _stream(self, hint: PeerHint, op: Op, digest: bytes):
        try:
            with trio.fail_after(self.limits.open_timeout_s):
                peer = ID.from_base58(hint.peer_id)
                if peer not in self._host.get_connected_peers():
                    await self._connect_announced(hint)
                stream = await self._host.new_stream(peer, [TProtocol(PROTOCOL)])
                await stream.write(encode_request(op, digest))
        except trio.TooSlowError as exc:
            raise PeerUnavailableError(hint.peer_id, "unreachable", "no stream within the open timeout") from exc
        except Exception as exc:  # any dial or negotiation failure means the same: this peer is unreachable
            raise PeerUnavailableError(hint.peer_id, "unreachable", f"{type(exc).__name__}: {exc}") from exc
        return stream

    async def _answer_header(self, hint: PeerHint, stream, length_size: int) -> int:
        timeout = self.limits.stream_timeout_s
        status = (await _read_exactly(stream, 1, timeout))[0]
        if status == Status.NOT_HELD:
            raise PeerUnavailableError(hint.peer_id, "not-held", "does not hold it")
        if status != Status.OK:
            name = Status(status).name if status in Status._value2member_map_ else str(status)
            raise PeerUnavailableError(hint.peer_id, "refused", f"answered {name}")
        return int.from_bytes(await _read_exactly(stream, length_size, timeout), "big")

    def _slot(self, peer_id: str) -> trio.Semaphore:
        return self._slots.setdefault(peer_id, trio.Semaphore(self.limits.max_streams_per_peer))

    async def _get(self, hint: PeerHint, digest: bytes, size: int) -> bytes:
        async with self._slot(hint.peer_id):
            return await self._get_now(hint, digest, size)

    async def _get_now(self, hint: PeerHint, digest: bytes, size: int) -> bytes:
        stream = await self._stream(hint, Op.GET, digest)
        try:
            length = await self._answer_header(hint, stream, SHARD_LENGTH_SIZE)
            if length != size:
                await self._ban(hint.peer_id, Refusal.WRONG_LENGTH, f"announced {length} bytes for a shard of {size}")
            data = await _read_exactly(stream, size, self.limits.stream_timeout_s)
            got = await trio.to_thread.run_sync(lambda: hashlib.sha256(data).digest())
            if got != digest:
                await self._ban(hint.peer_id, Refusal.HASH_MISMATCH,
                                f"sha256 {got.hex()[:16]}… instead of {digest.hex()[:16]}…")
            return data
        except trio.TooSlowError as exc:
            self.refusals[Refusal.STALLED] += 1
            raise PeerUnavailableError(hint.peer_id, Refusal.STALLED,
                                       f"silent for {self.limits.stream_timeout_s} s mid-stream") from exc
        except (EOFError, OSError, ValueError, BaseLibp2pError) as exc:  # reset, closed, cut off mid-answer
            raise PeerUnavailableError(hint.peer_id, "truncated", f"{type(exc).__name__}: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                await stream.reset()

    async def _have(self, hint: PeerHint, manifest: Manifest) -> set[int]:
        async with self._slot(hint.peer_id):
            return await self._have_now(hint, manifest)

    async def _have_now(self, hint: PeerHint, manifest: Manifest) -> set[int]:
        stream = await self._stream(hint, Op.HAVE, bytes.fromhex(manifest_sha256(manifest)))
        count = len(manifest.shards)
        try:
            try:
                length = await self._answer_header(hint, stream, BITFIELD_LENGTH_SIZE)
            except PeerUnavailableError as exc:
                if exc.reason == "not-held":  # it holds no shard of this version (yet)
                    return set()
                raise
            if length != (count + 7) // 8:
                await self._ban(hint.peer_id, Refusal.WRONG_LENGTH, f"a bitfield of {length} bytes for {count} shards")
            return decode_bitfield(await _read_exactly(stream, length, self.limits.stream_timeout_s), count)
        except trio.TooSlowError as exc:
            self.refusals[Refusal.STALLED] += 1
            raise PeerUnavailableError(hint.peer_id, Refusal.STALLED, "silent while listing shards") from exc
        except (EOFError, OSError, ValueError, BaseLibp2pError) as exc:  # reset, closed, cut off mid-answer
            raise PeerUnavailableError(hint.peer_id, "truncated", f"{type(exc).__name__}: {exc}") from exc
        finally:
            with contextlib.suppress(Exception):
                await stream.reset()

    async def _ban(self, peer_id: str, reason: Refusal, detail: str):
        """Name, drop and remember a peer that sent bytes the manifest does not name; raises BadPeerError."""
        self._banned.add(peer_id)
        self.bad_peers.append(BadPeer(peer_id, reason, detail))
        self.refusals[reason] += 1
        log.warning("peer %s served bad data (%s): %s; banned", peer_id, reason, detail)
        with contextlib.suppress(Exception), trio.move_on_after(self.limits.open_timeout_s):
            await self._host.disconnect(ID.from_base58(peer_id))
        raise BadPeerError(peer_id, reason, detail)

    # ---- trio side: server

    def _admit(self, peer: str) -> Status | None:
        """None when ``peer`` may open this stream, else the status to refuse it with (and it is counted)."""
        if peer in self._banned:
            refusal, status = Refusal.BANNED, Status.BANNED
        else:
            now = trio.current_time()
            bucket = self._buckets.bucket(peer, now)
            if bucket.level(now) < 1:
                refusal, status = Refusal.RATE_LIMITED, Status.RATE_LIMITED
            elif self._open[peer] >= self.limits.max_streams_per_peer:
                refusal, status = Refusal.BUSY, Status.BUSY
            else:
                bucket.take(1.0, now)
                return None
        self.refusals[refusal] += 1
        return status

    async def _handle(self, stream) -> None:
        peer = stream.muxed_conn.peer_id.to_base58()
        refused = self._admit(peer)
        try:
            if refused is not None:
                with trio.move_on_after(self.limits.stream_timeout_s):
                    await stream.write(bytes([refused]))
                return
            self._open[peer] += 1
            try:
                await self._answer(stream, peer)
            finally:
                self._open[peer] -= 1
                if not self._open[peer]:
                    del self._open[peer]
        except Exception as exc:  # noqa: BLE001 - one peer's broken stream must never take the host down
            log.debug("stream from %s ended: %r", peer, exc)
        finally:
            with contextlib.suppress(Exception):
                await stream.close()

    async def _answer(self, stream, peer: str) -> None:
        timeout = self.limits.stream_timeout_s
        try:
            request = decode_request(await _read_exactly(stream, 33, timeout))
        except trio.TooSlowError:
            self.refusals[Refusal.STALLED] += 1
            return
        if request is None:
            self.refusals[Refusal.BAD_REQUEST] += 1
            with trio.fail_after(timeout):
                await stream.write(bytes([Status.BAD_REQUEST]))
            return
        op, digest = request
        if op == Op.HAVE:
            with self._lock:
                entry = self._held.get(digest)
                bits = encode_bitfield(set(entry[1]), entry[0]) if entry is not None else None
            with trio.fail_after(timeout):
                if bits is None:
                    await stream.write(bytes([Status.NOT_HELD]))
                else:
                    await stream.write(bytes([Status.OK]) + len(bits).to_bytes(BITFIELD_LENGTH_SIZE, "big") + bits)
            return
        with self._lock:
            where = self._shards.get(digest)
        data = None
        if where is not None:
            try:
                data = await trio.to_thread.run_sync(_read_range, *where)
            except OSError as exc:  # pruned or moved since: say we do not hold it
                log.info("cannot serve shard %s…: %s", digest.hex()[:16], exc)
        with trio.fail_after(timeout):
            if data is None:
                await stream.write(bytes([Status.NOT_HELD]))
                return
            await stream.write(bytes([Status.OK]) + len(data).to_bytes(SHARD_LENGTH_SIZE, "big"))
        await self._send(stream, data, peer)

    async def _send(self, stream, data: bytes, peer: str) -> None:
        """Write a shard's bytes, each chunk under the stream timeout (a peer that stops reading is dropped)."""
        view = memoryview(data)
        for start in range(0, len(data), CHUNK):
            with trio.fail_after(self.limits.stream_timeout_s):
                await stream.write(bytes(view[start:start + CHUNK]))
            self.bytes_served += min(CHUNK, len(data) - start)
