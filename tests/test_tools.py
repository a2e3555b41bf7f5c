"""Tool calling the chat-template way (tasks/tools.py, chat_templates.py) and TRL environment_factory classes."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmrl.chat_templates import CHATML_TOOLS
from llmrl.rollout.base import Sampling
from llmrl.rollout.episodes import Limits, check_template, run_episodes, shows_tools
from llmrl.tasks.base import Example
from llmrl.tasks.tools import ToolCall, parse_tool_calls, run_tool, tool_schema

ROOT = Path(__file__).resolve().parents[1]
COUNTER = ROOT / "examples" / "trl_env" / "counter.py"
ROWS = ROOT / "examples" / "trl_env" / "rows.jsonl"
SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0, min_new_tokens=0, max_new_tokens=60,
                    max_prompt_tokens=400)


def scale(x: float, factor: int = 2, exact: bool = False) -> float:
    """Multiply a number.

    Args:
        x: the number
        factor: by how much
        exact: round nothing
    """
    return x * factor


def test_tool_calls_are_read_in_the_hermes_form_and_in_the_tag_form():
    names = {"scale", "add"}
    reply = ('I will call. <tool_call>\n{"name": "scale", "arguments": {"x": 0.1, "factor": 3}}\n</tool_call>'
             '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'
             '<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>{bad json</tool_call>'
             '<tool_call>["scale"]</tool_call><tool_call>{"name": "scale", "arguments": [1]}</tool_call>')
    calls = parse_tool_calls(reply, names)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("scale", {"x": 0.1, "factor": 3}), ("add", {"a": 1})]
    assert [c.error is None for c in calls] == [True, True, False, False, False, False]
    assert "no tool 'nope'" in calls[2].error and "not valid JSON" in calls[3].error
    # tag form: only names that are tools, only when there is no <tool_call> block
    assert [(c.name, c.arguments) for c in parse_tool_calls("<b>x</b> <scale> 2.5 </scale><add>1</add>", names)] == [
        ("scale", "2.5"), ("add", "1")]
    assert parse_tool_calls("no call here, <scale>", names) == []


def test_a_tool_runs_on_its_typed_arguments_and_every_failure_is_an_error_text():
    assert run_tool(scale, ToolCall("scale", {"x": 0.1, "factor": 3})) == (json.dumps(0.1 * 3), True)  # 0.30000000000000004
    assert run_tool(scale, ToolCall("scale", "0.7")) == (json.dumps(0.7 * 2), True)  # tag text → the float x
    text, ok = run_tool(scale, ToolCall("scale", {"y": 1}))
    assert not ok and text.startswith("error: TypeError")
    text, ok = run_tool(scale, ToolCall("scale", {"x": "a"}))  # "a" * 2 is "aa": a tool may accept odd values
    assert ok and text == "aa"
    assert run_tool(None, ToolCall("?", None, "the tool call is not valid JSON (x)")) == (
        "error: the tool call is not valid JSON (x)", False)
    assert run_tool(lambda: 1 / 0, ToolCall("f", {}))[0] == "error: ZeroDivisionError: division by zero"
    schema = tool_schema(scale)["function"]
    assert schema["name"] == "scale" and schema["parameters"]["required"] == ["x"]
    assert schema["parameters"]["properties"]["factor"] == {"type": "integer", "description": "by how much"}


def test_chatml_tools_renders_as_the_embedded_template_without_tools_and_shows_tools_with_them(embedded_path):
    tok = AutoTokenizer.from_pretrained(embedded_path)
    conversations = [[{"role": "user", "content": "Hi 0.1 + 0.2?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}]]
    own = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g) for m in conversations for g in (False, True)]
    tok.chat_template = CHATML_TOOLS
    assert [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g)
            for m in conversations for g in (False, True)] == own
    schema = tool_schema(scale)
    text = tok.apply_chat_template(conversations[0] + [{"role": "assistant", "content": "<scale>3</scale>"},
                                                       {"role": "tool", "content": "6"}],
                                   tools=[schema], tokenize=False, add_generation_prompt=True)
    assert json.dumps(schema) in text and "<tool_call>" in text
    assert text.endswith("<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    check_template(tok, "<|im_end|>", [schema])  # tool results append as a prefix-preserving delta
    assert shows_tools(tok, [schema])
    tok.chat_template = AutoTokenizer.from_pretrained(embedded_path).chat_template
    assert not shows_tools(tok, [schema])  # SmolLM2's own template ignores tools: a warning at start


class Replies:
    """An engine whose replies are fixed texts (stand-ins for sampling), one list per turn."""

    sampler_logp = False

    def __init__(self, tok, turns: list[str], ended: bool = True):
        self.tok, self.turns, self.calls, self.ended = tok, turns, 0, ended

    def episodes(self):
        import contextlib

        return contextlib.nullcontext()

    def continue_ids(self, contexts, keys, sampling, max_new_tokens, greedy=False, group_size=1, logprobs=True):
        from llmrl.rollout.base import Reply

        text = self.turns[self.calls]
        self.calls += 1
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        if self.ended:
            ids = ids + [self.tok.convert_tokens_to_ids("<|im_end|>")]
        return [Reply(ids, ended=self.ended) for _ in contexts]


def counter_env(tmp_path, reward_funcs=None):
    from llmrl.config import load_config
    from llmrl.tasks import task_from_config

    options = {"environment_factory": f"{COUNTER}:CounterEnv", "dataset": str(ROWS), "env_isolation": "thread"}
    if reward_funcs:
        options["reward_funcs"] = reward_funcs
    return task_from_config(load_config(None, options))


def test_an_environment_factory_class_plays_tool_calls_with_tool_tokens_masked_and_counted(tmp_path, tiny_model_dir):
    """TRL's docs shape (examples/trl_env/counter.py, two typed tools): reset(**row) per episode, Hermes calls
    (two in one reply) and a tag-form call answered as role tool messages, a call with a bad argument counted as a tool error, a
    reply without a call ends the episode; get_reward scores it. The rows' mask is 0 on every tool-result token
    and the loss's gradient at those positions is exactly 0."""
    from llmrl.algorithms.losses import LOSSES, LossSettings
    from llmrl.models.scoring import sequence_logprobs
    from llmrl.tasks.score import score_episodes

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.padding_side = "left"
    tok.chat_template = CHATML_TOOLS
    env = counter_env(tmp_path)
    assert [s["function"]["name"] for s in env.tool_schemas] == ["increment", "read_counter"]
    row = {"prompt": "Make the counter equal 7.", "target": 7}
    ex = Example([{"role": "user", "content": row["prompt"]}], None, meta=row)
    turns = ['<tool_call>{"name": "increment", "arguments": {"amount": 4}}</tool_call>',
             "Now three more: <increment>3</increment>",
             '<tool_call>{"name": "increment", "arguments": {"amount": "x"}}</tool_call>\n'
             '<tool_call>{"name": "read_counter", "arguments": {}}</tool_call>',
             "The counter is 7."]
    limits = Limits(max_turns=5, episode_tokens=400, reply_tokens=200, env_tokens=100, env_timeout=30)
    r, episodes = run_episodes(Replies(tok, turns), env, tok, [ex], group_size=2, seed=0, first_prompt=0,
                               sampling=SAMPLING, limits=limits, eos=[tok.convert_tokens_to_ids("<|im_end|>")])
    ep = episodes[0]
    assert ep.done and ep.replies == 4 and ep.tool_calls == 4 and ep.tool_errors == 1
    assert episodes[0].state is not episodes[1].state  # an instance per episode
    tool_messages = [m for m in ep.messages if m["role"] == "tool"]
    assert [m["content"] for m in tool_messages] == ["4", "7", "error: ValueError: invalid literal for int() with base "
                                                     "10: 'x'", "7"]
    scores = score_episodes(env, episodes, strict=True, where="test")
    assert [s.total for s in scores.rewards] == [1.0, 1.0]
    # the row: the template's rendering with tools; mask 1 on the three replies only
    text = tok.decode(r.input_ids[0][r.attention_mask[0].bool()].tolist())
    assert text.startswith(tok.apply_chat_template(ex.messages, tools=env.tool_schemas, tokenize=False,
                                                   add_generation_prompt=True))
    trajectory = r.input_ids[0, r.prompt_len:].tolist()
    mask = r.completion_mask[0, r.prompt_len - 1:].tolist()
    unmasked = tok.decode([t for t, m in zip(trajectory, mask) if m == 0])
    assert all(f"<tool_response>\n{m['content']}\n</tool_response>" in unmasked for m in tool_messages)
    assert int(r.completion_mask[0].sum()) == sum(len(tok(t, add_special_tokens=False)["input_ids"]) + 1 for t in turns)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    captured = {}

    def keep(module, args, out):
        out.retain_grad()
        captured["out"] = out

    model.get_output_embeddings().register_forward_hook(keep)
    logp, _ = sequence_logprobs(model, r.input_ids, r.attention_mask, r.prompt_len)
    pg, _ = LOSSES["grpo"](logp, logp.detach(), torch.tensor([0.7, -1.3]), r.completion_mask, LossSettings(), None)
    pg.backward()
    per_position = captured["out"].grad.abs().sum(-1)
    scored = r.completion_mask[:, r.prompt_len - 1:][:, : per_position.shape[1]]
    assert per_position[scored == 0].max() == 0.0 and (per_position[scored == 1] > 0).all()


