"""`llmrl bench`: FLOP-limit arithmetic, warm-up/median logic, config, and short end-to-end runs on the tiny model."""

import argparse
import importlib.util
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers import kept_logits

from llmrl import bench
from llmrl.bench import (
    add_bench_parser, cpu_bench, child_values, cmd_bench, drop_warmup, flop_count, flop_limit_seconds, median,
    kernel_rate, split_steps, summarize, timing_size,
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


def test_a_kernel_too_slow_for_full_size_is_timed_on_the_probe():
    # (2048/256)^3 = 512: a 256x256 product of 3.9e-3 s projects to 1.9968 s, of 3.91e-3 s to 2.00192 s
    assert timing_size(3.9e-3, 256, 2048, 2.0) == 2048
    assert timing_size(3.91e-3, 256, 2048, 2.0) == 256
    assert timing_size(0.2, 256, 2048, 2.0) == 256  # bf16 on AMD EPYC Zen 1: one 2048 product ~105 s
    assert timing_size(0.1, 300, 900, 2.7) == 900  # 0.1 * 27 rounds to the double 2.7 rounds to: the bound is inclusive
    assert timing_size(0.1, 300, 900, 2.69) == 300
    r = {"matmul_gflops_by_kernel": {"torch.mm": 69.35, "torch.mm_bf16": 1.894}, "matmul_n_by_kernel": {"torch.mm": 2048, "torch.mm_bf16": 256}}
    assert kernel_rate(r, "torch.mm") == "torch.mm 69" and kernel_rate(r, "torch.mm_bf16") == "torch.mm_bf16 1.9 on 256x256"


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
    from llmrl.install import pip_install

    with pytest.raises(ConfigError) as e:
        cmd_bench(parse(["--steps", "1"]))
    assert str(e.value) == f"TRL not installed: {pip_install('bench')} (or run with --no_trl)"
    assert bench.main(["--steps", "1"]) == 2
    assert capsys.readouterr().err == f"llmrl: error: TRL not installed: {pip_install('bench')} (or run with --no_trl)\n"


@pytest.fixture
def one_thread_config(tmp_path) -> str:
    """cpu-bench with one torch thread: on a small, busy machine the tiny model runs much faster so."""
    path = tmp_path / "cpu-bench-1t.yaml"
    path.write_text(yaml.safe_dump({**cpu_bench(), "num_threads": 1}))
    return str(path)


@pytest.mark.slow
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
    assert set(r["matmul_n_by_kernel"]) == set(rates) and set(r["matmul_n_by_kernel"].values()) <= {256, 2048}
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


@pytest.mark.slow
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


# ---- the TRL side computes what llmrl computes (or the bench says where it does not) ------------------------------


def test_token_mean_maps_to_trls_bnpo_not_dapo():
    from llmrl.bench_trl import trl_settings

    base = {**cpu_bench(), "top_k": 0, "repetition_penalty": 1.0, "adam_beta1": 0.9, "adam_beta2": 0.95,
            "weight_decay": 0.0}
    assert trl_settings({**base, "loss_agg": "token_mean"})["loss_type"] == "bnpo"
    assert trl_settings(base)["loss_type"] == "grpo"
    assert trl_settings({**base, "loss_agg": "seq_mean_token_sum"})["loss_type"] == "dr_grpo"
    assert trl_settings(base)["scale_rewards"] == "group"
    assert trl_settings({**base, "adv_estimator": "group_mean"})["scale_rewards"] == "none"
    assert trl_settings(base)["use_bias_correction_kl"] is False  # llmrl's KL is not multiplied by the ratio
    with pytest.raises(ValueError, match="adv_estimator='rloo' has no TRL scale_rewards"):
        trl_settings({**base, "adv_estimator": "rloo"})


class CoinLM(torch.nn.Module):
    """Two tokens, logits [0, θ] at every position: at θ = 0, d log π(y)/dθ = y − ½ = ±½."""

    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(()))

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        logits = torch.stack([torch.zeros(input_ids.shape), self.theta.expand(input_ids.shape)], -1)  # [N, L, 2]
        return SimpleNamespace(logits=kept_logits(logits, logits_to_keep))


