"""The lease desk: hands out prompts to generate, with the seeds and limits the intake later holds the
group to, and returns the prompts of expired or spent leases to the pool.

Probation nodes (new keys; a strike sends a trusted node back) are held short, since a key costs an
attacker little: at most ``leases.probation_max_open`` open leases each, a lease budget per node
(``probation_leases_per_hour`` with a burst of ``probation_lease_burst``), and all of them together
hold at most ``probation_share`` of the open leases (but always ``probation_floor``, so that a new
network, where every node is on probation, can start).
"""

from __future__ import annotations

import math
import random
import secrets
from collections.abc import Callable
from typing import Any, NamedTuple

from veriroll.coordinator import store as st
from veriroll.coordinator.config import CoordinatorConfig
from veriroll.coordinator.intake import MESSAGES_META_KEY
from veriroll.coordinator.ledger import NodeInfo
from veriroll.coordinator.metrics import CoordinatorMetrics
from veriroll.coordinator.policy import PolicyState
from veriroll.coordinator.prompts import PromptRenderer
from veriroll.protos.ratelimit import BucketMap
from veriroll.protos.v1 import coordinator_pb2 as pb

BUDGETS_KEPT = 100_000


def random_seeds(n: int) -> list[int]:
    """``n`` independent uniform 64-bit sampling seeds from the OS CSPRNG (one read for all)."""
    raw = secrets.token_bytes(8 * n)
    return [int.from_bytes(raw[i:i + 8], "little") for i in range(0, 8 * n, 8)]


class LeaseStep(NamedTuple):
    """A planned lease request: the writer op, and the answer made from its result."""

    op: Callable[[Any], Any]
    answer: Callable[[Any], pb.LeaseResponse]


EXPIRE_EVERY_MS = 250
"""How often at most a lease op expires past-deadline leases before issuing (housekeeping: every second)."""