def test_trl_reward_functions_score_an_environment_factory_episode_with_its_environment(tmp_path):
    """TRL's signature with environments=: the components are each function's values and the total their
    weighted sum (weights 1 and 0.3: 0.3 is not exact in binary)."""
    rewards = tmp_path / "rewards.py"
    rewards.write_text(
        "def reached(prompts, completions, environments, target, **kw):\n"
        "    return [float(e.counter == t) for e, t in zip(environments, target)]\n"
        "def calls(prompts, completions, **kw):\n"
        "    return [sum(m['role'] == 'tool' for m in c) / 10 for c in completions]\n")
    from llmrl.config import load_config
    from llmrl.tasks import task_from_config
    from llmrl.tasks.env import Episode

    env = task_from_config(load_config(None, {"environment_factory": f"{COUNTER}:CounterEnv", "dataset": str(ROWS),
                                              "reward_funcs": f"{rewards}:reached,{rewards}:calls",
                                              "reward_weights": "1,0.3"}))
    ex = env.sample_train_batch(1)[0]
    ep = Episode(example=ex, messages=env.reset(ex), first=len(ex.messages))
    env.start(ep)
    ep.state.increment(ex.meta["target"])
    ep.messages += [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "1"},
                    {"role": "assistant", "content": "done"}]
    reward = env.reward(ep)
    assert reward.components == {"reached": 1.0, "calls": 0.1}
    assert reward.total == 1.0 + 0.3 * 0.1
    assert env.data.system == ""  # nothing asks for \boxed{}: the rows' prompts go as they are


