"""Training-inference mismatch correction (rollout_engine=vllm): hand-worked weights and losses, and
the update's invariants. None of this needs vLLM: the engine's log-probs are plain tensors here."""

import math

import pytest
import torch
from helpers import kept_logits

from llmrl.algorithms.core import mismatch_weights
from llmrl.algorithms.losses import LossSettings, grpo_loss, reinforce_loss
from llmrl.config import load_config
from llmrl.errors import ConfigError
from llmrl.training.update import UpdateBatch, UpdateSettings, add_diff, policy_update

OLD = torch.tensor([[-1.1, -0.3, -2.7], [-0.4, -1.3, -0.2], [-2.0, -0.6, -0.1]])
ENGINE = torch.tensor([[-0.9, -0.7, -3.9], [-1.3, -2.0, -0.5], [-1.2, 0.3, -5.1]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# log-ratios OLD − ENGINE: [-0.2, 0.4, 1.2], [0.9, 0.7, 0.3], [-0.8, -0.9, (5.0 masked)]


def test_token_tis_truncates_the_weight_on_top_of_the_loss_ratio():
    w = mismatch_weights(OLD - ENGINE, MASK, "token_tis", 2.0)
    expected = [[math.exp(-0.2), math.exp(0.4), 2.0], [2.0, 2.0, math.exp(0.3)], [math.exp(-0.8), math.exp(-0.9), 1.0]]
    assert torch.allclose(w, torch.tensor(expected), atol=1e-6)


def test_token_tis_in_ratio_truncates_the_ratio_itself():
    """old_logprobs=engine with grpo: ρ·w = min(ρ, C), so w = min(ρ, C)/ρ."""
    w = mismatch_weights(OLD - ENGINE, MASK, "token_tis", 2.0, in_ratio=True)
    expected = [[1.0, 1.0, 2.0 / math.exp(1.2)], [2.0 / math.exp(0.9), 2.0 / math.exp(0.7), 1.0], [1.0, 1.0, 1.0]]
    assert torch.allclose(w, torch.tensor(expected), atol=1e-6)
    rho = torch.exp(OLD - ENGINE)
    assert torch.allclose((rho * w)[MASK > 0], rho.clamp(max=2.0)[MASK > 0], atol=1e-6)


def test_sequence_mask_drops_rows_whose_geometric_mean_ratio_leaves_the_band():
    # row means: 0.4667 (kept), 0.6333 (kept: below log 2 = 0.6931), −0.85 (dropped; the masked 5.0 is ignored)
    w = mismatch_weights(OLD - ENGINE, MASK, "sequence_mask", 2.0)
    assert w.tolist() == [[1.0] * 3, [1.0] * 3, [0.0] * 3]
    # a tighter cap (log 1.8 = 0.5878) drops the second row too
    assert mismatch_weights(OLD - ENGINE, MASK, "sequence_mask", 1.8)[:, 0].tolist() == [1.0, 0.0, 0.0]


def test_no_correction_is_all_ones():
    assert torch.equal(mismatch_weights(OLD - ENGINE, MASK, "none", 2.0), torch.ones(3, 3))


def test_weighted_grpo_token_value_and_gradient():
    """One token, ρ = e^0.1, A = −1.5, weight 0.6: term = 0.6·ρ·A (ρ inside the clip range), pg = −term."""
    logp_new = torch.tensor([[-0.7]], requires_grad=True)
    logp_old = torch.tensor([[-0.8]])
    pg, _ = grpo_loss(logp_new, logp_old, torch.tensor([-1.5]), torch.ones(1, 1), LossSettings(), torch.tensor([[0.6]]))
    assert pg.item() == pytest.approx(0.6 * 1.5 * math.exp(0.1), rel=1e-6)  # 0.994654
    pg.backward()
    assert logp_new.grad.item() == pytest.approx(0.6 * 1.5 * math.exp(0.1), rel=1e-6)


def test_engine_mode_tis_gives_the_truncated_ratio_value_and_its_gradient():
    """ρ = π_θ/π_engine = e^1.2 > C = 2 with A = −0.7: the unclipped branch; with w = min(ρ, C)/ρ the term
    is C·A = −1.4 and d pg / d logp_new = −C·A = 1.4 (TIS keeps a bounded gradient)."""
    logp_new = torch.tensor([[-0.3]], requires_grad=True)
    logp_engine = torch.tensor([[-1.5]])
    w = mismatch_weights(logp_new.detach() - logp_engine, torch.ones(1, 1), "token_tis", 2.0, in_ratio=True)
    pg, _ = grpo_loss(logp_new, logp_engine, torch.tensor([-0.7]), torch.ones(1, 1), LossSettings(), w)
    assert pg.item() == pytest.approx(1.4, rel=1e-6)
    pg.backward()
    assert logp_new.grad.item() == pytest.approx(1.4, rel=1e-6)


def test_weighted_reinforce_scales_each_token():
    logp = torch.tensor([[-0.5, -1.25, -0.75]])
    w = torch.tensor([[0.5, 2.0, 1.0]])
    pg, _ = reinforce_loss(logp, logp, torch.tensor([0.3]), torch.ones(1, 3), LossSettings(), w)
    assert pg.item() == pytest.approx(-0.3 * (0.5 * -0.5 + 2.0 * -1.25 + -0.75) / 3, rel=1e-6)


def test_add_diff_sums_masked_absolute_differences():
    s, n, m = add_diff(None, OLD, ENGINE, MASK)
    assert n == 8
    assert s == pytest.approx(0.2 + 0.4 + 1.2 + 0.9 + 0.7 + 0.3 + 0.8 + 0.9, abs=1e-5)
    assert m == pytest.approx(1.2, abs=1e-6)
    s2, n2, m2 = add_diff((s, n, m), OLD[:1], ENGINE[:1], MASK[:1])
    assert (n2, m2) == (11, m) and s2 == pytest.approx(s + 1.8, abs=1e-5)


class Linear(torch.nn.Module):
    """A tiny 'causal LM' whose logits depend only on the current token (enough for the update's maths)."""

    def __init__(self, vocab=7):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(vocab, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, **kw):
        logits = self.emb(input_ids)
        return type("Out", (), {"logits": kept_logits(logits, logits_to_keep)})()


def _batch(engine_shift: float) -> UpdateBatch:
    torch.manual_seed(0)
    n, length, prompt = 6, 7, 3
    ids = torch.randint(0, 7, (n, length))
    mask = torch.zeros(n, length - 1)
    mask[:, prompt - 1:] = 1.0
    model = Linear()
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0] * mask
    return UpdateBatch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=mask, logp_old=logp,
                       logp_ref=None, adv=torch.tensor([0.9, -0.4, -0.5, 1.1, 0.2, -1.3]), group=torch.arange(n) // 3,
                       prompt_len=prompt, lengths=mask.sum(1), logp_engine=(logp + engine_shift) * mask)


