"""Checkpoint directories: ``config.json`` (model class + hyperparameters) + ``model.safetensors``.

Plain weights, loadable without Ray or DeepSpeed::

    save_model(model, "W/checkpoints/ck-qti")
    model = load_model("W/checkpoints/ck-qti")

A model is saveable when it has a dataclass ``config`` attribute and ``__init__(config)``.
``config.json`` records the size and sha256 of ``model.safetensors``: a truncated weights file is
refused on loading, naming the checkpoint, and so is one whose bytes changed after the checkpoint was
saved (the digest is checked when the weights file is not older than ``config.json``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ckray.data.shards import file_sha256, file_unchanged, write_failed
from ckray.errors import MissingArtifactError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
TRAIN_SUMMARY_FILE = "train_summary.json"   # what the training job writes beside a trained checkpoint


def class_path(obj: Any) -> str:
    """``module.QualName`` of ``obj``'s class, as ``config.json`` records it."""
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


# Modules that moved since checkpoints recorded them in config.json (old module → its home now): a
# checkpoint saved before the move still loads. New checkpoints record the new module.
MOVED_MODULES: dict[str, str] = {
    "ckray.models.ck": "ckray.rankers.ck_qti.model",
    "ckray.models.clear": "ckray.rankers.clear.model",
    "ckray.models.cedr": "ckray.rankers.cedr.model",
    "ckray.models.qds": "ckray.rankers.qds.model",
}


def current_class_path(path: str) -> str:
    """``path`` (``module.QualName`` from a ``config.json``) with a moved module replaced by its home now."""
    module, _, name = path.rpartition(".")
    return f"{MOVED_MODULES.get(module, module)}.{name}"


def _import(path: str) -> Any:
    module, _, name = current_class_path(path).rpartition(".")
    return getattr(importlib.import_module(module), name)


def save_model(model: torch.nn.Module, path: str | os.PathLike, extra: dict | None = None) -> Path:
    """Write the checkpoint atomically (temporary directory, then rename)."""
    path = Path(path)
    config = model.config
    payload = {
        "model_class": class_path(model),
        "config_class": class_path(config),
        "config": dataclasses.asdict(config),
        **(extra or {}),
    }
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        save_file(_untie(state), str(tmp / WEIGHTS_FILE))  # weights first: config.json is the newer file
        payload.update(weights_bytes=(tmp / WEIGHTS_FILE).stat().st_size, weights_sha256=file_sha256(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(payload, indent=2))
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except (OSError, SafetensorError) as e:
        raise write_failed(path, e) from e
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _untie(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage; clone tensors that alias another."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out


def read_checkpoint_config(path: str | os.PathLike) -> dict:
    cfg = Path(path) / CONFIG_FILE
    if not cfg.exists():
        raise MissingArtifactError(
            f"no checkpoint at {path}: {CONFIG_FILE} is missing (train one with jobs/train_*.py)")
    return json.loads(cfg.read_text())


def read_training_data_config(path: str | os.PathLike) -> dict:
    """The training-data settings a checkpoint was trained with (``train_summary.json``'s ``data_config``);
    empty for a checkpoint saved without training (an untrained encoder) or written before the summary."""
    summary = Path(path) / TRAIN_SUMMARY_FILE
    if not summary.exists():
        return {}
    try:
        return dict(json.loads(summary.read_text()).get("data_config") or {})
    except (json.JSONDecodeError, AttributeError) as e:
        raise MissingArtifactError(f"{summary}: not a training summary ({e}); re-train or remove it") from e


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """``config.json``'s payload of a whole checkpoint: its weights are there and are the file it records
    (size; sha256 when the weights are not older than ``config.json``), else :class:`MissingArtifactError`
    naming ``path``. A driver checks this before its Ray actors load the model, so a damaged checkpoint
    ends the job with that one line, not as actors that died in their creation."""
    payload = read_checkpoint_config(path)
    if not (Path(path) / WEIGHTS_FILE).exists():
        raise MissingArtifactError(f"checkpoint {path} has no {WEIGHTS_FILE}; it is half-written, re-train")
    _check_weights(path, payload)
    return payload


def checkpoint_digest(path: str | os.PathLike) -> str:
    """sha256 over a checkpoint's config and weights (names and bytes): what an index, a tuned weight
    or a stamp made with this model records, so work done with another model is redone. Not
    ``train_summary.json``, which re-running a finished training rewrites with the same model. The
    checkpoint is verified first (:func:`verify_checkpoint`)."""
    verify_checkpoint(path)
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        file = Path(path) / name
        h.update(name.encode())
        with open(file, "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
    return h.hexdigest()


def read_checkpoint(path: str | os.PathLike,
                    map_location: str | torch.device = "cpu") -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json``'s payload and the tensors of ``model.safetensors``; a missing or half-written
    checkpoint raises :class:`MissingArtifactError` naming ``path``."""
    payload = verify_checkpoint(path)
    weights = Path(path) / WEIGHTS_FILE
    try:
        return payload, load_file(str(weights), device=str(map_location))
    except (SafetensorError, OSError, RuntimeError) as e:
        raise MissingArtifactError(f"checkpoint {path}: {WEIGHTS_FILE} is unreadable ({e}); "
                                   "it is truncated or corrupted, re-train or restore it") from e


def _check_weights(path: str | os.PathLike, payload: dict) -> None:
    """Refuse weights whose size differs from the recorded one, or whose sha256 does when the weights
    file is not older than ``config.json`` (checkpoints saved before these were recorded pass)."""
    weights, config = Path(path) / WEIGHTS_FILE, Path(path) / CONFIG_FILE
    if "weights_bytes" not in payload:
        return
    size = weights.stat().st_size
    if size != payload["weights_bytes"]:
        raise MissingArtifactError(f"checkpoint {path}: {WEIGHTS_FILE} has {size} bytes, {CONFIG_FILE} records "
                                   f"{payload['weights_bytes']}; it is truncated or corrupted, re-train or restore it")
    recorded = {"bytes": payload["weights_bytes"], "sha256": payload.get("weights_sha256")}
    if not file_unchanged(weights, recorded, config.stat().st_mtime_ns):   # the shard markers' rule
        raise MissingArtifactError(f"checkpoint {path}: {WEIGHTS_FILE} does not match the sha256 {CONFIG_FILE} "
                                   "records; it is corrupted, re-train or restore it")


def load_model(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> torch.nn.Module:
    """Rebuild the model from ``config.json`` and load ``model.safetensors`` into it."""
    payload, state = read_checkpoint(path, map_location)
    config = _import(payload["config_class"])(**payload["config"])
    model = _import(payload["model_class"])(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in getattr(model, "_non_persistent_ok", ())]
    if missing or unexpected:
        raise MissingArtifactError(f"checkpoint {path} does not match {payload['model_class']}: "
                                   f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    return model