class LeaseDesk:
    def __init__(self, cfg: CoordinatorConfig, db: st.Database, *, environment, renderer: PromptRenderer,
                 policy: PolicyState, metrics: CoordinatorMetrics, clock: Callable[[], int], stop_token_ids: list[int],
                 verify_budget=None):
        self.cfg = cfg
        self.db = db
        self.env = environment
        self.renderer = renderer
        self.policy = policy
        self.metrics = metrics
        self.clock = clock
        self.stop_token_ids = list(stop_token_ids)
        self.verify_budget = verify_budget
        # Leases a probation node may still be issued: only leases actually issued are taken, so waiting
        # out backpressure costs a node nothing.
        self._budgets = BucketMap(cfg.leases.probation_leases_per_hour / 3600.0, cfg.leases.probation_lease_burst,
                                  max_keys=BUDGETS_KEPT)
        drawn = db.run_sync(st.prompts_drawn)
        # The prompt stream resumes where it stopped: its state is the seed and the number of draws.
        # Several edge processes draw from one stream each: a salt keeps them from drawing the same prompts.
        salt = f":{secrets.token_hex(8)}" if cfg.role == "edge" else ""
        self._rng = random.Random(f"{cfg.environment.seed}:{drawn}{salt}")
        self._expired_at = -EXPIRE_EVERY_MS  # the clock (ms) when a lease op last expired leases
        self._spare: st.FreshPrompt | None = None  # drawn, not stored (see _next_prompt)

    def _next_prompt(self) -> st.FreshPrompt:
        """The next prompt of the stream (the writer's thread only): one drawn earlier and not stored (a
        ``lease_one`` leftover) first, so that the stream skips none."""
        if self._spare is not None:
            prompt, self._spare = self._spare, None
            return prompt
        prompt = self.env.sample_prompts(self._rng, 1)[0]
        # The conversation as the model saw it rides in meta, so the reward sees the whole prompt.
        meta = {**(prompt.meta or {}), MESSAGES_META_KEY: self.renderer.messages(prompt)}
        return st.FreshPrompt(prompt.env, prompt.text, prompt.answer, meta, self.renderer.render(prompt))

    def _draw_prompt(self, conn) -> tuple[int, list[int], str]:
        """Draw the next prompt of the stream and store it as leased: its id, token ids and environment."""
        p = self._next_prompt()
        return st.insert_leased_prompt(conn, p.env, p.text, p.answer, p.meta, p.prompt_ids), p.prompt_ids, p.env

    async def lease_work(self, node: NodeInfo, req: pb.LeaseRequest, *, peer: str = "unknown") -> pb.LeaseResponse:
        step = await self.plan(node, req, peer=peer)
        if isinstance(step, pb.LeaseResponse):
            return step
        return step.answer(await self.db.run(step.op))

    async def plan(self, node: NodeInfo, req: pb.LeaseRequest, *, peer: str = "unknown") -> LeaseStep | pb.LeaseResponse:
        """A lease request up to the store: the answer already when a limit that needs no store refuses, else
        the writer op to run and how to answer from its result (:meth:`lease_work` runs it alone; a
        submission's ``next_leases`` runs it in the accepted group's transaction)."""
        lc = self.cfg.leases
        now = self.clock()
        version = self.policy.version
        # Generate with the newest version the node holds, as long as it is inside the window; else
        # name the current one, which the node must fetch first.
        held = [v for v in list(req.available_versions) + [req.loaded_version]
                if v >= 0 and version - self.cfg.intake.s_max < v <= version]
        lease_version = max(held) if held else version
        probation = node.standing == st.Standing.PROBATION
        max_open = lc.probation_max_open if probation else lc.max_open_per_node
        wanted = max(1, min(int(req.max_leases or 1), max_open))
        if probation and self.verify_budget is not None:
            # Every group of a probation node is verified: no work while its verifier time is used up.
            spent = await self.verify_budget.check(node.node_id, peer)
            if spent is not None:
                return pb.LeaseResponse(retry_after_ms=5000, wait_reason="verify_budget")
        budget = self._budgets.bucket(node.node_id) if probation else None
        if budget is not None:
            wanted = min(wanted, int(budget.level()))
            if wanted <= 0:
                wait_s = budget.seconds_until(1.0)
                retry_ms = 1000 if math.isinf(wait_s) else max(1000, int(wait_s * 1000))
                return pb.LeaseResponse(retry_after_ms=retry_ms, wait_reason="probation_budget")
        deadline = now + int(lc.ttl_s * 1000)
        # Everything that needs no state is drawn here, so the serialized writer only reads and writes.
        fresh = [(secrets.token_hex(12), random_seeds(lc.group_size)) for _ in range(wanted)]

        def record(lease_id: str, seeds: list[int], prompt_id: int) -> st.LeaseRecord:
            return st.LeaseRecord(
                lease_id=lease_id, node_id=node.node_id, prompt_id=prompt_id, group_size=lc.group_size,
                temperature=lc.temperature, max_new_tokens=lc.max_new_tokens, seeds=tuple(seeds),
                stop_token_ids=tuple(self.stop_token_ids), policy_version=lease_version, issued_ms=now,
                deadline_ms=deadline, state=st.LeaseState.OPEN, probation=probation)

        def op(conn):
            # Housekeeping expires leases every second; a lease op does too, at most every EXPIRE_EVERY_MS,
            # so that a node's lapsed leases free its slots promptly without a scan per lease.
            expired = 0
            if now - self._expired_at >= EXPIRE_EVERY_MS:
                expired, self._expired_at = st.expire_leases(conn, now), now
            if wanted == 1 and not probation:
                # The common case (a trusted node asking for its next lease) in one store operation.
                lease_id, seeds = fresh[0]
                one = st.lease_one(conn, record(lease_id, seeds, 0), self._next_prompt,
                                   queue_max=lc.queue_maxsize, max_open=max_open)
                if one.leftover is not None:
                    self._spare = one.leftover
                if one.prompt_id is not None:
                    return [(lease_id, one.prompt_ids, one.env, seeds)], expired, ""
                return [], expired, "backpressure" if one.queued >= lc.queue_maxsize else "too_many_open_leases"
            queued, open_of_node = st.lease_limits(conn, node.node_id)
            if queued >= lc.queue_maxsize:
                return [], expired, "backpressure"
            k = min(wanted, max_open - open_of_node)
            if k <= 0:
                return [], expired, "too_many_open_leases"
            if probation:
                total, held = st.open_lease_totals(conn)
                while k > 0 and held + k > max(lc.probation_floor, lc.probation_share * (total + k)):
                    k -= 1
                if k <= 0:
                    return [], expired, "probation_share"
            issued = []
            for lease_id, seeds in fresh[:k]:
                # A prompt back in the pool (its lease expired or was spent) goes first, else a new one.
                prompt_id, ids, env = st.take_pending_prompt(conn) or self._draw_prompt(conn)
                st.insert_lease(conn, record(lease_id, seeds, prompt_id))
                issued.append((lease_id, ids, env, seeds))
            return issued, expired, ""

        def answer(result) -> pb.LeaseResponse:
            issued, expired, wait = result
            if budget is not None:
                budget.spend(len(issued))
            leases = [pb.Lease(lease_id=lease_id, prompt_ids=ids, group_size=lc.group_size, temperature=lc.temperature,
                               max_new_tokens=lc.max_new_tokens, seeds=seeds, policy_version=lease_version,
                               deadline_ms=deadline, stop_token_ids=self.stop_token_ids, environment=env)
                      for lease_id, ids, env, seeds in issued]
            if expired:
                self.metrics.leases_expired.inc(expired)
            self.metrics.leases_issued.inc(len(leases))
            return pb.LeaseResponse(leases=leases, retry_after_ms=0 if leases else 1000, wait_reason=wait)

        return LeaseStep(op, answer)