def test_an_environment_factory_class_is_code_and_bad_classes_are_one_line(tmp_path):
    from llmrl.config import load_config
    from llmrl.errors import ConfigError
    from llmrl.tasks import resume_command, task_from_config

    cfg = load_config(None, {"environment_factory": f"{COUNTER}:CounterEnv", "prompts": str(ROWS)})
    assert cfg.task == "dataset" and cfg.dataset == str(ROWS)  # rows from a prompts file
    assert resume_command(cfg, "R") == "llmrl train --resume R --trust_task_code"
    bad = tmp_path / "bad.py"
    bad.write_text("class NoTools:\n    def reset(self, **kw):\n        pass\n    def get_reward(self):\n        return 0.0\n"
                   "class Untyped:\n    def reset(self, **kw):\n        pass\n    def act(self, x):\n        return x\n"
                   "    def get_reward(self):\n        return 0.0\n"
                   "class Unscored:\n    def reset(self, **kw):\n        pass\n    def act(self, x: int) -> int:\n"
                   "        '''Act.\n\n        Args:\n            x: a number\n        '''\n        return x\n")
    unanswered = tmp_path / "rows.jsonl"  # no answer column for a grader
    unanswered.write_text("".join(json.dumps({"prompt": f"Go {k}.", "level": k}) + "\n" for k in range(5)))
    for cls, message in (("NoTools", "no public method to use as a tool"), ("Untyped", "tool 'act': no JSON schema"),
                         ("Unscored", "nothing scores an episode")):
        with pytest.raises(ConfigError, match=message):
            task_from_config(load_config(None, {"environment_factory": f"{bad}:{cls}", "dataset": str(unanswered)}))


