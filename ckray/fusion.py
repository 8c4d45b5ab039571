"""Interpolating a reranker with its first stage: ``first+reranker`` pipelines.

A reranker trained on a few hundred queries throws away what the first stage knew; adding the two
scores back together is the standard remedy (e.g. Nogueira & Cho's BM25 + BERT interpolation, and
CLEAR's own Eq. 8 for BM25 + dense). Over each query's top ``depth`` first-stage documents::

    s(q, d) = z(s_rerank(q, d)) + w · z(s_first(q, d))

where ``z`` standardises a query's scores (mean 0, standard deviation 1 over its top ``depth``), so
one weight fits first stages and rerankers whose score scales differ. ``w`` is chosen on the *dev*
queries — training queries held back from the reranker's training by the same stable hash
(``ckray.data.examples.is_dev_query``) — never on test queries, and saved to
``W/fusion/<first>+<reranker>.json`` so evaluation and serving use the same weight.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from ckray.errors import ConfigError, MissingArtifactError

log = logging.getLogger(__name__)

Run = dict[str, list[tuple[str, float]]]

FUSION_DIR = "fusion"
DEFAULT_WEIGHT_GRID: tuple[float, ...] = tuple(round(0.1 * i, 2) for i in range(0, 31))  # 0.0 … 3.0


@dataclass
class InterpolationConfig:
    """``weight`` is w above; ``depth`` the first-stage depth it was tuned at; ``table`` {w: dev nDCG@10}."""

    weight: float
    depth: int
    dev_queries: int = 0
    table: dict = field(default_factory=dict)
    checkpoint_stamp: str = ""     # which reranker checkpoint it was tuned for (``ckray.models.checkpoint.checkpoint_digest``)
    first_stage_stamp: str = ""    # which first-stage index it was tuned on (``ckray.pipelines.first_stage_digest``)




def _zscores(scores: Sequence[float]) -> list[float]:
    n = len(scores)
    if n == 0:
        return []
    mean = sum(scores) / n
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / n)
    return [(s - mean) / std if std > 0 else 0.0 for s in scores]


def interpolate(first: Run, reranked: Run, depth: int, weight: float) -> Run:
    """``z(s_rerank) + w · z(s_first)`` over each query's top ``depth`` first-stage documents, best
    first; documents below ``depth`` follow in their first-stage order (as in ``merge_scores``)."""
    out: Run = {}
    for qid, docs in first.items():
        docs = sorted(docs, key=lambda x: -float(x[1]))
        top, rest = docs[:depth], docs[depth:]
        rerank_score = dict(reranked.get(qid, []))
        missing = [d for d, _ in top if d not in rerank_score]
        if missing:
            raise KeyError(f"query {qid!r}: the reranked run lacks {len(missing)} of the top {depth} "
                           f"first-stage documents (e.g. {missing[0]!r})")
        z_first = _zscores([float(s) for _, s in top])
        z_rerank = _zscores([float(rerank_score[d]) for d, _ in top])
        fused = sorted(((d, zr + weight * zf) for (d, _), zf, zr in zip(top, z_first, z_rerank)),
                       key=lambda x: -x[1])
        floor = fused[-1][1] if fused else 0.0
        out[qid] = fused + [(d, floor - 1.0 - i) for i, (d, _) in enumerate(rest)]
    return out


def tune_weight(first: Run, reranked: Run, qrels: Mapping[str, Mapping[str, int]], depth: int,
                grid: Sequence[float] = DEFAULT_WEIGHT_GRID) -> InterpolationConfig:
    """The ``w`` of ``grid`` with the best nDCG@10 over the judged queries (ties: the smaller w)."""
    from ckray.eval import ndcg_at_10

    judged = {q: dict(r) for q, r in qrels.items() if q in first and any(v > 0 for v in r.values())}
    if not judged:
        raise ConfigError("tune_weight: none of the queries in the run has a relevant judgment")
    first = {q: first[q] for q in judged}
    table = {float(w): ndcg_at_10(interpolate(first, reranked, depth, float(w)), judged) for w in sorted(grid)}
    best = max(table, key=lambda w: (table[w], -w))
    log.info("interpolation weight w = %g (dev nDCG@10 %.4f on %d queries; reranker alone %.4f)",
             best, table[best], len(judged), table.get(0.0, float("nan")))
    return InterpolationConfig(weight=best, depth=depth, dev_queries=len(judged),
                               table={str(k): v for k, v in table.items()})


def fusion_path(workdir: str | os.PathLike, first: str, reranker: str) -> Path:
    return Path(workdir) / FUSION_DIR / f"{first}+{reranker}.json"


def save_interpolation(workdir: str | os.PathLike, first: str, reranker: str, config: InterpolationConfig) -> Path:
    from ckray.data.shards import write_json_atomic

    return write_json_atomic(asdict(config), fusion_path(workdir, first, reranker))


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
