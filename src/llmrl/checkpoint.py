"""Checkpoints under `<run>/checkpoints/step_NNNNNN/`.

Each holds the PEFT adapter (`adapter_model.safetensors` + `adapter_config.json`, loadable with
plain `PeftModel.from_pretrained`), `optimizer.pt` and `rng.pt` (tensors only, loaded with
`weights_only=True`) and `trainer_state.json` (step, scheduler, task and Python RNG state).
A checkpoint is written into a temporary directory and renamed into place, and `latest` is
rewritten only after that, so a crash while saving never hides the previous checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINTS = "checkpoints"
LATEST = "latest"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:06d}"


def rng_state() -> dict[str, Any]:
    """Python and torch RNG states (the loop passes explicit seeds, these are kept for anything else)."""
    v, internal, gauss = random.getstate()
    return {"python": [v, list(internal), gauss], "torch": torch.get_rng_state()}


def save_checkpoint(
    run_dir: Path, step: int, model, optimizer: torch.optim.Optimizer, state: dict[str, Any], generator: torch.Generator
) -> Path:
    """Write the checkpoint of `step` atomically and point `latest` at it."""
    final = checkpoint_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-step_{step:06d}-"))
    try:
        model.save_pretrained(tmp)
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        rng = rng_state()
        torch.save({"torch": rng["torch"], "shuffle": generator.get_state()}, tmp / "rng.pt")
        (tmp / "trainer_state.json").write_text(json.dumps({**state, "step": step, "python_rng": rng["python"]}))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = run_dir / CHECKPOINTS / f".{LATEST}.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, run_dir / CHECKPOINTS / LATEST)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint `latest` names, else the highest-numbered complete one, else None."""
    root = run_dir / CHECKPOINTS
    pointer = root / LATEST
    if pointer.exists() and (root / pointer.read_text().strip() / "trainer_state.json").exists():
        return root / pointer.read_text().strip()
    done = sorted(p for p in root.glob("step_*") if (p / "trainer_state.json").exists()) if root.exists() else []
    return done[-1] if done else None


def load_checkpoint(path: Path, model, optimizer: torch.optim.Optimizer, generator: torch.Generator) -> dict[str, Any]:
    """Restore adapter weights, optimizer, RNGs; return the trainer state (step, scheduler, task, ...)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors", device=str(device)))
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location=device, weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=True)
    torch.set_rng_state(rng["torch"])
    generator.set_state(rng["shuffle"])
    state = json.loads((path / "trainer_state.json").read_text())
    v, internal, gauss = state["python_rng"]
    random.setstate((v, tuple(internal), gauss))
    return state
