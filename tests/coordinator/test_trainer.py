"""The trainer against a real store and policy store: which groups it trains on, what it drops and
skips, when it publishes, how it resumes after a restart, and that a policy learns."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import make_coordinator_dir, running_coordinator

from veriroll.coordinator import store as st
from veriroll.coordinator.app import load_coordinator_config
from veriroll.coordinator.policy import PolicyStore
from veriroll.coordinator.trainer import HISTORY_KEY, Trainer

PROMPT = [1, 5, 14, 6, 15]  # <bos> 1 + 2 = in the test checkpoint's char vocabulary
EOS = 2


def insert_group(conn, rewards, *, policy_version=0, completion=(6, 7, EOS), logprob=-2.5, trusted=None,
                 env="arithmetic", temperature=1.0, samples=None) -> int:
    """An accepted group, written as the intake writes one. ``samples``, if given, is a list of
    ``(token_ids, logprobs)`` that replaces the made-up completions."""
    if samples is None:
        samples = [([completion[0] + (i % 3), *completion[1:]], [logprob] * len(completion)) for i in range(len(rewards))]
    pid = conn.execute("INSERT INTO prompts(env, text, answer, prompt_ids, state) VALUES(?, '1+2=', '3', ?, 'done')",
                       (env, st.pack_i32(PROMPT))).lastrowid
    n_tok = sum(len(t) for t, _ in samples)
    gid = conn.execute(
        "INSERT INTO groups(lease_id, node_id, prompt_id, env, policy_version, temperature, arrival_ms, content_hash, "
        "tokens, mean_reward, verified) VALUES(?, 'node', ?, ?, ?, ?, ?, 'h', ?, ?, ?)",
        (secrets.token_hex(8), pid, env, policy_version, temperature, int(time.time() * 1000), n_tok,
         float(np.mean(rewards)), int(trusted is not None))).lastrowid
    for i, (r, (tok, lp)) in enumerate(zip(rewards, samples, strict=True)):
        conn.execute("INSERT INTO samples(group_id, idx, token_ids, logprobs, trusted_logprobs, reward, finish_reason) "
                     "VALUES(?, ?, ?, ?, ?, ?, 'stop')",
                     (gid, i, st.pack_i32(tok), st.pack_f32(lp),
                      None if trusted is None else st.pack_f32([trusted] * len(tok)), float(r)))
    return int(gid)


def add_groups(db: st.Database, specs: list[dict]) -> list[int]:
    return db.run_sync(lambda c: [insert_group(c, **s) for s in specs])


def group_rows(db: st.Database) -> dict[int, dict]:
    return {r["group_id"]: dict(r) for r in db.run_sync(
        lambda c: c.execute("SELECT group_id, consumed_step, dropped FROM groups").fetchall())}


def kv(db: st.Database, key: str, default=None):
    return db.run_sync(lambda c: st.kv_get(c, key, default))


SIGNAL = {"rewards": [1.0, 0.0, 0.0, 1.0]}
FLAT = {"rewards": [1.0, 1.0, 1.0, 1.0]}


@pytest.fixture()
def trainer_env(tmp_path):
    """A coordinator directory, its store and policy store, and a factory for a Trainer on them."""
    made = []

    def make(overrides: dict | None = None):
        base = make_coordinator_dir(tmp_path / f"c{len(made)}", {"trainer.lr": 1e-3, "trainer.groups_per_step": 2,
                                                                  "trainer.min_groups": 2, **(overrides or {})})
        cfg = load_coordinator_config(base)
        db = st.Database(base / cfg.database)
        trainer = Trainer(cfg, db, PolicyStore(base / cfg.checkpoints))
        made.append(db)
        return trainer, db

    yield make
    for db in made:
        db.close()


def test_fresh_groups_are_trained_oldest_first_and_stale_ones_dropped_with_reason(trainer_env):
    trainer, db = trainer_env({"intake.s_max": 1, "trainer.groups_per_step": 3, "trainer.min_groups": 1})
    trainer.resume()
    first = add_groups(db, [SIGNAL] * 2)
    assert trainer.step().kind == "trained"  # version 0 -> 1
    assert trainer.step().kind == "waiting"
    assert trainer.version == 1
    first += add_groups(db, [SIGNAL])
    assert trainer.step().published == 2
    # At version 2 with s_max 1: version 0 is stale, 1 and 2 are fresh.
    stale = add_groups(db, [{**SIGNAL, "policy_version": 0}] * 2)
    fresh = add_groups(db, [{**SIGNAL, "policy_version": v} for v in (1, 2, 2, 1)])
    out = trainer.step()
    rows = group_rows(db)
    assert [rows[g]["dropped"] for g in stale] == ["stale", "stale"]
    assert all(rows[g]["consumed_step"] is None for g in stale)
    assert [rows[g]["consumed_step"] for g in fresh] == [3, 3, 3, None]  # oldest first, 3 per step
    assert [rows[g]["consumed_step"] for g in first] == [1, 1, 2]
    assert out.metrics["dropped_stale_groups"] == 2
    assert out.metrics["frac_stale"] == pytest.approx(8 / (8 + 12))
    assert out.metrics["staleness_hist"] == {"0": 8, "1": 4, "2": 8}
    assert kv(db, "trainer_step") == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="pins 'auto' to CPU on a machine without CUDA")
def test_trainer_keeps_model_and_optimizer_on_its_device_and_resumes_them_from_sharded_state(trainer_env):
    from veriroll.coordinator.checkpoint import SHARDED_DIR, latest_training_state

    trainer, db = trainer_env({"trainer.device": "auto"})
    trainer.resume()
    assert trainer.device == torch.device("cpu")
    add_groups(db, [SIGNAL] * 2)
    assert trainer.step().kind == "trained"
    assert {p.device for p in trainer.model.parameters()} == {trainer.device}
    moments = [t for s in trainer.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert moments and {t.device for t in moments} == {trainer.device}
    trainer.save_state()
    _, state = latest_training_state(trainer.state_dir)
    assert state["format"] == 2 and "model" not in state and (state["dir"] / SHARDED_DIR / ".metadata").is_file()
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    trainer.resume()  # a fresh model from version 0, then the checkpoint loaded onto the trainer's device
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())
    assert all(torch.equal(moments[k], v) for k, v in trainer.optimizer.state_dict()["state"][0].items())
    assert {p.device for p in trainer.model.parameters()} == {trainer.device}


def test_a_checkpoint_of_the_first_format_still_resumes(trainer_env):
    from veriroll.coordinator.checkpoint import save_training_state

    trainer, db = trainer_env()
    trainer.resume()
    add_groups(db, [SIGNAL] * 2)
    assert trainer.step().kind == "trained"
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    # What format 1 wrote: everything, the state dicts included, in state.pt.
    save_training_state(trainer.state_dir, 1, {"format": 1, "step": 1, "version": 1, "model": trainer.model.state_dict(),
                                               "optimizer": trainer.optimizer.state_dict(),
                                               "torch_rng": torch.get_rng_state(), "python_rng": [3, [0] * 625, None],
                                               "time": 0.0, "consumed_groups": 2}, keep=2)
    trainer.resume()
    assert trainer.step_no == 1
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())
    assert all(torch.equal(moments[k], v) for k, v in trainer.optimizer.state_dict()["state"][0].items())


def test_trainer_waits_and_says_so_while_too_few_fresh_groups(trainer_env, caplog):
    trainer, db = trainer_env({"trainer.min_groups": 3, "trainer.groups_per_step": 4})
    trainer.resume()
    add_groups(db, [SIGNAL] * 2)
    with caplog.at_level(logging.INFO, logger="veriroll.trainer"):
        assert trainer.step().kind == "waiting"
        assert trainer.step().kind == "waiting"
    waits = [r for r in caplog.records if "waiting for groups" in r.getMessage()]
    assert len(waits) == 1 and "2 fresh" in waits[0].getMessage() and "min_groups is 3" in waits[0].getMessage()
    assert kv(db, "trainer_step") == 0
    add_groups(db, [SIGNAL])
    out = trainer.step()
    assert out.kind == "trained" and out.metrics["groups"] == 3


def test_zero_advantage_groups_are_skipped_counted_and_consumed(trainer_env):
    trainer, db = trainer_env({"trainer.groups_per_step": 3})
    trainer.resume()
    ids = add_groups(db, [FLAT, SIGNAL, {"rewards": [0.0] * 4}])
    out = trainer.step()
    assert out.metrics["zero_adv_groups"] == 2
    assert out.metrics["groups"] == 3 and out.metrics["grad_norm"] > 0
    assert all(group_rows(db)[g]["consumed_step"] == 1 for g in ids)


def test_a_batch_without_signal_counts_as_a_step_but_changes_no_weight(trainer_env):
    trainer, db = trainer_env()
    trainer.resume()
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    add_groups(db, [FLAT, FLAT])
    out = trainer.step()
    assert out.kind == "trained" and out.metrics["zero_adv_groups"] == 2 and out.metrics["grad_norm"] is None
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_decoupled_correction_uses_trusted_logprobs_and_reports_mismatch(trainer_env):
    trainer, db = trainer_env({"trainer.correction": "decoupled"})
    trainer.resume()
    add_groups(db, [{**SIGNAL, "trusted": -2.0}, {**SIGNAL, "logprob": -3.0}])  # one verified, one not
    out = trainer.step()
    # Only the verified group's tokens enter the mismatch: k3 of (−2.0 − (−2.5)).
    assert out.metrics["mismatch_kl"] == pytest.approx(np.expm1(0.5) - 0.5, rel=1e-5)
    assert np.isfinite(out.metrics["loss"])


def test_history_keeps_one_entry_per_step_with_the_dashboard_keys(trainer_env):
    trainer, db = trainer_env()
    trainer.resume()
    add_groups(db, [SIGNAL] * 4)
    trainer.step()
    trainer.step()
    history = kv(db, HISTORY_KEY)
    assert [h["step"] for h in history] == [1, 2]
    for key in ("step", "version", "time", "reward", "approx_kl", "clipfrac", "entropy", "grad_norm", "mismatch_kl",
                "frac_stale", "staleness_hist", "groups", "tokens", "groups_per_s", "tokens_per_s",
                "zero_adv_groups", "queue_depth"):
        assert key in history[-1], key
    assert history[0]["queue_depth"] == 2 and history[1]["queue_depth"] == 0
    assert history[0]["reward"] == pytest.approx(0.5) and history[0]["tokens"] == 24


def test_publishes_version_n_plus_1_after_publish_weights_every_steps(tmp_path):
    base = make_coordinator_dir(tmp_path, {"trainer.enabled": True, "trainer.groups_per_step": 2,
                                           "trainer.min_groups": 2, "trainer.publish_weights_every": 2})

    async def scenario():
        async with running_coordinator(base) as coord:
            announced = []

            async def publish_version(v):
                announced.append(v)

            coord.publish_version = publish_version
            await coord.db.run(lambda c: [insert_group(c, **SIGNAL) for _ in range(2)])
            await wait_for(coord, lambda: kv_now(coord, "trainer_step") == 1)
            assert coord.service.policy.version == 0 and coord.policy_store.available() == [0]
            await coord.db.run(lambda c: [insert_group(c, **SIGNAL) for _ in range(2)])
            await wait_for(coord, lambda: kv_now(coord, "trainer_step") == 2 and announced)
            assert announced == [1]
            assert coord.service.policy.version == 1 and kv_now(coord, "policy_version") == 1
            assert coord.policy_store.available() == [0, 1]
            assert (coord.policy_store.version_dir(1) / "model.safetensors").exists()
            metrics = coord.service.metrics
            assert metrics.trainer_steps.get() == 2 and metrics.trainer.get(metric="version") == 1
            assert metrics.trainer.get(metric="reward") == pytest.approx(0.5)

    asyncio.run(scenario())


def kv_now(coord, key, default=None):
    return coord.db.run_sync(lambda c: st.kv_get(c, key, default))


async def wait_for(coord, predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met in {timeout} s; trainer_step={kv_now(coord, 'trainer_step')}")
        await asyncio.sleep(0.05)


def final_weights(base) -> dict:
    cfg = load_coordinator_config(base)
    store = PolicyStore(base / cfg.checkpoints)
    from safetensors.torch import load_file

    return load_file(store.version_dir(store.latest()) / "model.safetensors")


def test_restart_resumes_from_the_checkpoint_and_trains_exactly_the_unconsumed_groups(tmp_path):
    settings = {"trainer.enabled": True, "trainer.groups_per_step": 2, "trainer.min_groups": 2, "trainer.lr": 1e-3,
                "trainer.checkpoint_every": 2, "intake.s_max": 4}
    specs = [{"rewards": [1.0, 0.0, float(i % 2), 0.0]} for i in range(8)]

    def seed(base, part):
        db = st.Database(base / "state.db")
        add_groups(db, part)
        db.close()

    async def run_until(base, step):
        async with running_coordinator(base) as coord:
            await wait_for(coord, lambda: kv_now(coord, "trainer_step") == step)
            await asyncio.sleep(0.3)  # it must now be waiting, not training further
            assert kv_now(coord, "trainer_step") == step
            return coord.service.policy.version

    # Reference: 4 steps without interruption.
    ref = make_coordinator_dir(tmp_path / "ref", settings)
    seed(ref, specs)
    assert asyncio.run(run_until(ref, 4)) == 4

    # Interrupted after step 3 (its last checkpoint is step 2), then restarted with two more groups.
    base = make_coordinator_dir(tmp_path / "run", settings)
    seed(base, specs[:6])
    assert asyncio.run(run_until(base, 3)) == 3
    db = st.Database(base / "state.db")
    step3 = [g for g, r in group_rows(db).items() if r["consumed_step"] == 3]
    db.close()
    assert len(step3) == 2
    seed(base, specs[6:])
    # Versions are never reused: the retrained step 3 publishes version 4, step 4 version 5.
    assert asyncio.run(run_until(base, 4)) == 5

    db_ref, db_run = st.Database(ref / "state.db"), st.Database(base / "state.db")
    try:
        assert group_rows(db_ref) == group_rows(db_run)  # same groups in the same steps, each once
        assert [h["step"] for h in kv(db_run, HISTORY_KEY)] == [1, 2, 3, 4]
        assert kv(db_run, "policy_version") == 5
    finally:
        db_ref.close()
        db_run.close()
    a, b = final_weights(ref), final_weights(base)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6, msg=k)


def test_max_steps_finishes_training_and_the_coordinator_keeps_serving(tmp_path):
    base = make_coordinator_dir(tmp_path, {"trainer.enabled": True, "trainer.groups_per_step": 1,
                                           "trainer.min_groups": 1, "trainer.max_steps": 2})

    async def scenario():
        async with running_coordinator(base) as coord:
            await coord.db.run(lambda c: [insert_group(c, **SIGNAL) for _ in range(3)])
            await wait_for(coord, lambda: kv_now(coord, "trainer_done") is True)
            await asyncio.sleep(0.3)
            assert kv_now(coord, "trainer_step") == 2
            assert coord.db.run_sync(st.status_summary)["unconsumed_groups"] == 1
            assert not coord.stopped.is_set()
        # Restarting does not train further either; the final state was checkpointed.
        async with running_coordinator(base) as coord:
            await asyncio.sleep(0.3)
            assert kv_now(coord, "trainer_step") == 2 and coord.trainer.done

    asyncio.run(scenario())


def test_target_reward_stops_training(trainer_env):
    trainer, db = trainer_env({"trainer.target_reward": 0.7, "trainer.target_window": 2, "trainer.groups_per_step": 1,
                               "trainer.min_groups": 1})
    trainer.resume()
    add_groups(db, [{"rewards": [1.0, 1.0, 1.0, 0.0]}] * 3)
    trainer.step()
    assert not trainer.done  # one step is not a window of two
    trainer.step()
    assert trainer.done and kv(db, "trainer_done") is True
    assert trainer.step().kind == "done"


def test_policy_learns_from_its_own_rollouts(trainer_env):
    """Reward: the first completion token is '7'. Random init samples it ~1/16 of the time."""
    from veriroll.node.engines.base import GenerationRequest
    from veriroll.node.engines.torch import TorchEngine

    trainer, db = trainer_env({"trainer.lr": 3e-3, "trainer.groups_per_step": 8, "trainer.min_groups": 8,
                               "leases.group_size": 8})
    trainer.resume()
    target = 11  # '7' (4 special tokens, then "0123456789+=")
    engine = TorchEngine(threads=1)
    rng = np.random.default_rng(0)
    curve = []
    for _ in range(25):
        v = trainer.version
        if engine.version != v:
            engine.load(trainer.policy_store.version_dir(v), v)
        requests = [GenerationRequest(PROMPT, [int(s) for s in rng.integers(0, 2**63, 8)], 1.0, 2, [EOS])
                    for _ in range(8)]

        results = engine.generate(requests)
        db.run_sync(lambda c, results=results, v=v: [
            insert_group(c, [float(r.token_ids[0] == target) for r in res], policy_version=v,
                         samples=[(r.token_ids, r.logprobs) for r in res]) for res in results])
        out = trainer.step()
        curve.append(out.metrics["reward"])
    assert np.mean(curve[:5]) < 0.3
    assert np.mean(curve[-5:]) > 0.6, curve


def test_groups_reset_by_a_resume_count_staleness_from_the_restored_version():
    """After a crash, groups trained into the lost steps are trained again, not dropped as stale."""
    from veriroll.coordinator import store as st_mod
    from veriroll.coordinator.trainer import select_groups

    conn = st_mod.connect(":memory:")
    for gid, version in ((1, 1), (2, 5)):
        conn.execute("INSERT INTO groups(group_id, lease_id, node_id, prompt_id, env, policy_version, temperature, "
                     "arrival_ms, content_hash, tokens, mean_reward, verified) VALUES(?, ?, 'n', 1, 'e', ?, 1, 0, '', 1, 0, 1)",
                     (gid, f"l{gid}", version))
    # Newest version 8, s_max 2: both groups are stale against it...
    fresh, stale = select_groups(conn, 8, 2, 16)
    assert fresh == [] and [g for g, _ in stale] == [1, 2]
    # ...but group 2 was reset by a resume to the checkpoint of version 5: it is fresh against that.
    fresh, stale = select_groups(conn, 8, 2, 16, {2: 5})
    assert fresh == [(2, 0)] and stale == [(1, 7)]


# ---------------------------------------------------------------------------------------------------
# The step's memory options on a tiny Llama: gradient checkpointing, bf16 autocast


def tiny_model(seed: int = 0):
    from veriroll.coordinator.model_factory import build_char_tokenizer, build_tiny_model

    return build_tiny_model(build_char_tokenizer("0123456789+="), layers=2, hidden=64, heads=4, seed=seed)


def tiny_batch(groups: int = 4):
    """``groups`` groups of four, ragged prompts and completions, rewards varying inside each group."""
    from veriroll.coordinator.trainer import GroupRecord, SampleRecord, build_batch

    rng = np.random.default_rng(1)
    out = []
    for g in range(groups):
        prompt = np.array([1, *rng.integers(4, 16, size=2 + g % 3)], dtype=np.int32)
        samples = [SampleRecord(rng.integers(4, 16, size=2 + (g + i) % 4).astype(np.int32),
                                (-rng.uniform(0.5, 3.0, size=2 + (g + i) % 4)).astype(np.float32), None, float(i % 2))
                   for i in range(4)]
        out.append(GroupRecord(g, "arithmetic", 0, 1.0, 0, prompt, samples))
    batch, keep = build_batch(out, [0] * groups)
    assert bool(keep.all())
    return batch


def sgd_update(model, cfg, batch) -> tuple[dict, dict[str, torch.Tensor]]:
    """The step's diagnostics and its parameter update under SGD(lr=1): the clipped gradient, negated."""
    from veriroll.coordinator.trainer import train_step

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, cfg, s_max=2)
    return metrics, {n: p.detach() - before[n] for n, p in model.named_parameters()}


