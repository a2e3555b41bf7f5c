"""The two losses on hand-worked numbers (ratio e clipped to 1.2, and the unclipped side)."""

import math

import pytest
import torch

from llmrl.algorithms.losses import LOSSES, LossSettings, grpo_loss, reinforce_loss

S = LossSettings(clip_low=0.2, clip_high=0.2)


def test_grpo_positive_advantage_clips_the_big_ratio():
    old = torch.tensor([[0.0, 0.0]])
    new = torch.tensor([[1.0, 0.0]], requires_grad=True)  # ratios e and 1
    mask = torch.ones(1, 2)
    pg, stats = grpo_loss(new, old, torch.tensor([1.0]), mask, S)
    # min(e, 1.2) = 1.2 and min(1, 1) = 1 -> row mean 1.1 -> pg -1.1
    assert pg.item() == pytest.approx(-1.1, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(0.5)
    pg.backward()
    # the clipped token gets no gradient; the other gets -(ratio * A) / 2 = -0.5
    assert new.grad[0].tolist() == pytest.approx([0.0, -0.5], abs=1e-6)


def test_grpo_negative_advantage_keeps_the_unclipped_ratio():
    old = torch.zeros(1, 2)
    new = torch.tensor([[1.0, 0.0]])
    pg, stats = grpo_loss(new, old, torch.tensor([-1.0]), torch.ones(1, 2), S)
    # min(-e, -1.2) = -e, min(-1, -1) = -1 -> row mean -(e+1)/2 -> pg (e+1)/2
    assert pg.item() == pytest.approx((math.e + 1) / 2, abs=1e-6)
    assert stats["clip_frac"] == 0.0


def test_grpo_small_ratio_is_clipped_for_negative_advantage():
    new = torch.tensor([[math.log(0.5)]])  # ratio 0.5 < 0.8
    pg, stats = grpo_loss(new, torch.zeros(1, 1), torch.tensor([-2.0]), torch.ones(1, 1), S)
    assert pg.item() == pytest.approx(-(-2.0 * 0.8), abs=1e-6)  # min(-1.0, -1.6) = -1.6
    assert stats["clip_frac"] == 1.0


def test_grpo_masked_tokens_do_not_count_and_rows_are_averaged():
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.0, 0.0, 5.0], [0.1, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    pg, _ = grpo_loss(new, old, torch.tensor([2.0, 1.0]), mask, S)
    # row 0: ratios 1, 1 -> 2; row 1: ratio e^0.1 = 1.10517 -> 1.10517; pg = -(2 + 1.10517) / 2
    assert pg.item() == pytest.approx(-(2 + math.exp(0.1)) / 2, abs=1e-6)


def test_grpo_at_ratio_one_equals_reinforce_gradient_direction():
    torch.manual_seed(0)
    logp = torch.randn(3, 4)
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([1.0, -0.5, 0.3])
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    grpo_loss(a, logp, adv, mask, S)[0].backward()
    reinforce_loss(b, logp, adv, mask, S)[0].backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)  # on-policy, the surrogates have equal gradients


def test_reinforce_by_hand():
    new = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -3.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    pg, stats = reinforce_loss(new, new, torch.tensor([2.0, 1.0]), mask, S)
    # seq logp = (-1.5, -3) -> -mean(2 * -1.5, 1 * -3) = 3
    assert pg.item() == pytest.approx(3.0, abs=1e-6)
    assert stats["clip_frac"] == 0.0


def test_loss_table():
    assert LOSSES["grpo"] is grpo_loss and LOSSES["reinforce"] is reinforce_loss
