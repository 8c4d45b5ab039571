"""What every ``jobs/train_*.py`` shares: flags, making sure the data artifacts exist, building the
training triples and dev set from *training* queries only, running :func:`ckray.train.fit`, and
writing the chosen checkpoint to ``W/checkpoints/<name>`` with a training summary beside it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Mapping

from ckray.data.examples import TrainingData, TrainingDataConfig, build_training_data
from ckray.errors import ConfigError
from ckray.models.checkpoint import TRAIN_SUMMARY_FILE
from ckray.options import add_options, options_from_args
from ckray.training import RankerTask, TrainConfig, TrainResult, add_train_args, config_from_args, fit
from ckray.workdir import WorkDir

log = logging.getLogger(__name__)


DATA_DEST_PREFIX = "data_"   # a training-data flag's destination: data_<field>


def add_training_data_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The training-data flags, one per :class:`TrainingDataConfig` field."""
    return add_options(parser, TrainingDataConfig, "training data (ckray.data.examples)", dest_prefix=DATA_DEST_PREFIX)


# where run_training puts a run: set from --workdir and the checkpoint name (shown in --help)
RUN_LAYOUT_DEFAULTS = {"output_dir": "W/checkpoints/<name>", "storage_dir": "W/train", "run_name": "<name>"}


def training_parser(description: str, train_defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """A training job's flags: common, training data, the training loop. ``train_defaults``: the
    model's own TrainConfig choices (what its job passes to :func:`run_training`), shown in --help."""
    from ckray.cli import base_parser

    return add_train_args(add_training_data_args(base_parser(description)),
                          {**RUN_LAYOUT_DEFAULTS, **(train_defaults or {})})


def training_data_config(args: argparse.Namespace) -> TrainingDataConfig:
    """The training data's config from a training job's flags (checked: an invalid one names its flag)."""
    return options_from_args(TrainingDataConfig, args, dest_prefix=DATA_DEST_PREFIX)


def training_config(args: argparse.Namespace, name: str, **train_defaults: Any) -> TrainConfig:
    """The training loop's config of the run ``name`` (``W/checkpoints/<name>``, run state under ``W/train``):
    the job's flags over ``train_defaults``, the model's own choices. An invalid flag is refused here,
    naming it (``--max-steps must be >= 1, got 0``): a job builds this before it starts Ray or any work."""
    workdir = WorkDir(args.workdir)
    return config_from_args(args, output_dir=str(workdir.checkpoint(name)),
                            storage_dir=str(WorkDir(workdir.root.resolve()).train_runs), run_name=name,
                            **train_defaults)


def training_data(args: argparse.Namespace) -> TrainingData:
    """The training triples (a Ray Dataset that streams, see :mod:`ckray.data.examples`) and dev set of
    a training job's flags; prepares the collection (shards, BM25, negatives) where the work directory
    lacks it. ``--max-triples N`` keeps the first N triples of the seeded shuffle."""
    from ckray.data.collections import read_queries_and_qrels
    from ckray.data.prepare import prepare_collection

    config = training_data_config(args)  # checks the flags before any work
    queries, qrels = read_queries_and_qrels(Path(args.data))
    if config.split not in qrels:
        raise ConfigError(f"--train-split {config.split!r}: {args.data} has qrels for {sorted(qrels)}")
    # idempotent: works on a fresh workdir; negatives prepared at this depth or deeper are kept
    prepare_collection(args.data, args.workdir, split=config.split, negative_depth=config.negative_depth)
    td = build_training_data(args.workdir, queries, qrels[config.split], config)
    if td.num_triples == 0:
        raise ConfigError(f"{args.data}: no training triples from split {config.split!r} — no non-dev query "
                          f"has a judged positive in the corpus and a BM25 candidate to contrast it with")
    return td.limited(config.max_triples) if config.max_triples else td


def run_training(task: RankerTask, args: argparse.Namespace, config: TrainConfig,
                 td: TrainingData | None = None) -> TrainResult:
    """Train ``task`` with ``config`` (:func:`training_config`) and write ``config.output_dir``
    (``W/checkpoints/<name>``, + ``train_summary.json``). ``td``: training data a job already built (e.g.
    to derive corpus statistics first); built from ``args`` otherwise."""
    td = td or training_data(args)
    out = Path(config.output_dir)
    name = out.name   # the checkpoint's name (W/checkpoints/<name>)
    summary_path = out / TRAIN_SUMMARY_FILE
    previous = summary_path.read_bytes() if summary_path.exists() else None  # fit replaces the directory
    if td.num_triples < config.workers * config.batch_size:  # the streamed triples are counted, not read, here
        raise ConfigError(f"{td.num_triples} training triples are fewer than workers x batch_size "
                          f"= {config.workers * config.batch_size}")
    result = fit(task, td.triples, td.dev, config)
    summary = {
        "name": name, "best_dev_ndcg@10": result.best_metric, "best_step": result.best_step,
        "steps": result.steps, "examples_seen": result.examples_seen, "wall_time_s": result.wall_time,
        "train_triples": td.num_triples, "weak_triples": td.weak_triples,
        "train_queries": len(td.train_queries), "dev_queries": len(td.dev),
        "dev_scoring": getattr(task, "dev_scoring", "model"), "train_top_k": getattr(task, "train_top_k", 0),
        "config": dataclasses.asdict(config), "data_config": dataclasses.asdict(td.config), "history": result.history,
    }
    if previous is not None and result.steps == result.start_step and not result.attempts \
            and json.loads(previous).get("steps") == result.steps:
        # the run was finished, nothing trained: keep the summary of the call that trained it (its
        # wall time and history), not one of a call that only consolidated the checkpoint again
        summary_path.write_bytes(previous)
    else:
        summary_path.write_text(json.dumps(summary, indent=2, default=str))
    print(f"{name}: best dev nDCG@10 {result.best_metric:.4f} at step {result.best_step}; "
          f"{result.steps} steps, {result.examples_seen} examples, {result.wall_time:.0f}s → {out}")
    return result
