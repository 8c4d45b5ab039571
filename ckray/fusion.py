"""Runs and their fusion: the ``Run`` type and every way ckray combines scores or rankings.

A run is ``dict[query_id, list[(doc_id, score)]]``, best first (DESIGN.md, "Runs"). Combining:

* **Reciprocal-rank fusion** of several first stages (:func:`reciprocal_rank_fusion`,
  :class:`FusedRetriever`; what ``ckray.serve`` does with ``"retrievers": [a, b, …]``)::

      s(d) = Σ_lists 1 / (rrf_k + rank(d))

* **Interpolating a reranker with its first stage** (``first+reranker`` pipelines, :func:`interpolate`).
  A reranker trained on a few hundred queries throws away what the first stage knew; adding the two
  scores back together is the standard remedy (e.g. Nogueira & Cho's BM25 + BERT interpolation).
  Over each query's top ``depth`` first-stage documents::

      s(q, d) = z(s_rerank(q, d)) + w · z(s_first(q, d))

  where ``z`` standardises a query's scores (mean 0, standard deviation 1 over its top ``depth``), so
  one weight fits first stages and rerankers whose score scales differ. ``w`` is chosen (by the
  one-standard-error rule below) on the *dev* queries — training queries held back from the
  reranker's training by the same stable hash (``ckray.data.examples.is_dev_query``) — never on
  test queries, and saved to
  ``W/fusion/<first>+<reranker>.json`` so evaluation and serving use the same weight. It is also
  saved with the reranker's checkpoint (``ckray.deploy``), and a collection with no training queries
  uses that one (``ckray.evaluation.ensure_interpolation``).

* **A linear combination of two scores per (query, document)** (:func:`linear_fusion`): CLEAR's
  Eq. 8 hybrid, ``s = λ · s_lex + s_emb`` (``ckray.rankers.clear.hybrid``), on the raw scores
  (``"none"``, the paper's) or on scores normalised per query by their theoretical minimum and the
  query's maximum (``"tmm"``; Bruch, Gai & Ingber 2023, *An Analysis of Fusion Functions for Hybrid
  Retrieval*, TOIS 42(1), §4: ``φ(s) = (s − m) / (M_q − m)`` with ``m`` = 0 for BM25 and −1 for a
  cosine). A BM25 score grows with the query's length and the collection's IDF while a cosine does
  not, so a raw λ chosen on one collection weighs BM25 differently on another; after ``φ`` both
  sides lie in [0, 1] with the query's best document at 1. ``"none"`` stays the default: a trained
  CLEAR's dense score is the residual of *raw* BM25 (its margin subtracts ``λ_train · Δs_lex``), and
  measured on SciFact and CACM it ranks better on raw scores; ``"tmm"`` helps an untrained encoder's
  hybrid, and serves a CLEAR trained on normalised BM25 (``--bm25-scale query-max``,
  ``ckray.rankers.clear.hybrid.trained_normalization``) (docs/transfer.md).

Weights (``w`` above, CLEAR's λ_test) are chosen by one grid search, :func:`grid_search`, by one of
two rules:

* ``"best"``: the grid value whose fused run has the best nDCG@10 on the judged queries, ties to the
  smaller value (CLEAR's λ_test: Eq. 8's λ is part of the model the dense side was trained against).
* ``"one-se"`` (``w``'s default): the one-standard-error rule (Breiman et al. 1984; Hastie, Tibshirani &
  Friedman, *Elements of Statistical Learning*, §7.10): the *largest* grid value — the most weight on
  the untrained first stage — whose nDCG@10 is within one standard error of the best's, the error
  taken over the queries' paired differences ``nDCG_q(w) − nDCG_q(w_best)``. A hundred dev queries
  cannot tell apart the weights on a flat curve's top, and the argmax among them is noise; of those
  the rule keeps the one that leans most on the stage that needs no training, which is what carries
  to a collection the reranker never saw.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckray.errors import ConfigError, MissingArtifactError
from ckray.workdir import WorkDir

log = logging.getLogger(__name__)

Hits = list[tuple[str, float]]
Run = dict[str, Hits]
Candidates = dict[str, dict[str, tuple[float, float]]]   # qid → doc_id → (s_a, s_b)

DEFAULT_WEIGHT_GRID: tuple[float, ...] = tuple(round(0.1 * i, 2) for i in range(0, 31))  # 0.0 … 3.0
RRF_K = 60   # the constant of reciprocal-rank fusion (Cormack et al., 2009)


# ============================================================================ runs

def best_first(hits: Iterable[tuple[str, float]]) -> Hits:
    """``hits`` sorted by score, best first; stable (tied documents keep their order)."""
    return sorted(hits, key=lambda h: -float(h[1]))


def above_rest(top: Iterable[tuple[str, float]], rest: Sequence[tuple[str, float]]) -> Hits:
    """``top`` (rescored) best first, then ``rest`` in its given order with scores rewritten to lie
    below ``top``'s lowest (``floor − 1 − i``): a run must stay sorted by score (evaluation tools
    sort by it)."""
    top = best_first(top)
    floor = top[-1][1] if top else 0.0
    return top + [(d, floor - 1.0 - i) for i, (d, _) in enumerate(rest)]


# ============================================================================ reciprocal-rank fusion

def reciprocal_rank_fusion(lists: Sequence[Hits], k: int, rrf_k: int = RRF_K) -> Hits:
    """Fuse ranked lists: ``score(d) = Σ_lists 1 / (rrf_k + rank(d))`` (ranks from 1, each list in its
    own best-first order); the top ``k``, best first, ties broken by doc id."""
    scores: dict[str, float] = {}
    for hits in lists:
        for rank, (doc_id, _) in enumerate(best_first(hits), start=1):
            scores[doc_id] = scores.get(doc_id, 0.0) + 1.0 / (rrf_k + rank)
    return sorted(scores.items(), key=lambda x: (-x[1], x[0]))[:k]


class FusedRetriever:
    """Reciprocal-rank fusion of several retrievers as one offline ``Retriever``: each searched to
    depth ``k``, fused, top ``k`` kept (what the HTTP API does with ``"retrievers": [a, b, …]``)."""

    def __init__(self, retrievers: Sequence[Any], rrf_k: int = RRF_K):
        if not retrievers:
            raise ConfigError("FusedRetriever needs at least one retriever")
        self.retrievers, self.rrf_k = list(retrievers), rrf_k

    def search(self, queries: dict[str, str], k: int = 1000) -> Run:
        runs = [r.search(queries, k) for r in self.retrievers]
        return {q: reciprocal_rank_fusion([run.get(q, []) for run in runs], k, self.rrf_k) for q in queries}


# ============================================================================ score combinations

def _zscores(scores: Sequence[float]) -> list[float]:
    n = len(scores)
    if n == 0:
        return []
    mean = sum(scores) / n
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / n)
    return [(s - mean) / std if std > 0 else 0.0 for s in scores]


def interpolate(first: Run, reranked: Run, depth: int, weight: float) -> Run:
    """``z(s_rerank) + w · z(s_first)`` over each query's top ``depth`` first-stage documents, best
    first; documents below ``depth`` follow in their first-stage order (:func:`above_rest`)."""
    out: Run = {}
    for qid, docs in first.items():
        docs = best_first(docs)
        top, rest = docs[:depth], docs[depth:]
        rerank_score = dict(reranked.get(qid, []))
        missing = [d for d, _ in top if d not in rerank_score]
        if missing:
            raise KeyError(f"query {qid!r}: the reranked run lacks {len(missing)} of the top {depth} "
                           f"first-stage documents (e.g. {missing[0]!r})")
        z_first = _zscores([float(s) for _, s in top])
        z_rerank = _zscores([float(rerank_score[d]) for d, _ in top])
        out[qid] = above_rest(((d, zr + weight * zf) for (d, _), zf, zr in zip(top, z_first, z_rerank)), rest)
    return out


HYBRID_NORMALIZATIONS = ("none", "tmm")
DEFAULT_HYBRID_NORMALIZATION = "none"   # CLEAR is trained against raw BM25 unless --bm25-scale says otherwise
THEORETICAL_MINIMA = (0.0, -1.0)        # BM25 ≥ 0; a cosine ≥ −1


def check_hybrid_normalization(config: str, normalization: str) -> None:
    """A ConfigError naming ``config``'s ``normalization`` field unless it is one of HYBRID_NORMALIZATIONS."""
    if normalization not in HYBRID_NORMALIZATIONS:
        raise ConfigError.invalid(config, "normalization", f"must be one of {HYBRID_NORMALIZATIONS}, "
                                                           f"got {normalization!r}")


