"""The hf engine's repetition penalty counts each row's own tokens only, never padding: with
repetition_penalty != 1 a row draws the same tokens alone as beside a much longer row (other left
padding, and on later turns other gaps between a kept prefix and the new tokens)."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, RepetitionPenaltyLogitsProcessor

from llmrl.models.loading import add_lora
from llmrl.rollout.base import Sampling
from llmrl.rollout.episodes import one_turn
from llmrl.rollout.hf import HFEngine, RepetitionPenalty

PENALTY = 1.3  # not exact in binary
# top-k 5: a random model's distribution is nearly flat, its top tokens' relative odds are what a penalty moves
SAMPLING = Sampling(temperature=0.7, top_p=1.0, top_k=5, repetition_penalty=PENALTY, min_new_tokens=0,
                    max_new_tokens=8, max_prompt_tokens=200)
SHORT = (list(range(1000, 1006)), [3000, 3001])  # (first context, what the environment adds after the reply)
LONG = (list(range(2000, 2030)), list(range(4000, 4012)))  # longer on both turns: the short row is padded on both


@pytest.fixture
def engine(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    torch.manual_seed(1)
    model = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8, 0.0, ["q_proj", "v_proj"], False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    engine = HFEngine(tok, SAMPLING, merge_lora=False, sampler_logp=False)
    engine.load(model, 0)
    return engine


def pad_with(engine: HFEngine, token_id: int) -> None:
    """Pad with `token_id`: the most sensitive padding is the token a row likes most (penalised or not)."""
    engine.tokenizer.pad_token = engine.tokenizer.convert_ids_to_tokens(token_id)
    assert engine.tokenizer.pad_token_id == token_id


def two_turns(engine: HFEngine, rows, keys: list[int], greedy: bool) -> list[tuple[list[int], list[int]]]:
    """Each row's two replies in one episode batch: the second turn continues the kept caches
    (resume_rows: a kept prefix left-padded, then the new tokens left-padded)."""
    with engine.episodes():
        first = engine.continue_ids([c for c, _ in rows], keys, SAMPLING, 4, greedy=greedy)
        contexts = [c + r.ids + more for (c, more), r in zip(rows, first)]
        second = engine.continue_ids(contexts, [k + 100 for k in keys], SAMPLING, 8, greedy=greedy)
    return [(a.ids, b.ids) for a, b in zip(first, second)]


@pytest.mark.parametrize("greedy", [True, False])
def test_a_first_turn_is_the_same_alone_and_beside_a_longer_context(engine, greedy):
    """Six rows of the short context (keys differ when sampled), alone, then left-padded beside a longer
    one; padding: the token greedy decoding starts the short row with."""
    keys = [11 + i for i in range(6)]
    likeliest = engine.continue_ids([SHORT[0]], [0], SAMPLING, 1, greedy=True)[0].ids[0]
    alone = [r.ids for r in engine.continue_ids([SHORT[0]] * 6, keys, SAMPLING, 8, greedy=greedy)]
    pad_with(engine, likeliest)
    assert [r.ids for r in engine.continue_ids([SHORT[0]] * 6, keys, SAMPLING, 8, greedy=greedy)] == alone
    both = engine.continue_ids([SHORT[0]] * 6 + [LONG[0]], keys + [99], SAMPLING, 8, greedy=greedy)
    assert [r.ids for r in both[:6]] == alone


@pytest.mark.parametrize("greedy", [True, False])
def test_a_later_turn_is_the_same_alone_and_beside_a_longer_context(engine, greedy):
    """Six episodes of the short context (keys differ when sampled) alone, then beside a longer one.
    The second turn continues the kept caches, which pads the short rows' new tokens after their kept
    prefix (a gap, not left padding, that transformers' own penalty counts); padding: the token greedy
    decoding starts the short row's second reply with."""
    keys = [11 + i for i in range(6)]
    likeliest = two_turns(engine, [SHORT], [0], greedy=True)[0][1][0]
    alone = two_turns(engine, [SHORT] * 6, keys, greedy)
    assert all(likeliest not in SHORT[0] + first + SHORT[1] for first, _ in alone)  # the row itself has no such token
    pad_with(engine, likeliest)
    assert two_turns(engine, [SHORT] * 6, keys, greedy) == alone  # alone: no padding, whatever its id
    both = two_turns(engine, [SHORT] * 6 + [LONG], keys + [99], greedy)
    assert both[:6] == alone


@pytest.mark.parametrize("greedy", [True, False])
def test_chat_samples_are_the_same_alone_and_beside_a_longer_prompt(engine, greedy):
    """Sampled eval's completions (one-turn episodes, near-greedy at a tiny temperature): k = 3 per prompt,
    prompts left-padded to the longest."""
    from llmrl.rollout.prompts import render

    short = [{"role": "user", "content": "Say something."}]
    long = [{"role": "system", "content": "Be brief, but not too brief, and never rude."},
            {"role": "user", "content": "Hello there, model, how are you today? Say something long."}]
    s = dataclasses.replace(SAMPLING, temperature=1e-4 if greedy else 0.7)
    alone = one_turn(engine, engine.tokenizer, [short], group_size=3, seed=4, sampling=s).texts
    pad_with(engine, engine.continue_ids([render(engine.tokenizer, short)], [0], s, 1, greedy=True)[0].ids[0])
    both = one_turn(engine, engine.tokenizer, [short, long], group_size=3, seed=4, sampling=s).texts
    assert both[:3] == alone


def test_the_penalty_is_transformers_own_on_the_rows_real_tokens():
    """RepetitionPenalty gives bit for bit what transformers' RepetitionPenaltyLogitsProcessor gives for
    the row without its padding (and without what follows its EOS)."""
    g = torch.Generator().manual_seed(0)
    vocab, eos = 50, 7
    rows = [[3, 9, 9, 12], [3, 5], [40, 41, 3]]
    generated = [[eos, 20, 21], [22, 5, 23], [24, 25, eos]]
    width = max(map(len, rows))
    ids = torch.full((3, width), 0, dtype=torch.long)  # padding: id 0, used by no row
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    ids = torch.cat([ids, torch.tensor(generated)], 1)
    scores = torch.randn(3, vocab, generator=g) * 3
    out = RepetitionPenalty(PENALTY, mask, [eos])(ids, scores.clone())
    for i, r in enumerate(rows):
        own = r + generated[i][: generated[i].index(eos) + 1 if eos in generated[i] else None]
        expected = RepetitionPenaltyLogitsProcessor(PENALTY)(torch.tensor([own]), scores[i: i + 1].clone())
        assert torch.equal(out[i: i + 1], expected), i
    assert out[0, 20] == scores[0, 20] and out[0, eos] != scores[0, eos]  # after EOS: not counted; EOS: counted
