"""Minibatching, gradient accumulation, warmup and skipping of non-finite updates."""

from types import SimpleNamespace

import pytest
import torch
from helpers import kept_logits

from llmrl.algorithms.core import masked_mean_rows
from llmrl.algorithms.losses import LossSettings
from llmrl.training.update import (
    UpdateBatch,
    UpdateSettings,
    UpdateStats,
    accumulation_windows,
    policy_update,
    trim_to_completions,
    warmup_factor,
)


class BigramLM(torch.nn.Module):
    """logits[t] = W[token t]: small enough to check gradients by hand."""

    def __init__(self, vocab: int = 6):
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(vocab, vocab) * 0.1)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        logits = self.w[input_ids]  # [N, L, V]
        return SimpleNamespace(logits=kept_logits(logits, logits_to_keep))


def make_batch(n: int = 6, prompt_len: int = 2, gen: int = 3) -> UpdateBatch:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 6, (n, prompt_len + gen), generator=g)
    mask = torch.zeros(n, prompt_len + gen - 1)
    mask[:, prompt_len - 1 :] = 1
    mask[0, -1] = 0  # one shorter completion
    return UpdateBatch(
        input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=mask,
        logp_old=torch.zeros(n, prompt_len + gen - 1), logp_ref=torch.zeros(n, prompt_len + gen - 1),
        adv=torch.linspace(-1, 1, n), group=torch.arange(n), prompt_len=prompt_len, lengths=mask.sum(1),
    )


def run(model, batch, opt, *, algo="reinforce", epochs=1, mb=2, accum=1, kl=0.0, seed=0) -> UpdateStats:
    batch.lengths = batch.completion_mask.sum(1)  # a test may have edited the mask
    settings = UpdateSettings(algo=algo, loss=LossSettings(), ppo_epochs=epochs, minibatch_size=mb, grad_accum_steps=accum,
                              kl_coef=kl, kl_estimator="k3", max_grad_norm=1e9)
    return policy_update(model, opt, batch, settings, torch.Generator().manual_seed(seed))


def test_trim_to_completions_drops_unscored_tail():
    mb = {"input_ids": torch.arange(12).view(2, 6), "completion_mask": torch.tensor([[0, 1, 1, 0, 0], [0, 1, 0, 0, 0.0]]),
          "logp_old": torch.ones(2, 5), "adv": torch.ones(2)}
    out = trim_to_completions(mb, prompt_len=2)
    assert out["input_ids"].shape == (2, 4) and out["completion_mask"].shape == (2, 3) and out["logp_old"].shape == (2, 3)
    assert out["adv"].shape == (2,)