def test_gradient_checkpointing_recomputes_layers_and_gives_the_same_gradients():
    from veriroll.coordinator.config import TrainerConfig

    torch.set_num_threads(1)
    batch = tiny_batch()
    results = {}
    for checkpointing in (False, True):
        model = tiny_model()
        calls = []
        model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        # Several micro-batches: checkpointing has to hold across gradient accumulation too.
        cfg = TrainerConfig(gradient_checkpointing=checkpointing, autocast="off", micro_batch_tokens=40)
        metrics, update = sgd_update(model, cfg, batch)
        results[checkpointing] = metrics, update, len(calls), model.is_activation_checkpointing
    (m0, u0, calls0, on0), (m1, u1, calls1, on1) = results[False], results[True]
    parts = m0["micro_batches"]
    assert parts > 2 and m1["micro_batches"] == parts
    # Checkpointing runs each layer's forward again in the backward: its attention is called twice.
    assert (on0, calls0) == (False, parts) and (on1, calls1) == (True, 2 * parts)
    assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-6) and m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-5)
    assert any(u.abs().max() > 1e-4 for u in u0.values())
    for name in u0:
        torch.testing.assert_close(u1[name], u0[name], rtol=0, atol=1e-5, msg=name)


def test_bf16_autocast_step_keeps_float32_weights_and_moves_them_like_float32():
    from veriroll.coordinator.config import TrainerConfig
    from veriroll.coordinator.trainer import autocast_dtype

    torch.set_num_threads(1)
    assert autocast_dtype("auto", "cpu") is None and autocast_dtype("off", "cpu") is None
    assert autocast_dtype("bfloat16", "cpu") is torch.bfloat16
    batch = tiny_batch()
    updates = {}
    for setting in ("off", "bfloat16"):
        model = tiny_model()
        seen = []
        # The dtype the first layer's attention projection computes in: bf16 under autocast.
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, i, o, seen=seen: seen.append(o.dtype))
        metrics, updates[setting] = sgd_update(model, TrainerConfig(autocast=setting), batch)
        assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        assert seen[0] == (torch.bfloat16 if setting == "bfloat16" else torch.float32)
        assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay float32
    changed = [n for n, u in updates["bfloat16"].items() if u.abs().max() > 0]
    assert len(changed) == len(updates["bfloat16"])
    # bf16 rounds the activations (8 bits of mantissa): the update points the same way as float32's.
    flat = {k: torch.cat([u.flatten() for u in v.values()]) for k, v in updates.items()}
    assert F.cosine_similarity(flat["off"], flat["bfloat16"], dim=0) > 0.99


