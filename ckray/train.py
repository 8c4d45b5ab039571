"""The one training loop of every ckray ranker: Ray Train ``TorchTrainer`` + DeepSpeed.

A model plugs in through a :class:`RankerTask` (build the model, collate a batch of triples, compute
the loss, score (query, document) pairs for validation); :func:`fit` does the rest::

    result = fit(MyTask(...), triples, dev, TrainConfig(workers=2, max_steps=2000, eval_every=200,
                                                       output_dir="W/checkpoints/my-model",
                                                       storage_dir="W/train"))
    model = load_model(result.best_checkpoint)

What happens inside
-------------------
* The driver starts (or connects to, via ``RAY_ADDRESS``) Ray and launches a ``TorchTrainer`` with
  ``ScalingConfig(num_workers, use_gpu, resources_per_worker)`` (``cpus_per_worker`` CPUs plus any
  custom resources such as ``ckray_train``, which the autoscaler answers with that node type); Ray
  Train sets up ``torch.distributed`` (gloo on CPU, NCCL on GPU) and ``deepspeed.initialize`` reuses
  that process group.
* DeepSpeed runs ZeRO stage ``zero_stage`` (stage 0 with a single worker: nothing to partition) with ``torch.optim.AdamW`` (no weight decay on biases and
  norm weights), a linear warm-up + linear decay schedule (``torch`` ``LambdaLR``, stepped by
  DeepSpeed at every optimizer step), gradient accumulation and gradient clipping.
  Precision: parameters, gradients and optimizer state are fp32; ``bf16`` runs ``task.loss`` and
  ``task.score`` under ``torch.autocast(bfloat16)`` (mixed precision: the matmuls run in bf16, the
  numerically sensitive ops - exp, log, softmax, norms - stay fp32, which kernel pooling needs).
  ``auto`` is bf16 on a GPU and fp32 on CPU.
* Each worker reads its shard of the triples with ``ray.train.get_dataset_shard("train")``, looping
  over as many epochs as ``max_steps`` needs; each epoch is re-shuffled (local shuffle buffer) with a
  seed derived from (seed, epoch, rank). ``step`` counts optimizer steps; one step consumes
  ``batch_size * grad_accum * workers`` triples.
* Every ``eval_every`` steps and at the end the dev queries' BM25 candidates are reranked with
  ``task.score`` (sharded over the workers) and scored with nDCG@10; the metrics and a checkpoint
  (DeepSpeed state incl. optimizer and LR schedule, per-rank RNG state, data position, history) go to
  ``ray.train.report``. Ray keeps the ``keep_checkpoints`` best by dev nDCG@10, plus the latest.
* Resume: a run is identified by ``storage_dir/run_name`` (``run_name`` defaults to ``task.name``).
  Calling ``fit`` again with the same storage continues from the latest checkpoint, at its step;
  a worker failure is retried ``max_failures`` times from the latest checkpoint (``FailureConfig``).
  ``resume=False`` deletes the run directory first.
* At the end the best checkpoint is consolidated to plain weights in ``output_dir`` with
  :func:`ckray.models.checkpoint.save_model` (``config.json`` + ``model.safetensors``), with the
  dev nDCG@10 and step in ``config.json``.

Writing a task
--------------
* ``build_model()`` must be deterministic given the torch seed and return an ``nn.Module`` with a
  dataclass ``config`` and ``__init__(config)`` (so ``save_model``/``load_model`` work).
* ``collate(rows)`` receives a dict of numpy arrays (columns of the triples table, ``batch_size``
  rows) and returns a dict of tensors; the loop moves tensors to the device (dtypes unchanged).
* ``loss(model, batch)`` and ``score(model, queries, docs, bm25)`` receive the bare module
  (``engine.module``), not the DeepSpeed engine, so any method of the model may be called.
  ``score`` gets a flat list of (query, doc) pairs and returns one score per pair.
* The task object is pickled to the workers: keep it light (paths and hyperparameters, not models).
* Hash words with a stable hash (``zlib.crc32``), never ``hash()``: it differs between processes.
* ZeRO stage 3 partitions parameters: use them only inside submodule ``forward`` calls.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import torch

from ckray.data.examples import DevSet
from ckray.errors import CkrayError, ConfigError, MissingArtifactError
from ckray.eval import ndcg_at_10

METRIC = "dev_ndcg@10"
TRAIN_DATASET = "train"
TRIPLE_COLUMNS = ("query_id", "query", "pos_id", "pos_text", "pos_bm25", "neg_id", "neg_text", "neg_bm25")
STATE_FILE = "train_state.json"   # written last, by rank 0: step, data position, history, file manifest
DS_TAG = "deepspeed"              # DeepSpeed checkpoint tag (sub-directory of a checkpoint)
PRECISIONS = ("auto", "fp32", "bf16")
_LOG = logging.getLogger("ckray.train")


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

@dataclass
class TrainConfig:
    """Everything :func:`fit` needs besides the task and the data. ``step`` = one optimizer step."""

    workers: int = 2
    use_gpu: bool = False
    zero_stage: int = 2
    precision: str = "auto"          # auto: bf16 on GPU, fp32 on CPU; bf16 = autocast mixed precision
    batch_size: int = 8              # per-worker micro-batch, in triples
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_steps: int = 0
    max_steps: int = 1000
    eval_every: int = 100            # 0: validate only at the end
    seed: int = 42
    max_failures: int = 2
    grad_clip: float = 1.0           # 0: no clipping
    output_dir: str = ""             # consolidated best model; default checkpoints/<task.name>
    storage_dir: str = ""            # Ray Train storage (run state, DeepSpeed checkpoints); default ./ray_train
    resume: bool = True
    run_name: str = ""               # run directory under storage_dir; default task.name
    log_every: int = 10              # progress line every N steps (rank 0)
    keep_checkpoints: int = 2        # best-by-dev checkpoints Ray keeps (the latest is kept as well)
    eval_batch_size: int = 64        # (query, doc) pairs per task.score call
    eval_at_start: bool = True       # also validate the untrained model (history entry at step 0)
    shuffle_buffer: int = 4096       # rows in the per-epoch local shuffle buffer (0: no shuffle)
    cpus_per_worker: int = 1         # logical CPUs reserved per worker = torch threads per worker
    # extra Ray resources each worker asks for, e.g. {"ckray_train": 1}: only nodes that advertise them
    # (cluster.yaml's training node type) take the workers, and the autoscaler launches such nodes
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    # start from these weights (a W/checkpoints/<name> directory of the same model) instead of the
    # model's own initialisation: fine-tuning a trained checkpoint further with other data or settings
    init_from: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a :class:`ConfigError` naming the first invalid field (``ConfigError.invalid``: a job
        that built this config from its flags names the flag instead, see :func:`config_from_args`)."""
        resources = self.resources_per_worker
        checks = [
            ("workers", self.workers >= 1, "must be >= 1"),
            ("zero_stage", self.zero_stage in (0, 1, 2, 3), "must be 0, 1, 2 or 3"),
            ("precision", self.precision in PRECISIONS, f"must be one of {PRECISIONS}"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("grad_accum", self.grad_accum >= 1, "must be >= 1"),
            ("lr", self.lr > 0, "must be > 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("warmup_steps", 0 <= self.warmup_steps, "must be >= 0"),
            ("max_steps", self.max_steps >= 1, "must be >= 1"),
            ("eval_every", self.eval_every >= 0, "must be >= 0 (0: validate only at the end)"),
            ("max_failures", self.max_failures >= -1, "must be >= -1 (-1: retry forever)"),
            ("grad_clip", self.grad_clip >= 0, "must be >= 0 (0: no clipping)"),
            ("log_every", self.log_every >= 1, "must be >= 1"),
            ("keep_checkpoints", self.keep_checkpoints >= 1, "must be >= 1"),
            ("eval_batch_size", self.eval_batch_size >= 1, "must be >= 1"),
            ("shuffle_buffer", self.shuffle_buffer >= 0, "must be >= 0 (0: no shuffle)"),
            ("cpus_per_worker", self.cpus_per_worker >= 1, "must be >= 1"),
            ("resources_per_worker",
             isinstance(resources, dict) and all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
                                                 for k, v in resources.items()),
             "must map resource names to amounts >= 0"),
            ("resources_per_worker", not {"CPU", "GPU"} & set(resources if isinstance(resources, dict) else {}),
             "must not name CPU or GPU: set CPUs with cpus_per_worker (--cpus-per-worker) and GPUs with "
             "use_gpu (--use-gpu)"),
        ]
        for name, ok, problem in checks:
            if not ok:
                raise ConfigError.invalid("TrainConfig", name, f"{problem}, got {getattr(self, name)!r}")


class RankerTask(ABC):
    """How a model plugs into :func:`fit`. Must be picklable: it is sent to every worker."""

    name: str = "ranker"

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        """A fresh model (deterministic given the torch seed) with a dataclass ``.config``."""

    @abstractmethod
    def collate(self, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Turn a Ray Data batch of triples (numpy columns, see ``TRIPLE_COLUMNS``) into tensors."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A scalar training loss for one micro-batch (``batch`` is already on the model's device)."""

    def score(self, model: torch.nn.Module, queries: list[str], docs: list[str],
              bm25: list[float]) -> torch.Tensor:
        """One relevance score per (query, doc) pair; called under ``torch.no_grad`` in eval mode."""
        return model.score_texts(queries, docs)

    def dev_scorer(self, model: torch.nn.Module) -> Callable[[list[str], list[str], list[float]], torch.Tensor]:
        """``(queries, docs, bm25) -> scores`` for every chunk of one validation, built once per validation
        from the current weights (a task can precompute there what all chunks share); default :meth:`score`."""
        return lambda queries, docs, bm25: self.score(model, queries, docs, bm25)

    @property
    def dev_scoring_forwards_per_chunk_fixed(self) -> bool:
        """Whether :meth:`dev_scorer` runs the same number of forward passes for every chunk. ZeRO-3 makes
        each forward a collective across workers (validation pads every rank to the same number of chunks),
        so :func:`fit` refuses ZeRO-3 over several workers for a task that says False."""
        return True

    def param_groups(self, model: torch.nn.Module, lr: float, weight_decay: float) -> list[dict] | None:
        """Optional AdamW parameter groups (e.g. a slower learning rate for a pretrained encoder);
        ``None``: one learning rate, no weight decay on biases and norms. Group ``lr`` values are
        scaled by the warm-up/decay schedule like the base rate."""
        return None


@dataclass
class TrainResult:
    best_checkpoint: Path            # output_dir: consolidated config.json + model.safetensors
    best_metric: float               # dev nDCG@10 of that checkpoint
    best_step: int
    history: list[dict]              # one entry per validation: step, epoch, loss, lr, dev_ndcg@10, examples_per_s
    steps: int                       # optimizer steps done in total (across resumes)
    examples_seen: int               # training triples consumed in total
    wall_time: float                 # seconds this fit() call took, start-up and consolidation included
    start_step: int = 0              # step this call started (resumed) from; 0 for a fresh run
    restarts: int = 0                # worker-group restarts (FailureConfig) during this call
    attempts: list[int] = field(default_factory=list)   # start step of each worker-group attempt
    run_dir: str = ""                # Ray Train run directory (checkpoints, snapshot)


def fit(task: RankerTask, triples: pa.Table | Any, dev: DevSet, config: TrainConfig) -> TrainResult:
    """Train ``task``'s model on ``triples`` (Arrow table or ``ray.data.Dataset``), pick the best
    checkpoint on ``dev`` by nDCG@10, write it to ``config.output_dir`` and return a summary.

    A run already at ``max_steps`` is not started again: its best checkpoint is consolidated."""
    t0 = time.time()
    config.validate()
    _validate_dev(dev)
    if _effective_zero_stage(config, config.workers) == 3 and not task.dev_scoring_forwards_per_chunk_fixed:
        raise ConfigError(f"{task.name}: its dev scoring runs a data-dependent number of forward passes per chunk, "
                          "which ZeRO-3 (a collective in every forward) cannot pair across workers; use "
                          "--zero-stage 2 (the optimizer state is still partitioned) or the task's one-forward "
                          "dev scoring (CK-QTI: --dev-scoring dense)")
    if isinstance(triples, pa.Table):
        _check_columns(triples.column_names)
        if triples.num_rows < config.workers * config.batch_size:
            raise ConfigError(f"{triples.num_rows} training triples are fewer than workers x batch_size "
                              f"= {config.workers * config.batch_size}")
    if config.init_from:
        _initial_weights(task, config.init_from)  # a missing or unfitting checkpoint fails here, not in a worker
    _ensure_ray()
    dataset = _as_dataset(triples)
    run_name = config.run_name or task.name
    storage = _storage_path(config.storage_dir)
    run_dir = f"{storage.rstrip('/')}/{run_name}"
    output_dir = Path(config.output_dir or Path("checkpoints") / task.name)
    latest_state = None
    if not config.resume:
        _remove_run_dir(run_dir)
    else:
        latest_state = _check_resumable(run_dir, config)

    fit_id = uuid.uuid4().hex
    if latest_state is not None and latest_state["step"] >= config.max_steps:
        print(f"[ckray.train {task.name}] {run_dir} is already at step {latest_state['step']} >= "
              f"max_steps {config.max_steps}: nothing to train", flush=True)
        result = _stored_result(run_dir)
    else:
        result = _run_trainer(task, dataset, dev, config, storage, run_name, run_dir, fit_id)

    best = result.get_best_checkpoint(METRIC, "max")
    if best is None or result.checkpoint is None:
        raise MissingArtifactError(f"training run {run_dir} produced no checkpoint")
    with result.checkpoint.as_directory() as latest_dir:
        latest = verify_checkpoint(latest_dir)
    with best.as_directory() as best_dir:
        best_state = verify_checkpoint(best_dir)
        consolidate(task, best_dir, output_dir, extra={"task": task.name, "train_run": run_dir})

    attempts = _attempt_starts(run_dir, fit_id)
    step = int(latest["step"])
    summary = TrainResult(
        best_checkpoint=output_dir,
        best_metric=float(best_state["metric"]),
        best_step=int(best_state["step"]),
        history=list(latest["history"]),
        steps=step,
        examples_seen=int(latest["examples_seen"]),
        wall_time=time.time() - t0,
        start_step=attempts[0] if attempts else step,
        restarts=max(0, len(attempts) - 1),
        attempts=attempts,
        run_dir=run_dir,
    )
    print(f"[ckray.train {task.name}] done: {summary.steps} steps, best {METRIC} "
          f"{summary.best_metric:.4f} at step {summary.best_step} -> {output_dir} "
          f"({summary.wall_time:.0f} s)", flush=True)
    start = next((h[METRIC] for h in summary.history if h.get("step") == 0 and METRIC in h), None)
    if start is not None and start > summary.best_metric:
        where = f"the --init-from checkpoint {config.init_from}" if config.init_from else "the untrained model"
        _LOG.warning("[%s] no trained step beat the starting weights on dev: %s %.4f at step 0 vs %.4f at step %d; "
                    "%s is the better model", task.name, METRIC, start, summary.best_metric, summary.best_step, where)
    return summary


def consolidate(task: RankerTask, checkpoint_dir: str | os.PathLike, output_dir: str | os.PathLike,
                extra: dict | None = None) -> Path:
    """Turn one training checkpoint (DeepSpeed state) into plain fp32 weights with ``save_model``."""
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
    return save_model(model, output_dir,
                      extra={METRIC: state["metric"], "step": state["step"], **(extra or {})})


def _initial_weights(task: RankerTask, path: str, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The weights of the saved checkpoint at ``path`` (``--init-from``), checked against ``task``'s
    model: same class, every tensor present with the same shape. Errors name the checkpoint."""
    from ckray.models.checkpoint import class_path, read_checkpoint

    model = model if model is not None else task.build_model()
    payload, weights = read_checkpoint(path)  # MissingArtifactError naming the path
    if payload.get("model_class") != class_path(model):
        raise ConfigError(f"--init-from {path}: it holds a {payload.get('model_class')}, "
                          f"this job trains a {class_path(model)}")
    own = model.state_dict()
    missing = sorted(set(own) - set(weights) - set(getattr(model, "_non_persistent_ok", ())))
    misfit = [k for k in own if k in weights and weights[k].shape != own[k].shape]
    if missing or misfit:
        detail = (f"missing {missing[:3]}" if missing else
                  f"{misfit[0]} is {tuple(weights[misfit[0]].shape)} there, {tuple(own[misfit[0]].shape)} here")
        raise ConfigError(f"--init-from {path} does not fit the model these flags build: {detail} "
                          f"(pass the model flags it was trained with)")
    return {k: v for k, v in weights.items() if k in own}


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


def lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    """LR multiplier for optimizer step ``step`` (0-based): linear warm-up to 1, then linear decay
    that reaches 0 just after ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (max_steps - step) / max(1, max_steps - warmup_steps))


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------

_FLAGS: dict[str, str] = {  # TrainConfig field -> its "--flag VALUE"
    "workers": "--workers", "zero_stage": "--zero-stage", "precision": "--precision",
    "batch_size": "--batch-size", "grad_accum": "--grad-accum", "lr": "--lr",
    "weight_decay": "--weight-decay", "warmup_steps": "--warmup-steps", "max_steps": "--max-steps",
    "eval_every": "--eval-every", "seed": "--seed", "max_failures": "--max-failures",
    "grad_clip": "--grad-clip", "output_dir": "--output-dir", "storage_dir": "--storage-dir",
    "run_name": "--run-name", "log_every": "--log-every", "keep_checkpoints": "--keep-checkpoints",
    "eval_batch_size": "--eval-batch-size", "cpus_per_worker": "--cpus-per-worker",
    "init_from": "--init-from",
}
_HELP: dict[str, str] = {  # what each of _FLAGS sets, for --help
    "workers": "Ray Train workers (one model replica each)",
    "zero_stage": "DeepSpeed ZeRO stage (0 with a single worker)",
    "precision": "auto: bf16 autocast on a GPU, fp32 on CPU",
    "batch_size": "training triples per worker and micro-batch",
    "grad_accum": "micro-batches per optimizer step",
    "lr": "peak learning rate (AdamW, linear warm-up and decay)",
    "weight_decay": "AdamW weight decay (none on biases and norms)",
    "warmup_steps": "linear warm-up steps",
    "max_steps": "optimizer steps in all (a finished run is not trained again)",
    "eval_every": "validate on dev every N steps (0: only at the end)",
    "seed": "random seed (model initialisation, data order)",
    "max_failures": "worker-group restarts from the latest checkpoint (-1: forever)",
    "grad_clip": "gradient norm clipping (0: none)",
    "output_dir": "where the best checkpoint is written",
    "storage_dir": "Ray Train storage: run state and DeepSpeed checkpoints",
    "run_name": "run directory under --storage-dir (resumed when it exists)",
    "log_every": "progress line every N steps",
    "keep_checkpoints": "best-by-dev checkpoints kept (the latest is kept as well)",
    "eval_batch_size": "(query, document) pairs per scoring call in validation",
    "cpus_per_worker": "CPUs reserved per worker (= its torch threads)",
}
# every TrainConfig field's flag (add_train_args), e.g. for naming the flag of an invalid field
TRAIN_FLAGS: dict[str, str] = {**_FLAGS, "resources_per_worker": "--resources-per-worker", "use_gpu": "--use-gpu",
                               "eval_at_start": "--no-eval-at-start", "resume": "--no-resume"}


def add_train_args(parser: argparse.ArgumentParser,
                   defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """Add the shared training flags (one per :class:`TrainConfig` field) to a job's parser.

    Every flag parses to None when not given, so the job's own choices (``config_from_args``'s
    ``defaults``) and then :class:`TrainConfig`'s apply. ``defaults`` (TrainConfig field → value,
    or a description such as ``"W/train"``) are the job's choices, shown in ``--help`` in place of
    TrainConfig's."""
    group = parser.add_argument_group("training (ckray.train)")
    base = TrainConfig()
    shown = {name: getattr(base, name) for name in _FLAGS} | dict(defaults or {})
    for name, flag in _FLAGS.items():
        value = shown[name]
        shown_value = value if isinstance(value, str) and value else repr(value)
        kwargs: dict[str, Any] = {"dest": f"train_{name}", "default": None, "type": type(getattr(base, name)),
                                  "metavar": name.upper(), "help": f"{_HELP.get(name, '')} (default: {shown_value})"}
        if name == "precision":
            kwargs.update(choices=PRECISIONS, metavar=None)
        if name == "zero_stage":
            kwargs.update(choices=(0, 1, 2, 3), metavar=None)
        if name == "init_from":
            kwargs.update(metavar="CKPT", help="start from this saved checkpoint's weights (a W/checkpoints/<name> "
                                               "directory of the same model) to fine-tune it further "
                                               "(default: the model's own initialisation)")
        group.add_argument(flag, **kwargs)
    group.add_argument("--resources-per-worker", dest="train_resources_per_worker", type=parse_resources,
                       default=None, metavar="JSON|K=V[,K=V]",
                       help='extra Ray resources per worker, e.g. ckray_train=1 or \'{"ckray_train": 1}\' '
                            "(default: none)")
    group.add_argument("--use-gpu", dest="train_use_gpu", action="store_true", default=None,
                       help="one GPU per worker (default: CPU)")
    group.add_argument("--no-eval-at-start", dest="train_eval_at_start", action="store_false", default=None,
                       help="skip validating the untrained model (default: validate it, step 0)")
    group.add_argument("--no-resume", dest="train_resume", action="store_false", default=None,
                       help="start over: delete the run directory instead of resuming from it (default: resume)")
    return parser


def parse_resources(text: str) -> dict[str, float]:
    """``'{"ckray_train": 1}'`` or ``ckray_train=1,other=0.5`` → ``{"ckray_train": 1.0, ...}``."""
    text = text.strip()
    try:
        if text.startswith("{"):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
        else:
            value = {}
            for item in filter(None, (s.strip() for s in text.split(","))):
                key, sep, amount = item.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{item!r} is not NAME=AMOUNT")
                value[key.strip()] = amount
        return {str(k): float(v) for k, v in value.items()}
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"resources {text!r}: {exc} (expected JSON like '{{\"ckray_train\": 1}}' or ckray_train=1)") from None


def config_from_args(args: argparse.Namespace, **defaults: Any) -> TrainConfig:
    """A :class:`TrainConfig` from parsed flags; ``defaults`` (a job's own choices, e.g.
    ``output_dir=W/checkpoints/ck-qti``, ``lr=3e-5``) apply where the flag was not given. An invalid
    value is refused naming its flag (``--max-steps must be >= 1, got 0``)."""
    values = dict(defaults)
    for f in dataclasses.fields(TrainConfig):
        value = getattr(args, f"train_{f.name}", None)
        if value is not None:
            values[f.name] = value
    try:
        return TrainConfig(**values)
    except ConfigError as exc:
        raise exc.for_flags(TRAIN_FLAGS) from None


# ----------------------------------------------------------------------------------------------
# Driver helpers
# ----------------------------------------------------------------------------------------------

def _run_trainer(task: RankerTask, dataset: Any, dev: DevSet, config: TrainConfig, storage: str,
                 run_name: str, run_dir: str, fit_id: str) -> Any:
    """Launch the TorchTrainer; return its ``ray.train.Result``."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    resources = {"CPU": config.cpus_per_worker, **({"GPU": 1} if config.use_gpu else {}),
                 **config.resources_per_worker}
    trainer = TorchTrainer(
        _train_worker,
        train_loop_config={"task": task, "config": config, "dev": dev, "fit_id": fit_id, "run_dir": run_dir},
        scaling_config=ScalingConfig(num_workers=config.workers, use_gpu=config.use_gpu,
                                     resources_per_worker=resources),
        run_config=RunConfig(
            storage_path=storage, name=run_name,
            failure_config=FailureConfig(max_failures=config.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=config.keep_checkpoints,
                                               checkpoint_score_attribute=METRIC,
                                               checkpoint_score_order="max")),
        datasets={TRAIN_DATASET: dataset},
    )
    try:
        return trainer.fit()
    except Exception as exc:  # Ray wraps worker errors; surface ours with their own message
        cause = _find_ckray_error(exc)
        if cause is not None:
            raise type(cause)(str(cause)) from exc
        raise


def _ensure_ray() -> None:
    """Connect to ``RAY_ADDRESS`` when set, else start a local Ray; no-op when already initialised.

    ``address="local"``: a bare ``ray.init()`` would attach to any head a ``ray start`` left running
    on this machine (someone else's, possibly)."""
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local",
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})


def _as_dataset(triples: Any) -> Any:
    import ray.data

    if isinstance(triples, pa.Table):
        dataset = ray.data.from_arrow(triples)
    elif isinstance(triples, ray.data.Dataset):
        dataset = triples
    else:
        raise ConfigError(f"triples must be a pyarrow.Table or ray.data.Dataset, not {type(triples).__name__}")
    _check_columns(dataset.schema().names)
    dataset.context.enable_progress_bars = False  # one bar per epoch per worker floods the log
    return dataset


def _check_columns(names: list[str]) -> None:
    missing = [c for c in TRIPLE_COLUMNS if c not in names]
    if missing:
        raise ConfigError(f"training triples lack columns {missing} (expected {list(TRIPLE_COLUMNS)})")


def _validate_dev(dev: DevSet) -> None:
    if not dev.queries:
        raise ConfigError("the dev set has no queries: validation needs at least one")
    for qid in dev.queries:
        for did, _ in dev.candidates.get(qid, []):
            if did not in dev.doc_text:
                raise ConfigError(f"dev set: candidate {did} of query {qid} has no entry in doc_text")


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
    written with the same number of workers and ZeRO stage. Returns its state (None: fresh run)."""
    import pyarrow.fs as pafs
    from ray.train import Result
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    fs, path = _filesystem(run_dir)
    if fs.get_file_info(f"{path}/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}").type != pafs.FileType.File:
        return None  # nothing to resume from
    try:
        latest = _stored_result(run_dir).checkpoint
    except Exception as exc:
        raise MissingArtifactError(f"cannot resume training run {run_dir}: {exc}; delete it or pass "
                                   "resume=False / --no-resume to start over") from exc
    if latest is None:
        return None
    state = verify_checkpoint(latest.path, latest.filesystem)
    _check_compatible(state, config, config.workers, latest.path)
    return state


ATTEMPTS_DIR = "ckray_attempts"   # run_dir/ckray_attempts/<fit id>/<time>.json: one per worker-group start


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


def _check_compatible(state: dict, config: TrainConfig, world: int, where: str) -> None:
    if state["world_size"] != world or state["zero_stage"] != config.zero_stage:
        raise ConfigError(
            f"training checkpoint {where} was written with {state['world_size']} workers and ZeRO "
            f"stage {state['zero_stage']}; resume with --workers {state['world_size']} --zero-stage "
            f"{state['zero_stage']} (the optimizer state is partitioned per worker), or start over "
            "with resume=False / --no-resume")


def _find_ckray_error(exc: BaseException | None, depth: int = 0) -> CkrayError | None:
    """The CkrayError a worker raised, out of Ray's wrappers (WorkerGroupError, RayTaskError)."""
    if exc is None or depth > 6:
        return None
    if isinstance(exc, CkrayError):
        return getattr(exc, "cause", None) if isinstance(getattr(exc, "cause", None), CkrayError) else exc
    inner: list[BaseException | None] = [getattr(exc, "cause", None), exc.__cause__,
                                         getattr(exc, "controller_failure", None)]
    inner += list(getattr(exc, "worker_failures", {}).values())
    for e in inner:
        found = _find_ckray_error(e, depth + 1)
        if found is not None:
            return found
    return None


def _checkpoint_weights(checkpoint_dir: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """fp32 weights out of a DeepSpeed checkpoint. ZeRO 0-2 keep whole fp32 parameters in the model
    states file; ZeRO-3 partitions them, so they are gathered from the per-rank files."""
    ds_dir = checkpoint_dir / DS_TAG
    if zero_stage == 3:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=DS_TAG)
    states = torch.load(ds_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return states["module"]


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------

def _train_worker(loop_config: dict) -> None:
    """The per-worker training function run by ``TorchTrainer``."""
    import deepspeed
    import ray.train
    import ray.train.torch

    task: RankerTask = loop_config["task"]
    cfg: TrainConfig = loop_config["config"]
    dev: DevSet = loop_config["dev"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    tag = f"[ckray.train {task.name}]"
    # logging, not print: Ray Train's print patch would show every line twice
    log = (lambda msg: _LOG.info(f"{tag} {msg}")) if rank == 0 else (lambda msg: None)

    torch.set_num_threads(cfg.cpus_per_worker)
    if torch.cuda.is_available():
        torch.cuda.set_device(ray.train.torch.get_device())
    _seed_everything(cfg.seed)
    model = task.build_model()
    if cfg.init_from:  # a resumed run's own state replaces these below
        model.load_state_dict(_initial_weights(task, cfg.init_from, model), strict=False)
    if not dataclasses.is_dataclass(getattr(model, "config", None)):
        raise ConfigError(f"{type(model).__name__} needs a dataclass `config` attribute (see ckray.models.checkpoint)")
    groups = task.param_groups(model, cfg.lr, cfg.weight_decay) or weight_decay_groups(model.parameters(),
                                                                                         cfg.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=_deepspeed_config(cfg, world))
    if torch.cuda.is_available() and engine.device != ray.train.torch.get_device():
        _LOG.warning(f"{tag} rank {rank}: DeepSpeed placed the model on {engine.device} (LOCAL_RANK) but "
                     f"Ray assigned {ray.train.torch.get_device()}")
    autocast = _autocast(cfg.precision, engine.device)

    state: dict[str, Any] = {
        "task": task.name, "step": 0, "epoch": 0, "batch_in_epoch": 0, "world_size": world,
        "zero_stage": cfg.zero_stage, "ds_zero_stage": _effective_zero_stage(cfg, world),
        "examples_seen": 0, "history": [], "metric": None,
    }
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as ckpt_dir:
            state = _restore(engine, Path(ckpt_dir), rank, cfg, world)
        log(f"resumed from step {state['step']} (epoch {state['epoch']}, batch {state['batch_in_epoch']})")
    if rank == 0:
        _record_attempt(loop_config["run_dir"], loop_config["fit_id"], state["step"])
    if state["step"] >= cfg.max_steps:
        log(f"already at step {state['step']} >= max_steps {cfg.max_steps}: nothing to train")
        return

    evaluator = _DevEvaluator(task, dev, rank, world, cfg.eval_batch_size,
                              pad=_effective_zero_stage(cfg, world) == 3)
    if state["step"] == 0 and cfg.eval_at_start and not state["history"]:
        with autocast:
            ndcg = evaluator(engine.module)
        state["history"].append({"step": 0, "epoch": 0, METRIC: ndcg})
        log(f"step 0 {METRIC} {ndcg:.4f} (untrained)")

    shard = ray.train.get_dataset_shard(TRAIN_DATASET)
    batches = _micro_batches(shard, cfg, rank, state["epoch"], state["batch_in_epoch"])
    per_step = cfg.batch_size * cfg.grad_accum * world   # triples per optimizer step, all workers
    log(f"training steps {state['step']}..{cfg.max_steps}: {world} workers x {cfg.batch_size} triples x "
        f"{cfg.grad_accum} accumulation, ZeRO-{_effective_zero_stage(cfg, world)}, "
        f"{_precision_name(cfg.precision, engine.device)}")

    engine.train()
    interval_loss = torch.zeros(2, dtype=torch.float64)   # sum, count since the last validation
    loss_sum, loss_n = torch.zeros((), device=engine.device), 0
    log_loss, log_n = 0.0, 0
    t_log = t_interval = time.time()
    train_seconds, steps_since_eval = 0.0, 0
    while state["step"] < cfg.max_steps:
        for _ in range(cfg.grad_accum):
            epoch, position, rows = next(batches)
            batch = _to_device(task.collate(rows), engine.device)
            with autocast:
                loss = task.loss(engine.module, batch)
            engine.backward(loss)
            engine.step()
            loss_sum += loss.detach().float()   # summed on the device: no host sync per micro-batch
            loss_n += 1
            state["epoch"], state["batch_in_epoch"] = epoch, position
        state["step"] += 1
        state["examples_seen"] += per_step
        steps_since_eval += 1
        step = state["step"]
        is_eval = (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.max_steps
        if step % cfg.log_every == 0 or is_eval:
            total = float(loss_sum.item())
            if not math.isfinite(total):
                raise FloatingPointError(f"{tag} loss became {total} before step {step} (rank {rank}); "
                                         "lower the learning rate or check the task's loss")
            interval_loss += torch.tensor([total, float(loss_n)], dtype=torch.float64)
            log_loss, log_n = log_loss + total, log_n + loss_n
            loss_sum.zero_()
            loss_n = 0
        if step % cfg.log_every == 0 and rank == 0:
            now = time.time()
            rate = cfg.log_every * per_step / max(now - t_log, 1e-9)
            eta = (cfg.max_steps - step) * per_step / max(rate, 1e-9)
            log(f"step {step}/{cfg.max_steps} epoch {epoch} loss {log_loss / max(log_n, 1):.4f} "
                f"lr {engine.get_lr()[0]:.2e} ex/s {rate:.1f} eta {_hms(eta)}")
            log_loss, log_n, t_log = 0.0, 0, now
        if is_eval:
            train_seconds = time.time() - t_interval
            rate = steps_since_eval * per_step / max(train_seconds, 1e-9)
            _validate_and_report(engine, evaluator, state, interval_loss, rate, autocast, rank, log)
            engine.train()
            interval_loss.zero_()
            steps_since_eval = 0
            t_log = t_interval = time.time()


def _validate_and_report(engine: Any, evaluator: "_DevEvaluator", state: dict, interval_loss: torch.Tensor,
                         examples_per_s: float, autocast: Any, rank: int, log: Callable[[str], None]) -> None:
    import ray.train
    import torch.distributed as dist

    if dist.is_initialized():
        reduced = interval_loss.to(engine.device)   # NCCL reduces device tensors only
        dist.all_reduce(reduced)
        interval_loss = reduced.cpu()
    t0 = time.time()
    with autocast:
        ndcg = evaluator(engine.module)
    entry = {"step": state["step"], "epoch": state["epoch"],
             "loss": float(interval_loss[0] / max(float(interval_loss[1]), 1.0)),
             "lr": float(engine.get_lr()[0]), METRIC: ndcg, "examples_per_s": examples_per_s,
             "eval_s": time.time() - t0}
    state["history"].append(entry)
    state["metric"] = ndcg
    ckpt_dir = Path(tempfile.mkdtemp(prefix="ckray-ckpt-"))
    try:
        _save(engine, ckpt_dir, state, rank)
        ray.train.report(dict(entry), checkpoint=ray.train.Checkpoint.from_directory(str(ckpt_dir)))
    finally:
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    log(f"step {entry['step']} {METRIC} {ndcg:.4f} loss {entry['loss']:.4f} "
        f"(validation {entry['eval_s']:.1f} s, checkpoint saved)")


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


class _DevEvaluator:
    """Rerank the dev candidates with ``task.dev_scorer(model)`` and compute nDCG@10.

    The (query, doc) pairs are cut into chunks of ``batch_size``; rank r scores chunks r, r+W, ...
    and the scores are all-gathered, so every rank returns the same figure. With ``pad`` (ZeRO-3,
    where a forward is a collective) every rank makes the same number of ``score`` calls.
    """

    def __init__(self, task: RankerTask, dev: DevSet, rank: int, world: int, batch_size: int, pad: bool):
        self.task, self.dev, self.rank, self.world, self.pad = task, dev, rank, world, pad
        self.pairs = [(qid, did, float(bm25)) for qid in sorted(dev.queries)
                      for did, bm25 in dev.candidates.get(qid, [])]
        self.chunks = [self.pairs[i:i + batch_size] for i in range(0, len(self.pairs), batch_size)]

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> float:
        import torch.distributed as dist

        was_training = model.training
        model.eval()
        mine: list[tuple[str, str, float]] = []
        score = self.task.dev_scorer(model)
        rounds = math.ceil(len(self.chunks) / self.world)
        for r in range(rounds):
            i = r * self.world + self.rank
            if i >= len(self.chunks) and not self.pad:
                break
            chunk = self.chunks[i] if i < len(self.chunks) else self.chunks[0]
            scores = score([self.dev.queries[q] for q, _, _ in chunk],
                           [self.dev.doc_text[d] for _, d, _ in chunk], [b for _, _, b in chunk])
            scores = scores.detach().float().reshape(-1).cpu().tolist()
            if len(scores) != len(chunk):
                raise ConfigError(f"{type(self.task).__name__}.dev_scorer returned {len(scores)} scores "
                                  f"for {len(chunk)} pairs")
            if i < len(self.chunks):
                mine += [(q, d, s) for (q, d, _), s in zip(chunk, scores)]
        everyone = [mine]
        if dist.is_initialized() and self.world > 1:
            everyone = [None] * self.world  # type: ignore[list-item]
            dist.all_gather_object(everyone, mine)
        run: dict[str, list[tuple[str, float]]] = {q: [] for q in self.dev.queries}
        for part in everyone:
            for q, d, s in part:
                run[q].append((d, s))
        for q in run:
            run[q].sort(key=lambda x: (-x[1], x[0]))
        model.train(was_training)
        return float(ndcg_at_10(run, self.dev.qrels))


def _micro_batches(shard: Any, cfg: TrainConfig, rank: int, epoch: int,
                   skip: int) -> Iterator[tuple[int, int, dict[str, np.ndarray]]]:
    """Endless (epoch, position-after, rows) micro-batches; the first ``skip`` batches of ``epoch``
    (already consumed before a resume) are passed over."""
    while True:
        n = 0
        for rows in shard.iter_batches(batch_size=cfg.batch_size, batch_format="numpy", drop_last=True,
                                       local_shuffle_buffer_size=cfg.shuffle_buffer or None,
                                       local_shuffle_seed=_epoch_seed(cfg.seed, epoch, rank)):
            n += 1
            if n <= skip:
                continue
            yield epoch, n, rows
        if n == 0:
            raise ConfigError(f"worker {rank} got no full batch of {cfg.batch_size} triples: the training "
                              f"set is smaller than workers x batch_size")
        epoch, skip = epoch + 1, 0


def _epoch_seed(seed: int, epoch: int, rank: int) -> int:
    return (seed * 1_000_003 + epoch * 1_009 + rank) % (2 ** 31)


def _effective_zero_stage(cfg: TrainConfig, world: int) -> int:
    """ZeRO partitions over the workers; with one worker there is nothing to partition and stages
    1-3 only add copies (measured: 9 % more CPU per step at ZeRO-2), so one worker runs stage 0."""
    return cfg.zero_stage if world > 1 else 0


def _deepspeed_config(cfg: TrainConfig, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.batch_size * cfg.grad_accum * world,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": _effective_zero_stage(cfg, world)},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10 ** 12,   # the loop logs progress itself
        "wall_clock_breakdown": False,
    }


def weight_decay_groups(params: Iterable[torch.nn.Parameter], weight_decay: float, **extra: Any) -> list[dict]:
    """AdamW groups: decay matrices and embeddings, not biases and norm/scale vectors; ``extra``
    (e.g. ``lr=``) goes into both groups."""
    decay, no_decay = [], []
    for p in params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [g for g in ({"params": decay, "weight_decay": weight_decay, **extra},
                        {"params": no_decay, "weight_decay": 0.0, **extra}) if g["params"]]


def _autocast(precision: str, device: torch.device) -> Any:
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _precision_name(precision: str, device: torch.device) -> str:
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    return f"{'bf16 autocast' if bf16 else 'fp32'} on {device}"


def _to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
