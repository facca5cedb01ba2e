"""The volunteer's rollout loop: register, heartbeat, lease, generate, sign, submit, repeat.

One event loop; generation runs in a worker thread so heartbeats keep flowing while the engine
works. Weights are swapped only between leases. When the coordinator is unreachable the agent backs
off (exponential, with jitter) and carries on when it returns, registering again if it has to.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from veriroll.node.config import NodeConfig
from veriroll.node.hardware import Hardware
from veriroll.protos.identity import PrivateKey
from veriroll.protos.reasons import Reason
from veriroll.protos.service import SOFTWARE_VERSION, CallError, SignedStub
from veriroll.protos.v1 import coordinator_pb2 as pb
from veriroll.toploc import commit_many  # noqa: F401 - fail closed: a node that cannot make proofs won't start

_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def dtype_name(dtype) -> str:
    """The wire name of an engine's compute dtype (``torch.bfloat16`` / ``'bf16'`` → ``'bfloat16'``)."""
    name = str(dtype).lower().removeprefix("torch.")
    return _DTYPE_NAMES.get(name, name)

log = logging.getLogger("veriroll.node")

VERSION = SOFTWARE_VERSION
GOODBYE_S = 2.0  # the last heartbeat's deadline, when stopping

# Refusals that end a running node: waiting does not change them, and working on would be wasted.
FATAL_REFUSALS = {Reason.BANNED: 3, Reason.KEY_IN_USE: 2, Reason.NODE_TOO_OLD: 2}

IDLE_SWAP_DEADLINE_MS = 60_000  # a version the node holds is live well within this; _engine_for needs a deadline

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


@dataclass
class NodeStatus:
    """What the node shows its operator (live view, status file).

    ``policy_version`` is the newest version the node has heard of, ``loaded_version`` the one it runs.
    Setting ``last_error`` also stamps when it happened and restarts the count of successful exchanges
    since (``problem_at``, ``oks_since_problem``): the view decides from those when a problem is over,
    whichever path reported it.
    """

    node_id: str = ""
    standing: str = ""
    policy_version: int = -1
    loaded_version: int = -1
    leases_in_flight: int = 0
    accepted_groups: int = 0
    accepted_tokens: int = 0
    rejected: Counter = field(default_factory=Counter)
    tokens_per_s: float = 0.0
    last_reward: float = 0.0
    connected: bool = False
    problem_at: float = 0.0  # time.monotonic() when last_error was last set (before it: __init__ sets it first)
    oks_since_problem: int = 0
    last_error: str = ""
    download: dict = field(default_factory=dict)
    adversary: dict = field(default_factory=dict)  # TESTING ONLY: what an --adversary node tried and was told

    def __setattr__(self, name: str, value) -> None:
        if name == "last_error" and value:
            super().__setattr__("problem_at", time.monotonic())
            super().__setattr__("oks_since_problem", 0)
        super().__setattr__(name, value)

    def note_ok(self) -> None:
        """One exchange with the coordinator went through (a lease, an accepted group, a heartbeat)."""
        self.oks_since_problem += 1

    def note_version(self, version: int) -> None:
        """The coordinator named ``version`` (a lease, a heartbeat): the newest version is at least that."""
        self.policy_version = max(self.policy_version, int(version))

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["rejected"] = dict(self.rejected)
        d["download"] = {str(k): v for k, v in self.download.items()}
        return d


GRACE_S = 8.0  # after a stop signal, how long the lease in hand may take before it is abandoned
HEARTBEAT_BACKOFF_CAP_S = 60.0  # failing heartbeats slow down to at most one a minute
HEARTBEAT_LOG_EVERY_S = 60.0  # a failing heartbeat is logged at once, then at most this often (unless it changes)


class Stopped(Exception):
    """The node was told to stop (a signal) and is abandoning what it was waiting for."""


class Backoff:
    def __init__(self, base: float = 0.5, cap: float = 30.0):
        self.base, self.cap, self.n = base, cap, 0

    def next(self) -> float:
        delay = min(self.cap, self.base * (2 ** self.n))
        self.n += 1
        return delay * (0.5 + random.random() / 2)

    def reset(self) -> None:
        self.n = 0


