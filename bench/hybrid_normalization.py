"""CLEAR's hybrid on raw and on normalised scores: λ_test tuned on one collection, carried to others.

    python bench/hybrid_normalization.py --data DIR --workdir W [--data OTHER --workdir V ...] [--split test]
        [--baseline-workdir W0 --baseline-workdir V0 ...]

Each ``--workdir`` holds BM25 (``jobs/prepare.py``) and a dense index of one CLEAR checkpoint
(``jobs/build_dense_index.py``, or ``jobs/benchmark.py``'s per-collection work directory); the pairs
are taken in order. ``--baseline-workdir`` (optional, one per ``--data``) holds another checkpoint's index
of the same collections, whose rows come first. The first collection must have training queries: for
each model and each normalization of ``ckray.fusion.linear_fusion`` (``none``, the paper's Eq. 8 on raw
scores; ``tmm``, each side normalised per query by its theoretical minimum and the query's maximum)
λ_test is tuned on its held-out dev queries (``ckray.rankers.clear.hybrid.tune_lambda``, as
``jobs/build_dense_index.py`` does), then that λ is applied, unchanged, to ``--split`` of every
collection (reported, never chosen on). The candidates (BM25's top 1000 ∪ the dense top 100, exact
scores) are made once per model and collection; only the fusion differs between a model's rows. Each
figure after the first row comes with its paired difference from the first row over the same queries
and that difference's standard error (``ckray.eval.paired_difference``). ``--lambda-rule`` (repeatable)
chooses λ_test on dev by each rule of ``ckray.fusion.grid_search`` (``best``: the argmax; ``one-se``: the
largest λ within one standard error of it); a row of a later rule also shows its paired difference from the
first rule's row of the same model and normalization. Prints the table and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckray.fusion import WEIGHT_RULES  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", action="append", required=True, help="collection (repeatable; the first tunes λ)")
    p.add_argument("--workdir", action="append", required=True, help="its work directory (one per --data)")
    p.add_argument("--baseline-workdir", action="append", default=[],
                   help="another checkpoint's work directory of the same collection (one per --data; optional)")
    p.add_argument("--split", default="test", help="split reported in every collection")
    p.add_argument("--lambda-rule", action="append", choices=WEIGHT_RULES, default=None,
                   help="rule choosing λ_test on dev (repeatable; default: best): ckray.fusion.grid_search")
    args = p.parse_args()
    rules = args.lambda_rule or ["best"]
    models = {"model": args.workdir}
    if args.baseline_workdir:
        models = {"baseline": args.baseline_workdir, **models}
    for name, workdirs in models.items():
        if len(args.data) != len(workdirs):
            p.error(f"{len(args.data)} --data but {len(workdirs)} {name} work directories: give one per collection")

    from ckray.eval import paired_difference, per_query
    from ckray.fusion import HYBRID_NORMALIZATIONS, linear_fusion, measurement_splits
    from ckray.lexical.bm25 import bm25_retriever
    from ckray.rankers.clear.hybrid import HybridConfig, HybridRetriever, dense_retriever, tune_lambda
    from ckray.ray_env import init_ray

    init_ray()  # before the JVM (ckray.lexical.jvm)
    splits = [measurement_splits(data, args.split) for data in args.data]
    if "dev" not in splits[0]:
        raise SystemExit(f"{args.data[0]} has no training queries: the first --data must have them (λ is tuned there)")
    columns = [f"{Path(data).name} {split}" for i, data in enumerate(args.data)
               for split in splits[i] if i == 0 or split != "dev"]
    dev = columns[0]

    rows, per_row = [], []       # per_row: each row's per-query nDCG@10 by column
    first_rule: dict[tuple[str, str], dict] = {}   # (model, normalization) → the first rule's per-query scores
    for model, workdirs in models.items():
        candidates: dict[str, tuple[dict, dict]] = {}      # column → (candidates, qrels)
        for i, (data, workdir) in enumerate(zip(args.data, workdirs)):
            hybrid = HybridRetriever(bm25_retriever(workdir), dense_retriever(workdir),
                                     HybridConfig(normalization="none"))
            for split, (queries, qrels) in splits[i].items():
                if i == 0 or split != "dev":
                    candidates[f"{Path(data).name} {split}"] = (hybrid.candidates(queries), qrels)
                    print(f"{model}: {Path(data).name} {split}: {len(queries)} queries", flush=True)
        for normalization, rule in [(n, r) for n in HYBRID_NORMALIZATIONS for r in rules]:
            lam, _ = tune_lambda(*candidates[dev], normalization=normalization, rule=rule)
            row = {"model": model, "normalization": normalization, "rule": rule, "lambda": lam}
            scores = {}
            for column in columns:
                cands, qrels = candidates[column]
                scores[column] = {q: m["nDCG@10"] for q, m in per_query(linear_fusion(cands, lam, 1000, normalization),
                                                                        qrels, ("nDCG@10",)).items()}
                row[column] = round(statistics.mean(scores[column].values()), 4)
            carried = [row[c] for c in columns if c != dev]
            row["mean (reported)"] = round(statistics.mean(carried), 4) if carried else None
            references = {" Δ": per_row[0]} if per_row else {}
            same_kind = first_rule.setdefault((model, normalization), scores)
            if same_kind is not scores and same_kind is not per_row[0]:   # else the first row's difference again
                references[f" Δ {rules[0]}"] = same_kind
            for suffix, reference in references.items():
                for column in columns:
                    ids = sorted(reference[column])
                    diff, se = paired_difference([scores[column][q] for q in ids], [reference[column][q] for q in ids])
                    row[f"{column}{suffix}"] = f"{diff:+.4f} ± {se:.4f}"
            rows.append(row)
            per_row.append(scores)
            print(row, flush=True)

    names = columns + ["mean (reported)"]
    print("\n| model | normalization | λ rule | λ | " + " | ".join(names) + " |\n|---|---|---|---:|" + "---:|" * len(names))
    for r in rows:
        cells = [f"{r[c]:g}" + "".join(f" ({r[c + s]}{label})" for s, label in
                                      ((" Δ", ""), (f" Δ {rules[0]}", f" against {rules[0]}")) if c + s in r)
                 if r[c] is not None else "–" for c in names]
        print(f"| {r['model']} | {r['normalization']} | {r['rule']} | {r['lambda']:g} | " + " | ".join(cells) + " |")
    print(json.dumps({"bench": "hybrid_normalization", "data": args.data, "workdirs": args.workdir,
                      "baseline_workdirs": args.baseline_workdir, "split": args.split, "tuned_on": dev,
                      "rows": rows}))


if __name__ == "__main__":
    main()
