"""The environment API around the episode: task_args, task files that never shadow a package, `finish` for
every episode, and the trainer's global RNG streams kept whatever an environment does to them."""

import random
import sys

import numpy as np
import pytest
import torch

from llmrl.config import load_config
from llmrl.errors import ConfigError
from llmrl.rollout.episodes import Limits
from llmrl.tasks import make_task
from llmrl.tasks.base import Example, Reward
from llmrl.tasks.custom import load_object
from llmrl.tasks.env import Environment, Turn
from llmrl.tasks.score import score_episodes
from test_env import play, tiny_policy  # noqa: F401 - the fixture

LEVELS = '''
from llmrl import Environment


class Levels(Environment):
    def __init__(self, seed=0, level=1, names=("a",)):
        self.seed, self.level, self.names = seed, level, list(names)
'''


def test_task_args_reach_the_constructor_from_yaml_and_the_command_line(tmp_path):
    (tmp_path / "levels.py").write_text(LEVELS)
    spec = f"{tmp_path / 'levels.py'}:Levels"
    (tmp_path / "c.yaml").write_text(f"task: {spec}\ntask_args:\n  level: 3\n  names: [x, y]\n")
    cfg = load_config(tmp_path / "c.yaml")
    env = make_task(cfg.task, seed=7, task_args=cfg.task_args)
    assert (env.seed, env.level, env.names) == (7, 3, ["x", "y"])
    cfg = load_config(None, {"task": spec, "task_args": '{"level": 5}'})  # the command line's JSON object
    assert make_task(cfg.task, seed=0, task_args=cfg.task_args).level == 5
    assert load_config(None, {"task": spec}).task_args == {}


def test_a_task_arg_the_constructor_does_not_take_is_one_line_naming_it(tmp_path):
    (tmp_path / "levels.py").write_text(LEVELS)
    with pytest.raises(ConfigError, match=r"cannot take task_args \['depth'\]"):
        make_task(f"{tmp_path / 'levels.py'}:Levels", seed=0, task_args={"depth": 2})
    with pytest.raises(ConfigError, match=r"cannot take task_args \['level'\]"):
        make_task("guess", seed=0, task_args={"level": 2})  # built-in tasks take them too, when they have them
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_config(None, {"task_args": "{level: 2"})
    with pytest.raises(ConfigError, match="mapping of names"):
        load_config(None, {"task_args": "[1, 2]"})
    (tmp_path / "fn.py").write_text("def reward(prompt, completion, **meta):\n    return 1.0\n")
    with pytest.raises(ConfigError, match="is a reward function: task_args go to a task class"):
        make_task(f"{tmp_path / 'fn.py'}:reward", seed=0, prompts=None, task_args={"level": 2})


def test_a_task_file_named_like_a_package_never_shadows_it(tmp_path):
    """`--task json.py:T` (or textarena.py) loads under a private name: the file's own `import json` gets the
    real package, and so does everything imported after it. Two files with one stem stay two modules."""
    import json

    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "json.py").write_text(
            "import json\n\nclass T:\n    def __init__(self, seed=0):\n"
            f"        self.text = json.dumps({{'dir': {d!r}}})\n")
    a = load_object(f"{tmp_path / 'a' / 'json.py'}:T")
    b = load_object(f"{tmp_path / 'b' / 'json.py'}:T")
    assert a(seed=0).text == '{"dir": "a"}' and b(seed=0).text == '{"dir": "b"}'
    assert a.__module__ != b.__module__ and a.__module__.startswith("_llmrl_task_json_")
    assert sys.modules["json"] is json and json.loads("[1]") == [1]
    assert load_object(f"{tmp_path / 'a' / 'json.py'}:T") is a  # loaded once


class Ending(Environment):
    """Episode `answer` decides its fate: "raise" (its step raises), "long" (runs into max_turns), else it ends
    after one reply. Every reset/reward/finish reseeds the global RNGs from the OS, as some game libraries do."""

    max_turns = 2

    def __init__(self, seed=0, finish_raises=False):
        self.finished: list[tuple[str, int, str | None]] = []
        self.finish_raises = finish_raises

    @staticmethod
    def reseed():
        random.seed()
        np.random.seed()
        torch.seed()

    def reset(self, example):
        self.reseed()
        return [{"role": "user", "content": f"play {example.answer}"}]

    def step(self, episode, reply):
        if episode.example.answer == "raise":
            raise RuntimeError("the game crashed")
        return Turn([{"role": "user", "content": "more"}]) if episode.example.answer == "long" else Turn(None)

    def reward(self, episode):
        self.reseed()
        return Reward(total=1.0, components={})

    def finish(self, episode):
        self.reseed()
        self.finished.append((episode.example.answer, id(episode), episode.cut))
        if self.finish_raises:
            raise OSError("socket already closed")


