"""Multi-turn rollouts, token-in/token-out: the one place that knows how an episode becomes a row.

A row is the left-padded first prompt (width P, shared by the G rows of its group), then the
trajectory: reply 1 (sampled, up to and including its EOS), the ids of the environment's answer,
reply 2, ... , right-padded. Each turn generates from the exact ids so far; an environment message is
appended as the ids of its chat-template delta (the text the template puts after the assistant's
end-of-turn token, rendered with a placeholder reply), so earlier turns are never re-rendered or
re-tokenised. completion_mask is 1 on sampled tokens only: 0 on the prompt, on environment tokens and
on padding, so every log-prob, KL, loss aggregation and token count downstream sees the same tokens.

    check_template(tokenizer, eos_text)      at start-up: the template must be prefix-preserving
    run_episodes(engine, env, ...)           G episodes per example → (Rollout, episodes)

A single-turn task is the one-turn case (`OneTurn`): its rows are made here too, by the same code.
The environment's steps of one turn run at once, in the run's step workers (tasks/workers.py: processes
that are killed at env_timeout, or threads); what reset and step return is checked, and a value of the
wrong kind ends its episode like a raise (env_error, reward 0, counted), never the run. A user's environment's
reset and start run within user_code_timeout (tasks/custom.py: UserCode): one that overruns ends its episodes
the same way, counted in rollout/env_timeouts too; too many overrunning calls still running stop the run
(UserCodeStuck, one line).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

from llmrl.batch import EpisodeCounts
from llmrl.errors import ConfigError, EngineDied
from llmrl.rng import kept_rng_state
from llmrl.rollout.base import Rollout, Sampling
from llmrl.rollout.keyed import mix
from llmrl.rollout.prompts import render, template_ids, text_ids
from llmrl.tasks.base import Example
from llmrl.tasks.env import Episode, OneTurn, Turn, checked_messages, finish_episodes
from llmrl.tasks.workers import TIMEOUT, ProcessSteps, ThreadSteps, env_steps, error_text

PLACEHOLDER = "LLMRL-REPLY-7f3a"  # a reply text no template rewrites
TRUNCATED = " …[truncated]"


@dataclass
class Limits:
    """What ends an episode besides the environment (config: max_turns, episode_tokens, max_env_tokens, env_timeout)."""

    max_turns: int
    episode_tokens: int  # sampled tokens per episode, all replies together
    reply_tokens: int  # sampled tokens per reply (max_new_tokens)
    env_tokens: int  # tokens one environment turn may add, all its messages together (capped_turn)
    env_timeout: float  # seconds one env.step may take
    framing: int = 0  # tokens an environment turn may add beyond env_tokens (the template's framing, the cut marker)

    def context_tokens(self, prompt_tokens: int, reply_tokens: int = 0) -> int:
        """The longest row an engine must hold: the prompt, the episode's sampled tokens (its budget, or
        `reply_tokens` if more: eval's cap) and each environment turn between replies, plus 8 spare."""
        return prompt_tokens + max(self.episode_tokens, reply_tokens) + (self.max_turns - 1) * (self.env_tokens + self.framing) + 8


class TemplateError(ConfigError):
    pass


