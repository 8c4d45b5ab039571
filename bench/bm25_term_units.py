"""Lucene BM25 over three term units, side by side: Porter-stemmed words (ckray's BM25), unstemmed words, and
the encoder's word pieces (what CK-QTI's exact match counts with ``--exact-match pieces``).

    python bench/bm25_term_units.py --data DIR [--split test] [--out OUT]

Each unit gets its own Lucene index of the collection (``contents = title + " " + text``) under ``--out``
(default: a temporary directory), BM25(0.9, 0.4) as ``ckray.lexical.bm25``; queries are analysed as the index
was (word pieces: the tokenizer's pieces, whitespace-separated). Prints nDCG@10 of each on ``--split``'s
judged queries and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

UNITS = ("stemmed words", "unstemmed words", "word pieces")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="collection directory (BEIR or MS MARCO layout)")
    p.add_argument("--split", default="test", help="the judged queries to rank (default: test)")
    p.add_argument("--out", default=None, help="where the three indexes are built (default: a temporary directory)")
    p.add_argument("--encoder", default=None, help="the word-piece tokenizer (default: the offline MiniLM)")
    args = p.parse_args()

    from ckray.data.collections import corpus_file, corpus_lines, doc_text, parse_corpus_lines, read_queries_and_qrels
    from ckray.eval import evaluate
    from ckray.lexical.bm25 import index_json_collection
    from ckray.lexical.jvm import ensure_jvm
    from ckray.models.encoders import load_tokenizer

    data = Path(args.data)
    queries, qrels = read_queries_and_qrels(data)
    judged = qrels[args.split]
    queries = {q: queries[q] for q in judged if q in queries}
    tokenizer = load_tokenizer(args.encoder)
    pieces = lambda text: " ".join(tokenizer.tokenize(text))  # noqa: E731
    out = Path(args.out or tempfile.mkdtemp(prefix="bm25-units-"))

    ensure_jvm()
    from jnius import autoclass
    from pyserini.analysis import get_lucene_analyzer
    from pyserini.search.lucene import LuceneSearcher

    result = {}
    for unit in UNITS:
        name = unit.replace(" ", "-")
        index = out / name / "index"
        if not index.exists():
            source = out / name / "jsonl"
            source.mkdir(parents=True, exist_ok=True)
            cfile, fmt = corpus_file(data)
            with open(source / "corpus.jsonl", "w", encoding="utf-8") as f:
                for doc_id, title, text in parse_corpus_lines(fmt, cfile, corpus_lines(cfile)):
                    contents = doc_text(title, text)
                    f.write(json.dumps({"id": doc_id, "contents": pieces(contents) if unit == "word pieces" else contents})
                            + "\n")
            extra = {"stemmed words": (), "unstemmed words": ("-stemmer", "none"),
                     "word pieces": ("-pretokenized",)}[unit]
            index_json_collection(source, index, extra_args=extra)
        searcher = LuceneSearcher(str(index))
        searcher.set_bm25(0.9, 0.4)
        if unit == "unstemmed words":
            searcher.set_analyzer(get_lucene_analyzer(stemming=False))
        elif unit == "word pieces":
            searcher.set_analyzer(autoclass("org.apache.lucene.analysis.core.WhitespaceAnalyzer")())
        qids = list(queries)
        texts = [pieces(queries[q]) if unit == "word pieces" else queries[q] for q in qids]
        hits = searcher.batch_search(texts, qids, k=1000, threads=2)
        run = {q: [(h.docid, float(h.score)) for h in hits.get(q, [])] for q in qids}
        result[unit] = round(evaluate(run, judged, ("nDCG@10",))["nDCG@10"], 4)
        print(f"{unit:<16} nDCG@10 {result[unit]}", flush=True)
    print(json.dumps({"bench": "bm25_term_units", "data": str(data), "split": args.split, "queries": len(queries),
                      "ndcg10": result}))


if __name__ == "__main__":
    main()
