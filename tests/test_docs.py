"""The documentation stays true: docs/config.md is what `make docs` writes from TrainConfig and docs/metrics.md
what it writes from llmrl.metrics_schema, every key real runs log is in that schema and every exact key of it is
written somewhere in src/llmrl, the README is a short front door, every relative link (and its #anchor) leads
somewhere, and the README's TRL names are config.py's."""

import re
from pathlib import Path

from llmrl import docs_gen, metrics_schema
from llmrl.config import TRL_NAMES

REPO = Path(__file__).parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_config_page_is_generated_from_the_config():
    assert (REPO / "docs" / "config.md").read_text(encoding="utf-8") == docs_gen.render(), (
        "docs/config.md is stale: run `make docs`")


def test_metrics_page_is_generated_from_the_schema():
    assert (REPO / "docs" / "metrics.md").read_text(encoding="utf-8") == docs_gen.render_metrics(), (
        "docs/metrics.md is stale: run `make docs`")


def test_docs_gen_check_exits_1_on_a_stale_page_and_0_once_written(tmp_path, capsys):
    config, metrics = tmp_path / "config.md", tmp_path / "metrics.md"
    pages = ["--path", str(config), "--metrics_path", str(metrics)]
    assert docs_gen.main(["--check", *pages]) == 1  # both missing
    assert len(capsys.readouterr().err.strip().splitlines()) == 2  # one line per page
    assert docs_gen.main(pages) == 0
    assert docs_gen.main(["--check", *pages]) == 0
    for page, source in ((config, "TrainConfig"), (metrics, "llmrl.metrics_schema")):
        good = page.read_text(encoding="utf-8")
        page.write_text("# stale\n", encoding="utf-8")
        assert docs_gen.main(["--check", *pages]) == 1
        assert capsys.readouterr().err.strip() == f"{page} differs from {source}: run `make docs` (python -m llmrl.docs_gen)"
        page.write_text(good, encoding="utf-8")


def test_config_page_lists_every_field_once():
    rows = re.findall(r"^\| `(\w+)` \| `", docs_gen.render(), flags=re.MULTILINE)
    fields = [name for name in rows if name in docs_gen.FIELDS]
    assert sorted(fields) == sorted(docs_gen.FIELDS)


def test_readme_is_at_most_300_lines():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 300, f"README.md has {n} lines: move detail into docs/"


