"""Each speed path against the plain path on the tiny model (tolerance 1e-5): old log-probs from the
sampler's logits vs a recomputation, LoRA merged vs unmerged while sampling, keyed sampling that does
not depend on the batch, with pad == eos, truncated completions and different prompt lengths."""

import contextlib
import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmrl.models.loading import add_lora
from llmrl.models.scoring import chunked_logprobs
from llmrl.rollout import HFEngine, Sampling, add_logprobs
from llmrl.rollout.episodes import one_turn
from llmrl.rollout.keyed import KeyedSampler

MESSAGES = [
    [{"role": "user", "content": "Hi."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a much longer story about a cat."}],
    [{"role": "user", "content": "Count to three, please."}],
]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(1)
    model = add_lora(base, 4, 8, 0.0, ["q_proj", "v_proj", "up_proj"], False)
    with torch.no_grad():  # LoRA B starts at 0; give it weight so merging matters
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert tok.pad_token_id == tok.eos_token_id
    return model, tok


@contextlib.contextmanager
def stopping_also_at(model, extra_eos):
    """The model's generation config ends completions at `extra_eos` too, inside the block."""
    config = model.generation_config
    before = config.eos_token_id
    config.eos_token_id = [before, *extra_eos] if extra_eos else before
    try:
        yield
    finally:
        config.eos_token_id = before


def sample(model, tok, messages, extra_eos=(), *, seed=11, first_prompt=0, logp_from_sampler=True, merge_lora=True,
           shared_prefix=True, with_ref=False):
    """G = 3 completions per prompt (T 0.9, top-p 0.95, 1-8 tokens) with log-probs, as a training step draws them."""
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=0, repetition_penalty=1.0, min_new_tokens=1,
                        max_new_tokens=8, max_prompt_tokens=64)
    engine = HFEngine(tok, sampling, merge_lora=merge_lora, sampler_logp=logp_from_sampler)
    engine.load(model, 0)
    with stopping_also_at(model, extra_eos):
        r = one_turn(engine, tok, messages, group_size=3, seed=seed, first_prompt=first_prompt, sampling=sampling,
                     device="cpu")
    return add_logprobs(model, r, chunk=4, group_size=3, shared_prefix=shared_prefix, with_ref=with_ref)


def test_sampler_logprobs_equal_a_recomputation(policy):
    model, tok = policy
    first = sample(model, tok, MESSAGES, logp_from_sampler=True, merge_lora=False)
    stop = int(first.input_ids[0, first.prompt_len + 3])  # a second EOS id (pad == eos == 2 stays one)
    fast = sample(model, tok, MESSAGES, extra_eos=[stop], logp_from_sampler=True, merge_lora=False)
    assert fast.ended.any() and not fast.ended.all(), "want both ended and truncated completions"
    again = chunked_logprobs(model.eval(), fast.input_ids, fast.attention_mask, fast.prompt_len, 4)[0] * fast.completion_mask
    assert torch.allclose(fast.logp_old, again, atol=1e-5)
    plain = sample(model, tok, MESSAGES, extra_eos=[stop], logp_from_sampler=False, merge_lora=False)
    assert torch.equal(plain.input_ids, fast.input_ids)
    assert torch.allclose(plain.logp_old, fast.logp_old, atol=1e-5)
    # entropies of the sampling policy (temperature 1): from the sampler's logits = from a recomputation
    assert torch.allclose(plain.entropy, fast.entropy, atol=1e-5)
    assert (fast.entropy[fast.completion_mask > 0] > 0).all() and (fast.entropy[fast.completion_mask == 0] == 0).all()


def test_merged_lora_samples_the_same_and_restores_the_weights(policy):
    model, tok = policy
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged = sample(model, tok, MESSAGES, merge_lora=True)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit for bit
    assert not any(getattr(m, "merged", False) for m in model.modules())
    plain = sample(model, tok, MESSAGES, merge_lora=False)
    assert torch.equal(merged.input_ids, plain.input_ids)
    assert torch.allclose(merged.logp_old, plain.logp_old, atol=1e-5)


def test_keyed_sampling_does_not_depend_on_the_batch(policy):
    """Prompt 2 alone (as prompt index 2) gets the same completions as inside the 3-prompt batch,
    although its padding and batch neighbours differ."""
    model, tok = policy
    full = sample(model, tok, MESSAGES)
    alone = sample(model, tok, MESSAGES[2:], first_prompt=2)
    assert full.texts[6:] == alone.texts
    other_seed = sample(model, tok, MESSAGES, seed=12)
    assert other_seed.texts != full.texts


def test_keyed_sampler_draws_from_the_tempered_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    n = 4000
    counts = Counter()
    for key in range(n):
        s = KeyedSampler([key], prompt_width=0, temperature=1.0, top_p=0.9, top_k=0)
        out = s(torch.zeros(1, 0, dtype=torch.long), logits.clone())
        counts[int(out.argmax())] += 1
    # nucleus 0.9 keeps tokens 0-2 (0.5 + 0.3 < 0.9 ≤ 0.95), renormalised: 0.5/0.95, 0.3/0.95, 0.15/0.95
    assert counts[3] == 0
    for token, p in ((0, 0.5 / 0.95), (1, 0.3 / 0.95), (2, 0.15 / 0.95)):
        assert abs(counts[token] / n - p) < 4 * math.sqrt(p * (1 - p) / n)
    hot = KeyedSampler([0], 0, temperature=1.0, top_p=1.0, top_k=1)(torch.zeros(1, 0, dtype=torch.long), logits.clone())
    assert int(hot.argmax()) == 0 and torch.isinf(hot[0, 1:]).all()


def test_shared_prefix_forward_equals_the_plain_forward_with_gradients(policy):
    """The group's prompt once, its completions attending to its cache: same log-probs, entropies and
    LoRA gradients as the plain forward (rows shuffled so groups interleave; prompts of different
    lengths; ended and truncated rows; pad == eos)."""
    from llmrl.models.scoring import sequence_logprobs, shared_prefix_logprobs

    model, tok = policy
    first = sample(model, tok, MESSAGES)
    stop = int(first.input_ids[0, first.prompt_len + 3])
    r = sample(model, tok, MESSAGES, extra_eos=[stop])
    assert r.ended.any() and not r.ended.all()
    order = torch.tensor([4, 0, 7, 2, 8, 1, 5])  # a minibatch of 7 of the 9 rows, groups mixed
    ids, attn, mask = r.input_ids[order], r.attention_mask[order], r.completion_mask[order]
    group = order // 3
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()

    def run(fn, *extra):
        model.zero_grad()
        logp, ent = fn(model, ids, attn, r.prompt_len, *extra, with_entropy=True)
        (logp * mask * weights).sum().backward()
        return logp * mask, ent * mask, [p.grad.clone() for p in params]

    plain = run(sequence_logprobs)
    shared = run(shared_prefix_logprobs, group)
    assert torch.allclose(plain[0], shared[0], atol=1e-5)
    assert torch.allclose(plain[1], shared[1], atol=1e-5)
    assert max((a - b).abs().max().item() for a, b in zip(plain[2], shared[2])) <= 1e-5
    assert sum(g.abs().sum().item() for g in shared[2]) > 0
    # one generated token only: nothing but the prompt forward
    short_ids, short_attn = ids[:, : r.prompt_len + 1], attn[:, : r.prompt_len + 1]
    a, _ = sequence_logprobs(model, short_ids, short_attn, r.prompt_len)
    b, _ = shared_prefix_logprobs(model, short_ids, short_attn, r.prompt_len, group)
    assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.slow
def test_fast_and_plain_paths_train_alike(tmp_path, tiny_model_dir):
    """Two steps with every speed path on and with --fast false: same samples, adapters within 1e-4."""
    from helpers import cli, lora_tensors, read_jsonl, tiny_args

    runs = {}
    for fast in ("true", "false"):
        out = tmp_path / fast
        cli(*tiny_args(str(tiny_model_dir), out, "grpo", steps=2, fast=fast, lora_dropout=0, kl_coef=0.1))
        runs[fast] = out
    a, b = (lora_tensors(runs[f] / "checkpoints/step_000002") for f in ("true", "false"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4
    sa, sb = (read_jsonl(runs[f] / "samples.jsonl") for f in ("true", "false"))
    assert [x["completion"] for x in sa] == [x["completion"] for x in sb]


@pytest.mark.parametrize("aggregate", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"])
def test_fused_accumulation_window_equals_separate_minibatches(policy, aggregate):
    """One forward for the minibatches of an optimizer step gives the same update as one per minibatch."""
    from llmrl.algorithms.losses import LossSettings
    from llmrl.training.update import UpdateBatch, UpdateSettings, policy_update

    model, tok = policy
    r = sample(model, tok, MESSAGES, with_ref=True)
    batch = UpdateBatch(input_ids=r.input_ids, attention_mask=r.attention_mask, completion_mask=r.completion_mask,
                        logp_old=r.logp_old, logp_ref=r.logp_ref, adv=torch.linspace(-1, 1, 9),
                        group=torch.arange(9) // 3, prompt_len=r.prompt_len, lengths=r.completion_lens)
    start = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    results = {}
    for fuse in (False, True):
        with torch.no_grad():
            for k, v in model.named_parameters():
                if v.requires_grad:
                    v.copy_(start[k])
        model.zero_grad(set_to_none=True)  # no gradient left over from other tests
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.5)
        settings = UpdateSettings(algo="grpo", loss=LossSettings(aggregate=aggregate), ppo_epochs=2, minibatch_size=2,
                                  grad_accum_steps=3, kl_coef=0.1, kl_estimator="k3", max_grad_norm=1e9,
                                  shared_prefix=fuse, fuse_accumulation=fuse)
        stats = policy_update(model, opt, batch, settings, torch.Generator().manual_seed(0))
        results[fuse] = ({k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}, stats)
    (w0, s0), (w1, s1) = results[False], results[True]
    # 10 minibatches over two epochs: windows of 3, 3, 3, 1 (the second holds rows of both epochs)
    assert s0.optimizer_steps == s1.optimizer_steps == 4
    assert max((w0[k] - w1[k]).abs().max().item() for k in w0) <= 1e-5
    assert max((w0[k] - start[k]).abs().max().item() for k in w0) > 1e-3  # the update did move the weights
    for key in ("loss", "kl", "grad_norm"):
        assert getattr(s1, key) == pytest.approx(getattr(s0, key), abs=1e-5)


@pytest.mark.parametrize("top_p,top_k", [(0.95, 0), (0.9, 20), (1.0, 0)])
def test_keyed_sampler_candidates_choose_as_the_whole_vocabulary(top_p, top_k):
    """Sorting and drawing noise only for the top `candidates` tokens picks the same token as the
    full vocabulary, for peaked rows (nucleus inside the candidates) and flat ones (fallback)."""
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([8.0] * 6 + [0.5] * 2)[:, None]  # 6 peaked rows, 2 flat ones
    fast_hits, fallbacks = 0, 0
    for position in range(12):
        logits = torch.randn(8, 5000, generator=g) * scale
        ids = torch.zeros(8, position, dtype=torch.long)
        fast = KeyedSampler(list(range(8)), 0, 0.8, top_p, top_k, candidates=64)
        full = KeyedSampler(list(range(8)), 0, 0.8, top_p, top_k, candidates=5000)
        peaked = KeyedSampler(list(range(6)), 0, 0.8, top_p, top_k, candidates=64)
        a, b = fast(ids, logits.clone()).argmax(-1), full(ids, logits.clone()).argmax(-1)
        assert torch.equal(a, b)
        assert torch.equal(peaked(ids, logits[:6].clone()).argmax(-1), a[:6])  # a row's choice ignores its batch
        fallbacks += fast.full_vocab_draws
        fast_hits += 1 - peaked.full_vocab_draws
    if top_p < 1.0 and top_k == 0:
        assert fallbacks == 12 and fast_hits == 12  # flat rows need the whole vocabulary, peaked ones do not


def test_hash_dropout_has_dropout_statistics_and_reproduces_with_the_seed():
    from llmrl.training.cpu_speed import HashDropout, hash_fields

    d = HashDropout(0.05).train()
    x = torch.ones(1000, 1000, requires_grad=True)
    torch.manual_seed(3)
    y = d(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - 0.05) < 4 * math.sqrt(0.05 * 0.95 / 1e6)
    assert torch.allclose(y[y != 0], torch.full_like(y[y != 0], 1 / 0.95))
    y.sum().backward()  # gradient: the mask, scaled
    assert torch.equal(x.grad, y.detach())
    torch.manual_seed(3)
    assert torch.equal(d(x), y)  # same seed, same mask
    torch.manual_seed(3)  # the mask is exactly "field >= threshold" of the key drawn from torch's generator
    key = int(torch.randint(-(2**62), 2**62, (1,)))
    assert torch.equal(y != 0, (hash_fields(x.numel(), key) >= d.threshold).view(x.shape))
    other = d(x)
    agree = ((other == 0) == (y == 0)).float().mean().item()  # independent masks: (1-p)^2 + p^2
    assert abs(agree - (0.95**2 + 0.05**2)) < 0.002
    rows = (y == 0).float().mean(1)  # no structure along rows or columns
    assert rows.std().item() < 3 * math.sqrt(0.05 * 0.95 / 1000)
    assert torch.equal(d.eval()(x), x) and torch.equal(HashDropout(0.0).train()(x), x)
    assert HashDropout(0.5).threshold == 0 and HashDropout(0.25).threshold == -(2**14)
    # p = 0.3 is not a multiple of 2^-16: kept with probability 1 - round(0.3·2^16)/2^16 (19661/65536)
    big = HashDropout(0.3).train()(torch.ones(3, 333_333))  # n not a multiple of 4: the last hash's fields cut
    assert big.shape == (3, 333_333) and abs((big == 0).float().mean().item() - 19661 / 65536) < 4 * math.sqrt(0.21 / 1e6)
    assert torch.allclose(big[big != 0], torch.full_like(big[big != 0], 1 / 0.7))


def test_hash_dropout_replaces_peft_lora_dropout(tiny_model_dir):
    from llmrl.training.cpu_speed import HashDropout, use_hash_dropout

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = add_lora(base, 4, 8, 0.1, ["q_proj", "v_proj", "up_proj"], False)
    n_layers = base.config.num_hidden_layers
    assert use_hash_dropout(model) == 3 * n_layers
    drops = [m for m in model.modules() if isinstance(m, HashDropout)]
    assert len(drops) == 3 * n_layers and all(m.p == 0.1 for m in drops)
    model.train()
    ids = torch.tensor([[1, 5, 9, 4, 7]])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    torch.manual_seed(0)
    a = model(input_ids=ids).logits
    torch.manual_seed(0)
    assert torch.equal(model(input_ids=ids).logits, a)
    assert not torch.equal(model(input_ids=ids).logits, a)  # a fresh mask each call


@pytest.mark.parametrize("aggregate", ["seq_mean_token_mean", "token_mean", "seq_mean_token_sum"])
def test_forwards_over_the_token_budget_are_split_and_the_update_is_the_same(policy, aggregate):
    """fuse_accumulation fuses a window only when its padded rows × columns fit token_budget (the
    activation memory of one forward); above it, one forward per minibatch; a minibatch above it runs
    in pieces of length-sorted rows. The same update and the same logged means every way."""
    from llmrl.algorithms.losses import LossSettings
    from llmrl.training.update import UpdateBatch, UpdateSettings, budget_pieces, padded_tokens, policy_update

    model, tok = policy
    r = sample(model, tok, MESSAGES, with_ref=True)
    keep = torch.tensor([8, 3, 6, 1, 8, 5, 2, 7, 4])  # completions of several lengths (as if they had ended)
    mask = r.completion_mask * (torch.arange(r.completion_mask.shape[1]) < r.prompt_len - 1 + keep[:, None])
    lengths = mask.sum(1)
    assert lengths.tolist() == keep.tolist()
    batch = UpdateBatch(input_ids=r.input_ids, attention_mask=r.attention_mask, completion_mask=mask,
                        logp_old=(r.logp_old - 0.07) * mask, logp_ref=r.logp_ref * mask,
                        adv=torch.linspace(-1, 1, 9), group=torch.arange(9) // 3, prompt_len=r.prompt_len,
                        lengths=lengths)
    window = [torch.tensor([0, 4]), torch.tensor([8, 2])]
    assert padded_tokens(torch.cat(window), batch) == 4 * (r.prompt_len + int(lengths[[0, 4, 8, 2]].max()))
    rows = torch.arange(9)
    width = r.prompt_len + int(lengths.max())
    pieces = budget_pieces(rows, batch, 2 * width)  # the fewest near-equal pieces within the budget
    assert [p.tolist() for p in pieces] == [[0, 4], [7, 2], [5, 8], [1, 6], [3]]  # by length 8 8 | 7 6 | 5 4 | 3 2 | 1
    assert all(padded_tokens(p, batch) <= 2 * width for p in pieces)
    assert [len(p) for p in budget_pieces(rows, batch, 4 * width)] == [3, 3, 3]  # 9 rows: 3 pieces, not 4 + 4 + 1
    assert budget_pieces(rows, batch, 9 * width) == [rows]
    start = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    calls, results = [], {}
    hook = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        for budget in (10**9, 3 * width, 1):
            with torch.no_grad():
                for k, v in model.named_parameters():
                    if v.requires_grad:
                        v.copy_(start[k])
            model.zero_grad(set_to_none=True)
            opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
            settings = UpdateSettings(algo="grpo", loss=LossSettings(aggregate=aggregate), ppo_epochs=2, minibatch_size=2,
                                      grad_accum_steps=3, kl_coef=0.1, kl_estimator="k3", max_grad_norm=1e9,
                                      fuse_accumulation=True, token_budget=budget)
            calls.clear()
            stats = policy_update(model, opt, batch, settings, torch.Generator().manual_seed(0))
            results[budget] = (len(calls), stats, {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad})
    finally:
        hook.remove()
    (fused_calls, fused, w_fused), (mb_calls, by_mb, w_mb), (row_calls, by_row, w_row) = results.values()
    assert (fused_calls, mb_calls, row_calls) == (4, 10, 18)  # 4 windows fused; 10 minibatches (a 2-row one fits, 6 rows do not); 18 rows
    for w in (w_mb, w_row):
        assert max((w_fused[k] - w[k]).abs().max().item() for k in w_fused) <= 1e-5
    for st in (by_mb, by_row):
        for key in ("loss", "pg_loss", "kl", "clip_frac"):
            assert getattr(st, key) == pytest.approx(getattr(fused, key), rel=1e-4, abs=1e-7), key
    assert fused.kl > 0 and fused.loss != 0


def test_growing_cache_layer_holds_what_concatenation_holds():
    """GrowingLayer against transformers' DynamicLayer over a prefill, decode steps that cross its
    capacity (reserve 7: grows at 8), a batch repeat and a batch selection: equal keys and
    values after every update, and the decode steps write into the same buffer (no copy)."""
    from transformers.cache_utils import DynamicLayer

    from llmrl.rollout.hf import GrowingLayer

    torch.manual_seed(0)
    grow, plain = GrowingLayer(reserve=7), DynamicLayer()
    steps = [5, 1, 1, 1, 2, 1, 3, 1, 1, 1, 1, 1, 1, 1]
    new_buffers, last = 0, None
    for i, width in enumerate(steps):
        k, v = torch.randn(3, 2, width, 5) * 1.37, torch.randn(3, 2, width, 5) / 3
        if i == 4:
            grow.batch_repeat_interleave(2), plain.batch_repeat_interleave(2)
        if i == 9:
            rows = torch.tensor([5, 0, 3, 3])
            grow.batch_select_indices(rows), plain.batch_select_indices(rows)
        n = plain.keys.shape[0] if plain.is_initialized and plain.keys.numel() else 3
        k, v = k[:1].expand(n, -1, -1, -1) + torch.arange(n)[:, None, None, None], v[:1].expand(n, -1, -1, -1)
        got, want = grow.update(k, v), plain.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert grow.get_seq_length() == plain.get_seq_length() == sum(steps[: i + 1])
        new_buffers, last = new_buffers + (grow._buffers is not last), grow._buffers
    assert grow.keys._base is grow._buffers[0] and grow._buffers[0].shape[-2] == 34
    # buffers: the first (room for 7), grown at 8 positions (16), copied after the repeat (20) and
    # after the selection (2 × 17); every other step wrote into the buffer it found
    assert new_buffers == 4


def test_generate_with_the_growing_cache_equals_concatenation(policy, monkeypatch):
    """Sampling with GrowingLayer caches gives the tokens and sampler logits of transformers' own
    concatenating cache (3 prompts of different lengths, G = 3, up to 8 new tokens)."""
    from transformers.cache_utils import DynamicCache

    import llmrl.rollout.hf as hf

    model, tok = policy
    grown = sample(model, tok, MESSAGES, logp_from_sampler=True, merge_lora=False)
    monkeypatch.setattr(hf, "growing_cache", lambda config, reserve: DynamicCache(config=config))
    plain = sample(model, tok, MESSAGES, logp_from_sampler=True, merge_lora=False)
    assert torch.equal(grown.input_ids, plain.input_ids)
    assert torch.allclose(grown.logp_old, plain.logp_old, atol=1e-6)


def test_hash_fields_are_uniform_and_the_four_fields_of_one_hash_independent():
    from llmrl.training.cpu_speed import hash_fields

    v = hash_fields(400_002, key=-123_456_789).double()  # n not a multiple of 4
    assert v.shape == (400_002,) and v.min() >= -(2**15) and v.max() < 2**15
    counts = torch.histc(v, bins=16, min=-(2**15), max=2**15 - 1)
    expected = 400_002 / 16
    assert ((counts - expected) ** 2 / expected).sum() < 45  # chi-square, 15 degrees of freedom (p ≈ 1e-4)
    fields = v[:400_000].view(-1, 4)
    corr = torch.corrcoef(fields.T)
    assert (corr - torch.eye(4, dtype=corr.dtype)).abs().max() < 0.01  # 4σ ≈ 0.0063
    assert not torch.equal(hash_fields(1000, 1), hash_fields(1000, 2))
    assert torch.equal(hash_fields(1000, 7), hash_fields(1003, 7)[:1000])  # a prefix does not depend on n


def test_fused_lora_output_equals_peft_forward_and_gradients(tiny_model_dir):
    """base + s·(A(dropout x)) Bᵀ in one addmm = PEFT's base + B(A(dropout x))·s: log-probs and every
    LoRA gradient, with hash dropout on (same seed, same masks), rows of different lengths (left
    padding); with the adapter disabled or merged it is PEFT's own forward."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    from llmrl.models.lora import fuse_lora_outputs, merged_lora
    from llmrl.models.scoring import sequence_logprobs
    from llmrl.training.cpu_speed import use_hash_dropout

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(2)
    model = add_lora(base, 5, 7, 0.1, ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"], False)
    use_hash_dropout(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    ids = torch.randint(3, 200, (3, 11))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[2, :1] = 0

    def run(train: bool):
        model.train(train)
        model.zero_grad()
        torch.manual_seed(9)
        logp = sequence_logprobs(model, ids, mask, 5)[0]
        (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = {train: run(train) for train in (True, False)}
    n_lora = sum(isinstance(m, LoraLinear) for m in model.modules())
    assert fuse_lora_outputs(model) == n_lora == 5 * base.config.num_hidden_layers
    assert fuse_lora_outputs(model) == 0  # installed once
    for train in (True, False):
        logp, grads = run(train)
        assert torch.allclose(logp, plain[train][0], atol=1e-5, rtol=0)
        for name, g in grads.items():
            assert torch.allclose(g, plain[train][1][name], atol=1e-6, rtol=1e-4), name
    assert not torch.allclose(plain[True][0], plain[False][0])  # dropout was on in training
    with torch.no_grad(), model.disable_adapter():  # falls back to PEFT: no LoRA at all
        off = sequence_logprobs(model, ids, mask, 5)[0]
    for m in model.modules():
        if isinstance(m, LoraLinear):
            del m.forward
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(off, sequence_logprobs(model, ids, mask, 5)[0])
    fuse_lora_outputs(model)
    model.eval()
    with torch.no_grad():
        unmerged = sequence_logprobs(model, ids, mask, 5)[0]
        with merged_lora(model):  # merged: PEFT's forward skips the LoRA branch, the merged weight has it
            assert torch.allclose(sequence_logprobs(model, ids, mask, 5)[0], unmerged, atol=1e-5)


def test_grouped_attention_reads_key_value_heads_in_place(tiny_model_dir, monkeypatch):
    """`grouped_query_attention` (CPU plans): the tiny model's 4 query heads share 2 key/value heads; SDPA
    reads them in place (enable_gqa) instead of transformers' repeat_kv copies, with the same log-probs
    and LoRA gradients, over left-padded rows of different lengths and the shared-prefix forward."""
    import transformers.integrations.sdpa_attention as hf_sdpa

    from llmrl.models.loading import grouped_query_attention
    from llmrl.models.scoring import sequence_logprobs, shared_prefix_logprobs

    copies = Counter()
    original = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda x, n: copies.update([n]) or original(x, n))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, tok.vocab_size, (6, 19), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate([4, 0, 0, 2, 0, 0]):  # two prompts of 3 rows each, left-padded differently
        mask[row, :pad] = 0
    ids[1:3, :9], mask[1:3, :9] = ids[0, :9], mask[0, :9]
    ids[4:6, :9], mask[4:6, :9] = ids[3, :9], mask[3, :9]
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    results = []
    for grouped in (False, True):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        torch.manual_seed(1)
        model = add_lora(base, 4, 8, 0.0, ["q_proj", "k_proj", "v_proj", "up_proj"], False)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
        assert grouped_query_attention(model) if grouped else True
        copies.clear()
        full = sequence_logprobs(model, ids, mask, 9)[0]
        shared = shared_prefix_logprobs(model, ids, mask, 9, group)[0]
        (full.sum() + 0.7 * shared.sum()).backward()
        grads = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if "lora_" in n])
        results.append((full, shared, grads))
        assert (sum(copies.values()) == 0) == grouped, copies  # repeat_kv called only without grouping
    (f0, s0, g0), (f1, s1, g1) = results
    # The two paths run different SDPA kernels: the same sums in another order. In fp32 (u = 2^-24) a
    # reordered sum of n terms differs by at most ~n·u·Σ|terms|, and an element near 0 is a cancellation of
    # terms of the tensor's own scale, so the bound is norm-wise: 64·u·max|x| (measured: 0 on the log-probs,
    # 4.5·u·max|g| on the gradients, AMD EPYC Zen 1). A wrong key/value head mapping moves them by O(max|x|).
    for new, old in ((f1, f0), (s1, s0), (g1, g0)):
        torch.testing.assert_close(new, old, rtol=0, atol=64 * 2.0**-24 * old.abs().max().item())
    assert g0.abs().max() > 1e-3  # gradients that a wrong attention would change


def test_scoring_without_grad_takes_logprobs_and_entropies_from_one_log_softmax(policy):
    """No-grad scoring (old log-probs) gathers the log-probs from the log-softmax its entropies need,
    where a forward with grad uses cross-entropy: the same bits either way."""
    from llmrl.models.scoring import sequence_logprobs, shared_prefix_logprobs

    model, tok = policy
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, tok.vocab_size, (6, 17), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3], mask[4, :1] = 0, 0
    ids[1:3, :7], mask[1:3, :7] = ids[0, :7], mask[0, :7]
    model.eval()
    for score in (lambda: sequence_logprobs(model, ids, mask, 7, with_entropy=True),
                  lambda: shared_prefix_logprobs(model, ids, mask, 7, torch.tensor([0, 0, 0, 1, 2, 3]), with_entropy=True)):
        logp, entropy = score()  # grad on: cross-entropy, entropies apart
        assert logp.requires_grad
        with torch.no_grad():
            logp_ng, entropy_ng = score()
        assert torch.equal(logp_ng, logp.detach()) and torch.equal(entropy_ng, entropy)
        assert entropy[:, 6:].min() > 0.1 and logp[:, 6:].max() < 0
