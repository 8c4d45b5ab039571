"""Queries/s of batch BM25 search (Lucene threads) vs one-at-a-time search, same index, same run.

    python bench/bm25.py [--data ../shared/data/scifact] [--workdir /tmp/ckray-bench-bm25] [--threads 2]

Ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckray.cli import setup_logging  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    default_data = Path(__file__).resolve().parents[2] / "shared" / "data" / "scifact"
    p.add_argument("--data", default=str(default_data))
    p.add_argument("--workdir", default="/tmp/ckray-bench-bm25")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    setup_logging("WARNING")
    if not (Path(args.data) / "corpus.jsonl").exists() and not (Path(args.data) / "collection.tsv").exists():
        print(f"skip: no collection at {args.data} (pass --data DIR)")
        return
    from ckray.data.collections import read_queries_and_qrels
    from ckray.data.prepare import PrepareConfig, prepare_shards
    from ckray.lexical.bm25 import BM25Searcher, bm25_index_dir, build_bm25_index

    prepare_shards(PrepareConfig(data=args.data, workdir=args.workdir, shards=4))
    build_bm25_index(args.workdir)
    queries, _ = read_queries_and_qrels(Path(args.data))
    searcher = BM25Searcher(str(bm25_index_dir(args.workdir)), threads=args.threads)
    searcher.search(dict(list(queries.items())[:50]), k=args.k)  # warm-up (JIT, caches)
    batch_t, single_t = [], []
    for _ in range(args.repeats):  # interleaved so machine noise hits both alike
        t0 = time.perf_counter()
        batch = searcher.search(queries, k=args.k)
        batch_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        single = {q: searcher.search_one(text, k=args.k) for q, text in queries.items()}
        single_t.append(time.perf_counter() - t0)
    assert all([d for d, _ in batch[q][:10]] == [d for d, _ in single[q][:10]] for q in queries)
    n = len(queries)
    batch_qps, single_qps = n / min(batch_t), n / min(single_t)
    print(f"{n} queries, k={args.k}, threads={args.threads}")
    print(f"batch search (threads): {batch_qps:8.1f} q/s")
    print(f"one at a time:          {single_qps:8.1f} q/s")
    print(f"speed-up: {batch_qps / single_qps:.2f}x")
    print(json.dumps({"bench": "bm25", "queries": n, "k": args.k, "threads": args.threads,
                      "batch_qps": round(batch_qps, 1), "single_qps": round(single_qps, 1),
                      "speedup": round(batch_qps / single_qps, 2)}))


if __name__ == "__main__":
    main()