def test_token_mean_over_an_accumulation_window_is_trls_bnpo_not_dapo():
    """One window of 2 minibatches (grad_accum_steps 2) of 3 rows with 5 and 7 completion tokens, reinforce:
    per-token loss ℓ = −A·log π(y), so at θ = 0 its gradient is g = −A·(y − ½):

        row  A     tokens  g per token            minibatch
        0    0.3   1       −0.15                  1: Σg = −0.15 + 0.55 + 0.35 = 0.75 over n1 = 5 tokens
        1   −1.1   0 1 1   −0.55, 0.55, 0.55
        2    0.7   0        0.35
        3   −0.2   1 1 0    0.1, 0.1, −0.1        2: Σg = 0.1 − 0.9 − 0.6 = −1.4 over n2 = 7 tokens
        4    0.9   1 1     −0.45, −0.45
        5   −0.6   0 0     −0.3, −0.3

    llmrl (token mean per minibatch, / grad_accum_steps) and TRL 1.16's bnpo (each micro-batch's
    Σ ℓ·m / Σ m, / gradient_accumulation_steps): dL/dθ = (0.75/5 − 1.4/7)/2 = −0.025.
    TRL's dapo divides each micro-batch's Σ ℓ·m by the generation batch's tokens (12, rescaled by
    gradient_accumulation_steps / steps_per_generation = 1): dL/dθ = (0.75 − 1.4)/12 = −0.0541667.
    One SGD step at lr 1 moves θ by −dL/dθ."""
    from llmrl.algorithms.losses import LossSettings
    from llmrl.training.update import UpdateBatch, UpdateSettings, policy_update

    adv = torch.tensor([0.3, -1.1, 0.7, -0.2, 0.9, -0.6])
    tokens = torch.tensor([[1, 0, 0], [0, 1, 1], [0, 0, 0], [1, 1, 0], [1, 1, 0], [0, 0, 0]])
    lengths = torch.tensor([1, 3, 1, 3, 2, 2])
    ids = torch.cat([torch.zeros(6, 1, dtype=torch.long), tokens], 1)  # [6, 4]: one prompt token
    mask = (torch.arange(3)[None, :] < lengths[:, None]).float()  # [6, 3]
    batch = UpdateBatch(input_ids=ids, attention_mask=torch.ones_like(ids), completion_mask=mask,
                        logp_old=torch.zeros(6, 3), logp_ref=None, adv=adv, group=torch.arange(6) // 3, prompt_len=1,
                        lengths=mask.sum(1))
    seed = 24  # its permutation puts rows {0, 1, 2} and {3, 4, 5} in the two minibatches
    perm = torch.randperm(6, generator=torch.Generator().manual_seed(seed)).tolist()
    assert {frozenset(perm[:3]), frozenset(perm[3:])} == {frozenset({0, 1, 2}), frozenset({3, 4, 5})}, perm

    # the two aggregations, from TRL 1.16's GRPOTrainer._compute_loss, applied to the per-token gradients g
    g = [torch.tensor([-0.15, -0.55, 0.55, 0.55, 0.35]), torch.tensor([0.1, 0.1, -0.1, -0.45, -0.45, -0.3, -0.3])]
    accum = steps_per_generation = 2
    bnpo = sum(gk.sum() / len(gk) / accum for gk in g)
    items_in_batch = sum(len(gk) for gk in g)  # num_items_in_batch: the generation batch's completion tokens
    dapo = sum(gk.sum() / (items_in_batch * accum / steps_per_generation) for gk in g)
    assert bnpo.item() == pytest.approx(-0.025, rel=1e-6) and dapo.item() == pytest.approx(-0.65 / 12, rel=1e-6)

    model = CoinLM()
    settings = UpdateSettings(algo="reinforce", loss=LossSettings(aggregate="token_mean"), ppo_epochs=1,
                              minibatch_size=3, grad_accum_steps=accum, kl_coef=0.0, kl_estimator="k3",
                              max_grad_norm=1e9)
    stats = policy_update(model, torch.optim.SGD(model.parameters(), lr=1.0), batch, settings,
                          torch.Generator().manual_seed(seed))
    assert stats.optimizer_steps == 1
    assert model.theta.item() == pytest.approx(0.025, rel=1e-5)  # −bnpo
    assert abs(model.theta.item() + dapo.item()) > 0.02  # not −dapo = 0.0541667


def test_group_zscore_differs_from_trls_scale_rewards_group_and_the_report_says_so():
    """Rewards 0.1, 0.7, 0.3, 1.3 (G = 4): mean 0.6, population std √0.21 = 0.458258, Bessel std √0.28
    = 0.529150. llmrl: A = (r − 0.6)/(0.458258 + 1e-6); TRL's scale_rewards=group: (r − 0.6)/(0.529150 + 1e-4),
    so TRL's A = llmrl's × 0.866 (√(3/4), up to the epsilons): for r = 1.3, 1.527525 vs 1.322587."""
    from llmrl.algorithms.core import group_zscore_advantages
    from llmrl.bench_trl import definition_differences

    rewards = torch.tensor([0.1, 0.7, 0.3, 1.3], dtype=torch.float64)
    llmrl = group_zscore_advantages(rewards, 4)
    trl = (rewards - rewards.mean()) / (rewards.std(unbiased=True) + 1e-4)  # TRL's nanstd: Bessel's correction
    assert llmrl[3].item() == pytest.approx(0.7 / (0.21 ** 0.5 + 1e-6), rel=1e-9)  # 1.527525
    assert trl[3].item() == pytest.approx(0.7 / (0.28 ** 0.5 + 1e-4), rel=1e-9)  # 1.322587
    assert (trl / llmrl).tolist() == pytest.approx([0.866] * 4, abs=3e-4)

    lines = definition_differences(cpu_bench())
    (std_line,) = [line for line in lines if "scale_rewards" in line]
    assert "Bessel std (n-1) + 1e-4" in std_line and "population std (n) + 1e-6" in std_line
    assert "sqrt((G-1)/G) = 0.866 at G=4" in std_line
    assert any("temperature (0.8)" in line for line in lines)  # cpu-bench samples at 0.8; TRL scores at it too
    assert not [line for line in definition_differences({**cpu_bench(), "adv_estimator": "group_mean"})
                if "scale_rewards" in line]  # group_mean is TRL's scale_rewards=none exactly

    side = {"step_s": 2.0, "rollout_s": 1.5, "update_s": 0.5, "tokens_per_s": 10.0, "peak_mb": 900.0,
            "prompt_tokens_per_step": 100.0, "mean_completion_tokens": 12.0}
    report = {"config": "cpu-bench", "steps": 1, "warmup_steps": 1, "alternate": 1, "num_threads": 2,
              "matmul_gflops": 50.0, "matmul_gflops_by_kernel": {"torch.mm": 50.0}, "llmrl": side, "trl": side,
              "speedup_vs_trl": 1.0, "flop_limit_ratio": 3.0, "flop_limit_s": 0.5, "matmul": "fastest fp32 kernel",
              "flop_limit_ratio_fp32": 3.0, "flop_limit_ratio_bf16": 2.0, "flop_limit_ratio_torch_mm": 3.0,
              "n_params": 1e6, "n_params_counts": "all", "trl_differences": lines}
    printed = bench.format_report(report).splitlines()
    assert f"differs from TRL: {std_line}" in printed  # on its own line
