"""Checkpoints and run directories: what a worker saves and restores, the checks before a run resumes, the
record of each worker-group start, and the consolidation of the best checkpoint into plain weights.

A checkpoint directory holds the DeepSpeed state (``DS_TAG``; each rank writes its partition), every
rank's RNG state (``rng/rank_<r>.pt``) and, written last by rank 0 once every rank is done,
``STATE_FILE``: step, data position, history and the manifest (path → size) of every file, by which
:func:`verify_checkpoint` tells a whole checkpoint from a half-written one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ckray.errors import CkrayError, ConfigError, MissingArtifactError
from ckray.training.config import TrainConfig
from ckray.training.task import METRIC, RankerTask

STATE_FILE = "train_state.json"   # written last, by rank 0: step, data position, history, file manifest
DS_TAG = "deepspeed"              # DeepSpeed checkpoint tag (sub-directory of a checkpoint)
ATTEMPTS_DIR = "ckray_attempts"   # run_dir/ckray_attempts/<fit id>/<time>.json: one per worker-group start


# ----------------------------------------------------------------------------------------------
# Worker side: save and restore
# ----------------------------------------------------------------------------------------------

def _save(engine: Any, ckpt_dir: Path, state: dict, rank: int) -> None:
    """DeepSpeed state (each rank writes its partition), per-rank RNG state, then - after every
    rank is done - ``STATE_FILE`` with the manifest of all files, written last by rank 0."""
    import torch.distributed as dist

    engine.save_checkpoint(str(ckpt_dir), tag=DS_TAG, client_state={"ckray_step": state["step"]})
    (ckpt_dir / "rng").mkdir(exist_ok=True)
    torch.save(_rng_state(), ckpt_dir / "rng" / f"rank_{rank}.pt")
    mine = {str(p.relative_to(ckpt_dir)): p.stat().st_size for p in ckpt_dir.rglob("*") if p.is_file()}
    everyone: list[dict] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(everyone, mine)
    if rank == 0:
        files = {k: v for d in everyone for k, v in d.items()}
        tmp = ckpt_dir / f".{STATE_FILE}.tmp"
        tmp.write_text(json.dumps({**state, "files": files}, indent=1))
        os.replace(tmp, ckpt_dir / STATE_FILE)


def _restore(engine: Any, ckpt_dir: Path, rank: int, cfg: TrainConfig, world: int) -> dict:
    state = verify_checkpoint(ckpt_dir)
    _check_compatible(state, cfg, world, str(ckpt_dir))
    try:
        load_path, _ = engine.load_checkpoint(str(ckpt_dir), tag=DS_TAG, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    except Exception as exc:
        raise MissingArtifactError(f"cannot load the DeepSpeed state of checkpoint {ckpt_dir}: {exc}") from exc
    if load_path is None:
        raise MissingArtifactError(f"DeepSpeed found no state in checkpoint {ckpt_dir}/{DS_TAG}")
    rng_file = ckpt_dir / "rng" / f"rank_{rank}.pt"
    if rng_file.exists():
        _set_rng_state(torch.load(rng_file, weights_only=False))
    state.pop("files", None)
    return state


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------------------------
# Checking a checkpoint, consolidating it
# ----------------------------------------------------------------------------------------------

def verify_checkpoint(path: str | os.PathLike, filesystem: Any = None) -> dict:
    """Read a training checkpoint's state and check every file it lists is there, whole.

    Raises :class:`MissingArtifactError` naming the checkpoint and what is missing.
    """
    import pyarrow.fs as pafs

    fs = filesystem or pafs.LocalFileSystem()
    path = str(path).rstrip("/")
    hint = ("delete the run directory or pass resume=False / --no-resume to start over")
    info = fs.get_file_info(f"{path}/{STATE_FILE}")
    if info.type != pafs.FileType.File:
        raise MissingArtifactError(f"training checkpoint {path} is half-written: {STATE_FILE} is missing; {hint}")
    with fs.open_input_stream(f"{path}/{STATE_FILE}") as f:
        try:
            state = json.loads(f.read().decode("utf-8"))
        except ValueError as exc:
            raise MissingArtifactError(f"training checkpoint {path}: {STATE_FILE} is corrupt ({exc}); {hint}")
    files = state.get("files", {})
    infos = fs.get_file_info([f"{path}/{rel}" for rel in files])
    for (rel, size), info in zip(files.items(), infos):
        if info.type != pafs.FileType.File:
            raise MissingArtifactError(f"training checkpoint {path} is incomplete: {rel} is missing; {hint}")
        if info.size != size:
            raise MissingArtifactError(f"training checkpoint {path} is incomplete: {rel} has "
                                       f"{info.size} bytes, expected {size}; {hint}")
    return state


def _check_compatible(state: dict, config: TrainConfig, world: int, where: str) -> None:
    if state["world_size"] != world or state["zero_stage"] != config.zero_stage:
        raise ConfigError(
            f"training checkpoint {where} was written with {state['world_size']} workers and ZeRO "
            f"stage {state['zero_stage']}; resume with --workers {state['world_size']} --zero-stage "
            f"{state['zero_stage']} (the optimizer state is partitioned per worker), or start over "
            "with resume=False / --no-resume")


def consolidate(task: RankerTask, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                extra: dict | None = None, weight_ensemble: float = 1.0, seed: int = 42,
                dev_metric: Callable[[torch.nn.Module], float] | None = None) -> Path:
    """Turn one training checkpoint (DeepSpeed state) into plain fp32 weights with ``save_model``.

    ``weight_ensemble`` < 1 saves WiSE-FT's mix (``ckray.models.weight_ensemble``, Eq. 1) of these
    weights with the model's own initialisation, rebuilt with the run's ``seed`` (the weights the run
    started from, before any ``--init-from``); ``config.json`` records α, the chosen step's dev metric
    and, with ``dev_metric``, the mixed model's own (which becomes the checkpoint's ``METRIC``)."""
    from ckray.models.checkpoint import save_model

    checkpoint_dir = Path(checkpoint_dir)
    state = verify_checkpoint(checkpoint_dir)
    model = task.build_model()
    weights = _checkpoint_weights(checkpoint_dir, int(state.get("ds_zero_stage", state["zero_stage"])))
    hint = "it was trained with other model settings; pass --no-resume or another --run-name to train anew"
    try:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # size mismatches (e.g. another --layers or --doc-max-len)
        first = str(exc).strip().splitlines()[1:2] or [str(exc)]
        raise ConfigError(f"checkpoint {checkpoint_dir} does not fit {type(model).__name__}: "
                          f"{first[0].strip()}; {hint}") from exc
    if missing or unexpected:
        raise ConfigError(f"checkpoint {checkpoint_dir} does not match {type(model).__name__}: "
                          f"missing {missing[:5]}, unexpected {unexpected[:5]}; {hint}")
    model.float().eval()
    extra = {METRIC: state["metric"], "step": state["step"], **(extra or {})}
    if weight_ensemble != 1.0:
        from ckray.models.weight_ensemble import ensemble_with_start

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            start = task.build_model().float()
        ensemble_with_start(model, start, weight_ensemble)
        extra["weight_ensemble"] = {"alpha": weight_ensemble, "start": f"the model's initialisation (seed {seed})",
                                    f"fine_tuned_{METRIC}": state["metric"]}
        if dev_metric is not None:
            extra[METRIC] = extra["weight_ensemble"][METRIC] = dev_metric(model)
    return save_model(model, output_dir, extra=extra)


def _checkpoint_weights(checkpoint_dir: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """fp32 weights out of a DeepSpeed checkpoint. ZeRO 0-2 keep whole fp32 parameters in the model
    states file; ZeRO-3 partitions them, so they are gathered from the per-rank files."""
    ds_dir = checkpoint_dir / DS_TAG
    if zero_stage == 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=DS_TAG)
    states = torch.load(ds_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return states["module"]


def _initial_weights(task: RankerTask, path: str, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The weights of the saved checkpoint at ``path`` (``--init-from``), checked against ``task``'s
    model: same class, every tensor present with the same shape. Errors name the checkpoint."""
    from ckray.models.checkpoint import class_path, current_class_path, read_checkpoint

    model = model if model is not None else task.build_model()
    payload, weights = read_checkpoint(path)  # MissingArtifactError naming the path
    if current_class_path(str(payload.get("model_class"))) != class_path(model):  # a moved model module is the same class
        raise ConfigError(f"--init-from {path}: it holds a {payload.get('model_class')}, "
                          f"this job trains a {class_path(model)}")
    for name in getattr(model, "_init_config_must_agree", ()):   # config fields the weights' meaning depends on
        field = next(f for f in dataclasses.fields(model.config) if f.name == name)
        theirs, ours = payload.get("config", {}).get(name, field.default), getattr(model.config, name)
        if theirs != ours:
            raise ConfigError(f"--init-from {path} was trained with {name}={theirs!r}, these flags build {name}={ours!r} "
                              f"(pass the model flags it was trained with)")
    own = model.state_dict()
    missing = sorted(set(own) - set(weights) - set(getattr(model, "_non_persistent_ok", ())))
    misfit = [k for k in own if k in weights and weights[k].shape != own[k].shape]
    if missing or misfit:
        detail = (f"missing {missing[:3]}" if missing else
                  f"{misfit[0]} is {tuple(weights[misfit[0]].shape)} there, {tuple(own[misfit[0]].shape)} here")
        raise ConfigError(f"--init-from {path} does not fit the model these flags build: {detail} "
                          f"(pass the model flags it was trained with)")
    return {k: v for k, v in weights.items() if k in own}