class HeartbeatFailures:
    """Consecutive heartbeat failures: how long to wait before the next beat, and logs that do not spam.

    The first failure is logged at once; while it keeps failing the same way (the same ``kind``: a reason
    code or an exception type, whatever its detail), at most once every ``HEARTBEAT_LOG_EVERY_S`` with the
    count; another kind is logged at once; recovery is logged.
    """

    def __init__(self, backoff: Backoff, *, clock: Callable[[], float] = time.monotonic):
        self.backoff = backoff
        self.clock = clock
        self.count = 0
        self._last_kind = ""
        self._logged_at = -float("inf")
        self._unlogged = 0

    def next_delay(self, period_s: float) -> float:
        return self.backoff.next() if self.count else period_s

    def failed(self, kind: str, detail: str, *, exc_info: BaseException | None = None) -> None:
        self.count += 1
        now = self.clock()
        new_kind = kind != self._last_kind
        if new_kind or now - self._logged_at >= HEARTBEAT_LOG_EVERY_S:
            more = f" ({self._unlogged} more failures since the last report)" if self._unlogged else ""
            log.warning("heartbeat failed %d time(s) in a row: %s: %s%s; backing off", self.count, kind, detail, more,
                        exc_info=exc_info if new_kind else None)
            self._last_kind, self._logged_at, self._unlogged = kind, now, 0
        else:
            self._unlogged += 1

    def succeeded(self) -> None:
        if self.count:
            log.info("heartbeat back after %d failure(s)", self.count)
        self.count, self._last_kind, self._unlogged = 0, "", 0
        self._logged_at = -float("inf")
        self.backoff.reset()


