"""Checkpoints under `<run>/checkpoints/step_NNNNNN/`, written so that a crash never costs more
than the steps since the previous one.

Each holds the PEFT adapter (`adapter_model.safetensors` + `adapter_config.json`, loadable with
plain `PeftModel.from_pretrained`) or, with finetune full, the whole model (`model.safetensors` + `config.json`,
loadable with plain `AutoModelForCausalLM.from_pretrained`), `optimizer.pt` and `rng.pt` (tensors only, loaded with
`weights_only=True`), `trainer_state.json` (step, task and Python/NumPy RNG state,
config) and last `manifest.json` (size and SHA-256 of every other file).

Writing: everything goes into a temporary directory, is flushed to disk, and the directory is renamed
into place; only then is `latest` rewritten (itself through a rename). A kill at any moment leaves
either the old or the new checkpoint complete, plus at most a `.tmp-*` directory that the next run
removes. Every failed write (a full disk, an I/O error, safetensors' own error for either) is an OSError,
raised after the temporary directory is gone, so the caller can stop in one line with the old checkpoint.
Loading: a checkpoint whose manifest does not match its files is reported and skipped in favour of the
previous good one.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import random
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmrl.errors import ConfigError
from llmrl.run_files import CHECKPOINTS, LATEST, PLOTS, SCRATCH, candidates, fsync_path, write_atomically

MANIFEST = "manifest.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:06d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write(path: Path, data: str | bytes) -> None:
    """One file of a checkpoint being written (flushed to disk with the others by _write_manifest)."""
    path.write_bytes(data.encode("utf-8") if isinstance(data, str) else data)


def _torch_bytes(obj: Any) -> bytes:
    """torch.save into memory: written to a file, it fails as an OSError naming the cause (on a full disk,
    torch.save to a path raises a RuntimeError about stream positions)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def as_os_error(e: Exception) -> OSError:
    """safetensors' SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    as the OSError it reports; any other of its errors as EIO with its first line."""
    found = re.search(r"os error (\d+)", str(e))
    if found:
        return OSError(int(found[1]), os.strerror(int(found[1])))
    return OSError(errno.EIO, f"safetensors: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}")