def _update(batch: UpdateBatch, mismatch: str, engine_old: bool = False) -> torch.Tensor:
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = UpdateSettings(algo="grpo", loss=LossSettings(), ppo_epochs=1, minibatch_size=3, grad_accum_steps=2, kl_coef=0.0,
                       kl_estimator="k3", max_grad_norm=100.0, mismatch=mismatch, mismatch_cap=2.0, engine_old=engine_old)
    stats = policy_update(model, opt, batch, s, torch.Generator().manual_seed(1))
    return model.emb.weight.detach().clone(), stats


def test_correction_without_mismatch_changes_nothing_and_with_mismatch_it_does():
    plain, _ = _update(_batch(0.0), "none")
    same, _ = _update(_batch(0.0), "token_tis")  # engine = trainer: every weight is 1
    assert torch.equal(plain, same)
    shifted, _ = _update(_batch(-0.3), "token_tis")  # engine 0.3 nats below: weights e^0.3 on every token
    assert (shifted - plain).abs().max() > 1e-4


def test_engine_old_logs_the_first_window_difference():
    batch = _batch(-0.25)
    batch.logp_old = batch.logp_engine  # old_logprobs=engine: logp_old is the engine's
    _, stats = _update(batch, "none", engine_old=True)
    total, tokens, biggest = stats.engine_diff
    assert tokens == 6 * 4  # the first window holds both minibatches (grad_accum_steps 2): all 24 tokens
    assert total / tokens == pytest.approx(0.25, abs=1e-5) and biggest == pytest.approx(0.25, abs=1e-5)


@pytest.mark.parametrize("overrides, field", [
    ({"mismatch_correction": "token_tis"}, "mismatch_correction"),  # needs the vllm engine
    ({"old_logprobs": "engine"}, "old_logprobs"),
    ({"rollout_engine": "vllm", "mismatch_correction": "tis"}, "mismatch_correction"),
    ({"rollout_engine": "vllm", "mismatch_cap": 1.0}, "mismatch_cap"),
])
def test_bad_correction_settings_are_one_error(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, {"model": "smollm2-135m-instruct", **overrides})
