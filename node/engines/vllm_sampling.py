"""The vLLM engine's logic that does not need vLLM: pure functions and small state machines over tensors.

:mod:`veriroll.node.engines.vllm` wires these into vLLM (a logits processor, a forward pre-hook, the
request loop); everything here is tested on CPU without vLLM installed.

How a seeded draw goes through vLLM: every sample is one vLLM request run at **temperature 0**
(greedy) that carries its seed and the lease's temperature ``T`` in ``SamplingParams.extra_args``.
Our logits processor sees the raw logits of each request's next position, draws the token exactly as
:func:`veriroll.toploc.sampling.sample` does (``argmax(logits / T + gumbel(seed, t))``), computes its
log-prob under ``softmax(logits / T)`` from the same raw logits (vLLM's own log-probs would be of the
logits it was handed, i.e. of our perturbed scores at temperature 0), and hands vLLM back a row that
is ``-inf`` everywhere but at the chosen token, so vLLM's greedy argmax can only pick that token,
whatever its tie-breaking. The hidden state that produced the logits (captured by a forward pre-hook
on the model's logits processor) is recorded with the token, keyed by ``(sample, t)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from veriroll.node.engines.base import EngineUnavailable
from veriroll.toploc import sampling

# The vLLM versions this engine was written against, as [low, high). 0.11 is the first release whose V1
# logits-processor interface passes (index, params, prompt ids, output ids) to ``update_state`` and
# whose ``LLM`` takes custom processor classes; 0.34 is excluded until someone has run
# tests/gpu/check_vllm.py on it (the V1 model runner this engine drives is being replaced by the
# "Model Runner V2", the default from 0.32 on, which has a different processor interface).
SUPPORTED_VLLM = ((0, 11, 0), (0, 34, 0))

EXTRA_ARGS_KEY = "veriroll"
"""Key of our per-request arguments in ``SamplingParams.extra_args``."""

_VERSION_RE = re.compile(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int]:
    """``'0.32.0+cpu'`` → ``(0, 32, 0)``; pre-release and local suffixes are ignored."""
    match = _VERSION_RE.match(str(text))
    if match is None:
        raise ValueError(f"not a version: {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def check_vllm_version(version: str, supported: tuple[tuple[int, ...], tuple[int, ...]] = SUPPORTED_VLLM) -> None:
    """Raise :class:`EngineUnavailable` unless ``version`` lies in ``[low, high)`` of ``supported``."""
    low, high = supported
    span = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    try:
        parsed = parse_version(version)
    except ValueError:
        raise EngineUnavailable(f"cannot read the installed vLLM version {version!r}; veriroll needs vllm{span}") from None
    if not low <= parsed < high:
        raise EngineUnavailable(
            f"vLLM {version} is not supported: the vllm engine was written and checked against vllm{span}; "
            f"install a supported version with `pip install 'veriroll[vllm]'`"
        )


# --------------------------------------------------------------------------------------------------
# Per-request arguments.


@dataclass(frozen=True)
class SampleSpec:
    """What our logits processor needs to know about one vLLM request (one sample)."""

    sample: int
    """Index of the sample within the engine's current ``generate`` call."""
    seed: int
    """The coordinator's uint64 seed as the int64 with the same bits (what the sampler hashes)."""
    temperature: float

    def extra_args(self) -> dict:
        """The ``SamplingParams.extra_args`` that carry this spec through vLLM."""
        return {EXTRA_ARGS_KEY: {"sample": self.sample, "seed": self.seed, "temperature": self.temperature}}

    @classmethod
    def from_params(cls, params) -> SampleSpec | None:
        """The spec carried by vLLM ``SamplingParams`` (anything with ``extra_args``), or ``None`` if it
        carries none. Raises ``ValueError`` on a malformed one."""
        extra = getattr(params, "extra_args", None) or {}
        raw = extra.get(EXTRA_ARGS_KEY)
        if raw is None:
            return None
        try:
            sample, seed, temperature = int(raw["sample"]), int(raw["seed"]), float(raw["temperature"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed {EXTRA_ARGS_KEY!r} extra_args: {raw!r}") from exc
        if sample < 0 or not -(1 << 63) <= seed < (1 << 63) or not temperature > 0:
            raise ValueError(f"out-of-range {EXTRA_ARGS_KEY!r} extra_args: {raw!r}")
        return cls(sample, seed, temperature)


def seed_bits(seed: int) -> int:
    """A uint64 seed as the int64 with the same bits."""
    return seed - (1 << 64) if seed >= (1 << 63) else seed


# --------------------------------------------------------------------------------------------------
# The persistent batch, as the V1 logits-processor interface describes it.


def added_fields(entry: Sequence) -> tuple[int, object, list[int]]:
    """``(index, params, output_tok_ids)`` of one ``BatchUpdate.added`` entry.

    vLLM 0.11+ sends ``(index, params, prompt_tok_ids, output_tok_ids)``; some development versions
    sent ``(prompt_tok_ids, index, params, output_tok_ids)`` or no prompt ids. The index is the one
    plain int, the params the element with ``extra_args``, the running output list the last element.
    """
    index = next((x for x in entry if isinstance(x, int) and not isinstance(x, bool)), None)
    params = next((x for x in entry if hasattr(x, "extra_args")), None)
    outputs = entry[-1]
    if index is None or params is None or not isinstance(outputs, list):
        raise ValueError(f"unrecognised BatchUpdate.added entry: {tuple(type(x).__name__ for x in entry)}")
    return index, params, outputs


class BatchRows:
    """Which of our samples sits in which row of vLLM's persistent batch, and how far it has got.

    ``update`` applies one ``BatchUpdate`` (removed, then added, then moved, as vLLM documents).
    Each row keeps a reference to the request's running list of output tokens, which vLLM extends in
    place: its length *is* the index ``t`` of the token about to be sampled, also after a preemption
    (the resumed request comes back with the tokens it already had).
    """

    def __init__(self) -> None:
        self._rows: dict[int, tuple[SampleSpec, list[int]]] = {}
        self._version = 0  # bumped on every change, so callers can cache per-composition tensors

    @property
    def version(self) -> int:
        return self._version

    def __len__(self) -> int:
        return len(self._rows)

    def update(self, removed: Iterable[int], added: Iterable[Sequence], moved: Iterable[Sequence]) -> None:
        for index in removed:
            self._rows.pop(int(index), None)
        for entry in added:
            index, params, outputs = added_fields(entry)
            spec = SampleSpec.from_params(params)
            if spec is None:
                self._rows.pop(index, None)  # a request that is not ours replaces one of ours
            else:
                self._rows[index] = (spec, outputs)
        for a, b, direction in moved:
            # UNIDIRECTIONAL moves a to b (b is overwritten); SWAP exchanges them. Compared by name so
            # that this code does not import vLLM's enum.
            swap = getattr(direction, "name", str(direction)).upper().endswith("SWAP")
            row_a, row_b = self._rows.pop(a, None), self._rows.pop(b, None)
            if row_a is not None:
                self._rows[b] = row_a
            if swap and row_b is not None:
                self._rows[a] = row_b
        self._version += 1

    def active(self, num_rows: int) -> tuple[list[int], list[SampleSpec], list[int]]:
        """Rows (ascending, below ``num_rows``) that hold one of our samples, their specs, and the index
        ``t`` of the token each is about to sample."""
        rows = sorted(i for i in self._rows if i < num_rows)
        specs = [self._rows[i][0] for i in rows]
        positions = [len(self._rows[i][1]) for i in rows]
        return rows, specs, positions


# --------------------------------------------------------------------------------------------------
# The draw.


Draw = Callable[[torch.Tensor, float, torch.Tensor, torch.Tensor], torch.Tensor]


def fused_draw() -> Draw:
    """:func:`sampling.sample` compiled by ``torch.compile`` into one kernel (for any number of rows).

    Eager, the hash behind the noise is ~20 elementwise int64 passes over ``[rows, vocab]``, a few ms
    per decode step at a 150 k vocabulary; fused it is one pass. The integer hash is exact either
    way; the compiled float steps (``log``, the division by T) may differ from eager by an ulp,
    which can only change a draw at an exact tie, far inside the verifier's near-tie slack.
    """
    return torch.compile(sampling.sample_dense, dynamic=True)


def seeded_tokens(
    logits: torch.Tensor,
    temperatures: Sequence[float],
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    draw: Draw = sampling.sample,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded Gumbel-max tokens ``[N]`` and their log-probs ``[N]`` (float32) for rows of raw ``logits``.

    Row ``i`` uses temperature ``temperatures[i]``, seed ``seeds[i]`` (int64 bits) and generated-token
    index ``positions[i]``. Rows are drawn per temperature with :func:`sampling.sample` (or ``draw``,
    e.g. :func:`fused_draw`) and :func:`sampling.token_logprobs` themselves, so by default the result
    is bit for bit what the torch engine and the verifier compute for the same logits on the same
    device.
    """
    n = logits.shape[0]
    if len(temperatures) != n or seeds.numel() != n or positions.numel() != n:
        raise ValueError(f"{n} logits rows, {len(temperatures)} temperatures, {seeds.numel()} seeds, "
                         f"{positions.numel()} positions")
    tokens = torch.empty(n, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
    distinct = sorted(set(temperatures))
    for temperature in distinct:
        if len(distinct) == 1:
            sel = slice(None)
        else:
            sel = torch.tensor([i for i, t in enumerate(temperatures) if t == temperature], device=logits.device)
        rows = logits[sel]
        picked = draw(rows, temperature, seeds[sel], positions[sel])
        tokens[sel] = picked
        logprobs[sel] = sampling.token_logprobs(rows, picked, temperature)
    return tokens, logprobs


def force_tokens(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``logits`` with each of ``rows`` set to ``-inf`` except 0 at its token, in place, returned.

    A greedy sampler (argmax) then picks exactly ``tokens``, independent of how it breaks ties; a
    random one would too, since every other token has probability 0.
    """
    logits[rows] = float("-inf")
    logits[rows, tokens] = 0.0
    return logits


# --------------------------------------------------------------------------------------------------
# Hidden states.


def hidden_from_hook_args(args: tuple, kwargs: dict | None = None) -> torch.Tensor:
    """The hidden states a forward pre-hook on vLLM's ``LogitsProcessor`` module sees.

    Its ``forward(lm_head, hidden_states, ...)`` takes them second, positionally in every release we
    support, by keyword in none; both are accepted.
    """
    kwargs = kwargs or {}
    if len(args) >= 2 and isinstance(args[1], torch.Tensor):
        return args[1]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    raise ValueError("the logits processor was called without a hidden_states tensor")


def sampled_row_indices(query_lens: Sequence[int]) -> torch.Tensor:
    """Indices, in a flattened ``[num_tokens, H]`` batch, of the last row of each request: the rows
    whose logits are sampled (for a hook that sees every token, e.g. one on the final norm)."""
    lens = torch.as_tensor(list(query_lens), dtype=torch.int64)
    if bool((lens < 1).any()):
        raise ValueError("every scheduled request has at least one token")
    return torch.cumsum(lens, 0) - 1


def prune_hidden(hidden: torch.Tensor, num_logits_rows: int, sampled: torch.Tensor | None = None) -> torch.Tensor:
    """The hidden rows that produced a ``[num_logits_rows, V]`` logits batch, in the same order.

    The pre-hook on the logits processor already sees exactly the sampled rows; some configurations
    hand it more (CUDA-graph padding at the end, or every token of the batch): with ``sampled`` (e.g.
    :func:`sampled_row_indices`) those rows are picked, else the padding at the end is cut.
    """
    if hidden.dim() != 2:
        raise ValueError(f"expected hidden states [rows, H], got {tuple(hidden.shape)}")
    if sampled is not None:
        sampled = sampled.to(hidden.device)
        if sampled.numel() != num_logits_rows:
            raise ValueError(f"{sampled.numel()} sampled rows for {num_logits_rows} logits rows")
        return hidden.index_select(0, sampled)
    if hidden.shape[0] < num_logits_rows:
        raise ValueError(f"{hidden.shape[0]} hidden rows for {num_logits_rows} logits rows")
    return hidden[:num_logits_rows]


@dataclass
class SampleOutput:
    """What the recorder holds for one finished sample: ``hidden [T, H]`` (on the capture device),
    ``tokens`` and ``logprobs`` (Python lists, length ``T``)."""

    hidden: torch.Tensor
    tokens: list[int]
    logprobs: list[float]


class StepRecorder:
    """Per-step captures (hidden rows, sample, position, token, log-prob), assembled per sample.

    A step may record a ``(sample, t)`` that a later step records again: vLLM samples the last row of
    every chunk of a chunked prefill and throws the token away until the prompt is complete, and a
    preempted request recomputes its prefill. The last record of each ``(sample, t)`` wins, which is
    the one whose token vLLM kept. Records stay on the capture device until :meth:`take`.
    """

    def __init__(self) -> None:
        self.superseded = 0
        """Records replaced by a later one of the same ``(sample, t)`` (chunked prefill, preemption)."""
        self._hidden: list[torch.Tensor] = []
        self._samples: list[torch.Tensor] = []
        self._positions: list[torch.Tensor] = []
        self._tokens: list[torch.Tensor] = []
        self._logprobs: list[torch.Tensor] = []

    def __len__(self) -> int:
        return sum(int(s.numel()) for s in self._samples)

    def clear(self) -> None:
        self.__init__()

    def record(
        self,
        hidden: torch.Tensor,
        samples: Sequence[int] | torch.Tensor,
        positions: Sequence[int] | torch.Tensor,
        tokens: torch.Tensor,
        logprobs: torch.Tensor,
    ) -> None:
        """One step: row ``i`` of ``hidden [N, H]`` produced token ``tokens[i]`` at index
        ``positions[i]`` of sample ``samples[i]``."""
        samples = torch.as_tensor(samples, dtype=torch.int64).reshape(-1).cpu()
        positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1).cpu()
        n = hidden.shape[0]
        if not samples.numel() == positions.numel() == tokens.numel() == logprobs.numel() == n:
            raise ValueError("hidden rows, samples, positions, tokens and logprobs must have one entry per row")
        self._hidden.append(hidden.detach())
        self._samples.append(samples)
        self._positions.append(positions)
        self._tokens.append(tokens.detach().reshape(-1))
        self._logprobs.append(logprobs.detach().reshape(-1).float())

    def take(self, lengths: dict[int, int]) -> dict[int, SampleOutput]:
        """Remove and return the records of the samples in ``lengths`` (sample → number of tokens vLLM
        returned for it), each as positions ``0 .. T-1`` in order.

        Records at positions ``>= T`` are dropped (a token vLLM computed but did not keep). Raises
        ``RuntimeError`` if a position below ``T`` was never recorded: the engine's bookkeeping and
        vLLM's disagree, and no proof could be built.
        """
        if not lengths:
            return {}
        if not self._samples:
            if any(t > 0 for t in lengths.values()):
                raise RuntimeError(f"no hidden states were recorded for samples {sorted(lengths)}")
            return {s: SampleOutput(torch.empty(0, 0), [], []) for s in lengths}
        samples, positions = torch.cat(self._samples), torch.cat(self._positions)
        hidden, tokens, logprobs = torch.cat(self._hidden), torch.cat(self._tokens), torch.cat(self._logprobs)
        wanted = torch.tensor(sorted(lengths), dtype=torch.int64)
        mine = torch.isin(samples, wanted)
        keep = torch.nonzero(~mine).flatten()
        # Records of other samples stay, compacted into one chunk.
        self._samples, self._positions = [samples[keep]], [positions[keep]]
        dev_keep = keep.to(hidden.device)
        self._hidden, self._tokens = [hidden[dev_keep]], [tokens[dev_keep]]
        self._logprobs = [logprobs[dev_keep]]

        idx = torch.nonzero(mine).flatten()
        s, p = samples[idx], positions[idx]
        limits = torch.zeros(int(wanted.max()) + 1, dtype=torch.int64)
        limits[wanted] = torch.tensor([lengths[int(k)] for k in wanted], dtype=torch.int64)
        inside = p < limits[s]
        idx, s, p = idx[inside], s[inside], p[inside]
        # Last record of each (sample, position): sort by (sample, position, record order) and take the
        # last entry of every run of equal keys.
        width = int(p.max()) + 1 if p.numel() else 1
        key = s * width + p
        order = torch.sort(key, stable=True).indices  # stable: equal keys stay in record order
        key_sorted = key[order]
        last = torch.ones_like(key_sorted, dtype=torch.bool)
        if key_sorted.numel() > 1:
            last[:-1] = key_sorted[1:] != key_sorted[:-1]
        chosen = idx[order[last]]  # ordered by sample, then position
        self.superseded += int(idx.numel() - chosen.numel())
        chosen_samples = samples[chosen]
        dev_chosen = chosen.to(hidden.device)
        hid, tok = hidden[dev_chosen], tokens[dev_chosen].cpu().tolist()
        lps = logprobs[dev_chosen].cpu().tolist()
        out: dict[int, SampleOutput] = {}
        start = 0
        counts = {int(k): int(c) for k, c in zip(*torch.unique_consecutive(chosen_samples, return_counts=True), strict=True)}
        for sample in sorted(lengths):
            t = lengths[sample]
            count = counts.get(sample, 0)
            if count != t:
                raise RuntimeError(
                    f"sample {sample}: vLLM returned {t} tokens but hidden states were recorded for {count} "
                    f"of its positions; is async scheduling, speculative decoding or a second engine on?"
                )
            out[sample] = SampleOutput(hid[start : start + t], tok[start : start + t], lps[start : start + t])
            start += t
        return out


# --------------------------------------------------------------------------------------------------
# Weights.


def checkpoint_weights(checkpoint_dir: Path | str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for every tensor of the ``*.safetensors`` files of an HF checkpoint directory,
    on CPU, one file open at a time (what vLLM's ``model.load_weights`` consumes)."""
    from safetensors import safe_open

    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {checkpoint_dir}")
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not mappings
                yield name, f.get_tensor(name)


# Config fields that fix the shapes of vLLM's preallocated buffers (KV cache, CUDA graphs): a checkpoint
# that changes any of them cannot be loaded in place.
SHAPE_KEYS = (
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "quantization_config",
)


def shape_changes(old: dict, new: dict) -> list[str]:
    """The :data:`SHAPE_KEYS` whose values differ between two ``config.json`` dicts."""
    return [k for k in SHAPE_KEYS if old.get(k) != new.get(k)]
