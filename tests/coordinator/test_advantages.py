"""group_advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from veriroll.coordinator.advantages import group_advantages


def test_advantage_is_reward_minus_group_mean():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [1.0, 0.0, 0.0, 0.0]])
    adv, nonzero = group_advantages(rewards)
    assert adv.tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0] * 4, [0.75, -0.25, -0.25, -0.25]]
    assert nonzero.tolist() == [True, False, True]


def test_std_scale_divides_by_population_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.3, 0.3, 0.3, 0.3]])
    adv, nonzero = group_advantages(rewards, std_scale=True, eps=1e-6)
    # group 0: mean 0.5, std 0.5; group 1: mean 0.25, std sqrt(0.75 * 0.25)
    s1 = math.sqrt(0.75 * 0.25)
    a0 = 0.5 / (0.5 + 1e-6)
    assert adv[0].tolist() == pytest.approx([a0, -a0, -a0, a0])
    assert adv[1].tolist() == pytest.approx([0.75 / (s1 + 1e-6)] + [-0.25 / (s1 + 1e-6)] * 3, rel=1e-5)
    assert adv[2].tolist() == [0.0] * 4
    assert nonzero.tolist() == [True, True, False]


def test_equal_rewards_with_rounding_error_count_as_zero_groups():
    # The float32 mean of three 0.1s is not exactly 0.1; the group must still be flagged and zeroed.
    adv, nonzero = group_advantages(torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7]]))
    assert nonzero.tolist() == [False, False]
    assert adv.abs().sum().item() == 0.0


def test_single_sample_groups_are_all_zero():
    adv, nonzero = group_advantages(torch.tensor([[0.4], [1.0]]), std_scale=True)
    assert adv.tolist() == [[0.0], [0.0]] and nonzero.tolist() == [False, False]


def test_rewards_must_be_groups_by_samples():
    with pytest.raises(ValueError, match="groups"):
        group_advantages(torch.tensor([1.0, 0.0]))
