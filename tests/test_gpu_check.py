import pytest
"""benchmarks/gpu_check.py --dry: the GPU check's CPU version passes every check (vllm may only be
skipped where it is not installed)."""

import importlib.util
import subprocess
import sys

from helpers import TESTS

CHECKS = ("train[hf]", "train[vllm]", "parity[hf]", "parity[vllm]", "resume[hf]", "overlong[hf]", "export[hf]")


@pytest.mark.slow
def test_dry_run_passes_every_check(tmp_path):
    script = TESTS.parent / "benchmarks" / "gpu_check.py"
    p = subprocess.run([sys.executable, str(script), "--dry", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    verdicts = {}
    for line in p.stdout.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASS", "SKIP", "FAIL"):
            verdicts[rest.split(":")[0]] = word
    assert set(verdicts) == set(CHECKS), p.stdout
    vllm = importlib.util.find_spec("vllm") is not None
    for name in CHECKS:
        allowed = {"PASS", "SKIP"} if "vllm" in name and not vllm else {"PASS"}
        assert verdicts[name] in allowed, (name, p.stdout)
    assert "SKIP train[vllm]: vllm not installed" in p.stdout or vllm
    for header in ("device: ", "torch ", "total wall time: "):
        assert any(line.startswith(header) for line in p.stdout.splitlines()), header
