"""The ranker registry: every model ckray trains, indexes, reranks with, evaluates and serves.

Each ranker is one package (``ckray/rankers/<name>/``: its model, its training task, its stage code,
its index where it has one) exporting a :class:`RankerSpec` named ``SPEC``. The built-in rankers are
listed below, one line each; a plug-in adds its own with :func:`register`::

    from ckray.rankers import register
    register(MY_SPEC)            # then `jobs/evaluate.py --pipeline bm25>my-ranker` etc. know it

Pipelines (``ckray.pipelines``), evaluation, Serve, the main job and the jobs read only this
registry. Importing it is cheap: a spec names its code as ``"module:attribute"`` strings (or
callables), imported when used.
"""

from __future__ import annotations

import argparse
import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ckray.errors import ConfigError

# a callable, or "package.module:attribute" naming one (imported on first use)
Ref = str | Callable[..., Any]


def resolve(ref: Ref) -> Callable[..., Any]:
    """The callable ``ref`` names (``"module:attribute"``), or ``ref`` itself."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class FirstStage:
    """A retriever a ranker provides: ``factory(workdir, **options) -> Retriever`` (``search(queries, k)``).

    ``artifacts``: paths relative to the work directory its factory loads (Serve deploys it only when
    all exist; empty: Serve probes the factory). ``stamp_files``: the small JSON files, relative to the
    work directory, that identify its index (a stamp of an evaluation records their content).
    """

    factory: Ref
    artifacts: tuple[str, ...] = ()
    stamp_files: tuple[str, ...] = ()


@dataclass(frozen=True)
class TrainingStage:
    """How a ranker trains. ``options``: its typed training options (a dataclass whose fields declare
    its job's model flags, :mod:`ckray.options`); ``module`` defines ``train(options, args) ->
    TrainResult`` (``args``: the training data and loop flags); ``defaults``: the training-loop
    settings (``TrainConfig`` fields) it uses where the job's flag is not given, shown in ``--help``."""

    module: str
    options: Ref                          # the options dataclass, e.g. "ckray.rankers.ck_qti.options:CKQTIOptions"
    job: str                              # its command-line job, e.g. jobs/train_ck.py ("" for none)
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def add_args(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        from ckray.options import add_options

        return add_options(parser, resolve(self.options), f"model ({self.module.rpartition('.')[0]})")

    def train(self, args: argparse.Namespace) -> Any:
        from ckray.options import options_from_args

        return self.run(options_from_args(resolve(self.options), args), args)

    def run(self, options: Any, args: argparse.Namespace) -> Any:
        """Train with typed ``options`` (the training data and loop from ``args``)."""
        return resolve(f"{self.module}:train")(options, args)


@dataclass(frozen=True)
class IndexStage:
    """A ranker's index: ``module`` defines ``add_index_args(parser) -> parser``, ``build_index(args) ->
    summary`` and ``report(summary)`` (how the job prints it)."""

    module: str
    job: str                              # e.g. jobs/build_impact_index.py

    def add_args(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return resolve(f"{self.module}:add_index_args")(parser)

    def build(self, args: argparse.Namespace) -> dict:
        return resolve(f"{self.module}:build_index")(args)

    def report(self, summary: dict) -> None:
        resolve(f"{self.module}:report")(summary)


# The training-loop settings of a fine-tuned BERT-sized encoder (CLEAR; CEDR and QDS with batch size 4)
ENCODER_TRAIN_DEFAULTS: Mapping[str, Any] = {"lr": 2e-5, "max_steps": 500, "eval_every": 100, "batch_size": 8,
                                              "warmup_steps": 20}


@dataclass(frozen=True)
class RankerSpec:
    """Everything ckray knows of one ranker.

    ``name``: the model's key (``--models``, ``train:<name>`` stages) and its default checkpoint
    name. ``rerankers``: reranker name → checkpoint directory under ``W/checkpoints`` (an ablation may
    read another's checkpoint, e.g. ``ck-qti-unpruned`` → ``ck-qti``); each is a
    ``CheckpointReranker`` over the model's ``score_texts`` unless ``reranker_factories`` names its own
    factory, ``(checkpoint, workdir, doc_text, **options) -> Reranker``. ``rerank_over``: the first
    stages the main job reranks with this ranker's own checkpoint.
    """

    name: str
    title: str
    module: str | None = None             # a plug-in's importable module that registers it (Serve replicas import it)
    training: TrainingStage | None = None
    index: IndexStage | None = None
    first_stages: Mapping[str, FirstStage] = field(default_factory=dict)
    rerankers: Mapping[str, str] = field(default_factory=dict)
    reranker_factories: Mapping[str, Ref] = field(default_factory=dict)
    rerank_over: tuple[str, ...] = ("bm25",)


BM25 = RankerSpec(
    name="bm25", title="BM25 (Lucene, Pyserini)",
    first_stages={"bm25": FirstStage("ckray.lexical.bm25:bm25_retriever", artifacts=("bm25/index",),
                                     stamp_files=("bm25/index/ckray_index.json",))})

_REGISTRY: dict[str, RankerSpec] = {}
_BUILT_IN = (  # one line per ranker: the package exporting its SPEC
    "ckray.rankers.ck_qti",
    "ckray.rankers.clear",
    "ckray.rankers.cedr",
    "ckray.rankers.qds",
)
PLUGINS_ENV = "CKRAY_RANKERS"  # comma-separated modules that register() rankers: imported in every process


def register(spec: RankerSpec) -> RankerSpec:
    """Add ``spec`` to the registry (a plug-in's one line). Its names must be new: a first stage,
    reranker or model name another ranker has is refused. Returns ``spec``."""
    _load()
    _add(spec)
    return spec


def _add(spec: RankerSpec) -> None:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is spec:
        return
    taken = {"ranker": set(_REGISTRY), "first stage": set(first_stages()), "reranker": set(rerankers())}
    wanted = {"ranker": {spec.name}, "first stage": set(spec.first_stages), "reranker": set(spec.rerankers)}
    for kind, names in wanted.items():
        if clash := names & taken[kind]:
            raise ConfigError(f"ranker {spec.name!r}: {kind} {', '.join(sorted(clash))} is already registered")
    _REGISTRY[spec.name] = spec


def unregister(name: str) -> None:
    """Remove the plug-in ranker ``name`` (a built-in one cannot be removed)."""
    _load()
    if name == BM25.name or spec(name).module is None:
        raise ConfigError(f"ranker {name!r} is built in; only a plug-in can be unregistered")
    del _REGISTRY[name]


def plugin_modules() -> list[str]:
    """The modules of the registered plug-ins: what ``$CKRAY_RANKERS`` must name for another process
    (a Serve replica) to know them."""
    return [s.module for s in specs().values() if s.module]


_loaded = False


def _load() -> None:
    """Register the built-in rankers, then import the modules named in ``$CKRAY_RANKERS`` (so Ray
    workers and Serve replicas know the plug-ins their driver registered)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    _add(BM25)
    for module in _BUILT_IN:
        _add(importlib.import_module(module).SPEC)
    for module in filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(","))):
        importlib.import_module(module)


def specs() -> dict[str, RankerSpec]:
    """Every registered ranker by name, in registration order (BM25 first)."""
    _load()
    return dict(_REGISTRY)


def spec(name: str) -> RankerSpec:
    """The ranker ``name``; a ConfigError lists the known ones."""
    known = specs()
    if name not in known:
        raise ConfigError(f"unknown ranker {name!r}; known: {', '.join(known)}")
    return known[name]


def trainable() -> dict[str, RankerSpec]:
    """The rankers that train (have a :class:`TrainingStage`), in registration order."""
    return {n: s for n, s in specs().items() if s.training is not None}


def indexed() -> dict[str, RankerSpec]:
    """The rankers with an index job."""
    return {n: s for n, s in specs().items() if s.index is not None}


def first_stages() -> dict[str, FirstStage]:
    """Every first stage (retriever) by name."""
    _load()
    return {name: fs for s in _REGISTRY.values() for name, fs in s.first_stages.items()}


def rerankers() -> dict[str, str]:
    """Every reranker name → its checkpoint directory name under ``W/checkpoints``."""
    _load()
    return {name: ckpt for s in _REGISTRY.values() for name, ckpt in s.rerankers.items()}


def reranker_factory(name: str) -> Ref | None:
    """The reranker's own factory, or None (a ``CheckpointReranker`` over its ``score_texts``)."""
    for s in specs().values():
        if name in s.reranker_factories:
            return s.reranker_factories[name]
    return None


def first_stage_stamp_files(workdir: str | os.PathLike, name: str) -> list[Path]:
    """The files that identify first stage ``name``'s index in ``workdir``."""
    return [Path(workdir) / f for f in first_stages()[name].stamp_files]

