"""`llmrl bench`: FLOP-limit arithmetic, warm-up/median logic, config, and short end-to-end runs on the tiny model."""

import argparse
import importlib.util
import json
import math
from pathlib import Path

import pytest
import yaml

from llmrl import bench
from llmrl.bench import (
    add_bench_parser, cpu_bench, child_values, cmd_bench, drop_warmup, flop_count, flop_limit_seconds, median,
    split_steps, summarize,
)
from llmrl.errors import ConfigError

HAS_TRL = importlib.util.find_spec("trl") is not None
REPO = Path(__file__).parent.parent


def test_flop_limit_hand_worked():
    # N=100, P=[10, 20], G=4, R=5, 2 epochs, kl: (2 + 2 + 4·2)·100·((10+20) + 2·4·5) = 12·100·70
    assert flop_count(100, [10, 20], 5, 4, 2, True) == 84_000
    assert flop_count(100, [10, 20], 5, 4, 2, False) == 70_000  # no reference pass: (2 + 8)·100·70
    assert flop_count(100, [10, 20], 5, 4, 1, True) == 56_000  # one epoch: (2 + 2 + 4)·100·70
    assert flop_limit_seconds(100, [10, 20], 5, 4, 2, True, flops_per_s=1_000) == pytest.approx(84.0)
    # fractional mean completion length: 1 group, P=7, G=2, R=2.5 → 12 tokens; (2+2+4)·10·12
    assert flop_count(10, [7], 2.5, 2, 1, True) == pytest.approx(960)


def test_warmup_and_median():
    assert drop_warmup([9.0, 1.0, 2.0, 30.0]) == [1.0, 2.0, 30.0]
    assert median(drop_warmup([9.0, 1.0, 2.0, 30.0])) == 2.0
    assert median(drop_warmup([9.0, 1.0, 3.0])) == 2.0
    assert median([]) is None
    assert split_steps(3, 1) == [3]
    assert split_steps(3, 2) == [2, 1]
    assert split_steps(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ConfigError):
        split_steps(2, 3)


def test_summarize():
    cfg = {**cpu_bench(), "batch_size": 2, "group_size": 2}  # 4 completions per step
    steps = [
        {"step_s": 4.0, "rollout_s": 3.0, "update_s": 1.0, "completion_tokens": 8, "prompt_tokens": [10, 20]},
        {"step_s": 2.0, "rollout_s": 1.0, "update_s": 1.0, "completion_tokens": 16, "prompt_tokens": [10, 20]},
        {"step_s": 3.0, "rollout_s": 2.0, "update_s": 1.0, "completion_tokens": 12, "prompt_tokens": [10, 20]},
    ]
    s = summarize(steps, peak_mb=500.0, n_params=100, cfg=cfg, flops_per_s=1.0)
    assert (s["step_s"], s["rollout_s"], s["update_s"]) == (3.0, 2.0, 1.0)
    assert s["tokens_per_s"] == pytest.approx(36 / 9)
    # R = 12/4 = 3 in the median step: tokens = 30 + 2·2·3 = 42, FLOP = (2 + 2 + 8)·100·42
    assert s["flop_limit_s"] == pytest.approx(12 * 100 * 42)
    assert s["flop_limit_ratio"] == pytest.approx(3.0 / (12 * 100 * 42))
    assert s["peak_mb"] == 500.0
    assert "generate_s" not in s and "logprobs_s" not in s  # parts only where a side measured them
    steps[0] |= {"generate_s": 0.5, "logprobs_s": 0.25}  # measured in some steps: the median of those
    steps[2] |= {"generate_s": 1.5, "logprobs_s": 0.75}
    steps[1] |= {"generate_s": 0.75, "logprobs_s": None}
    s = summarize(steps, peak_mb=500.0, n_params=100, cfg=cfg, flops_per_s=1.0)
    assert (s["generate_s"], s["logprobs_s"]) == (0.75, 0.5)


def test_bench_config_is_specs_cpu_bench():
    """bench reads configs/cpu-bench.yaml: SPEC's cpu-bench settings."""
    c = cpu_bench()
    assert (c["model"], c["task"], c["algo"], c["batch_size"], c["group_size"], c["max_new_tokens"]) == (
        "smollm2-135m-instruct", "format_copy", "grpo", 4, 4, 24)
    assert (c["ppo_epochs"], c["minibatch_size"], c["grad_accum_steps"], c["clip_eps"], c["kl_coef"], c["warmup_steps"]) == (
        2, 8, 2, 0.2, 0.05, 10)


