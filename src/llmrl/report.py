"""`llmrl report`: plots and one self-contained HTML page from one or more run directories.

    runs ──load──▶ RunData (config.yaml, metrics.jsonl, samples.jsonl, eval_samples.jsonl)
         ──plot──▶ one PNG per metric, every run overlaid      (out_dir/plots/*.png)
         ──page──▶ runs table + plots (base64) + sample completions  (out_dir/report.html)

The page references nothing outside itself (images are data: URIs, CSS is inline, there is no
script), so it can be mailed or opened from a checkpoint folder. Files are written to a temporary
name and renamed, so a reader opening the page while the trainer refreshes it never sees half of it.

Smoothing is a bias-corrected EMA (as in TensorBoard): s_t = w·s_{t-1} + (1-w)·v_t with s_0 = 0,
drawn as s_t / (1 - w^t), so the first points are not pulled towards 0. Eval metrics (a handful of
points) and cumulative counters are drawn unsmoothed, with markers.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import html
import io
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from llmrl.errors import ConfigError, DataError
from llmrl.run_files import CONFIG, DISK_ERRORS, EVAL_SAMPLES, METRICS, PLOTS, REPORT, SAMPLES, write_atomically

# x-axis choice -> (metric that holds it, axis label, divisor applied to the values)
X_AXES: dict[str, tuple[str, str, float]] = {
    "step": ("step", "RL step", 1.0),
    "optimizer_steps": ("train/optimizer_steps", "optimizer steps", 1.0),
    "completions": ("rollout/completions", "completions sampled", 1.0),
    "time": ("time/train_s", "training time (min)", 60.0),
}

# Plot order: the first prefix a metric starts with decides its rank; unknown metrics go just before time/.
METRIC_ORDER = ("reward/mean", "reward/", "eval/", "train/kl", "train/loss", "train/pg_loss", "train/clip",
                "train/entropy", "train/grad_norm", "rollout/completion_len", "rollout/truncated", "rollout/",
                "adv/", "train/", "time/")
# Drawn as they are, with markers: counters that only grow, and metrics logged at evals only.
UNSMOOTHED = {"train/optimizer_steps", "train/skipped_updates", "rollout/completions", "time/train_s", "time/eval_s"}
LOWER_IS_BETTER = ("truncated", "len", "loss", "error", "kl", "time")
KEY_FIELDS = ("model", "task", "algo", "lr", "batch_size", "group_size", "ppo_epochs", "clip_eps", "kl_coef",
              "grad_accum_steps", "steps", "seed")
NOT_COMPARED = {"run_name", "output_dir", "task", "algo"}  # shown elsewhere, or different by construction
FOLD_CHARS, FOLD_LINES = 400, 8


@dataclass
class RunData:
    """Everything read from one run directory; `error` is set when it has no usable metrics."""

    path: Path
    name: str
    config: dict[str, Any]
    records: list[dict[str, Any]]  # valid metrics records, sorted by step (train before eval at a step)
    samples: list[dict[str, Any]]
    eval_samples: list[dict[str, Any]]
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class Plot:
    """One metric's figure; `xs[run]` are the x values of the points actually drawn for that run."""

    metric: str
    png: Path
    data_uri: str
    xs: dict[str, list[float]]

    @property
    def points(self) -> dict[str, int]:
        return {name: len(xs) for name, xs in self.xs.items()}


@dataclass
class Report:
    html: Path
    plots: list[Plot]
    runs: list[RunData]
    notes: list[str]


# ---------------------------------------------------------------------------------------------- reading


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a .jsonl file that have an integer `step`; other lines (a line cut short by a
    kill, a stray value) are skipped. A missing file reads as no records."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and not isinstance(row["step"], bool):
            rows.append(row)
    return rows


