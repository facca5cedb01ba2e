"""The trainer: accepted groups in the store → optimizer steps → policy versions, one step at a time.

:class:`Trainer` selects a step's groups (``batch.py``), trains on them (``step.py``), writes a new version
every ``publish_weights_every`` steps (``weights.py``) and commits it all in one transaction; it checkpoints
its full state and resumes from it. The coordinator drives it from a worker thread (``app.start_trainer``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from veriroll.coordinator import store as st
from veriroll.coordinator.checkpoint import latest_training_state, load_sharded_state, save_training_state
from veriroll.coordinator.config import CoordinatorConfig, TrainerConfig
from veriroll.coordinator.policy import PolicyState
from veriroll.coordinator.trainer.batch import build_batch, load_groups, select_groups
from veriroll.coordinator.trainer.device import trainer_device
from veriroll.coordinator.trainer.step import train_step
from veriroll.coordinator.trainer.weights import build_optimizer, load_training_model, write_policy_version

__all__ = ["HISTORY_CAP", "HISTORY_KEY", "StepOutcome", "Trainer"]

log = logging.getLogger("veriroll.trainer")

HISTORY_KEY = st.TRAINER_HISTORY_KEY
HISTORY_CAP = 2000  # steps kept in kv trainer_history (the dashboard reads it)
WAIT_LOG_EVERY_S = 30.0  # a trainer that keeps waiting says so again this often
STATE_FORMAT = 2  # 1: model and optimizer in state.pt; 2: as sharded training state beside it (both are read)


@dataclass
class StepOutcome:
    """What one call of :meth:`Trainer.step` did: ``'trained'``, ``'waiting'`` (too few fresh groups) or
    ``'done'`` (a stop condition holds); ``published`` is the new policy version, if this step made one."""

    kind: str
    step: int = 0
    published: int | None = None
    metrics: dict = field(default_factory=dict)


class Trainer:
    """Trains the policy on the groups in ``db``, publishing versions into ``policy_store``.

    Synchronous and single-threaded: the coordinator drives it from one worker thread
    (``app.start_trainer``); benchmarks and tests may call :meth:`resume` and :meth:`step` directly.
    ``metrics`` is the coordinator's :class:`CoordinatorMetrics` (or ``None``).

    ``policy`` is the process's current policy version, and the trainer keeps no copy of it: staleness
    counts from ``policy.version``, and a committed version becomes current through :meth:`make_current`,
    the one place a trainer moves it. Standalone (``advances_policy``) that happens at the commit; under a
    coordinator (``advances_policy=False``) ``app.start_trainer`` calls it once shardcast holds the version,
    so that no node is told a version no relay serves yet (:attr:`unannounced` holds a committed version
    that a resume found not yet current).
    """

    def __init__(self, cfg: CoordinatorConfig, db: st.Database, policy_store, *, metrics=None,
                 clock=time.time, policy: PolicyState | None = None, advances_policy: bool = True) -> None:
        self.cfg = cfg
        self.tcfg: TrainerConfig = cfg.trainer
        self.s_max = cfg.intake.s_max
        # A batch holds at most groups_per_step groups, so waiting for more would be waiting forever.
        self.min_groups = min(self.tcfg.min_groups, self.tcfg.groups_per_step)
        if self.min_groups < self.tcfg.min_groups:
            log.warning("trainer.min_groups %d > groups_per_step %d; using %d", self.tcfg.min_groups,
                        self.tcfg.groups_per_step, self.min_groups)
        from veriroll.coordinator.models import DTYPES

        # Published versions are in the operator's dtype (the config takes only DTYPES' names); the
        # trainer's own weights stay float32.
        self.publish_dtype = DTYPES[cfg.model_dtype]
        # The model, its optimizer state and every micro-batch live here; checkpoints and published versions
        # are written from CPU copies. ``coordinator init``/``run`` refused a device this machine lacks.
        self.device = trainer_device(self.tcfg.device)
        self.db = db
        self.policy_store = policy_store
        self.metrics = metrics
        self.clock = clock
        self.state_dir = Path(policy_store.root) / "trainer"
        self.staging_dir = Path(policy_store.root) / ".staging"
        self.model: torch.nn.Module | None = None
        self.ref_model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.step_no = 0
        self.policy = policy if policy is not None else PolicyState()
        self.advances_policy = advances_policy
        self.unannounced: int | None = None  # committed, not yet current (advances_policy False only)
        self.broken = False
        self.resume_reference: dict[int, int] = {}  # group id → version its staleness counts from
        self.done = False
        self.history: list[dict] = []
        self._stale_pending: Counter = Counter()  # staleness → samples dropped since the last step
        self._stale_groups_pending = 0
        self._last_step_end = clock()
        self._waiting_since: float | None = None
        self._last_wait_log = 0.0

    @property
    def version(self) -> int:
        """The current policy version (``policy.version``): the one nodes are told, which staleness counts from."""
        return self.policy.version

    @property
    def weights_version(self) -> int:
        """The version of the trainer's weights: the newest it committed, current or about to be."""
        return self.policy.version if self.unannounced is None else max(self.unannounced, self.policy.version)

    def make_current(self, version: int) -> None:
        """Make the committed ``version`` current: the one call by which a trainer moves the policy on."""
        self.policy.advance(version)
        if self.unannounced is not None and self.unannounced <= version:
            self.unannounced = None

    def _committed(self, version: int) -> None:
        if self.advances_policy:
            self.make_current(version)
        else:
            self.unannounced = version

    # -- start -------------------------------------------------------------------------------------

    def _load_model(self, version: int) -> torch.nn.Module:
        return load_training_model(self.policy_store.version_dir(version), device=self.device,
                                   attn_implementation=self.tcfg.attn_implementation, packing=self.tcfg.packing)

    def resume(self) -> None:
        """Load the newest complete training state (or start at step 0 from the oldest version on disk,
        version 0) and make every group consumed after that step unconsumed again."""
        torch.set_num_threads(self.tcfg.threads)
        base_version = self.policy_store.available()[0]
        self.model = self._load_model(base_version)
        self.optimizer = build_optimizer(self.model, self.tcfg)
        found = latest_training_state(self.state_dir)
        if found is not None:
            step, state = found
            if "model" in state:  # format 1, whole state dicts in state.pt
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
            else:  # onto the model's device, whatever number of ranks wrote it
                load_sharded_state(state["dir"], self.model, self.optimizer)
            for group in self.optimizer.param_groups:  # the configured lr wins over the saved one
                group["lr"] = self.tcfg.lr
                group["weight_decay"] = self.tcfg.weight_decay
            torch.set_rng_state(state["torch_rng"])
            random.setstate(_tuplify(state["python_rng"]))
        else:
            step, state = 0, {"consumed_groups": 0}
        self.step_no = step
        if self.tcfg.kl_coef != 0.0:
            self.ref_model = self._load_model(base_version).requires_grad_(False)

        def op(conn):
            reset = st.unconsume_after(conn, step)
            # Those groups were trained into weights that the crash lost. The restored weights are the
            # checkpoint's version: their staleness counts from it, not from the newest version number,
            # or the resume would drop as stale exactly the groups it promised to train again.
            reference = {gid: int(state.get("version", 0)) for gid in reset}
            st.kv_set(conn, "trainer_step", step)
            history = [h for h in st.kv_get(conn, HISTORY_KEY, []) if h.get("step", 0) <= step]
            st.kv_set(conn, HISTORY_KEY, history)
            version = int(st.kv_get(conn, "policy_version", 0))
            was_done = bool(st.kv_get(conn, "trainer_done", False))
            return len(reset), reference, history, version, was_done, st.consumed_groups(conn)

        reset, reference, self.history, version, was_done, trained = self.db.run_sync(op)
        self.resume_reference = reference
        if version > self.policy.version:
            # Committed before a failure, never made current (or another process's store): current now
            # standalone, announced by the coordinator's side otherwise.
            self._committed(version)
        if trained != state.get("consumed_groups", trained):
            # The store and the checkpoint disagree on what the weights have seen (a store restored from
            # another backup than the checkpoints?): training goes on, but an operator should know.
            log.warning("the checkpoint of step %d was taken after %d consumed groups, the store now shows %d",
                        step, state["consumed_groups"], trained)
        # The stop conditions are checked against the current config: raising max_steps continues training.
        self.done = self._stop_reason() is not None
        if self.done != was_done:
            done = self.done
            self.db.run_sync(lambda c: st.kv_set(c, "trainer_done", done))
        log.info("trainer at step %d, policy version %d (%s)%s, on %s; %d groups consumed after step %d will be "
                 "trained again", step, self.version,
                 "from checkpoint" if found else f"fresh start from version {base_version}",
                 "; training finished" if self.done else "", self.device, reset, step)
        self._last_step_end = self.clock()

    # -- one step ----------------------------------------------------------------------------------

    def _stop_reason(self) -> str | None:
        t = self.tcfg
        if t.max_steps and self.step_no >= t.max_steps:
            return f"max_steps {t.max_steps} reached"
        if t.target_reward > 0:
            recent = [h["reward"] for h in self.history[-t.target_window:] if h.get("reward") is not None]
            if len(recent) >= t.target_window and sum(recent) / len(recent) >= t.target_reward:
                return f"mean reward {sum(recent) / len(recent):.3f} over {len(recent)} steps ≥ target {t.target_reward}"
        return None

    def step(self) -> StepOutcome:
        """Train one step if enough fresh groups wait; otherwise report waiting (or done)."""
        if self.model is None:
            raise RuntimeError("call resume() first")
        if self.done:
            return StepOutcome("done", self.step_no)
        t = self.tcfg
        fresh, stale = self.db.read(lambda c: select_groups(c, self.version, self.s_max, t.groups_per_step,
                                                            self.resume_reference)).result()
        if stale:
            self._drop_stale(stale)
        if len(fresh) < self.min_groups:
            self._note_waiting(len(fresh))
            return StepOutcome("waiting", self.step_no)
        self._waiting_since = None
        started = self.clock()
        groups = self.db.read(lambda c: load_groups(c, [g for g, _ in fresh])).result()
        staleness = [s for _, s in fresh]
        batch, signal = build_batch(groups, staleness, std_scale=t.std_scale,
                                    pad_id=int(getattr(self.policy_store.tokenizer, "pad_token_id", 0) or 0))
        next_step = self.step_no + 1
        try:
            # From here the weights change: the step counts only once its commit (groups consumed, step,
            # history, version) is durable. Until then nothing else moves; if anything fails, the weights
            # go back to the last checkpoint and its groups are trained again, never twice.
            if batch is not None:
                m = train_step(self.model, self.optimizer, batch, t, self.s_max, ref_model=self.ref_model)
            else:
                m = {}
                log.info("step %d: no group in the batch has a learning signal; no update", next_step)
            # A version installed here but never committed is skipped, not reused (see _install_version).
            new_version = self._install_version() if next_step % t.publish_weights_every == 0 else None
            record = self._record(groups, staleness, signal, m, started, new_version, next_step)
            history = [*self.history, record][-HISTORY_CAP:]
            self.db.run_sync(lambda conn: st.commit_step(conn, next_step, [g.group_id for g in groups], history,
                                                         new_version))
        except BaseException:
            self._recover(next_step)
            raise
        self.step_no, self.history = next_step, history
        if new_version is not None:
            self._committed(new_version)
            # Versions older than the staleness window are accepted nowhere any more; one extra is kept
            # for a verification that started just before this publish.
            self.policy_store.prune(new_version - self.s_max - 1, protect=(0,))
        reason = self._stop_reason()
        if self.step_no % t.checkpoint_every == 0 or reason is not None:
            self.save_state()
        if reason is not None:
            self.done = True
            self.db.run_sync(lambda c: st.kv_set(c, "trainer_done", True))
            log.info("training finished at step %d: %s; the coordinator keeps serving", self.step_no, reason)
        self._export(record)
        return StepOutcome("trained", self.step_no, new_version, record)

    def _recover(self, failed_step: int) -> None:
        """After a failed step: back to the newest checkpoint (weights, optimizer, step, history) and the
        store's view of what is trained. If even that fails the trainer stops (``broken``) rather than
        train on weights nobody can account for."""
        log.error("trainer step %d failed; going back to the last checkpoint", failed_step)
        try:
            self.resume()
        except BaseException:
            self.broken = True
            log.critical("trainer could not go back to its checkpoint; training stops (the coordinator keeps "
                         "serving; restart it to resume from the checkpoint)")
            raise

    def _note_waiting(self, fresh: int) -> None:
        now = self.clock()
        if self._waiting_since is None or now - self._last_wait_log >= WAIT_LOG_EVERY_S:
            waited = "" if self._waiting_since is None else f" (for {now - self._waiting_since:.0f} s)"
            log.info("trainer waiting for groups: %d fresh queued, min_groups is %d%s", fresh, self.min_groups, waited)
            self._last_wait_log = now
            if self._waiting_since is None:
                self._waiting_since = now

    def _drop_stale(self, stale: list[tuple[int, int]]) -> None:
        ids = [g for g, _ in stale]

        sizes = self.db.run_sync(lambda conn: st.drop_groups(conn, ids, "stale"))
        for g, s in stale:
            self._stale_pending[s] += int(sizes.get(g, 0))
        self._stale_groups_pending += len(stale)
        log.info("dropped %d stale groups (staleness %s > s_max %d)", len(stale),
                 ",".join(str(s) for s in sorted({s for _, s in stale})), self.s_max)

    def _install_version(self) -> int:
        """Write the current weights as the next policy version (HF format, ``cfg.model_dtype``) and install
        it; returns it. Runs in the trainer's worker thread, never on the event loop.

        The number is one past both the announced version and anything on disk, so a version a crashed
        run installed but never announced is never reused. Tokenizer files, chat template and generation
        config are copied from the oldest version on disk (version 0) byte for byte.
        """
        on_disk = self.policy_store.available()
        version = max([self.weights_version, *on_disk]) + 1
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.staging_dir / f"v{version:06d}-{int(self.clock() * 1000)}"
        started = time.perf_counter()
        write_policy_version(self.model, self.policy_store.version_dir(on_disk[0]), tmp, self.publish_dtype)
        dest = self.policy_store.install(tmp, version)
        size = sum(f.stat().st_size for f in dest.iterdir() if f.is_file())
        log.info("wrote version %d (%s, %.1f MB) in %.2f s", version, self.cfg.model_dtype, size / 1e6,
                 time.perf_counter() - started)
        return version

    def _record(self, groups, staleness, signal, m: dict, started: float, new_version: int | None, step: int) -> dict:
        now = self.clock()
        rewards = [s.reward for g in groups for s in g.samples]
        by_env: dict[str, list[float]] = {}
        for g in groups:
            by_env.setdefault(g.env, []).extend(s.reward for s in g.samples)
        hist = Counter(self._stale_pending)
        for g, s in zip(groups, staleness, strict=True):
            hist[s] += len(g.samples)
        stale_samples = sum(self._stale_pending.values())
        considered = stale_samples + sum(len(g.samples) for g in groups)
        tokens = sum(g.tokens for g in groups)
        interval = max(now - self._last_step_end, 1e-9)
        queue_depth = self.db.read(st.queued_groups).result()
        # The batch's own groups are still unconsumed until the commit below.
        queue_depth = max(0, int(queue_depth) - len(groups))
        record = {
            "step": step,
            "version": new_version if new_version is not None else self.version,
            "time": now,
            "reward": sum(rewards) / len(rewards) if rewards else None,
            "reward_by_env": {k: sum(v) / len(v) for k, v in by_env.items() if v},
            "loss": m.get("loss"),
            "approx_kl": m.get("approx_kl"),
            "clipfrac": m.get("clipfrac"),
            "entropy": m.get("entropy"),
            "grad_norm": m.get("grad_norm"),
            "mismatch_kl": m.get("mismatch_kl"),
            "lr": self.optimizer.param_groups[0]["lr"],
            "frac_stale": stale_samples / considered if considered else 0.0,
            "dropped_stale_groups": self._stale_groups_pending,
            "staleness_hist": {str(k): int(v) for k, v in sorted(hist.items())},
            "groups": len(groups),
            "tokens": tokens,
            "groups_per_s": len(groups) / interval,
            "tokens_per_s": tokens / interval,
            "zero_adv_groups": int((~signal).sum()),
            "queue_depth": queue_depth,
            "step_seconds": now - started,
        }
        self._stale_pending.clear()
        self._stale_groups_pending = 0
        self._last_step_end = now
        # JSON has no inf or nan (a browser's JSON.parse rejects them): a non-finite number is recorded as null.
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}

    def _export(self, r: dict) -> None:
        env_part = " ".join(f"{k} {v:.3f}" for k, v in r["reward_by_env"].items())
        log.info("step %d v%d | reward %s (%s) | loss %s kl %s clip %s ent %s gnorm %s mismatch %s | groups %d "
                 "(%d zero-adv, %d stale dropped) tokens %d | %.1f groups/s %.0f tok/s | queue %d | staleness %s",
                 r["step"], r["version"], _f(r["reward"]), env_part, _f(r["loss"]), _f(r["approx_kl"], 4),
                 _f(r["clipfrac"]), _f(r["entropy"]), _f(r["grad_norm"]), _f(r["mismatch_kl"], 4), r["groups"],
                 r["zero_adv_groups"], r["dropped_stale_groups"], r["tokens"], r["groups_per_s"], r["tokens_per_s"],
                 r["queue_depth"], json.dumps(r["staleness_hist"]))
        if self.metrics is None:
            return
        gauge = self.metrics.trainer
        for key in ("reward", "loss", "approx_kl", "clipfrac", "entropy", "grad_norm", "mismatch_kl", "lr",
                    "frac_stale", "dropped_stale_groups", "groups", "tokens", "groups_per_s", "tokens_per_s",
                    "zero_adv_groups", "queue_depth", "step_seconds", "version"):
            if r.get(key) is not None:
                gauge.set(r[key], metric=key)
        for env, value in r["reward_by_env"].items():
            gauge.set(value, metric=f"reward_{env}")
        gauge.set(r["step"], metric="step")
        self.metrics.trainer_steps.inc()
        self.metrics.trainer_staleness.clear()
        for s, n in r["staleness_hist"].items():
            self.metrics.trainer_staleness.set(n, staleness=s)

    # -- state -------------------------------------------------------------------------------------

    def save_state(self) -> Path:
        """Checkpoint the full training state at the current step (atomically)."""
        state = {
            "format": STATE_FORMAT,
            "step": self.step_no,
            "version": self.weights_version,
            "torch_rng": torch.get_rng_state(),
            "python_rng": _listify(random.getstate()),
            "time": self.clock(),
            # What the weights have been trained on is the groups with consumed_step <= step; their
            # number is kept as a cross-check against the store on resume.
            "consumed_groups": self.db.read(lambda c: st.consumed_groups(c, self.step_no)).result(),
        }
        # The weights and AdamW state go as sharded training state (torch.distributed.checkpoint): written
        # from whatever device they are on, loaded onto whatever device (and number of ranks) resumes.
        return save_training_state(self.state_dir, self.step_no, state, keep=self.tcfg.keep_checkpoints,
                                   model=self.model, optimizer=self.optimizer)


def _listify(x):
    return [_listify(v) for v in x] if isinstance(x, tuple) else x


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