def theoretical_min_max(docs: Mapping[str, tuple[float, float]],
                        minima: tuple[float, float] = THEORETICAL_MINIMA) -> dict[str, tuple[float, float]]:
    """Each side's ``φ(s) = (s − m) / (M_q − m)``: ``m`` its theoretical minimum, ``M_q`` its maximum
    over this query's candidates (Bruch et al. 2023, TMM). A side whose maximum is its minimum maps to 0."""
    if not docs:
        return {}
    tops = [max(pair[i] for pair in docs.values()) for i in (0, 1)]
    spans = [top - m for top, m in zip(tops, minima)]
    return {d: tuple((s - m) / span if span > 0 else 0.0 for s, m, span in zip(pair, minima, spans))
            for d, pair in docs.items()}


def linear_fusion(candidates: Candidates, weight: float, k: int = 1000, normalization: str = "none") -> Run:
    """``s = weight · s_a + s_b`` for each candidate's score pair (CLEAR's Eq. 8: ``λ · s_lex + s_emb``),
    on the raw scores (``"none"``) or on their :func:`theoretical_min_max` (``"tmm"``); top ``k`` per
    query, best first, ties by doc id."""
    check_hybrid_normalization("linear_fusion", normalization)
    run: Run = {}
    for qid, docs in candidates.items():
        if normalization == "tmm":
            docs = theoretical_min_max(docs)
        scored = [(d, weight * a + b) for d, (a, b) in docs.items()]
        scored.sort(key=lambda x: (-x[1], x[0]))
        run[qid] = scored[:k]
    return run