def _write_manifest(directory: Path) -> None:
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest = {p.name: {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    _write(directory / MANIFEST, json.dumps(manifest, indent=1))
    for p in [*files, directory / MANIFEST]:
        fsync_path(p)


def required_files(names: set[str]) -> list[str]:
    """What a checkpoint holding `names` must also hold: its trainer state and RNGs, and its weights with what reads
    them: DCP shards with config.json (the shards hold the optimizer), or a LoRA adapter or whole model with its
    config and optimizer.pt. A checkpoint with no weights at all needs the adapter's files."""
    needed = ["trainer_state.json", "rng.pt"]
    if ".metadata" in names:
        return needed + ["config.json"] + ([] if any(SHARD_NAME.fullmatch(n) for n in names) else ["__0_0.distcp"])
    if "adapter_model.safetensors" not in names and any(MODEL_NAME.fullmatch(n) for n in names):
        return needed + ["config.json", "optimizer.pt"]
    return needed + ["adapter_model.safetensors", "adapter_config.json", "optimizer.pt"]


SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")
MODEL_NAME = re.compile(r"model(-\d+-of-\d+)?\.safetensors")


def verify_checkpoint(path: Path) -> str | None:
    """None if every file the manifest lists is there with its size and hash, the manifest lists every file there,
    and it lists every file a checkpoint of its kind needs (required_files); else what is wrong."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no readable manifest.json"
    if not isinstance(manifest, dict) or not all(
            isinstance(v, dict) and isinstance(v.get("size"), int) and isinstance(v.get("sha256"), str)
            for v in manifest.values()):
        return "manifest.json is not a map of file names to sizes and hashes"
    missing = [name for name in required_files(set(manifest)) if name not in manifest]
    if missing:
        return f"manifest.json does not list {missing[0]}, which a checkpoint needs"
    unlisted = sorted(p.name for p in path.iterdir() if p.name != MANIFEST and p.name not in manifest)
    if unlisted:
        return f"{unlisted[0]} is not in manifest.json"
    for name, expected in manifest.items():
        f = path / name
        if "/" in name or name in (".", "..") or not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != expected["size"]:
            return f"{name} has {f.stat().st_size} bytes, expected {expected['size']}"
        if _sha256(f) != expected["sha256"]:
            return f"{name} does not match its hash"
    return None


def space_needed(model) -> int:
    """Bytes a checkpoint of `model` takes, about: its trained weights, tied ones counted under each name (DCP shards
    store each; save_pretrained only once), and AdamW's two moments, 4 bytes each (what an unsharded or sharded
    full-weight or LoRA checkpoint holds), plus 1 MiB for the small files."""
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    saved = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False) if id(p) in trained)
    return 4 * saved + 8 * sum(p.numel() for p in model.parameters() if p.requires_grad) + (1 << 20)


def disk_full(path: Path) -> bool:
    """The disk of `path` has less than 1 MiB free (after a failed write: the cause was a full disk, whatever the
    writer's own message says)."""
    try:
        return shutil.disk_usage(path).free < (1 << 20)
    except OSError:
        return False


def free_space_problem(run_dir: Path, needed: int) -> str | None:
    """None if the disk of `run_dir`'s checkpoints has `needed` bytes free (checked before a save, so a full disk
    stops the run before anything is written), else what is short."""
    where = run_dir / CHECKPOINTS if (run_dir / CHECKPOINTS).exists() else run_dir
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return None  # cannot tell: the write itself reports a full disk
    if free >= needed:
        return None
    return f"not enough free space for it ({needed / 2**20:.1f} MiB needed, {free / 2**20:.1f} MiB free on {where})"


def rng_state() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Global RNG states: (JSON-able part, tensor part). The loop itself passes explicit seeds; these
    cover LoRA dropout and anything else that draws from the global generators."""
    v, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(keys.astype(np.int64))}
    if torch.cuda.is_available():
        tensors |= {f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return {"python": [v, list(internal), gauss], "numpy": [kind, pos, has_gauss, cached]}, tensors


def set_rng_state(plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    v, internal, gauss = plain["python"]
    random.setstate((v, tuple(internal), gauss))
    kind, pos, has_gauss, cached = plain["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda_")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


def remove_stale_temporaries(run_dir: Path) -> None:
    """Delete what a killed process left half-written: checkpoint directories, and the temporaries of
    write_atomically (config.yaml, `latest`, the report and its plots). Called with the run's lock held."""
    for folder in (run_dir / CHECKPOINTS, run_dir, run_dir / PLOTS):
        if folder.exists():
            for tmp in folder.glob(".tmp-*"):
                if not in_use(tmp):
                    shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)


def in_use(tmp: Path) -> bool:
    """A rollout engine's scratch adapters (`.tmp-adapters-PID-*`) whose process is alive (this one's, or an
    `llmrl eval` or `chat` of the same run directory): in use, not a leftover."""
    found = re.fullmatch(re.escape(SCRATCH) + r"(\d+)-.*", tmp.name)
    if not found:
        return False
    try:
        os.kill(int(found[1]), 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def save_checkpoint(
    run_dir: Path, step: int, model, optimizer: torch.optim.Optimizer, state: dict[str, Any],
    generator: torch.Generator, keep: int = 0, extra_rng: dict[str, torch.Tensor] | None = None,
    base_model: str | None = None, card: str | None = None, whole: tuple[dict, dict] | None = None,
    sharded: Path | None = None,
) -> Path:
    """Write the checkpoint of `step` atomically, point `latest` at it, keep the newest `keep` (0: all).
    base_model: how adapter_config.json names the base (as the user gave it, not this machine's cache path);
    card: the README.md written instead of PEFT's empty template; whole: a sharded run's (model, optimizer) state
    gathered to this rank (training/fsdp.py:full_state), written in an unsharded run's format. A failed write raises
    OSError, with `latest` still naming the previous checkpoint. sharded: the temporary directory (checkpoint_tmp)
    into which every rank has written its shards of the weights and optimizer (training/fsdp.py:save_sharded): it
    becomes the checkpoint, with the model's config.json beside the shards."""
    from safetensors import SafetensorError

    final = checkpoint_dir(run_dir, step)
    tmp = sharded or checkpoint_tmp(run_dir, step)
    try:
        try:
            if sharded:  # the weights are the shards; config.json says what model they belong to
                model.config.save_pretrained(tmp)
            else:
                model.save_pretrained(tmp, **({"state_dict": whole[0]} if whole else {}))
        except SafetensorError as e:
            raise as_os_error(e) from None
        if base_model is not None and (tmp / "adapter_config.json").exists():  # full weights: config.json, no adapter
            adapter_config = json.loads((tmp / "adapter_config.json").read_text())
            adapter_config["base_model_name_or_path"] = base_model
            _write(tmp / "adapter_config.json", json.dumps(adapter_config, indent=2))
        if card is not None:
            _write(tmp / "README.md", card)
        if not sharded:  # (the shards hold the optimizer's state)
            _write(tmp / "optimizer.pt", _torch_bytes(whole[1] if whole else optimizer.state_dict()))
        plain, tensors = rng_state()
        _write(tmp / "rng.pt", _torch_bytes({**tensors, **(extra_rng or {}), "shuffle": generator.get_state()}))
        _write(tmp / "trainer_state.json", json.dumps({**state, "step": step, "rng": plain}))
        _write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_atomically(final.parent / LATEST, final.name)
    if keep > 0:
        for old in sorted(final.parent.glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_tmp(run_dir: Path, step: int) -> Path:
    """A new temporary directory for the checkpoint of `step` (renamed into place when complete)."""
    final = checkpoint_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-step_{step:06d}-"))


def latest_checkpoint(run_dir: Path, report=lambda msg: print(msg, file=sys.stderr)) -> Path | None:
    """The newest checkpoint that verifies; every one skipped on the way is reported in one line."""
    for path in candidates(run_dir):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        report(f"llmrl: checkpoint {path} is incomplete or corrupt ({problem}); trying an older one")
    return None


def load_tensors(path: Path, device: torch.device | str = "cpu") -> Any:
    """torch.load that only accepts tensors and plain containers: never unpickles code."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"checkpoint file {path} is not a plain tensor file, refusing to load it ({first})") from None


def is_sharded_checkpoint(path: Path) -> bool:
    """A checkpoint of sharded full weights: DCP shards (`.metadata` and `__<rank>_0.distcp`), not model.safetensors."""
    return (path / ".metadata").is_file()


def is_full_checkpoint(path: Path) -> bool:
    """A full-weight checkpoint (model*.safetensors or DCP shards, + config.json) rather than a LoRA adapter."""
    return not (path / "adapter_model.safetensors").exists() and (
        any(path.glob("model*.safetensors")) or is_sharded_checkpoint(path))


def load_policy_weights(path: Path, model) -> None:
    """Load a checkpoint's trained weights into `model`: the LoRA adapter into a PEFT policy, every weight into a
    full-weight one (save_pretrained's model.safetensors, or its shards). A checkpoint of the other kind, or one
    whose tensors do not fit the model, is one ConfigError line."""
    from safetensors.torch import load_file

    from llmrl.models.full import is_full

    device = str(next(model.parameters()).device)
    full = is_full(model)
    if full != is_full_checkpoint(path):
        saved, wanted = ("a LoRA adapter", "full") if full else ("full weights", "lora")
        raise ConfigError(f"checkpoint {path} holds {saved}, but the config has finetune {wanted}: use the finetune "
                          "of the run that wrote it")
    if not full:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(path / "adapter_model.safetensors", device=device))
        return
    if is_sharded_checkpoint(path):
        from llmrl.training.fsdp import load_sharded

        load_sharded(path, model)
        return
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(path.glob("model*.safetensors")):
        state.update(load_file(shard, device=device))
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a shape that does not fit
        raise ConfigError(f"checkpoint {path} does not fit the model: {str(e).strip().splitlines()[-1].strip()}") from None
    params = dict(model.named_parameters(remove_duplicate=False))
    untied = [m for m in missing if not any(params.get(m) is params.get(k) for k in state)]  # tied copies are saved once
    if untied or unexpected:
        raise ConfigError(f"checkpoint {path} does not fit the model: missing {untied[:3]}, unexpected {unexpected[:3]}")


def load_optimizer(path: Path, model, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer.pt into `optimizer`: saved by an unsharded run (keyed by parameter index) or a sharded one
    (keyed by parameter name, whole tensors), into an unsharded or a sharded (FSDP2) policy."""
    from llmrl.training.fsdp import is_sharded, load_sharded

    if is_sharded_checkpoint(path):  # the shards hold the optimizer's state (and the weights, read again)
        load_sharded(path, model, optimizer)
        return
    saved = load_tensors(path / "optimizer.pt", next(model.parameters()).device)
    by_name = any(isinstance(k, str) for k in saved.get("state", {})) or any(
        isinstance(p, str) for g in saved.get("param_groups", []) for p in g["params"])
    if not by_name and not is_sharded(model):
        optimizer.load_state_dict(saved)
        return
    if not saved.get("state"):  # saved before the first step: the fresh optimizer is that state (loading it through
        return  # torch.distributed's set_optimizer_state_dict would first give AdamW a zero step, count 1)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not by_name:  # an unsharded run's: index i is the i-th trainable parameter
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        saved = {"state": {names[i]: v for i, v in saved["state"].items()},
                 "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in saved["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, saved, options=StateDictOptions(full_state_dict=True))


def load_checkpoint(path: Path, model, optimizer: torch.optim.Optimizer, generator: torch.Generator,
                    weights: bool = True) -> dict[str, Any]:
    """Restore the trained weights (adapter or full; not with `weights` False, for a caller that loaded them before
    sharding), optimizer and RNGs; return the trainer state (step, task, ...)."""
    if weights:
        load_policy_weights(path, model)
    load_optimizer(path, model, optimizer)
    tensors = load_tensors(path / "rng.pt")
    generator.set_state(tensors.pop("shuffle"))
    state = json.loads((path / "trainer_state.json").read_text())
    state["rank_rng"] = {k: tensors.pop(k) for k in [k for k in tensors if k.startswith(("torch_rank", "cuda_rank"))]}
    set_rng_state(state["rng"], tensors)
    return state