# ----------------------------------------------------------------------------------------------
# Run directories (local paths or URIs such as s3://)
# ----------------------------------------------------------------------------------------------

def _storage_path(storage_dir: str) -> str:
    if "://" in storage_dir:
        return storage_dir
    return str(Path(storage_dir or "ray_train").expanduser().resolve())


def _filesystem(run_dir: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    if "://" in run_dir:
        return pafs.FileSystem.from_uri(run_dir)
    return pafs.LocalFileSystem(), run_dir


def _remove_run_dir(run_dir: str) -> None:
    import pyarrow.fs as pafs

    fs, path = _filesystem(run_dir)
    if fs.get_file_info(path).type == pafs.FileType.Directory:
        fs.delete_dir(path)


def _stored_result(run_dir: str) -> Any:
    from ray.train import Result

    return Result.from_path(run_dir)


def _check_resumable(run_dir: str, config: TrainConfig) -> dict | None:
    """Before any worker starts: the latest checkpoint of an existing run must be whole and
    written with the same number of workers and ZeRO stage. Returns its state (None: fresh run), with
    ``registered``: whether Ray's record of the run lists it.

    Ray resumes a run from its own record of the checkpoints reported, which ``Result.from_path`` reads.
    That raises where there is no such record: no run directory, or a run stopped before Ray registered
    its first checkpoint (a driver or worker that died right after writing one). The workers then resume
    from the latest whole checkpoint of ours (:func:`resume_checkpoint`), or start afresh where there is
    none; a run directory that holds only checkpoints that are not whole cannot be resumed, and the
    error says so."""
    try:
        registered = _stored_result(run_dir).checkpoint
    except Exception as exc:
        if not _holds_checkpoints(run_dir):
            return None  # nothing to resume from
        latest, _ = resume_checkpoint(run_dir, None)
        if latest is None:
            raise MissingArtifactError(f"cannot resume training run {run_dir}: {exc}; delete it or pass "
                                       "resume=False / --no-resume to start over") from exc
        registered = None
    else:
        latest, _ = resume_checkpoint(run_dir, registered)
    if latest is None:
        return None
    state = verify_checkpoint(latest.path, latest.filesystem)
    _check_compatible(state, config, config.workers, latest.path)
    return {**state, "registered": registered is not None and latest.path == registered.path}


def resume_checkpoint(run_dir: str, registered: Any) -> tuple[Any, int | None]:
    """The checkpoint a worker group resumes from, and its step: Ray's latest registered one
    (``registered``, a ``ray.train.Checkpoint`` or None), or a whole checkpoint of ours in ``run_dir``
    at a later step that Ray never registered (its report was lost with a worker or driver that died
    right after writing it); (None, None): start at step 0."""
    import pyarrow.fs as pafs
    from ray.train import Checkpoint

    best, best_step = None, -1
    if registered is not None:
        best, best_step = registered, int(verify_checkpoint(registered.path, registered.filesystem)["step"])
    fs, path = _filesystem(run_dir)
    children = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    for child in sorted((c.path for c in children if c.type == pafs.FileType.Directory)):
        try:
            step = int(verify_checkpoint(child, fs)["step"])
        except MissingArtifactError:
            continue   # not a checkpoint, or not whole
        if step > best_step:
            best, best_step = Checkpoint(path=child, filesystem=fs), step
    return (best, best_step) if best is not None else (None, None)


def _holds_checkpoints(run_dir: str) -> bool:
    """Whether a directory of ``run_dir`` holds a training checkpoint of ours (a ``STATE_FILE`` or a
    DeepSpeed state, whole or not)."""
    import pyarrow.fs as pafs

    fs, path = _filesystem(run_dir)
    children = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
    subdirs = [c.path for c in children if c.type == pafs.FileType.Directory]
    marks = fs.get_file_info([f"{d}/{name}" for d in subdirs for name in (STATE_FILE, DS_TAG)])
    return any(m.type != pafs.FileType.NotFound for m in marks)


class WorkersLostError(CkrayError):
    """Training workers failed more often than ``max_failures`` allows; the message names the checkpoint the
    same command resumes from."""


def workers_lost(run_dir: str, max_failures: int, reason: str) -> WorkersLostError:
    """The error of a run whose workers failed ``max_failures + 1`` times: why, and the checkpoint a rerun
    resumes from (:func:`resume_checkpoint`), with its step, or that a rerun starts at step 0."""
    try:
        registered = _stored_result(run_dir).checkpoint
    except Exception:  # no record of Ray's
        registered = None
    latest, step = resume_checkpoint(run_dir, registered)
    if latest is not None:
        resume = (f"the latest checkpoint is {latest.path} (step {step}); run the same command again to resume "
                  "from it")
    else:
        resume = "no checkpoint was saved yet; running the same command again starts at step 0"
    return WorkersLostError(f"training run {run_dir}: a worker failed {max_failures + 1} time(s), more than "
                            f"max_failures = {max_failures} (--max-failures) allows ({reason}); {resume}")


def _record_attempt(run_dir: str, fit_id: str, start_step: int) -> None:
    fs, path = _filesystem(run_dir)
    folder = f"{path}/{ATTEMPTS_DIR}/{fit_id}"
    fs.create_dir(folder, recursive=True)
    with fs.open_output_stream(f"{folder}/{time.time_ns()}.json") as f:
        f.write(json.dumps({"start_step": start_step}).encode())


def _attempt_starts(run_dir: str, fit_id: str) -> list[int]:
    """The step each worker-group attempt of one fit() call started from, in order."""
    import pyarrow.fs as pafs

    fs, path = _filesystem(run_dir)
    infos = fs.get_file_info(pafs.FileSelector(f"{path}/{ATTEMPTS_DIR}/{fit_id}", allow_not_found=True))
    starts = []
    for info in sorted(infos, key=lambda i: i.base_name):
        with fs.open_input_stream(info.path) as f:
            starts.append(int(json.loads(f.read().decode())["start_step"]))
    return starts
