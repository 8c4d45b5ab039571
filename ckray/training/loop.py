"""The loop: :func:`fit` on the driver, :func:`_train_worker` on every Ray Train worker.

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
  a worker failure is retried ``max_failures`` times from the latest checkpoint (``FailureConfig``);
  one more is a :class:`~ckray.training.checkpointing.WorkersLostError` naming that checkpoint.
  ``resume=False`` deletes the run directory first.
* At the end the best checkpoint is consolidated to plain weights in ``output_dir`` with
  :func:`ckray.models.checkpoint.save_model` (``config.json`` + ``model.safetensors``), with the
  dev nDCG@10 and step in ``config.json``; ``weight_ensemble`` < 1 saves WiSE-FT's mix of those
  weights with the initial ones instead (``ckray.models.weight_ensemble``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import random
import shutil
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import pyarrow as pa
import torch

from ckray.batch_inference import ckray_cause as _find_ckray_error  # out of Ray's wrappers
from ckray.data.examples import DevSet
from ckray.errors import ConfigError, MissingArtifactError
from ckray.ray_env import init_ray
from ckray.training.checkpointing import (_attempt_starts, _check_resumable, _initial_weights, _record_attempt,
                                          _remove_run_dir, _restore, _save, _storage_path, _stored_result,
                                          consolidate, resume_checkpoint, verify_checkpoint, workers_lost)
from ckray.training.config import TrainConfig
from ckray.training.dev import _DevEvaluator, _validate_dev
from ckray.training.task import METRIC, TRIPLE_COLUMNS, RankerTask, TrainResult

TRAIN_DATASET = "train"
_LOG = logging.getLogger("ckray.train")


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------


def best_checkpoint(result: Any) -> Any:
    """The kept checkpoint with the best dev metric (``METRIC``); among equal metrics the latest step.

    Ray's own choice among equal metrics follows the order its checkpoints were registered in, which
    differs between an uninterrupted run and one killed and resumed; the latest step among the best is
    the same in both (Ray always keeps the latest checkpoint), so the chosen model does not depend on
    whether the run was interrupted."""
    scored = [(metrics[METRIC], metrics.get("step", -1), i, checkpoint)
              for i, (checkpoint, metrics) in enumerate(result.best_checkpoints or []) if METRIC in metrics]
    if not scored:
        return result.get_best_checkpoint(METRIC, "max")
    return max(scored, key=lambda t: (t[0], t[1], t[2]))[3]

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
    init_ray()   # RAY_ADDRESS when set, else a local Ray; a no-op when one is running
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
    if latest_state is not None and latest_state["registered"] and latest_state["step"] >= config.max_steps:
        print(f"[ckray.train {task.name}] {run_dir} is already at step {latest_state['step']} >= "
              f"max_steps {config.max_steps}: nothing to train", flush=True)
        result = _stored_result(run_dir)
    else:
        result = _run_trainer(task, dataset, dev, config, storage, run_name, run_dir, fit_id)

    best = best_checkpoint(result)
    if best is None or result.checkpoint is None:
        raise MissingArtifactError(f"training run {run_dir} produced no checkpoint")
    with result.checkpoint.as_directory() as latest_dir:
        latest = verify_checkpoint(latest_dir)
    with best.as_directory() as best_dir:
        best_state = verify_checkpoint(best_dir)
        mixed_dev = None  # WiSE-FT's mix is validated on the driver, as the workers validated the steps
        if config.weight_ensemble != 1.0:
            mixed_dev = _DevEvaluator(task, dev, 0, 1, config.eval_batch_size, pad=False)
        consolidate(task, best_dir, output_dir, extra={"task": task.name, "train_run": run_dir},
                    weight_ensemble=config.weight_ensemble, seed=config.seed, dev_metric=mixed_dev)

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
    if config.weight_ensemble != 1.0:
        from ckray.models.checkpoint import read_checkpoint_config

        mixed = read_checkpoint_config(output_dir)["weight_ensemble"]
        print(f"[ckray.train {task.name}] saved WiSE-FT's mix, α = {config.weight_ensemble}: dev {METRIC} "
              f"{mixed[METRIC]:.4f} (the fine-tuned step alone {summary.best_metric:.4f})", flush=True)
    start = next((h[METRIC] for h in summary.history if h.get("step") == 0 and METRIC in h), None)
    if start is not None and start > summary.best_metric:
        where = f"the --init-from checkpoint {config.init_from}" if config.init_from else "the untrained model"
        _LOG.warning("[%s] no trained step beat the starting weights on dev: %s %.4f at step 0 vs %.4f at step %d; "
                    "%s is the better model", task.name, METRIC, start, summary.best_metric, summary.best_step, where)
    return summary


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
    from ray.train import WorkerGroupError

    try:
        return trainer.fit()
    except Exception as exc:  # Ray wraps worker errors; surface ours with their own message
        cause = _find_ckray_error(exc)
        if cause is not None:
            raise type(cause)(str(cause)) from exc
        if isinstance(exc, WorkerGroupError):  # retried max_failures times already
            raise workers_lost(run_dir, config.max_failures, _first_failure(exc)) from exc
        raise


def _first_failure(exc: BaseException) -> str:
    """One line on why a worker group failed: the first worker's error, its last line (the exception)."""
    failures = list(getattr(exc, "worker_failures", {}).items())
    rank, error = failures[0] if failures else (None, exc)
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    what = lines[-1] if lines else type(error).__name__
    return f"worker {rank}: {what}" if rank is not None else what


