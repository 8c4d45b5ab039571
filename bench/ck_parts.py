"""CK-QTI: what each part of s_td ranks, and how each leans on document length, side by side.

    python bench/ck_parts.py --data DIR --workdir W [--checkpoint W/checkpoints/ck-qti] [--split test] [--depth 100]

``W`` holds the corpus shards and BM25 (``jobs/prepare.py``). The checkpoint's explicit match is set to
``W``'s corpus (IDF and mean length, as the impact index job sets it). BM25's top ``--depth`` of each
query is reranked by the model's dense sum over the deployed query terms (``query_term_counts``; no
top-k cut), and by each part of

    s_td = ReLU(α·s_explicit + (1−α)·s_implicit + b)

alone: ``explicit`` = Σ_t α·s_explicit_td (Eq. 9–10, the learned BM25), ``implicit`` = Σ_t (1−α)·s_implicit_td
(Eq. 11–16, the kernel-pooled match). For each: nDCG@10 on the dev split of the training queries (when
the collection has them) and on ``--split``, and the mean over queries of the Spearman correlation
between a candidate's score and its length in word pieces. Ends with one JSON line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.impact_topk import impact_bench_arguments  # noqa: E402

PARTS = ("model", "explicit", "implicit")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Rank correlation of two score vectors (ties broken by position); nan when either is constant."""
    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return float("nan")
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def part_scores(model, bag: dict[int, int], texts: list[str]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """``{part: score per text}`` for one query's term bag, and each text's length in word pieces."""
    import torch

    terms = torch.tensor([t for t, c in bag.items() for _ in range(c)], dtype=torch.long)
    ids, mask = model.tokenize_documents(texts)
    with torch.no_grad():
        doc = model.encode_documents(ids.to(model.device), mask.to(model.device))
        terms = terms.to(model.device)
        explicit, implicit = model.weighted_parts(terms.expand(len(texts), -1), model.encode_query_terms(terms), doc)
        s_td = torch.relu(explicit + implicit + model.bias)  # Σ_t of it is forward's S_qd
    scores = {"model": s_td.sum(-1), "explicit": explicit.sum(-1), "implicit": implicit.sum(-1)}
    return {k: v.float().cpu().numpy() for k, v in scores.items()}, doc.length.cpu().numpy()


def main() -> None:
    parsed = impact_bench_arguments(__doc__, lambda p: p.add_argument("--depth", type=int, default=100))
    if parsed is None:
        return
    args, data, w, checkpoint = parsed
    from ckray.data.shards import DocStore
    from ckray.eval import evaluate
    from ckray.fusion import measurement_splits
    from ckray.lexical.bm25 import bm25_retriever
    from ckray.rankers.ck_qti.corpus_statistics import corpus_adaptation
    from ckray.rankers.ck_qti.impact_search import query_term_counts
    from ckray.rankers.ck_qti.model import load_ck_model
    from ckray.ray_env import init_ray

    splits = measurement_splits(data, args.split)
    init_ray()  # before the JVM: Ray's crash handler, installed after it, turns the JVM's own SIGSEGVs fatal
    bm25 = bm25_retriever(w)
    store = DocStore(w)
    model = load_ck_model(checkpoint)
    corpus_adaptation(w, checkpoint, model).apply(model)
    model.eval()

    result = {}
    for name, (qs, judged) in splits.items():
        first = bm25.search(qs, k=args.depth)
        runs = {part: {} for part in ("bm25", *PARTS)}
        correlations = {part: [] for part in runs}
        for qid, bag in zip(qs, query_term_counts(list(qs.values()), model.config.encoder)):
            docs = [d for d, _ in first[qid]]
            if not docs or not bag:
                continue
            scores, lengths = part_scores(model, bag, [store.text(d) for d in docs])
            scores["bm25"] = np.array([s for _, s in first[qid]])
            for part, s in scores.items():
                runs[part][qid] = list(zip(docs, s.tolist()))
                correlations[part].append(spearman(s, lengths))
        result[name] = {part: {"ndcg10": round(evaluate(run, judged, ("nDCG@10",))["nDCG@10"], 4),
                               "spearman_length": round(float(np.nanmean(correlations[part])), 3)}
                        for part, run in runs.items()}
        print(name, result[name], flush=True)
    print(f"\n{'ranked by':<10}" + "".join(f"{n + ' nDCG@10':>16}{n + ' ρ(length)':>16}" for n in result))
    for part in ("bm25", *PARTS):
        print(f"{part:<10}" + "".join(f"{result[n][part]['ndcg10']:>16}{result[n][part]['spearman_length']:>16}"
                                      for n in result))
    print(json.dumps({"bench": "ck_parts", "checkpoint": str(checkpoint), "data": str(data), "depth": args.depth,
                      "splits": result}))


if __name__ == "__main__":
    main()
