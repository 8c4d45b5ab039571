"""The Python API: prepare a collection, train a ranker, build its index, evaluate pipelines.

Each call runs the very code of its job (``jobs/*.py`` are these calls behind a command line), with
typed options instead of flags::

    from ckray import api
    from ckray.rankers.ck_qti.options import CKQTIOptions

    api.prepare("data/scifact", "W")
    result = api.train("ck-qti", "data/scifact", "W", options=CKQTIOptions(layers=1),
                       loop={"max_steps": 200, "workers": 2})
    api.build_index("ck-qti", "data/scifact", "W", top_k=64)
    metrics = api.evaluate(["bm25", "ck-qti", "bm25>ck-qti"], "data/scifact", "W", split="test")

Rankers come from the registry (``ckray.rankers``), so a registered plug-in trains, indexes and
evaluates through the same calls. Ray starts on first use (``$RAY_ADDRESS`` or a local one).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import TYPE_CHECKING, Any, Mapping

from ckray.errors import ConfigError

if TYPE_CHECKING:
    from ckray.data.prepare import PreparedCollection
    from ckray.training import TrainConfig, TrainResult

PathLike = str | os.PathLike


def prepare(data: PathLike, workdir: PathLike, shards: int = 4, train_split: str | None = "train",
            threads: int = 2, negative_depth: int = 1000) -> "PreparedCollection":
    """Shard ``data`` into ``workdir``, build the BM25 index and the BM25 negatives of ``train_split``'s
    queries (None: none), as ``jobs/prepare.py``. Finished work is kept."""
    from ckray.data.prepare import prepare_collection

    return prepare_collection(data, workdir, shards=shards, split=train_split, threads=threads,
                              negative_depth=negative_depth)


def _job_args(stage: str, data: PathLike, workdir: PathLike, flags: Mapping[str, Any]) -> argparse.Namespace:
    """The namespace the stage's job parser makes of ``--data data --workdir workdir``, with ``flags``
    (destination → value) over its defaults; an unknown name is refused, listing the known ones."""
    from ckray.stages import parse_stage_args

    args = parse_stage_args(stage, ["--data", str(data), "--workdir", str(workdir)])
    unknown = sorted(set(flags) - set(vars(args)))
    if unknown:
        raise ConfigError(f"{stage}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(vars(args)))}")
    vars(args).update(flags)
    return args


def _loop_flags(loop: "TrainConfig | Mapping[str, Any] | None") -> dict[str, Any]:
    """Training-loop settings as the job's ``train_<field>`` destinations. A mapping sets the fields it
    names; a ``TrainConfig`` sets the fields that differ from ``TrainConfig()``'s (the others keep the
    ranker's own defaults, e.g. CK-QTI's learning rate)."""
    if loop is None:
        return {}
    if not isinstance(loop, Mapping):
        base = type(loop)()
        loop = {f.name: getattr(loop, f.name) for f in dataclasses.fields(loop)
                if getattr(loop, f.name) != getattr(base, f.name)}
    return {f"train_{name}": value for name, value in loop.items()}


def train(ranker: str, data: PathLike, workdir: PathLike, options: Any = None,
          loop: "TrainConfig | Mapping[str, Any] | None" = None, **data_options: Any) -> "TrainResult":
    """Train ``ranker`` (a registered name, e.g. ``"ck-qti"``) on ``data``'s training queries into
    ``workdir/checkpoints/<name>``, as its ``jobs/train_*.py`` does.

    ``options``: the ranker's typed training options (``spec.training.options``; None: its defaults).
    ``loop``: training-loop settings (``TrainConfig`` fields). ``data_options``: the training-data
    settings of the job's flags by destination (``max_dev_queries=5``, ``data_split="train"``, …).
    A run already at its step count is not trained again."""
    from ckray.options import options_from_args
    from ckray.rankers import resolve
    from ckray.stages import training_stage

    stage = training_stage(ranker)
    cls = resolve(stage.options)
    args = _job_args(f"train:{ranker}", data, workdir, {**data_options, **_loop_flags(loop)})
    if options is None:
        options = options_from_args(cls, args)
    elif not isinstance(options, cls):
        raise ConfigError(f"{ranker}: options must be a {cls.__name__}, got {type(options).__name__}")
    return stage.run(options, args)


def build_index(ranker: str, data: PathLike, workdir: PathLike, **options: Any) -> dict:
    """Build ``ranker``'s index in ``workdir`` (its ``jobs/build_*_index.py``); ``options``: the job's
    flags by destination (``top_k=64``, ``checkpoint=...``). Returns the job's summary."""
    from ckray.rankers import indexed

    if ranker not in indexed():
        raise ConfigError(f"ranker {ranker!r} has no index; rankers with one: {', '.join(indexed())}")
    return indexed()[ranker].index.build(_job_args(f"index:{ranker}", data, workdir, options))


def evaluate(pipelines: list[str] | str, data: PathLike, workdir: PathLike, split: str = "test", k: int = 1000,
             rerank_depth: int = 100, lam: float | None = None,
             fusion_weight: float | None = None) -> dict[str, dict[str, float]]:
    """Run each named pipeline (``bm25``, ``ck-qti``, ``bm25>cedr-knrm``, ``clear+cedr-knrm`` …) on
    ``split``'s judged queries and evaluate it, as ``jobs/evaluate.py``: writes ``W/runs`` and
    ``W/metrics``; returns ``{pipeline: {measure: value}}``. ``lam`` / ``fusion_weight`` override
    CLEAR's λ_test and the ``w`` of ``first+reranker`` (tuned, or carried with the checkpoints)."""
    from ckray.evaluation import EvaluateConfig, evaluate_pipelines

    names = [pipelines] if isinstance(pipelines, str) else list(pipelines)
    return evaluate_pipelines(EvaluateConfig(data=str(data), workdir=str(workdir), pipelines=names, split=split,
                                             k=k, rerank_depth=rerank_depth, lam=lam, fusion_weight=fusion_weight))
