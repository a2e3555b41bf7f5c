"""Core tensor functions against numbers worked out by hand."""

import math

import pytest
import torch

from llmrl.algorithms.core import (
    ADVANTAGE_ESTIMATORS,
    completion_mask,
    group_zscore_advantages,
    kl_k3,
    masked_mean,
    masked_mean_rows,
    normalize_advantages,
    token_entropy,
    token_logprobs,
    zero_spread_fraction,
)


def test_token_logprobs_scores_the_next_token():
    # position 0: logits [0, 0] -> p(token 1) = 0.5; position 1: [ln 3, 0] -> p(token 0) = 0.75
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [5.0, -5.0]]])  # [1, 3, 2]
    ids = torch.tensor([[0, 1, 0]])
    out = token_logprobs(logits, ids)
    assert out.shape == (1, 2)
    assert torch.allclose(out, torch.tensor([[math.log(0.5), math.log(0.75)]]), atol=1e-6)


def test_token_entropy_uniform_and_peaked():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]])
    ent = token_entropy(logits)
    assert torch.allclose(ent, torch.tensor([[math.log(4.0), 0.0]]), atol=1e-5)


EOS = 2  # pad == eos, as in the embedded model


def test_completion_mask_includes_eos_and_ignores_padding_after_it():
    ids = torch.tensor([
        [7, 8, 9, 5, EOS, EOS, EOS],  # ends after one token: scores 5 and the EOS
        [7, 8, 9, 5, 6, 7, 8],  # truncated: every generated token counts
        [7, 8, 9, EOS, EOS, EOS, EOS],  # immediate EOS: only the EOS counts
        [EOS, EOS, 9, 5, EOS, EOS, EOS],  # left padding made of pad==eos tokens changes nothing
    ])
    mask, ended = completion_mask(ids, prompt_len=3, eos_token_ids=[EOS])
    assert mask.tolist() == [
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 1],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
    ]
    assert ended.tolist() == [True, False, True, True]


def test_completion_mask_several_eos_ids():
    ids = torch.tensor([[1, 1, 4, 11, 3, 10], [1, 1, 4, 10, 3, 3]])
    mask, ended = completion_mask(ids, prompt_len=2, eos_token_ids=[10, 11])
    assert mask.tolist() == [[0, 1, 1, 0, 0], [0, 1, 1, 0, 0]]
    assert ended.tolist() == [True, True]


def test_masked_means():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.allclose(masked_mean_rows(x, m), torch.tensor([1.5, 0.0]))
    assert masked_mean(x, m).item() == pytest.approx(1.5, abs=1e-6)
    m2 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]])
    assert masked_mean(x, m2).item() == pytest.approx((1 + 5 + 6) / 3, abs=1e-6)  # token mean, not row mean


def test_kl_k3_values():
    new = torch.log(torch.tensor([[0.5, 0.3]]))
    ref = torch.log(torch.tensor([[0.25, 0.3]]))
    kl = kl_k3(new, ref)
    # delta = ln(0.25/0.5) = -ln 2: exp(delta) - delta - 1 = 0.5 + ln 2 - 1
    assert kl[0, 0].item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert kl[0, 1].item() == 0.0


def test_kl_k3_nonnegative_and_clamped():
    torch.manual_seed(0)
    new, ref = torch.randn(50, 7) * 5, torch.randn(50, 7) * 5
    assert (kl_k3(new, ref) >= 0).all()
    big = kl_k3(torch.tensor([[0.0]]), torch.tensor([[50.0]]))  # delta clamped to 20
    assert big.item() == pytest.approx(math.exp(20) - 21, rel=1e-6)
    assert torch.isfinite(kl_k3(torch.tensor([[-1e4]]), torch.tensor([[0.0]]))).all()


def test_group_advantages_by_hand():
    adv = group_zscore_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    std = math.sqrt(0.1875)  # population std of (1, 0, 0, 0)
    expected = [0.75 / (std + 1e-6)] + [-0.25 / (std + 1e-6)] * 3
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)