# ============================================================================ choosing a weight

def judged_queries(qrels: Mapping[str, Mapping[str, int]], among: Collection[str],
                   what: str) -> dict[str, dict[str, int]]:
    """The qrels of the queries in ``among`` with at least one relevant judgment (the only ones a
    weight can be tuned on); a ConfigError naming ``what`` when there are none."""
    judged = {q: dict(r) for q, r in qrels.items() if q in among and any(v > 0 for v in r.values())}
    if not judged:
        raise ConfigError(f"{what}: none of the {len(among)} queries has a relevant judgment")
    return judged


WEIGHT_RULES = ("best", "one-se")
DEFAULT_WEIGHT_RULE = "one-se"   # w of first+reranker pipelines (module docstring)
DEFAULT_LAMBDA_RULE = "best"     # CLEAR's λ_test: Eq. 8's λ, dev's argmax (module docstring)


def check_weight_rule(config: str, rule: str, field: str = "weight_rule") -> None:
    """A ConfigError naming ``config``'s ``field`` unless ``rule`` is one of WEIGHT_RULES."""
    if rule not in WEIGHT_RULES:
        raise ConfigError.invalid(config, field, f"must be one of {WEIGHT_RULES}, got {rule!r}")


def grid_search(fused: Callable[[float], Run], qrels: Mapping[str, Mapping[str, int]], grid: Sequence[float],
                name: str = "weight", rule: str = "best") -> tuple[float, dict[float, float]]:
    """The weight of ``grid`` that ``rule`` (``"best"`` or ``"one-se"``, module docstring) chooses for
    the runs ``fused(weight)`` on ``qrels``. Returns ``(chosen, {weight: nDCG@10})``, the table in
    ascending weight order."""
    from ckray.eval import per_query_values

    if rule not in WEIGHT_RULES:
        raise ConfigError(f"unknown rule for choosing {name}: {rule!r} (one of {', '.join(WEIGHT_RULES)})")
    per_weight = {}
    for w in sorted(float(x) for x in grid):
        per_weight[w] = per_query_values(fused(w), qrels)
    table = {w: sum(v) / len(v) for w, v in per_weight.items()}
    best = max(table, key=lambda w: (table[w], -w))
    chosen = best if rule == "best" else max(
        w for w in table if w >= best and _within_one_se(per_weight[w], per_weight[best]))
    log.info("%s = %g by rule %r (nDCG@10 %.4f on %d queries; the best, %g, has %.4f; %s = 0 gives %.4f)",
             name, chosen, rule, table[chosen], len(qrels), best, table[best], name, table.get(0.0, float("nan")))
    return chosen, table


def _within_one_se(scores: Sequence[float], best: Sequence[float]) -> bool:
    """Is the mean of ``scores`` within one standard error of ``best``'s, paired by query?"""
    from ckray.eval import paired_difference

    mean, se = paired_difference(scores, best)
    return mean >= -se - 1e-12


# ============================================================================ the interpolation weight of a pipeline