# ---------------------------------------------------------------------------------------------------
# Published versions: the operator's dtype, version 0's tokenizer files


WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def non_weight_files(d) -> dict[str, bytes]:
    """Every file of a version directory but its weights and config.json, by name, with its bytes."""
    return {p.name: p.read_bytes() for p in d.iterdir()
            if p.is_file() and p.name != "config.json" and not p.name.endswith(WEIGHT_SUFFIXES)}


def safetensors_weights(d) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def load_version(d, dtype="auto"):
    """A published version as a node or the verifier loads it: AutoModelForCausalLM + AutoTokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from veriroll.coordinator.models import _dtype_kwarg

    return AutoModelForCausalLM.from_pretrained(str(d), **{_dtype_kwarg(): dtype}), AutoTokenizer.from_pretrained(str(d))


@pytest.mark.parametrize("model_dtype", ["float32", "bfloat16"])
def test_tiny_preset_versions_are_published_in_the_operators_dtype_with_version_0s_tokenizer(trainer_env, model_dtype):
    trainer, db = trainer_env({"model_dtype": model_dtype})
    trainer.resume()
    add_groups(db, [SIGNAL] * 2)
    assert trainer.step().published == 1
    v0, v1 = trainer.policy_store.version_dir(0), trainer.policy_store.version_dir(1)
    # The char tokenizer's files (tokenizer_class PreTrainedTokenizerFast) are version 0's, byte for byte.
    assert non_weight_files(v1) == non_weight_files(v0) and "tokenizer.json" in non_weight_files(v1)
    assert b"PreTrainedTokenizerFast" in non_weight_files(v1)["tokenizer_config.json"]
    want = getattr(torch, model_dtype)
    model, tok = load_version(v1)
    assert {p.dtype for p in model.parameters()} == {want}
    assert tok.encode("1+2=") == trainer.policy_store.tokenizer.encode("1+2=")
    # The file holds the trainer's float32 weights rounded to the configured dtype; the trainer keeps float32.
    published = safetensors_weights(v1)
    trained = dict(trainer.model.state_dict())
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
    for name, t in published.items():
        assert t.dtype == want, name
        assert torch.equal(t, trained[name].to(want)), name
    assert any(not torch.equal(published[n], safetensors_weights(v0)[n].to(want)) for n in published)


def link_model(src, dst) -> None:
    """``dst`` as a directory of symlinks to ``src``'s files (the 538 MB model is not copied)."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).symlink_to(p)


