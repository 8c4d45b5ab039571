"""Paired difference of two work directories' same-named runs: per query, a measure of A's run minus B's, the mean
and its standard error, over the split's judged queries (a query a run misses scores 0).

    python scripts/paired_runs.py A B --data DIR [--split test] [--measure nDCG@10] [--against PIPELINE]

A and B are work directories holding ``runs/<pipeline>-<split>.trec`` (``jobs/evaluate.py``, ``jobs/benchmark.py``:
``<root>/<collection>``); DIR is the collection whose ``--split`` qrels judge them. Prints a row per run name the
two share; exits 1 when they share none. With ``--against PIPELINE`` every run of A is compared with B's run of
PIPELINE instead (A and B may be the same directory: each run against its own ``bm25``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ckray.data.collections import read_queries_and_qrels, read_trec_run
from ckray.eval import paired_difference, per_query_values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--data", required=True, type=Path, help="the collection (its qrels judge the runs)")
    p.add_argument("--split", default="test")
    p.add_argument("--measure", default="nDCG@10")
    p.add_argument("--against", metavar="PIPELINE", help="compare every run of A with this run of B")
    args = p.parse_args(argv)
    qrels = {q: d for q, d in read_queries_and_qrels(args.data)[1].get(args.split, {}).items() if d}
    if not qrels:
        print(f"{args.data} has no judged queries in split {args.split!r}")
        return 1
    names = sorted(r.name for r in (args.a / "runs").glob(f"*-{args.split}.trec"))
    if args.against:
        baseline = args.b / "runs" / f"{args.against}-{args.split}.trec"
        if not baseline.exists():
            print(f"no run {baseline}")
            return 1
    else:
        names = sorted(set(names) & {r.name for r in (args.b / "runs").glob(f"*-{args.split}.trec")})
    if not names:
        print(f"no run of split {args.split!r} in both {args.a / 'runs'} and {args.b / 'runs'}")
        return 1
    def values(path: Path) -> list[float]:
        return per_query_values(read_trec_run(path), qrels, args.measure)

    against = values(baseline) if args.against else None   # read and judged once
    print(f"{'run':<32} {'A':>7} {'B':>7} {'A − B':>8} {'± se':>7}  ({args.measure}, {len(qrels)} queries)")
    for name in names:
        va = values(args.a / "runs" / name)
        vb = against if against is not None else values(args.b / "runs" / name)
        diff, se = paired_difference(va, vb)
        print(f"{name[:-len(f'-{args.split}.trec')]:<32} {sum(va) / len(va):>7.4f} {sum(vb) / len(vb):>7.4f} "
              f"{diff:>+8.4f} {se:>7.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