def read_config(path: Path) -> dict[str, Any]:
    """config.yaml as a dict ({} when missing or not a mapping). Fields added to llmrl after the run was
    made get their defaults (which reproduce the older behaviour), so they do not show as differences."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(data, dict):
        return {}
    from llmrl.config import TrainConfig

    return {**TrainConfig().to_dict(), **data} if data else {}


def is_eval_record(record: dict[str, Any]) -> bool:
    return any(k.startswith("eval/") for k in record)


def dedupe_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One train and one eval record per step (the last one logged), sorted by step, train first."""
    kept: dict[tuple[int, bool], dict[str, Any]] = {}
    for r in records:
        kept[(r["step"], is_eval_record(r))] = r
    return [kept[k] for k in sorted(kept)]


def load_run(path: Path) -> RunData:
    """Read one run directory; never raises for a missing or broken file (sets `error` instead)."""
    config = read_config(path / CONFIG)
    name = str(config.get("run_name") or path.resolve().name)
    run = RunData(path, name, config, dedupe_records(read_jsonl(path / METRICS)),
                  read_jsonl(path / SAMPLES), read_jsonl(path / EVAL_SAMPLES))
    if not path.is_dir():
        run.error = f"{path}: not a directory"
    elif not (path / METRICS).is_file():
        run.error = f"{path / METRICS}: missing"
    elif not run.records:
        run.error = f"{path / METRICS}: no valid records"
    return run


def unique_names(runs: list[RunData]) -> None:
    """Make run names distinct: a repeated name gets its parent directory, then a counter."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.name] = counts.get(r.name, 0) + 1
    seen: set[str] = set()
    for r in runs:
        if counts[r.name] > 1:
            r.name = f"{r.path.resolve().parent.name}/{r.name}"
        base, n = r.name, 2
        while r.name in seen:
            r.name, n = f"{base} ({n})", n + 1
        seen.add(r.name)


# ---------------------------------------------------------------------------------------------- series


def number(value: Any) -> float | None:
    """A finite float, or None for null, NaN/inf, bools, strings and the like."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def metric_rank(name: str) -> float:
    """Position of a metric's group in METRIC_ORDER (unknown groups just before time/)."""
    known = (i for i, prefix in enumerate(METRIC_ORDER) if name.startswith(prefix))
    return next(known, len(METRIC_ORDER) - 1.5)


def metric_names(runs: list[RunData]) -> list[str]:
    """Every metric with at least one finite value in some run, in plotting order (ties: first seen)."""
    seen: dict[str, None] = {}
    for run in runs:
        for record in run.records:
            for key, value in record.items():
                if key != "step" and number(value) is not None:
                    seen.setdefault(key, None)
    return sorted(seen, key=metric_rank)  # sorted() is stable


def x_mapping(run: RunData, x_axis: str) -> tuple[Any, bool]:
    """(record -> x, whether the run had the x-axis metric). Records without it (eval records, old lines)
    take the x of the last train record at or before their step, or 0 before the first one; a run
    without the metric at all falls back to the step."""
    key, _, scale = X_AXES[x_axis]
    if key == "step":
        return (lambda r: float(r["step"])), True
    known = sorted((r["step"], v / scale) for r in run.records if (v := number(r.get(key))) is not None)
    if not known:
        return (lambda r: float(r["step"])), False
    steps = [s for s, _ in known]

    def x_of(record: dict[str, Any]) -> float:
        own = number(record.get(key))
        if own is not None:
            return own / scale
        i = bisect.bisect_right(steps, record["step"]) - 1
        return known[i][1] if i >= 0 else 0.0

    return x_of, True


def series(run: RunData, metric: str, x_of) -> tuple[list[float], list[float]]:
    """(xs, ys) of one metric in one run, null/non-finite values skipped, sorted by x."""
    points = sorted((x_of(r), v) for r in run.records if (v := number(r.get(metric))) is not None)
    return [x for x, _ in points], [y for _, y in points]


def ema(values: list[float], weight: float) -> list[float]:
    """Bias-corrected exponential moving average (see the module docstring)."""
    out, s = [], 0.0
    for t, v in enumerate(values, 1):
        s = weight * s + (1 - weight) * v
        out.append(s / (1 - weight**t))
    return out


# ---------------------------------------------------------------------------------------------- plots