def smollm2_trainer(tmp_path, smollm2_dir, overrides: dict, *, v0_dtype: str = "float32"):
    """A Trainer whose version 0 is SmolLM2-135M-Instruct, stored in ``v0_dtype``."""
    import shutil

    from transformers import AutoModelForCausalLM

    from veriroll.coordinator.models import DTYPES, save_pretrained_checkpoint

    base = make_coordinator_dir(tmp_path, {"trainer.groups_per_step": 2, "trainer.min_groups": 2, **overrides})
    cfg = load_coordinator_config(base)
    store = PolicyStore(base / cfg.checkpoints)
    shutil.rmtree(store.version_dir(0))
    if v0_dtype == "float32":
        link_model(smollm2_dir, store.version_dir(0))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir))
        save_pretrained_checkpoint(model, smollm2_dir, store.version_dir(0), dtype=DTYPES[v0_dtype])
        del model
    db = st.Database(base / cfg.database)
    return Trainer(cfg, db, store), db


def chat_prompt(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def real_groups(tok, n_groups: int, group_size: int, completion_len: int, *, seed: int = 0) -> list[dict]:
    """Groups for ``insert_group``: a chat prompt, random completions ending in EOS (= the pad id),
    rewards that vary inside each group so every sample has a non-zero advantage."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        samples = []
        for i in range(group_size):
            n = completion_len - (i % 3)
            tokens = [*rng.integers(100, tok.vocab_size, size=n - 1).tolist(), tok.eos_token_id]
            samples.append((tokens, (-rng.uniform(5.0, 12.0, size=n)).tolist()))
        out.append({"rewards": [float(i % 2) for i in range(group_size)], "samples": samples,
                    "prompt": chat_prompt(tok, f"What is {g} + {g + 1}? Think step by step.")})
    return out


def insert_real_groups(db, groups: list[dict]) -> list[int]:
    def op(conn):
        ids = []
        for g in groups:
            gid = insert_group(conn, g["rewards"], samples=g["samples"])
            pid = conn.execute("SELECT prompt_id FROM groups WHERE group_id = ?", (gid,)).fetchone()[0]
            conn.execute("UPDATE prompts SET prompt_ids = ? WHERE prompt_id = ?", (st.pack_i32(g["prompt"]), pid))
            ids.append(gid)
        return ids

    return db.run_sync(op)


def test_real_model_loads_bf16_version_0_as_float32_and_publishes_bf16_with_its_own_tokenizer(tmp_path, smollm2_dir):
    trainer, db = smollm2_trainer(tmp_path, smollm2_dir, {"model_dtype": "bfloat16", "trainer.lr": 1e-4,
                                                          "trainer.micro_batch_tokens": 256,
                                                          "trainer.gradient_checkpointing": True,
                                                          "trainer.kl_coef": 0.01}, v0_dtype="bfloat16")
    try:
        torch.set_num_threads(1)
        trainer.resume()
        v0 = trainer.policy_store.version_dir(0)
        stored = safetensors_weights(v0)
        assert {t.dtype for t in stored.values()} == {torch.bfloat16}
        # bf16 on disk, float32 in the trainer (policy and KL reference alike): the master weights.
        for model in (trainer.model, trainer.ref_model):
            assert {p.dtype for p in model.parameters()} == {torch.float32}
            assert torch.equal(model.state_dict()["model.embed_tokens.weight"],
                               stored["model.embed_tokens.weight"].float())
        tok = trainer.policy_store.tokenizer
        assert tok.pad_token_id == tok.eos_token_id == 2
        insert_real_groups(db, real_groups(tok, 2, 4, 12))
        out = trainer.step()
        assert out.published == 1 and np.isfinite(out.metrics["loss"]) and out.metrics["grad_norm"] > 0
        v1 = trainer.policy_store.version_dir(1)
        files = non_weight_files(v1)
        assert files == non_weight_files(v0)
        assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} <= set(files)
        published = safetensors_weights(v1)
        assert published.keys() == stored.keys()  # the tied LM head is not written twice
        assert {t.dtype for t in published.values()} == {torch.bfloat16}
        assert any(not torch.equal(published[n], stored[n]) for n in published)  # the step moved the weights
        model, loaded_tok = load_version(v1)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert loaded_tok.chat_template == tok.chat_template and loaded_tok.eos_token_id == 2
        assert model.generation_config.eos_token_id == 2
    finally:
        db.close()


def test_padding_is_masked_by_the_attention_mask_when_the_pad_id_is_eos(smollm2_dir):
    """SmolLM2 pads with EOS (2), which also ends every completion: each row's log-probs in a padded
    batch are its log-probs alone, the final EOS included."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from veriroll.coordinator.trainer import (
        GroupRecord,
        SampleRecord,
        build_batch,
        completion_logprobs,
        micro_batches,
    )

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tok.pad_token_id == tok.eos_token_id == 2
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir)).eval()
    groups = []
    for g, spec in enumerate(real_groups(tok, 2, 3, 9, seed=3)):
        prompt = np.array(spec["prompt"][: len(spec["prompt"]) - 3 * g], dtype=np.int32)  # ragged prompts too
        samples = [SampleRecord(np.array(t, dtype=np.int32), np.array(lp, dtype=np.float32), None, r)
                   for (t, lp), r in zip(spec["samples"], spec["rewards"], strict=True)]
        groups.append(GroupRecord(g, "math", 0, 0.7, 0, prompt, samples))
    batch, _ = build_batch(groups, [0, 0], pad_id=tok.pad_token_id)
    # EOS, padding and the chat template's end of turn (<|im_end|>, inside every prompt) share one id:
    # masking by id would hide the prompt's turn ends from attention and change every log-prob.
    assert all(tok.eos_token_id in g.prompt_ids.tolist() for g in groups)
    assert (batch.input_ids == tok.pad_token_id).sum() > batch.size
    with torch.no_grad():
        together, _ = completion_logprobs(model, batch)
        alone = [completion_logprobs(model, row)[0] for row in micro_batches(batch, 1)]  # one row, no padding
    order = torch.argsort(batch.attention_mask.sum(1), stable=True).tolist()  # micro_batches' row order
    for row, logp in zip(order, alone, strict=True):
        n = int(batch.response_mask[row].sum())
        assert batch.completion_ids[row, n - 1] == tok.eos_token_id and logp.shape[1] == n
        torch.testing.assert_close(together[row, :n], logp[0], rtol=0, atol=2e-4)


