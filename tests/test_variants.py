"""The algorithm family on hand-worked numbers: advantage estimators, loss aggregations, token vs
sequence ratios, asymmetric clipping, KL estimators, the overlong penalty, and concatenated rollouts
(dynamic sampling's refill). The run with every variant switched on is in test_e2e.py."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmrl.algorithms.core import (
    ADVANTAGE_ESTIMATORS, KL_ESTIMATORS, batch_zscore_advantages, group_mean_advantages, group_zscore_advantages,
    overlong_penalty, rloo_advantages,
)
from llmrl.algorithms.losses import AGGREGATIONS, LossSettings, grpo_loss, reinforce_loss
from llmrl.models.scoring import sequence_logprobs
from llmrl.rollout.base import Rollout, concat_rollouts, select_rows

R = torch.tensor([2.0, 0.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0])  # two groups of 4: mean 1 (pop std √½), flat 3


def test_group_zscore_by_hand():
    s = math.sqrt(0.5)
    assert group_zscore_advantages(R, 4).tolist() == pytest.approx([1 / s, -1 / s, 0, 0, 0, 0, 0, 0], abs=1e-5)


def test_dr_grpo_group_mean_by_hand():
    assert group_mean_advantages(R, 4).tolist() == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_rloo_by_hand_and_its_known_scale():
    # 2 − (0+1+1)/3 = 4/3;  0 − (2+1+1)/3 = −4/3;  1 − (2+0+1)/3 = 0
    assert rloo_advantages(R, 4).tolist() == pytest.approx([4 / 3, -4 / 3, 0, 0, 0, 0, 0, 0], abs=1e-6)
    torch.manual_seed(0)
    r = torch.rand(12)
    for g in (2, 3, 4, 6):
        # RLOO = G/(G−1) · (r − mean) and z-score = (r − mean)/std: they agree in sign, differ in scale
        assert torch.allclose(rloo_advantages(r, g), g / (g - 1) * group_mean_advantages(r, g), atol=1e-6)
        std = r.view(-1, g).std(1, unbiased=False).repeat_interleave(g)
        assert torch.allclose(group_zscore_advantages(r, g) * (std + 1e-6), group_mean_advantages(r, g), atol=1e-5)


def test_batch_zscore_by_hand():
    # centred [1, −1, 0, 0, 0, 0, 0, 0]: batch std √(2/8) = ½ → [2, −2, 0, …]
    assert batch_zscore_advantages(R, 4).tolist() == pytest.approx([2, -2, 0, 0, 0, 0, 0, 0], abs=1e-5)
    assert set(ADVANTAGE_ESTIMATORS) == {"group_zscore", "group_mean", "rloo", "batch_zscore"}


X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
M = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize("name, expected", [
    ("seq_mean_token_mean", (2 + 4) / 2),  # row means 2 and 4
    ("token_mean", (1 + 2 + 3 + 4) / 4),  # every token alike
    ("seq_mean_token_sum", (6 / 4 + 4 / 4) / 2),  # row sums over the constant 4
])
def test_aggregations_by_hand(name, expected):
    assert AGGREGATIONS[name](X, M, 4).item() == pytest.approx(expected, abs=1e-6)


def test_token_vs_sequence_ratio_differ_by_hand():
    old = torch.zeros(1, 2)
    mask = torch.ones(1, 2)
    adv = torch.tensor([1.0])
    new_t = torch.tensor([[0.3, -0.3]], requires_grad=True)
    pg_t, st_t = grpo_loss(new_t, old, adv, mask, LossSettings(0.2, 0.2, "token"))
    # token ratios e^0.3 = 1.34986 → clipped 1.2, e^−0.3 = 0.74082 kept (A > 0 takes the min): mean 0.97041
    assert pg_t.item() == pytest.approx(-(1.2 + math.exp(-0.3)) / 2, abs=1e-6)
    assert (st_t["clip_frac_high"], st_t["clip_frac_low"]) == (0.5, 0.0)
    new_s = torch.tensor([[0.3, -0.3]], requires_grad=True)
    pg_s, st_s = grpo_loss(new_s, old, adv, mask, LossSettings(0.2, 0.2, "sequence"))
    # GSPO: s = exp(mean(0.3, −0.3)) = 1, unclipped → pg −1, gradient −A·s/|y| = −0.5 per token
    assert pg_s.item() == pytest.approx(-1.0, abs=1e-6) and st_s["clip_frac"] == 0.0
    pg_s.backward()
    assert new_s.grad[0].tolist() == pytest.approx([-0.5, -0.5], abs=1e-6)


def test_sequence_ratio_clips_whole_sequences():
    new = torch.tensor([[0.4, 0.2], [0.0, 0.0]])  # s = e^0.3 for row 0, 1 for row 1
    pg, st = grpo_loss(new, torch.zeros(2, 2), torch.tensor([1.0, 1.0]), torch.ones(2, 2), LossSettings(0.2, 0.2, "sequence"))
    assert pg.item() == pytest.approx(-(1.2 + 1.0) / 2, abs=1e-6)
    assert st["clip_frac_high"] == 0.5  # both tokens of row 0, none of row 1


def test_clip_higher_is_asymmetric():
    up = torch.tensor([[math.log(1.25)]])
    pg_sym, st_sym = grpo_loss(up, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), LossSettings(0.2, 0.2))
    pg_dapo, st_dapo = grpo_loss(up, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), LossSettings(0.2, 0.28))
    assert pg_sym.item() == pytest.approx(-1.2) and st_sym["clip_frac_high"] == 1.0
    assert pg_dapo.item() == pytest.approx(-1.25) and st_dapo["clip_frac_high"] == 0.0
    down = torch.tensor([[math.log(0.75)]])
    pg, st = grpo_loss(down, torch.zeros(1, 1), torch.tensor([-1.0]), torch.ones(1, 1), LossSettings(0.2, 0.28))
    assert pg.item() == pytest.approx(0.8) and (st["clip_frac_low"], st["clip_frac_high"]) == (1.0, 0.0)  # min(−.75, −.8)


def test_reinforce_with_token_mean_and_dr_grpo_sum():
    new = torch.tensor([[-1.0, -2.0, -9.0], [-3.0, -3.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, 1.0])
    tok, _ = reinforce_loss(new, new, adv, mask, LossSettings(aggregate="token_mean"))
    assert tok.item() == pytest.approx(-(2 * -1 + 2 * -2 + 1 * -3 * 3) / 5)  # = 3
    dr, _ = reinforce_loss(new, new, adv, mask, LossSettings(aggregate="seq_mean_token_sum", max_tokens=10))
    assert dr.item() == pytest.approx(-((2 * -3) / 10 + (1 * -9) / 10) / 2)  # = 0.75


def test_kl_estimators_by_hand():
    new, ref = torch.tensor([[-1.0]]), torch.tensor([[-2.0]])
    assert KL_ESTIMATORS["k1"](new, ref).item() == pytest.approx(1.0)
    assert KL_ESTIMATORS["k2"](new, ref).item() == pytest.approx(0.5)
    assert KL_ESTIMATORS["k3"](new, ref).item() == pytest.approx(math.exp(-1) + 1 - 1)
    same = torch.tensor([[-0.7]])
    assert all(KL_ESTIMATORS[k](same, same).item() == 0.0 for k in ("k1", "k2", "k3"))


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([10, 16, 20, 24])
    assert overlong_penalty(lengths, 24, 8, 1.0).tolist() == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(lengths, 24, 0).tolist() == [0.0] * 4


def test_concatenated_rollouts_keep_every_log_prob(tiny_model_dir):
    """Rows from rollouts with different prompt widths and completion lengths, merged by padding,
    score the same tokens with the same log-probs."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    torch.manual_seed(0)

    def part(prompt_len: int, width: int, n: int) -> Rollout:
        ids = torch.randint(3, 100, (n, prompt_len + width))
        attn = torch.ones_like(ids)
        attn[0, :2] = 0  # left padding in row 0
        mask = torch.zeros(n, prompt_len + width - 1)
        mask[:, prompt_len - 1 :] = 1
        with torch.no_grad():
            logp, _ = sequence_logprobs(model, ids, attn, prompt_len)
        return Rollout(ids, attn, mask, logp * mask, None, torch.ones(n, dtype=torch.bool), prompt_len, ["x"] * n, 0)

    a, b = part(5, 3, 2), part(8, 6, 3)
    merged = concat_rollouts([a, select_rows(b, [2, 0])], pad_id=0)
    assert merged.prompt_len == 8 and merged.input_ids.shape == (4, 14)
    assert merged.completion_mask.sum().item() == a.completion_mask.sum().item() + 2 * 6
    with torch.no_grad():
        again, _ = sequence_logprobs(model, merged.input_ids, merged.attention_mask, merged.prompt_len)
    assert torch.allclose(again * merged.completion_mask, merged.logp_old, atol=1e-5)