def file_stem(metric: str, used: set[str]) -> str:
    """A file-system-safe, unique name for a metric's PNG ("reward/mean" -> "reward_mean")."""
    stem = "".join(c if c.isalnum() or c in "-." else "_" for c in metric).strip("._") or "metric"
    base, n = stem, 2
    while stem in used:
        stem, n = f"{base}_{n}", n + 1
    used.add(stem)
    return stem


def plot_metric(metric: str, runs: list[RunData], x_ofs: list, x_label: str, smooth: float) -> tuple[bytes, dict[str, list[float]]]:
    """Render one metric for all runs; returns the PNG bytes and the x values drawn per run."""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:  # leave a notebook's backend alone (no pyplot is used here)
        matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(5.6, 3.4), dpi=90)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colours = matplotlib.colormaps["tab10"]
    unsmoothed = metric.startswith("eval/") or metric in UNSMOOTHED or smooth <= 0
    drawn: dict[str, list[float]] = {}
    for i, (run, x_of) in enumerate(zip(runs, x_ofs)):
        xs, ys = series(run, metric, x_of)
        if not xs:
            continue
        colour = colours(i % 10)
        if len(xs) == 1 or unsmoothed:
            raw, = ax.plot(xs, ys, color=colour, marker="o", markersize=3.5, linewidth=1.4, label=run.name)
        else:
            raw, = ax.plot(xs, ys, color=colour, alpha=0.3, linewidth=1.0)
            ax.plot(xs, ema(ys, smooth), color=colour, linewidth=1.8, label=run.name)
        drawn[run.name] = [float(x) for x in raw.get_xdata()]
    if all(x.is_integer() for xs in drawn.values() for x in xs):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no "step 2.5" ticks
    ax.set_title(metric, fontsize=10)
    ax.set_xlabel(x_label, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue(), drawn


def pass_at_k_names(run: RunData) -> list[str]:
    """The run's eval/pass@j metrics, by j."""
    names = {k for r in run.records for k in r if k.startswith("eval/pass@") and number(r[k]) is not None}
    return sorted(names, key=lambda k: int(k.rsplit("@", 1)[1]))


def plot_pass_at_k(run: RunData, x_of, x_label: str) -> bytes:
    """One run's pass@j curves (one line per j) in one figure: does RL narrow or widen what it solves?"""
    import matplotlib

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.6, 3.4), dpi=90)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for name in pass_at_k_names(run):
        xs, ys = series(run, name, x_of)
        ax.plot(xs, ys, marker="o", markersize=3.5, linewidth=1.4, label=name.removeprefix("eval/"))
    ax.set_title(f"pass@k: {run.name}", fontsize=10)
    ax.set_xlabel(x_label, fontsize=8)
    ax.set_ylim(-0.02, 1.02)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def make_plots(runs: list[RunData], plot_dir: Path, x_axis: str, smooth: float) -> tuple[list[Plot], list[str]]:
    """One PNG per metric in `plot_dir`; returns the plots and notes about x-axis fallbacks."""
    plot_dir.mkdir(parents=True, exist_ok=True)
    key, label, _ = X_AXES[x_axis]
    x_ofs, fallback = [], []
    for run in runs:
        x_of, has_key = x_mapping(run, x_axis)
        x_ofs.append(x_of)
        if not has_key:
            fallback.append(run.name)
    notes = []
    if fallback:
        notes.append(f"no {key} in {', '.join(fallback)}: plotted against the RL step instead")
        label = "RL step" if len(fallback) == len(runs) else f"{label} (RL step for {', '.join(fallback)})"
    plots, used = [], set()
    pass_plots = []
    for run, x_of in zip(runs, x_ofs):
        if pass_at_k_names(run):
            png = plot_pass_at_k(run, x_of, label)
            path = plot_dir / f"{file_stem('pass_at_k_' + run.name, used)}.png"
            write_atomically(path, png)
            pass_plots.append(Plot(f"pass@k {run.name}", path, "data:image/png;base64," + base64.b64encode(png).decode("ascii"), {}))
    for metric in metric_names(runs):
        if metric.startswith("eval/") and pass_plots:
            plots += pass_plots  # at the head of the eval section
            pass_plots = []
        if metric != "reward/mean" and constant_value(runs, metric) is not None:
            continue  # listed in the constants table instead
        png, drawn = plot_metric(metric, runs, x_ofs, label, smooth)
        path = plot_dir / f"{file_stem(metric, used)}.png"
        write_atomically(path, png)
        plots.append(Plot(metric, path, "data:image/png;base64," + base64.b64encode(png).decode("ascii"), drawn))
    return plots + pass_plots, notes


