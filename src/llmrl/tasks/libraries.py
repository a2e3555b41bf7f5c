"""Tasks from environment libraries, named `--task LIBRARY:NAME` (each library an optional extra that leaves
llmrl's torch and transformers as they are).

    --task reasoning_gym:chain_sum                     pip install "llmrl[reasoning-gym]"
    --task reasoning_gym:chain_sum,spell_backward      a mixture (task_args weights: {name: weight})
    --task textarena:GuessTheNumber-v0                 pip install "llmrl[textarena]"
    --task skyrl_gym:gsm8k --dataset rows.jsonl        pip install "llmrl[skyrl-gym]"
    --task openenv:http://HOST:PORT                    pip install "llmrl[openenv]"
    --task verifiers:TASKSET                           pip install "llmrl[verifiers]"  (single-turn tasksets)

reasoning-gym: procedural datasets (`reasoning_gym.create_dataset(name, size=, seed=, **config)`), each
item scored by the dataset's own `score_answer(extract_answer(completion), item)` (partial credit where
the dataset gives it), with reasoning-gym's default system prompt asking for `<answer>…</answer>`.
Training items come from `size` items seeded by the run's seed; eval items from another seed, minus any
whose question is also a training item (the data report counts them). task_args: size, eval_size,
weights ({name: weight}), configs ({name: {option: value}}: the dataset's own options), system_prompt
(one of reasoning-gym's SYSTEM_PROMPTS names, text, or "" for none), shots (k solved items of each dataset
shown before the question as earlier turns, user question then assistant `<answer>gold</answer>`; they
are the dataset's first k training items, taken out of the training pool. A small model that ignores the
system prompt's format copies it from these turns).

Logged: reward/score (the mean score), and with several datasets reward/<name> (each dataset's mean score
over its own rows, a metric outside the total); eval/score, eval/correct (full credit) and, with several
datasets, eval/<name>/score and eval/<name>/correct. pass@k counts full credit only.
"""

from __future__ import annotations

import difflib
import importlib
import random
import threading
from typing import Any

from llmrl.errors import ConfigError, DataError
from llmrl.install import pip_install
from llmrl.tasks.base import Example, Judgement, Reward, SeededSampling, mean_of
from llmrl.tasks.env import Environment, Episode, Instances, OnRows, Turn
from llmrl.tasks.workers import Pending, check_stuck, user_calls

EXTRAS = {"reasoning_gym": "reasoning-gym", "textarena": "textarena", "skyrl_gym": "skyrl-gym", "openenv": "openenv",
          "verifiers": "verifiers"}  # the library's module → its llmrl extra
EVAL_SEED_OFFSET = 1_000_003
PREFETCH = 64  # OpenEnv: sessions a reset opens at once, for the examples after it in the batch


def import_library(module: str):
    """The library's module, or one ConfigError line saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"task {module}:…: the {module} library is not installed ({e}); install it with "
                          + pip_install(EXTRAS.get(module, module))) from None


def closest(name: str, known, exist: str = "exist", examples: str | None = None) -> str:
    """`did you mean A or B? (N exist)` for an unknown name of a library's, else a few of the N known names."""
    known = sorted(known)
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if near:
        return f"did you mean {' or '.join(near)}? {len(known)} {exist}"
    return f"{len(known)} {exist}, e.g. {examples or ', '.join(known[:5])}"


def is_library_task(name: str) -> bool:
    return name.partition(":")[0] in LIBRARY_TASKS and bool(name.partition(":")[2])


def library_task(name: str, seed: int, task_args: dict[str, Any]) -> Any:
    """The task of `LIBRARY:NAME[,NAME…]`, built with the run's seed and task_args."""
    from llmrl.tasks.custom import construct

    library, _, names = name.partition(":")
    return construct(name, LIBRARY_TASKS[library], {"seed": seed, "names": names} | task_args)


