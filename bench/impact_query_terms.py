"""CK-QTI: which query terms the impact sum runs over, side by side on one index.

    python bench/impact_query_terms.py --data DIR --workdir W [--checkpoint W/checkpoints/ck-qti] [--split test]

``W`` holds a built impact index of the checkpoint (``jobs/build_impact_index.py``) and BM25
(``jobs/prepare.py``). Each rule turns a query into the terms of ``S_qd = Σ_{t∈q} count_t · s_td``
(``ckray.rankers.ck_qti.impact_search.query_term_counts``):

* ``training``: every word piece, cut at the model's ``max_query_len``, as training tokenises queries;
* ``all_pieces``: every word piece, not cut;
* ``analyzed_cut``: the word pieces of the words the BM25 analyser keeps, cut at ``max_query_len``;
* ``analyzed``: the same, not cut (the deployed rule).

For each: nDCG@10 and R@100 of ``ck-qti`` (the impact index over the whole collection) and nDCG@10 of
``bm25>ck-qti`` (BM25's top 100 reranked by the stored impacts), on the dev split of the *training*
queries (when the collection has them) and on ``--split`` (reported, never chosen on), with the mean
number of query terms. The index and the documents' impacts are the same for every rule; only the
query side changes. Ends with one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.impact_topk import impact_bench_arguments  # noqa: E402


def rules(max_query_len: int) -> dict[str, tuple[bool, int]]:
    """``{rule: (analyzed, max_pieces)}`` (module docstring)."""
    from ckray.rankers.ck_qti.impact_search import MAX_QUERY_PIECES

    return {"training": (False, max_query_len), "all_pieces": (False, MAX_QUERY_PIECES),
            "analyzed_cut": (True, max_query_len), "analyzed": (True, MAX_QUERY_PIECES)}


def main() -> None:
    parsed = impact_bench_arguments(__doc__)
    if parsed is None:
        return
    args, data, w, checkpoint = parsed
    from ckray.data.shards import DocStore
    from ckray.eval import evaluate
    from ckray.fusion import measurement_splits
    from ckray.lexical.bm25 import bm25_retriever
    from ckray.models.checkpoint import read_checkpoint_config
    from ckray.rankers.ck_qti.impact import impact_index_dir
    from ckray.rankers.ck_qti.impact_search import ImpactRetriever
    from ckray.rankers.ck_qti.impact_rerank import ImpactReranker
    from ckray.rankers.ck_qti.model import CKConfig
    from ckray.ray_env import init_ray

    max_query_len = int(read_checkpoint_config(checkpoint)["config"].get("max_query_len", CKConfig.max_query_len))
    splits = measurement_splits(data, args.split)
    init_ray()  # before the JVM: Ray's crash handler, installed after it, turns the JVM's own SIGSEGVs fatal
    first = {name: bm25_retriever(w).search(qs, k=100) for name, (qs, _) in splits.items()}
    store = DocStore(w)

    rows = []
    for rule, (analyzed, max_pieces) in rules(max_query_len).items():
        retriever = ImpactRetriever(str(impact_index_dir(w)), analyze_queries=analyzed, max_query_pieces=max_pieces)
        reranker = ImpactReranker(str(checkpoint), str(w), store.text, analyze_queries=analyzed,
                                  max_query_pieces=max_pieces)
        if reranker.source != "shards":
            raise SystemExit(f"no impact shards of {checkpoint} under {w}: run jobs/build_impact_index.py first")
        row = {"rule": rule, "analyzed": analyzed, "max_pieces": max_pieces}
        for name, (qs, judged) in splits.items():
            bags = retriever.query_terms(list(qs.values()))
            full = evaluate(retriever.search(qs, k=1000), judged, ("nDCG@10", "R@100"))
            rr = evaluate(reranker.rerank(qs, first[name], depth=100), judged, ("nDCG@10",))
            row[f"{name}_terms"] = round(statistics.mean(sum(b.values()) for b in bags), 1)
            row[f"{name}_ndcg10"], row[f"{name}_r100"] = round(full["nDCG@10"], 4), round(full["R@100"], 4)
            row[f"{name}_rerank_ndcg10"] = round(rr["nDCG@10"], 4)
        rows.append(row)
        print(row, flush=True)
    bm = {name: round(evaluate(first[name], judged, ("nDCG@10",))["nDCG@10"], 4)
          for name, (_, judged) in splits.items()}
    print(f"\n{'rule':<13}" + "".join(f"{n + ' terms':>12}{n + ' ck-qti':>14}{n + ' R@100':>12}{n + ' rerank':>14}"
                                     for n in splits))
    for r in rows:
        print(f"{r['rule']:<13}" + "".join(f"{r[n + '_terms']:>12}{r[n + '_ndcg10']:>14}{r[n + '_r100']:>12}"
                                           f"{r[n + '_rerank_ndcg10']:>14}" for n in splits))
    print("bm25 nDCG@10: " + ", ".join(f"{n} {v}" for n, v in bm.items()))
    print(json.dumps({"bench": "impact_query_terms", "checkpoint": str(checkpoint), "data": str(data),
                      "split": args.split, "bm25_ndcg10": bm, "rows": rows}))


if __name__ == "__main__":
    main()
