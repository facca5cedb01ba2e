"""The coordinator's request logic, between the wire (``server.py``) and the store.

Every public coroutine takes an already-parsed request plus the authenticated caller and either
returns a response message or raises :class:`Refusal`. Nothing here knows about gRPC status codes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from veriroll.coordinator import store as st
from veriroll.coordinator.admission import NonceStore, RateLimiter
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.intake import (
    LeaseRecord,
    Rejection,
    Submission,
    check_dtype,
    check_lease,
    check_shape,
    check_staleness,
    content_hash,
)
from veriroll.coordinator.metrics import CoordinatorMetrics
from veriroll.coordinator.prompts import PromptRenderer
from veriroll.coordinator.rewards import RewardRunner
from veriroll.protos.envelope import SignedHeaders, verify_signature
from veriroll.protos.identity import PublicKey, public_key_problem
from veriroll.protos.reasons import Reason
from veriroll.protos.v1 import coordinator_pb2 as pb

log = logging.getLogger("veriroll.coordinator")


class Refusal(Exception):
    """A request refused for ``reason``; ``detail`` is shown to the node."""

    def __init__(self, reason: Reason, detail: str = ""):
        super().__init__(f"{reason.value}: {detail or reason.message}")
        self.reason = reason
        self.detail = detail or reason.message


@dataclass
class VerificationResult:
    rejection: Rejection | None
    trusted_logprobs: list[np.ndarray] | None = None
    seconds: float = 0.0


class GroupVerifier(Protocol):
    """The verification stages (TOPLOC, sampling, log-probs) run on the trusted model of ``lease.policy_version``."""

    def verify_group(self, lease: LeaseRecord, prompt_ids: list[int], sub: Submission) -> VerificationResult: ...


@dataclass
class NodeInfo:
    node_id: str
    public_key: bytes
    standing: str


@dataclass
class PolicyState:
    """What GetPolicy tells nodes; updated by the trainer/publisher."""

    version: int = 0
    relays: list[str] = field(default_factory=list)
    manifest_path: str = ""


def now_ms() -> int:
    return int(time.time() * 1000)


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
    ):
        self.cfg = cfg
        self.db = db
        self.env = environment
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.coordinator_key = coordinator_key
        self.policy = policy
        self.verifier = verifier
        self.metrics = metrics or CoordinatorMetrics()
        self.clock = clock
        s = cfg.server
        self.nonces = NonceStore(int(s.timestamp_window_s * 1000), not_before_ms=clock() - 1000)
        self.key_limits = RateLimiter(s.key_rate_per_s, s.key_burst)
        self.peer_limits = RateLimiter(s.peer_rate_per_s, s.peer_burst)
        self._nodes: dict[bytes, NodeInfo] = {}
        self._nodes_loaded_ms = 0
        self._rng = random.Random(cfg.environment.seed)
        self._audit_rng = random.Random()
        self.codec = TextCodec(tokenizer, [p.text for p in environment.sample_prompts(random.Random(0), 16)])
        ec = cfg.environment
        # Raises PromptRenderError here, at coordinator start, when chat_template='always' meets a
        # tokenizer without a template.
        self.renderer = PromptRenderer(tokenizer, system_prompt=ec.system_prompt, chat_template=ec.chat_template,
                                       encode_text=self.codec.encode)
        self.stop_token_ids = self.renderer.stop_token_ids(self.stop_token_ids)
        self.rewards = rewards or RewardRunner(ec.name, ec.kwargs, timeout_s=ec.reward_timeout_s,
                                               workers=ec.reward_workers)
        self._stop_ids_json = json.dumps(self.stop_token_ids)
        self._stop_ids = np.asarray(self.stop_token_ids, dtype=np.int64)
        self._verify_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="veriroll-verify")
        self.db.run_sync(self._restore_prompt_stream)

    # --- door ----------------------------------------------------------------------------------

    def _restore_prompt_stream(self, conn: sqlite3.Connection) -> None:
        drawn = int(st.kv_get(conn, "prompts_drawn", 0))
        self._rng = random.Random(f"{self.cfg.environment.seed}:{drawn}")

    async def _refresh_nodes(self, force: bool = False) -> None:
        # Operators ban and unban from another process (the CLI writes the database): pick that up.
        if not force and self.clock() - self._nodes_loaded_ms < 2000:
            return
        rows = await self.db.run_read(lambda c: c.execute("SELECT node_id, public_key, standing FROM nodes").fetchall())
        self._nodes = {bytes(r["public_key"]): NodeInfo(r["node_id"], bytes(r["public_key"]), r["standing"]) for r in rows}
        self._nodes_loaded_ms = self.clock()

    async def admit(self, method: str, name: str, body: bytes, headers: SignedHeaders, peer: str) -> NodeInfo | None:
        """Signature, replay window, identity, ban and rate checks. Returns the caller (None for Register)."""
        if not self.peer_limits.allow(peer):
            raise Refusal(Reason.RATE_LIMITED, "too many requests from this address")
        # parse_headers already refused these; checked again (a cached lookup) so that no signature is
        # ever taken from a small-order or non-canonical key, however the headers were built.
        problem = public_key_problem(headers.public_key.raw)
        if problem is not None:
            raise Refusal(Reason.BAD_KEY, problem)
        now = self.clock()
        skew = self.nonces.check_time(headers.ts_ms, now)
        if skew is Reason.CLOCK_SKEW:
            raise Refusal(Reason.CLOCK_SKEW, f"request time is {(headers.ts_ms - now) / 1000:+.1f}s from the coordinator's "
                                             f"(window ±{self.cfg.server.timestamp_window_s:g}s); fix the node's clock")
        if not verify_signature(headers, method, body):
            raise Refusal(Reason.BAD_SIGNATURE)
        if skew is not None:
            raise Refusal(skew, "request was signed before the coordinator restarted; sign it again")
        if not self.nonces.use(headers.public_key.raw, headers.nonce, headers.ts_ms, now):
            raise Refusal(Reason.REPLAYED_NONCE)
        await self._refresh_nodes()
        node = self._nodes.get(headers.public_key.raw)
        if node is None and name != "Register":
            await self._refresh_nodes(force=True)
            node = self._nodes.get(headers.public_key.raw)
            if node is None:
                raise Refusal(Reason.UNKNOWN_KEY)
        if node is not None and node.standing == "banned":
            raise Refusal(Reason.BANNED)
        if not self.key_limits.allow(headers.public_key.raw):
            raise Refusal(Reason.RATE_LIMITED, "too many requests for this key")
        return node

    async def count_refusal(self, node_id: str, reason: Reason, detail: str = "", lease_id: str = "") -> None:
        self.metrics.rejections.inc(reason=reason.value)
        await self.db.run(self._refusal_op(node_id, reason, detail, lease_id))
        if node_id and reason.strike:
            await self._refresh_nodes(force=True)

    def _refusal_op(self, node_id: str, reason: Reason, detail: str, lease_id: str) -> Callable[[sqlite3.Connection], None]:
        """The store op that counts a refusal and, for a hard failure, strikes (and maybe bans) the node."""
        now = self.clock()
        strike_limit = self.cfg.intake.max_strikes

        def op(conn: sqlite3.Connection) -> None:
            st.count_rejection(conn, node_id, reason.value, lease_id, detail, now, log=bool(node_id))
            if node_id and reason.strike:
                row = conn.execute("UPDATE nodes SET strikes = strikes + 1, clean_groups = 0, "
                                   "standing = CASE WHEN standing = 'trusted' THEN 'probation' ELSE standing END "
                                   "WHERE node_id = ? RETURNING strikes", (node_id,)).fetchone()
                if row is not None and row["strikes"] >= strike_limit:
                    st.set_standing(conn, node_id, "banned", f"{row['strikes']} strikes, last: {reason.value}")
                    log.warning("banned node %s after %d strikes (last: %s)", node_id, row["strikes"], reason.value)

        return op

    # --- Register / Heartbeat / GetPolicy / GetLedger ------------------------------------------------

    def policy_info(self) -> pb.PolicyInfo:
        v = self.policy.version
        s_max = self.cfg.intake.s_max
        return pb.PolicyInfo(
            version=v, relays=list(self.policy.relays), s_max=s_max,
            coordinator_public_key=self.coordinator_key.raw, manifest_path=self.policy.manifest_path,
            accepted_versions=list(range(max(0, v - s_max), v + 1)),
        )

    async def register(self, headers: SignedHeaders, req: pb.RegisterRequest) -> pb.RegisterResponse:
        if bytes(req.public_key) != headers.public_key.raw:
            raise Refusal(Reason.BAD_SIGNATURE, "Register must be signed by the key it registers")
        problem = public_key_problem(bytes(req.public_key))
        if problem is not None:  # never store a key anyone can sign for
            raise Refusal(Reason.BAD_KEY, problem)
        h = req.hardware
        hw, software_version, display_name = st.bound_node_fields({
            "cpu": h.cpu, "cpu_count": h.cpu_count, "ram_bytes": h.ram_bytes, "disk_free_bytes": h.disk_free_bytes,
            "os": h.os, "engine": h.engine, "device": h.device,
            "gpus": [{"name": g.name, "memory_bytes": g.memory_bytes} for g in h.gpus[:st.MAX_GPUS]],
        }, req.software_version, req.display_name)
        node_id = headers.public_key.node_id
        now = self.clock()

        def op(conn):
            conn.execute(
                "INSERT INTO nodes(node_id, public_key, registered_ms, last_seen_ms, hardware, software_version, display_name) "
                "VALUES(?, ?, ?, ?, ?, ?, ?) ON CONFLICT(node_id) DO UPDATE SET last_seen_ms = excluded.last_seen_ms, "
                "hardware = excluded.hardware, software_version = excluded.software_version, display_name = excluded.display_name",
                (node_id, headers.public_key.raw, now, now, json.dumps(hw), software_version, display_name),
            )
            return conn.execute("SELECT standing FROM nodes WHERE node_id = ?", (node_id,)).fetchone()["standing"]

        standing = await self.db.run(op)
        await self._refresh_nodes(force=True)
        if standing == "banned":
            raise Refusal(Reason.BANNED)
        return pb.RegisterResponse(node_id=node_id, standing=standing, server_time_ms=now, policy=self.policy_info())

    async def heartbeat(self, node: NodeInfo, req: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        now = self.clock()
        await self.db.run(lambda c: c.execute("UPDATE nodes SET last_seen_ms = ?, loaded_version = ? WHERE node_id = ?",
                                              (now, int(req.loaded_version), node.node_id)))
        return pb.HeartbeatResponse(server_time_ms=now, policy_version=self.policy.version, standing=node.standing)

    async def get_policy(self, node: NodeInfo, req: pb.PolicyRequest) -> pb.PolicyResponse:
        return pb.PolicyResponse(policy=self.policy_info())

    async def get_ledger(self, node: NodeInfo, req: pb.LedgerRequest) -> pb.LedgerResponse:
        def op(conn):
            row = conn.execute("SELECT * FROM nodes WHERE node_id = ?", (node.node_id,)).fetchone()
            return dict(row), st.rejections_by_reason(conn, node.node_id)

        row, rejections = await self.db.run_read(op)
        return pb.LedgerResponse(
            node_id=node.node_id, standing=row["standing"], accepted_groups=row["accepted_groups"],
            accepted_tokens=row["accepted_tokens"], strikes=row["strikes"], rejections_by_reason=rejections,
            credits=float(row["accepted_tokens"]),
        )

    # --- LeaseWork ------------------------------------------------------------------------------

    def _new_prompt(self, conn: sqlite3.Connection) -> tuple[int, list[int], str]:
        """Draw the next prompt of the stream and store it as leased: its id, token ids and environment."""
        prompt = self.env.sample_prompts(self._rng, 1)[0]
        ids = self.renderer.render(prompt)
        # The conversation as the model saw it rides in meta, so the reward sees the whole prompt.
        meta = {**(prompt.meta or {}), MESSAGES_META_KEY: self.renderer.messages(prompt)}
        cur = conn.execute("INSERT INTO prompts(env, text, answer, meta, prompt_ids, state, attempts) "
                           "VALUES(?, ?, ?, ?, ?, 'leased', 1)",
                           (prompt.env, prompt.text, prompt.answer, json.dumps(meta), st.pack_i32(ids)))
        # prompts_drawn (JSON text in kv) counts the stream's draws, to resume it after a restart.
        conn.execute("INSERT INTO kv(key, value) VALUES('prompts_drawn', '1') "
                     "ON CONFLICT(key) DO UPDATE SET value = CAST(value AS INTEGER) + 1")
        return int(cur.lastrowid), ids, prompt.env

    def expire_leases(self, conn: sqlite3.Connection, now: int) -> int:
        rows = conn.execute("UPDATE leases SET state = 'expired' WHERE state = 'open' AND deadline_ms < ? RETURNING prompt_id",
                            (now,)).fetchall()
        for r in rows:
            conn.execute("UPDATE prompts SET state = 'pending' WHERE prompt_id = ? AND state = 'leased'", (r["prompt_id"],))
        return len(rows)

    async def lease_work(self, node: NodeInfo, req: pb.LeaseRequest) -> pb.LeaseResponse:
        lc = self.cfg.leases
        now = self.clock()
        version = self.policy.version
        # Generate with the newest version the node holds, as long as it is inside the window; else
        # name the current one, which the node must fetch first.
        held = [v for v in list(req.available_versions) + [req.loaded_version]
                if v >= 0 and version - self.cfg.intake.s_max < v <= version]
        lease_version = max(held) if held else version
        wanted = max(1, min(int(req.max_leases or 1), lc.max_open_per_node))
        deadline = now + int(lc.ttl_s * 1000)
        # Everything that needs no state is drawn here, so the serialized writer only reads and writes.
        fresh = [(secrets.token_hex(12), random_seeds(lc.group_size)) for _ in range(wanted)]

        def op(conn):
            expired = self.expire_leases(conn, now)
            open_n = conn.execute("SELECT COUNT(*) FROM leases WHERE node_id = ? AND state = 'open'", (node.node_id,)).fetchone()[0]
            if st.queued_groups(conn) >= lc.queue_maxsize:
                return [], expired, "backpressure"
            k = min(wanted, lc.max_open_per_node - open_n)
            if k <= 0:
                return [], expired, "too_many_open_leases"
            issued = []
            for lease_id, seeds in fresh[:k]:
                # A prompt back in the pool (its lease expired or was spent) goes first, else a new one.
                row = conn.execute("UPDATE prompts SET state = 'leased', attempts = attempts + 1 WHERE prompt_id = "
                                   "(SELECT prompt_id FROM prompts WHERE state = 'pending' ORDER BY prompt_id LIMIT 1) "
                                   "RETURNING prompt_id, prompt_ids, env").fetchone()
                if row is not None:
                    prompt_id, ids, env = int(row[0]), st.unpack_i32(row[1]).tolist(), row[2]
                else:
                    prompt_id, ids, env = self._new_prompt(conn)
                conn.execute(
                    "INSERT INTO leases(lease_id, node_id, prompt_id, group_size, temperature, max_new_tokens, seeds, "
                    "stop_token_ids, policy_version, issued_ms, deadline_ms) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (lease_id, node.node_id, prompt_id, lc.group_size, lc.temperature, lc.max_new_tokens,
                     json.dumps(seeds), self._stop_ids_json, lease_version, now, deadline),
                )
                issued.append((lease_id, ids, env, seeds))
            return issued, expired, ""

        issued, expired, wait = await self.db.run(op)
        leases = [pb.Lease(lease_id=lease_id, prompt_ids=ids, group_size=lc.group_size, temperature=lc.temperature,
                           max_new_tokens=lc.max_new_tokens, seeds=seeds, policy_version=lease_version,
                           deadline_ms=deadline, stop_token_ids=self.stop_token_ids, environment=env)
                  for lease_id, ids, env, seeds in issued]
        if expired:
            self.metrics.leases_expired.inc(expired)
        self.metrics.leases_issued.inc(len(leases))
        return pb.LeaseResponse(leases=leases, retry_after_ms=0 if leases else 1000, wait_reason=wait)

    # --- SubmitGroup ----------------------------------------------------------------------------

    async def submit_group(self, node: NodeInfo, req: pb.SubmitGroupRequest) -> pb.SubmitGroupResponse:
        now = self.clock()
        sub = Submission.from_proto(req)
        digest = content_hash(sub)
        packed = sample_blobs(sub)  # here, so the serialized writer only writes
        if self.verifier is not None and self._should_audit(node):
            return await self._submit_verified(node, sub, digest, packed, now)
        # Not verified: a reader trip for the lease, its prompt and the checks; the rewards in a
        # reward worker (operator code with a time limit, never inside the writer, which every
        # node's submission waits on); then one writer op to accept, or to spend the lease and count
        # the refusal. The accept re-checks that the lease is still open, so a concurrent
        # submission of the same lease between the read and the write is caught there.
        lease, prompt, prior, rejection = await self.db.run_read(
            lambda conn: self._precheck(conn, node, sub, digest, now))
        if prior is not None:
            return await self._accepted_response(prior)
        rewards = group_id = None
        if rejection is not None:
            await self.db.run(self._reject_op(node, lease, rejection))
        else:
            rewards = await self._rewards(prompt, sub)
            group_id = await self.db.run(self._accept_op(node, lease, prompt, sub, digest, rewards, packed, False, now))
        return await self._answer(node, sub, lease, rejection, rewards, group_id)

    async def _submit_verified(self, node: NodeInfo, sub: Submission, digest: str, packed: list,
                               now: int) -> pb.SubmitGroupResponse:
        """Intake with the verification stages, which run between the checks and the accept, off the store."""
        lease, prompt, prior, rejection = await self.db.run_read(
            lambda conn: self._precheck(conn, node, sub, digest, now))
        if prior is not None:
            return await self._accepted_response(prior)
        rewards = group_id = None
        if rejection is None:
            prompt_ids = st.unpack_i32(prompt["prompt_ids"]).tolist()
            result: VerificationResult = await asyncio.get_running_loop().run_in_executor(
                self._verify_pool, self.verifier.verify_group, lease, prompt_ids, sub)
            self.metrics.verify_latency.observe(result.seconds)
            rejection = result.rejection
        if rejection is not None:
            await self.db.run(self._reject_op(node, lease, rejection))
        else:
            if result.trusted_logprobs is not None:
                packed = [(tok, lp, st.pack_f32(t)) for (tok, lp, _), t in zip(packed, result.trusted_logprobs, strict=True)]
            rewards = await self._rewards(prompt, sub)
            group_id = await self.db.run(self._accept_op(node, lease, prompt, sub, digest, rewards, packed, True, now))
        return await self._answer(node, sub, lease, rejection, rewards, group_id)

    async def _answer(self, node: NodeInfo, sub: Submission, lease: LeaseRecord | None, rejection: Rejection | None,
                      rewards: list[float] | None, group_id: int | None) -> pb.SubmitGroupResponse:
        """Metrics and the node's answer once the verdict is committed; a rejection is raised as a :class:`Refusal`."""
        if rejection is None and group_id is None:
            # Another submission of this lease was accepted between the check and the write: counted
            # here, as the edge leaves SubmitGroup's lease reasons to the intake.
            rejection = Rejection(Reason.LEASE_USED, "the lease was submitted concurrently")
            await self.db.run(self._refusal_op(node.node_id, rejection.reason, rejection.detail, lease.lease_id))
        if rejection is not None:
            self.metrics.rejections.inc(reason=rejection.reason.value)
            if rejection.reason.strike:
                await self._refresh_nodes(force=True)
            raise Refusal(rejection.reason, rejection.detail)
        self.metrics.accepted_groups.inc()
        self.metrics.accepted_tokens.inc(sub.num_tokens)
        return pb.SubmitGroupResponse(accepted=True, rewards=rewards, credited_tokens=sub.num_tokens, group_id=str(group_id))

    def _precheck(self, conn: sqlite3.Connection, node: NodeInfo, sub: Submission, digest: str, now: int) -> tuple:
        """(lease, prompt, prior group if this is a retry, rejection)."""
        lease, prompt, prior = self._load_lease(conn, sub.lease_id)
        if self._is_retry(lease, prior, node, digest):
            # An honest retry after a lost answer: the same content was accepted already. Answer the same.
            return lease, prompt, prior, None
        return lease, prompt, None, self._check_group(lease, node, sub, now)

    @staticmethod
    def _load_lease(conn: sqlite3.Connection, lease_id: str) -> tuple[LeaseRecord | None, dict | None, dict | None]:
        """The lease, its prompt, and the group already accepted for it (if any)."""
        row = conn.execute("SELECT * FROM leases WHERE lease_id = ?", (lease_id,)).fetchone()
        if row is None:
            return None, None, None
        lease = LeaseRecord.from_row(row)
        prompt = dict(conn.execute("SELECT * FROM prompts WHERE prompt_id = ?", (lease.prompt_id,)).fetchone())
        group = conn.execute("SELECT group_id, content_hash FROM groups WHERE lease_id = ?", (lease_id,)).fetchone()
        return lease, prompt, dict(group) if group else None

    @staticmethod
    def _is_retry(lease: LeaseRecord | None, prior: dict | None, node: NodeInfo, digest: str) -> bool:
        return prior is not None and lease is not None and lease.node_id == node.node_id and prior["content_hash"] == digest

    def _check_group(self, lease: LeaseRecord | None, node: NodeInfo, sub: Submission, now: int) -> Rejection | None:
        """The pure intake stages before verification: lease, shape and bounds, staleness."""
        rejection = check_lease(lease, node.node_id, now)
        if rejection is None:
            rejection = check_shape(sub, lease, vocab_size=self.vocab_size,
                                    max_proof_bytes_per_token=self.cfg.intake.max_proof_bytes_per_token,
                                    require_proof=self.cfg.intake.verify)
        if rejection is None:
            rejection = check_dtype(sub, self.cfg.intake.accepted_dtypes)
        if rejection is None:
            rejection = check_staleness(sub, self.policy.version, self.cfg.intake.s_max)
        return rejection

    def _should_audit(self, node: NodeInfo) -> bool:
        if node.standing != "trusted":
            return True
        return self._audit_rng.random() < self.cfg.intake.audit_fraction

    async def _rewards(self, prompt: dict, sub: Submission) -> list[float]:
        """Rewards recomputed from the tokens by the environment's rubric, never read from the node: in a
        reward worker process with a time limit per sample, awaited off the store's writer and without
        blocking the event loop. A failed reward is 0, counted and logged."""
        result = await self.rewards.score(self._reward_prompt(prompt), self._completions(sub))
        return self._counted(prompt, result)

    def _score(self, prompt: dict, sub: Submission) -> list[float]:
        """:meth:`_rewards`, blocking (for tests and tools that re-check stored rewards)."""
        return self._counted(prompt, self.rewards.score_group(self._reward_prompt(prompt), self._completions(sub)))

    @staticmethod
    def _reward_prompt(prompt: dict):
        from veriroll.coordinator.environments import Prompt

        meta = json.loads(prompt["meta"] or "{}")
        messages = meta.pop(MESSAGES_META_KEY, [])
        return Prompt(text=prompt["text"], answer=prompt["answer"], env=prompt["env"], meta=meta, messages=messages)

    def _completions(self, sub: Submission) -> list[str]:
        """Each sample's text as the rubric sees it: decoded without stop tokens or special tokens."""
        texts = []
        for s in sub.samples:
            ids = np.asarray(s.token_ids, dtype=np.int64)
            for stop in self._stop_ids:
                ids = ids[ids != stop]
            texts.append(self.codec.decode(ids.tolist()))
        return texts

    def _counted(self, prompt: dict, result) -> list[float]:
        for kind in result.errors:
            if kind is not None:
                self.metrics.reward_errors.inc(kind=kind)
        if result.details:
            log.warning("reward errors in prompt %s of environment %s (scored 0): %s",
                        prompt["prompt_id"], prompt["env"], "; ".join(result.details))
        return result.rewards

    def _reject_op(self, node: NodeInfo, lease: LeaseRecord | None, rejection: Rejection) -> Callable[[sqlite3.Connection], None]:
        """Count the refusal (strike, maybe ban) and, for a content failure, spend the lease."""
        count = self._refusal_op(node.node_id, rejection.reason, rejection.detail, lease.lease_id if lease else "")
        # A lease that was legitimately this node's and failed a content check is spent; its prompt
        # goes back to the pool for someone else.
        spend = lease is not None and lease.node_id == node.node_id and lease.state == "open" and \
            rejection.reason not in (Reason.LEASE_EXPIRED, Reason.LEASE_USED, Reason.LEASE_UNKNOWN)

        def op(conn):
            if spend:
                n = conn.execute("UPDATE leases SET state = 'rejected' WHERE lease_id = ? AND state = 'open'",
                                 (lease.lease_id,)).rowcount
                if n:
                    conn.execute("UPDATE prompts SET state = 'pending' WHERE prompt_id = ? AND state = 'leased'",
                                 (lease.prompt_id,))
            count(conn)

        return op

    def _accept_op(self, node, lease: LeaseRecord, prompt: dict, sub: Submission, digest: str, rewards: list[float],
                   packed: list, verified: bool, now: int) -> Callable[[sqlite3.Connection], int | None]:
        """Store the group and credit the node; the op returns the group id, or None if the lease is no longer open."""
        probation_groups = self.cfg.intake.probation_groups
        num_tokens = sub.num_tokens
        mean_reward = float(np.mean(rewards))

        def op(conn):
            n = conn.execute("UPDATE leases SET state = 'submitted' WHERE lease_id = ? AND state = 'open'",
                             (lease.lease_id,)).rowcount
            if n != 1:
                return None
            cur = conn.execute(
                "INSERT INTO groups(lease_id, node_id, prompt_id, env, policy_version, temperature, arrival_ms, content_hash, "
                "tokens, mean_reward, verified) VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (lease.lease_id, node.node_id, lease.prompt_id, prompt["env"], sub.policy_version, lease.temperature, now,
                 digest, num_tokens, mean_reward, int(verified)),
            )
            gid = int(cur.lastrowid)
            conn.executemany(
                "INSERT INTO samples(group_id, idx, token_ids, logprobs, trusted_logprobs, reward, finish_reason) "
                "VALUES(?, ?, ?, ?, ?, ?, ?)",
                [(gid, i, tok, lp, trusted, rewards[i], s.finish_reason)
                 for i, ((tok, lp, trusted), s) in enumerate(zip(packed, sub.samples, strict=True))])
            conn.execute("UPDATE prompts SET state = 'done' WHERE prompt_id = ?", (lease.prompt_id,))
            # SET expressions see the row before the update: clean_groups + ? is the new count.
            conn.execute(
                "UPDATE nodes SET accepted_groups = accepted_groups + 1, accepted_tokens = accepted_tokens + ?, "
                "clean_groups = clean_groups + ?, last_seen_ms = ?, standing = CASE WHEN standing = 'probation' "
                "AND clean_groups + ? >= ? THEN 'trusted' ELSE standing END WHERE node_id = ?",
                (num_tokens, int(verified), now, int(verified), probation_groups, node.node_id),
            )
            return gid

        return op

    async def _accepted_response(self, prior: dict) -> pb.SubmitGroupResponse:
        group_id = prior["group_id"]

        def op(conn):
            g = conn.execute("SELECT tokens FROM groups WHERE group_id = ?", (group_id,)).fetchone()
            rs = [r["reward"] for r in conn.execute("SELECT reward FROM samples WHERE group_id = ? ORDER BY idx", (group_id,))]
            return int(g["tokens"]), rs

        tokens, rewards = await self.db.run_read(op)
        return pb.SubmitGroupResponse(accepted=True, rewards=rewards, credited_tokens=tokens, group_id=str(group_id))

    # --- housekeeping ---------------------------------------------------------------------------

    async def refresh_gauges(self) -> dict[str, Any]:
        summary = await self.db.run_read(st.status_summary)
        standings = await self.db.run_read(lambda c: c.execute("SELECT standing, COUNT(*) n FROM nodes GROUP BY standing").fetchall())
        self.metrics.queue_depth.set(summary["unconsumed_groups"])
        self.metrics.policy_version.set(self.policy.version)
        for s in st.STANDINGS:
            self.metrics.nodes.set(0, standing=s)
        for r in standings:
            self.metrics.nodes.set(r["n"], standing=r["standing"])
        return summary

    def close(self) -> None:
        self._verify_pool.shutdown(wait=False, cancel_futures=True)
        self.rewards.close()


MESSAGES_META_KEY = "_messages"
"""Key of the rendered conversation in a stored prompt's meta (taken out again before the reward sees meta)."""


def sample_blobs(sub: Submission) -> list[tuple[bytes, bytes, bytes | None]]:
    """Each sample's (token ids, log-probs, trusted log-probs) as stored; the last is filled by verification."""
    return [(st.pack_i32(s.token_ids), st.pack_f32(s.logprobs), None) for s in sub.samples]


def random_seeds(n: int) -> list[int]:
    """``n`` independent uniform 64-bit sampling seeds from the OS CSPRNG (one read for all)."""
    raw = secrets.token_bytes(8 * n)
    return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, 8 * n, 8)]


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
