"""CLEAR's hybrid on raw and on normalised scores: λ_test tuned on one collection, carried to others.

    python bench/hybrid_normalization.py --data DIR --workdir W [--data OTHER --workdir V ...] [--split test]

Each ``--workdir`` holds BM25 (``jobs/prepare.py``) and a dense index of one CLEAR checkpoint
(``jobs/build_dense_index.py``, or ``jobs/benchmark.py``'s per-collection work directory); the pairs
are taken in order. The first collection must have training queries: for each normalization of
``ckray.fusion.linear_fusion`` (``none``, the paper's Eq. 8 on raw scores; ``tmm``, each side
normalised per query by its theoretical minimum and the query's maximum) λ_test is tuned on its
held-out dev queries (``ckray.rankers.clear.dense.tune_lambda``, as ``jobs/build_dense_index.py``
does), then that λ is applied, unchanged, to ``--split`` of every collection (reported, never chosen
on). The candidates (BM25's top 1000 ∪ the dense top 100, exact scores) are made once per collection;
only the fusion differs between rows. Prints the table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", action="append", required=True, help="collection (repeatable; the first tunes λ)")
    p.add_argument("--workdir", action="append", required=True, help="its work directory (one per --data)")
    p.add_argument("--split", default="test", help="split reported in every collection")
    args = p.parse_args()
    if len(args.data) != len(args.workdir):
        p.error(f"{len(args.data)} --data but {len(args.workdir)} --workdir: give one work directory per collection")

    from ckray.eval import evaluate
    from ckray.fusion import HYBRID_NORMALIZATIONS, linear_fusion, measurement_splits
    from ckray.lexical.bm25 import bm25_retriever
    from ckray.rankers.clear.dense import HybridConfig, HybridRetriever, dense_retriever, tune_lambda
    from ckray.ray_env import init_ray

    init_ray()  # before the JVM (ckray.lexical.jvm)
    columns: dict[str, tuple[dict, dict]] = {}     # column → (candidates, qrels)
    for i, (data, workdir) in enumerate(zip(args.data, args.workdir)):
        splits = measurement_splits(data, args.split)
        if i == 0 and "dev" not in splits:
            raise SystemExit(f"{data} has no training queries: the first --data must have them (λ is tuned there)")
        hybrid = HybridRetriever(bm25_retriever(workdir), dense_retriever(workdir), HybridConfig(normalization="none"))
        name = Path(data).name
        for split, (queries, qrels) in splits.items():
            if i == 0 or split != "dev":
                columns[f"{name} {split}"] = (hybrid.candidates(queries), qrels)
                print(f"{name} {split}: {len(queries)} queries", flush=True)

    dev = next(iter(columns))
    rows = []
    for normalization in HYBRID_NORMALIZATIONS:
        cands, qrels = columns[dev]
        lam, table = tune_lambda(cands, qrels, normalization=normalization)
        row = {"normalization": normalization, "lambda": lam}
        for column, (cands, qrels) in columns.items():
            row[column] = round(evaluate(linear_fusion(cands, lam, 1000, normalization), qrels,
                                         ("nDCG@10",))["nDCG@10"], 4)
        carried = [v for c, v in row.items() if c not in ("normalization", "lambda", dev)]
        row["mean (reported)"] = round(statistics.mean(carried), 4) if carried else None
        rows.append(row)
        print(row, flush=True)

    names = [c for c in rows[0] if c not in ("normalization",)]
    print("\n| normalization | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for r in rows:
        print(f"| {r['normalization']} | " + " | ".join(f"{r[c]:g}" if r[c] is not None else "–" for c in names) + " |")
    print(json.dumps({"bench": "hybrid_normalization", "data": args.data, "workdirs": args.workdir,
                      "split": args.split, "tuned_on": dev, "rows": rows}))


if __name__ == "__main__":
    main()
