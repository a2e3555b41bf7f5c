"""Training-inference mismatch correction (rollout_engine=vllm): hand-worked weights and losses, and
the update's invariants. None of this needs vLLM: the engine's log-probs are plain tensors here."""

import math

import pytest
import torch
from helpers import kept_logits

from llmrl.algorithms.core import MISMATCH_WEIGHTS, mismatch_loss_mask, mismatch_weights
from llmrl.algorithms.losses import LossSettings, grpo_loss, reinforce_loss
from llmrl.config import MISMATCH_CORRECTIONS, load_config
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


def test_geo_mean_mask_drops_rows_whose_geometric_mean_ratio_leaves_the_band():
    # row means: 0.4667 (kept), 0.6333 (kept: below log 2 = 0.6931), −0.85 (dropped; the masked 5.0 is ignored)
    w = mismatch_weights(OLD - ENGINE, MASK, "geo_mean_mask", 2.0)
    assert w.tolist() == [[1.0] * 3, [1.0] * 3, [0.0] * 3]
    # a tighter cap (log 1.8 = 0.5878) drops the second row too
    assert mismatch_weights(OLD - ENGINE, MASK, "geo_mean_mask", 1.8)[:, 0].tolist() == [1.0, 0.0, 0.0]


# Five completions of 3, 2, 3, 1 and 3 tokens; X holds x_t = log π_old − log π_engine (9.0 / −7.0: masked, ignored).
# With C = 2 (log C = 0.693147):
#   row  x                    Σx = log r   r = Πe^x   mean x     geo band [−0.693, 0.693]   TRL r ≤ C
#   0    0.3 −0.1  0.2         0.4         1.491825    0.133333  in                          yes
#   1    0.5  0.4  —           0.9         2.459603    0.45      in                          no (high)
#   2   −0.3 −0.5 −0.2        −1.0         0.367879   −0.333333  in                          yes (no lower bound)
#   3   −0.9  —    —          −0.9         0.406570   −0.9       out: below 1/C              yes
#   4    0.8  0.7  0.9         2.4        11.023176    0.8       out: above C                no (high)
X = torch.tensor([[0.3, -0.1, 0.2], [0.5, 0.4, 9.0], [-0.3, -0.5, -0.2], [-0.9, 9.0, -7.0], [0.8, 0.7, 0.9]])
LENGTHS = torch.tensor([3, 2, 3, 1, 3])
X_MASK = (torch.arange(3)[None, :] < LENGTHS[:, None]).float()
e = math.exp


def rows(*values):
    return torch.tensor([[v] * 3 for v in values])


@pytest.mark.parametrize("mode, in_ratio, expected", [
    # TRL token_truncate / verl rollout_is=token: min(e^x_t, 2) on completion tokens (e^0.7 = 2.0138: capped),
    # 1 off them
    ("token_tis", False, torch.tensor([[e(0.3), e(-0.1), e(0.2)], [e(0.5), e(0.4), 1.0], [e(-0.3), e(-0.5), e(-0.2)],
                                       [e(-0.9), 1.0, 1.0], [2.0, 2.0, 2.0]])),
    # the loss's own ratio ρ = e^x already: min(ρ, 2)/ρ, below 1 only where ρ > 2
    ("token_tis", True, torch.tensor([[1.0] * 3] * 4 + [[2 / e(0.8), 2 / e(0.7), 2 / e(0.9)]])),
    # TRL sequence_truncate / verl rollout_is=sequence: min(r, 2) on every token of the row
    ("sequence_truncate", False, rows(e(0.4), 2.0, e(-1.0), e(-0.9), 2.0)),
    ("sequence_truncate", True, rows(1.0, 2 / e(0.9), 1.0, 1.0, 2 / e(2.4))),  # min(r, 2)/r: 0.813139, 0.181436
    # TRL sequence_mask: r where r ≤ 2 (rows 2 and 3 are far below 1 and kept: no lower bound), else 0
    ("sequence_mask", False, rows(e(0.4), 0.0, e(-1.0), e(-0.9), 0.0)),
    ("sequence_mask", True, rows(1.0, 0.0, 1.0, 1.0, 0.0)),
    # llmrl's geometric-mean band, and verl's seq_mean_k1 (the same rows; it also changes the mask: below)
    ("geo_mean_mask", False, rows(1.0, 1.0, 1.0, 0.0, 0.0)),
    ("geo_mean_mask", True, rows(1.0, 1.0, 1.0, 0.0, 0.0)),
    ("seq_mean_k1", False, rows(1.0, 1.0, 1.0, 0.0, 0.0)),
    ("seq_mean_k1", True, rows(1.0, 1.0, 1.0, 0.0, 0.0)),
])
def test_each_mode_hand_worked(mode, in_ratio, expected):
    w = mismatch_weights(X, X_MASK, mode, 2.0, in_ratio=in_ratio)
    assert w.shape == (5, 3)
    assert torch.allclose(w, expected.float(), rtol=1e-6, atol=0), (w, expected)


