"""`llmrl report` on hand-written run directories: plots carry the data, the page is self-contained
and escaped, the runs table shows what differs, x axes map eval records, broken runs are survivable."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from llmrl.errors import ConfigError, DataError
from llmrl.report import add_report_parser, build_report, cmd_report, ema, refresh_run_report, write_report

BASE_CONFIG = {"model": "tiny", "task": "format_copy", "algo": "grpo", "lr": 1e-4, "batch_size": 4, "group_size": 4,
               "ppo_epochs": 2, "clip_eps": 0.2, "kl_coef": 0.05, "grad_accum_steps": 2, "seed": 0, "steps": 5,
               "lora_target_modules": ["q_proj", "v_proj"]}
EVIL = "<script>alert(1)</script> &amp; done"


def train_record(step: int, **extra) -> dict:
    """A train record with cumulative counters: 2 optimizer steps, 16 completions, 30 s per RL step."""
    return {"step": step, "reward/mean": 0.1 * step, "reward/exact": 0.05 * step, "train/kl": 0.01 * step,
            "train/loss": -0.1 * step, "train/optimizer_steps": 2 * step, "rollout/completions": 16 * step,
            "time/train_s": 30.0 * step, **extra}


def eval_record(step: int, value: float) -> dict:
    return {"step": step, "eval/exact_match": value, "eval/truncated_frac": 1 - value, "time/eval_s": 5.0}


def make_run(root: Path, name: str, records: list[dict] | None, *, extra_lines: list[str] = (), samples=(),
             **config) -> Path:
    """A run directory with config.yaml, metrics.jsonl (None: no file) and samples.jsonl."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({**BASE_CONFIG, "output_dir": str(run), **config}))
    if records is not None:
        lines = [json.dumps(r) for r in records] + list(extra_lines)
        (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    (run / "samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return run


def sample(step: int, completion: str, reward: float = 1.0) -> dict:
    return {"step": step, "prompt": "Copy this: 7 & <8>", "answer": 7, "completion": completion, "reward": reward,
            "components": {"exact": reward}, "advantage": 0.5, "ended": True}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    grpo_records = [eval_record(0, 0.0)]
    for step in range(1, 6):
        grpo_records.append(train_record(step, **({"train/kl": None} if step == 2 else {})))
        if step in (3, 5):
            grpo_records.append(eval_record(step, step / 5))
    samples = [sample(s, f"step {s} #{i} " + EVIL + " long" * (200 if i == 0 else 0)) for s in (1, 3, 5) for i in range(3)]
    return {
        "grpo": make_run(root, "grpo", grpo_records, samples=samples,
                         extra_lines=["{not json", '{"step": 6, "reward/mean": 0.'], run_name="grpo-run"),
        "reinforce": make_run(root, "reinforce", [eval_record(0, 0.0)] + [train_record(s) for s in range(1, 5)]
                              + [eval_record(4, 0.5)], algo="reinforce", lr=2e-4),
        "one": make_run(root, "one", [train_record(1, **{"train/loss": float("nan")})]),  # written as NaN
        "missing": make_run(root, "missing", None),
    }


@pytest.fixture(scope="module")
def report(runs, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    return write_report([runs["grpo"], runs["reinforce"], runs["one"], runs["missing"]], out, x_axis="step")


def plot(report, metric: str):
    return next(p for p in report.plots if p.metric == metric)


def test_each_plot_is_a_png_with_the_points_of_every_run(report):
    import matplotlib.image

    assert report.html.is_file() and report.plots
    for p in report.plots:
        assert p.png.is_file() and p.png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
        pixels = matplotlib.image.imread(p.png)
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert sum(p.points.values()) > 0, p.metric
    assert plot(report, "reward/mean").points == {"grpo-run": 5, "reinforce": 4, "one": 1}
    assert plot(report, "train/kl").points["grpo-run"] == 4  # the null at step 2 is skipped
    assert "one" not in plot(report, "train/loss").points  # its only value is NaN
    assert plot(report, "eval/exact_match").points == {"grpo-run": 3, "reinforce": 2}
    assert plot(report, "reward/mean").xs["grpo-run"] == [1, 2, 3, 4, 5]  # the partial line (step 6) is skipped


def test_metrics_are_ordered_reward_first_then_eval_and_time_last(report):
    names = [p.metric for p in report.plots]
    assert names[0] == "reward/mean"
    assert names.index("reward/exact") < names.index("eval/exact_match") < names.index("train/kl") < names.index("train/loss")
    assert names[-1].startswith("time/")


def test_page_is_self_contained_and_escaped(report):
    page = report.html.read_text(encoding="utf-8")
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "<script" not in page.lower()
    assert "&amp;amp;" in page  # the literal "&amp;" in a completion is shown as written
    assert "http://" not in page and "https://" not in page
    sources = re.findall(r"<img[^>]*\ssrc=\"([^\"]*)\"", page)
    assert len(sources) == len(report.plots) == page.count("<img")
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    assert "<details" in page  # the long completion is folded
    assert "metrics.jsonl: missing" in page and "missing" in report.notes[0]


def runs_table(page: str) -> str:
    return page[page.index("<h2>Runs</h2>"):page.index("<h2>Metrics</h2>")]


def test_runs_table_shows_fields_that_differ_and_eval_results(report):
    table = runs_table(report.html.read_text(encoding="utf-8"))
    headers = re.findall(r"<th>([^<]*)</th>", table)
    assert "lr" in headers and "run" in headers and "algo" in headers and "eval/exact_match" in headers
    assert "reinforce" in table and "grpo" in table
    assert "seed" not in headers and "lora_target_modules" not in headers and "output_dir" not in headers
    assert "5/5" in table  # steps done of planned


def test_single_run_table_lists_key_fields(runs, tmp_path):
    html_path = build_report([runs["reinforce"]], tmp_path, smooth=0.0)
    table = runs_table(html_path.read_text(encoding="utf-8"))
    assert html_path == tmp_path / "report.html"
    assert "lr=0.0002" in table and "seed=0" in table and "group_size=4" in table


@pytest.mark.parametrize(("x_axis", "train_xs", "eval_xs"), [
    ("optimizer_steps", [2, 4, 6, 8, 10], [0, 6, 10]),
    ("completions", [16, 32, 48, 64, 80], [0, 48, 80]),
    ("time", [0.5, 1.0, 1.5, 2.0, 2.5], [0, 1.5, 2.5]),  # minutes
])
def test_x_axis_uses_the_cumulative_counters_and_maps_eval_records(runs, tmp_path, x_axis, train_xs, eval_xs):
    rep = write_report([runs["grpo"]], tmp_path, x_axis=x_axis)
    assert plot(rep, "reward/mean").xs["grpo-run"] == pytest.approx(train_xs)
    assert plot(rep, "eval/exact_match").xs["grpo-run"] == pytest.approx(eval_xs)
    assert rep.notes == []


def test_x_axis_falls_back_to_step_and_says_so(tmp_path):
    old = make_run(tmp_path, "old", [{"step": s, "reward/mean": 0.5} for s in (1, 2, 3)])
    rep = write_report([old], tmp_path / "out", x_axis="optimizer_steps")
    assert plot(rep, "reward/mean").xs["old"] == [1, 2, 3]
    assert "plotted against the RL step" in rep.html.read_text(encoding="utf-8")


def test_sample_steps_and_max_samples(runs, tmp_path):
    page = build_report([runs["grpo"]], tmp_path, sample_steps=[3, 4], max_samples=1).read_text(encoding="utf-8")
    assert "training samples at step 3" in page and "step 3 #0" in page and "step 3 #1" not in page
    assert "none at step 4" in page and "step 1 #0" not in page
    default = build_report([runs["grpo"]], tmp_path).read_text(encoding="utf-8")
    assert all(f"training samples at step {s}" in default for s in (1, 3, 5))


def test_no_data_anywhere_raises_a_data_error_naming_the_path(runs, tmp_path):
    empty = make_run(tmp_path, "empty", [], extra_lines=["garbage"])
    with pytest.raises(DataError, match="empty.*metrics.jsonl") as e:
        build_report([runs["missing"], empty], tmp_path / "out")
    assert str(runs["missing"] / "metrics.jsonl") in str(e.value)


def test_bad_options_are_config_errors(runs, tmp_path):
    with pytest.raises(ConfigError, match="smooth"):
        build_report([runs["grpo"]], tmp_path, smooth=1.5)
    with pytest.raises(ConfigError, match="x axis"):
        build_report([runs["grpo"]], tmp_path, x_axis="tokens")


def test_duplicate_run_names_are_made_distinct(runs, tmp_path):
    rep = write_report([runs["one"], runs["one"]], tmp_path)
    names = [r.name for r in rep.runs]
    assert len(set(names)) == 2 and plot(rep, "reward/mean").points == {names[0]: 1, names[1]: 1}


def test_ema_is_bias_corrected():
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])
    assert ema([0.0, 1.0], 0.5) == pytest.approx([0.0, 0.5 / 0.75])


def test_refresh_run_report_writes_into_the_run_and_never_raises(runs, tmp_path, capsys):
    refresh_run_report(tmp_path / "nowhere")
    refresh_run_report(runs["missing"])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.startswith("llmrl: warning:") for line in err)
    run = make_run(tmp_path, "live", [eval_record(0, 0.0), train_record(1)])
    refresh_run_report(run)
    assert (run / "report.html").is_file() and (run / "plots" / "reward_mean.png").is_file()
    assert not list(run.rglob(".tmp-*"))