def test_group_advantages_are_per_group_and_zero_spread_gives_zero():
    adv = group_zscore_advantages(torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 1.0]), 3)
    s = math.sqrt(1 / 6)  # population std of (0, 0.5, 1)
    assert torch.allclose(adv, torch.tensor([0, 0, 0, -0.5 / (s + 1e-6), 0, 0.5 / (s + 1e-6)]), atol=1e-6)
    assert torch.isfinite(adv).all()


def test_group_advantages_edge_cases():
    assert group_zscore_advantages(torch.tensor([1.0, 2.0]), 1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="groups of 4"):
        group_zscore_advantages(torch.ones(6), 4)


TASK_REWARD_LEVELS = (0.0, 0.1, 0.2, 0.3, 1.0, 1.1, 1.2, 1.3)  # every total format_copy and math_hard can give
GROUP_SIZES = (2, 3, 4, 5, 6, 7, 8, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_equal_reward_groups_get_exactly_zero(name, dtype):
    estimator = ADVANTAGE_ESTIMATORS[name]
    for g in GROUP_SIZES:
        for level in TASK_REWARD_LEVELS:
            # one zero-spread group between two groups with spread, so batch-wide statistics are non-trivial
            rewards = torch.tensor([0.0] * (g - 1) + [1.3] + [level] * g + [1.1] + [0.1] * (g - 1), dtype=dtype)
            adv = estimator(rewards, g)
            assert adv.dtype == dtype
            assert adv[g : 2 * g].tolist() == [0.0] * g, (name, g, level)
            assert (adv[:g] != 0).all() and (adv[2 * g :] != 0).all(), (name, g, level)
            alone = estimator(torch.full((g,), level, dtype=dtype), g)
            assert alone.tolist() == [0.0] * g, (name, g, level)
            normalized = normalize_advantages(adv, g)
            assert normalized[g : 2 * g].tolist() == [0.0] * g, (name, g, level)


def test_naive_zscore_of_equal_fp32_rewards_is_not_zero():
    """The inputs above stress the bug: the plain formula gives ±0.1 to six equal rewards of 1.3 in fp32."""
    grouped = torch.tensor([[1.3] * 6])
    naive = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, unbiased=False, keepdim=True) + 1e-6)
    assert naive.abs().min().item() > 0.05
    assert group_zscore_advantages(grouped.view(-1), 6).tolist() == [0.0] * 6


def test_normalize_advantages_and_zero_spread_fraction():
    out = normalize_advantages(torch.tensor([1.0, 3.0]))
    assert torch.allclose(out, torch.tensor([-1.0, 1.0]), atol=1e-5)
    assert normalize_advantages(torch.zeros(4)).tolist() == [0.0] * 4
    assert zero_spread_fraction(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]), 2) == pytest.approx(2 / 3)


@pytest.mark.gpu
def test_reward_shaping_terms_are_on_the_cpu_for_a_cuda_rollout():
    """The rewards live on the CPU; a rollout on the GPU must not put a CUDA penalty into them (this
    crashed `--overlong_buffer > 0` on CUDA: adding a CUDA tensor to a CPU one)."""
    from llmrl.config import load_config
    from llmrl.rollout import Rollout
    from types import SimpleNamespace

    from llmrl.tasks.base import Reward
    from llmrl.training.step import Sampled, shaped_rewards

    cfg = load_config(None, {"max_new_tokens": 5, "overlong_buffer": 2, "kl_in_reward": True, "kl_coef": 0.3})
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0.0]], device="cuda")
    r = Rollout(input_ids=torch.zeros(2, 6, dtype=torch.long, device="cuda"), attention_mask=torch.ones(2, 6, device="cuda"),
                completion_mask=mask, logp_old=-0.1 * mask, logp_ref=-0.3 * mask, ended=torch.tensor([False, True], device="cuda"),
                prompt_len=1, texts=["", ""], prompts_truncated=0)
    run = SimpleNamespace(cfg=cfg, episodes=SimpleNamespace(limits=SimpleNamespace(episode_tokens=5)))
    sampled = Sampled([None, None], r, [Reward(0.0, {}), Reward(0.0, {})])
    rewards = shaped_rewards(run, sampled)
    assert rewards.device.type == "cpu"
    assert [x.components["overlong"] for x in sampled.rewards] == pytest.approx([-1.0, 0.0])
