"""The contract every generation engine meets (torch now, vLLM later).

An engine holds one policy version at a time and turns leases into samples: for each request it draws
``len(seeds)`` completions of ``prompt_ids`` with the project's seeded Gumbel-max sampler
(:mod:`veriroll.toploc.sampling`), so that the coordinator can replay every draw on its own logits. Each
sample comes back with the log-probs the engine computed, and a TOPLOC commitment over the final-norm
hidden states (the LM-head input) of its generated positions.

What the verifier relies on, and every engine must keep:

- the token at generated position ``t`` (0 for the first generated token) of the sample with seed ``s``
  is ``sampling.sample(logits, temperature, s, t)`` on the logits of the position that predicts it;
- ``logprobs`` are ``sampling.token_logprobs`` of those tokens under ``softmax(logits / temperature)``;
- ``hidden`` / ``proof`` cover the hidden state of the position that *produced* each token, i.e. the
  positions ``[P - 1, P + T - 1)`` of a teacher-forced forward over ``prompt + completion``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path

import torch

_U64 = 1 << 64


@dataclass
class GenerationRequest:
    """One lease's worth of work: ``n = len(seeds)`` samples of the same prompt.

    ``seeds`` holds one uint64 per sample, assigned by the coordinator. A sample ends on the first
    token in ``stop_token_ids`` (which is kept in its output) or after ``max_new_tokens`` tokens.
    """

    prompt_ids: list[int]
    seeds: list[int]
    temperature: float
    max_new_tokens: int
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("a generation request needs a non-empty prompt")
        if not self.seeds:
            raise ValueError("a generation request needs at least one seed (one per sample)")
        if any(not 0 <= int(s) < _U64 for s in self.seeds):
            raise ValueError("seeds must be uint64 values in [0, 2**64)")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")

    @property
    def n(self) -> int:
        """Number of samples asked for."""
        return len(self.seeds)


@dataclass
class SampleResult:
    """One generated completion.

    ``logprobs[i]`` is the float32 log-prob of ``token_ids[i]`` under ``softmax(logits / T)``;
    ``finish_reason`` is ``'stop'`` when the last token is a stop token, else ``'length'``;
    ``hidden`` (``[T, H]``, the model's dtype, on CPU) is only kept when the caller asks for it.
    """

    token_ids: list[int]
    logprobs: list[float]
    proof: bytes
    finish_reason: str
    hidden: torch.Tensor | None = None


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot run here (not written yet, or its dependencies are missing)."""


class Engine(abc.ABC):
    """A policy loaded at one version that generates verifiable samples."""

    name: str = "engine"
    version: int | None = None

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Size of the logits' last dimension (the range of valid token ids)."""

    @abc.abstractmethod
    def load(self, checkpoint_dir: Path, version: int) -> None:
        """Swap in the weights of ``checkpoint_dir``; ``version`` changes only once they are live."""

    @abc.abstractmethod
    def generate(
        self, requests: list[GenerationRequest], *, keep_hidden: bool = False
    ) -> list[list[SampleResult]]:
        """Generate every sample of every request; ``result[i][j]`` is sample ``j`` of request ``i``."""

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release the model and any device memory; the engine is unusable afterwards."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
