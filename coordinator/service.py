"""The coordinator's request logic, between the wire (``server.py``) and the store.

:class:`CoordinatorService` composes the parts along their jobs: the door (``edge.py``: envelope,
signature, replay, identity, rate limits), the ledger (``ledger.py``: nodes, standings, every refusal
counted once, credits), the lease desk (``leases.py``) and the intake (``intake.py``: checks,
verification, rewards, the verdict). :meth:`CoordinatorService.call` takes one request as raw bytes
and returns the response message or raises a counted :class:`Refusal`; nothing here knows about
gRPC status codes.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any

from google.protobuf.message import DecodeError
from packaging.version import InvalidVersion, Version

from veriroll.coordinator import store as st
from veriroll.coordinator.admission import NewIdentityLimiter, check_register_pow
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.edge import Door, Refusal, banned
from veriroll.coordinator.environments import environment_kwargs
from veriroll.coordinator.intake import (
    MESSAGES_META_KEY,
    GroupVerifier,
    Intake,
    Submission,
    sample_blobs,
)
from veriroll.coordinator.leases import LeaseDesk, LeaseStep, random_seeds
from veriroll.coordinator.ledger import Ledger, NodeInfo
from veriroll.coordinator.limits import PeerGate
from veriroll.coordinator.metrics import CoordinatorMetrics
from veriroll.coordinator.policy import PolicyState
from veriroll.coordinator.prompts import PromptRenderer
from veriroll.coordinator.rewards import RewardRunner
from veriroll.coordinator.verify_budget import VerifierBudget
from veriroll.protos.bounds import field_problem
from veriroll.protos.envelope import EnvelopeError, SignedHeaders, parse_headers
from veriroll.protos.identity import PublicKey, public_key_problem
from veriroll.protos.netaddr import address_key
from veriroll.protos.reasons import Reason
from veriroll.protos.service import METHODS, UPGRADE_COMMAND, full_method
from veriroll.protos.v1 import coordinator_pb2 as pb
from veriroll.shardcast.swarm.hints import PeerDirectory, peer_id_problem

log = logging.getLogger("veriroll.coordinator")

__all__ = ["CoordinatorService", "GroupVerifier", "MESSAGES_META_KEY", "NodeInfo", "PolicyState", "Refusal",
           "TextCodec", "encode_prompt", "now_ms", "random_seeds", "sample_blobs"]


def now_ms() -> int:
    return int(time.time() * 1000)


class StoreOutageLog:
    """What the serving path tells the operator while the store cannot serve it (PostgreSQL down, the disk
    full): nodes are answered ``store_unavailable`` and retry; the log gets the reason at once, then at most
    one line every ``every_s`` with the requests refused meanwhile, and one line when a request goes through
    again. A traceback per request would bury the cause; no line at all would leave a full disk to be found
    from the nodes' side.

    "Again" means a request served after ``quiet_s`` with none refused: on a nearly full disk some
    transactions still fit while others fail, and reads go through all along."""

    def __init__(self, every_s: float = 10.0, quiet_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self.quiet_s = quiet_s
        self.clock = clock
        self.down_since: float | None = None
        self._logged_at = self._refused_at = 0.0
        self._refused = 0  # since the last line

    def refused(self, exc: BaseException) -> None:
        now = self._refused_at = self.clock()
        self._refused += 1
        if self.down_since is None:
            self.down_since = now
        elif now - self._logged_at < self.every_s:
            return
        log.error("the store is unavailable: %s (%d request(s) could not use it since the last line; nodes are "
                  "told store_unavailable and retry)", exc, self._refused)
        self._logged_at, self._refused = now, 0

    def served(self) -> None:
        if self.down_since is None:
            return
        now = self.clock()
        if now - self._refused_at < self.quiet_s:
            return
        log.warning("the store serves requests again, %.1f s after the first refused (%d more refused since the last "
                    "line)", self._refused_at - self.down_since, self._refused)
        self.down_since, self._refused = None, 0


class CoordinatorService:
    def __init__(
        self,
        cfg: CoordinatorConfig,
        db: st.Database,
        *,
        environment,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        coordinator_key: PublicKey,
        policy: PolicyState,
        verifier: GroupVerifier | None = None,
        metrics: CoordinatorMetrics | None = None,
        clock: Callable[[], int] = now_ms,
        rewards: RewardRunner | None = None,
        peer_directory: PeerDirectory | None = None,
    ):
        self.cfg = cfg
        self.peer_directory = peer_directory  # nodes' swarms, announced signed in the policy (shardcast/swarm/hints.py)
        self.db = db
        self.env = environment
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.coordinator_key = coordinator_key
        self.policy = policy
        self.verifier = verifier
        self.metrics = metrics or CoordinatorMetrics()
        policy.report_to(self.metrics.policy_version)
        self.clock = clock
        now = lambda: self.clock()  # noqa: E731 - the parts read the service's clock, which tests may move
        ec = cfg.environment
        self.codec = TextCodec(tokenizer, [p.text for p in environment.sample_prompts(random.Random(0), 16)])
        # Raises PromptRenderError here, at coordinator start, when chat_template='always' meets a
        # tokenizer without a template.
        self.renderer = PromptRenderer(tokenizer, system_prompt=ec.system_prompt, chat_template=ec.chat_template,
                                       encode_text=self.codec.encode)
        self.stop_token_ids = self.renderer.stop_token_ids(list(stop_token_ids), override=cfg.leases.stop_token_ids)
        inline = ec.inline_bounded_rewards and getattr(getattr(environment, "rubric", None), "bounded", False)
        self.rewards = rewards or RewardRunner(ec.name, environment_kwargs(cfg), timeout_s=ec.reward_timeout_s,
                                               workers=ec.reward_workers, inline=environment if inline else None)
        self.ledger = Ledger(db, self.metrics, now, max_strikes=cfg.intake.max_strikes,
                             probation_groups=cfg.intake.probation_groups, session_ttl_s=cfg.identity.session_ttl_s)
        # With a PostgreSQL store, other edge processes may share it: nonces go where all of them see them.
        self.door = Door(cfg, self.ledger, now, db=db, shared_nonces=st.pg.is_url(str(db.path)))
        self.new_identities = NewIdentityLimiter.from_config(cfg.identity, shared_db=db if self.door.shared_nonces else None)
        self.peer_gate = PeerGate(cfg.server.max_inflight_per_address)
        self.store_outage = StoreOutageLog()
        self._log_identity_policy()
        # Verifier time per node key, address and network: shared by the lease desk (no work for a node
        # whose groups could not be verified now) and the intake (which pays what verification cost).
        self.verify_budget = VerifierBudget.from_config(
            cfg.intake, shared_db=db if self.door.shared_nonces else None) if verifier is not None else None
        self.leases = LeaseDesk(cfg, db, environment=environment, renderer=self.renderer, policy=policy,
                                metrics=self.metrics, clock=now, stop_token_ids=self.stop_token_ids,
                                verify_budget=self.verify_budget)
        self.intake = Intake(cfg, db, ledger=self.ledger, policy=policy, metrics=self.metrics, clock=now,
                             vocab_size=vocab_size, rewards=self.rewards, codec=self.codec,
                             stop_token_ids=self.stop_token_ids, verifier=verifier, verify_budget=self.verify_budget)
        self._handlers = {  # Register, which needs the headers too, is served by register()
            "Heartbeat": self.heartbeat, "LeaseWork": self.lease_work,
            "SubmitGroup": self.submit_group, "GetPolicy": self.get_policy, "GetLedger": self.get_ledger,
        }

    # --- one request --------------------------------------------------------------------------------

    async def call(self, name: str, body: bytes | Callable[[], Awaitable[bytes | None]], metadata, peer: str, *,
                   has_deadline: bool = True):
        """Serve one request of method ``name``: ``body`` as received (the signature covers exactly these
        bytes), or a coroutine function that reads it, ``metadata`` the call's headers. Returns the response
        message; raises :class:`Refusal`, which is counted exactly once whichever part refused.

        Before the body is read (and so before it costs memory), the address must have a free slot of its
        ``server.max_inflight_per_address`` and the call a deadline; the read itself is bounded by
        ``server.body_timeout_s``, so a client that sends headers and then nothing holds nothing for long.
        """
        with self.peer_gate.hold(peer) as admitted:
            return await self._call(name, body, metadata, peer, has_deadline, admitted)

    async def _call(self, name: str, body, metadata, peer: str, has_deadline: bool, admitted: bool):
        node_id = ""
        try:
            if not admitted:
                raise Refusal(Reason.RATE_LIMITED, f"more than {self.peer_gate.limit} requests in flight from "
                                                   f"{address_key(peer)}")
            if not has_deadline:
                raise Refusal(Reason.DEADLINE_REQUIRED)
            if not isinstance(body, bytes):
                body = await self._read_body(body)
            cap = self.cfg.server.max_message_bytes
            if len(body) > cap:
                raise Refusal(Reason.MESSAGE_TOO_LARGE, f"{len(body)} bytes > {cap} accepted")
            try:
                headers = parse_headers(metadata)
            except EnvelopeError as exc:
                raise Refusal(Reason(exc.reason), str(exc)) from exc
            node = await self.door.admit(full_method(name), name, body, headers, peer)
            node_id = node.node_id if node else ""
            request_type = METHODS[name][0]
            try:
                request = request_type.FromString(body)
            except DecodeError as exc:
                raise Refusal(Reason.MALFORMED, f"cannot parse {request_type.__name__}: {exc}") from exc
            problem = field_problem(request)
            if problem is not None:
                raise Refusal(Reason.MALFORMED, problem)
            if name == "Register":
                response = await self.register(headers, request, node=node, peer=peer)
            elif name in ("Heartbeat", "LeaseWork", "SubmitGroup"):
                response = await self._handlers[name](node, request, peer=peer)
            else:
                response = await self._handlers[name](node, request)
            self.metrics.requests.inc(method=name, result="ok")
            self.store_outage.served()
            return response
        except Refusal as refusal:
            self.metrics.requests.inc(method=name, result=refusal.reason.value)
            if not refusal.counted:
                # The door's refusals of a known key (banned, over its rate) count against that key but leave
                # no event row: they are what a flood is made of, and the key's rate limit does not bound them.
                await self._record_refusal(node_id or refusal.node_id, refusal.reason, refusal.detail,
                                           log_event=bool(node_id))
                refusal.counted = True
            raise
        except st.StoreUnavailable as exc:  # counted in the metrics only: the store cannot take the row now
            self.metrics.requests.inc(method=name, result=Reason.STORE_UNAVAILABLE.value)
            self.ledger.counted(node_id, Reason.STORE_UNAVAILABLE)
            self.store_outage.refused(exc)
            raise Refusal(Reason.STORE_UNAVAILABLE, f"{exc}; retry in about 2 s", counted=True) from exc
        # Blind on purpose: any bug below the door is answered as a counted `internal` refusal (logged with
        # its traceback); nothing was accepted.
        except Exception as exc:
            log.exception("internal error in %s", name)
            self.metrics.requests.inc(method=name, result=Reason.INTERNAL.value)
            await self._record_refusal(node_id, Reason.INTERNAL, f"internal error in {name}")
            raise Refusal(Reason.INTERNAL, counted=True) from exc

    async def _record_refusal(self, node_id: str, reason: Reason, detail: str, *, log_event: bool = True) -> None:
        """The refusal's row in the store, and its count; when the store cannot take the row (unavailable,
        or a bug recording it, logged) the refusal stands, counted in the metrics only."""
        try:
            await self.ledger.refuse(node_id, reason, detail, log_event=log_event)
        except st.StoreUnavailable as exc:
            self.store_outage.refused(exc)
            self.ledger.counted(node_id, reason)
        except Exception:  # the refusal is answered whatever recording it hit
            log.exception("recording a %s refusal failed", reason.value)
            self.ledger.counted(node_id, reason)

    async def _read_body(self, read: Callable[[], Awaitable[bytes | None]]) -> bytes:
        timeout = self.cfg.server.body_timeout_s
        try:
            # A deadline on this task rather than wait_for, which runs the read in a task of its own.
            async with asyncio.timeout(timeout):
                body = await read()
        except TimeoutError:
            raise Refusal(Reason.MALFORMED, f"the request's body did not arrive within {timeout:g} s") from None
        if body is None:
            raise Refusal(Reason.MALFORMED, "the call ended without a request message (or gRPC refused it, e.g. over "
                                            "max_message_bytes)")
        return body

    async def admit(self, method: str, name: str, body: bytes, headers: SignedHeaders, peer: str) -> NodeInfo | None:
        return await self.door.admit(method, name, body, headers, peer)

    async def count_refusal(self, node_id: str, reason: Reason, detail: str = "", lease_id: str = "") -> None:
        await self.ledger.refuse(node_id, reason, detail, lease_id)

    # --- Register / Heartbeat / GetPolicy / GetLedger -------------------------------------------------

    def policy_info(self) -> pb.PolicyInfo:
        v = self.policy.version
        s_max = self.cfg.intake.s_max
        return pb.PolicyInfo(
            version=v, relays=list(self.policy.relays), s_max=s_max,
            coordinator_public_key=self.coordinator_key.raw, manifest_path=self.policy.manifest_path,
            accepted_versions=list(range(max(0, v - s_max), v + 1)), min_node_version=self.cfg.server.min_node_version,
            peer_hints=self.peer_directory.signed(v) if self.peer_directory is not None else b"",
        )

    def _log_identity_policy(self) -> None:
        ic = self.cfg.identity
        if ic.pow_bits <= 0:
            log.warning("identity: proof of work on Register is OFF by configuration (identity.pow_bits = 0): "
                        "new keys cost an attacker nothing but the per-address limits")
        else:
            log.info("identity: a new key brings %d bits of proof of work to Register", ic.pow_bits)
        if ic.exempt_networks:
            log.warning("identity: new keys from %s are not limited per address (identity.exempt_networks)",
                        ", ".join(ic.exempt_networks))

    async def register(self, headers: SignedHeaders, req: pb.RegisterRequest, *, node: NodeInfo | None = None,
                       peer: str = "unknown") -> pb.RegisterResponse:
        """Register a key, or refresh a known one. Only a key the coordinator does not know yet pays: its
        proof of work first (one hash to check), then a token of its address's and network's budget of
        new identities, so that requests without work spend nobody's budget. A node older than
        ``server.min_node_version`` is refused before it pays anything; a key whose live session is another
        node process is refused, and that process keeps the key."""
        if bytes(req.public_key) != headers.public_key.raw:
            raise Refusal(Reason.BAD_SIGNATURE, "Register must be signed by the key it registers")
        problem = public_key_problem(bytes(req.public_key))
        if problem is not None:  # never store a key anyone can sign for
            raise Refusal(Reason.BAD_KEY, problem)
        too_old = node_version_problem(req.software_version, self.cfg.server.min_node_version)
        if too_old is not None:
            raise Refusal(Reason.NODE_TOO_OLD, too_old)
        if node is None:
            refused = check_register_pow(self.cfg.identity.pow_bits, self.coordinator_key.raw, req, headers) \
                or await self.new_identities.take(peer)
            if refused is not None:
                raise Refusal(*refused)
        h = req.hardware
        hw, software_version, display_name = st.bound_node_fields({
            "cpu": h.cpu, "cpu_count": h.cpu_count, "ram_bytes": h.ram_bytes, "disk_free_bytes": h.disk_free_bytes,
            "os": h.os, "engine": h.engine, "device": h.device,
            "gpus": [{"name": g.name, "memory_bytes": g.memory_bytes} for g in h.gpus[:st.MAX_GPUS]],
        }, req.software_version, req.display_name)
        node = await self.ledger.register(headers.public_key.node_id, headers.public_key.raw, hw, software_version,
                                          display_name, st.Session(req.session_id, peer))
        if isinstance(node, st.LiveSession):
            raise self._key_in_use(node)
        if node.standing == st.Standing.BANNED:
            raise banned(node)
        return pb.RegisterResponse(node_id=node.node_id, standing=node.standing, server_time_ms=self.clock(),
                                   policy=self.policy_info())

    async def heartbeat(self, node: NodeInfo, req: pb.HeartbeatRequest, *, peer: str = "unknown") -> pb.HeartbeatResponse:
        if (problem := peer_id_problem(req.swarm_peer_id)) is not None:  # before anything changes
            raise Refusal(Reason.MALFORMED, problem)
        now = await self.ledger.touch(node, int(req.loaded_version), st.Session(req.session_id, peer),
                                      stopping=req.stopping)
        if isinstance(now, st.LiveSession):
            raise self._key_in_use(now)
        if self.peer_directory is not None:
            self.peer_directory.record(node.node_id, req.swarm_peer_id, req.swarm_addrs, req.swarm_versions, peer,
                                       req.bad_peers)
        return pb.HeartbeatResponse(server_time_ms=now, policy_version=self.policy.version, standing=node.standing)

    def _key_in_use(self, live: st.LiveSession) -> Refusal:
        age_s = max(0.0, (self.clock() - live.seen_ms) / 1000)
        lapse_s = max(0.0, self.cfg.identity.session_ttl_s - age_s)
        return Refusal(Reason.KEY_IN_USE, f"this key is in use by another node process (at {live.address}, last "
                                          f"heartbeat {age_s:.0f} s ago); stop that node, or give this one its own key "
                                          f"(`veriroll keygen --out OTHER.key`); if it stopped without saying so (killed, "
                                          f"crashed), its claim lapses in {lapse_s:.0f} s")

    async def get_policy(self, node: NodeInfo, req: pb.PolicyRequest) -> pb.PolicyResponse:
        return pb.PolicyResponse(policy=self.policy_info())

    async def get_ledger(self, node: NodeInfo, req: pb.LedgerRequest) -> pb.LedgerResponse:
        return await self.ledger.ledger(node)

    # --- LeaseWork / SubmitGroup ---------------------------------------------------------------------

    async def lease_work(self, node: NodeInfo, req: pb.LeaseRequest, *, peer: str = "unknown") -> pb.LeaseResponse:
        return await self.leases.lease_work(node, req, peer=peer)

    async def submit_group(self, node: NodeInfo, req: pb.SubmitGroupRequest, *,
                           peer: str = "unknown") -> pb.SubmitGroupResponse:
        if not req.HasField("next_leases"):
            return await self.intake.submit_group(node, req, peer=peer)
        planned: LeaseStep | pb.LeaseResponse | None = None

        async def plan():
            # Planned once the group passed its checks (as LeaseWork after it would be); its store op runs
            # in the transaction that accepts the group, right after it: one wait on the writer, one commit.
            nonlocal planned
            try:
                planned = await self.leases.plan(node, req.next_leases, peer=peer)
            except Exception as exc:  # noqa: BLE001 - answered in the lease answer; the group goes on
                planned = self._lease_failure(exc)
            return planned.op if isinstance(planned, LeaseStep) else None

        resp, result, error = await self.intake.submit_group_then(node, req, peer=peer, then=plan)
        if planned is None:  # an honest retry of a group accepted before: lease as LeaseWork would
            answer = await self._next_leases(node, req.next_leases, peer)
        elif isinstance(planned, pb.LeaseResponse):
            answer = planned
        elif error is not None:
            answer = self._lease_failure(error)
        else:
            try:
                answer = planned.answer(result)
            except Exception as exc:  # noqa: BLE001 - the group is committed: said in the lease answer
                answer = self._lease_failure(exc)
        resp.next_leases.CopyFrom(answer)
        return resp

    async def _next_leases(self, node: NodeInfo, req: pb.LeaseRequest, peer: str) -> pb.LeaseResponse:
        """LeaseWork's answer inside an accepted submission's response. The group is accepted (committed)
        whatever happens here, so a failure to lease is said in the lease answer (``wait_reason``; the node
        asks again with LeaseWork after ``retry_after_ms``), never as a refusal of the group."""
        try:
            return await self.leases.lease_work(node, req, peer=peer)
        except Exception as exc:  # noqa: BLE001 - said in the lease answer
            return self._lease_failure(exc)

    def _lease_failure(self, exc: Exception) -> pb.LeaseResponse:
        """The lease answer of an accepted group whose lease failed: counted, and retried by the node later."""
        if isinstance(exc, st.StoreUnavailable):
            self.metrics.requests.inc(method="SubmitGroup.next_leases", result=Reason.STORE_UNAVAILABLE.value)
            self.store_outage.refused(exc)
            return pb.LeaseResponse(retry_after_ms=2000, wait_reason=Reason.STORE_UNAVAILABLE.value)
        # Any bug here is logged and counted; the accepted group stands.
        log.error("internal error leasing after an accepted group", exc_info=exc)
        self.metrics.requests.inc(method="SubmitGroup.next_leases", result=Reason.INTERNAL.value)
        return pb.LeaseResponse(retry_after_ms=1000, wait_reason=Reason.INTERNAL.value)

    def _score(self, prompt: dict, sub: Submission) -> list[float]:
        """The rewards of a stored prompt's group, blocking (tests and tools re-check stored rewards)."""
        return self.intake.score_blocking(prompt, sub)

    # --- housekeeping ---------------------------------------------------------------------------

    @staticmethod
    def expire_leases(conn: sqlite3.Connection, now: int) -> int:
        return st.expire_leases(conn, now)

    async def refresh_gauges(self) -> dict[str, Any]:
        # One read, so one snapshot on PostgreSQL: the queue depth and the standings of the same moment.
        summary, standings = await self.db.run_read(lambda c: (st.status_summary(c), st.standing_counts(c)))
        self.metrics.queue_depth.set(summary["unconsumed_groups"])
        for standing, n in standings.items():
            self.metrics.nodes.set(n, standing=standing)
        return summary

    def close(self) -> None:
        self.intake.close()
        self.rewards.close()