def test_warmup_is_linear_from_one_over_warmup():
    assert [warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [warmup_factor(s, 3) for s in range(4)] == [1 / 3, 2 / 3, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_optimizer_steps_with_accumulation_remainder():
    model = BigramLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # 3 minibatches per epoch, 6 in all, accumulated across epochs as the starter: windows 2 + 2 + 2
    stats = run(model, make_batch(n=6), opt, mb=2, accum=2, epochs=2)
    assert stats.optimizer_steps == 3 and stats.skipped_updates == 0 and stats.empty_minibatches == 0
    # 5 minibatches per epoch (the last of one row), 15 in all, windows of 4: 4 + 4 + 4 + a flushed 3
    stats = run(BigramLM(), make_batch(n=9), torch.optim.SGD(BigramLM().parameters(), lr=0.1), mb=2, accum=4, epochs=3)
    assert stats.optimizer_steps == 4


def test_accumulation_windows_skip_minibatches_without_tokens():
    lengths = torch.tensor([3, 0, 0, 5, 0, 2, 0])  # scored tokens of 7 rows
    mbs = [torch.tensor(r) for r in ([1, 2], [0, 1], [4, 6], [3], [2, 4], [5, 6], [6])]
    windows, empty = accumulation_windows(mbs, lengths, 2)
    assert empty == 4  # [1, 2], [4, 6], [2, 4], [6] score nothing
    assert [[m.tolist() for m in w] for w in windows] == [[[0, 1], [3]], [[5, 6]]]
    windows, empty = accumulation_windows(mbs, torch.zeros(7), 3)
    assert windows == [] and empty == 7


def test_update_without_completion_tokens_runs_no_forward_and_no_step():
    """An all-masked update (e.g. overlong_filter removed every completion) leaves AdamW alone: no
    forward, no optimizer step, its momentum from the last real step does not move the weights."""
    model = BigramLM()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    run(model, make_batch(n=4), opt, mb=2, accum=1)  # a real step: AdamW now has momentum
    w0 = model.w.detach().clone()
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    batch = make_batch(n=4)
    batch.completion_mask.zero_()
    stats = run(model, batch, opt, mb=2, accum=1, epochs=2)
    assert stats.optimizer_steps == 0 and stats.empty_minibatches == 4 and stats.skipped_updates == 0
    assert calls == [] and torch.equal(model.w.detach(), w0)
    # seed 0 draws minibatches [0, 1] and [3, 2]: the first scores nothing and is skipped
    batch = make_batch(n=4)
    batch.completion_mask[[0, 1]] = 0
    assert torch.randperm(4, generator=torch.Generator().manual_seed(0))[:2].tolist() == [0, 1]
    stats = run(model, batch, opt, mb=2, accum=1, epochs=1, seed=0)
    assert stats.empty_minibatches == 1
    assert stats.optimizer_steps == 1


def test_accumulated_gradient_equals_the_full_batch_gradient():
    batch = make_batch(n=6)
    model = BigramLM()
    w0 = model.w.detach().clone()
    run(model, batch, torch.optim.SGD(model.parameters(), lr=1.0), mb=2, accum=3)  # one step over 3 minibatches

    ref = BigramLM()
    logits = ref.w[batch.input_ids]
    logp = torch.log_softmax(logits[:, 1:-1], -1).gather(-1, batch.input_ids[:, 2:, None]).squeeze(-1)  # [6, 3]
    pg = -(batch.adv * masked_mean_rows(logp, batch.completion_mask[:, 1:])).mean()
    pg.backward()
    assert torch.allclose(model.w.detach(), w0 - ref.w.grad, atol=1e-6)


def test_first_grpo_epoch_is_on_policy_and_kl_is_zero_at_the_reference():
    batch = make_batch(n=4)
    model = BigramLM()
    with torch.no_grad():
        logits = model.w[batch.input_ids]
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    batch.logp_old = logp * batch.completion_mask
    batch.logp_ref = batch.logp_old.clone()
    stats = run(model, batch, torch.optim.SGD(model.parameters(), lr=0.0), algo="grpo", mb=4, kl=0.5)
    assert stats.clip_frac == 0.0 and stats.kl == pytest.approx(0.0, abs=1e-7)


def test_non_finite_loss_skips_the_update_and_keeps_parameters():
    batch = make_batch(n=4)
    batch.adv[1] = float("nan")
    model = BigramLM()
    w0 = model.w.detach().clone()
    stats = run(model, batch, torch.optim.SGD(model.parameters(), lr=1.0), mb=4, accum=1)
    assert stats.skipped_updates == 1 and stats.optimizer_steps == 0
    assert torch.equal(model.w.detach(), w0)
    assert model.w.grad is None  # nothing left over for the next step


@pytest.mark.parametrize("budget", [2**62, 9])  # 9 padded tokens: each 5-row minibatch runs in pieces
def test_kl_term_follows_the_loss_aggregation_with_kl_agg_loss_agg(budget):
    """kl_agg=loss_agg: the KL term is aggregated like the policy term (TRL, verl); kl_agg=token_mean (the
    seed) keeps one token mean. With zero advantages the gradient is kl_coef·∇KL alone; rows of 3, 2, 1
    completion tokens (not a power of two, 5 rows a minibatch) make the two aggregations differ, and a
    token budget that splits the minibatch must give the same gradient (pieces weighted by rows, not tokens)."""
    from llmrl.algorithms.core import KL_ESTIMATORS
    from llmrl.algorithms.losses import AGGREGATIONS
    from llmrl.models.scoring import sequence_logprobs

    batch = make_batch(n=5, prompt_len=2, gen=3)
    batch.completion_mask[1, -1] = 0
    batch.completion_mask[2, -2:] = 0
    batch.adv = torch.zeros(5)
    batch.logp_ref = -torch.linspace(0.3, 2.9, 20).view(5, 4) * batch.completion_mask
    batch.lengths = batch.completion_mask.sum(1)
    grads = {}
    for agg in ("token_mean", "loss_agg"):
        model = BigramLM()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the step is a no-op: read the gradient it used
        settings = UpdateSettings(algo="reinforce", loss=LossSettings(), ppo_epochs=1, minibatch_size=5, grad_accum_steps=1,
                                  kl_coef=0.37, kl_estimator="k3", max_grad_norm=1e9, kl_agg=agg, token_budget=budget)
        grad_seen = []
        opt.step = lambda: grad_seen.append(model.w.grad.clone())  # noqa: B023
        policy_update(model, opt, batch, settings, torch.Generator().manual_seed(0))
        expected_model = BigramLM()
        logp = sequence_logprobs(expected_model, batch.input_ids, batch.attention_mask, batch.prompt_len)[0]
        kl_t = KL_ESTIMATORS["k3"](logp, batch.logp_ref)
        m = batch.completion_mask
        by_hand = (kl_t * m).sum() / m.sum() if agg == "token_mean" else ((kl_t * m).sum(1) / m.sum(1)).mean()
        assert agg == "token_mean" or torch.allclose(by_hand, AGGREGATIONS["seq_mean_token_mean"](kl_t, m, 1))
        (0.37 * by_hand).backward()
        # fp32 sums of ≤ 15 terms in another order: a few ulps of the gradient's scale
        torch.testing.assert_close(grad_seen[0], expected_model.w.grad, rtol=0, atol=1e-6 * expected_model.w.grad.abs().max().item())
        grads[agg] = grad_seen[0]
    assert (grads["token_mean"] - grads["loss_agg"]).abs().max() > 1e-2 * grads["loss_agg"].abs().max()