def delta_ids(tokenizer, history: list[dict[str, str]], new: list[dict[str, str]], end_text: str,
              tools: list[dict] | None = None) -> list[int]:
    """The token ids of the text the chat template puts after an assistant reply's end-of-turn token when
    `new` messages follow it, up to the next reply's start (generation prompt included); the new messages'
    contents are plain text (prompts.template_ids: a spelled special token stays text).

    Rendered twice with a placeholder reply: history + reply, and history + reply + new + generation
    prompt; the first must be a prefix of the second (else earlier turns would be re-rendered), and the
    reply must be closed by `end_text` (the end-of-turn token the policy generates); `tools`: the schemas the
    prompt was rendered with."""
    reply = {"role": "assistant", "content": PLACEHOLDER}
    before = tokenizer.apply_chat_template([*history, reply], tools=tools, tokenize=False)
    end = before.rindex(PLACEHOLDER) + len(PLACEHOLDER)
    if not before.startswith(end_text, end):
        raise TemplateError(f"the model's chat template does not close an assistant reply with its end-of-turn token "
                            f"{end_text!r} (it writes {before[end:end + 20]!r}): the policy's replies cannot be "
                            "continued token for token")

    def delta(messages: list[dict[str, str]]) -> str:
        after = tokenizer.apply_chat_template([*history, reply, *messages], tools=tools, tokenize=False,
                                              add_generation_prompt=True)
        if not after.startswith(before):
            raise TemplateError("the model's chat template is not prefix-preserving: rendering one more turn changes "
                                "the earlier ones (e.g. it drops reasoning from past replies), so multi-turn "
                                "token-in/token-out rollouts cannot append turns; use a model or template without "
                                "that rewrite")
        return after[end + len(end_text):]

    return template_ids(tokenizer, delta, new)


def end_of_turn(tokenizer, eos: list[int]) -> int:
    """The EOS id the chat template writes right after an assistant reply (render a placeholder reply, read
    the token after it): Qwen2.5-Instruct's <|im_end|> 151645, not <|endoftext|> 151643; Llama-3's <|eot_id|>.
    A template that closes replies with none of the EOS ids is a one-line TemplateError."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi."},
                                          {"role": "assistant", "content": PLACEHOLDER}], tokenize=False)
    after = text[text.rindex(PLACEHOLDER) + len(PLACEHOLDER):]
    first = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
    if not first or first[0] not in eos:
        raise TemplateError(f"the model's chat template does not close an assistant reply with one of its EOS tokens "
                          f"{[tokenizer.decode([e]) for e in eos]} (it writes {after[:20]!r}): the policy's replies "
                          "cannot be continued token for token")
    return first[0]


def shows_tools(tokenizer, tools: list[dict]) -> bool:
    """Whether the chat template renders `tools` at all (a template without tool support ignores them)."""
    messages = [{"role": "user", "content": "Hi."}]
    return (tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            != tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def tools_line(tokenizer, tools: list[dict]) -> str:
    """One line saying which tools every prompt shows and what their schemas cost: "tools in every prompt:
    increment(amount), read_counter() (+187 prompt tokens)" (the template's rendering with and without them)."""
    messages = [{"role": "user", "content": "Hi."}]
    extra = (len(text_ids(tokenizer, tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                                   add_generation_prompt=True)))
             - len(text_ids(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))))
    names = [f"{t['function']['name']}({', '.join(t['function'].get('parameters', {}).get('properties', {}))})"
             for t in tools if isinstance(t, dict) and "function" in t]
    return f"tools in every prompt: {', '.join(names)} (+{extra} prompt tokens)"


def check_template(tokenizer, end_text: str, tools: list[dict] | None = None) -> None:
    """Start-up check for environments: the template renders k turns as a prefix of k + 1 (two deltas; with
    tools, of tool results as the environment's messages)."""
    role = "tool" if tools else "user"
    history = [{"role": "user", "content": "Start."}]
    for k in range(2):
        delta_ids(tokenizer, history, [{"role": role, "content": f"Turn {k}."}], end_text, tools)
        history = [*history, {"role": "assistant", "content": f"Reply {k}."}, {"role": role, "content": f"Turn {k}."}]


def message_overhead(tokenizer, end_text: str, tools: list[dict] | None = None) -> int:
    """Tokens the chat template adds around one environment message (its delta with empty content:
    the end of the reply's turn, the message's framing, the next generation prompt): an upper bound of
    what each message of a turn costs beyond its content (with tools: the larger of a user and a tool message)."""
    history = [{"role": "user", "content": "Hi."}]
    return max(len(delta_ids(tokenizer, history, [{"role": role, "content": ""}], end_text, tools))
               for role in (("user", "tool") if tools else ("user",)))