def test_child_values_turn_off_eval_and_logging():
    v = child_values(cpu_bench(), 2, group_size=8)
    assert (v["steps"], v["group_size"], v["eval_n"], v["sample_log_interval"], v["wandb"]) == (2, 8, 0, 0, False)


def parse(argv):
    parser = argparse.ArgumentParser(prog="llmrl")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", *argv])


def test_parser_defaults():
    a = parse([])
    assert (a.steps, a.no_trl, a.sweep, a.model, a.config, a.alternate, a.work_dir, a.json, a.num_threads) == (
        3, False, None, None, None, 1, None, None, None)
    import llmrl.bench as bench

    assert parse(["--sweep"]).sweep == bench.SWEEP
    assert parse(["--sweep", "4:512:512,8:24"]).sweep == [(4, 512, 512), (8, None, 24)]
    for bad in ("4", "4:x", "0:24", "4:1:2:3"):
        with pytest.raises(SystemExit):
            parse(["--sweep", bad])
    assert a.trl_checkpointing is True and parse(["--trl_checkpointing", "false"]).trl_checkpointing is False
    with pytest.raises(SystemExit):
        parse(["--trl_checkpointing", "maybe"])


def test_trl_missing_is_one_clear_line(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a))
    with pytest.raises(ConfigError, match=r'TRL not installed: pip install "llmrl\[bench\]" \(or run with --no_trl\)'):
        cmd_bench(parse(["--steps", "1"]))
    assert bench.main(["--steps", "1"]) == 2
    assert capsys.readouterr().err == 'llmrl: error: TRL not installed: pip install "llmrl[bench]" (or run with --no_trl)\n'


@pytest.fixture
def one_thread_config(tmp_path) -> str:
    """cpu-bench with one torch thread: on a small, busy machine the tiny model runs much faster so."""
    path = tmp_path / "cpu-bench-1t.yaml"
    path.write_text(yaml.safe_dump({**cpu_bench(), "num_threads": 1}))
    return str(path)


def test_bench_no_trl_end_to_end(tiny_model_dir, one_thread_config, tmp_path, capsys):
    out = tmp_path / "out.json"
    args = parse(["--no_trl", "--steps", "1", "--model", tiny_model_dir, "--config", one_thread_config,
                  "--json", str(out), "--matmul_seconds", "0.3", "--work_dir", str(tmp_path / "work")])
    assert cmd_bench(args) == 0
    printed = capsys.readouterr().out
    assert "llmrl bench:" in printed and "speedup_vs_trl n/a" in printed
    r = json.loads(out.read_text())
    assert r["speedup_vs_trl"] is None and r["trl"] is None and r["sweep"] is None
    assert r["speedup_vs_trl_checkpointing"] is None and r["trl_checkpointing"] is None
    assert r["num_threads"] == 1
    for value in (r["flop_limit_ratio"], r["flop_limit_s"], r["matmul_gflops"], r["n_params"], r["flop_limit_ratio_torch_mm"]):
        assert math.isfinite(value) and value > 0
    rates = r["matmul_gflops_by_kernel"]
    fp32 = {k: v for k, v in rates.items() if not k.endswith("_bf16")}
    assert "torch.mm" in rates and "torch.mm_bf16" in rates
    assert r["matmul_gflops"] == max(fp32.values())  # the limit uses the fastest kernel of llmrl's precision (fp32)
    assert r["flop_limit_ratio_torch_mm"] == pytest.approx(r["flop_limit_ratio"] * rates["torch.mm"] / r["matmul_gflops"])
    bf16 = max(v for k, v in rates.items() if k.endswith("_bf16"))  # torch.mm_bf16, onednn_packed_bf16
    assert r["flop_limit_ratio_bf16"] == pytest.approx(r["flop_limit_ratio"] * bf16 / r["matmul_gflops"])
    s = r["llmrl"]
    for key in ("step_s", "rollout_s", "update_s", "tokens_per_s", "peak_mb", "flop_limit_s", "flop_limit_ratio",
                "mean_completion_tokens", "prompt_tokens_per_step"):
        assert math.isfinite(s[key]) and s[key] > 0, key
    assert s["measured_steps"] == 1 and len(s["warmup"]) == 1
    assert s["step_s"] == pytest.approx(s["rollout_s"] + s["update_s"])
    assert s["rollout_s"] > s["generate_s"] + s["logprobs_s"] and min(s["generate_s"], s["logprobs_s"]) > 0
    assert f"{s['generate_s']:8.2f} {s['update_s']:8.2f}" in printed  # the table's generate column
    assert len(s["steps"][0]["prompt_tokens"]) == cpu_bench()["batch_size"]
    assert (tmp_path / "work" / "round1-llmrl" / "run" / "metrics.jsonl").exists()


