"""docs/config.md, generated from `TrainConfig`: every field's name, type, default and help, in the
sections of `llmrl train --help`, and the TRL option names the command line points to llmrl's; and
docs/metrics.md, generated from `llmrl.metrics_schema`: every key of metrics.jsonl, when it is logged, its kind
and meaning.

    python -m llmrl.docs_gen            # rewrite docs/config.md and docs/metrics.md (`make docs`)
    python -m llmrl.docs_gen --check    # exit 1, with one line per page, when a page is not what this writes

tests/test_docs.py fails while either page is stale. Nothing heavy is imported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from llmrl import metrics_schema
from llmrl.config import FIELDS, SECTIONS, TRL_NAMES, TrainConfig

CONFIG_MD = Path(__file__).resolve().parents[2] / "docs" / "config.md"
METRICS_MD = CONFIG_MD.with_name("metrics.md")

HEADER = """\
# Config reference

Generated from `TrainConfig` (`src/llmrl/config.py`) by `make docs` (`python -m llmrl.docs_gen`): edit the
field's help there, not this page; `tests/test_docs.py` fails when the two differ.

Every field is a key of a YAML file given with `--config FILE` and an option `--field value` of `llmrl train`,
which override the file (`llmrl train --help` shows the same help, section by section). Booleans are written
`true` or `false`, lists comma-separated; *unset* means the field's help says what stands in.
"""

TRL_INTRO = """\
A TRL `GRPOConfig` (or transformers `TrainingArguments`) option name given to `llmrl train` or in a config file
is refused with a pointer to llmrl's field (`llmrl: error: unknown option --num_generations (--num_generations:
TRL's name for --group_size)`). Options of the same name (`seed`, `output_dir`, `temperature`, `top_p`,
`warmup_steps`, ...) need none.
"""


def cell(text: str) -> str:
    """`text` safe inside a Markdown table cell: no pipes, no tags, no emphasis markers."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def type_name(f: dataclasses.Field) -> str:
    """The field's annotation as written in config.py (`str | None`, `list[str]`)."""
    return f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))


def default_text(f: dataclasses.Field) -> str:
    """The default as a YAML value or command-line argument would spell it."""
    value: Any = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if value is None:
        return "*unset*"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, list):
        value = ",".join(map(str, value))
    return f"`{cell(str(value))}`"


def field_table(names: tuple[str, ...]) -> list[str]:
    rows = ["| field | type | default | what |", "|---|---|---|---|"]
    for name in names:
        f = FIELDS[name]
        rows.append(f"| `{name}` | `{cell(type_name(f))}` | {default_text(f)} | {cell(f.metadata['help'])} |")
    return rows


def render() -> str:
    """The whole text of docs/config.md."""
    out = [HEADER]
    placed = {name for names in SECTIONS.values() for name in names}
    sections = dict(SECTIONS)
    if rest := tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in placed):
        sections["other"] = rest
    for title, names in sections.items():
        out += [f"## {title}", "", *field_table(names), ""]
    out += ["## TRL names", "", TRL_INTRO, "| TRL | llmrl | note |", "|---|---|---|"]
    out += [f"| `{trl}` | `{name}` | {cell(note)} |" for trl, (name, note) in TRL_NAMES.items()]
    return "\n".join(out) + "\n"


METRICS_HEADER = """\
# Metrics reference

Generated from `src/llmrl/metrics_schema.py` by `make docs` (`python -m llmrl.docs_gen`): edit the entry there,
not this page; `tests/test_docs.py` fails when the two differ, when a run logs a key the schema does not know,
and when an entry names a key no code writes.

`metrics.jsonl` (in the [run directory](run-directory.md)) holds one JSON object per RL step and one per eval,
both with `step`; wandb and TensorBoard get the same names. Only rank 0 writes; means and counts cover every
rank's completions. NaN and infinities are written as `null`. *when* says when a key is in a record:

- *every step*: every RL step's record; *eval*: every eval's record (every `eval_interval` steps, at the end,
  and before step 1 for the untrained policy);
- *environments*: a multi-turn task (`--task calculator`, `--task guess`, an `Environment` class:
  [environments](environments.md));
- *vllm engines*: `--rollout_engine vllm` or `vllm-server`; *async*: `--max_staleness 1`; *dynamic_sampling*:
  `--dynamic_sampling true` ([engines](engines.md), [algorithms](algorithms.md));
- *task NAME*: that built-in task's reward components, counts and eval metrics; a custom task's are under
  [the patterns](#patterns).
"""

PATTERNS_INTRO = ("Keys whose names come from a config value or from the task: a key that is none of the above is "
                  "the first of these it matches.")

METRIC_SECTIONS = {  # prefix → heading (a key without "/" is under "")
    "": "Every record", "reward": "reward/", "adv": "adv/", "train": "train/", "rollout": "rollout/",
    "time": "time/", "eval": "eval/",
}


def metric_rows(items: list[tuple[str, metrics_schema.Metric]]) -> list[str]:
    rows = ["| key | when | kind | meaning |", "|---|---|---|---|"]
    return rows + [f"| `{key.replace('|', chr(92) + '|')}` | {cell(m.when)} | {cell(m.kind)} | {cell(m.text)} |"
                   for key, m in items]


def render_metrics() -> str:
    """The whole text of docs/metrics.md."""
    out = [METRICS_HEADER, "## Kinds", "", "| kind | what |", "|---|---|"]
    out += [f"| {cell(kind)} | {cell(text)} |" for kind, text in metrics_schema.KINDS.items()]
    out.append("")
    by_section: dict[str, list[tuple[str, metrics_schema.Metric]]] = {p: [] for p in METRIC_SECTIONS}
    for key, m in metrics_schema.METRICS.items():
        prefix = key.split("/", 1)[0] if "/" in key else ""
        by_section.setdefault(prefix, []).append((key, m))
    for prefix, items in by_section.items():
        if items:
            out += [f"## {METRIC_SECTIONS.get(prefix, prefix + '/')}", "", *metric_rows(items), ""]
    out += ["## Patterns", "", PATTERNS_INTRO, ""]
    out += metric_rows([(metrics_schema.shown(regex), m) for regex, m in metrics_schema.PATTERNS])
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmrl.docs_gen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 if a page differs")
    parser.add_argument("--path", type=Path, default=CONFIG_MD, help=f"the config page (default: {CONFIG_MD})")
    parser.add_argument("--metrics_path", type=Path, default=METRICS_MD,
                        help=f"the metrics page (default: {METRICS_MD})")
    args = parser.parse_args(argv)
    pages = [(args.path, render(), "TrainConfig"), (args.metrics_path, render_metrics(), "llmrl.metrics_schema")]
    if args.check:
        stale = 0
        for path, text, source in pages:
            current = path.read_text(encoding="utf-8") if path.exists() else None
            if current != text:
                why = "is missing" if current is None else f"differs from {source}"
                print(f"{path} {why}: run `make docs` (python -m llmrl.docs_gen)", file=sys.stderr)
                stale += 1
        return 1 if stale else 0
    for path, text, _ in pages:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
