"""Multi-turn environments: token-in/token-out rows, the loss mask with gaps, limits, the built-in environments."""

import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmrl.algorithms.losses import LOSSES, LossSettings
from llmrl.models.loading import add_lora
from llmrl.rollout import add_logprobs
from llmrl.rollout.base import Sampling
from llmrl.rollout.episodes import Limits, TemplateError, check_template, episode_counts, run_episodes
from llmrl.rollout.hf import HFEngine
from llmrl.tasks.base import Example, Reward
from llmrl.tasks.calculator import CalculatorEnv, arithmetic
from llmrl.tasks.env import Environment, Episode, Turn
from llmrl.tasks.guess import GuessEnv
from llmrl.tasks.score import score_episodes

SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, min_new_tokens=0, max_new_tokens=5,
                    max_prompt_tokens=200)


class ScriptEnv(Environment):
    """Answers the first replies with messages of different lengths, then ends; reward = replies."""

    name, max_turns = "script", 3
    ANSWERS = ["first answer", "a longer second answer from the environment"]

    def step(self, episode: Episode, reply: str) -> Turn:
        if episode.replies > len(self.ANSWERS):
            return Turn(None)
        return Turn([{"role": "user", "content": self.ANSWERS[episode.replies - 1]}], tool_calls=1)

    def reward(self, episode: Episode) -> Reward:
        return Reward(total=float(episode.replies), components={"replies": float(episode.replies)})


def stop_after(n: int, eos: int):
    """A KeyedSampler that ends every reply with EOS at its n-th token (the random tiny model never
    chooses EOS); the other tokens are the keyed draw. Log-probs are of the raw logits either way."""
    from llmrl.rollout.keyed import KeyedSampler

    class Stopping(KeyedSampler):
        def __call__(self, input_ids, scores):
            out = super().__call__(input_ids, scores)
            if input_ids.shape[1] - self.prompt_width == n - 1:
                out = torch.full_like(scores, float("-inf"))
                out[:, eos] = 0.0
            return out

    return Stopping


@pytest.fixture
def tiny_policy(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    torch.manual_seed(1)
    model = add_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 4, 8, 0.0, ["q_proj", "v_proj"], False)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    return model, tok


def play(model, tok, monkeypatch, examples, group_size=3, limits=None, env=None):
    import llmrl.rollout.hf as hf

    monkeypatch.setattr(hf, "KeyedSampler", stop_after(4, tok.eos_token_id))
    engine = HFEngine(tok, SAMPLING, eval_batch_size=8, merge_lora=False, sampler_logp=True)
    engine.sync(model)
    limits = limits or Limits(max_turns=3, episode_tokens=15, reply_tokens=5, env_tokens=50, env_timeout=30)
    return run_episodes(engine, env or ScriptEnv(), tok, examples, group_size=group_size, seed=5, first_prompt=0,
                        sampling=SAMPLING, limits=limits, eos=[tok.eos_token_id])


