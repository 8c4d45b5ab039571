"""Reranking a first-stage run with any ``score_texts`` model: in process, or as Ray batch inference.

The model is anything with ``score_texts(queries: list[str], docs: list[str]) -> Tensor[B]`` that
``ckray.models.checkpoint.load_model`` rebuilds from a checkpoint directory (CEDR today,
QDS-Transformer later). Both entry points take the same inputs and give the same run:

* ``queries``: ``dict[qid, text]``;
* ``run``: the first stage, ``dict[qid, list[(doc_id, score)]]``;
* ``doc_text``: ``dict[doc_id, text]`` or a callable ``doc_id -> text`` (e.g. ``DocStore``);
* ``depth``: how many of each query's top first-stage documents the model rescores;
* ``windows`` (optional): ``(query, text) -> [(position, window text)]``, the windows of a document a model
  reads whole for a query (a ``CheckpointReranker`` reads up to ``passages`` windows of the word pieces its
  model reads, those matching the query best: ``ckray.windows``); each window is scored with the query and
  the document gets its best window's score (MaxP, Dai & Callan 2019). Without it a document is scored
  once, cut where the model cuts it.

The top ``depth`` documents of every query are replaced by the model's scores and sorted; the
documents below ``depth`` keep their first-stage order after them, with scores rewritten to lie
below the lowest reranked score (a run must stay sorted by score: evaluation tools sort by it).

``rerank`` builds one ``ray.data.Dataset`` of ``(qid, doc_id, passage, query, doc)`` rows and maps it with an
actor pool (``ckray.batch_inference``): each actor loads the checkpoint once and scores batches of
``batch_size`` pairs, on a GPU when ``num_gpus_per_actor`` is set (bf16 autocast there). Scores are
keyed by ``(qid, doc_id, passage)``: a pair scored twice (a batch retried after a lost actor) counts once, a
pair never scored is an error naming it.
``rerank_local`` scores in the calling process, for small inputs, tests and serving.
``CheckpointReranker`` wraps either behind the DESIGN contract ``rerank(queries, run, depth) -> run``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckray.errors import ConfigError
from ckray.fusion import Run, above_rest, best_first
from ckray.windows import DEFAULT_WINDOW_CHOICE, CandidateWindows, check_window_choice

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 30.0  # seconds between progress lines of a long in-process rerank
# windows of a long document a cross-encoder reads (CheckpointReranker.passages): 0 every one, 1 the first
# (the model's own truncation, as trained), N the first N. Chosen on held-out training queries (SciFact's and
# a long-document collection's, docs/transfer.md); capped because each window costs a forward pass per query
# at query time, where an index reads a document once.
DEFAULT_RERANK_PASSAGES = 4

DocText = Mapping[str, str] | Callable[[str], str]
Windows = Callable[[str, str], list[tuple[int, str]]]   # (query, text) -> [(position, window)]


def _lookup(doc_text: DocText) -> Callable[[str], str]:
    if callable(doc_text) and not isinstance(doc_text, Mapping):
        return doc_text

    def get(doc_id: str) -> str:
        try:
            return doc_text[doc_id]
        except KeyError:
            raise KeyError(f"no text for document {doc_id!r} in the doc-text lookup") from None

    return get


def rerank_candidates(queries: Mapping[str, str], run: Run, depth: int) -> dict[str, list[str]]:
    """Each query's top ``depth`` document ids of ``run`` (by score, as strings), checked against ``queries``."""
    if depth < 0:
        raise ValueError("depth must be >= 0")
    out = {}
    for qid, docs in run.items():
        if qid not in queries:
            raise KeyError(f"query {qid!r} is in the run but not in queries")
        out[qid] = [str(doc_id) for doc_id, _ in best_first(docs)[:depth]]
    return out


