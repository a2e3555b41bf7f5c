"""A checkpoint is not started on a disk without room for it: the run stops in one line before writing anything,
with the previous checkpoint intact and nothing half-written left behind."""

import shutil
from collections import namedtuple

from helpers import tiny_args


def test_free_space_problem_names_what_is_short(tmp_path, monkeypatch):
    from llmrl import checkpoint

    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: Usage(10 << 20, 0, 3 << 20))
    assert checkpoint.free_space_problem(tmp_path, 3 << 20) is None
    assert checkpoint.free_space_problem(tmp_path, (3 << 20) + 1) == (
        f"not enough free space for it (3.0 MiB needed, 3.0 MiB free on {tmp_path})")


def test_space_needed_counts_trained_weights_and_both_adam_moments():
    import torch

    from llmrl.checkpoint import space_needed

    model = torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(3, 5, bias=False))  # 24 + 15 parameters
    model[1].weight.requires_grad_(False)
    assert space_needed(model) == 12 * 24 + (1 << 20)
    tied = torch.nn.Sequential(torch.nn.Embedding(11, 3), torch.nn.Linear(3, 11, bias=False))  # 33 parameters, twice
    tied[1].weight = tied[0].weight  # as lm_head and embed_tokens: DCP stores it under both names, AdamW holds it once
    assert space_needed(tied) == 4 * 66 + 8 * 33 + (1 << 20)


def test_a_full_disk_stops_the_run_before_the_save(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from llmrl import checkpoint, cli
    from llmrl.checkpoint import latest_checkpoint, verify_checkpoint

    real = shutil.disk_usage
    saves = []

    def disk_usage(path):  # room for step 1's checkpoint, none for step 2's
        usage = real(path)
        saves.append(path)
        return usage._replace(free=usage.free if len(saves) == 1 else 1000)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", disk_usage)
    out = tmp_path / "run"
    code = cli.main(tiny_args(tiny_model_dir, out, "grpo", steps=3, eval_n=1, eval_interval=0))
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    stops = [line for line in err.splitlines() if line.startswith("llmrl: stopped:")]
    assert len(stops) == 1 and "Traceback" not in err, err[-2000:]
    assert stops[0].startswith("llmrl: stopped: could not write the checkpoint of step 2: not enough free space for it")
    assert "MiB free" in stops[0] and "step_000001" in stops[0] and "llmrl train --resume" in stops[0]
    assert latest_checkpoint(out).name == "step_000001" and verify_checkpoint(out / "checkpoints" / "step_000001") is None
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]