@pytest.mark.skipif(not HAS_TRL, reason="TRL not installed (pip install 'llmrl[bench]')")
def test_trl_settings_map_one_generation_to_one_rl_step():
    """TRL generates one batch of B·G completions and reuses it for num_iterations optimizer steps."""
    from trl import GRPOConfig

    from llmrl.bench_trl import trl_settings

    args = GRPOConfig(output_dir="unused", use_cpu=True, **trl_settings({**cpu_bench(), "top_k": 0, "repetition_penalty": 1.0,
                                                                       "adam_beta1": 0.9, "adam_beta2": 0.95,
                                                                       "weight_decay": 0.0}))
    assert args.generation_batch_size == cpu_bench()["batch_size"] * cpu_bench()["group_size"] == 16
    assert args.steps_per_generation == args.gradient_accumulation_steps == 2
    assert args.num_iterations == 2 and args.max_steps == 2 * cpu_bench()["steps"]
    assert args.loss_type == "grpo" and args.beta == 0.05 and args.epsilon == 0.2 and not args.shuffle_dataset
    with pytest.raises(ValueError):
        trl_settings({**cpu_bench(), "group_size": 8})


@pytest.mark.skipif(not HAS_TRL, reason="TRL not installed (pip install 'llmrl[bench]')")
def test_trl_side_one_step(tiny_model_dir, one_thread_config, tmp_path):
    _, values = bench.bench_values(one_thread_config, tiny_model_dir)
    r = bench.run_side("trl", child_values(values, 1), tmp_path / "trl", quiet=True)
    assert r["side"] == "trl" and r["global_steps"] == 2 and r["n_params"] > 0 and r["max_rss_mb"] > 0
    (step,) = r["steps"]
    assert step["step_s"] > step["rollout_s"] > step["generate_s"] > 0
    assert step["update_s"] > 0 and step["completion_tokens"] > 0
    assert len(step["prompt_tokens"]) == cpu_bench()["batch_size"]
    assert r["gradient_checkpointing"] is False  # like llmrl's cpu-bench
    r = bench.run_side("trl_checkpointing", child_values(values, 1), tmp_path / "trl_ckpt", quiet=True)
    assert r["gradient_checkpointing"] is True and len(r["steps"]) == 1  # TRL's own default


def test_sweep_rows_carry_their_shape_and_forced_rows_have_exactly_their_length(tiny_model_dir, one_thread_config,
                                                                                 tmp_path):
    out = tmp_path / "out.json"  # the config's own row comes first, then a forced 6-token row
    args = parse(["--no_trl", "--sweep", "2:6:6", "--steps", "1", "--model", tiny_model_dir, "--config", one_thread_config,
                  "--json", str(out), "--matmul_seconds", "0.2"])
    assert cmd_bench(args) == 0
    rows = json.loads(out.read_text())["sweep"]
    for row in rows:
        for key in ("group_size", "min_new_tokens", "max_new_tokens", "step_s", "tokens_per_s", "flop_limit_ratio",
                    "peak_mb", "rollout_s", "generate_s", "logprobs_s", "update_s"):
            assert key in row and row[key] is not None, key
        assert row["step_s"] == pytest.approx(row["rollout_s"] + row["update_s"])
        assert row["rollout_s"] > row["generate_s"] + row["logprobs_s"]
    own, forced = rows
    assert (own["group_size"], own["min_new_tokens"], own["max_new_tokens"]) == (4, cpu_bench()["min_new_tokens"], 24)
    assert (forced["group_size"], forced["min_new_tokens"], forced["max_new_tokens"]) == (2, 6, 6)
    assert forced["completion_tokens_per_step"] == cpu_bench()["batch_size"] * 2 * 6  # every completion exactly 6 tokens
