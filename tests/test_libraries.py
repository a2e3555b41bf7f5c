"""Environment libraries by name (`--task LIBRARY:NAME`): llmrl's reward equals the library's own scoring."""

import pytest

from llmrl.errors import ConfigError
from llmrl.tasks import is_task_code, is_task_name, make_task
from llmrl.tasks.score import score

rg = pytest.importorskip("reasoning_gym")


def test_reasoning_gym_reward_is_its_own_scoring_on_right_wrong_partial_and_untagged_replies():
    from reasoning_gym.utils import extract_answer

    task = make_task("reasoning_gym:spell_backward", seed=3, task_args={"size": 40, "eval_size": 20})
    ds = rg.create_dataset("spell_backward", size=40, seed=3)
    examples = task.eval_examples(3) + task.sample_train_batch(3)
    for ex in examples:
        answer = ex.answer
        replies = {"right": f"thinking...\n<answer>{answer}</answer>", "wrong": "<answer>zzzz</answer>",
                   "partial": f"<answer>{answer[:-1]}x</answer>", "untagged": answer,
                   "longer": f"<answer>{answer} indeed</answer>"}
        got = {k: task.reward(ex, r).total for k, r in replies.items()}
        item = ex.meta["item"]
        want = {k: float(ds.score_answer(extract_answer(r), item)) for k, r in replies.items()}
        assert got == want
        assert got["right"] == 1.0 and got["untagged"] == 0.0 and got["wrong"] == 0.0
        assert 0.0 < got["partial"] < 1.0  # spell_backward's partial credit: a near miss
    train_items = {ex.meta["item"]["question"] for ex in task.sample_train_batch(40)}
    assert all(item["question"] in {ds[i]["question"] for i in range(40)} for item in (ex.meta["item"] for ex in examples[3:]))
    assert not {ex.meta["item"]["question"] for ex in task.eval_examples(20)} & {ds[i]["question"] for i in range(40)}
    assert train_items


def test_a_mixture_logs_each_datasets_score_and_full_credit_only_counts_for_pass_at_k():
    task = make_task("reasoning_gym:chain_sum,spell_backward", seed=0,
                     task_args={"size": 30, "eval_size": 10, "weights": {"chain_sum": 3.0}})
    assert not is_task_code("reasoning_gym:chain_sum,spell_backward") and is_task_name("reasoning_gym:chain_sum")
    evals = task.eval_examples(4)
    assert [ex.meta["dataset"] for ex in evals] == ["chain_sum", "spell_backward"] * 2  # interleaved
    replies = [f"<answer>{ex.answer}</answer>" if i % 2 == 0 else f"<answer>{ex.answer}!!</answer>"
               for i, ex in enumerate(evals)]
    scores = score(task, evals, replies, strict=True, where="test")
    assert scores.rewards[0].metrics == {"chain_sum": 1.0} and scores.rewards[0].total == 1.0
    assert scores.rewards[1].metrics.keys() == {"spell_backward"} and 0 < scores.rewards[1].total < 1
    metrics = task.evaluate(evals, replies)
    assert metrics["chain_sum/correct"] == 1.0 and metrics["spell_backward/correct"] == 0.0
    assert metrics["correct"] == 0.5 and metrics["score"] == pytest.approx(sum(r.total for r in scores.rewards) / 4)
    assert [j.correct for j in task.judge(evals, replies)] == [True, False, True, False]
    picked = [ex.meta["dataset"] for ex in task.sample_train_batch(400)]
    assert 0.65 < picked.count("chain_sum") / 400 < 0.85  # weights 3:1 → 0.75 (±0.1 is > 4 binomial sd)