@pytest.mark.slow
def test_an_environment_factory_class_trains_two_steps_on_the_embedded_model_with_the_tool_template(tmp_path):
    from helpers import cli, read_jsonl

    out = tmp_path / "run"
    cli("train", "--model", "smollm2-135m-instruct", "--environment_factory", f"{COUNTER}:CounterEnv",
        "--dataset", str(ROWS), "--chat_template", "chatml-tools", "--steps", "2", "--batch_size", "1",
        "--group_size", "2", "--minibatch_size", "2", "--max_new_tokens", "24", "--max_turns", "2",
        "--max_prompt_tokens", "400", "--eval_interval", "2", "--eval_n", "1", "--save_interval", "2",
        "--sample_log_interval", "1", "--output_dir", str(out), "--num_threads", "2")
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all("rollout/tool_calls" in r and "rollout/tool_errors" in r and r["rollout/turns"] >= 1 for r in train)
    samples = read_jsonl(out / "samples.jsonl")
    assert samples and all("transcript" in s for s in samples)


def test_a_cut_reply_is_stepped_where_the_environment_scores_every_output(tiny_model_dir):
    """step_cut_replies: a reply cut at the token cap still reaches step (its reward parts count), and the
    episode ends cut (what step returns is not appended); without it the cut reply is not stepped."""
    from llmrl.tasks.env import Environment, Turn

    class Scores(Environment):
        max_turns = 3

        def step(self, episode, reply):
            return Turn([{"role": "user", "content": "more"}], parts={"seen": 0.25})

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ex = Example([{"role": "user", "content": "Go."}], None)
    limits = Limits(max_turns=3, episode_tokens=400, reply_tokens=200, env_tokens=100, env_timeout=30)
    for step_cut, parts in ((True, {"seen": 0.25}), (False, {})):
        env = Scores()
        env.step_cut_replies = step_cut
        _, (ep,) = run_episodes(Replies(tok, ["a long reply that was cut"], ended=False), env, tok, [ex], group_size=1,
                                seed=0, first_prompt=0, sampling=SAMPLING, limits=limits, eos=[2])
        assert ep.cut == "reply_tokens" and ep.truncated and ep.replies == 1 and ep.parts == parts
        assert [m["role"] for m in ep.transcript] == ["assistant"]


def test_reset_text_follows_the_prompt_after_a_blank_line():
    """What an environment_factory's reset returns is its own paragraph, not glued to the prompt's last word; a
    side that already has whitespace there keeps it as it is."""
    from llmrl.tasks.tools import joined

    assert joined("Make the counter equal 7.", "Counter: 0") == "Make the counter equal 7.\n\nCounter: 0"
    assert joined("Board:\n", "x.o") == "Board:\nx.o"
    assert joined("Go.", " now") == "Go. now"
    assert joined("", "Counter: 0") == "Counter: 0" and joined("Go.", "") == "Go."


def test_the_start_line_names_the_tools_every_prompt_shows(tmp_path, tiny_model_dir):
    """With --steps 2 the user still sees that the schemas reached the prompt: the tool names with their
    arguments and the prompt tokens they add, counted from the template's own rendering."""
    from llmrl.rollout.episodes import tools_line
    from llmrl.rollout.prompts import text_ids

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.chat_template = CHATML_TOOLS
    env = counter_env(tmp_path)
    hi = [{"role": "user", "content": "Hi."}]
    extra = (len(text_ids(tok, tok.apply_chat_template(hi, tools=env.tool_schemas, tokenize=False, add_generation_prompt=True)))
             - len(text_ids(tok, tok.apply_chat_template(hi, tokenize=False, add_generation_prompt=True))))
    assert extra > 50  # two JSON schemas and the calling instructions
    assert tools_line(tok, env.tool_schemas) == f"tools in every prompt: increment(amount), read_counter() (+{extra} prompt tokens)"
