"""Budgets and limits of episodes (more than one reply per row), async staleness, and the names a reward may use:
each test here failed on the code before its fix (see the issue-39 note)."""

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from helpers import read_jsonl, run_cli, tiny_args, train_records
from llmrl.config import load_config
from llmrl.errors import ConfigError
from llmrl.rollout.base import Rollout
from llmrl.rollout.episodes import Limits, run_episodes
from llmrl.tasks.base import Example, Reward
from llmrl.tasks.env import Environment, Turn
from llmrl.training.step import Sampled, shaped_rewards
from llmrl.training.update import UpdateBatch, budget_pieces, padded_tokens
from test_env import SAMPLING, ScriptedReplies


class Talker(Environment):
    """Answers every reply with `answer` and never ends by itself; `fail_at`: the reply whose step raises."""

    name, max_turns = "talker", 3

    def __init__(self, answer="go on", fail_at=0):
        self.answer, self.fail_at = answer, fail_at

    def step(self, episode, reply):
        if episode.replies == self.fail_at:
            raise RuntimeError("boom")
        return Turn([{"role": "user", "content": self.answer}])

    def reward(self, episode):
        return Reward(total=1.0, components={})


def test_only_a_reply_cut_by_a_token_cap_makes_a_row_truncated(tiny_model_dir):
    """Episodes ended by max_turns, by an environment error, or by the episode budget right after a whole reply
    are not truncated (their replies all ended on EOS): overlong_filter keeps them, truncated_frac does not count
    them. A reply cut at reply_tokens is truncated."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    words = tok("fine then", add_special_tokens=False)["input_ids"]
    ex = Example([{"role": "user", "content": "Talk."}], None)

    def one(env, replies, **limits):
        limits = Limits(**{"max_turns": 2, "episode_tokens": 200, "reply_tokens": 40, "env_tokens": 50,
                           "env_timeout": 30, **limits})
        r, (ep,) = run_episodes(ScriptedReplies(replies), env, tok, [ex], group_size=1, seed=0, first_prompt=0,
                                sampling=SAMPLING, limits=limits, eos=[eos])
        return ep.cut, bool(r.ended[0])

    whole = words + [eos]
    assert one(Talker(), [whole, whole]) == ("max_turns", True)
    assert one(Talker(fail_at=2), [whole, whole]) == ("env_error", True)
    assert one(Talker(), [whole, whole], episode_tokens=len(whole)) == ("episode_tokens", True)
    assert one(Talker(), [whole, words + words], reply_tokens=len(words) + 1) == ("reply_tokens", False)


def rows(lengths_and_gaps: list[list[int]], prompt_len: int = 3) -> Rollout:
    """A rollout whose row i has sampled segments of the given lengths, each followed by 5 environment tokens."""
    width = prompt_len + max(sum(s + 5 for s in segs) for segs in lengths_and_gaps)
    mask = torch.zeros(len(lengths_and_gaps), width - 1)
    for i, segs in enumerate(lengths_and_gaps):
        col = prompt_len - 1
        for s in segs:
            mask[i, col: col + s] = 1
            col += s + 5
    n = len(lengths_and_gaps)
    return Rollout(input_ids=torch.zeros(n, width, dtype=torch.long), attention_mask=torch.ones(n, width),
                   completion_mask=mask, logp_old=None, logp_ref=None, ended=torch.ones(n, dtype=torch.bool),
                   prompt_len=prompt_len, texts=[""] * n, prompts_truncated=0)


def test_the_overlong_penalty_is_taken_against_the_episode_budget():
    """Two episodes of 3 replies (7 + 7 + 3 = 17 and 2 + 2 + 3 = 7 sampled tokens), max_new_tokens 7, episode
    budget 21, overlong_buffer 6: the penalty starts at 15 tokens of the budget, so −(17 − 15)/6 · 0.9 and 0. Against
    the one-reply cap of 7 (the old code) both would pay the whole 0.9."""
    cfg = load_config(None, {"task": "format_copy", "max_new_tokens": 7, "overlong_buffer": 6, "overlong_penalty": 0.9})
    def shaped(budget: int) -> list[float]:
        run = SimpleNamespace(cfg=cfg, episodes=SimpleNamespace(limits=SimpleNamespace(episode_tokens=budget)))
        sampled = Sampled([None, None], rows([[7, 7, 3], [2, 2, 3]]), [Reward(0.1, {}), Reward(0.0, {})])
        total = shaped_rewards(run, sampled)
        assert [r.components["overlong"] for r in sampled.rewards] == pytest.approx((total - torch.tensor([0.1, 0.0])).tolist())
        return total.tolist()

    assert shaped(21) == pytest.approx([0.1 - (17 - 15) / 6 * 0.9, 0.0], abs=1e-7)
    assert shaped(7) == pytest.approx([0.1 - 0.9, -0.9], abs=1e-7)


def test_the_token_budget_counts_the_environment_tokens_between_replies():
    """A forward over a multi-turn row spans its environment tokens too: padded_tokens is rows × (prompt + the
    widest row up to its last scored token), not rows × (prompt + scored tokens); budget_pieces sorts and splits by
    that width, so no piece passes the budget."""
    out = rows([[4, 4, 4], [1], [6], [2, 2]])  # widths: 4+5+4+5+4 = 22, 1, 6, 2+5+2 = 9
    assert out.spans.tolist() == [22, 1, 6, 9]
    n = out.input_ids.shape[0]
    batch = UpdateBatch(input_ids=out.input_ids, attention_mask=out.attention_mask, completion_mask=out.completion_mask,
                        logp_old=torch.zeros_like(out.completion_mask), logp_ref=None, adv=torch.zeros(n),
                        group=torch.arange(n), prompt_len=3, lengths=out.completion_mask.sum(1), spans=out.spans)
    every = torch.arange(n)
    assert padded_tokens(every, batch) == 4 * (3 + 22)  # scored counts alone would say 4 * (3 + 12)
    pieces = budget_pieces(every, batch, token_budget=60)
    assert sorted(torch.cat(pieces).tolist()) == [0, 1, 2, 3]
    assert all(padded_tokens(p, batch) <= 60 for p in pieces if len(p) > 1)
    # widest first, two pieces of 2 × 25 and 2 × 9 (by scored counts all four fit in one forward of 4 × 15)
    assert [piece.tolist() for piece in pieces] == [[0, 3], [2, 1]]


def test_engine_context_holds_whole_episodes():
    """The vLLM engines' context (max_model_len) for an environment: the prompt, the episode's sampled tokens and
    each environment turn between replies (its cap plus the template's framing); one reply for a single-turn task
    (eval's cap if larger), as before."""
    limits = Limits(max_turns=3, episode_tokens=48, reply_tokens=16, env_tokens=30, env_timeout=10, framing=11)
    assert limits.context_tokens(100, reply_tokens=24) == 100 + 48 + 2 * (30 + 11) + 8
    one = Limits(max_turns=1, episode_tokens=16, reply_tokens=16, env_tokens=0, env_timeout=10)
    assert one.context_tokens(100, reply_tokens=24) == 100 + 24 + 8


def test_each_rank_sizes_its_engine_for_its_own_share_of_the_rollout():
    from llmrl.config import resolve
    from llmrl.rollout import rank_sequences

    cfg = load_config(None, {"task": "format_copy", "batch_size": 6, "group_size": 5, "minibatch_size": 10, "eval_batch_size": 4})
    plan = resolve(cfg)
    import dataclasses

    assert rank_sequences(cfg, plan) == 30
    assert rank_sequences(cfg, dataclasses.replace(plan, world_size=3)) == 10  # 2 prompts × 5 per rank


@pytest.mark.parametrize("values, text", [
    ({"max_staleness": 2}, r"must be 0 \(synchronous\) or 1"),
    ({"max_staleness": 1, "algo": "reinforce", "ppo_epochs": 1}, "must be 0 with algo=reinforce"),
])
def test_async_settings_that_would_not_do_what_they_say_are_refused(values, text):
    with pytest.raises(ConfigError, match=text):
        load_config(None, {"task": "format_copy", "rollout_engine": "vllm-server", **values})


RESERVED_TASK = '''
from llmrl.tasks.base import Reward
from toy_task import CharTask


class Clash(CharTask):
    def reward(self, example, completion):
        return Reward(total=1.0, components={"mean": 5.0})
'''


def test_a_reward_component_named_like_a_fixed_metric_stops_in_one_line(tmp_path, tiny_model_dir):
    """A component 'mean' would have overwritten reward/mean in metrics.jsonl: the run stops in one line, with the
    checkpoint of the last step learned, instead of logging a wrong mean."""
    (tmp_path / "clash.py").write_text(RESERVED_TASK)
    p = run_cli(*tiny_args(tiny_model_dir, tmp_path / "run", "grpo", steps=2, eval_interval=0,
                           task=f"{tmp_path / 'clash.py'}:Clash"))
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "component or count 'mean'" in lines[-1] and "checkpoint" in lines[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or all(
        r.get("reward/mean") != 5.0 for r in read_jsonl(tmp_path / "run" / "metrics.jsonl"))


def test_an_overlong_multi_turn_run_pays_only_past_its_episode_budget(tmp_path, tiny_model_dir):
    """guess with 3 turns of at most 6 tokens (an episode budget of 18) and overlong_buffer 6: episodes of at most
    two replies (≤ 12 sampled tokens) pay nothing, whatever their length against the one-reply cap of 6; with
    overlong_filter, rollout/completion_len still counts the truncated rows' tokens."""
    out = tmp_path / "run"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=1, task="guess", max_prompt_tokens=256, max_turns=3,
                           eval_interval=0, overlong_buffer=6, overlong_filter="true"))
    assert p.returncode == 0, p.stderr[-2000:]
    samples = read_jsonl(out / "samples.jsonl")
    short = [s for s in samples if sum(m["role"] == "assistant" for m in s["transcript"]) <= 2]
    assert short and all(s["components"]["overlong"] == 0.0 for s in short)
    record = train_records(out)[-1]
    if record["rollout/truncated_frac"] == 1.0:  # every row was cut: the old code logged 0 tokens for all of them
        assert record["rollout/completion_len"] >= 6
    assert record["rollout/completion_len"] > 0

