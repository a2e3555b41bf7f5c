"""The documentation stays true: docs/config.md is what `make docs` writes from TrainConfig, the README is a
short front door, every relative link (and its #anchor) leads somewhere, and the README's TRL names are
config.py's."""

import re
from pathlib import Path

from llmrl import docs_gen
from llmrl.config import TRL_NAMES

REPO = Path(__file__).parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_config_page_is_generated_from_the_config():
    assert (REPO / "docs" / "config.md").read_text(encoding="utf-8") == docs_gen.render(), (
        "docs/config.md is stale: run `make docs`")


def test_docs_gen_check_exits_1_on_a_stale_page_and_0_once_written(tmp_path, capsys):
    page = tmp_path / "config.md"
    assert docs_gen.main(["--check", "--path", str(page)]) == 1  # missing
    page.write_text("# stale\n", encoding="utf-8")
    assert docs_gen.main(["--check", "--path", str(page)]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 2  # one line each time
    assert docs_gen.main(["--path", str(page)]) == 0
    assert docs_gen.main(["--check", "--path", str(page)]) == 0


def test_config_page_lists_every_field_once():
    rows = re.findall(r"^\| `(\w+)` \| `", docs_gen.render(), flags=re.MULTILINE)
    fields = [name for name in rows if name in docs_gen.FIELDS]
    assert sorted(fields) == sorted(docs_gen.FIELDS)


def test_readme_is_at_most_300_lines():
    n = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= 300, f"README.md has {n} lines: move detail into docs/"


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
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| (.*?) *\|$", section, flags=re.MULTILINE)
    assert rows, "the README's TRL table is gone"
    for trl, name, note in rows:
        assert trl in TRL_NAMES, f"README: {trl} is not in config.TRL_NAMES"
        assert TRL_NAMES[trl] == (name, note), f"README: {trl} → {name} ({note}); config.py: {TRL_NAMES[trl]}"