class NodeAgent:
    def __init__(self, cfg: NodeConfig, *, key: PrivateKey, channel: grpc.aio.Channel, engine_factory: Callable,
                 versions, hardware: Hardware, engine_kind: str, device: str, adversary=None):
        self.cfg = cfg
        self.key = key
        self.stub = SignedStub(channel, key, timeout=cfg.call_timeout_s,
                               method_timeouts={"SubmitGroup": cfg.submit_timeout_s}, max_pow_bits=cfg.pow_max_bits)
        self.engine_factory = engine_factory
        self.engine = None
        self.versions = versions
        self.hardware = hardware
        self.engine_kind = engine_kind
        self.device = device
        self.adversary = adversary
        self.status = NodeStatus(node_id=key.node_id)
        self.policy: pb.PolicyInfo | None = None
        self.stopping = asyncio.Event()  # no new leases; the one in hand may finish (within a grace)
        self.abandon = asyncio.Event()  # drop everything in flight now, the lease in hand included
        self.busy_threads: list[threading.Thread] = []  # engine work left running when the node abandoned it
        self._backoff = Backoff()
        self._leased: pb.LeaseResponse | None = None  # leases that came with the last accepted group
        self._tok_window: list[tuple[float, int]] = []
        # This process's claim on its key, in Register and Heartbeat: the coordinator refuses a second process
        # running the same key (key_in_use) while this one heartbeats.
        self.session_id = secrets.token_hex(16)
        self.exit_code: int | None = None  # set by a refusal that ends the node

    # --- coordinator calls with retry -------------------------------------------------------------

    async def _call(self, fn, *args):
        while not self.abandon.is_set():
            try:
                result = await self._unless_abandoned(fn(*args))
                self._backoff.reset()
                self.status.connected = True
                return result
            except CallError as err:
                if err.code in RETRYABLE and err.refusal is not Reason.MESSAGE_TOO_LARGE:
                    if self.stopping.is_set() and err.code == grpc.StatusCode.UNAVAILABLE:
                        raise
                    self.status.connected = err.code != grpc.StatusCode.UNAVAILABLE
                    self.status.last_error = f"{err.reason}: {err.said}"
                    delay = self._backoff.next()
                    log.warning("coordinator call failed (%s); retrying in %.1fs", err.reason, delay)
                    await self._sleep(delay)
                    continue
                if err.refusal is Reason.UNKNOWN_KEY:
                    log.warning("coordinator does not know this key (restarted with a new state?); registering again")
                    await self.register()
                    continue
                raise
        raise Stopped

    def request_stop(self, grace_s: float = GRACE_S) -> None:
        """First stop signal: take no new lease; give the lease in hand ``grace_s`` to finish, then abandon it."""
        self.stopping.set()
        if self.status.leases_in_flight:
            log.warning("stopping: finishing the lease in hand (at most %.0fs; Ctrl-C again to abandon it)", grace_s)
            asyncio.get_running_loop().call_later(grace_s, self._grace_over)
        else:
            log.warning("stopping")
            self.abandon.set()

    def _grace_over(self) -> None:
        if not self.abandon.is_set() and self.status.leases_in_flight:
            log.warning("the lease in hand did not finish in time; abandoning it")
        self.abandon.set()

    async def _sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, waking at once when the node abandons its work."""
        try:
            await asyncio.wait_for(self.abandon.wait(), timeout=seconds)
        except TimeoutError:
            pass

    async def _unless_abandoned(self, aw):
        """Await ``aw``; raise :class:`Stopped` (cancelling it) if the node abandons its work first."""
        if self.abandon.is_set():
            if asyncio.iscoroutine(aw):
                aw.close()
            raise Stopped
        task = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.abandon.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        raise Stopped

    async def _in_thread(self, fn, *args):
        """``fn(*args)`` in a daemon thread, abandoned (left to run, never waited for) if the node abandons its work.

        A daemon thread rather than ``asyncio.to_thread``: the loop's executor is joined at exit, so a generation
        that cannot be interrupted would keep a stopped node alive until it finished.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(result=None, exc=None):
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(result)

        def work():
            try:
                outcome = {"result": fn(*args)}
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                outcome = {"exc": exc}
            with contextlib.suppress(RuntimeError):  # the loop is gone: the node stopped without this
                loop.call_soon_threadsafe(lambda: settle(**outcome))

        thread = threading.Thread(target=work, name=f"engine-{getattr(fn, '__name__', 'work')}", daemon=True)
        thread.start()
        try:
            return await self._unless_abandoned(fut)
        except Stopped:
            self.busy_threads.append(thread)
            raise

    async def register(self) -> None:
        hw = self.hardware
        req = pb.RegisterRequest(
            public_key=self.key.public.raw, software_version=VERSION, display_name=self.cfg.display_name,
            session_id=self.session_id, hardware=pb.HardwareReport(
                cpu=hw.cpu, cpu_count=hw.cpu_count, ram_bytes=hw.ram_bytes, disk_free_bytes=hw.disk_free_bytes,
                os=hw.os, engine=self.engine_kind, device=self.device,
                gpus=[pb.Gpu(name=g.name, memory_bytes=g.memory_bytes) for g in hw.gpus]),
        )
        while True:
            if self.abandon.is_set():
                raise Stopped
            try:
                resp = await self._unless_abandoned(self.stub.register(req))
                break
            except CallError as err:
                if err.code not in RETRYABLE:
                    raise
                delay = self._backoff.next()
                self.status.last_error = f"{err.reason}: {err.said}"
                if err.refusal is Reason.NEW_IDENTITY_LIMITED:
                    log.warning("the coordinator takes no more new keys from this network now (%s); retrying in %.1fs",
                                err.said, delay)
                else:
                    log.warning("cannot reach the coordinator at %s (%s); retrying in %.0fs (Ctrl-C to stop)",
                                self.cfg.coordinator, err.reason, delay)
                await self._sleep(delay)
        self._backoff.reset()
        skew = (resp.server_time_ms - time.time() * 1000) / 1000
        if abs(skew) > 5:
            log.warning("this machine's clock is %+.1fs off the coordinator's; requests beyond the window fail", skew)
        self.status.standing = resp.standing
        self.status.connected = True
        self._set_policy(resp.policy)
        log.info("registered as %s (standing: %s); policy version %d", resp.node_id, resp.standing, resp.policy.version)

    def _set_policy(self, policy: pb.PolicyInfo) -> None:
        from veriroll.protos.identity import InvalidPublicKey, PublicKey

        self.policy = policy
        announced = None
        if len(policy.coordinator_public_key) == 32:
            try:
                announced = PublicKey(bytes(policy.coordinator_public_key))
            except InvalidPublicKey as exc:  # small order or non-canonical: it would verify forged manifests
                log.error("the coordinator announces an unusable checkpoint key (%s); ignoring it", exc)
        pinned = getattr(self.versions, "coordinator_key", False)
        if pinned is None and announced is not None:
            # No key pinned in the config: trust the one the coordinator announces over TLS.
            self.versions.coordinator_key = announced
        elif pinned and announced is not None and pinned.raw != announced.raw:
            log.error("the coordinator announces checkpoint key %s but this node pins %s; checkpoints will be refused",
                      announced.node_id, pinned.node_id)
        self.status.policy_version = policy.version
        take_hints = getattr(self.versions, "take_peer_hints", None)
        if take_hints is not None:
            take_hints(bytes(policy.peer_hints))

    async def _heartbeats(self) -> None:
        """Report liveness and pick up new policy versions, until the node stops; failures back off and are logged."""
        failing = HeartbeatFailures(Backoff(self.cfg.heartbeat_s, max(self.cfg.heartbeat_s, HEARTBEAT_BACKOFF_CAP_S)))
        while not self.stopping.is_set():
            await self._sleep(failing.next_delay(self.cfg.heartbeat_s))
            if self.stopping.is_set():  # told to stop while asleep: the channel may be closed already
                break
            try:
                resp = await self.stub.heartbeat(pb.HeartbeatRequest(
                    loaded_version=self.engine.version if self.engine and self.engine.version is not None else -1,
                    leases_in_flight=self.status.leases_in_flight, tokens_per_s=self.status.tokens_per_s,
                    session_id=self.session_id, **self._swarm_listing()))
                self.status.standing = resp.standing
                self.status.note_version(resp.policy_version)
                if self.policy is None or resp.policy_version != self.policy.version:
                    self._set_policy((await self.stub.get_policy()).policy)
                if self.policy is not None:
                    await self.versions.ensure(self.policy.version, list(self.policy.relays))
                self.status.download = self.versions.progress()
                self.status.note_ok()
            except CallError as err:
                self.status.last_error = f"heartbeat: {err.reason}"
                if err.refusal in FATAL_REFUSALS:
                    self._fatal(err)
                    break
                failing.failed(err.reason, err.said)
            except Exception as exc:  # noqa: BLE001 - a bug here must not stop the heartbeat; logged with its traceback
                if self.stopping.is_set():  # the channel closed under a call in flight: stopping, not a failure
                    break
                self.status.last_error = f"heartbeat: {exc}"
                failing.failed(type(exc).__name__, str(exc), exc_info=exc)
            else:
                failing.succeeded()

    async def _reserve_circuits(self, swarm) -> None:
        """A slot on each of ``swarm_relays``: peers then reach this node through them (its heartbeat lists
        the circuit addresses). A relay that refuses costs only that: the node still fetches from peers."""
        from veriroll.shardcast.swarm.errors import SwarmError

        for relay in self.cfg.swarm_relays:
            addr, sep, peer_id = relay.rpartition("/p2p/")
            if not sep or not addr or not peer_id:
                log.error("swarm_relays entry %r is not /ip4/HOST/tcp/PORT/p2p/PEER_ID; skipped", relay)
                continue
            try:
                circuit = await swarm.reserve(peer_id, addr)
            except SwarmError as exc:
                log.warning("no circuit through relay %s: %s", relay, exc)
            else:
                log.info("peers reach this node through circuit %s", circuit)

    def _swarm_listing(self) -> dict:
        """What this node's peer swarm serves (HeartbeatRequest fields), for the coordinator to announce."""
        listing = getattr(self.versions, "swarm_listing", None)
        return listing() if listing is not None else {}

    # --- the loop ---------------------------------------------------------------------------------

    async def _engine_for(self, version: int, deadline_ms: int):
        """The engine with ``version`` live, fetching and swapping first if needed; None if it cannot be in time."""
        if self.engine is not None and self.engine.version == version:
            return self.engine
        relays = list(self.policy.relays) if self.policy else []
        while True:
            path = await self._unless_abandoned(self.versions.ensure(version, relays))
            if path is not None:
                break
            if time.time() * 1000 > deadline_ms - 1000 or self.abandon.is_set() or self.versions.gone(version):
                return None
            await self._sleep(0.2)
        if self.engine is None:
            self.engine = await self._in_thread(self.engine_factory, Path(path), version)
        else:
            await self._in_thread(self.engine.load, Path(path), version)
        if self.adversary is not None:  # TESTING ONLY: weight attacks bend the engine after each load
            await self._in_thread(self.adversary.prepare_engine, self.engine)
        self.status.loaded_version = version
        log.info("policy version %d is live", version)
        return self.engine

    async def _swap_in_newest_held(self) -> None:
        """While the coordinator has no work for this node, make the newest version live if the node holds it
        already (the heartbeat fetches it): the next lease at it then starts at once instead of after the
        swap, and a node told to wait does not sit on an old version. Nothing is fetched or waited for here;
        a swap that fails is logged and left to the next lease, which swaps (and reports) as before."""
        if self.engine is None or self.policy is None or self.stopping.is_set():
            return
        newest = self.policy.version
        if self.engine.version == newest or newest not in self.versions.available():
            return
        try:
            await self._engine_for(newest, int(time.time() * 1000) + IDLE_SWAP_DEADLINE_MS)
        except Stopped:
            raise
        except Exception as exc:  # noqa: BLE001 - an early swap is an optimisation; the lease path swaps again
            log.warning("could not make version %d live while idle (the next lease at it tries again): %s", newest, exc)

    def _window_versions(self) -> list[int]:
        if self.policy is None:
            return []
        lo = self.policy.version - self.policy.s_max
        return [v for v in self.versions.available() if v >= lo]

    async def run(self) -> int:
        heartbeat = None
        swarm = getattr(self.versions, "swarm", None)
        try:
            if swarm is not None:
                await swarm.start()
                log.info("peer swarm %s listening on %s", swarm.peer_id, ", ".join(swarm.addrs))
                await self._reserve_circuits(swarm)
            await self.register()
            if self.policy is not None:
                await self._unless_abandoned(self.versions.ensure(self.policy.version, list(self.policy.relays)))
            heartbeat = asyncio.create_task(self._heartbeats())
            while not self.stopping.is_set():
                if self.cfg.max_groups and self.status.accepted_groups >= self.cfg.max_groups:
                    log.info("submitted %d accepted groups; done", self.status.accepted_groups)
                    break
                # The last accepted group's response may carry the next leases already (SubmitGroupRequest's
                # next_leases): then no LeaseWork round trip.
                resp, self._leased = self._leased, None
                try:
                    if resp is None:
                        resp = await self._call(self.stub.lease_work, self._lease_request())
                except CallError as err:
                    self.status.rejected[err.reason] += 1
                    self.status.last_error = str(err)
                    if err.refusal in FATAL_REFUSALS:
                        self._fatal(err)
                        break
                    log.warning("lease request refused: %s", err)
                    await self._sleep(self._backoff.next())
                    continue
                self.status.note_ok()
                if not resp.leases:
                    await self._swap_in_newest_held()
                    await self._sleep(max(0.05, resp.retry_after_ms / 1000))
                    continue
                for i, lease in enumerate(resp.leases):
                    self.status.note_version(lease.policy_version)
                    if self.stopping.is_set():
                        log.warning("stopping: leaving lease %s; it returns to the pool at its deadline", lease.lease_id)
                        continue
                    await self._serve(lease, ask_next=i == len(resp.leases) - 1)
        except Stopped:
            pass
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            if self.status.connected and self.exit_code is None:
                await self._say_goodbye()
            # An engine still working in an abandoned thread is left alone: the process exits around it.
            if self.engine is not None and not any(t.is_alive() for t in self.busy_threads):
                self.engine.close()
            if swarm is not None:
                await swarm.stop()
        return self.exit_code or 0

    def _fatal(self, err: CallError) -> None:
        """A refusal that ends this node (banned, its key in use elsewhere, too old): say why and stop."""
        advice = {Reason.BANNED: "`veriroll node credits` shows its ledger and why",
                  Reason.KEY_IN_USE: "stop the other process, or give this node its own key (veriroll keygen --out PATH)",
                  Reason.NODE_TOO_OLD: "pip install -U veriroll"}[err.refusal]
        log.error("the coordinator refused this node (%s): %s; %s", err.reason, err.said, advice)
        self.exit_code = FATAL_REFUSALS[err.refusal]
        self.stopping.set()
        self.abandon.set()

    async def _say_goodbye(self) -> None:
        """Tell the coordinator this session ends, so that the key is free for a restart at once (best effort:
        a coordinator out of reach lets the session lapse after identity.session_ttl_s)."""
        try:
            await asyncio.wait_for(self.stub.heartbeat(pb.HeartbeatRequest(session_id=self.session_id, stopping=True)),
                                   GOODBYE_S)
        except Exception as exc:  # noqa: BLE001 - a goodbye that does not arrive costs a lapse, never the exit
            log.debug("goodbye heartbeat not delivered: %s", exc)

    def _lease_request(self) -> pb.LeaseRequest:
        loaded = self.engine.version if self.engine is not None and self.engine.version is not None else -1
        return pb.LeaseRequest(max_leases=self.cfg.max_leases, loaded_version=loaded,
                               available_versions=self._window_versions())

    def _wants_more(self) -> bool:
        """Whether the loop will lease again after this group (not stopping, not at max_groups)."""
        return not self.stopping.is_set() and not (
            self.cfg.max_groups and self.status.accepted_groups + 1 >= self.cfg.max_groups)

    async def _serve(self, lease: pb.Lease, *, ask_next: bool = False) -> None:
        from veriroll.node.engines.base import GenerationRequest

        self.status.leases_in_flight += 1
        try:
            engine = await self._engine_for(lease.policy_version, lease.deadline_ms)
            if engine is None:
                if self.versions.gone(lease.policy_version):
                    log.info("version %d left the relays before this node had it (the policy moved on); "
                             "lease %s returns to the pool at its deadline", lease.policy_version, lease.lease_id)
                else:
                    log.warning("version %d not available before the deadline of lease %s; letting it expire",
                                lease.policy_version, lease.lease_id)
                return
            request = GenerationRequest(prompt_ids=list(lease.prompt_ids), seeds=list(lease.seeds),
                                        temperature=float(lease.temperature), max_new_tokens=int(lease.max_new_tokens),
                                        stop_token_ids=list(lease.stop_token_ids))
            t0 = time.perf_counter()
            try:
                results = (await self._in_thread(engine.generate, [request]))[0]
            except Stopped:
                log.warning("abandoning lease %s mid-generation; it returns to the pool at its deadline",
                            lease.lease_id)
                raise
            gen_s = time.perf_counter() - t0
            if any(not r.proof for r in results):
                # Never submit unproven samples: an engine without proofs is broken, so stop the node.
                raise RuntimeError(f"engine {type(engine).__name__} returned a sample without a TOPLOC proof for "
                                   f"lease {lease.lease_id}; refusing to submit")
            req = pb.SubmitGroupRequest(lease_id=lease.lease_id, policy_version=lease.policy_version,
                                        compute_dtype=dtype_name(getattr(engine, "dtype", "float32")), samples=[
                pb.Sample(token_ids=r.token_ids, logprobs=np.asarray(r.logprobs, dtype="<f4").tobytes(),
                          proof=r.proof, finish_reason=r.finish_reason) for r in results])
            tokens = sum(len(r.token_ids) for r in results)
            self._note_tokens(tokens, gen_s)
            if self.adversary is not None:
                await self.adversary.submit(self, lease, req, results)
                return
            if ask_next and self._wants_more():
                req.next_leases.CopyFrom(self._lease_request())
            await self.submit(req, tokens)
        finally:
            self.status.leases_in_flight -= 1

    def _note_tokens(self, tokens: int, seconds: float) -> None:
        now = time.monotonic()
        self._tok_window = [(t, n) for t, n in self._tok_window if now - t < 30] + [(now, tokens)]
        span = max(seconds, now - self._tok_window[0][0]) if len(self._tok_window) > 1 else seconds
        self.status.tokens_per_s = sum(n for _, n in self._tok_window) / max(span, 1e-6)

    async def submit(self, req: pb.SubmitGroupRequest, tokens: int) -> pb.SubmitGroupResponse | None:
        try:
            resp = await self._call(self.stub.submit_group, req)
        except CallError as err:
            self.status.rejected[err.reason] += 1
            log.warning("group for lease %s rejected: %s", req.lease_id, err)
            self._write_status()
            return None
        self.status.accepted_groups += 1
        self.status.accepted_tokens += resp.credited_tokens
        if resp.HasField("next_leases"):
            self._leased = resp.next_leases
        self.status.last_reward = float(np.mean(resp.rewards)) if len(resp.rewards) else 0.0
        self.status.note_ok()
        # One line per group would be ten a second on a small model: the view sums them up instead.
        log.debug("group accepted (lease %s, version %d, %d tokens, mean reward %.2f)", req.lease_id,
                  req.policy_version, tokens, self.status.last_reward)
        self._write_status()
        return resp

    def _write_status(self) -> None:
        if self.cfg.status_file:
            tmp = Path(self.cfg.status_file + ".tmp")
            tmp.write_text(json.dumps(self.status.as_dict()))
            tmp.replace(self.cfg.status_file)