@dataclass
class InterpolationConfig:
    """``weight`` is w above; ``depth`` the first-stage depth it was tuned at; ``table`` {w: dev nDCG@10}."""

    weight: float
    depth: int
    dev_queries: int = 0
    table: dict = field(default_factory=dict)
    checkpoint_stamp: str = ""     # which reranker checkpoint it was tuned for (``ckray.models.checkpoint.checkpoint_digest``)
    first_stage_stamp: str = ""    # which first-stage index it was tuned on (``ckray.pipelines.first_stage_digest``)
    source: str = ""               # where a weight not tuned here came from (a checkpoint's deploy.json, ckray.deploy)
    rule: str = "best"             # how it was chosen from ``table`` (grid_search); files from before the rule say nothing: "best"
    reranker_passages: int = 1     # windows of a long document the reranker read (``ckray.rerank``); files from before: 1
    reranker_window_choice: str = "first"   # which of them (``ckray.windows``); files from before: the first


def tune_weight(first: Run, reranked: Run, qrels: Mapping[str, Mapping[str, int]], depth: int,
                grid: Sequence[float] = DEFAULT_WEIGHT_GRID, rule: str = DEFAULT_WEIGHT_RULE) -> InterpolationConfig:
    """The ``w`` of ``grid`` that ``rule`` chooses over the judged queries (:func:`grid_search`)."""
    judged = judged_queries(qrels, first, "tune_weight")
    first = {q: first[q] for q in judged}
    chosen, table = grid_search(lambda w: interpolate(first, reranked, depth, w), judged, grid,
                                "interpolation weight w", rule)
    return InterpolationConfig(weight=chosen, depth=depth, dev_queries=len(judged),
                               table={str(k): v for k, v in table.items()}, rule=rule)


def fusion_path(workdir: str | os.PathLike, first: str, reranker: str) -> Path:
    return WorkDir(workdir).fusion(first, reranker)


def save_interpolation(workdir: str | os.PathLike, first: str, reranker: str, config: InterpolationConfig) -> Path:
    from ckray.data.shards import write_json_atomic

    record = asdict(config)
    if not record["source"]:  # tuned here: the file reads as it always has
        del record["source"]
    return write_json_atomic(record, fusion_path(workdir, first, reranker))


def load_interpolation(workdir: str | os.PathLike, first: str, reranker: str) -> InterpolationConfig:
    import json

    path = fusion_path(workdir, first, reranker)
    if not path.exists():
        raise MissingArtifactError(
            f"no tuned interpolation weight at {path}: run `python jobs/evaluate.py --pipeline {first}+{reranker} "
            f"...` once (it tunes w on the dev split of the training queries and saves it)")
    return InterpolationConfig(**json.loads(path.read_text()))


def dev_queries(queries: Mapping[str, str], qrels: Mapping[str, Mapping[str, Mapping[str, int]]],
                split: str = "train", dev_fraction: float | None = None, max_queries: int | None = None,
                seed: int | None = None) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    """The held-back training queries the rerankers validated on (same rule and defaults as training)."""
    from ckray.data.examples import TrainingDataConfig, is_dev_query

    d = TrainingDataConfig()
    dev_fraction = d.dev_fraction if dev_fraction is None else dev_fraction
    max_queries = d.max_dev_queries if max_queries is None else max_queries
    seed = d.seed if seed is None else seed
    if split not in qrels:
        raise ConfigError(f"tuning an interpolation weight needs {split!r} qrels; the collection has {sorted(qrels)}")
    judged = qrels[split]
    qids = sorted(q for q in judged if q in queries and any(r > 0 for r in judged[q].values()))
    dev = [q for q in qids if is_dev_query(q, dev_fraction, seed)][:max_queries]
    return {q: queries[q] for q in dev}, {q: dict(judged[q]) for q in dev}


def measurement_splits(data: str | os.PathLike, split: str) -> dict[str, tuple[dict[str, str], dict[str, dict[str, int]]]]:
    """A collection's query sets for side-by-side measurements (``bench/``): ``{"dev": every held-back
    training query, where the collection has training qrels (settings are chosen there), split: its
    judged queries (reported, never chosen on)}``, each as ``(queries, qrels)``."""
    from ckray.data.collections import read_queries_and_qrels

    queries, qrels = read_queries_and_qrels(Path(data))
    if split not in qrels:
        raise ConfigError(f"--split {split!r}: {data} has qrels for {sorted(qrels)}")
    splits = {"dev": dev_queries(queries, qrels, max_queries=10**6)} if "train" in qrels else {}
    splits[split] = ({q: queries[q] for q in qrels[split] if q in queries}, dict(qrels[split]))
    return splits