def test_cli_report_command(runs, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_report_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["report", str(runs["grpo"]), str(runs["reinforce"]), "--out", str(tmp_path),
                              "--x", "optimizer_steps", "--smooth", "0", "--steps", "1,5", "--max_samples", "2"])
    assert cmd_report(args) == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "report.html") in out and re.search(r"\(\d+ plots\)", out)
    with pytest.raises(ConfigError, match="--steps"):
        cmd_report(parser.parse_args(["report", str(runs["grpo"]), "--steps", "a,b"]))


def test_tensorboard_logger_writes_finite_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from llmrl.tensorboard_log import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path / "tb")
    logger.log({"reward/mean": 0.25, "train/kl": None, "train/loss": float("nan"), "note": "x", "flag": True}, step=1)
    logger.log({"reward/mean": 0.75, "eval/exact_match": 1}, step=2)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["eval/exact_match", "reward/mean"]
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]


def test_tensorboard_missing_is_a_config_error(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name == "tensorboard" or name.startswith("torch.utils.tensorboard"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    from llmrl.tensorboard_log import TensorBoardLogger

    with pytest.raises(ConfigError, match="pip install tensorboard"):
        TensorBoardLogger(tmp_path / "tb")


@pytest.mark.slow
def test_training_refreshes_its_report_and_writes_tensorboard(tmp_path, tiny_model_dir):
    """A real (tiny) run: report.html is refreshed at each eval, TensorBoard gets the same metric names,
    and `llmrl report` reads the run directory."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from helpers import cli, tiny_args

    run = tmp_path / "run"
    cli(*tiny_args(str(tiny_model_dir), run, "grpo", steps=2, tensorboard="true"))
    page = (run / "report.html").read_text()
    assert "reward/mean" in page and page.count('src="data:image/png;base64,') >= 10
    events = EventAccumulator(str(run / "tensorboard")).Reload()
    assert {"reward/mean", "train/kl", "eval/reward"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("reward/mean")] == [1, 2]
    out = tmp_path / "cmp"
    p = cli("report", str(run), str(run), "--out", str(out), "--x", "completions")
    assert (out / "report.html").exists() and "report.html" in p.stdout


def test_report_lists_health_warnings_and_draws_pass_at_k(tmp_path):
    records = [train_record(1), train_record(2), train_record(3, warnings=["100% of completions were cut " + EVIL])]
    records += [{"step": s, "eval/pass@1": 0.1 * s, "eval/pass@2": 0.15 * s, "eval/pass@4": 0.2 * s, "eval/maj@4": 0.1}
                for s in (0, 3)]
    run = make_run(tmp_path, "sampled", records)
    r = write_report([run], tmp_path / "out")
    html = r.html.read_text()
    assert "<h2>Warnings</h2>" in html and "step 3: 100% of completions were cut" in html
    assert "<script>" not in html  # the warning text is escaped
    pass_plots = [p for p in r.plots if p.metric.startswith("pass@k")]
    assert len(pass_plots) == 1 and pass_plots[0].png.is_file()
    quiet = make_run(tmp_path, "quiet", [train_record(1)])
    assert "<h2>Warnings</h2>" not in Path(build_report([quiet], tmp_path / "q")).read_text()


def test_sections_constant_series_and_smoothing_scaled_to_the_run(tmp_path):
    from llmrl.report import auto_smooth, load_run

    records = [train_record(s, **{"train/skipped_updates": 0, "rollout/prompts_truncated": 0}) for s in range(1, 41)]
    run = make_run(tmp_path, "forty", records + [eval_record(40, 1.0)])
    r = write_report([run], tmp_path / "out")
    names = [p.metric for p in r.plots]
    assert "train/skipped_updates" not in names and "rollout/prompts_truncated" not in names  # always 0: folded
    page = r.html.read_text()
    assert "<h3>constant</h3>" in page and "train/skipped_updates" in page
    assert page.index("<h3>reward</h3>") < page.index("<h3>eval</h3>") < page.index("<h3>policy</h3>") < page.index("<h3>time</h3>")
    assert "EMA weight 0.75" in page  # 40 steps: a window of about 4
    assert auto_smooth([load_run(run)]) == 0.75
    short = make_run(tmp_path, "short", [train_record(s) for s in range(1, 6)])
    assert auto_smooth([load_run(short)]) == 0.0
    assert auto_smooth([load_run(make_run(tmp_path, "long", [train_record(s) for s in range(1, 501)]))]) == 0.9


def test_environment_samples_show_every_turn_with_who_wrote_it(tmp_path):
    """A multi-turn sample: turns and environment messages counted, each message labelled policy or
    environment, in transcript order; the rollout/turns and tool curves are plotted."""
    transcript = [{"role": "assistant", "content": "<calc>964*59</calc>"}, {"role": "user", "content": "<result>56876</result>"},
                  {"role": "assistant", "content": "<answer>56876</answer>"}]
    row = {**sample(1, "<answer>56876</answer>"), "transcript": transcript}
    run = make_run(tmp_path, "calc", [train_record(1, **{"rollout/turns": 2.0, "rollout/tool_calls": 1.0})], samples=[row])
    page = build_report([run], tmp_path / "out").read_text(encoding="utf-8")
    assert "turns=2 · environment messages=1" in page
    labels = re.findall(r"<div class=label>(policy|environment) \((\w+)\)</div>", page)
    assert labels == [("policy", "assistant"), ("environment", "user"), ("policy", "assistant")]
    assert page.index("&lt;calc&gt;964*59") < page.index("&lt;result&gt;56876") < page.index("&lt;answer&gt;56876")
    assert (tmp_path / "out" / "plots" / "rollout_turns.png").exists() and (tmp_path / "out" / "plots" / "rollout_tool_calls.png").exists()