def rng_states():
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state()


def test_finish_is_called_once_for_every_episode_and_the_global_rngs_stay_the_trainers(tiny_policy, monkeypatch, capsys):
    model, tok = tiny_policy
    env = Ending(finish_raises=True)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    before = rng_states()
    examples = [Example([], "raise"), Example([], "long"), Example([], "ok")]
    _, episodes = play(model, tok, monkeypatch, examples, group_size=2, env=env,
                       limits=Limits(max_turns=2, episode_tokens=30, reply_tokens=5, env_tokens=50, env_timeout=30))
    scores = score_episodes(env, episodes, strict=False, where="step 1")
    after = rng_states()
    assert after[0] == before[0] and after[1] == before[1] and torch.equal(after[2], before[2])
    assert sorted(i for _, i, _ in env.finished) == sorted(id(ep) for ep in episodes)  # each once
    assert {(a, cut) for a, _, cut in env.finished} == {("raise", "env_error"), ("long", "max_turns"), ("ok", None)}
    assert [r.total for r in scores.rewards] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    err = capsys.readouterr().err
    assert "step 1: the environment's finish raised for 6 of 6 episodes (first: OSError: socket already closed)" in err


def test_the_episodes_of_a_rollout_whose_engine_fails_are_finished(tiny_policy, monkeypatch):
    from llmrl.rollout.hf import HFEngine

    model, tok = tiny_policy
    env = Ending()
    calls = {"n": 0}
    real = HFEngine.continue_ids

    def dies_on_turn_2(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ConnectionError("the engine went away")
        return real(self, *a, **k)

    monkeypatch.setattr(HFEngine, "continue_ids", dies_on_turn_2)
    with pytest.raises(ConnectionError):
        play(model, tok, monkeypatch, [Example([], "long")], group_size=2, env=env,
             limits=Limits(max_turns=2, episode_tokens=30, reply_tokens=5, env_tokens=50, env_timeout=30))
    assert [a for a, _, _ in env.finished] == ["long", "long"]


RESEEDING = '''
import random

import numpy as np
import torch

from llmrl.tasks.base import Reward
from llmrl.tasks.guess import GuessEnv


def reseed():
    random.seed()
    np.random.seed()
    torch.seed()


class Reseeding(GuessEnv):
    """guess, reseeding the global RNGs from the OS in every call the trainer makes (TextArena and GEM reseed)."""

    def sample_train_batch(self, n):
        reseed()
        return super().sample_train_batch(n)

    def reset(self, example):
        reseed()
        return super().reset(example)

    def step(self, episode, reply):
        reseed()
        return super().step(episode, reply)

    def reward(self, episode):  # a spread within groups, so LoRA dropout shapes every update
        reseed()
        return Reward(total=(len(episode.last_reply) % 3) / 2, components={})

    def finish(self, episode):
        reseed()
'''


@pytest.mark.slow
def test_resume_stays_exact_with_an_environment_that_reseeds_the_global_rngs(tmp_path, tiny_model_dir):
    """LoRA dropout draws its keys from torch's global generator: an environment reseeding it from the OS would
    make every run differ. SIGKILL in step 3's rollout + --resume still ends as the uninterrupted run (≤ 1e-6),
    with the steps on threads (they share the trainer's RNGs)."""
    import signal

    from helpers import assert_same_run, cli, run_cli, tiny_args

    (tmp_path / "reseeding.py").write_text(RESEEDING)
    task = f"{tmp_path / 'reseeding.py'}:Reseeding"
    full, part = tmp_path / "full", tmp_path / "part"
    common = dict(steps=3, task=task, max_prompt_tokens=256, max_turns=2, env_isolation="thread", lora_dropout=0.3)
    cli(*tiny_args(tiny_model_dir, full, "grpo", **common), "--trust_task_code")
    p = run_cli(*tiny_args(tiny_model_dir, part, "grpo", save_interval=2, **common), "--trust_task_code",
                fault="kill_in_rollout@3")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    cli("train", "--resume", str(part), "--trust_task_code")
    assert_same_run(full, part, 3)