def constant_value(runs: list[RunData], metric: str) -> float | None:
    """The one value a metric has in every record of every run (at least two records), else None."""
    values = {number(r[metric]) for run in runs for r in run.records if metric in r} - {None}
    count = sum(metric in r and number(r[metric]) is not None for run in runs for r in run.records)
    return next(iter(values)) if len(values) == 1 and count >= 2 else None


SECTION_PREFIXES = (("reward", ("reward/", "adv/")), ("eval", ("eval/", "pass@k")), ("policy", ("train/",)),
                    ("rollout", ("rollout/",)), ("time", ("time/",)))


def section_of(metric: str) -> str:
    return next((name for name, prefixes in SECTION_PREFIXES if metric.startswith(prefixes)), "other")


def auto_smooth(runs: list[RunData]) -> float:
    """An EMA weight for the run length: a window of about a tenth of the longest run, at most 0.9
    (40 steps: 0.75; 100 and more: 0.9; 10 or fewer: 0, raw values)."""
    steps = max((sum(not is_eval_record(r) for r in run.records) for run in runs), default=0)
    return round(min(0.9, max(0.0, 1 - 10 / steps)), 3) if steps else 0.0


# ---------------------------------------------------------------------------------------------- tables


def show(value: Any) -> str:
    """A config or metric value as short text."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "—" if value is None else str(value)


def differing_fields(runs: list[RunData]) -> list[str]:
    """Config fields whose values are not the same in every run (a field missing somewhere differs)."""
    keys = dict.fromkeys(k for r in runs for k in r.config)
    missing = object()
    return [k for k in keys if k not in NOT_COMPARED
            and len({json.dumps(r.config.get(k, missing), default=str, sort_keys=True) for r in runs}) > 1]


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m" if h else f"{m}m {s:02d}s"


def run_summary(run: RunData) -> dict[str, str]:
    """Steps done (of planned) and wall time (training + eval) of one run."""
    train = [r for r in run.records if not is_eval_record(r)]
    last = train[-1]["step"] if train else 0
    planned = run.config.get("steps")
    train_s = next((v for r in reversed(train) if (v := number(r.get("time/train_s"))) is not None), None)
    eval_s = [v for r in run.records if (v := number(r.get("time/eval_s"))) is not None]
    total = None if train_s is None and not eval_s else (train_s or 0.0) + sum(eval_s)
    return {"steps": f"{last}/{planned}" if isinstance(planned, int) else str(last), "time": duration(total)}


def eval_cell(run: RunData, metric: str) -> str:
    """'final (best)' of one eval metric; best is the min for metrics where lower is better."""
    values = [v for r in run.records if (v := number(r.get(metric))) is not None]
    if not values:
        return "—"
    best = min(values) if any(word in metric for word in LOWER_IS_BETTER) else max(values)
    final = f"{values[-1]:.4g}"
    return final if best == values[-1] else f"{final} <span class=dim>(best {best:.4g})</span>"


def runs_table(runs: list[RunData]) -> str:
    """The HTML table comparing runs: config that differs (or key fields for one run), eval results."""
    ok = [r for r in runs if r.error is None]
    evals = [m for m in metric_names(ok) if m.startswith("eval/")]
    if len(runs) == 1:
        config_cols: list[str] = []
    else:
        config_cols = differing_fields(runs)
    head = ["run", "task", "algo"] + config_cols + (["config"] if len(runs) == 1 else []) + evals + ["steps", "time"]
    rows = []
    for run in runs:
        if run.error is not None:
            rows.append(f"<tr><td>{esc(run.name)}</td><td colspan={len(head) - 1} class=err>{esc(run.error)}</td></tr>")
            continue
        cells = [esc(run.name), esc(show(run.config.get("task"))), esc(show(run.config.get("algo")))]
        cells += [esc(show(run.config.get(k))) for k in config_cols]
        if len(runs) == 1:
            cells.append(", ".join(f"{esc(k)}={esc(show(run.config[k]))}" for k in KEY_FIELDS if k in run.config))
        cells += [eval_cell(run, m) for m in evals]
        summary = run_summary(run)
        cells += [summary["steps"], summary["time"]]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    header = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in head) + "</tr>"
    note = ""
    if len(runs) > 1 and not config_cols:
        note = "<p class=dim>The runs' configs are the same (apart from names and output directories).</p>"
    return f"<table>{header}{''.join(rows)}</table>{note}"


# ---------------------------------------------------------------------------------------------- samples


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def folded(text: str) -> str:
    """Escaped text in a <pre>; long text is folded in a <details> showing its beginning."""
    if len(text) <= FOLD_CHARS and text.count("\n") < FOLD_LINES:
        return f"<pre>{esc(text)}</pre>"
    head = text[:120].replace("\n", " ⏎ ")
    return f"<details><summary>{esc(head)}… <span class=dim>({len(text)} chars)</span></summary><pre>{esc(text)}</pre></details>"


def pick_steps(rows: list[dict[str, Any]], wanted: list[int] | None) -> list[int]:
    """The steps to show: those asked for, else the first, middle and last step present."""
    present = sorted({r["step"] for r in rows})
    if wanted is not None:
        return [s for s in wanted if s in present]
    if not present:
        return []
    return list(dict.fromkeys([present[0], present[len(present) // 2], present[-1]]))


def sample_block(row: dict[str, Any]) -> str:
    """One completion: reward, advantage, answer, components, then prompt and completion text."""
    facts = [f"reward <b>{esc(show(row.get('reward')))}</b>"]
    if "advantage" in row:
        facts.append(f"advantage <b>{esc(show(row.get('advantage')))}</b>")
    if "answer" in row:
        facts.append(f"answer <code>{esc(show(row.get('answer')))}</code>")
    if isinstance(row.get("components"), dict):
        facts.append(esc(", ".join(f"{k}={show(v)}" for k, v in row["components"].items())))
    if "ended" in row:
        facts.append(f"ended={'yes' if row['ended'] else 'no'}")
    transcript = row.get("transcript")
    if isinstance(transcript, list):  # an environment's episode: every turn, labelled by who wrote it
        turns = [m for m in transcript if isinstance(m, dict)]
        replies = sum(m.get("role") == "assistant" for m in turns)
        facts.append(f"turns={replies} · environment messages={len(turns) - replies}")
        body = "".join(f"<div class=label>{'policy' if m.get('role') == 'assistant' else 'environment'} "
                       f"({esc(m.get('role'))})</div>{folded(str(m.get('content', '')))}" for m in turns)
    else:
        body = f"<div class=label>completion</div>{folded(str(row.get('completion', '')))}"
    return (f"<div class=sample><div class=facts>{' · '.join(facts)}</div>"
            f"<div class=label>prompt</div>{folded(str(row.get('prompt', '')))}{body}</div>")


def samples_section(run: RunData, steps: list[int] | None, max_samples: int) -> str:
    """Sampled (training) and eval completions of one run at the chosen steps."""
    parts = []
    for kind, rows in (("training samples", run.samples), ("eval samples", run.eval_samples)):
        chosen = pick_steps(rows, steps)
        if steps is not None and len(chosen) < len(steps) and rows:
            absent = sorted(set(steps) - set(chosen))
            parts.append(f"<p class=dim>{kind}: none at step {', '.join(map(str, absent))}</p>")
        for step in chosen:
            at_step = [r for r in rows if r["step"] == step]
            shown = at_step[:max_samples]
            blocks = "".join(sample_block(r) for r in shown)
            parts.append(f"<details open><summary>{kind} at step {step} "
                         f"<span class=dim>({len(shown)} of {len(at_step)})</span></summary>{blocks}</details>")
    if not parts:
        parts.append("<p class=dim>no samples logged</p>")
    return f"<h3>{esc(run.name)}</h3>" + "".join(parts)


# ---------------------------------------------------------------------------------------------- page


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em} h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px} td,th{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f4f4f4} .dim{color:#777} .err{color:#a00}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(460px,1fr));gap:8px}
.plots img{width:100%;height:auto;border:1px solid #eee}
.sample{border:1px solid #e4e4e4;border-radius:4px;margin:6px 0;padding:6px 8px}
.facts{font-size:12px;color:#444} .label{font-size:11px;color:#888;margin-top:4px}
pre{white-space:pre-wrap;word-break:break-word;margin:2px 0;background:#fafafa;padding:4px}
summary{cursor:pointer}
"""