def node_version_problem(software_version: str, minimum: str) -> str | None:
    """Why a node reporting ``software_version`` is too old for ``minimum`` (PEP 440; empty: any), or None.
    A version that does not parse is refused too: it is no release of this project."""
    if not minimum:
        return None
    try:
        too_old = Version(software_version) < Version(minimum)
    except InvalidVersion:
        too_old = True
    if not too_old:
        return None
    said = st.bounded_text(software_version, st.NAME_CHARS) or "(no version)"
    return (f"this node runs veriroll {said}; this coordinator accepts {minimum} "
            f"or newer: upgrade with `{UPGRADE_COMMAND}` and start the node again")


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Token ids of a prompt exactly as the warm start formatted it (the tokenizer adds BOS)."""
    return list(tokenizer(text).input_ids)


class TextCodec:
    """The tokenizer calls on the intake path: prompt text to ids, completion ids to text.

    A fast tokenizer's Rust backend is called directly, which is ~30x cheaper per call than the
    transformers wrapper (argument normalization, per-token type checks), but only when the backend
    gives exactly the wrapper's ids and text on probe inputs and the wrapper does no post-processing
    of its own (``clean_up_tokenization_spaces``); otherwise the wrapper is used.
    """

    def __init__(self, tokenizer, probe_texts: list[str]):
        self.tokenizer = tokenizer
        self._backend = None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
            return
        try:
            rng = random.Random(0)
            probe_ids = [[rng.randrange(len(tokenizer)) for _ in range(24)] for _ in range(16)]
            same = all(backend.encode(t).ids == encode_prompt(tokenizer, t) for t in probe_texts) and all(
                backend.decode(ids, skip_special_tokens=True) == tokenizer.decode(ids, skip_special_tokens=True)
                for ids in probe_ids)
        except Exception:  # noqa: BLE001 - any disagreement means: use the wrapper
            same = False
        if same:
            self._backend = backend

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text).ids
        return encode_prompt(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)