def test_shots_are_solved_turns_taken_out_of_the_training_pool_and_never_eval_items():
    task = make_task("reasoning_gym:spell_backward", seed=5,
                     task_args={"size": 23, "eval_size": 17, "shots": 2, "system_prompt": ""})
    ds = rg.create_dataset("spell_backward", size=23, seed=5)
    shot_items = [ds[0], ds[1]]
    ex = task.sample_train_batch(1)[0]
    assert ex.messages[:4] == [m for item in shot_items for m in (
        {"role": "user", "content": item["question"]},
        {"role": "assistant", "content": f"<answer>{item['answer']}</answer>"})]
    assert ex.messages[4] == {"role": "user", "content": ex.meta["item"]["question"]} and len(ex.messages) == 5
    pool = {ex.meta["item"]["question"] for ex in task.sample_train_batch(400)}
    assert pool == {ds[i]["question"] for i in range(2, 23)}  # 21 items, each drawn in 400 tries (P miss < 1e-7)
    assert task.data_report["datasets"]["spell_backward"]["train"] == 21
    evals = task.eval_examples(17)
    assert evals and not {e.meta["item"]["question"] for e in evals} & {ds[i]["question"] for i in range(23)}
    assert all(e.messages[:4] == ex.messages[:4] for e in evals)
    for bad in (-1, 23, 1.5, True):
        with pytest.raises(ConfigError, match="shots"):
            make_task("reasoning_gym:spell_backward", seed=5, task_args={"size": 23, "shots": bad})


def test_reasoning_gym_mistakes_are_one_line():
    with pytest.raises(ConfigError, match="no dataset 'no_such_set'"):
        make_task("reasoning_gym:no_such_set", seed=0)
    with pytest.raises(ConfigError, match="cannot take task_args"):
        make_task("reasoning_gym:chain_sum", seed=0, task_args={"sizes": 3})
    with pytest.raises(ConfigError, match="create_dataset raised"):
        make_task("reasoning_gym:chain_sum", seed=0, task_args={"configs": {"chain_sum": {"min_terms": "x"}}})


def test_a_textarena_game_plays_as_the_library_plays_it_and_is_scored_by_it():
    """llmrl's textarena:GuessTheNumber-v0 against the library's own game with the same seed and replies: the
    same prompt, the same answers, the same reward (a win by binary search: 1.0; a game lost to two invalid
    moves: the game's own score), and a group's episodes play the same game on instances of their own."""
    ta = pytest.importorskip("textarena")
    from llmrl.tasks.env import Episode

    env = make_task("textarena:GuessTheNumber-v0", seed=4, task_args={"max_turns": 7})
    assert env.max_turns == 7
    for ex in env.sample_train_batch(2) + env.eval_examples(1):
        first = env.reset(ex)
        game = ta.make("GuessTheNumber-v0-raw", max_turns=7)
        game.reset(num_players=1, seed=ex.meta["game_seed"])
        _, observations = game.get_observation()
        assert first == [{"role": "user", "content": observations[0][1]}]
        episodes = [Episode(example=ex, messages=list(first), first=1) for _ in range(2)]
        for ep in episodes:
            env.start(ep)
        assert episodes[0].state["game"] is not episodes[1].state["game"]
        lo, hi, turn = 1, 20, None
        while turn is None or turn.messages is not None:  # binary search: llmrl's game and the library's
            guess = (lo + hi) // 2
            episodes[0].replies += 1
            turn = env.step(episodes[0], f"My guess: [{guess}]")
            done, _ = game.step(f"My guess: [{guess}]")
            assert done == (turn.messages is None)
            if not done:
                _, observations = game.get_observation()
                assert turn.messages[0]["content"] == "\n".join(m for _, m, k in observations if k != ta.ObservationType.PLAYER_ACTION)
                lo, hi = (guess + 1, hi) if "higher" in turn.messages[0]["content"] else (lo, guess - 1)
        assert env.reward(episodes[0]).total == float(game.close()[0][0]) == 1.0 and env.correct(episodes[0])
        lost = ta.make("GuessTheNumber-v0-raw", max_turns=7)
        lost.reset(num_players=1, seed=ex.meta["game_seed"])
        for reply in ("[1] is my guess", "no number", "still none"):
            episodes[1].replies += 1
            if env.step(episodes[1], reply).messages is None:
                break
        for reply in ("[1] is my guess", "no number", "still none"):
            if lost.step(reply)[0]:
                break
        reward = env.reward(episodes[1])
        assert reward.total == float(lost.close()[0][0]) and reward.counts == {"invalid_moves": 1}
    with pytest.raises(ConfigError, match="no such game"):
        make_task("textarena:NoSuchGame-v0", seed=0, task_args={})