def warnings_section(runs: list[RunData]) -> str:
    """The health warnings each run logged, with their steps (nothing when there are none)."""
    items = [f"<li><b>{esc(run.name)}</b>, step {r['step']}: {esc(w)}</li>"
             for run in runs for r in run.records for w in (r.get("warnings") or [])]
    return f"<h2>Warnings</h2><ul class=err>{''.join(items)}</ul>" if items else ""


def render_page(runs: list[RunData], plots: list[Plot], notes: list[str], *, x_axis: str, smooth: float,
                sample_steps: list[int] | None, max_samples: int) -> str:
    """The whole HTML document (no external references, no script)."""
    smoothing = f"EMA weight {smooth:g}, bias-corrected" if smooth > 0 else "none"
    notes_html = "".join(f"<li>{esc(n)}</li>" for n in notes)
    sections: dict[str, list[str]] = {}
    for p in plots:
        sections.setdefault(section_of(p.metric), []).append(
            f"<figure><img src=\"{p.data_uri}\" alt=\"{esc(p.metric)}\"></figure>")
    figures = "".join(f"<h3>{esc(name)}</h3><div class=plots>{''.join(figs)}</div>" for name, figs in sections.items())
    ok = [r for r in runs if r.error is None]
    constants = [(m, constant_value(ok, m)) for m in metric_names(ok) if m != "reward/mean" and constant_value(ok, m) is not None]
    constants_html = ("<h3>constant</h3><table><tr><th>metric</th><th>value (every record)</th></tr>"
                      + "".join(f"<tr><td>{esc(m)}</td><td>{esc(show(v))}</td></tr>" for m, v in constants) + "</table>"
                      if constants else "")
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<title>llmrl report: {esc(', '.join(r.name for r in runs))}</title><style>{STYLE}</style></head><body>"
        f"<h1>llmrl report</h1><p class=dim>{esc(time.strftime('%Y-%m-%d %H:%M:%S'))} · x axis: {esc(x_axis)} · "
        f"smoothing: {esc(smoothing)} (eval metrics and cumulative counters unsmoothed) · faint lines are raw values</p>"
        + (f"<ul class=err>{notes_html}</ul>" if notes else "")
        + f"<h2>Runs</h2>{runs_table(runs)}"
        + warnings_section(ok)
        + f"<h2>Metrics</h2>{figures}{constants_html}"
        + "<h2>Samples</h2>" + "".join(samples_section(r, sample_steps, max_samples) for r in ok)
        + "</body></html>\n"
    )


