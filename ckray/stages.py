"""Stages as jobs: a ranker's training or index stage (``ckray.rankers``) behind its command line.

A stage is ``"train:<ranker>"`` or ``"index:<ranker>"``; its code lives in the ranker's package
(``ckray/rankers/<ranker>/stage.py``) and is found through the registry, so ``jobs/train_*.py`` and
``jobs/build_*_index.py`` are :func:`main_for` of their stage, and ``ckray.full_pipeline`` runs
exactly the same code with a namespace parsed from a few flags (``parse_stage_args``)::

    args = parse_stage_args("train:cedr-knrm", ["--data", D, "--workdir", W, "--max-steps", "20"])
    result = run_stage("train:cedr-knrm", args)       # == python jobs/train_cedr.py --data D ...

Every stage skips finished work: a training run already at ``--max-steps`` is not started again
(``ckray.training.fit``), finished impact / embedding shards and an up-to-date index are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ckray.errors import ConfigError
from ckray.options import add_options, option, parse_resources
from ckray.rankers import TrainingStage, indexed, trainable

if TYPE_CHECKING:
    from ckray.training import TrainConfig


@dataclass(frozen=True)
class ActorPoolOptions:
    """The Ray Data actor pool of an index job (impact scoring, dense embedding): its flags."""

    actors: int = option(1, "actor pool size (one model copy each)")
    use_gpu: bool = option(False, "one GPU per actor")
    cpus_per_actor: float = option(1.0, "CPUs (and torch threads) per actor")
    resources_per_actor: dict[str, float] = option(
        help="extra Ray resources per actor, e.g. ckray_infer=1: only nodes that advertise them take the actors "
             "(default: none)", default_factory=dict, parse=parse_resources, metavar="JSON|K=V[,K=V]")


def add_actor_pool_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The actor-pool flags of an index job (:class:`ActorPoolOptions`)."""
    return add_options(p, ActorPoolOptions)


def print_json(summary: dict) -> None:
    """Print a job's summary as one line of JSON."""
    print(json.dumps(summary, sort_keys=True))


def training_stage(name: str) -> TrainingStage:
    """The training stage of ranker ``name``; a ConfigError lists the rankers that train."""
    models = trainable()
    if name not in models:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(models)}")
    return models[name].training


def model_parser(name: str, description: str | None = None) -> argparse.ArgumentParser:
    """The full flag set of a model's training job: common flags, training data, loop, model."""
    from ckray.train_job import training_parser

    stage = training_stage(name)
    return stage.add_args(training_parser(description or f"train {name}", stage.defaults))


def check_training_flags(model: str, args: argparse.Namespace) -> None:
    """Refuse ``model``'s invalid training-loop flags (naming the flag) without doing anything: what its
    training stage checks first, for a caller that runs the stage later (the main job, before Ray)."""
    from ckray.train_job import training_config, training_data_config

    training_data_config(args)
    training_config(args, model, **training_stage(model).defaults)


def stage_parser(stage: str, description: str | None = None) -> argparse.ArgumentParser:
    """The parser of a stage's job: ``"train:<model>"`` (a ranker that trains) or ``"index:<model>"``
    (a ranker with an index). ``description``: the job's help text."""
    from ckray.cli import base_parser

    kind, _, model = stage.partition(":")
    if kind == "train":
        return model_parser(model, description)
    if kind == "index" and model in indexed():
        return indexed()[model].index.add_args(base_parser(description or f"{model} index"))
    raise ConfigError(f"unknown stage {stage!r}")


def parse_stage_args(stage: str, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` with a stage's job parser (see :func:`stage_parser`); unset flags get the job's
    defaults."""
    return stage_parser(stage).parse_args(argv)


def stage_args(stage: str, data: str | os.PathLike, workdir: str | os.PathLike, *,
               options: Mapping[str, Any] | None = None, loop: "TrainConfig | Mapping[str, Any] | None" = None,
               data_options: Mapping[str, Any] | None = None) -> argparse.Namespace:
    """The namespace a stage's job parser makes of ``--data data --workdir workdir``, with typed settings
    over its defaults, each by field name: ``options`` (the ranker's training options, or an index job's
    flags), ``loop`` (``TrainConfig`` fields, or a ``TrainConfig``: the fields that differ from
    ``TrainConfig()``'s) and ``data_options`` (``TrainingDataConfig`` fields). An unknown name is refused,
    listing the known ones. This is how ``ckray.api`` and the main job run a stage without a command line."""
    from ckray.train_job import DATA_DEST_PREFIX
    from ckray.training.flags import DEST_PREFIX

    args = parse_stage_args(stage, ["--data", str(data), "--workdir", str(workdir)])
    if loop is not None and not isinstance(loop, Mapping):
        base = type(loop)()
        loop = {f.name: getattr(loop, f.name) for f in dataclasses.fields(loop)
                if getattr(loop, f.name) != getattr(base, f.name)}
    values: dict[str, Any] = {}
    for kind, prefix, given in (("loop", DEST_PREFIX, loop), ("training-data", DATA_DEST_PREFIX, data_options),
                                ("", "", options)):
        named = {prefix + name: value for name, value in (given or {}).items()}
        unknown = sorted(name for name in given or {} if prefix + name not in vars(args))
        if unknown:
            known = sorted(dest[len(prefix):] for dest in vars(args) if dest.startswith(prefix) and (
                prefix or not dest.startswith((DEST_PREFIX, DATA_DEST_PREFIX)))
                and dest not in ("data", "workdir", "address", "log_level"))
            raise ConfigError(f"{stage}: unknown {kind + ' ' if kind else ''}option(s) {', '.join(unknown)}; "
                              f"known: {', '.join(known)}")
        values.update(named)
    vars(args).update(values)
    return args


def run_stage(stage: str, args: argparse.Namespace) -> Any:
    """Run a stage on its parsed flags: a training stage returns its TrainResult (and prints one line
    itself), an index stage prints its summary the way its job does and returns it."""
    kind, _, model = stage.partition(":")
    if kind == "train":
        return training_stage(model).train(args)
    index = indexed()[model].index
    summary = index.build(args)
    index.report(summary)
    return summary


def main_for(stage: str, description: str | None = None, argv: list[str] | None = None) -> None:
    """The whole of a stage's job script (``jobs/train_*.py``, ``jobs/build_*_index.py``): parse
    ``argv`` (default: the command line) with :func:`stage_parser`, then :func:`run_stage` under
    :func:`ckray.cli.run_job` (logging, ``--address``, a CkrayError ends the job with exit code 2).
    Exits the process."""
    from ckray.cli import run_job

    def main(args: argparse.Namespace) -> None:
        run_stage(stage, args)  # its result is not an exit code

    run_job(main, stage_parser(stage, description), argv)
