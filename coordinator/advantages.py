"""Group-relative advantages (GRPO without a critic; Dr.GRPO's default of no std division).

For a group of ``n`` completions of one prompt with rewards r_1..r_n:

    A_i = r_i − mean(r)                      (default)
    A_i = (r_i − mean(r)) / (std(r) + eps)   (std_scale=True; population std)

A group whose completions all scored the same teaches nothing (every A_i is 0): it is flagged so the
caller can skip it and count it, rather than spend a training step on zeros.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages"]


def group_advantages(
    rewards: torch.Tensor, *, std_scale: bool = False, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages ``[G, n]`` for rewards ``[G, n]`` (G groups of n), and a ``[G]`` bool mask of groups
    with any non-zero advantage.

    A group counts as all-zero when every |r_i − mean(r)| ≤ eps (floating-point means of equal
    rewards need not be exact); its advantages are set to exactly 0.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples_per_group], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    nonzero = centered.abs().amax(dim=1) > eps
    adv = centered
    if std_scale:
        adv = centered / (rewards.std(dim=1, correction=0, keepdim=True) + eps)
    adv = torch.where(nonzero[:, None], adv, torch.zeros_like(adv))
    return adv, nonzero