def test_versions_are_written_and_published_off_the_event_loop(tmp_path, caplog):
    """The checkpoint write runs in the trainer's worker thread and shardcast's hashing in a worker
    thread of the loop: the event loop that serves intake never does either."""
    import threading

    base = make_coordinator_dir(tmp_path, {"trainer.enabled": True, "trainer.groups_per_step": 2,
                                           "trainer.min_groups": 2, "shardcast.origin_port": 0})

    async def scenario():
        async with running_coordinator(base) as coord:
            await coord.db.run(lambda c: [insert_group(c, **SIGNAL) for _ in range(2)])
            await wait_for(coord, lambda: coord.service.policy.manifest_path == "/versions/1/manifest")
            return threading.current_thread().name

    with caplog.at_level(logging.INFO):
        loop_thread = asyncio.run(scenario())
    wrote = [r for r in caplog.records if r.getMessage().startswith("wrote version 1 ")]
    published = [r for r in caplog.records if r.name.startswith("veriroll.shardcast")
                 and r.getMessage().startswith("published version 1:")]
    assert len(wrote) == 1 and wrote[0].threadName.startswith("veriroll-trainer")
    assert len(published) == 1 and published[0].threadName not in (loop_thread, wrote[0].threadName)


@pytest.mark.slow
def test_smollm2_step_at_the_smoke_settings_stays_under_6_gb(smollm2_dir):
    """A fresh process loads SmolLM2-135M like the trainer, takes two AdamW steps on 8 samples x 48
    tokens after a chat prompt (micro_batch_tokens 1024, gradient checkpointing on) and publishes the
    weights in bf16; its peak RSS (ru_maxrss) stays below 6 GB and every weight tensor moved."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "trainer_memory.py"), "--quick",
                           "--model", str(smollm2_dir), "--micro-batch-tokens", "1024", "--gradient-checkpointing",
                           "--publish", "bfloat16"],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"\nSmolLM2-135M trainer at the smoke settings: peak RSS {result['trainer_peak_rss_mb']:.0f} MB "
          f"(after a bf16 publish {result['publish'][0]['peak_rss_mb']:.0f} MB), step {result['step_s']:.1f} s")
    assert result["samples"] == 8 and result["gradient_checkpointing"] is True
    assert result["weights_changed"] == 272  # every parameter tensor of SmolLM2-135M (tied head counted once)
    assert result["trainer_peak_rss_mb"] < 6000
    assert result["publish"][0]["peak_rss_mb"] < 6000
    assert result["publish"][0]["bytes"] < 300e6  # bf16: half of the 538 MB float32 weights, plus tokenizer files


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measure_publish_times_a_signed_shardcast_version_of_the_weights(tmp_path, dtype):
    from support import build_tiny_checkpoint

    from veriroll.coordinator.trainer import measure_publish
    from veriroll.protos.identity import PrivateKey
    from veriroll.shardcast.store import list_versions

    base = build_tiny_checkpoint(tmp_path / "v0")
    model = load_version(base, "float32")[0]
    out = measure_publish(model, base, tmp_path / "out", dtype, PrivateKey.generate(), version=3)
    checkpoint = tmp_path / "out" / "checkpoint"
    assert out["dtype"] == dtype and out["save_s"] > 0 and out["shard_s"] > 0
    assert out["publish_s"] == pytest.approx(out["save_s"] + out["shard_s"])
    # What ships is the checkpoint's files, all of them: weights in the dtype asked for, version 0's tokenizer.
    assert out["bytes"] == sum(p.stat().st_size for p in checkpoint.iterdir())
    assert out["files"] == len(list(checkpoint.iterdir()))
    assert {t.dtype for t in safetensors_weights(checkpoint).values()} == {getattr(torch, dtype)}
    assert non_weight_files(checkpoint) == non_weight_files(base)
    assert list_versions(tmp_path / "out" / "store") == [3]


def test_a_sharded_version_0_gives_its_tokenizer_but_not_its_weight_index_to_later_versions(tmp_path):
    from support import build_tiny_checkpoint

    from veriroll.coordinator.models import save_pretrained_checkpoint
    from veriroll.coordinator.trainer import write_policy_version

    tiny = build_tiny_checkpoint(tmp_path / "tiny")
    model = load_version(tiny, "float32")[0]
    # Version 0 in bf16 shards of at most 100 kB, with an index; version 1 in one float32 file.
    v0 = save_pretrained_checkpoint(model, tiny, tmp_path / "v0", max_shard_size="100KB", dtype=torch.bfloat16)
    assert len(list(v0.glob("*.safetensors"))) > 1 and (v0 / "model.safetensors.index.json").exists()
    v1 = write_policy_version(model, v0, tmp_path / "v1", torch.float32)
    assert sorted(p.name for p in v1.glob("*.safetensors*")) == ["model.safetensors"]
    assert non_weight_files(v1) == non_weight_files(v0) == non_weight_files(tiny)
    for d, dtype in ((v0, torch.bfloat16), (v1, torch.float32)):
        loaded = load_version(d)[0]
        assert {p.dtype for p in loaded.parameters()} == {dtype}
        for name, p in loaded.state_dict().items():
            assert torch.equal(p, model.state_dict()[name].to(dtype)), (d.name, name)