class ReasoningGymTask(SeededSampling):
    """One or a weighted mixture of reasoning-gym datasets, scored by reasoning-gym itself."""

    name = "reasoning_gym"
    eval_n_default = 128

    def __init__(self, seed: int = 0, names: str = "", size: int = 5000, eval_size: int = 256,
                 weights: dict[str, float] | None = None, configs: dict[str, dict[str, Any]] | None = None,
                 system_prompt: str = "default", shots: int = 0):
        rg = import_library("reasoning_gym")
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        self.extract_answer = extract_answer
        self.names = [n.strip() for n in names.split(",") if n.strip()]
        if not self.names:
            raise ConfigError("task reasoning_gym:NAME[,NAME…]: name at least one dataset")
        unknown = [n for n in self.names if n not in rg.factory.DATASETS]
        if unknown:
            raise ConfigError(f"task reasoning_gym: no dataset {unknown[0]!r} "
                              f"({closest(unknown[0], rg.factory.DATASETS)})")
        weights, configs = dict(weights or {}), dict(configs or {})
        if set(weights) - set(self.names) or set(configs) - set(self.names):
            raise ConfigError(f"task_args weights/configs name datasets outside {self.names}")
        self.weights = [float(weights.get(n, 1.0)) for n in self.names]
        if not all(w >= 0 for w in self.weights) or not any(self.weights):
            raise ConfigError(f"task_args weights {weights}: must be non-negative, not all 0")
        if not isinstance(shots, int) or isinstance(shots, bool) or not 0 <= shots < size:
            raise ConfigError(f"task_args shots {shots!r}: a whole number of solved turns, 0 <= shots < size {size}")
        self.system = SYSTEM_PROMPTS.get(system_prompt, system_prompt)
        self.shots: dict[str, list[dict[str, str]]] = {}
        self.rng = random.Random(seed)
        self.datasets, self.train, self.eval = {}, {}, []
        report: dict[str, Any] = {"datasets": {}}
        for n in self.names:
            try:
                ds = rg.create_dataset(n, size=size, seed=seed, **configs.get(n, {}))
                held = rg.create_dataset(n, size=eval_size, seed=seed + EVAL_SEED_OFFSET, **configs.get(n, {}))
            except Exception as e:  # noqa: BLE001 - a bad option of the dataset's own config
                raise ConfigError(f"task reasoning_gym:{n}: create_dataset raised {type(e).__name__}: {e}") from None
            self.datasets[n] = ds
            items = [ds[i] for i in range(len(ds))]
            self.shots[n] = [turn for item in items[:shots] for turn in (
                {"role": "user", "content": item["question"]},
                {"role": "assistant", "content": f"<answer>{item['answer']}</answer>"})]
            self.train[n] = items[shots:]
            seen = {item["question"] for item in items}
            fresh = [item for item in (held[i] for i in range(len(held))) if item["question"] not in seen]
            self.eval += [(n, item) for item in fresh]
            report["datasets"][n] = {"train": len(self.train[n]), "eval": len(fresh),
                                     "eval_dropped_as_in_train": len(held) - len(fresh)}
        self.data_report = report
        if not self.eval:
            raise DataError(f"task reasoning_gym:{names}: every eval item is also a training item; raise eval_size or "
                            "lower size")
        if len(self.names) > 1:  # eval interleaves the datasets, so the first eval_n hold each of them
            by_name = {n: [e for e in self.eval if e[0] == n] for n in self.names}
            self.eval = [pair for group in zip(*by_name.values()) for pair in group] + [
                pair for n in self.names for pair in by_name[n][min(map(len, by_name.values())):]]

    def example(self, name: str, item: dict[str, Any]) -> Example:
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.shots[name] + [
            {"role": "user", "content": item["question"]}]
        return Example(messages=messages, answer=item["answer"], meta={"dataset": name, "item": item})

    def sample_train_batch(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            name = self.rng.choices(self.names, weights=self.weights)[0]
            out.append(self.example(name, self.train[name][self.rng.randrange(len(self.train[name]))]))
        return out

    def eval_examples(self, n: int) -> list[Example]:
        return [self.example(name, item) for name, item in self.eval[:n]]

    def score(self, example: Example, completion: str) -> tuple[float, str | None]:
        """(reasoning-gym's score of the completion's answer, that answer)."""
        name = example.meta["dataset"]
        answer = self.extract_answer(completion)
        return float(self.datasets[name].score_answer(answer, example.meta["item"])), answer

    def reward(self, example: Example, completion: str) -> Reward:
        s, _ = self.score(example, completion)
        metrics = {example.meta["dataset"]: s} if len(self.names) > 1 else {}
        return Reward(total=s, components={"score": s}, metrics=metrics)

    def judge(self, examples: list[Example], completions: list[str]) -> list[Judgement]:
        scored = [self.score(ex, c) for ex, c in zip(examples, completions, strict=True)]
        return [Judgement(s == 1.0, answer) for s, answer in scored]

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]:
        scores = [(ex.meta["dataset"], self.score(ex, c)[0]) for ex, c in zip(examples, completions, strict=True)]
        out = {"score": mean_of([s for _, s in scores]), "correct": mean_of([s == 1.0 for _, s in scores])}
        if len(self.names) > 1:
            for n in self.names:
                mine = [s for name, s in scores if name == n]
                if mine:
                    out[f"{n}/score"], out[f"{n}/correct"] = mean_of(mine), mean_of([s == 1.0 for s in mine])
        return out


