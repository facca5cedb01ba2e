"""A step's data: the groups the trainer may take from the store, and the tensors of one step.

``select_groups`` sorts the queue into fresh and stale by staleness, ``load_groups`` reads the chosen groups
with their samples, ``build_batch`` turns them into one right-padded :class:`RolloutBatch` (group-relative
advantages; groups without a learning signal left out), ``micro_batches`` splits it by length, and
``pack_rows`` lays a micro-batch's samples end to end in one row for a packed forward.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, field

import numpy as np
import torch

from veriroll.coordinator import store as st
from veriroll.coordinator.advantages import group_advantages

__all__ = ["GroupRecord", "PackedRow", "RolloutBatch", "SampleRecord", "build_batch", "load_groups", "micro_batches", "pack_rows",
           "select_groups"]


@dataclass
class SampleRecord:
    token_ids: np.ndarray  # int32 [T], the completion (stop token included)
    logprobs: np.ndarray  # float32 [T], the node's, at the lease temperature
    trusted: np.ndarray | None  # float32 [T], the verifier's, or None when the group was not verified
    reward: float


@dataclass
class GroupRecord:
    group_id: int
    env: str
    policy_version: int
    temperature: float
    tokens: int
    prompt_ids: np.ndarray
    samples: list[SampleRecord] = field(default_factory=list)


@dataclass
class RolloutBatch:
    """B samples, right-padded: ``input_ids`` [B, L] = prompt + completion; per completion token t of
    sample b, ``positions[b, t]`` = P_b − 1 + t is the position whose logits predict it."""

    input_ids: torch.Tensor  # long [B, L]
    attention_mask: torch.Tensor  # long [B, L]
    positions: torch.Tensor  # long [B, T]
    completion_ids: torch.Tensor  # long [B, T]
    response_mask: torch.Tensor  # bool [B, T]
    temperature: torch.Tensor  # float [B]
    logp_behavior: torch.Tensor  # float [B, T]
    logp_trusted: torch.Tensor  # float [B, T] (= behaviour where the group has no trusted log-probs)
    has_trusted: torch.Tensor  # bool [B]
    advantages: torch.Tensor  # float [B]
    staleness: torch.Tensor  # long [B]
    rewards: torch.Tensor  # float [B]

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, rows: torch.Tensor | slice) -> RolloutBatch:
        return RolloutBatch(**{k: getattr(self, k)[rows] for k in self.__dataclass_fields__})

    def to(self, device: torch.device | str) -> RolloutBatch:
        """Every tensor of the batch on ``device`` (the batch itself when they are there already)."""
        if all(getattr(self, k).device == torch.device(device) for k in self.__dataclass_fields__):
            return self
        return RolloutBatch(**{k: getattr(self, k).to(device) for k in self.__dataclass_fields__})


def select_groups(conn: sqlite3.Connection, version: int, s_max: int, limit: int,
                  reference: dict[int, int] | None = None) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Unconsumed, undropped groups as ``(fresh, stale)`` lists of ``(group_id, staleness)``, oldest first.

    ``fresh`` holds at most ``limit`` groups with staleness ≤ ``s_max``; ``stale`` every group beyond it.
    ``reference`` maps group ids to the version their staleness is measured against instead of
    ``version`` (after a resume: the restored checkpoint's version, see :meth:`Trainer.resume`).
    """
    reference = reference or {}
    fresh, stale = [], []
    for gid, made_with in st.queued_group_versions(conn):
        s = max(0, reference[gid] - made_with) if gid in reference else version - made_with
        if s > s_max:
            stale.append((gid, s))
        elif len(fresh) < limit:
            fresh.append((gid, s))
    return fresh, stale


def load_groups(conn: sqlite3.Connection, group_ids: list[int]) -> list[GroupRecord]:
    """The groups ``group_ids`` with their prompts and samples, in the order given."""
    groups = {}
    for gid, (g, samples) in st.groups_with_samples(conn, group_ids).items():
        record = GroupRecord(gid, g["env"], int(g["policy_version"]), float(g["temperature"]), int(g["tokens"]),
                             np.array(st.unpack_i32(g["prompt_ids"])))
        for r in samples:
            trusted = st.unpack_f32(r["trusted_logprobs"])
            record.samples.append(SampleRecord(
                np.array(st.unpack_i32(r["token_ids"])), np.array(st.unpack_f32(r["logprobs"])),
                None if trusted is None else np.array(trusted), float(r["reward"])))
        groups[gid] = record
    missing = [g for g in group_ids if g not in groups]
    if missing:
        raise LookupError(f"groups {missing} are not in the store (or their prompts are missing)")
    return [groups[g] for g in group_ids]