def test_only_seq_mean_k1_takes_rejected_rows_out_of_the_loss_mask():
    """verl's rejection rewrites the response mask (rows 3 and 4 rejected above); every other mode leaves it."""
    assert torch.equal(mismatch_loss_mask(X, X_MASK, "seq_mean_k1", 2.0), X_MASK * rows(1, 1, 1, 0, 0))
    for mode in ("none", "token_tis", "sequence_truncate", "sequence_mask", "geo_mean_mask"):
        assert torch.equal(mismatch_loss_mask(X, X_MASK, mode, 2.0), X_MASK), mode
    # a cap between the geometric means 0.45 and 0.8 in log space, e^0.5 = 1.648721: row 1 stays, row 4 goes
    assert mismatch_loss_mask(X, X_MASK, "seq_mean_k1", e(0.5))[:, 0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    # e^0.4 = 1.491825 < e^0.45: row 1 (mean 0.45) goes at the high bound, row 2 (−0.333) stays
    assert mismatch_loss_mask(X, X_MASK, "seq_mean_k1", e(0.4))[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]


def test_modes_are_the_configs_and_an_unknown_one_is_one_error():
    assert MISMATCH_CORRECTIONS == tuple(MISMATCH_WEIGHTS)
    for mode in MISMATCH_CORRECTIONS:
        cfg = load_config(None, {"model": "smollm2-135m-instruct", "rollout_engine": "vllm",
                                 "mismatch_correction": mode})
        assert cfg.mismatch_correction == mode
    with pytest.raises(ValueError, match="unknown mismatch correction 'tis' \\(known: none, token_tis, "):
        mismatch_weights(X, X_MASK, "tis", 2.0)


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


class CoinLM(torch.nn.Module):
    """Two tokens, logits [0, θ] at every position: at θ = 0, d log π(y)/dθ = y − ½ = ±½."""

    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, **kw):
        logits = torch.stack([torch.zeros(input_ids.shape), self.theta.expand(input_ids.shape)], -1)  # [N, L, 2]
        return type("Out", (), {"logits": kept_logits(logits, logits_to_keep)})()