def test_scripted_episodes_are_the_templates_tokens_with_a_mask_on_sampled_tokens_only(tiny_policy, monkeypatch):
    """Three replies of 4 tokens with two environment answers between them: each row is exactly the chat
    template's rendering of its transcript, the mask is 1 on the 12 sampled tokens (each reply's EOS
    included) and 0 on every environment token, the gradient of the loss with respect to the logits at
    environment positions is exactly 0, and the trainer's log-probs of the sampled tokens equal the
    sampling engine's own."""
    model, tok = tiny_policy
    examples = [Example([{"role": "user", "content": "Say something."}], None),
                Example([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, model."}], None)]
    r, episodes = play(model, tok, monkeypatch, examples)
    assert all(ep.done and ep.replies == 3 for ep in episodes)
    assert r.completion_mask.sum(1).tolist() == [12.0] * 6  # sampled tokens only: completion_lens
    for i, ep in enumerate(episodes):
        row = r.input_ids[i][r.attention_mask[i].bool()].tolist()
        trajectory = r.input_ids[i, r.prompt_len:].tolist()
        rendered = tok.apply_chat_template(ep.messages, tokenize=False)
        text = tok.decode(row)
        assert rendered.startswith(text) and len(rendered) - len(text) <= 2, (rendered[-80:], text[-80:])
        mask = r.completion_mask[i, r.prompt_len - 1:].tolist()  # mask[j] scores trajectory token j
        sampled = [t for t, m in zip(trajectory, mask) if m == 1]
        env_part = tok.decode([t for j, (t, m) in enumerate(zip(trajectory, mask)) if m == 0 and j < 12 + ep.env_tokens])
        assert len(sampled) == 12 and [sampled[k] for k in (3, 7, 11)] == [tok.eos_token_id] * 3
        assert ScriptEnv.ANSWERS[0] in env_part and ScriptEnv.ANSWERS[1] in env_part and ep.env_tokens > 10
        assert r.completion_mask[i, : r.prompt_len - 1].sum() == 0
    # the loss's gradient reaches the logits of sampled tokens only
    r = add_logprobs(model, r, chunk=6, group_size=3, shared_prefix=True, with_ref=False)
    torch.testing.assert_close(r.logp_old * r.completion_mask, r.engine_logp, rtol=0, atol=1e-5)  # fp32 decode vs full forward
    captured = {}

    def keep(module, args, output):
        output.retain_grad()
        captured["logits"] = output

    handle = model.get_output_embeddings().register_forward_hook(keep)
    from llmrl.models.scoring import sequence_logprobs

    model.train()
    logp, _ = sequence_logprobs(model, r.input_ids, r.attention_mask, r.prompt_len)
    handle.remove()
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1, 0.9, -0.8])
    pg, _ = LOSSES["grpo"](logp, r.logp_old, adv, r.completion_mask, LossSettings(), None)
    pg.backward()
    grad = captured["logits"].grad  # [N, kept positions, V]: position k scores column prompt_len - 1 + k
    scored = r.completion_mask[:, r.prompt_len - 1:][:, : grad.shape[1]]
    per_position = grad.abs().sum(-1)
    assert per_position[scored == 0].max() == 0.0  # exactly: environment tokens and padding teach nothing
    assert (per_position[scored == 1] > 0).all()


def test_turn_keys_make_episodes_independent_of_their_batch(tiny_policy, monkeypatch):
    """Noise keyed by (seed, prompt, g, turn): an example's episodes are the same alone or beside another."""
    model, tok = tiny_policy
    a = Example([{"role": "user", "content": "Say something."}], None)
    b = Example([{"role": "user", "content": "Something much longer to say, with more tokens in it."}], None)
    both, _ = play(model, tok, monkeypatch, [a, b])
    alone, _ = play(model, tok, monkeypatch, [a])
    width = alone.input_ids.shape[1] - alone.prompt_len
    assert torch.equal(both.input_ids[:3, both.prompt_len: both.prompt_len + width], alone.input_ids[:, alone.prompt_len:])


class FlakyEnv(ScriptEnv):
    def step(self, episode, reply):
        g = episode.state
        if g == 0:
            raise RuntimeError("the environment broke")
        if g == 1:
            time.sleep(3)
        return super().step(episode, reply)

    def start(self, episode):
        FlakyEnv.count = getattr(FlakyEnv, "count", -1) + 1
        episode.state = FlakyEnv.count % 3


def test_an_environment_that_raises_or_hangs_ends_that_episode_with_reward_zero(tiny_policy, monkeypatch):
    model, tok = tiny_policy
    FlakyEnv.count = -1
    limits = Limits(max_turns=3, episode_tokens=15, reply_tokens=5, env_tokens=50, env_timeout=0.5)
    _, episodes = play(model, tok, monkeypatch, [Example([{"role": "user", "content": "Hi."}], None)], limits=limits,
                       env=FlakyEnv())
    assert [ep.cut for ep in episodes] == ["env_error", "env_error", None]
    assert "RuntimeError: the environment broke" in episodes[0].error and "timeout" in episodes[1].error
    scores = score_episodes(FlakyEnv(), episodes, strict=False, where="test")
    assert [r.total for r in scores.rewards] == [0.0, 0.0, 3.0]
    assert episode_counts(episodes)["env_errors"] == 2


def test_limits_cut_episodes_and_cap_environment_messages(tiny_policy, monkeypatch):
    """max_turns 2 cuts a 3-reply script; an episode budget of 6 sampled tokens cuts the second reply at 2
    tokens (no EOS); a 1-token cap cuts the environment's message, with a marker."""
    model, tok = tiny_policy
    ex = [Example([{"role": "user", "content": "Hi."}], None)]
    _, episodes = play(model, tok, monkeypatch, ex, group_size=1,
                       limits=Limits(max_turns=2, episode_tokens=15, reply_tokens=5, env_tokens=1, env_timeout=30))
    [ep] = episodes
    assert ep.cut == "max_turns" and ep.replies == 2 and ep.env_truncated == 1
    assert ep.messages[-2]["content"].endswith("…[truncated]")
    r, episodes = play(model, tok, monkeypatch, ex, group_size=1,
                       limits=Limits(max_turns=3, episode_tokens=6, reply_tokens=5, env_tokens=50, env_timeout=30))
    assert episodes[0].cut == "episode_tokens" and r.completion_mask.sum() == 6 and not r.ended[0]


def test_a_template_that_rewrites_earlier_turns_is_refused_at_start(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    check_template(tok, tok.eos_token)  # the embedded ChatML template is prefix-preserving
    tok.chat_template = (  # like templates that drop the reasoning of past replies
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}(earlier reply){% else %}{{ m.content }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        check_template(tok, tok.eos_token)


def test_calculator_protocol_and_reward():
    env = CalculatorEnv(seed=0)
    ex = CalculatorEnv.example(964, 59)
    ep = Episode(ex, list(ex.messages), first=len(ex.messages))
    ep.replies = 1
    turn = env.step(ep, "<calc>964*59</calc>")
    assert turn.messages == [{"role": "user", "content": "<result>56876</result>"}] and turn.tool_calls == 1
    ep.parts = dict(turn.parts)
    assert env.step(ep, "964 x 59").messages[0]["content"] == "<result>56876</result>"  # a bare expression is a call
    bad = env.step(ep, "<calc>import os</calc>")
    assert bad.tool_errors == 1 and bad.messages[0]["content"].startswith("<result>error: SyntaxError")
    assert env.step(ep, "So: <answer>56876</answer>").messages is None
    r = env.reward(ep)
    assert r.components == {"correct": 1.0, "tool": 0.2, "format": 0.1} and r.total == pytest.approx(1.3)
    assert env.correct(ep)
    assert arithmetic("(17 + 4) * 3 - 10 / 4") == 60.5 and arithmetic("7//2") == 3


def test_guess_game():
    env = GuessEnv()
    ex = GuessEnv.example(7)
    ep = Episode(ex, list(ex.messages), first=len(ex.messages))
    env.start(ep)
    for reply, expected in (("<guess>5</guess>", "Higher."), ("<guess>9</guess>", "Lower."), ("<guess>7</guess>", None)):
        ep.replies += 1
        turn = env.step(ep, reply)
        assert (turn.messages[0]["content"] if turn.messages else None) == expected
    r = env.reward(ep)
    assert r.components["solved"] == pytest.approx(0.8) and r.components["format"] == pytest.approx(0.2)


def test_register_env_and_custom_environment_files(tmp_path):
    from llmrl import register_env
    from llmrl.errors import ConfigError
    from llmrl.tasks import TASKS, make_task

    register_env("script-env", ScriptEnv)
    assert isinstance(make_task("script-env", seed=0), ScriptEnv)
    with pytest.raises(TypeError, match="not an Environment"):
        register_env("nope", dict)
    TASKS.pop("script-env")
    (tmp_path / "my_env.py").write_text("from llmrl import Environment\nclass Maze(Environment):\n"
                                        "    def __init__(self, seed=0):\n        self.seed = seed\n")
    assert make_task(f"{tmp_path / 'my_env.py'}:Maze", seed=3).seed == 3
    with pytest.raises(ConfigError):
        make_task(f"{tmp_path / 'my_env.py'}:Missing", seed=3)


def test_environment_runs_from_the_cli_logs_turns_and_resumes_exactly(tmp_path, tiny_model_dir):
    """`--task guess` end to end on the tiny model: the environment metrics and transcripts are logged,
    eval plays episodes, and a run killed after step 2 and resumed ends as the uninterrupted one."""
    from helpers import assert_same_run, cli, read_jsonl, tiny_args, train_records

    full, part = tmp_path / "full", tmp_path / "part"
    cli(*tiny_args(tiny_model_dir, full, "grpo", steps=3, task="guess", max_prompt_tokens=256, max_turns=2))
    records = train_records(full)
    for key in ("rollout/turns", "rollout/turns_max", "rollout/tool_calls", "rollout/env_tokens", "rollout/cut_reply_tokens",
                "rollout/env_errors"):
        assert key in records[-1], key
    assert records[-1]["rollout/turns"] >= 1 and records[-1]["rollout/completion_len"] > 0
    samples = read_jsonl(full / "samples.jsonl")
    assert samples[0]["transcript"][0]["role"] == "assistant"
    evals = [r for r in read_jsonl(full / "metrics.jsonl") if "eval/turns" in r]
    assert evals and "eval/solved" in evals[-1]
    cli(*tiny_args(tiny_model_dir, part, "grpo", steps=2, task="guess", max_prompt_tokens=256, max_turns=2))
    cli("train", "--resume", str(part), "--steps", "3")
    assert_same_run(full, part, 3)
