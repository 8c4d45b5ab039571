"""Evaluation with ir-measures: run files, aggregate and per-query metrics, report table."""

from __future__ import annotations

import math
from collections.abc import Sequence

import ir_measures
from ir_measures import parse_measure

Run = dict[str, list[tuple[str, float]]]
Qrels = dict[str, dict[str, int]]

DEFAULT_MEASURES = ("nDCG@10", "RR@10", "R@100", "AP@1000")


def _run_dict(run: Run) -> dict[str, dict[str, float]]:
    return {qid: {did: float(s) for did, s in docs} for qid, docs in run.items()}


def evaluate(run: Run, qrels: Qrels, measures=DEFAULT_MEASURES) -> dict[str, float]:
    """Mean of each measure over the queries that have judgments (queries absent from the run score 0)."""
    ms = [parse_measure(m) for m in measures]
    qrels = {q: d for q, d in qrels.items() if d}
    run_d = _run_dict(run)
    for q in qrels:
        run_d.setdefault(q, {})
    agg = ir_measures.calc_aggregate(ms, qrels, run_d)
    return {str(m): float(agg.get(m, 0.0)) for m in ms}


def per_query(run: Run, qrels: Qrels, measures=DEFAULT_MEASURES) -> dict[str, dict[str, float]]:
    ms = [parse_measure(m) for m in measures]
    out: dict[str, dict[str, float]] = {}
    for r in ir_measures.iter_calc(ms, {q: d for q, d in qrels.items() if d}, _run_dict(run)):
        out.setdefault(r.query_id, {})[str(r.measure)] = float(r.value)
    return out


def per_query_values(run: Run, qrels: Qrels, measure: str = "nDCG@10") -> list[float]:
    """``measure`` of each query of ``qrels`` in sorted order, 0 for one the run misses or that has no
    judgments: the aligned lists :func:`paired_difference` compares."""
    values = per_query(run, qrels, (measure,))
    return [values.get(q, {}).get(measure, 0.0) for q in sorted(qrels)]


def ndcg_at_10(run: Run, qrels: Qrels) -> float:
    return evaluate(run, qrels, ("nDCG@10",))["nDCG@10"]


def paired_difference(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Mean of the per-query differences ``a_q − b_q`` of two systems on the same queries, and its
    standard error (the differences' sample standard deviation / √n; 0 for a single query)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired_difference needs two non-empty lists over the same queries, got {len(a)} and {len(b)}")
    diffs = [x - y for x, y in zip(a, b)]
    n = len(diffs)
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n) if n > 1 else 0.0
    return mean, se
