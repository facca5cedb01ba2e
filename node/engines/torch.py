"""The PyTorch engine: any transformers causal LM, on CPU or any GPU.

All samples of all requests are generated together: prompts are left-padded into one batch (with an
attention mask and position ids that count only real tokens, so every row sees exactly the positions
a lone, unpadded forward would), prefilled once, then decoded one token per step against a KV cache.
A row leaves the batch (and the cache) as soon as it emits a stop token or reaches its
``max_new_tokens``.

The hidden state we keep is the LM head's input, captured by a forward pre-hook on the model's output
embeddings: that is by definition the final-norm hidden state that produced the logits we sampled
from, for every architecture, without asking the model for all its layers' hidden states. For Llama-
style models it equals ``outputs.hidden_states[-1]`` and the base model's ``last_hidden_state``
(pinned by a test), which is what the coordinator's teacher-forced prefill reads.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from veriroll.node.engines.base import Engine, GenerationRequest, SampleResult
from veriroll.toploc import sampling

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_TOKENS = 1 << 16

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or its name (``'bfloat16'``, ``'bf16'``, ``'float32'``, ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}") from None


def _commit_fn() -> Callable[[list[torch.Tensor]], list[bytes]]:
    """TOPLOC commitments for a list of ``[T, H]`` tensors (``commit_many`` shares the field arithmetic
    of a whole group).

    Fails closed: ``veriroll.toploc`` is first-party, so an ImportError propagates; a node that cannot
    make proofs does not start (the engine resolves this at construction). Imported here rather than
    at the top of the module only so that it is looked up when an engine is built.
    """
    from veriroll.toploc import commit_many

    return commit_many


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars ("Loading weights") off while the node loads a version.

    A node loads every new policy version: a bar each time would be noise in a log and would tear the
    live panel on a terminal, which shows the version instead. They come back on afterwards, unless
    they were off already (``HF_HUB_DISABLE_PROGRESS_BARS``), so nothing else in the process changes.
    """
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def _seed_bits(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits (what ``sampling`` hashes)."""
    return seed - (1 << 64) if seed >= (1 << 63) else seed


@dataclass
class GenerationStats:
    """Where the time of the last :meth:`TorchEngine.generate` call went (seconds)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    commit_s: float = 0.0
    total_s: float = 0.0
    samples: int = 0
    tokens: int = 0
    batches: int = 0


@dataclass
class _Row:
    """One sample being generated, and what it has produced so far."""

    request: int
    index: int
    prompt: list[int]
    seed: int
    temperature: float
    max_new_tokens: int
    stop: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str = "length"


class TorchEngine(Engine):
    """Batched, KV-cached, seeded generation with any ``AutoModelForCausalLM`` checkpoint.

    ``threads`` sets torch's intra-op threads for the process (``None`` leaves it alone).
    ``max_batch_tokens`` bounds one forward batch: rows x (longest prompt + longest completion) of the
    rows in it; requests beyond it are split into several batches, each generated to the end.
    """

    name = "torch"

    def __init__(
        self,
        checkpoint_dir: Path | str | None = None,
        version: int | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        threads: int | None = 1,
        max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
        attn_implementation: str | None = None,
    ) -> None:
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be positive")
        self.device = torch.device(device)
        self.dtype = resolve_dtype(dtype)
        self.max_batch_tokens = max_batch_tokens
        self.attn_implementation = attn_implementation
        if threads is not None:
            torch.set_num_threads(threads)
        self.version = None
        self.last_stats = GenerationStats()
        self._model: torch.nn.Module | None = None
        self._captured: list[torch.Tensor] = []
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._lock = threading.Lock()
        self._commit_many = _commit_fn()  # no proofs, no engine: an ImportError stops the node here
        if checkpoint_dir is not None:
            self.load(Path(checkpoint_dir), version)

    # -- weights -------------------------------------------------------------------------------------

    @classmethod
    def from_model(cls, model: torch.nn.Module, version: int | None = None, **kwargs) -> TorchEngine:
        """An engine around an already built model (tests, benchmarks); it is moved to the engine's
        device and dtype."""
        engine = cls(**kwargs)
        engine._install(model, version)
        return engine

    def load(self, checkpoint_dir: Path, version: int | None) -> None:
        """Load an HF checkpoint directory and make it live.

        The new model is built before the old one is touched, so a failed load (missing or corrupt
        files) leaves the engine serving the previous version. A generation in progress finishes on
        the old weights; ``version`` changes together with the weights.
        """
        import transformers

        kwargs = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": self.dtype}
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        with _no_progress_bars():
            model = transformers.AutoModelForCausalLM.from_pretrained(Path(checkpoint_dir), **kwargs)
        self._install(model, version)

    def _install(self, model: torch.nn.Module, version: int | None) -> None:
        model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(
                f"{type(model).__name__} has no output embeddings (LM head) to read hidden states from"
            )
        # The LM head's input is the final-norm hidden state the logits are computed from.
        hook = head.register_forward_pre_hook(lambda _module, args: self._captured.append(args[0]))
        params = self._forward_params(model)
        with self._lock:
            if self._hook is not None:
                self._hook.remove()
            self._model, self._hook = model, hook
            self._cache_arg = "cache" if "cache" in params else "past_key_values"
            self._logits_to_keep = "logits_to_keep" in params
            self.version = version

    @staticmethod
    def _forward_params(model: torch.nn.Module) -> set[str]:
        import inspect

        return set(inspect.signature(model.forward).parameters)

    @property
    def vocab_size(self) -> int:
        model = self._require_model()
        return int(model.get_output_embeddings().weight.shape[0])

    @property
    def model(self) -> torch.nn.Module:
        """The live model (read-only use: the verifier-side tests run their prefill on it)."""
        return self._require_model()

    def _require_model(self) -> torch.nn.Module:
        if self._model is None:
            raise RuntimeError("no weights loaded: call load(checkpoint_dir, version) first")
        return self._model

    def close(self) -> None:
        with self._lock:
            if self._hook is not None:
                self._hook.remove()
            self._model, self._hook = None, None
            self.version = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- generation ----------------------------------------------------------------------------------

    def generate(
        self, requests: list[GenerationRequest], *, keep_hidden: bool = False
    ) -> list[list[SampleResult]]:
        """Generate all samples of all ``requests`` in as few batches as ``max_batch_tokens`` allows."""
        # no_grad rather than inference_mode: the hidden states we hand out stay ordinary tensors.
        with self._lock, torch.no_grad():
            model = self._require_model()
            stats = GenerationStats()
            started = time.perf_counter()
            rows = self._rows(requests)
            for batch in self._batches([r for r in rows if r.max_new_tokens > 0]):
                self._generate_batch(model, batch, stats)
                stats.batches += 1
            width = model.get_output_embeddings().weight.shape[1]
            hiddens = [
                torch.stack(r.hidden) if r.hidden else torch.empty(0, width, dtype=self.dtype) for r in rows
            ]
            t0 = time.perf_counter()
            proofs = self._commit(hiddens)
            stats.commit_s = time.perf_counter() - t0
            results = [[None] * req.n for req in requests]
            for row, hidden, proof in zip(rows, hiddens, proofs, strict=True):
                results[row.request][row.index] = SampleResult(
                    token_ids=row.tokens,
                    logprobs=row.logprobs,
                    proof=proof,
                    finish_reason=row.finish_reason,
                    hidden=hidden.cpu() if keep_hidden else None,
                )
                stats.tokens += len(row.tokens)
            stats.samples = len(rows)
            stats.total_s = time.perf_counter() - started
            self.last_stats = stats
            return results

    def _commit(self, hiddens: list[torch.Tensor]) -> list[bytes]:
        proofs = self._commit_many(hiddens)
        if len(proofs) != len(hiddens) or not all(isinstance(p, bytes) and p for p in proofs):
            raise RuntimeError("TOPLOC produced no proof for some sample; refusing to return unproven samples")
        return proofs

    def _rows(self, requests: list[GenerationRequest]) -> list[_Row]:
        vocab = self.vocab_size
        rows = []
        for i, req in enumerate(requests):
            if any(not 0 <= t < vocab for t in req.prompt_ids):
                raise ValueError(f"request {i}: prompt token ids must lie in [0, {vocab})")
            stop = frozenset(req.stop_token_ids)
            for j, seed in enumerate(req.seeds):
                rows.append(
                    _Row(i, j, list(req.prompt_ids), int(seed), req.temperature, req.max_new_tokens, stop)
                )
        return rows

    def _batches(self, rows: list[_Row]) -> Iterator[list[_Row]]:
        """Rows grouped into batches under ``max_batch_tokens``, longest prompts first to limit padding."""
        batch: list[_Row] = []
        prompt_width = new_width = 0
        for row in sorted(rows, key=lambda r: len(r.prompt), reverse=True):
            p, n = max(prompt_width, len(row.prompt)), max(new_width, row.max_new_tokens)
            if batch and (len(batch) + 1) * (p + n) > self.max_batch_tokens:
                yield batch
                batch, p, n = [], len(row.prompt), row.max_new_tokens
            batch.append(row)
            prompt_width, new_width = p, n
        if batch:
            yield batch

    def _forward(self, model, input_ids, attention_mask, position_ids, cache):
        """One forward pass: last-position logits ``[B, V]``, LM-head input ``[B, H]`` and the cache."""
        kwargs = {self._cache_arg: cache} if cache is not None else {}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        self._captured.clear()
        out = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            **kwargs,
        )
        if len(self._captured) != 1:
            raise RuntimeError(f"expected one LM-head call per forward, saw {len(self._captured)}")
        hidden = self._captured.pop()[:, -1, :]
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :], hidden, cache

    def _generate_batch(self, model, rows: list[_Row], stats: GenerationStats) -> None:
        t0 = time.perf_counter()
        dev = self.device
        lengths = torch.tensor([len(r.prompt) for r in rows], device=dev)
        width = int(lengths.max())
        input_ids = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
        attention_mask = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
        for i, row in enumerate(rows):
            input_ids[i, width - len(row.prompt) :] = torch.tensor(row.prompt, device=dev)
            attention_mask[i, width - len(row.prompt) :] = 1
        # Left padding: real tokens sit at positions 0..P-1, as in the verifier's unpadded view.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        seeds = torch.tensor([_seed_bits(r.seed) for r in rows], dtype=torch.int64, device=dev)

        logits, hidden, cache = self._forward(model, input_ids, attention_mask, position_ids, None)
        stats.prefill_s += time.perf_counter() - t0
        t0 = time.perf_counter()

        active = list(rows)
        step = 0
        while True:
            tokens = torch.empty(len(active), dtype=torch.long, device=dev)
            logprobs = torch.empty(len(active), dtype=torch.float32, device=dev)
            positions = torch.full((len(active),), step, dtype=torch.int64, device=dev)
            for temperature in {r.temperature for r in active}:
                sel = torch.tensor(
                    [i for i, r in enumerate(active) if r.temperature == temperature], device=dev
                )
                picked = sampling.sample(logits[sel], temperature, seeds[sel], positions[sel])
                tokens[sel] = picked
                logprobs[sel] = sampling.token_logprobs(logits[sel], picked, temperature)

            keep = []
            for i, (row, token, logprob) in enumerate(
                zip(active, tokens.tolist(), logprobs.tolist(), strict=True)
            ):
                row.tokens.append(token)
                row.logprobs.append(logprob)
                row.hidden.append(hidden[i])
                if token in row.stop:
                    row.finish_reason = "stop"
                elif len(row.tokens) < row.max_new_tokens:
                    keep.append(i)
            if not keep:
                break
            if len(keep) < len(active):
                # Finished rows leave the batch and the cache instead of decoding padding.
                idx = torch.tensor(keep, device=dev)
                cache.reorder_cache(idx)
                attention_mask, lengths, seeds, tokens = (
                    attention_mask[idx],
                    lengths[idx],
                    seeds[idx],
                    tokens[idx],
                )
                active = [active[i] for i in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active), 1)], dim=1)
            # The token generated at step t sits at position P + t of its sample.
            position_ids = (lengths + step)[:, None]
            logits, hidden, cache = self._forward(model, tokens[:, None], attention_mask, position_ids, cache)
            step += 1
        stats.decode_s += time.perf_counter() - t0
