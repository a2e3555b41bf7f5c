"""Common mistakes, each answered in one line that names the fix (issue 58, items 6 and 7). Fast: no training."""

import json
import re
import subprocess
from pathlib import Path

import pytest

import llmrl
from llmrl import cli, install
from llmrl.config import read_yaml
from llmrl.errors import ConfigError

SRC = Path(llmrl.__file__).parent


def test_nproc_over_the_cores_of_a_cpu_only_machine_warns_in_one_line(monkeypatch, capsys):
    import torch

    calls = []
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "call", lambda cmd, **kw: calls.append((cmd, kw["env"])) or 0)
    assert cli.launch_torchrun(3, ["train", "--nproc", "3", "--steps", "1"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == ["llmrl: warning: --nproc 3 on 2 CPU cores and no GPU: the 3 ranks will share 2 cores and each "
                        "runs slower; --nproc 2 or fewer gives each rank a core of its own"]
    assert len(calls) == 1 and "--nproc_per_node=3" in calls[0][0]  # a warning, not a refusal: the ranks still start
    assert cli.launch_torchrun(2, ["train", "--nproc", "2"]) == 0
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # with a GPU the cores are not what each rank runs on
    assert cli.launch_torchrun(3, ["train", "--nproc", "3"]) == 0
    assert "warning" not in capsys.readouterr().err


class FakeDistribution:
    def __init__(self, direct_url):
        self.direct_url = direct_url

    def read_text(self, name):
        return json.dumps(self.direct_url) if name == "direct_url.json" and self.direct_url is not None else None


def test_a_missing_extra_names_the_install_that_works_here(monkeypatch, tmp_path):
    import importlib.metadata

    from llmrl.tasks.libraries import import_library

    root = Path(llmrl.__file__).resolve().parents[2]
    assert (root / "pyproject.toml").exists()  # these tests run from a source checkout
    with pytest.raises(ConfigError) as e:
        import_library("llmrl_no_such_library")
    assert str(e.value).endswith(f'install it with pip install -e ".[llmrl_no_such_library]" from {root}')
    # an installed wheel: no pyproject.toml two levels up, not editable → the package index's form
    monkeypatch.setattr(install, "__file__", str(tmp_path / "site-packages" / "llmrl" / "install.py"))
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: FakeDistribution(None))
    assert install.pip_install("verifiers") == 'pip install "llmrl[verifiers]"'
    with pytest.raises(ConfigError) as e:
        import_library("llmrl_no_such_library")
    assert str(e.value).endswith('install it with pip install "llmrl[llmrl_no_such_library]"')
    # an editable install whose package directory is elsewhere: the checkout that direct_url.json names
    editable = {"url": f"file://{tmp_path / 'my clone'}".replace(" ", "%20"), "dir_info": {"editable": True}}
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: FakeDistribution(editable))
    assert install.pip_install("verifiers") == f'pip install -e ".[verifiers]" from {tmp_path / "my clone"}'
    not_editable = {"url": "file:///x", "dir_info": {}}
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: FakeDistribution(not_editable))
    assert install.pip_install("verifiers") == 'pip install "llmrl[verifiers]"'


def test_every_install_hint_for_an_extra_goes_through_the_helper():
    spelled = re.compile(r'pip install (-e )?\\?["\'](llmrl)?\.?\[')
    found = [f"{path.relative_to(SRC)}:{n}: {line.strip()}" for path in SRC.rglob("*.py") if path.name != "install.py"
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if spelled.search(line) and not line.lstrip().startswith("--task")]  # libraries.py's docstring table
    assert found == []


@pytest.mark.parametrize("option, hint", [
    ("--learning-rate", "--learning-rate: TRL's name for --lr"),
    ("--learning_rate", "--learning_rate: TRL's name for --lr"),
    ("--num-steps", "--num-steps: did you mean --steps?"),
    ("--num_steps", "--num_steps: did you mean --steps?"),
    ("--batch-size", "--batch-size: did you mean --batch_size? options are spelled with underscores"),
    ("--group-size", "--group-size: did you mean --group_size? options are spelled with underscores"),
])
def test_a_near_miss_option_gets_the_real_one(option, hint, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", option, "3"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"llmrl: error: unknown option {option} ({hint}); `llmrl train --help` lists "
                                       "every option\n")


def test_a_near_miss_config_key_gets_the_real_one(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("num_steps: 3\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'num_steps' \(did you mean steps\?\)"):
        llmrl.load_config(path)


@pytest.mark.parametrize("text, where", [
    ("steps: 3\nlr: [0.01\nseed: 1\n",
     "line 3, column 5: expected ',' or ']', but got ':'; while parsing a flow sequence at line 2, column 5"),
    ("steps: 3\n  lr: 0.01\n", "line 2, column 5: mapping values are not allowed here"),
])
def test_a_yaml_syntax_error_names_its_line_and_column(tmp_path, capsys, text, where):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_yaml(path)
    assert str(e.value) == f"config file '{path}': not valid YAML ({where})"
    assert cli.main(["train", "--config", str(path)]) == 2
    assert capsys.readouterr().err == f"llmrl: error: {e.value}\n"


def test_an_unknown_library_environment_gets_the_closest_names():
    pytest.importorskip("reasoning_gym")
    from llmrl.tasks import make_task

    with pytest.raises(ConfigError) as e:
        make_task("reasoning_gym:chain_summ", seed=0)
    assert re.fullmatch(r"task reasoning_gym: no dataset 'chain_summ' \(did you mean chain_sum( or [a-z_]+)*\? "
                        r"\d+ exist\)", str(e.value)), str(e.value)
    with pytest.raises(ConfigError, match=r"no dataset 'qqqqqqq' \(\d+ exist, e\.g\. "):  # nothing close: examples
        make_task("reasoning_gym:qqqqqqq", seed=0)


def test_library_names_helper():
    from llmrl.tasks.libraries import closest

    assert closest("GuesTheNumber-v0", ["GuessTheNumber-v0", "Sudoku-v0"], "registered") == \
        "did you mean GuessTheNumber-v0? 2 registered"
    assert closest("zzz", ["GuessTheNumber-v0", "Sudoku-v0"], "registered", "A, B") == "2 registered, e.g. A, B"


def test_dir_shows_the_lazy_api():
    names = dir(llmrl)
    for name in ("train", "load_config", "Environment", "TrainConfig", "evaluate", "__version__"):
        assert name in names
    for name in ("train", "load_config", "Environment"):
        assert getattr(llmrl, name) is not None
    assert set(llmrl.__all__) <= set(names)


@pytest.mark.parametrize("mistake", __import__("mistakes").MISTAKES, ids=lambda m: m.what)
def test_the_common_mistakes_replayed_through_the_cli_end_in_one_line_naming_the_fix(mistake):
    """Each mistake of tests/mistakes.py as a user makes it (a subprocess, a fresh directory): no traceback, one
    llmrl error or warning line, and that line names the fix."""
    import importlib.util
    import os

    import torch

    from mistakes import replay

    if "--nproc" in mistake.args and ((os.cpu_count() or 1) >= 3 or torch.cuda.is_available()):
        pytest.skip("the --nproc mistake needs a CPU-only machine with fewer than 3 cores")
    if any(a.startswith("verifiers:") for a in mistake.args) and importlib.util.find_spec("verifiers"):
        pytest.skip("the missing-extra mistake needs a venv without verifiers")
    ok, line = replay(mistake)
    assert ok, line