def _as_dataset(triples: Any) -> Any:
    import ray.data

    if isinstance(triples, pa.Table):
        dataset = ray.data.from_arrow(triples)
    elif isinstance(triples, ray.data.Dataset):
        dataset = triples
    else:
        raise ConfigError(f"triples must be a pyarrow.Table or ray.data.Dataset, not {type(triples).__name__}")
    # A streamed dataset's schema is known only by running it: never run the whole pipeline here just to
    # check the columns; its first batch on each worker is checked instead (_micro_batches).
    schema = dataset.schema(fetch_if_missing=False)
    if schema is not None:
        _check_columns(schema.names)
    dataset.context.enable_progress_bars = False  # one bar per epoch per worker floods the log
    return dataset


def _check_columns(names: list[str]) -> None:
    missing = [c for c in TRIPLE_COLUMNS if c not in names]
    if missing:
        raise ConfigError(f"training triples lack columns {missing} (expected {list(TRIPLE_COLUMNS)})")


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------

def _train_worker(loop_config: dict) -> None:
    """The per-worker training function run by ``TorchTrainer``."""
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
    engine = build_engine(task, model, cfg, world)
    if torch.cuda.is_available() and engine.device != ray.train.torch.get_device():
        _LOG.warning(f"{tag} rank {rank}: DeepSpeed placed the model on {engine.device} (LOCAL_RANK) but "
                     f"Ray assigned {ray.train.torch.get_device()}")
    autocast = precision_context(cfg.precision, engine.device)

    state: dict[str, Any] = {
        "task": task.name, "step": 0, "epoch": 0, "batch_in_epoch": 0, "world_size": world,
        "zero_stage": cfg.zero_stage, "ds_zero_stage": _effective_zero_stage(cfg, world),
        "examples_seen": 0, "history": [], "metric": None,
    }
    checkpoint, _ = resume_checkpoint(loop_config["run_dir"], ray.train.get_checkpoint())
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
            loss_sum += train_micro_batch(engine, task, rows, autocast).float()   # on the device: no host sync
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


def build_engine(task: RankerTask, model: torch.nn.Module, cfg: TrainConfig, world: int,
                 zero_stage: int | None = None) -> Any:
    """``model`` wrapped in a DeepSpeed engine as every training worker wraps it: AdamW over the task's
    parameter groups (else :func:`weight_decay_groups`), :func:`lr_schedule`, gradient clipping and
    accumulation from ``cfg``, and ZeRO at :func:`_effective_zero_stage` (``zero_stage`` forces a stage:
    for benchmarks that time ZeRO's partitioned optimizer on one device). ``torch.distributed`` is
    initialised first (Ray Train does it on the workers)."""
    import deepspeed

    groups = task.param_groups(model, cfg.lr, cfg.weight_decay) or weight_decay_groups(model.parameters(),
                                                                                         cfg.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr)
    scheduler = lr_schedule(optimizer, cfg)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=_deepspeed_config(cfg, world, zero_stage))
    return engine


def train_micro_batch(engine: Any, task: RankerTask, rows: dict[str, np.ndarray], autocast: Any) -> torch.Tensor:
    """One micro-batch of triples: ``task.collate``, ``task.loss`` under ``autocast``
    (:func:`precision_context`), backward, and ``engine.step()`` (an optimizer step at each
    accumulation boundary). Returns the loss, detached, on the device."""
    batch = _to_device(task.collate(rows), engine.device)
    with autocast:
        loss = task.loss(engine.module, batch)
    engine.backward(loss)
    engine.step()
    return loss.detach()


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
            if n == 1:
                _check_columns(list(rows))
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


def _deepspeed_config(cfg: TrainConfig, world: int, zero_stage: int | None = None) -> dict:
    stage = _effective_zero_stage(cfg, world) if zero_stage is None else zero_stage
    return {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "train_batch_size": cfg.batch_size * cfg.grad_accum * world,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {"stage": stage},
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


def lr_schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The run's schedule: :func:`lr_factor` with ``cfg``'s warm-up, decaying to zero at
    ``cfg.schedule_steps`` (0: at ``cfg.max_steps``)."""
    end = cfg.schedule_steps or cfg.max_steps
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg.warmup_steps, end))


def lr_factor(step: int, warmup_steps: int, schedule_steps: int) -> float:
    """LR multiplier for optimizer step ``step`` (0-based): linear warm-up to 1, then linear decay
    that reaches 0 just after ``schedule_steps`` (``TrainConfig.schedule_steps``, else ``max_steps``)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    return max(0.0, (schedule_steps - step) / max(1, schedule_steps - warmup_steps))


def precision_context(precision: str, device: torch.device, cpuinfo: str = "/proc/cpuinfo") -> Any:
    """The context a training step's forward runs in: ``torch.autocast(bfloat16)`` for ``bf16`` (and
    ``auto`` on a GPU), else none (fp32). ``bf16`` on a CPU without native bf16 (``ckray.device.
    cpu_has_native_bf16`` of ``cpuinfo``) is emulated: it still runs, with a warning, since it is many
    times slower than fp32 there."""
    from ckray.device import CPU_BF16_FLAGS, cpu_has_native_bf16

    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        if device.type == "cpu" and cpu_has_native_bf16(cpuinfo) is False:
            warnings.warn(f"--precision bf16 on a CPU without native bf16 ({' or '.join(CPU_BF16_FLAGS)} not in "
                          f"{cpuinfo}): bf16 is emulated there, many times slower than fp32 (--precision fp32)",
                          stacklevel=2)
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


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