def write_report(run_dirs: list[Path], out_dir: Path, *, x_axis: str = "step", smooth: float | None = None,
                 sample_steps: list[int] | None = None, max_samples: int = 8) -> Report:
    """Build the report (see `build_report`) and return what was drawn, for the CLI and the tests.
    smooth None: scaled to the run length (auto_smooth)."""
    if x_axis not in X_AXES:
        raise ConfigError(f"x axis must be one of {', '.join(X_AXES)}, got {x_axis!r}")
    if smooth is not None and not 0 <= smooth < 1:
        raise ConfigError(f"smooth must be in [0, 1), got {smooth}")
    if max_samples < 0:
        raise ConfigError(f"max_samples must be >= 0, got {max_samples}")
    runs = [load_run(Path(d)) for d in run_dirs]
    if not runs:
        raise DataError("no run directories given")
    unique_names(runs)
    ok = [r for r in runs if r.error is None]
    if not ok:
        raise DataError("nothing to report: " + "; ".join(r.error or "" for r in runs))
    notes = [f"{r.name}: {r.error}" for r in runs if r.error is not None]
    smooth = auto_smooth(ok) if smooth is None else smooth
    out_dir = Path(out_dir)
    plots, plot_notes = make_plots(ok, out_dir / PLOTS, x_axis, smooth)
    notes += plot_notes
    page = render_page(runs, plots, notes, x_axis=x_axis, smooth=smooth, sample_steps=sample_steps, max_samples=max_samples)
    html_path = out_dir / REPORT
    write_atomically(html_path, page.encode("utf-8"))
    return Report(html_path, plots, runs, notes)