@pytest.mark.slow
def test_a_textarena_game_trains_multi_turn_from_the_cli(tmp_path, tiny_model_dir):
    """Two steps of textarena:GuessTheNumber-v0 on the tiny model whose replies end after 4 tokens (no valid
    guess: the game answers, and ends the episode at the second invalid move): exit 0, 2 turns per episode."""
    pytest.importorskip("textarena")
    from helpers import read_jsonl, run_cli, tiny_args

    out = tmp_path / "run"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task="textarena:GuessTheNumber-v0", max_turns=4,
                           max_prompt_tokens=200, eval_n=1), fault="replies_end@4")
    assert p.returncode == 0, p.stderr[-2000:]
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2] and all(r["rollout/turns"] == 2.0 for r in train)
    assert all(r["reward/invalid_moves"] == 6 for r in train)  # 2 prompts x 3 episodes, each lost to invalid moves


def skyrl_rows(tmp_path, n=12):
    """Hand-made rows in SkyRL's dataset format (half of them choose the multi-turn environment per row)."""
    import json

    rows = [{"prompt": [{"role": "user", "content": f"What is {k} + {k * 3}? End with #### and the number."}],
             "env_class": "gsm8k_multi_turn" if k % 2 else "gsm8k", "reward_spec": {"method": "rule", "ground_truth": str(4 * k)},
             "extra_info": {"max_turns": 3}} for k in range(1, n + 1)]
    path = tmp_path / "skyrl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_skyrl_gym_reward_is_the_environments_own_on_fixed_replies(tmp_path):
    """skyrl_gym:gsm8k on SkyRL-format rows (env_class per row): each episode's reward is the sum of what the
    library's own environment returns for the same replies (right, wrong, formatted-wrong, untagged), and the
    multi-turn rows continue with the library's observations until it says done."""
    skyrl_gym = pytest.importorskip("skyrl_gym")
    from llmrl.config import load_config
    from llmrl.tasks import task_from_config
    from llmrl.tasks.env import Episode

    env = task_from_config(load_config(None, {"task": "skyrl_gym:gsm8k", "dataset": skyrl_rows(tmp_path),
                                              "eval_holdout": 2, "task_args": '{"max_turns": 3}'}))
    assert env.max_turns == 3 and env.step_cut_replies
    for ex in env.sample_train_batch(6) + env.eval_examples(2):
        gold = ex.meta["reward_spec"]["ground_truth"]
        for replies in ([f"so #### {gold}"], ["#### 9999", f"#### {gold}"], [gold, "#### 1", "#### 2"]):
            ep = Episode(example=ex, messages=env.reset(ex), first=len(ex.messages))
            env.start(ep)
            own = skyrl_gym.make(ex.meta["env_class"], extras=ex.meta)
            own.init(ex.messages)
            total = 0.0
            for reply in replies:
                ep.replies += 1
                turn = env.step(ep, reply)
                out = own.step(reply)
                total += out["reward"]
                assert (turn.messages is None) == out["done"] and turn.parts == {"reward": float(out["reward"])}
                for name, v in turn.parts.items():
                    ep.parts[name] = ep.parts.get(name, 0.0) + v
                if out["done"]:
                    break
                assert turn.messages == out["observations"]
            assert env.reward(ep).total == total
            env.finish(ep)
    with pytest.raises(ConfigError, match="give its rows with --dataset"):
        make_task("skyrl_gym:gsm8k", seed=0, task_args={})
    with pytest.raises(ConfigError, match="no such environment"):
        make_task("skyrl_gym:nope", seed=0, task_args={})