def build_batch(groups: list[GroupRecord], staleness: list[int], *, std_scale: bool = False,
                pad_id: int = 0) -> tuple[RolloutBatch | None, torch.Tensor]:
    """The step's tensors from ``groups`` (with their ``staleness``), and a ``[G]`` bool mask of the groups
    that carry a learning signal; groups whose advantages are all zero are left out of the batch
    (``None`` when no group is left)."""
    keep = []
    advantages = []
    for g in groups:
        rewards = torch.tensor([[s.reward for s in g.samples]], dtype=torch.float32)
        adv, nonzero = group_advantages(rewards, std_scale=std_scale)
        keep.append(bool(nonzero[0]))
        advantages.append(adv[0])
    keep_t = torch.tensor(keep, dtype=torch.bool)
    rows = [(g, s, sample, float(a)) for g, s, adv, k in zip(groups, staleness, advantages, keep, strict=True) if k
            for sample, a in zip(g.samples, adv.tolist(), strict=True)]
    if not rows:
        return None, keep_t
    B = len(rows)
    L = max(len(g.prompt_ids) + len(smp.token_ids) for g, _, smp, _ in rows)
    T = max(1, max(len(smp.token_ids) for _, _, smp, _ in rows))
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    completion = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    behavior = torch.zeros((B, T), dtype=torch.float32)
    trusted = torch.zeros((B, T), dtype=torch.float32)
    has_trusted = torch.zeros(B, dtype=torch.bool)
    for b, (g, _, smp, _) in enumerate(rows):
        P, n = len(g.prompt_ids), len(smp.token_ids)
        input_ids[b, :P] = torch.from_numpy(g.prompt_ids.astype(np.int64))
        input_ids[b, P:P + n] = torch.from_numpy(smp.token_ids.astype(np.int64))
        attention[b, :P + n] = 1
        positions[b, :n] = torch.arange(P - 1, P - 1 + n)
        completion[b, :n] = input_ids[b, P:P + n]
        mask[b, :n] = True
        behavior[b, :n] = torch.from_numpy(smp.logprobs.astype(np.float32))
        if smp.trusted is not None and len(smp.trusted) == n:
            trusted[b, :n] = torch.from_numpy(smp.trusted.astype(np.float32))
            has_trusted[b] = True
        else:
            trusted[b, :n] = behavior[b, :n]
    batch = RolloutBatch(
        input_ids=input_ids, attention_mask=attention, positions=positions, completion_ids=completion,
        response_mask=mask, temperature=torch.tensor([g.temperature for g, _, _, _ in rows], dtype=torch.float32),
        logp_behavior=behavior, logp_trusted=trusted, has_trusted=has_trusted,
        advantages=torch.tensor([a for _, _, _, a in rows], dtype=torch.float32),
        staleness=torch.tensor([s for _, s, _, _ in rows], dtype=torch.long),
        rewards=torch.tensor([smp.reward for _, _, smp, _ in rows], dtype=torch.float32),
    )
    return batch, keep_t


def micro_batches(batch: RolloutBatch, max_tokens: int, *, packing: bool = False) -> list[RolloutBatch]:
    """``batch`` split into micro-batches, each trimmed to its own longest row.

    Padded (``packing=False``): at most ``max_tokens`` padded tokens (rows × longest row; a longer row goes
    alone), rows grouped by length, so heavy-tailed completions no longer pad every short row to the
    longest one. Packed: at most ``max_tokens`` real tokens (prompt + completion) per micro-batch, first-fit
    over the samples longest first (a longer sample goes alone); the forward packs each micro-batch into one
    row (:func:`pack_rows`)."""
    lengths = batch.attention_mask.sum(1)
    chunks: list[list[int]] = []
    if packing:
        loads: list[int] = []
        for row in torch.argsort(lengths, descending=True, stable=True).tolist():
            width = int(lengths[row])
            fit = next((i for i, load in enumerate(loads) if load + width <= max_tokens), None)
            if fit is None:
                chunks.append([row])
                loads.append(width)
            else:
                chunks[fit].append(row)
                loads[fit] += width
    else:
        for row in torch.argsort(lengths, stable=True).tolist():
            width = int(lengths[row])
            if chunks and (len(chunks[-1]) + 1) * width <= max_tokens:
                chunks[-1].append(row)  # rows come shortest first: this row is the chunk's longest
            else:
                chunks.append([row])
    out = []
    for rows in chunks:
        mb = batch.select(torch.tensor(rows))
        L = int(mb.attention_mask.sum(1).max())
        T = max(1, int(mb.response_mask.sum(1).max()))
        out.append(RolloutBatch(
            input_ids=mb.input_ids[:, :L], attention_mask=mb.attention_mask[:, :L], positions=mb.positions[:, :T],
            completion_ids=mb.completion_ids[:, :T], response_mask=mb.response_mask[:, :T],
            temperature=mb.temperature, logp_behavior=mb.logp_behavior[:, :T], logp_trusted=mb.logp_trusted[:, :T],
            has_trusted=mb.has_trusted, advantages=mb.advantages, staleness=mb.staleness, rewards=mb.rewards))
    return out


@dataclass
class PackedRow:
    """The samples of a micro-batch end to end in one row: ``input_ids`` and ``position_ids`` ``[1, N]``, N
    the real tokens, with the position ids restarting at 0 at every sample (what tells the attention where
    one sample ends); ``index[b, t]`` is the column of that row whose logits predict completion token t of
    sample b (the padded ``positions[b, t]`` shifted by the sample's start)."""

    input_ids: torch.Tensor  # long [1, N]
    position_ids: torch.Tensor  # long [1, N]
    index: torch.Tensor  # long [B, T]


def pack_rows(batch: RolloutBatch) -> PackedRow:
    """``batch``'s samples packed into one row (padding dropped), in row order."""
    lengths = batch.attention_mask.sum(1)
    real = batch.attention_mask.bool()
    starts = torch.cumsum(lengths, 0) - lengths
    position_ids = torch.arange(int(lengths.sum()), device=lengths.device) - starts.repeat_interleave(lengths)
    return PackedRow(input_ids=batch.input_ids[real][None], position_ids=position_ids[None],
                     index=batch.positions + starts[:, None])
