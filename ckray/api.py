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

import os
from typing import TYPE_CHECKING, Any, Mapping

from ckray.errors import ConfigError

if TYPE_CHECKING:
    from ckray.data.prepare import PreparedCollection
    from ckray.training import TrainConfig, TrainResult

PathLike = str | os.PathLike


def prepare(data: PathLike, workdir: PathLike, shards: int = 4, train_split: str | None = "train",
            threads: int = 2, negative_depth: int = 1000, max_shard_mb: int = 32) -> "PreparedCollection":
    """Shard ``data`` into ``workdir`` (at least ``shards`` shards of at most ``max_shard_mb`` MiB of the corpus
    file), build the BM25 index and the BM25 negatives of ``train_split``'s queries (None: none), as
    ``jobs/prepare.py``. Finished work is kept."""
    from ckray.data.prepare import prepare_collection

    return prepare_collection(data, workdir, shards=shards, split=train_split, threads=threads,
                              negative_depth=negative_depth, max_shard_mb=max_shard_mb)


def train(ranker: str, data: PathLike, workdir: PathLike, options: Any = None,
          loop: "TrainConfig | Mapping[str, Any] | None" = None, **data_options: Any) -> "TrainResult":
    """Train ``ranker`` (a registered name, e.g. ``"ck-qti"``) on ``data``'s training queries into
    ``workdir/checkpoints/<name>``, as its ``jobs/train_*.py`` does.

    ``options``: the ranker's typed training options (``spec.training.options``; None: its defaults).
    ``loop``: training-loop settings (``TrainConfig`` fields). ``data_options``: the training-data
    settings, ``TrainingDataConfig`` fields (``max_dev_queries=5``, ``split="train"``, …).
    A run already at its step count is not trained again."""
    from ckray.options import options_from_args
    from ckray.rankers import resolve
    from ckray.stages import stage_args, training_stage

    stage = training_stage(ranker)
    cls = resolve(stage.options)
    args = stage_args(f"train:{ranker}", data, workdir, data_options=data_options, loop=loop)
    if options is None:
        options = options_from_args(cls, args)
    elif not isinstance(options, cls):
        raise ConfigError(f"{ranker}: options must be a {cls.__name__}, got {type(options).__name__}")
    return stage.run(options, args)


def build_index(ranker: str, data: PathLike, workdir: PathLike, **options: Any) -> dict:
    """Build ``ranker``'s index in ``workdir`` (its ``jobs/build_*_index.py``); ``options``: the job's
    flags by destination (``top_k=64``, ``checkpoint=...``). Returns the job's summary."""
    from ckray.rankers import indexed
    from ckray.stages import stage_args

    if ranker not in indexed():
        raise ConfigError(f"ranker {ranker!r} has no index; rankers with one: {', '.join(indexed())}")
    return indexed()[ranker].index.build(stage_args(f"index:{ranker}", data, workdir, options=options))


def evaluate(pipelines: list[str] | str, data: PathLike, workdir: PathLike, split: str = "test", k: int = 1000,
             rerank_depth: int = 100, lam: float | None = None, hybrid_normalization: str | None = None,
             fusion_weight: float | None = None, weight_rule: str | None = None,
             rerank_passages: int | None = None,
             rerank_window_choice: str | None = None) -> dict[str, dict[str, float]]:
    """Run each named pipeline (``bm25``, ``ck-qti``, ``bm25>cedr-knrm``, ``clear+cedr-knrm`` …) on
    ``split``'s judged queries and evaluate it, as ``jobs/evaluate.py``: writes ``W/runs`` and
    ``W/metrics``; returns ``{pipeline: {measure: value}}``. ``lam`` / ``fusion_weight`` override
    CLEAR's λ_test and the ``w`` of ``first+reranker`` (tuned, or carried with the checkpoints), and
    ``hybrid_normalization`` the scores λ_test applies to (``"tmm"`` or ``"none"``);
    ``weight_rule`` is how a tuned ``w`` is chosen (``ckray.fusion.grid_search``: ``"one-se"``, the
    default, or ``"best"``); ``rerank_passages`` the windows of a long document a cross-encoder reads
    (0: every one, 1: the first; default ``ckray.rerank.DEFAULT_RERANK_PASSAGES``) and
    ``rerank_window_choice`` which of them (``"query"``, the default, or ``"first"``: ``ckray.windows``)."""
    from ckray.evaluation import EvaluateConfig, evaluate_pipelines

    names = [pipelines] if isinstance(pipelines, str) else list(pipelines)
    return evaluate_pipelines(EvaluateConfig(data=str(data), workdir=str(workdir), pipelines=names, split=split,
                                             k=k, rerank_depth=rerank_depth, lam=lam,
                                             hybrid_normalization=hybrid_normalization, fusion_weight=fusion_weight,
                                             **({"weight_rule": weight_rule} if weight_rule else {}),
                                             **({"rerank_passages": rerank_passages}
                                                if rerank_passages is not None else {}),
                                             **({"rerank_window_choice": rerank_window_choice}
                                                if rerank_window_choice is not None else {})))


def benchmark(data: list[PathLike], checkpoints: PathLike, pipelines: list[str] | str = "bm25",
              workdir_root: PathLike = "benchmark", **options: Any) -> dict:
    """Zero-shot evaluation of ``pipelines`` over the collections ``data`` with the checkpoints under
    ``checkpoints`` (a training ``W/checkpoints``), as ``jobs/benchmark.py``: a work directory per
    collection under ``workdir_root``, the table as benchmark.md/.json/.png there. ``options``:
    ``ckray.benchmark.BenchmarkConfig`` fields (``split``, ``rerank_depth``, ``index_options`` …).
    Returns the table (``{"measure", "collections", "rows": {pipeline: {collection: value, "mean"}}}``)."""
    from ckray.benchmark import BenchmarkConfig, run_benchmark

    names = [pipelines] if isinstance(pipelines, str) else list(pipelines)
    return run_benchmark(BenchmarkConfig(data=[str(d) for d in data], checkpoints=str(checkpoints),
                                         workdir_root=str(workdir_root), pipelines=names, **options))
