"""async_ppo_loss against values worked out by hand in plain Python arithmetic."""

from __future__ import annotations

import math

import pytest
import torch

from veriroll.coordinator.loss import async_ppo_loss

LN = math.log


def k3(r: float) -> float:
    return (r - 1.0) - LN(r)


def logps(log_ratios, base=-1.0):
    """(logp_train with grad, logp_behavior) whose token log-ratios are ``log_ratios``."""
    behavior = torch.full((len(log_ratios), len(log_ratios[0])), base)
    train = (behavior + torch.tensor(log_ratios)).requires_grad_(True)
    return train, behavior


# Two samples, three token slots. Sample 0 (A = +1) has ratios 1.1, 1.5, 0.7; sample 1 (A = -0.5) has
# ratios 0.9, 0.6 and a padded slot.
RATIOS = [[1.1, 1.5, 0.7], [0.9, 0.6, 1.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
ADV = torch.tensor([1.0, -0.5])


def test_mixed_default_matches_hand_computation():
    train, behavior = logps([[LN(r) for r in row] for row in RATIOS])
    loss, m = async_ppo_loss(train, behavior, ADV, MASK, torch.tensor([0, 2]))

    # clip band [0.8, 1.28]. A = +1: min(1.1, 1.1) = 1.1; min(1.5, 1.28) = 1.28; min(0.7, 0.8) = 0.7.
    # A = -0.5: min(-0.45, -0.45) = -0.45; min(-0.3, 0.8 * -0.5 = -0.4) = -0.4.
    total = 1.1 + 1.28 + 0.7 - 0.45 - 0.4
    assert loss.item() == pytest.approx(-total / 5, abs=1e-6)
    assert m["loss"] == pytest.approx(-total / 5, abs=1e-6)
    assert m["approx_kl"] == pytest.approx(sum(k3(r) for r in [1.1, 1.5, 0.7, 0.9, 0.6]) / 5, abs=1e-6)
    assert m["clipfrac"] == pytest.approx(3 / 5)  # 1.5, 0.7 and 0.6 leave the band
    assert m["frac_dropped_stale"] == 0.0
    assert m["mean_staleness"] == pytest.approx(1.0)
    assert m["max_staleness"] == 2.0
    assert m["tokens_used"] == 5.0 and m["samples_used"] == 2.0
    assert m["ratio_mean"] == pytest.approx((1.1 + 1.5 + 0.7 + 0.9 + 0.6) / 5, abs=1e-6)
    assert all(isinstance(v, float) for v in m.values())

    loss.backward()
    # d(ratio * A)/d logp_train = ratio * A where the unclipped term is the min, 0 where the clipped
    # one is; the loss is minus the mean over 5 tokens.
    expected = [[-1.1 / 5, 0.0, -0.7 / 5], [0.45 / 5, 0.0, 0.0]]
    assert train.grad.tolist() == [pytest.approx(row, abs=1e-6) for row in expected]


def test_on_policy_gradient_is_minus_advantage_over_tokens():
    train, behavior = logps([[0.0, 0.0], [0.0, 0.0]])
    loss, m = async_ppo_loss(train, behavior, torch.tensor([2.0, -1.0]), torch.ones(2, 2), torch.zeros(2))
    assert loss.item() == pytest.approx(-(2 + 2 - 1 - 1) / 4)
    assert m["approx_kl"] == 0.0 and m["clipfrac"] == 0.0
    loss.backward()
    assert train.grad.tolist() == [[-0.5, -0.5], [0.25, 0.25]]


def test_stale_samples_are_excluded_from_loss_and_gradient():
    train, behavior = logps([[LN(r) for r in row] for row in RATIOS])
    loss, m = async_ppo_loss(train, behavior, ADV, MASK, torch.tensor([0, 5]), s_max=4)
    assert loss.item() == pytest.approx(-(1.1 + 1.28 + 0.7) / 3, abs=1e-6)
    assert m["frac_dropped_stale"] == 0.5
    assert m["mean_staleness"] == 2.5 and m["max_staleness"] == 5.0
    assert m["tokens_used"] == 3.0 and m["samples_used"] == 1.0
    loss.backward()
    assert train.grad[1].tolist() == [0.0, 0.0, 0.0]

    # Whatever the stale sample holds does not matter.
    other = train.detach().clone()
    other[1] = torch.tensor([5.0, -7.0, 3.0])
    loss_other, _ = async_ppo_loss(other, behavior, ADV, MASK, torch.tensor([0, 5]), s_max=4)
    assert loss_other.item() == loss.item()


def test_staleness_equal_to_s_max_is_still_fresh():
    train, behavior = logps([[0.0], [0.0]])
    _, m = async_ppo_loss(train, behavior, torch.tensor([1.0, 1.0]), torch.ones(2, 1), torch.tensor([4, 5]), s_max=4)
    assert m["frac_dropped_stale"] == 0.5 and m["samples_used"] == 1.0


def test_all_stale_gives_zero_loss_and_zero_gradient():
    train, behavior = logps([[0.3, 0.1]])
    loss, m = async_ppo_loss(train, behavior, torch.tensor([1.0]), torch.ones(1, 2), torch.tensor([9]))
    assert loss.item() == 0.0 and m["frac_dropped_stale"] == 1.0 and m["tokens_used"] == 0.0
    loss.backward()
    assert train.grad.tolist() == [[0.0, 0.0]]


def test_truncated_importance_ratio_is_capped_with_zero_gradient():
    # Ratios 6 (capped to 4) and 2, both with A = -1 and A = +1.
    train, behavior = logps([[LN(6.0), LN(2.0)], [LN(6.0), LN(2.0)]])
    loss, m = async_ppo_loss(train, behavior, torch.tensor([-1.0, 1.0]), torch.ones(2, 2), torch.zeros(2), tis_cap=4.0)
    # A = -1: min(-4, -1.28) = -4 and min(-2, -1.28) = -2. A = +1: min(4, 1.28) = 1.28, min(2, 1.28) = 1.28.
    assert loss.item() == pytest.approx(-(-4 - 2 + 1.28 + 1.28) / 4, abs=1e-6)
    assert m["tis_capped_frac"] == pytest.approx(2 / 4)
    assert m["ratio_max"] == pytest.approx(4.0)
    loss.backward()
    # Only the uncapped A = -1 token (ratio 2, unclipped branch) carries gradient: -(2 * -1) / 4.
    assert train.grad.tolist() == [pytest.approx([0.0, 0.5]), pytest.approx([0.0, 0.0])]


def test_huge_or_infinite_values_do_not_poison_the_gradient():
    behavior = torch.tensor([[-1.0, -1.0, float("-inf")]])
    train = torch.tensor([[500.0, -1.0, 0.0]], requires_grad=True)  # log ratio 501, 0, and a padded slot
    loss, _ = async_ppo_loss(train, behavior, torch.tensor([-1.0]), torch.tensor([[1, 1, 0]]), torch.zeros(1))
    loss.backward()
    assert math.isfinite(loss.item())
    assert loss.item() == pytest.approx(-(-4.0 - 1.0) / 2)
    assert torch.isfinite(train.grad).all()
    assert train.grad.tolist() == [[0.0, 0.5, 0.0]]


def test_soft_staleness_weights_enter_numerator_and_denominator():
    # One token per sample, ratio 1 so per_token = A; staleness 0, 1, 2 and 5 (> s_max 4).
    train, behavior = logps([[0.0]] * 4)
    adv = torch.tensor([1.0, 2.0, 3.0, 4.0])
    staleness = torch.tensor([0, 1, 2, 5])
    ones = torch.ones(4, 1)

    loss, m = async_ppo_loss(train, behavior, adv, ones, staleness, staleness_gamma=0.5)
    # weights 1, 0.5, 0.25, 0
    assert loss.item() == pytest.approx(-(1 * 1 + 0.5 * 2 + 0.25 * 3) / (1 + 0.5 + 0.25))
    assert m["tokens_used"] == pytest.approx(1.75)
    assert m["frac_dropped_stale"] == 0.25

    loss, _ = async_ppo_loss(train, behavior, adv, ones, staleness, staleness_gamma=0.5, staleness_weight_floor=0.3)
    assert loss.item() == pytest.approx(-(1 * 1 + 0.5 * 2 + 0.3 * 3) / (1 + 0.5 + 0.3))

    loss, _ = async_ppo_loss(train, behavior, adv, ones, staleness, staleness_gamma=0.5, staleness_weight_ceiling=0.8)
    assert loss.item() == pytest.approx(-(0.8 * 1 + 0.5 * 2 + 0.25 * 3) / (0.8 + 0.5 + 0.25))

    loss.backward()
    assert train.grad.flatten().tolist() == pytest.approx([-0.8 / 1.55, -1.0 / 1.55, -0.75 / 1.55, 0.0])


def test_sequence_ratio_band_drops_samples_outside_it():
    # Length-normalized sequence ratios: sqrt(3 * 1) ≈ 1.73 (kept), 3 (dropped), 0.4 (dropped; the
    # huge value sits in a padded slot and must not count).
    train, behavior = logps([[LN(3.0), 0.0], [LN(3.0), LN(3.0)], [LN(0.4), 100.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    loss, m = async_ppo_loss(train, behavior, torch.ones(3), mask, torch.zeros(3), seq_ratio_band=2.0)
    assert loss.item() == pytest.approx(-(1.28 + 1.0) / 2, abs=1e-6)
    assert m["frac_dropped_seq_ratio"] == pytest.approx(2 / 3)
    assert m["samples_used"] == 1.0

    # A band of 3.5 ([0.286, 3.5]) keeps all three: tokens 1.28, 1.0, 1.28, 1.28 and min(0.4, 0.8).
    loss, m = async_ppo_loss(train, behavior, torch.ones(3), mask, torch.zeros(3), seq_ratio_band=3.5)
    assert loss.item() == pytest.approx(-(1.28 + 1.0 + 1.28 + 1.28 + 0.4) / 5, abs=1e-6)
    assert m["frac_dropped_seq_ratio"] == 0.0


def test_decoupled_correction_matches_hand_computation():
    # Per token: behaviour → trusted ratio (engine gap), trusted → train ratio (policy change).
    engine = [[2.0, 8.0], [0.5, 1.0]]
    policy = [[1.1, 1.5], [0.7, 1.0]]
    behavior = torch.full((2, 2), -2.0)
    trusted = (behavior + torch.tensor([[LN(r) for r in row] for row in engine])).requires_grad_(True)
    train = (trusted.detach() + torch.tensor([[LN(r) for r in row] for row in policy])).requires_grad_(True)
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, -1.0])

    loss, m = async_ppo_loss(
        train, behavior, adv, mask, torch.zeros(2), correction="decoupled", logp_trusted=trusted, tis_cap=4.0
    )
    # A = +1: 2 * min(1.1, 1.1) = 2.2; min(8, 4) * min(1.5, 1.28) = 5.12.
    # A = -1: 0.5 * min(-0.7, -0.8) = -0.4.
    assert loss.item() == pytest.approx(-(2.2 + 5.12 - 0.4) / 3, abs=1e-5)
    assert m["tis_weight_mean"] == pytest.approx((2 + 4 + 0.5) / 3, abs=1e-5)
    assert m["approx_kl"] == pytest.approx((k3(1.1) + k3(1.5) + k3(0.7)) / 3, abs=1e-6)
    assert m["clipfrac"] == pytest.approx(2 / 3)
    assert m["mismatch_kl"] == pytest.approx((k3(2.0) + k3(8.0) + k3(0.5)) / 3, abs=1e-5)

    loss.backward()
    # Only the first token takes the unclipped branch: -(2 * 1.1 * 1) / 3. The correction is detached.
    assert train.grad.tolist() == [pytest.approx([-2.2 / 3, 0.0], abs=1e-5), pytest.approx([0.0, 0.0])]
    assert trusted.grad is None


def test_mixed_reports_mismatch_kl_when_trusted_logps_are_given():
    train, behavior = logps([[0.0, 0.0]])
    trusted = behavior + torch.tensor([[LN(2.0), 0.0]])
    loss_plain, _ = async_ppo_loss(train, behavior, torch.ones(1), torch.ones(1, 2), torch.zeros(1))
    loss, m = async_ppo_loss(train, behavior, torch.ones(1), torch.ones(1, 2), torch.zeros(1), logp_trusted=trusted)
    assert loss.item() == loss_plain.item()  # 'mixed' only reports it
    assert m["mismatch_kl"] == pytest.approx(k3(2.0) / 2, abs=1e-6)


def test_kl_penalty_adds_k3_to_reference():
    train, behavior = logps([[0.0, 0.0]])
    ref = train.detach() + torch.tensor([[LN(2.0), LN(0.5)]])  # logp_ref − logp_train = ln 2, ln 0.5
    loss, m = async_ppo_loss(
        train, behavior, torch.zeros(1), torch.ones(1, 2), torch.zeros(1), kl_coef=0.1, logp_ref=ref
    )
    # k3 = (2 − 1 − ln 2) + (0.5 − 1 + ln 2) = 0.5 over 2 tokens; the policy term is 0 (A = 0).
    assert m["kl_ref"] == pytest.approx(0.25, abs=1e-6)
    assert loss.item() == pytest.approx(0.1 * 0.25, abs=1e-6)
    loss.backward()
    # d k3 / d logp_train = 1 − exp(logp_ref − logp_train)
    assert train.grad.tolist() == [pytest.approx([0.1 * (1 - 2) / 2, 0.1 * (1 - 0.5) / 2], abs=1e-6)]


def test_bad_arguments_are_refused_with_a_reason():
    train, behavior = logps([[0.0, 0.0]])
    args = (train, behavior, torch.ones(1), torch.ones(1, 2), torch.zeros(1))
    with pytest.raises(ValueError, match="logp_trusted"):
        async_ppo_loss(*args, correction="decoupled")
    with pytest.raises(ValueError, match="correction"):
        async_ppo_loss(*args, correction="vtrace")
    with pytest.raises(ValueError, match="logp_ref"):
        async_ppo_loss(*args, kl_coef=0.1)
    with pytest.raises(ValueError, match="advantages"):
        async_ppo_loss(train, behavior, torch.ones(2), torch.ones(1, 2), torch.zeros(1))
    with pytest.raises(ValueError, match="response_mask"):
        async_ppo_loss(train, behavior, torch.ones(1), torch.ones(1, 3), torch.zeros(1))
