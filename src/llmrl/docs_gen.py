"""docs/config.md, generated from `TrainConfig`: every field's name, type, default and help, in the
sections of `llmrl train --help`, and the TRL option names the command line points to llmrl's.

    python -m llmrl.docs_gen            # rewrite docs/config.md (`make docs`)
    python -m llmrl.docs_gen --check    # exit 1, with one line, when docs/config.md is not what this writes

tests/test_docs.py fails while docs/config.md is stale. Nothing heavy is imported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from llmrl.config import FIELDS, SECTIONS, TRL_NAMES, TrainConfig

CONFIG_MD = Path(__file__).resolve().parents[2] / "docs" / "config.md"

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmrl.docs_gen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 if the file differs")
    parser.add_argument("--path", type=Path, default=CONFIG_MD, help=f"the page (default: {CONFIG_MD})")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.path.read_text(encoding="utf-8") if args.path.exists() else None
        if current != text:
            why = "is missing" if current is None else "differs from TrainConfig"
            print(f"{args.path} {why}: run `make docs` (python -m llmrl.docs_gen)", file=sys.stderr)
            return 1
        return 0
    args.path.parent.mkdir(parents=True, exist_ok=True)
    args.path.write_text(text, encoding="utf-8")
    print(f"wrote {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
