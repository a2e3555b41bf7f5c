"""pyproject's floors stay above the releases with known code-execution or path-traversal bugs, and what is installed
meets them: a floor lowered (or a venv below it) fails here."""

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# package: (the last release with the bug, the release that fixed it, what it is)
FLOORS = {
    "torch": ("2.9.1", "2.10.0", "CVE-2026-24747: weights_only=True bypass (CVE-2025-32434 below 2.6)"),
    "transformers": ("5.9.0", "5.10.0", "CVE-2026-4372 (< 5.3.0), CVE-2026-5241 (< 5.5.0), CVE-2026-9856 (< 5.10.0)"),
    "jinja2": ("3.1.5", "3.1.6", "sandbox escapes reachable through --chat_template"),
    "tqdm": ("4.66.2", "4.66.3", "CVE-2024-34062: CLI arguments evaluated"),
}


def requirements() -> dict[str, Requirement]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return {(r := Requirement(d)).name.lower(): r for d in deps}


@pytest.mark.parametrize("name", list(FLOORS))
def test_the_floor_admits_the_fix_and_not_the_bug(name):
    vulnerable, fixed, what = FLOORS[name]
    req = requirements()[name]
    assert not req.specifier.contains(vulnerable, prereleases=True), f"{req} admits {name} {vulnerable} ({what})"
    assert not req.specifier.contains("0.1", prereleases=True), f"{req} has no floor"
    assert req.specifier.contains(fixed), f"{req} refuses the fixed {name} {fixed}"


@pytest.mark.parametrize("name", list(FLOORS))
def test_what_is_installed_meets_the_floor(name):
    installed = Version(version(name).split("+")[0])
    assert installed >= Version(FLOORS[name][1]), f"{name} {installed} is below {FLOORS[name][1]} ({FLOORS[name][2]})"