def rerank_pairs(queries: Mapping[str, str], run: Run, doc_text: DocText, depth: int,
                 sort_by_length: bool = True, windows: Windows | None = None) -> list[dict[str, Any]]:
    """The ``(qid, doc_id, passage, query, doc)`` rows to score: each query's top ``depth`` documents,
    each whole (``passage`` 0) or, with ``windows``, as the windows it reads for the query (``passage``:
    the window's position in the document).

    With ``sort_by_length`` rows are ordered by text length so batches hold pairs of similar length
    (less padding; scores do not depend on the batch).
    """
    lookup = _lookup(doc_text)
    texts: dict[str, str] = {}   # a document's text, read once for all the queries it is a candidate of

    def passages(query: str, doc_id: str) -> list[tuple[int, str]]:
        if doc_id not in texts:
            texts[doc_id] = lookup(doc_id)
        return windows(query, texts[doc_id]) if windows else [(0, texts[doc_id])]

    rows = [{"qid": str(qid), "doc_id": doc_id, "passage": p, "query": queries[qid], "doc": part}
            for qid, doc_ids in rerank_candidates(queries, run, depth).items() for doc_id in doc_ids
            for p, part in passages(queries[qid], doc_id)]
    if sort_by_length:
        rows.sort(key=lambda r: len(r["query"]) + len(r["doc"]))
    return rows


def best_passages(scores: Mapping[tuple[str, str, int], float]) -> dict[tuple[str, str], float]:
    """Each ``(qid, doc_id)``'s score from its windows' ``(qid, doc_id, passage)`` scores: the best one
    (MaxP, Dai & Callan 2019). A document scored whole has one window."""
    out: dict[tuple[str, str], float] = {}
    for (qid, doc_id, _), score in scores.items():
        out[(qid, doc_id)] = max(out.get((qid, doc_id), -math.inf), score)
    return out


def merge_scores(run: Run, scores: Mapping[tuple[str, str], float], depth: int) -> Run:
    """Top ``depth`` of each query rescored and sorted; the rest kept after them, in their order."""
    out: Run = {}
    for qid, docs in run.items():
        docs = best_first(docs)
        out[qid] = above_rest(((d, float(scores[(str(qid), str(d))])) for d, _ in docs[:depth]), docs[depth:])
    return out


def _score_rows(model: Any, rows: list[dict[str, Any]], batch_size: int) -> dict[tuple[str, str, int], float]:
    """Score every row in batches; logs pairs/s and an ETA every ``PROGRESS_EVERY_S`` seconds."""
    import torch

    scores: dict[tuple[str, str, int], float] = {}
    start = last = time.perf_counter()
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        s = model.score_texts([r["query"] for r in chunk], [r["doc"] for r in chunk])
        for r, v in zip(chunk, torch.as_tensor(s).float().tolist()):
            scores[(r["qid"], r["doc_id"], r["passage"])] = v
        now = time.perf_counter()
        if now - last >= PROGRESS_EVERY_S:
            done, rate = i + len(chunk), (i + len(chunk)) / (now - start)
            log.info("reranked %d/%d pairs (%.1f pairs/s, eta %.0f s)", done, len(rows), rate,
                     (len(rows) - done) / rate)
            last = now
    return scores


def rerank_local(model: Any, queries: Mapping[str, str], run: Run, doc_text: DocText,
                 depth: int = 100, batch_size: int = 16, windows: Windows | None = None) -> Run:
    """Rerank in this process with an already-loaded model (call ``model.eval()`` first)."""
    rows = rerank_pairs(queries, run, doc_text, depth, windows=windows)
    return merge_scores(run, best_passages(_score_rows(model, rows, batch_size)), depth)