@pytest.fixture
def digit_server():
    """The local OpenEnv server of tests/openenv_digit_server.py on a free port; its URL."""
    pytest.importorskip("openenv")
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("openenv_digit_server.py")), str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):  # up to 60 s for the server's imports on a loaded machine
            try:
                urllib.request.urlopen(url + "/health", timeout=1).read()
                break
            except OSError:
                assert server.poll() is None, server.stderr.read().decode()[-2000:]
                time.sleep(0.1)
        yield url
    finally:
        server.kill()
        server.wait()


def test_openenv_reward_and_messages_are_the_servers_own_on_fixed_replies(digit_server):
    """openenv:URL against a local server: llmrl's prompt, messages and summed reward equal those of OpenEnv's
    own client given the same seed and replies; every session is closed at finish."""
    from openenv.core.generic_client import GenericEnvClient

    from llmrl.tasks.env import Episode

    env = make_task(f"openenv:{digit_server}", seed=2, task_args={"max_turns": 3})
    assert env.required_isolation == "thread" and env.max_turns == 3
    for ex in env.sample_train_batch(3) + env.eval_examples(1):
        seed = ex.meta["game_seed"]
        for replies in (["5", f"it is {seed % 10}"], ["none", "nothing", "still"], ["0", "9", "x"]):
            first = env.reset(ex)
            ep = Episode(example=ex, messages=list(first), first=len(first))
            env.start(ep)
            own = GenericEnvClient(base_url=digit_server).sync()
            assert first[-1]["content"] == own.reset(seed=seed).observation["text"]
            total = 0.0
            for reply in replies:
                turn, out = env.step(ep, reply), own.step({"message": reply})
                total += out.reward
                ep.parts["reward"] = ep.parts.get("reward", 0.0) + turn.parts["reward"]
                assert (turn.messages is None) == out.done
                if out.done:
                    break
                assert turn.messages == [{"role": "user", "content": out.observation["text"]}]
            assert env.reward(ep).total == total  # the same additions in the same order
            if replies[0] == "none":  # three replies without a digit: -0.1 three times, summed in float
                assert total == -0.1 + -0.1 + -0.1 != -0.3
            own.close()
            env.finish(ep)
    with pytest.raises(ConfigError, match="no session"):
        make_task("openenv:http://127.0.0.1:9", seed=0, task_args={})


@pytest.mark.slow
def test_an_openenv_server_trains_multi_turn_from_the_cli(tmp_path, tiny_model_dir, digit_server):
    pytest.importorskip("openenv")
    from helpers import read_jsonl, run_cli, tiny_args

    out = tmp_path / "run"
    p = run_cli(*tiny_args(tiny_model_dir, out, "grpo", steps=2, task=f"openenv:{digit_server}", max_turns=3,
                           max_prompt_tokens=100, eval_n=1), fault="replies_end@4")
    assert p.returncode == 0, p.stderr[-2000:]
    train = [r for r in read_jsonl(out / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2] and all(r["rollout/turns"] > 1 and r["rollout/env_errors"] == 0 for r in train)


def test_the_reasoning_gym_config_builds_its_task_as_documented():
    """configs/reasoning_gym.yaml loads, and its task is spell_backward on 3-4 letter words behind two solved
    turns (what the README's learning figure ran)."""
    from pathlib import Path

    from llmrl import load_config

    cfg = load_config(Path(__file__).parent.parent / "configs" / "reasoning_gym.yaml")
    task = make_task(cfg.task, seed=cfg.seed, task_args=cfg.task_args)
    ex = task.sample_train_batch(1)[0]
    assert len(ex.messages) == 5 and ex.messages[1]["content"].startswith("<answer>")  # no system prompt, 2 shots
    words = [e.meta["item"]["metadata"]["word"] for e in task.eval_examples(200)]
    assert words and all(3 <= len(w) <= 4 for w in words)
