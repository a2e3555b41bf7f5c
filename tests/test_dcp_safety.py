"""A DCP checkpoint (sharded full weights: `.metadata` + `__<rank>_0.distcp`) is read as data: a crafted run directory
whose newest checkpoint carries a pickle payload (in `.metadata`, nested inside real metadata, or in a non-tensor
entry of a shard) runs nothing on eval, export, chat or resume, each ending in one line; a real DCP checkpoint still
resumes exactly; manifests must list what a checkpoint needs."""

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import cli, run_cli, tiny_args


class Payload:
    """Unpickled, it writes `marker` (what a hostile checkpoint could do instead)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def full_args(model, out, steps):
    return tiny_args(model, out, "grpo", steps=steps, finetune="full", lr="1e-3", eval_n=1)


def to_dcp(checkpoint: Path) -> None:
    """Rewrite a 1-process full-weight checkpoint in place as the DCP shards a sharded run writes (model and AdamW
    state in `__0_0.distcp` + `.metadata`, no model.safetensors or optimizer.pt), with a consistent manifest."""
    from transformers import AutoModelForCausalLM

    from llmrl.checkpoint import _write_manifest, load_optimizer
    from llmrl.training.fsdp import save_sharded

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_optimizer(checkpoint, model, optimizer)
    for name in ("model.safetensors", "optimizer.pt", "manifest.json"):
        (checkpoint / name).unlink()
    save_sharded(model, optimizer, checkpoint)
    _write_manifest(checkpoint)


def rewrite(checkpoint: Path, name: str, data: bytes) -> None:
    from llmrl.checkpoint import _write_manifest

    (checkpoint / name).write_bytes(data)
    (checkpoint / "manifest.json").unlink()
    _write_manifest(checkpoint)  # consistent: the manifest does not catch it, the reader must


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """(uninterrupted 2-step full-weight run, the same run's copy cut back to a step-1 DCP checkpoint)."""
    root = tmp_path_factory.mktemp("dcp")
    straight = root / "straight"
    cli(*full_args(tiny_model_dir, straight, steps=2))
    cut = root / "cut"
    shutil.copytree(straight, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000002")
    (cut / "checkpoints" / "latest").write_text("step_000001")
    for log in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):  # as a kill after step 1's save leaves them
        if (cut / log).exists():
            rows = [r for r in (cut / log).read_text().splitlines() if json.loads(r).get("step", 0) <= 1]
            (cut / log).write_text("".join(r + "\n" for r in rows))
    to_dcp(cut / "checkpoints" / "step_000001")
    return straight, cut


def crafted(cut: Path, tmp_path: Path, how: str) -> tuple[Path, Path]:
    """A copy of the DCP run whose checkpoint carries a payload `how`; returns (run dir, marker the payload writes)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    run_dir, marker = tmp_path / f"crafted-{how}", tmp_path / f"ran-{how}"
    shutil.copytree(cut, run_dir)
    ckpt = run_dir / "checkpoints" / "step_000001"
    if how == "metadata":
        rewrite(ckpt, ".metadata", pickle.dumps(Payload(marker)))
    elif how == "nested":  # real metadata, with the payload one level down
        metadata = FileSystemReader(str(ckpt)).read_metadata()
        metadata.storage_meta.modules = [Payload(marker)]
        rewrite(ckpt, ".metadata", pickle.dumps(metadata))
    elif how == "outside":  # a storage entry naming a file outside the checkpoint
        metadata = FileSystemReader(str(ckpt)).read_metadata()
        info = next(iter(metadata.storage_data.values()))
        info.relative_path = "../../../config.yaml"
        rewrite(ckpt, ".metadata", pickle.dumps(metadata))
    elif how == "bytes":  # a shard whose non-tensor entry (the optimizer's lr) is a payload
        import torch.distributed.checkpoint as dcp
        from transformers import AutoModelForCausalLM

        from torch.distributed.checkpoint.state_dict import get_state_dict

        straight = cut.parent / "straight" / "checkpoints" / "step_000001"  # the same weights, unsharded (runs)
        model = AutoModelForCausalLM.from_pretrained(straight, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

        model_state, optimizer_state = get_state_dict(model, optimizer)
        optimizer_state["param_groups"][0]["lr"] = Payload(marker)
        for f in [*ckpt.glob("__*.distcp"), ckpt / ".metadata"]:
            f.unlink()
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(ckpt), no_dist=True)
        rewrite(ckpt, "config.json", (ckpt / "config.json").read_bytes())
    assert not marker.exists()
    return run_dir, marker


COMMANDS = {
    "eval --run": lambda run, model, out: ["eval", "--run", str(run), "--eval_n", "1", "--trust_task_code"],
    "eval --adapter": lambda run, model, out: ["eval", "--adapter", str(run / "checkpoints" / "step_000001"),
                                               "--eval_n", "1", "--trust_task_code"],
    "eval --adapter --finetune full": lambda run, model, out: [  # the command llmrl's refusal outside a run suggests
        "eval", "--adapter", str(run / "checkpoints" / "step_000001"), "--model", model, "--finetune", "full",
        "--task", "toy_task:CharTask", "--eval_n", "1"],
    "export": lambda run, model, out: ["export", str(run), "--out", str(out), "--trust_task_code"],
    "chat": lambda run, model, out: ["chat", str(run), "--max_new_tokens", "2", "--trust_task_code"],
    "train --resume": lambda run, model, out: ["train", "--resume", str(run), "--trust_task_code"],
}


def one_line_refusal(p, marker: Path) -> None:
    assert not marker.exists(), "the checkpoint ran code"
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("llmrl: error:")]
    assert len(errors) == 1 and p.stderr.rstrip().endswith(errors[0]), p.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_metadata_payload_runs_on_no_command(runs, tmp_path, tiny_model_dir, command):
    run_dir, marker = crafted(runs[1], tmp_path, "metadata")
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    p = run_cli(*COMMANDS[command](run_dir, tiny_model_dir, tmp_path / "export"))
    one_line_refusal(p, marker)
    assert "builtins.exec" in p.stderr, p.stderr[-2000:]
    if command != "train --resume":
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before  # nothing changed or lost


@pytest.mark.slow
@pytest.mark.parametrize("how", ["nested", "outside", "bytes"])
def test_payloads_deeper_in_the_files_are_refused_too(runs, tmp_path, tiny_model_dir, how):
    run_dir, marker = crafted(runs[1], tmp_path, how)
    command = "train --resume" if how == "bytes" else "eval --run"  # eval reads no optimizer state: nothing to refuse
    p = run_cli(*COMMANDS[command](run_dir, tiny_model_dir, None))
    one_line_refusal(p, marker)


def test_the_reader_refuses_each_payload_in_process(runs, tmp_path, tiny_model_dir):
    """The same payloads through load_sharded itself (what every command calls): a ConfigError naming the file."""
    from transformers import AutoModelForCausalLM

    from llmrl.errors import ConfigError
    from llmrl.training.fsdp import load_sharded

    expected = {"metadata": r"names builtins\.exec", "nested": r"names builtins\.exec",
                "outside": r"names '\.\./\.\./\.\./config\.yaml', not a shard file", "bytes": r"lr is not plain data"}
    for how, message in expected.items():
        run_dir, marker = crafted(runs[1], tmp_path, how)
        ckpt = run_dir / "checkpoints" / "step_000001"
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with pytest.raises(ConfigError, match=message):
            load_sharded(ckpt, model, optimizer)
        assert not marker.exists(), how


def test_a_real_dcp_checkpoint_resumes_exactly(runs):
    straight, cut = runs
    p = cli("train", "--resume", str(cut), "--trust_task_code")
    assert "resuming" in p.stderr and "Traceback" not in p.stderr
    a = load_file(straight / "checkpoints" / "step_000002" / "model.safetensors")
    b = load_file(cut / "checkpoints" / "step_000002" / "model.safetensors")
    assert a.keys() == b.keys()
    # the same fp32 tensors in and the same arithmetic after: equal up to the order of float sums (1 process both)
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


def test_a_manifest_must_list_what_a_checkpoint_needs(runs, tmp_path):
    from llmrl.checkpoint import _write_manifest, verify_checkpoint

    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs[0] / "checkpoints" / "step_000001", ckpt)
    assert verify_checkpoint(ckpt) is None
    (ckpt / "manifest.json").write_text("{}")  # lists nothing: before, every file "matched"
    assert verify_checkpoint(ckpt) == "manifest.json does not list trainer_state.json, which a checkpoint needs"
    (ckpt / "manifest.json").unlink()
    (ckpt / "optimizer.pt").unlink()
    _write_manifest(ckpt)  # consistent with the files, but the optimizer is gone: resume would fail later
    assert verify_checkpoint(ckpt) == "manifest.json does not list optimizer.pt, which a checkpoint needs"
    shutil.copy(runs[0] / "checkpoints" / "step_000001" / "optimizer.pt", ckpt)
    (ckpt / "manifest.json").unlink()
    _write_manifest(ckpt)
    assert verify_checkpoint(ckpt) is None
    (ckpt / ".metadata").write_bytes(b"added later")  # a file the manifest does not vouch for
    assert verify_checkpoint(ckpt) == ".metadata is not in manifest.json"
    (ckpt / "manifest.json").write_text("[1, 2]")
    assert verify_checkpoint(ckpt) == "manifest.json is not a map of file names to sizes and hashes"


def test_a_checkpoint_before_the_first_step_leaves_adam_without_state(tmp_path, tiny_model_dir):
    """A run stopped at step 0 (its first eval's report could not be written) saves before AdamW has a state: the
    save must not give it one (torch's get_state_dict does, by a zero step whose count 1 changes the next update),
    and loading it leaves the resumed optimizer fresh, as the uninterrupted run's was."""
    from transformers import AutoModelForCausalLM

    from llmrl.training.fsdp import load_sharded, save_sharded

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_sharded(model, optimizer, tmp_path / "step0")
    assert not optimizer.state
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    resumed = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_sharded(tmp_path / "step0", fresh, resumed)
    assert not resumed.state
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
