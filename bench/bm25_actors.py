"""Queries/s of BM25 search on a pool of Ray actors (ckray.lexical.pool): 1 vs 2 actors, same index, same run.

    python bench/bm25_actors.py [--data ../shared/data/scifact] [--workdir /tmp/ckray-bench-bm25]
                                [--actors 1 2] [--threads 1] [--k 1000] [--chunk 64] [--repeats 3]

Every pool is started (one JVM and Lucene searcher per actor, ``--threads`` search threads each) and
warmed up before any timing; the timed runs of the pools are interleaved, so noise from other work on
the machine hits each alike, and the best of ``--repeats`` counts. Every pool's run must equal one
searcher's. With ``--threads 1`` the actors are the only parallelism, so the ratio shows how
throughput grows with actors up to the machine's cores. Ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckray.cli import setup_logging  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_data = Path(__file__).resolve().parents[2] / "shared" / "data" / "scifact"
    p.add_argument("--data", default=str(default_data))
    p.add_argument("--workdir", default="/tmp/ckray-bench-bm25")
    p.add_argument("--actors", type=int, nargs="+", default=[1, 2], help="pool sizes to compare")
    p.add_argument("--threads", type=int, default=1, help="Lucene search threads per actor")
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--chunk", type=int, default=64, help="queries per actor call")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    setup_logging("WARNING")
    if not (Path(args.data) / "corpus.jsonl").exists():
        print(f"skip: no collection at {args.data} (pass --data DIR)")
        return
    import ray

    from ckray.data.collections import read_queries_and_qrels
    from ckray.data.prepare import PrepareConfig, prepare_shards
    from ckray.lexical.bm25 import bm25_retriever, build_bm25_index
    from ckray.lexical.pool import SearcherPool, chunks

    prepare_shards(PrepareConfig(data=args.data, workdir=args.workdir, shards=4))  # starts Ray
    build_bm25_index(args.workdir)
    queries, _ = read_queries_and_qrels(Path(args.data))
    pieces = [({q: queries[q] for q in piece}, args.k) for piece in chunks(list(queries), args.chunk)]
    factory = functools.partial(bm25_retriever, str(Path(args.workdir).resolve()), threads=args.threads)
    # every pool held at once (CPU reservations of 0: only one pool searches at a time)
    pools = {n: SearcherPool(factory, n, cpus_per_actor=0) for n in args.actors}
    one = factory().search(queries, k=args.k)  # the reference run: one searcher in this process
    times: dict[int, list[float]] = {n: [] for n in args.actors}
    for n, pool in pools.items():  # warm-up: JIT and index pages, on every actor
        list(pool.map(_search, pieces[:2 * n]))
    for _ in range(args.repeats):
        for n, pool in pools.items():
            t0 = time.perf_counter()
            run: dict = {}
            for part in pool.map(_search, pieces):
                run.update(part)
            times[n].append(time.perf_counter() - t0)
            assert run == one, f"{n} actors: the run differs from one searcher's"
    for pool in pools.values():
        pool.close()
    qps = {n: len(queries) / min(t) for n, t in times.items()}
    base = qps[args.actors[0]]
    print(f"{len(queries)} queries, k={args.k}, {args.threads} thread(s) per actor, {args.chunk} queries a call, "
          f"{os.cpu_count()} cores")
    for n in args.actors:
        print(f"{n} actor(s): {qps[n]:8.1f} q/s  ({qps[n] / base:.2f}x)")
    print(json.dumps({"bench": "bm25_actors", "queries": len(queries), "k": args.k, "threads": args.threads,
                      "chunk": args.chunk, "cores": os.cpu_count(), "repeats": args.repeats,
                      "qps": {str(n): round(q, 1) for n, q in qps.items()},
                      "ratio": {str(n): round(q / base, 2) for n, q in qps.items()},
                      "same_run_as_one_searcher": True}))
    ray.shutdown()


def _search(retriever, queries: dict[str, str], k: int) -> dict:
    return retriever.search(queries, k=k)


if __name__ == "__main__":
    main()