class SeededGames(SeededSampling):
    """Mixin of an environment whose examples are games named by a seed (no messages: reset builds them):
    training seeds from the run's seed (checkpointed), eval seeds from a separate stream (every eval plays
    the same games)."""

    seed: int
    rng: random.Random

    def example(self, game_seed: int) -> Example:
        return Example(messages=[], answer=None, meta={"game_seed": game_seed})

    def sample_train_batch(self, n: int) -> list[Example]:
        check_stuck()  # too many overrunning calls into user code still running: the run stops here, in one line
        return [self.example(self.rng.randrange(2**31)) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        check_stuck()
        stream = random.Random(self.seed + EVAL_SEED_OFFSET)
        return [self.example(stream.randrange(2**31)) for _ in range(n)]


class TextArenaEnv(SeededGames, Environment):
    """A single-player TextArena game (`--task textarena:GuessTheNumber-v0`) as an environment.

    Each example is one game, named by its seed: training games draw seeds from the run's seed, eval games
    are the first eval_n seeds of a separate stream (the same games every eval). A group's G episodes play
    the same game (same seed), each on its own instance (`ta.make(ID + "-raw")`: the game's own
    observations, no wrappers). The prompt is the game's first observation; after each reply
    (`game.step(reply)`) the game's new messages (not the player's own action) are the next user turn; the
    game ending ends the episode. Before each step the global `random`/NumPy RNGs are seeded from (game seed,
    turn), so a game that draws from them (many do) plays the same way in any worker, on resume too. The
    reward is the game's own for player 0 (`close()`; GuessTheNumber: 1 for a win, else how close the last
    guess was), component "game"; an episode a limit cut before the game ended scores what the game gave
    so far (0 when it gave nothing). task_args: any keyword of the game's constructor (e.g. max_turns).
    """

    name = "textarena"
    eval_n_default = 32
    max_turns = 10
    step_cut_replies = True  # the game judges every output, a cut one too

    def __init__(self, seed: int = 0, names: str = "", **game_args: Any) -> None:
        super().__init__(seed)
        import_library("textarena")
        self.game_id = names.strip()
        raw = f"{self.game_id}-raw"
        registry = self.ta.envs.registration.ENV_REGISTRY
        if self.game_id not in registry:
            games = [g for g in registry if not g.endswith("-raw")]  # llmrl makes a game's -raw variant itself
            hint = closest(self.game_id, games, "registered", "GuessTheNumber-v0, TowerOfHanoi-v0, Minesweeper-v0")
            raise ConfigError(f"task textarena:{self.game_id}: no such game ({hint})")
        self.make_id = raw if raw in registry else self.game_id
        self.game_args = game_args
        self.rng = random.Random(seed)
        probe = self.new_game(0)
        if not isinstance(probe.state, self.ta.SinglePlayerState):
            raise ConfigError(f"task textarena:{self.game_id}: not a single-player game (llmrl plays one player)")
        self.max_turns = int(getattr(probe.state, "max_turns", None) or self.max_turns)
        self.instances = Instances()

    @property
    def ta(self):
        """The textarena module (imported, not held: the environment is pickled into step workers)."""
        import textarena

        return textarena

    def new_game(self, game_seed: int) -> Any:
        try:
            game = self.ta.make(self.make_id, **self.game_args)
            game.reset(num_players=1, seed=game_seed)
        except Exception as e:  # noqa: BLE001 - the library's own errors, e.g. a data file it cannot download
            raise ConfigError(f"task textarena:{self.game_id}: the game could not start: {type(e).__name__}: {e}") from None
        return game

    def observation_text(self, game: Any) -> str:
        """The game's messages since the last call, but the player's own action."""
        _, observations = game.get_observation()
        kind = self.ta.ObservationType.PLAYER_ACTION
        return "\n".join(message for _, message, what in observations or [] if what != kind).strip()

    def fresh_game(self, game_seed: int) -> tuple[Any, str]:
        """(a new game reset with the seed, its first observation's text), on a thread of the trainer within
        user_code_timeout (tasks/workers.py: UserCalls.here: an overrun is abandoned and counted)."""
        def make() -> tuple[Any, str]:
            game = self.new_game(game_seed)
            return game, self.observation_text(game)

        return user_calls(self).here(f"textarena {self.game_id}: a game's reset", make)

    def reset(self, example: Example) -> list[dict[str, str]]:
        game, text = self.fresh_game(example.meta["game_seed"])
        self.instances.keep(example, game)
        return [{"role": "user", "content": text}]

    def start(self, episode: Episode) -> None:
        seed = episode.example.meta["game_seed"]
        episode.state = {"game": self.instances.take(episode.example, lambda: self.fresh_game(seed)[0])}

    def step(self, episode: Episode, reply: str) -> Turn:
        import numpy as np

        seed = hash((episode.example.meta["game_seed"], episode.replies)) % 2**32
        random.seed(seed)  # per-episode RNG: the game's draws depend on its seed and turn only
        np.random.seed(seed)
        done, _ = episode.state["game"].step(reply)
        if done:
            return Turn(None)
        return Turn([{"role": "user", "content": self.observation_text(episode.state["game"]) or "(no message)"}])

    def reward(self, episode: Episode) -> Reward:
        state = episode.state["game"].state
        rewards = getattr(state, "rewards", None) or {}
        value = float(rewards.get(0, 0.0))
        info = (getattr(state, "game_info", None) or {}).get(0, {})
        return Reward(total=value, components={"game": value},
                      counts={"invalid_moves": int(bool(info.get("invalid_move")))})

    def correct(self, episode: Episode) -> bool | None:
        return self.reward(episode).total >= 1.0

    def finish(self, episode: Episode) -> None:
        self.instances.drop(episode.example)


class SkyRLGymEnv(OnRows, Environment):
    """SkyRL-gym environments (`--task skyrl_gym:gsm8k --dataset rows.jsonl`) on a dataset's rows.

    A row is SkyRL's dataset format: `prompt` (chat messages or a text), `reward_spec` ({"ground_truth": …}),
    optionally `env_class` (the row's own environment: a per-row choice; default the task's name) and `extras`;
    the whole row goes to `skyrl_gym.make(env_class, env_config=task_args env_config, extras=row)`, one instance
    per episode. `init(prompt)` gives the first messages; each reply is `step(reply)`: its observations are the
    next messages, its reward is added to the episode's, `done` ends the episode. A reply cut by a token cap is
    stepped too (SkyRL scores every output). The reward is the sum of the step rewards (component "reward");
    the instance's `get_metrics()` numbers are logged as reward metrics (never summed). task_args: env_config
    (a mapping), max_turns.
    """

    name = "skyrl_gym"
    max_turns = 1
    step_cut_replies = True

    def __init__(self, seed: int = 0, names: str = "", data=None, env_config: dict[str, Any] | None = None,
                 max_turns: int | None = None) -> None:
        super().__init__(seed)
        skyrl_gym = import_library("skyrl_gym")
        self.env_class = names.strip()
        if self.env_class not in skyrl_gym.registry:
            near = difflib.get_close_matches(self.env_class, sorted(skyrl_gym.registry), n=3, cutoff=0.6)
            raise ConfigError(f"task skyrl_gym:{self.env_class}: no such environment ("
                              + (f"did you mean {' or '.join(near)}? " if near else "")
                              + f"registered: {', '.join(sorted(skyrl_gym.registry))})")
        if data is None:
            raise ConfigError(f"task skyrl_gym:{self.env_class}: give its rows with --dataset (SkyRL's format: prompt, "
                              "reward_spec, optional env_class)")
        self.data, self.env_config = data, dict(env_config or {})
        self.max_turns = int(max_turns or (5 if self.env_class.endswith("multi_turn") else 1))
        self.eval_n_default = getattr(data, "eval_n_default", 32)
        self.instances = Instances()

    def new_env(self, example: Example) -> Any:
        import skyrl_gym
        from omegaconf import OmegaConf

        row = example.meta
        return skyrl_gym.make(row.get("env_class") or self.env_class, env_config=OmegaConf.create(self.env_config),
                              extras=row)

    def fresh_env(self, example: Example) -> tuple[Any, list[dict[str, str]]]:
        """(a new environment for the example's row, the first messages its init gives), on a thread of the trainer
        within user_code_timeout (tasks/workers.py: UserCalls.here: an overrun is abandoned and counted)."""
        def make() -> tuple[Any, list[dict[str, str]]]:
            env = self.new_env(example)
            messages, _ = env.init([dict(m) for m in example.messages])
            return env, messages

        return user_calls(self).here(f"skyrl_gym {self.env_class}: an environment's init", make)

    def reset(self, example: Example) -> list[dict[str, str]]:
        env, messages = self.fresh_env(example)
        self.instances.keep(example, env)
        return [dict(m) for m in messages]

    def start(self, episode: Episode) -> None:
        episode.state = self.instances.take(episode.example, lambda: self.fresh_env(episode.example)[0])

    def step(self, episode: Episode, reply: str) -> Turn:
        out = episode.state.step(reply)
        parts = {"reward": float(out["reward"] or 0.0)}
        if out["done"]:
            return Turn(None, parts)
        return Turn([{"role": m.get("role", "user"), "content": str(m.get("content", ""))} for m in out["observations"]]
                    or [{"role": "user", "content": ""}], parts)

    def reward(self, episode: Episode) -> Reward:
        total = episode.parts.get("reward", 0.0)
        metrics = {k: float(v) for k, v in (episode.state.get_metrics() if episode.state is not None else {}).items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return Reward(total=total, components={"reward": total}, metrics=metrics)

    def finish(self, episode: Episode) -> None:
        for env in [episode.state, *self.instances.drop(episode.example)]:
            if env is not None:
                env.close()


class OpenEnvEnv(SeededGames, Environment):
    """An OpenEnv environment server (`--task openenv:http://HOST:PORT`) played over its own client.

    Each episode is one session of OpenEnv's `GenericEnvClient(base_url=URL).sync()` (a WebSocket of its own):
    `reset(seed=game seed)`, then each reply is `step({action_field: reply})`; the observation's text (its
    `observation_field`, else its only text field, else the observation as JSON) is the next user message, the
    step rewards add up to the episode's reward (component "reward"), `done` ends it; a cut reply is stepped
    too. Examples are seeds, as for TextArena (eval: a separate stream). A session is a live connection, so
    steps run on threads of the trainer whatever env_isolation says (the server is the process that holds
    the game; env_timeout still bounds a step). task_args: action_field ("message"), observation_field,
    system_prompt, max_turns, message_timeout (seconds the client waits for one message: a positive, finite
    number).

    Sessions open concurrently, each on a thread and bounded by user_code_timeout (tasks/workers.py: UserCalls):
    the first reset of a batch of examples (sample_train_batch, eval_examples) opens the sessions of that
    example and of the next PREFETCH, and waits for its own; `start` opens each other episode's session at once,
    and its first step waits for it (at most 0.8 × env_timeout). A session that does not open in time ends its
    episodes like a raise (env_error, counted in rollout/env_errors and rollout/env_timeouts, reward 0); its
    thread, which the client's own timeouts end, closes the client when it comes. Sessions opened for examples
    never reset are closed at the next batch.
    """

    name = "openenv"
    max_turns = 8
    step_cut_replies = True
    required_isolation = "thread"  # a session's client cannot be pickled into a worker process

    def __init__(self, seed: int = 0, names: str = "", action_field: str = "message",
                 observation_field: str | None = None, system_prompt: str = "", max_turns: int | None = None,
                 message_timeout: float = 60.0) -> None:
        super().__init__(seed)
        if (isinstance(message_timeout, bool) or not isinstance(message_timeout, (int, float))
                or not 0 < message_timeout < float("inf")):
            raise ConfigError(f"task openenv:{names.strip()}: task_args message_timeout={message_timeout!r}: must be a "
                              "positive, finite number of seconds")
        import_library("openenv")
        self.url = names.strip()
        if not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ConfigError(f"task openenv:{self.url}: name the server's URL, e.g. openenv:http://127.0.0.1:8000")
        self.action_field, self.observation_field = action_field, observation_field
        self.system, self.message_timeout = system_prompt, float(message_timeout)
        self.max_turns = int(max_turns or self.max_turns)
        self.rng = random.Random(seed)
        self.instances = Instances()
        self.lock = threading.Lock()
        self.batch: list[Example] = []  # the examples last drawn: their resets open their sessions together
        self.opened: set[int] = set()  # ids of those whose session was opened
        self.opening: dict[int, tuple[Example, Pending]] = {}  # their sessions not yet taken by reset
        probe = self.session(0)  # a server that is not there is one line now, not an env_error per episode
        probe[0].close()

    def sample_train_batch(self, n: int) -> list[Example]:
        return self.expect(super().sample_train_batch(n))

    def eval_examples(self, n: int) -> list[Example]:
        return self.expect(super().eval_examples(n))

    def expect(self, examples: list[Example]) -> list[Example]:
        """Resets will ask for these examples next; the sessions opened for the last ones and not taken close."""
        with self.lock:
            stale, self.opening, self.batch, self.opened = list(self.opening.values()), {}, list(examples), set()
        for _, pending in stale:
            pending.abandon()
        return examples

    def open(self, game_seed: int) -> Pending:
        """A session opening on a thread of its own (bounded by user_code_timeout; its client's own timeouts end it)."""
        return user_calls(self).start(f"OpenEnv {self.url}: opening a session", self.session, game_seed,
                                      late=lambda opened: opened[0].close(), counted=False)

    def client(self, episode: Episode) -> Any:
        """The episode's client, once its session has opened (a step waits at most 0.8 × env_timeout for it)."""
        if isinstance(episode.state, Pending):
            step_limit = user_calls(self).step_timeout
            episode.state = episode.state.result(None if step_limit is None else 0.8 * step_limit)[0]
        return episode.state

    def session(self, game_seed: int) -> tuple[Any, Any]:
        """(a connected client, its reset result)."""
        from openenv.core.generic_client import GenericEnvClient

        try:
            client = GenericEnvClient(base_url=self.url, message_timeout_s=self.message_timeout).sync()
            return client, client.reset(seed=game_seed)
        except Exception as e:  # noqa: BLE001 - connection refused, a handshake error, the server's own
            raise ConfigError(f"task openenv:{self.url}: no session: {type(e).__name__}: {e}"[:300]) from None

    def text(self, observation: Any) -> str:
        """An observation's text: observation_field, else its only text field, else the whole as JSON."""
        import json

        if not isinstance(observation, dict):
            return str(observation)
        if self.observation_field is not None:
            return str(observation.get(self.observation_field, ""))
        texts = [v for k, v in observation.items() if isinstance(v, str) and k not in ("metadata",)]
        if len(texts) == 1:
            return texts[0]
        return json.dumps({k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")})

    def reset(self, example: Example) -> list[dict[str, str]]:
        with self.lock:
            at = next((i for i, e in enumerate(self.batch) if e is example), None)
            if at is not None and id(example) not in self.opened:  # this one and the next PREFETCH, together
                for ex in self.batch[at: at + PREFETCH]:
                    if id(ex) not in self.opened:
                        self.opened.add(id(ex))
                        self.opening[id(ex)] = (ex, self.open(ex.meta["game_seed"]))
            taken = self.opening.pop(id(example), None)
        pending = taken[1] if taken is not None else self.open(example.meta["game_seed"])
        client, first = pending.result()
        self.instances.keep(example, client)
        return ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": self.text(first.observation)}]

    def start(self, episode: Episode) -> None:
        episode.state = self.instances.take(episode.example, lambda: self.open(episode.example.meta["game_seed"]))

    def step(self, episode: Episode, reply: str) -> Turn:
        result = self.client(episode).step({self.action_field: reply})
        parts = {"reward": float(result.reward or 0.0)}
        if result.done:
            return Turn(None, parts)
        return Turn([{"role": "user", "content": self.text(result.observation)}], parts)

    def reward(self, episode: Episode) -> Reward:
        total = episode.parts.get("reward", 0.0)
        return Reward(total=total, components={"reward": total})

    def finish(self, episode: Episode) -> None:
        for client in [episode.state, *self.instances.drop(episode.example)]:
            if isinstance(client, Pending):
                client.abandon()  # closed when (if) it opens
            elif client is not None:
                client.close()


class VerifiersTask(SeededSampling):
    """A verifiers (v1) taskset, each reply scored by the taskset's own weighted `@vf.reward` methods.

    `--task verifiers:ID` loads the taskset as verifiers does (`vf.load_taskset`: the module
    `verifiers.v1.tasksets.ID` or an installed module `ID` exporting one Taskset subclass in `__all__`).
    Its rows are single-turn examples: the prompt the chat harness shows (the task's system_prompt, then its
    prompt), one reply, then `Task.score` on a trace of that conversation. Each reward's score is a
    component (unweighted, reward/<name>), the total is verifiers' own `trace.reward` (the weighted sum),
    `@vf.metric` values are metrics (never summed); a reward that raises is a reward error, as any task's. A taskset that needs a harness (a runtime, a container, tool servers, an LLM judge, or its own
    Env that drives the turns) is refused at start: llmrl samples the replies itself, so it cannot run a
    harness's agent program (see docs/environments.md).

    task_args: config (the taskset's own TasksetConfig fields, e.g. a split), eval_config (another config
    whose rows are the eval set; without it `eval_size` rows are held out of the shuffled rows by the run's
    seed), size (rows read from an infinite taskset, default 5000), eval_size (default a fifth of the rows, at
    most 64).
    """

    name = "verifiers"
    eval_n_default = 64

    def __init__(self, seed: int = 0, names: str = "", config: dict[str, Any] | None = None,
                 eval_config: dict[str, Any] | None = None, size: int = 5000, eval_size: int | None = None):
        import_library("verifiers")
        from verifiers.v1.utils import loaders

        self.vf = importlib.import_module("verifiers.v1")
        self.rng = random.Random(seed)
        taskset_id = names.strip()
        if not taskset_id or "," in taskset_id:
            raise ConfigError(f"task verifiers:{names}: name one taskset (verifiers:ID)")
        try:
            cls = loaders.taskset_class(taskset_id)
        except Exception as e:  # noqa: BLE001 - not found, no __all__, several subclasses: verifiers' own words
            raise ConfigError(f"task verifiers:{taskset_id}: {type(e).__name__}: {e}") from None
        if loaders.environment_class(taskset_id, "") is not loaders.SingleAgentEnv:
            raise ConfigError(f"task verifiers:{taskset_id}: the taskset brings its own Env, which drives the turns "
                              "through a harness; llmrl runs single-turn tasksets only (not yet supported)")
        self.data_report: dict[str, Any] = {"taskset": taskset_id}
        rows = self.rows(cls, taskset_id, config, size)
        if eval_config is not None:
            self.train, self.eval = rows, self.rows(cls, taskset_id, eval_config, size)
            self.data_report |= {"train": len(self.train), "eval": len(self.eval), "eval_from": "eval_config"}
        else:
            eval_size = min(64, max(1, len(rows) // 5)) if eval_size is None else eval_size
            if not isinstance(eval_size, int) or not 0 < eval_size < len(rows):
                raise ConfigError(f"task verifiers:{taskset_id}: eval_size {eval_size} must be between 1 and the "
                                  f"{len(rows)} rows - 1 (or give eval_config)")
            order = list(range(len(rows)))
            random.Random(seed + EVAL_SEED_OFFSET).shuffle(order)
            self.eval = [rows[i] for i in order[:eval_size]]
            self.train = [rows[i] for i in sorted(order[eval_size:])]
            self.data_report |= {"train": len(self.train), "eval": len(self.eval), "eval_from": "held out by seed"}
        for task in self.train[:1] + self.eval[:1]:
            self.refuse_harness(taskset_id, task)

    def rows(self, cls: type, taskset_id: str, config: dict[str, Any] | None, size: int) -> list[Any]:
        from itertools import islice

        from verifiers.v1.utils.generic import concrete_type

        config_type = concrete_type(cls, self.vf.TasksetConfig) or self.vf.TasksetConfig
        try:
            taskset = cls(config_type.model_validate({**(config or {}), "id": taskset_id}))
            rows = list(islice(iter(taskset), size))
        except Exception as e:  # noqa: BLE001 - a bad config field, or load() failing: one line
            raise ConfigError(f"task verifiers:{taskset_id}: the taskset did not load ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
        if not rows:
            raise DataError(f"task verifiers:{taskset_id}: the taskset yielded no rows")
        if cls.toolsets(taskset.config):
            raise ConfigError(f"task verifiers:{taskset_id}: the taskset serves tools (toolsets), which a harness "
                              "runs; not yet supported")
        return rows

    def refuse_harness(self, taskset_id: str, task: Any) -> None:
        import inspect

        def needs(fn: Any) -> bool:
            param = inspect.signature(fn).parameters.get("runtime")
            return param is not None and param.default is inspect.Parameter.empty

        needs_runtime = [fn.__name__ for fn in (*task.hooks("reward"), *task.hooks("metric")) if needs(fn)]
        why = ("a container (NEEDS_CONTAINER)" if task.NEEDS_CONTAINER else
               f"a runtime for {', '.join(needs_runtime)}" if needs_runtime else
               "an LLM judge (config judges)" if task.config.judges else None)
        if why:
            raise ConfigError(f"task verifiers:{taskset_id}: its tasks need {why}, which a harness provides; "
                              "not yet supported (llmrl scores single replies offline)")

    def messages(self, task: Any) -> list[dict[str, str]]:
        """What the chat harness shows: the system prompt, then the prompt (a text, or messages)."""
        data = task.data
        out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            return out + [{"role": "user", "content": data.prompt}]
        return out + [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in data.prompt or []]

    def example(self, split: str, i: int) -> Example:
        """Row i of the split; meta names the row (an Example crosses processes, a verifiers Task need not)."""
        task = (self.train if split == "train" else self.eval)[i]
        return Example(messages=self.messages(task), answer=str(getattr(task.data, "answer", "")),
                       meta={"split": split, "row": i, "id": task.data.id})

    def sample_train_batch(self, n: int) -> list[Example]:
        return [self.example("train", self.rng.randrange(len(self.train))) for _ in range(n)]

    def eval_examples(self, n: int) -> list[Example]:
        return [self.example("eval", i) for i in range(min(n, len(self.eval)))]

    def trace(self, task: Any, messages: list[dict[str, str]], completion: str) -> Any:
        """A verifiers Trace of the conversation with `completion` as the sampled assistant reply."""
        from verifiers.v1.state import state_cls

        vf = self.vf
        kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
        shown = [kinds[m["role"]](content=m["content"]) for m in messages]
        nodes = [vf.MessageNode(message=m, parent=i - 1 if i else None) for i, m in enumerate(shown)]
        nodes.append(vf.MessageNode(message=vf.AssistantMessage(content=completion), parent=len(nodes) - 1 if nodes
                                    else None, sampled=True))
        return vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                        state=state_cls(type(task))(), nodes=nodes,
                        agent=vf.AgentInfo(config=vf.AgentConfig(runtime=vf.SubprocessConfig()), name="llmrl"))

    def reward(self, example: Example, completion: str) -> Reward:
        import asyncio

        task = (self.train if example.meta["split"] == "train" else self.eval)[example.meta["row"]]
        trace = self.trace(task, example.messages, completion)
        asyncio.run(task.score(trace))
        components = {k: float(r.score) for k, r in trace.rewards.items() if r is not None}
        metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
        return Reward(total=float(trace.reward), components=components, metrics=metrics)

    def judge(self, examples: list[Example], completions: list[str]) -> None:
        """Rewards say nothing about correctness: no pass@k."""
        return None

    def evaluate(self, examples: list[Example], completions: list[str]) -> dict[str, float]:
        rewards = [self.reward(ex, c) for ex, c in zip(examples, completions, strict=True)]
        names = sorted({k for r in rewards for k in r.components})
        return {n: mean_of([r.components.get(n, 0.0) for r in rewards]) for n in names}


LIBRARY_TASKS: dict[str, type] = {"reasoning_gym": ReasoningGymTask, "textarena": TextArenaEnv, "skyrl_gym": SkyRLGymEnv,
                                  "openenv": OpenEnvEnv, "verifiers": VerifiersTask}