def build_report(run_dirs: list[Path], out_dir: Path, *, x_axis: str = "step", smooth: float | None = None,
                 sample_steps: list[int] | None = None, max_samples: int = 8) -> Path:
    """Write one PNG per metric to `out_dir/plots/` and a self-contained `out_dir/report.html` comparing
    `run_dirs`; returns the page's path. Runs without metrics are noted on the page; raises DataError
    when none has any."""
    return write_report(run_dirs, out_dir, x_axis=x_axis, smooth=smooth, sample_steps=sample_steps,
                        max_samples=max_samples).html


def refresh_run_report(run_dir: Path) -> None:
    """Rewrite `run_dir/report.html` (and `run_dir/plots/`) for one run, as the trainer does at each eval.
    A plotting problem prints one warning line and training goes on; only a failing disk (OSError with an
    errno in run_files.DISK_ERRORS) is raised, which stops the run like any other write that fails."""
    try:
        write_report([Path(run_dir)], Path(run_dir), max_samples=4)
    except Exception as e:  # noqa: BLE001 - a report must never stop training, but for a failing disk
        if isinstance(e, OSError) and e.errno in DISK_ERRORS:
            raise
        print(f"llmrl: warning: could not refresh {Path(run_dir) / REPORT}: {type(e).__name__}: {e}".splitlines()[0],
              file=sys.stderr)


# ---------------------------------------------------------------------------------------------- CLI


def parse_steps(text: str | None) -> list[int] | None:
    """'10,20,40' -> [10, 20, 40]; None stays None."""
    if text is None:
        return None
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--steps must be comma-separated integers, got {text!r}") from None


def add_report_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the `report` subcommand to an argparse subparsers object."""
    p = sub.add_parser("report", help="plots and an HTML report of one or more runs",
                       description="Plot every metric of the given run directories (overlaid) and write a "
                                   "self-contained report.html with a runs table and sample completions.")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (each with metrics.jsonl)")
    p.add_argument("--out", metavar="DIR", help="where to write report.html and plots/ (default: the first run)")
    p.add_argument("--x", dest="x_axis", choices=list(X_AXES), default="step", help="x axis (default: step)")
    p.add_argument("--smooth", type=float, default=None,
                   help="EMA weight in [0, 1), 0 = raw only (default: scaled to the run length, 0.75 at 40 steps, at most 0.9)")
    p.add_argument("--steps", metavar="S1,S2,...", help="steps to show samples of (default: first, middle, last)")
    p.add_argument("--max_samples", type=int, default=8, help="completions shown per run and step (default: 8)")
    return p


def cmd_report(args: argparse.Namespace) -> int:
    """Run `llmrl report`; prints the page's path and the number of plots."""
    out = Path(args.out) if args.out else Path(args.runs[0])
    report = write_report([Path(r) for r in args.runs], out, x_axis=args.x_axis, smooth=args.smooth,
                          sample_steps=parse_steps(args.steps), max_samples=args.max_samples)
    print(f"{report.html} ({len(report.plots)} plots)")
    for note in report.notes:
        print(f"llmrl: note: {note}", file=sys.stderr)
    return 0