def test_readme_names_no_commit():
    """Figures carry their date and command; which commit gave each lives in docs/results.md. A commit here is
    7-40 hex digits with a digit and a letter (so neither a number nor a word like `added`)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", readme) if re.search(r"[0-9]", w) and re.search(r"[a-f]", w)]
    assert not hashes, f"README.md names commits {hashes}: move them to docs/results.md"


def without_code(text: str, inline: bool = True) -> str:
    """`text` without fenced code blocks (a `# comment` there is no heading, a `[x](y)` no link) and, with
    `inline`, without inline code."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text) if inline else text


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of `page` (lower case, punctuation dropped, spaces → '-')."""
    seen: dict[str, int] = {}
    out = set()
    text = without_code(page.read_text(encoding="utf-8"), inline=False)
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_points_to_an_existing_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(without_code(page.read_text(encoding="utf-8"))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_docs_page_is_in_the_readme_index():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    missing = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_readme_trl_names_are_the_configs():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Coming from TRL", 1)[1].split("\n## ", 1)[0]
    pairs = re.findall(r"`(\w+)` is `(\w+)`", section)  # the README names a few; docs/config.md has the table
    assert len(pairs) >= 3, "the README's TRL names are gone"
    for trl, name in pairs:
        assert trl in TRL_NAMES, f"README: {trl} is not in config.TRL_NAMES"
        assert TRL_NAMES[trl][0] == name, f"README: {trl} → {name}; config.py: {TRL_NAMES[trl]}"


def test_metrics_schema_entries_are_well_formed():
    entries = [*metrics_schema.METRICS.items(), *((metrics_schema.shown(r), m) for r, m in metrics_schema.PATTERNS)]
    for key, m in entries:
        assert m.kind in metrics_schema.KINDS, f"{key}: kind {m.kind!r} is not in KINDS"
        assert m.when and m.text.endswith("."), f"{key}: needs a `when` and a one-sentence text"
    assert metrics_schema.describe("reward/mean") is metrics_schema.METRICS["reward/mean"]
    assert metrics_schema.describe("eval/pass@4").kind == "fraction"
    assert metrics_schema.describe("reward/my_component") is metrics_schema.CUSTOM_REWARD
    assert metrics_schema.describe("rollout/no_such_key") is None and metrics_schema.describe("nope") is None


SOURCE = "\n".join(p.read_text(encoding="utf-8") for p in sorted((REPO / "src" / "llmrl").rglob("*.py"))
                   if p.name not in ("metrics_schema.py", "docs_gen.py"))


def spellings(key: str) -> set[str]:
    """How code that writes `key` may spell it: the key, its name after the prefix (f"train/{k}" over names), and
    for names built from parts, the part (f"cut_{why}", f"{name}_max")."""
    name = key.split("/", 1)[-1]
    return {key, name, key.removesuffix("_max"), name.removeprefix("cut_")}


def written(spelling: str) -> bool:
    """Some code in src/llmrl writes this spelling: a string literal, or a field of the typed counts (batch.py)."""
    return (f'"{spelling}"' in SOURCE or f"'{spelling}'" in SOURCE
            or re.search(rf"^    {re.escape(spelling)}: int", COUNTS, flags=re.M) is not None)


COUNTS = (REPO / "src" / "llmrl" / "batch.py").read_text(encoding="utf-8")


def test_every_exact_metric_key_is_written_by_the_code():
    """A stale entry (a key no code writes any more) fails: some spelling of it is a string literal in src/llmrl
    or a field of the step's typed counts."""
    stale = [key for key in metrics_schema.METRICS if not any(written(s) for s in spellings(key))]
    assert not stale, f"metrics_schema.METRICS names keys no code in src/llmrl writes: {stale}"


def undescribed(records: list[dict], task_names: set[str]) -> list[str]:
    """The keys of `records` that metrics_schema does not describe, or that only a custom task's pattern covers
    although the task does not name them (an llmrl key missing from METRICS would hide there)."""
    custom = (metrics_schema.CUSTOM_EVAL, metrics_schema.CUSTOM_REWARD)
    bad = set()
    for record in records:
        for key in record:
            m = metrics_schema.describe(key)
            if m is None or (any(m is c for c in custom) and key.split("/", 1)[1] not in task_names):
                bad.add(key)
    return sorted(bad)


def test_every_key_a_single_turn_run_logs_is_in_the_schema(tmp_path, tiny_model_dir):
    """One step of toy_task:CharTask with dynamic sampling and the overlong penalty, evaluated before and after."""
    from helpers import cli, read_jsonl, tiny_args

    cli(*tiny_args(tiny_model_dir, tmp_path / "run", "grpo", steps=1, save_interval=0, dynamic_sampling="true",
                   overlong_buffer=2))
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    keys = {k for r in records for k in r}
    assert {"reward/distinct", "reward/overlong", "rollout/sampling_rounds", "eval/distinct", "time/eval_s"} <= keys
    assert not undescribed(records, {"distinct"}), "keys llmrl.metrics_schema does not describe"


def test_every_key_an_environment_run_logs_is_in_the_schema(tmp_path, tiny_model_dir):
    """One step of the guess environment (2 turns), with sampled eval (pass@1, pass@2)."""
    from helpers import cli, read_jsonl, tiny_args

    cli(*tiny_args(tiny_model_dir, tmp_path / "run", "grpo", steps=1, save_interval=0, task="guess", max_turns=2,
                   max_prompt_tokens=256, eval_samples_per_prompt=2))
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    keys = {k for r in records for k in r}
    assert {"rollout/turns", "rollout/cut_reply_tokens", "reward/solved", "eval/solved", "eval/pass@2"} <= keys
    assert not undescribed(records, set()), "keys llmrl.metrics_schema does not describe"