def capped_turn(tokenizer, messages: list[dict[str, str]], max_tokens: int, overhead: int) -> tuple[list[dict[str, str]], int]:
    """One environment turn's messages within max_tokens tokens all together, however many there are:
    each costs its content's tokens plus, after the first, `overhead` (the template's framing of a
    message); the message that reaches the cap is cut (with a marker), those after it are dropped.
    Returns the messages kept and how many were cut or dropped."""
    kept, cut, left = [], 0, max_tokens
    for k, m in enumerate(messages):
        left -= overhead if k else 0
        if left <= 0:
            return kept, cut + len(messages) - k
        ids = text_ids(tokenizer, m["content"])
        if len(ids) > left:
            m, cut, ids = {**m, "content": tokenizer.decode(ids[:left]) + TRUNCATED}, cut + 1, ids[:left]
        kept.append(m)
        left -= len(ids)
    return kept, cut


def env_tools(env) -> list[dict] | None:
    """The tool schemas an environment's template shows (its `tool_schemas`), None for a single-turn task or none."""
    return None if isinstance(env, OneTurn) else getattr(env, "tool_schemas", None) or None


def run_episodes(engine, env, tokenizer, examples: list[Example], *, group_size: int, seed: int, first_prompt: int,
                 sampling: Sampling, limits: Limits, eos: list[int], greedy: bool = False,
                 device: torch.device | str = "cpu", steps: ProcessSteps | ThreadSteps | None = None,
                 logprobs: bool = True) -> tuple[Rollout, list[Episode]]:
    """group_size episodes per example (prompt-major), every turn of every live episode in one engine
    call; sampling noise keyed by (seed, first_prompt + b, g, turn) (turn 0: that of a single-turn
    completion). The environment's steps of a turn run together in `steps` (the run's; None: threads
    for this call only). Returns the rows as a Rollout on `device` (the trainer's; logp_old None: the
    trainer scores them, except hf's sampler log-probs; engine_logp when the engine gave log-probs for
    every reply; `logprobs` False, as eval asks: neither) and the episodes."""
    one_turn = isinstance(env, OneTurn)
    tools = env_tools(env)  # shown by the template
    step_cut = not one_turn and bool(getattr(env, "step_cut_replies", False))  # env.step sees cut replies too
    # the end-of-turn id the template closes a reply with; a reply that ends on another EOS id ends its episode
    turn_end = None if one_turn or limits.max_turns == 1 else end_of_turn(tokenizer, eos or [tokenizer.eos_token_id])
    end_text = "" if turn_end is None else tokenizer.decode([turn_end])
    if steps is None and not one_turn:
        with contextlib.closing(ThreadSteps(env, 4)) as own:
            return run_episodes(engine, env, tokenizer, examples, group_size=group_size, seed=seed,
                                first_prompt=first_prompt, sampling=sampling, limits=limits, eos=eos, greedy=greedy,
                                device=device, steps=own, logprobs=logprobs)
    episodes, contexts, prompts, tails = [], [], [], []
    try:
        truncated = 0
        for b, ex in enumerate(examples):
            error = None
            if one_turn:
                first = env.reset(ex)
            else:
                try:
                    with kept_rng_state():  # a library that reseeds the global RNGs cannot move the trainer's
                        first = checked_messages(env.reset(ex), "reset")
                except EngineDied:  # user code that stops the run (UserCodeStuck)
                    raise
                except Exception as e:  # noqa: BLE001 - a user's environment may raise anything
                    # the episodes end before their first reply; their rows still need a prompt
                    first, error = [{"role": "user", "content": ""}], error_text(e)
            ids = render(tokenizer, first, tools)
            truncated += len(ids) > sampling.max_prompt_tokens
            ids = ids[-sampling.max_prompt_tokens:]
            for _ in range(group_size):
                ep = Episode(example=ex, messages=list(first), first=len(first))
                if error is None:
                    try:
                        with kept_rng_state():
                            env.start(ep)
                    except EngineDied:
                        raise
                    except Exception as e:  # noqa: BLE001
                        ep.cut, ep.error = "env_error", error_text(e)
                else:
                    ep.cut, ep.error = "env_error", error
                episodes.append(ep)
                prompts.append(ids)
                contexts.append(list(ids))
                tails.append([])  # (token ids, sampled?, engine log-probs, engine entropies (or None)) segments
        keys = [mix(seed, first_prompt + b, g) for b in range(len(examples)) for g in range(group_size)]
        spent = [0] * len(episodes)
        overhead = 0 if one_turn or limits.max_turns == 1 else message_overhead(tokenizer, end_text, tools)
        # hf: each episode's KV cache carries over to its next turn (one turn: nothing to carry)
        with engine.episodes() if limits.max_turns > 1 else contextlib.nullcontext():
            for turn in range(limits.max_turns):
                live = [i for i, ep in enumerate(episodes) if not ep.done and ep.cut is None]
                if not live:
                    break
                budgets = [min(limits.reply_tokens, limits.episode_tokens - spent[i]) for i in live]
                turn_keys = [keys[i] if turn == 0 else mix(keys[i], turn) for i in live]
                # turn 0: a group shares its prompt (unless the environment's start failed for part of one)
                shared = turn == 0 and len(live) == group_size * len({i // group_size for i in live})
                replies = engine.continue_ids([contexts[i] for i in live], turn_keys, sampling, max(budgets), greedy=greedy,
                                              group_size=group_size if shared else 1, logprobs=logprobs)
                stepping = []  # the episodes whose reply ended: the environment answers each
                for i, budget, reply in zip(live, budgets, replies):
                    ep = episodes[i]
                    ids, ended = reply.ids[:budget], reply.ended and len(reply.ids) <= budget
                    tails[i].append((ids, True, *(None if x is None else x[: len(ids)] for x in (reply.logp, reply.entropy))))
                    contexts[i] += ids
                    spent[i] += len(ids)
                    text = tokenizer.decode(ids[: len(ids) - int(ended)], skip_special_tokens=True)
                    ep.messages.append({"role": "assistant", "content": text})
                    ep.replies += 1
                    if not ended:
                        ep.cut = "reply_tokens" if spent[i] < limits.episode_tokens else "episode_tokens"
                        ep.truncated = True
                        if step_cut:  # the environment scores every output, a cut one too (its episode ends)
                            stepping.append((i, text, False))
                        continue
                    stepping.append((i, text, turn_end is not None and ids[-1] != turn_end))
                # a single-turn task has no step to run; an environment's steps of this turn run at once
                if one_turn:
                    outs = [Turn(None)] * len(stepping)
                else:
                    with kept_rng_state():  # steps on threads share the trainer's global RNGs
                        outs = steps.run([(episodes[i], text) for i, text, _ in stepping], limits.env_timeout)
                for (i, _, other_eos), out in zip(stepping, outs):
                    ep = episodes[i]
                    if isinstance(out, str):  # it raised, overran or returned something that is not a Turn
                        ep.cut, ep.error = "env_error", out
                        continue
                    for name, v in out.parts.items():
                        ep.parts[name] = ep.parts.get(name, 0.0) + v
                    ep.tool_calls += out.tool_calls
                    ep.tool_errors += out.tool_errors
                    if ep.cut is not None:  # a cut reply's step (step_cut_replies): scored, the episode stays cut
                        continue
                    if out.messages is None or other_eos:  # the environment ended it, or the reply's EOS id did
                        ep.done = ep.cut is None
                        continue
                    if spent[i] >= limits.episode_tokens:
                        ep.cut = "episode_tokens"
                        continue
                    if turn + 1 == limits.max_turns:
                        ep.cut = "max_turns"
                        continue
                    new, cut = capped_turn(tokenizer, out.messages, limits.env_tokens, overhead)
                    ep.env_truncated += cut
                    # the history before this reply: delta_text renders it with a placeholder reply
                    delta = delta_ids(tokenizer, ep.messages[:-1], new, end_text, tools)
                    tails[i].append((delta, False, None, None))
                    contexts[i] += delta
                    ep.env_tokens += len(delta)
                    ep.messages += new
        rows = to_rows(prompts, tails, episodes, tokenizer.pad_token_id, truncated, device)
        if engine.sampler_logp:  # hf: the sampler's fp32 logits are the policy's (no second forward)
            rows.logp_old, rows.engine_logp = rows.engine_logp, None
        return rows, episodes
    except BaseException:  # the engine or the step workers failed: the episodes begun still end
        if not one_turn:
            finish_episodes(env, episodes, "a rollout that failed")
        raise


Segment = tuple[list[int], bool, list[float] | None, list[float] | None]  # ids, sampled?, engine log-probs, entropies


def to_rows(prompts: list[list[int]], tails: list[list[Segment]], episodes: list[Episode], pad_id: int,
            truncated: int, device: torch.device | str = "cpu") -> Rollout:
    """Episodes as one Rollout on `device`: prompts left-padded to P, trajectories right-padded to T; mask
    1 on sampled tokens (column P+j−1 scores tail token j); engine_logp (and entropy) where every reply
    has them; `ended` False where the last reply was cut by a token cap (an episode ended by max_turns, an
    environment error or the episode budget after a whole reply is not truncated)."""
    n = len(prompts)
    p = max(len(x) for x in prompts)
    t = max(1, max(sum(len(seg[0]) for seg in tail) for tail in tails))
    input_ids = torch.full((n, p + t), pad_id, dtype=torch.long)
    attention = torch.ones(n, p + t, dtype=torch.long)
    mask = torch.zeros(n, p + t - 1)
    per_token = [torch.zeros(n, p + t - 1) if all(seg[k] is not None for tail in tails for seg in tail if seg[1]) else None
                 for k in (2, 3)]  # engine log-probs, entropies
    for i, (prompt, tail) in enumerate(zip(prompts, tails)):
        input_ids[i, p - len(prompt): p] = torch.tensor(prompt, dtype=torch.long)
        attention[i, : p - len(prompt)] = 0
        col = p
        for ids, sampled, *values in tail:
            if ids:
                input_ids[i, col: col + len(ids)] = torch.tensor(ids, dtype=torch.long)
                if sampled:
                    mask[i, col - 1: col - 1 + len(ids)] = 1.0
                    for out, v in zip(per_token, values):
                        if out is not None:
                            out[i, col - 1: col - 1 + len(ids)] = torch.tensor(v, dtype=torch.float32)
            col += len(ids)
    ended = torch.tensor([not ep.truncated for ep in episodes])  # a row is truncated when its last reply was cut
    texts = [ep.last_reply for ep in episodes]

    def on(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x.to(device)

    return Rollout(input_ids=on(input_ids), attention_mask=on(attention), completion_mask=on(mask), logp_old=None,
                   logp_ref=None, ended=on(ended), prompt_len=p, texts=texts, prompts_truncated=truncated,
                   engine_logp=on(per_token[0]), entropy=on(per_token[1]))


@dataclass
class EpisodeRunner:
    """run_episodes with a run's tokenizer, limits and EOS ids bound (what step and eval call)."""

    env: object
    tokenizer: object
    limits: Limits
    eos: list[int]
    device: torch.device | str = "cpu"  # where the rows go (the trainer's device)
    steps: ProcessSteps | ThreadSteps | None = None  # the run's step workers (None: a single-turn task)

    def __call__(self, engine, examples: list[Example], *, group_size: int, seed: int, first_prompt: int,
                 sampling: Sampling, greedy: bool = False, logprobs: bool = True) -> tuple[Rollout, list[Episode]]:
        return run_episodes(engine, self.env, self.tokenizer, examples, group_size=group_size, seed=seed,
                            first_prompt=first_prompt, sampling=sampling, limits=self.limits, eos=self.eos,
                            greedy=greedy, device=self.device, steps=self.steps, logprobs=logprobs)

    @property
    def single_turn(self) -> bool:
        """A single-turn task's runner (`OneTurn`: one reply, scored on its text), not an environment's."""
        return isinstance(self.env, OneTurn)

    def abandoned(self) -> int:
        """The step workers' gauge for the step's rollout/ metrics: abandoned steps still running (threads)."""
        return self.steps.abandoned if self.steps is not None else 0


def episode_runner(cfg, env, tokenizer, eos: list[int], device: torch.device | str = "cpu") -> EpisodeRunner:
    """The runner of a config's environment (a single-turn task: `OneTurn(task)`, one reply of at most
    max_new_tokens), with its step workers (env_isolation, env_workers; the pool's processes start at the
    first step); checks the chat template first for more than one turn (one ConfigError line)."""
    single = isinstance(env, OneTurn)
    if single:
        turns, budget = 1, cfg.max_new_tokens
    else:
        turns = cfg.max_turns or env.max_turns
        budget = cfg.episode_tokens or turns * cfg.max_new_tokens
    limits = Limits(max_turns=turns, episode_tokens=budget, reply_tokens=cfg.max_new_tokens,
                    env_tokens=cfg.max_env_tokens, env_timeout=cfg.env_timeout)
    tools = env_tools(env)
    if tools and not shows_tools(tokenizer, tools):
        print("llmrl: warning: the chat template does not show tools (rendering with tools= changes nothing): the "
              "model never sees the tools' schemas; use a template with tools (--chat_template chatml-tools for "
              "ChatML models, or --chat_template FILE)", file=sys.stderr)
    elif tools:
        print(f"llmrl: {tools_line(tokenizer, tools)}", file=sys.stderr)
    if turns > 1:
        end_text = tokenizer.decode([end_of_turn(tokenizer, eos or [tokenizer.eos_token_id])])
        check_template(tokenizer, end_text, tools)
        limits.framing = message_overhead(tokenizer, end_text, tools) + len(text_ids(tokenizer, TRUNCATED))
    # an environment whose episodes hold live connections (openenv) requires threads
    steps = None if single else env_steps(getattr(env, "required_isolation", None) or cfg.env_isolation, env, cfg.env_workers)
    return EpisodeRunner(env, tokenizer, limits, eos, device, steps)


def one_turn(engine, tokenizer, messages: list[list[dict[str, str]]], *, group_size: int, seed: int,
             sampling: Sampling, device: torch.device | str = "cpu", first_prompt: int = 0, greedy: bool = False) -> Rollout:
    """group_size completions per prompt (prompt-major) on `device`, drawn exactly as a single-turn
    training step draws them (greedy: as greedy eval does): one-turn episodes, noise keyed by
    (seed, first_prompt + b, g); their texts in `.texts`."""
    limits = Limits(max_turns=1, episode_tokens=sampling.max_new_tokens, reply_tokens=sampling.max_new_tokens,
                    env_tokens=0, env_timeout=60.0)
    examples = [Example(messages=m, answer=None) for m in messages]
    return run_episodes(engine, OneTurn(None), tokenizer, examples, group_size=group_size, seed=seed,
                        first_prompt=first_prompt, sampling=sampling, limits=limits, eos=[], greedy=greedy,
                        device=device)[0]


def episode_counts(episodes: list[Episode], abandoned: int = 0) -> EpisodeCounts:
    """Sums (turns_max: the maximum) over episodes, for the step's rollout/ metrics (means are taken after
    merging ranks and rounds: batch.EpisodeCounts.logged); `abandoned`: the step workers' gauge."""
    return EpisodeCounts(
        episodes=len(episodes), turns=sum(ep.replies for ep in episodes),
        turns_max=max((ep.replies for ep in episodes), default=0),
        tool_calls=sum(ep.tool_calls for ep in episodes), tool_errors=sum(ep.tool_errors for ep in episodes),
        env_tokens=sum(ep.env_tokens for ep in episodes), env_truncated=sum(ep.env_truncated for ep in episodes),
        env_errors=sum(ep.cut == "env_error" for ep in episodes),
        env_timeouts=sum(ep.cut == "env_error" and (ep.error or "").startswith(TIMEOUT) for ep in episodes),
        **{f"cut_{why}": sum(ep.cut == why for ep in episodes) for why in ("max_turns", "episode_tokens", "reply_tokens")},
        env_abandoned=abandoned)