@pytest.mark.parametrize("mode, aggregate, step", [
    ("none", "token_mean", 1.6 / 12),
    ("geo_mean_mask", "token_mean", 1.45 / 12),  # rows 3, 4 weigh 0; their 4 tokens stay in the normaliser
    ("seq_mean_k1", "token_mean", 1.45 / 8),  # verl: rows 3, 4 leave the mask, the normaliser is the 8 kept tokens
    ("sequence_mask", "token_mean", (0.2 * e(0.4) + 0.55 * e(-1.0) - 0.15 * e(-0.9)) / 12),  # 0.0366428
    # per-sequence means: a rejected row counts as a zero among the 5 either way (verl's count would drop it)
    ("seq_mean_k1", "seq_mean_token_mean", (0.2 / 3 + 0.7 / 2 + 0.55 / 3) / 5),  # 0.12
    ("geo_mean_mask", "seq_mean_token_mean", (0.2 / 3 + 0.7 / 2 + 0.55 / 3) / 5),
])
def test_update_normalises_over_the_rows_each_mode_keeps(mode, aggregate, step):
    """Reinforce on X's five rows (one minibatch of 12 tokens), A = 0.4, −0.7, 1.1, −0.3, 0.6, per-token loss
    −w·A·log π(y); at θ = 0 each token's gradient is g = −w·A·(y − ½):

        row  tokens  g (w = 1)             Σg
        0    1 0 1   −0.2, 0.2, −0.2      −0.2
        1    0 0     −0.35, −0.35          −0.7
        2    1 1 0   −0.55, −0.55, 0.55   −0.55
        3    1        0.15                  0.15   (rejected by geo_mean_mask / seq_mean_k1 at 1/C)
        4    0 1 1    0.3, −0.3, −0.3      −0.3    (rejected at C)

    token_mean: dL/dθ = Σ w·g / (tokens in the normaliser); one SGD step at lr 1 moves θ by −dL/dθ."""
    tokens = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0], [0, 1, 1]])
    ids = torch.cat([torch.zeros(5, 1, dtype=torch.long), tokens], 1)  # [5, 4]: one prompt token
    batch = UpdateBatch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=X_MASK.clone(),
                        logp_old=torch.zeros(5, 3), logp_ref=None, adv=torch.tensor([0.4, -0.7, 1.1, -0.3, 0.6]),
                        group=torch.arange(5), prompt_len=1, lengths=X_MASK.sum(1), logp_engine=-X)  # old − engine = X
    model = CoinLM()
    s = UpdateSettings(algo="reinforce", loss=LossSettings(aggregate=aggregate), ppo_epochs=1, minibatch_size=5,
                       grad_accum_steps=1, kl_coef=0.0, kl_estimator="k3", max_grad_norm=1e9, mismatch=mode,
                       mismatch_cap=2.0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = policy_update(model, opt, batch, s, torch.Generator().manual_seed(0))
    assert stats.optimizer_steps == 1
    assert model.theta.item() == pytest.approx(step, rel=1e-5)


@pytest.mark.parametrize("mode, step", [
    ("geo_mean_mask", 0.0196627),  # −0.5·(−0.174929 − 0.181269 − 0.052585 − 0.110701 + 0.047581)/12
    ("seq_mean_k1", 0.0255490),  # −0.5·(−0.174929 − 0.181269 − 0.052585)/8: the KL's mean leaves rows 3, 4 out too
])
def test_seq_mean_k1_takes_rejected_rows_out_of_the_kl_term(mode, step):
    """Advantages 0, kl_coef 0.5, k3 with log π_ref = log π_θ + δ_row, δ = 0.3, −0.2, 0.1, 0.2, −0.1 (rows as above):
    d k3/d log π = 1 − e^δ, so a row's gradient is (1 − e^δ)·Σ_t(y_t − ½), with Σ_t(y_t − ½) = ½, −1, ½, ½, ½:
    −0.174929, −0.181269, −0.052585, −0.110701, 0.047581. One SGD step at lr 1: Δθ = −0.5·Σ/(tokens averaged)."""
    delta = torch.tensor([0.3, -0.2, 0.1, 0.2, -0.1])
    tokens = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 0], [1, 0, 0], [0, 1, 1]])
    ids = torch.cat([torch.zeros(5, 1, dtype=torch.long), tokens], 1)
    batch = UpdateBatch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=X_MASK.clone(),
                        logp_old=torch.zeros(5, 3), logp_ref=(-math.log(2) + delta)[:, None].expand(5, 3).clone(),
                        adv=torch.zeros(5), group=torch.arange(5), prompt_len=1, lengths=X_MASK.sum(1), logp_engine=-X)
    model = CoinLM()
    s = UpdateSettings(algo="reinforce", loss=LossSettings(aggregate="token_mean"), ppo_epochs=1, minibatch_size=5,
                       grad_accum_steps=1, kl_coef=0.5, kl_estimator="k3", max_grad_norm=1e9, mismatch=mode,
                       mismatch_cap=2.0)
    policy_update(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, s, torch.Generator().manual_seed(0))
    assert model.theta.item() == pytest.approx(step, rel=1e-5)
