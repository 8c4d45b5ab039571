"""Diagnosis of how CK-QTI reads a long document in windows: collection statistics and the per-term aggregate.

Scores every window of every document of a prepared work directory with a CK-QTI checkpoint, as the impact
index does (``TermImpactScorer.score_pieces``; top-k and β from the flags), and ranks the collection's judged
queries by brute force (Σ over query terms, ``query_term_counts``) under

* three sets of collection statistics for the explicit match (Eq. 9): counted over each document's first
  window (what the index uses), over every window as a document, or over whole documents;
* several per-term aggregates of a term's window weights w_tp: the best (max, what the index stores), the
  first, the mean, the mean of the best two, the best discounted by the number of windows.

Prints nDCG@10 for each. For choosing on a dev collection (``scripts/long_collection.py --held-out``)::

    python scripts/impact_windows.py --data T/longsci-dev --workdir W --checkpoint T/ckR/ck-qti
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import torch

AGGREGATES = {
    "max": lambda v: max(v),
    "first": lambda v: v[0],
    "mean": lambda v: sum(v) / len(v),
    "mean of the best two": lambda v: sum(sorted(v)[-2:]) / min(2, len(v)),
    "max / sqrt(windows)": lambda v: max(v) / math.sqrt(len(v)),
}


def window_statistics(windows: list[list[int]], per_doc: list[int], vocab_size: int, unit: str):
    """(document frequencies, N, mean length) with every window (``unit="window"``) or every whole
    document (``"document"``) counted as a document; the mean length is a window's."""
    df = np.zeros(vocab_size, np.int64)
    if unit == "window":
        for w in windows:
            df[np.unique(np.asarray(w, np.int64))] += 1
        n = len(windows)
    else:
        starts = np.cumsum([0] + per_doc)
        for a, b in zip(starts[:-1], starts[1:]):
            df[np.unique(np.concatenate([np.asarray(w, np.int64) for w in windows[a:b]]))] += 1
        n = len(per_doc)
    return df, n, sum(len(w) for w in windows) / max(1, len(windows))


def main() -> None:
    from ckray.data.collections import doc_text, read_beir_qrels, read_beir_queries
    from ckray.data.shards import load_corpus_table
    from ckray.eval import ndcg_at_10
    from ckray.models.encoders import document_windows, load_tokenizer
    from ckray.rankers.ck_qti.corpus_statistics import corpus_adaptation, training_mean_doc_len
    from ckray.rankers.ck_qti.impact_search import query_term_counts
    from ckray.rankers.ck_qti.impact_settings import ImpactConfig
    from ckray.rankers.ck_qti.term_impacts import TermImpactScorer
    from ckray.rankers.ck_qti.model import load_ck_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="BEIR directory (queries.jsonl, qrels/<split>.tsv)")
    parser.add_argument("--workdir", required=True, help="its prepared work directory (jobs/prepare.py)")
    parser.add_argument("--checkpoint", required=True, help="a CK-QTI checkpoint")
    parser.add_argument("--split", default="test")
    parser.add_argument("--top-k", type=int, default=256)
    parser.add_argument("--explicit-weight", type=float, default=0.5)
    a = parser.parse_args()
    torch.set_grad_enabled(False)

    table = load_corpus_table(a.workdir, ["doc_id", "title", "text"])
    ids = table.column("doc_id").to_pylist()
    texts = [doc_text(t, x) for t, x in zip(table.column("title").to_pylist(), table.column("text").to_pylist())]
    queries = read_beir_queries(Path(a.data) / "queries.jsonl")
    qrels = read_beir_qrels(Path(a.data) / "qrels" / f"{a.split}.tsv")
    qids = [q for q in qrels if q in queries]
    probe = load_ck_model(a.checkpoint)
    windows, per_doc = document_windows(load_tokenizer(probe.config.encoder), texts, probe.config.max_doc_len,
                                        add_special_tokens=False)
    bags = query_term_counts([queries[q] for q in qids], probe.config.encoder)
    print(f"{len(ids)} documents, {len(windows)} windows of up to {probe.config.max_doc_len} word pieces, "
          f"{len(qids)} queries")
    for unit in ("first window", "window", "document"):
        model = load_ck_model(a.checkpoint)
        adaptation = corpus_adaptation(a.workdir, a.checkpoint, model)
        if unit != "first window":
            df, n, mean_len = window_statistics(windows, per_doc, model.config.vocab_size, unit)
            trained = training_mean_doc_len(a.checkpoint, model)
            adaptation.doc_freq, adaptation.n_docs, adaptation.mean_doc_len = df, n, mean_len
            adaptation.length_scale = mean_len / trained if trained else 1.0
        adaptation.apply(model)
        scored = TermImpactScorer(model, ImpactConfig(top_k=a.top_k, explicit_weight=a.explicit_weight)
                                  ).score_pieces(windows)
        starts = np.cumsum([0] + per_doc)
        weights = []   # per document: {term: [w_tp of each window, 0 where the window does not keep it]}
        for first, end in zip(starts[:-1], starts[1:]):
            doc: dict[int, list[float]] = {}
            for window, (terms, ws) in enumerate(scored[first:end]):
                for t, w in zip(terms.tolist(), ws.tolist()):
                    doc.setdefault(t, [0.0] * (end - first))[window] = w
            weights.append(doc)
        for name, aggregate in AGGREGATES.items():
            run = {}
            for q, bag in zip(qids, bags):
                scores = [(d, sum(c * aggregate(doc[t]) for t, c in bag.items() if t in doc))
                          for d, doc in zip(ids, weights)]
                run[q] = sorted(scores, key=lambda x: -x[1])[:100]
            print(f"statistics over each {unit:12s}  {name:22s} nDCG@10 {ndcg_at_10(run, qrels):.3f}", flush=True)


if __name__ == "__main__":
    main()