class PairScorer:
    """A Ray Data actor: loads the checkpoint once, then scores batches of (query, doc) rows."""

    def __init__(self, model_path: str, use_gpu: bool = False, torch_threads: int = 0,
                 statistics: Any = None):
        from ckray.batch_inference import actor_device
        from ckray.models.checkpoint import load_model

        self.device = actor_device(use_gpu, torch_threads)
        model = load_model(model_path, map_location="cpu")
        if statistics is not None:  # the collection statistics of the corpus being reranked
            model.set_collection_statistics(statistics)
        self.model = model.to(self.device).eval()

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        queries = [str(x) for x in batch["query"]]
        docs = [str(x) for x in batch["doc"]]
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            scores = self.model.score_texts(queries, docs)
        return {"qid": batch["qid"], "doc_id": batch["doc_id"], "passage": batch["passage"],
                "score": torch.as_tensor(scores).float().cpu().numpy().astype(np.float64)}


def rerank(model_path: str | os.PathLike, queries: Mapping[str, str], run: Run, doc_text: DocText,
           depth: int = 100, *, batch_size: int = 16, num_actors: int = 1,
           num_cpus_per_actor: float = 1.0, num_gpus_per_actor: float | None = None,
           statistics: Any = None, windows: Windows | None = None) -> Run:
    """Rerank as Ray batch inference: ``Dataset`` of pairs → ``map_batches`` on an actor pool.

    Uses the running Ray cluster (or starts a local one). ``num_gpus_per_actor`` (e.g. 1 or 0.5)
    places each actor on a GPU; without it the actors score on CPUs with ``num_cpus_per_actor`` threads.
    ``statistics``: the collection statistics (``ckray.data.statistics.CorpusStats``) of the corpus being
    reranked, given to each actor's model (``set_collection_statistics``) when the model reads any.
    ``windows``: how a long document is cut (module docstring), in this process, before the rows ship.
    """
    import ray.data

    from ckray.batch_inference import (ActorPoolConfig, KeyedRows, ckray_errors_surfaced, ensure_ray, map_on_actors,
                                       raise_if_missing)
    from ckray.models.checkpoint import verify_checkpoint

    rows = rerank_pairs(queries, run, doc_text, depth, windows=windows)
    if not rows:
        return merge_scores(run, {}, depth)
    verify_checkpoint(model_path)   # here, not in each actor's creation (Ray would report it as a dead actor)
    ensure_ray()
    pool = ActorPoolConfig(actors=num_actors, use_gpu=bool(num_gpus_per_actor), cpus_per_actor=num_cpus_per_actor,
                           batch_size=batch_size, gpus_per_actor=num_gpus_per_actor or 1.0)
    n_blocks = max(1, min(len(rows) // max(1, batch_size), 4 * num_actors))
    ds = ray.data.from_items(rows, override_num_blocks=n_blocks)
    scored = map_on_actors(ds, PairScorer, {"model_path": str(model_path), "use_gpu": pool.use_gpu,
                                            "torch_threads": pool.torch_threads, "statistics": statistics}, pool)
    scores = KeyedRows(((r["qid"], r["doc_id"], r["passage"]) for r in rows), "Ray reranking")
    with ckray_errors_surfaced():  # a CkrayError in an actor ends the job with its own one line
        for batch in scored.iter_batches(batch_size=None, batch_format="numpy"):
            for qid, doc_id, passage, score in zip(batch["qid"], batch["doc_id"], batch["passage"], batch["score"]):
                scores.add((str(qid), str(doc_id), int(passage)), float(score))
    raise_if_missing([scores], "Ray reranking", "re-run it")
    return merge_scores(run, best_passages(scores.rows), depth)


@dataclass
class CheckpointReranker:
    """A reranker over a checkpoint directory with the DESIGN contract ``rerank(queries, run, depth)``.

    ``use_ray=False`` loads the model once in this process (serving, small runs); ``use_ray=True``
    runs every call as Ray batch inference on an actor pool (``rerank``). A model that reads collection
    statistics (the QDS-Transformer's IDF-weighted MaxSim head) reads those of ``workdir``'s corpus, the
    one being reranked, not its training collection's (``ckray.data.statistics``). ``passages``: how
    much of a document longer than the model reads (its ``document_pieces``) is scored: 0 every window
    of that many word pieces, a quarter of each shared with the next (``ckray.models.encoders.text_windows``),
    the document scoring as its best window; 1 the first window, cut where the model cuts it (as
    trained); N windows of those, chosen by ``window_choice`` (``ckray.windows``): ``"query"`` the N
    matching the query best, weighted by the IDF of ``workdir``'s corpus (the first N without a corpus to
    count), ``"first"`` the first N.
    """

    model_path: str
    doc_text: DocText
    workdir: str | None = None
    passages: int = DEFAULT_RERANK_PASSAGES
    window_choice: str = DEFAULT_WINDOW_CHOICE
    batch_size: int = 16
    use_ray: bool = False
    num_actors: int = 1
    num_cpus_per_actor: float = 1.0
    num_gpus_per_actor: float | None = None
    _model: Any = field(default=None, init=False, repr=False)
    _statistics: Any = field(default=None, init=False, repr=False)
    _windows: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.passages < 0:
            raise ConfigError.invalid("CheckpointReranker", "passages",
                                      f"must be >= 0 (0: every window of a document), got {self.passages}")
        check_window_choice("CheckpointReranker", self.window_choice)

    @property
    def model(self) -> Any:
        if self._model is None:
            from ckray.data.statistics import collection_statistics_for
            from ckray.device import default_device
            from ckray.models.checkpoint import load_model

            model = load_model(self.model_path)
            self._statistics = collection_statistics_for(model, self.workdir)
            if self._statistics is not None:
                model.set_collection_statistics(self._statistics)
            self._model = model.to(default_device()).eval()
        return self._model

    def windows(self) -> Windows | None:
        """The windows of a candidate the model reads for a query (``passages``, ``window_choice``): None,
        the text whole and the model cutting it, at ``passages`` 1 or for a model that does not say how
        much it reads."""
        pieces = getattr(self.model, "document_pieces", None)
        if self.passages == 1 or pieces is None:
            return None
        if self._windows is None:
            choice = self.window_choice if self.passages else "first"   # every window is read: nothing to choose
            idf = self._window_idf(pieces) if choice == "query" else None
            if choice == "query" and idf is None:
                log.warning("%s: no corpus in %s to weigh the query's word pieces by; a long document's "
                            "first %d windows are read", self.model_path, self.workdir, self.passages)
                choice = "first"
            self._windows = CandidateWindows(self.model.tokenizer, pieces, self.passages, choice, idf)
        return self._windows

    def _window_idf(self, pieces: int) -> np.ndarray | None:
        """The IDF of each word piece in ``workdir``'s corpus, tokenised as the model reads it (None without
        a corpus): what weighs a query's word pieces in a candidate's windows."""
        from ckray.data.statistics import Tokenisation, workdir_statistics

        config = self.model.config
        name = getattr(config, "tokenizer", None) or config.encoder
        stats = workdir_statistics(self.workdir, Tokenisation(name, len(self.model.tokenizer), pieces))
        return None if stats is None else stats.idf.numpy()

    @property
    def settings(self) -> dict:
        """The windows of a long document read, and the collection statistics the model reads when it
        reads any (what an evaluation records)."""
        from ckray.data.statistics import statistics_stamp

        out = {"reranker_passages": self.passages}
        windows = self.windows()
        if windows is not None and self.passages:
            out["reranker_window_choice"] = windows.choice
        if self.model is not None and self._statistics is not None:
            out["reranker_collection_statistics"] = statistics_stamp(self.workdir, self._statistics)
        return out

    def rerank(self, queries: Mapping[str, str], run: Run, depth: int = 100) -> Run:
        if self.use_ray:
            return rerank(self.model_path, queries, run, self.doc_text, depth, batch_size=self.batch_size,
                          num_actors=self.num_actors, num_cpus_per_actor=self.num_cpus_per_actor,
                          num_gpus_per_actor=self.num_gpus_per_actor,
                          statistics=self._statistics if self.model is not None else None,
                          windows=self.windows())
        return rerank_local(self.model, queries, run, self.doc_text, depth, self.batch_size, windows=self.windows())
