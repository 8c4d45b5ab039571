"""Named retrieval pipelines, shared by ``jobs/evaluate.py`` and ``ckray/serve.py`` so offline and
online results agree by construction.

A pipeline name is ``<first stage>[><reranker>]``: ``bm25``, ``clear``, ``ck-qti``,
``bm25>cedr-knrm``, ``clear>cedr-knrm``, ``bm25>qds`` … ``ck-qti-rerank`` is an alias of
``bm25>ck-qti``. ``<first stage>+<reranker>`` reranks the same way and then adds the first stage's
score back, ``z(s_rerank) + w·z(s_first)`` with ``w`` tuned on dev queries (``ckray.fusion``). A first stage is a retriever with ``search(queries, k) -> run``; a reranker is a
trained checkpoint ``W/checkpoints/<name>`` whose model has ``score_texts(queries, docs)``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ckray import rankers
from ckray.errors import ConfigError
from ckray.workdir import WorkDir
from ckray.fusion import Run, interpolate, load_interpolation

log = logging.getLogger(__name__)

ALIASES = {"ck-qti-rerank": "bm25>ck-qti", "ck-rerank": "bm25>ck"}

# First stages and rerankers come from the ranker registry (``ckray.rankers``): each ranker's spec
# names its first stages (factory ``(workdir, **options) -> Retriever``) and its rerankers (checkpoint
# directory under W/checkpoints; a CheckpointReranker over the model's ``score_texts`` unless the spec
# names the reranker's own factory ``(checkpoint, workdir, doc_text, **options) -> Reranker``).


def served_by_default(name: str) -> bool:
    """A reranker of its own checkpoint (not an ablation reading another's, like ``ck-qti-unpruned``)."""
    return rankers.rerankers()[name] == name


class Retriever(Protocol):
    def search(self, queries: dict[str, str], k: int) -> Run: ...


class Reranker(Protocol):
    def rerank(self, queries: dict[str, str], run: Run, depth: int) -> Run: ...


def parse_pipeline(name: str) -> tuple[str, str | None]:
    """``(first stage, reranker or None)`` of ``first``, ``first>reranker`` or ``first+reranker``."""
    name = ALIASES.get(name.strip(), name.strip())
    sep = "+" if "+" in name else ">"
    first, _, reranker = name.partition(sep)
    first, reranker = first.strip(), (reranker.strip() or None)
    if sep == "+" and reranker is None:
        raise ConfigError(f"pipeline {name!r}: '+' needs a reranker after it (e.g. bm25+cedr-knrm)")
    if first not in rankers.first_stages():
        raise ConfigError(f"unknown first stage {first!r} in pipeline {name!r}; "
                          f"known: {', '.join(sorted(rankers.first_stages()))}")
    if reranker is not None and reranker not in rankers.rerankers():
        raise ConfigError(f"unknown reranker {reranker!r} in pipeline {name!r}; "
                          f"known: {', '.join(sorted(rankers.rerankers()))}")
    return first, reranker


def build_retriever(name: str, workdir: str | os.PathLike, **options) -> Retriever:
    known = rankers.first_stages()
    if name not in known:
        raise ConfigError(f"unknown retriever {name!r}; known: {', '.join(sorted(known))}")
    return rankers.resolve(known[name].factory)(workdir, **options)


def is_interpolated(name: str) -> bool:
    """``first+reranker``: the reranker's score interpolated with the first stage's (``ckray.fusion``)."""
    return "+" in ALIASES.get(name.strip(), name.strip())


def checkpoint_dir(workdir: str | os.PathLike, reranker: str) -> Path:
    return WorkDir(workdir).checkpoint(rankers.rerankers()[reranker])


def first_stage_files(workdir: str | os.PathLike, first: str) -> list[Path]:
    """The small files that identify a first stage's index (each names the shards/checkpoint it came from)."""
    return rankers.first_stage_stamp_files(workdir, first)


def artifact_content(path: Path):
    """A JSON artifact as a stamp records it (None when absent); hybrid.json's ``tuned`` (the λ grid's
    dev scores) is dropped: a record of how λ was chosen, not an input of the results."""
    if not path.exists():
        return None
    obj = json.loads(path.read_text())
    if isinstance(obj, dict):
        obj.pop("tuned", None)
    return obj


def first_stage_fingerprint(workdir: str | os.PathLike, first: str) -> dict:
    """``{file relative to W: content}`` of :func:`first_stage_files`: changes when the first stage's
    index is rebuilt from other shards or another checkpoint, or its λ is re-tuned."""
    workdir = Path(workdir)
    return {str(f.relative_to(workdir)): artifact_content(f) for f in first_stage_files(workdir, first)}


def first_stage_models(workdir: str | os.PathLike, first: str) -> list[str]:
    """The digests (``checkpoint_sha256``) of the models the first stage's index was built with, sorted;
    empty for a first stage without one (BM25). Unlike :func:`first_stage_digest` it does not depend on
    the collection, so a weight carried to another collection can say which model it was tuned over."""
    return sorted({content["checkpoint_sha256"] for content in first_stage_fingerprint(workdir, first).values()
                   if isinstance(content, dict) and content.get("checkpoint_sha256")})


def first_stage_digest(workdir: str | os.PathLike, first: str) -> str:
    """sha256 of :func:`first_stage_fingerprint`: what a weight tuned on this first stage records."""
    import hashlib

    return hashlib.sha256(json.dumps(first_stage_fingerprint(workdir, first), sort_keys=True,
                                     default=str).encode()).hexdigest()


def reranker_passages(name: str, passages: int) -> int:
    """The windows of a long document reranker ``name`` reads when asked for ``passages``: those for a
    cross-encoder (``ckray.rerank.CheckpointReranker``); 1 for a reranker with its own factory (CK-QTI's
    reads the impacts its index stored, windowed when the index was built)."""
    return 1 if rankers.reranker_factory(name) is not None else passages


def reranker_window_choice(name: str, passages: int, choice: str) -> str:
    """Which windows of a long document reranker ``name`` reads when asked for ``passages`` chosen by
    ``choice`` (``ckray.windows``): ``choice`` when some windows are chosen among more, ``"first"`` when none
    are (one window, every window, or a reranker with its own factory)."""
    return choice if reranker_passages(name, passages) not in (0, 1) else "first"


def build_reranker(name: str, workdir: str | os.PathLike, passages: int | None = None,
                   window_choice: str | None = None, **options) -> Reranker:
    """Reranker ``name`` over ``W/checkpoints/<name>``; ``passages`` and ``window_choice``: the windows of a
    long document a cross-encoder reads (``CheckpointReranker``; None: its default)."""
    if name not in rankers.rerankers():
        raise ConfigError(f"unknown reranker {name!r}; known: {', '.join(sorted(rankers.rerankers()))}")
    from ckray.data.shards import DocStore
    from ckray.models.checkpoint import read_checkpoint_config
    from ckray.rerank import CheckpointReranker

    path = checkpoint_dir(workdir, name)
    read_checkpoint_config(path)  # a clear error now, not at the first query
    factory = rankers.reranker_factory(name)
    if factory is not None:
        return rankers.resolve(factory)(path, workdir, DocStore(workdir).text, **options)
    if passages is not None:
        options["passages"] = passages
    if window_choice is not None:
        options["window_choice"] = window_choice
    return CheckpointReranker(str(path), doc_text=DocStore(workdir).text, workdir=str(workdir), **options)


@dataclass
class Pipeline:
    """First stage, then (optionally) a reranker over its top ``rerank_depth``; with
    ``interpolation_weight`` w the final score is ``z(s_rerank) + w·z(s_first)`` (``ckray.fusion``)."""

    name: str
    retriever: Retriever
    reranker: Reranker | None = None
    rerank_depth: int = 100
    interpolation_weight: float | None = None
    timings: dict = field(default_factory=dict)

    def run(self, queries: dict[str, str], k: int = 1000) -> Run:
        t0 = time.perf_counter()
        run = self.retriever.search(queries, k=max(k, self.rerank_depth if self.reranker else 0))
        t1 = time.perf_counter()
        if self.reranker is not None:
            first = run
            run = self.reranker.rerank(queries, first, depth=self.rerank_depth)
            if self.interpolation_weight is not None:
                run = interpolate(first, run, self.rerank_depth, self.interpolation_weight)
        t2 = time.perf_counter()
        self.timings = {"first_stage_s": t1 - t0, "rerank_s": t2 - t1}
        return {q: docs[:k] for q, docs in run.items()}


def build_pipeline(name: str, workdir: str | os.PathLike, rerank_depth: int = 100,
                   retriever_options: dict | None = None, reranker_options: dict | None = None,
                   interpolation_weight: float | None = None) -> Pipeline:
    """A pipeline by name. ``first+reranker`` reads its tuned weight from ``W/fusion`` unless
    ``interpolation_weight`` is given (``ckray.evaluation.tune_interpolation`` writes it)."""
    first, reranker = parse_pipeline(name)
    if is_interpolated(name) and interpolation_weight is None:
        interpolation_weight = load_interpolation(workdir, first, reranker).weight
    return Pipeline(name=name, retriever=build_retriever(first, workdir, **(retriever_options or {})),
                    reranker=build_reranker(reranker, workdir, **(reranker_options or {})) if reranker else None,
                    rerank_depth=rerank_depth,
                    interpolation_weight=interpolation_weight if is_interpolated(name) else None)
