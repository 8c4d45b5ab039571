"""Compare the TREC run files of two work directories (or two run files): same documents in the same
order for every query, scores equal within a tolerance.

    python scripts/compare_runs.py A B [--tolerance 1e-5]

A and B are work directories (their ``runs/*.trec`` are compared by name) or two run files. Prints one
row per run file and exits 1 when any differs or is missing on one side.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Comparison:
    name: str
    queries: int = 0
    docs: int = 0
    max_score_diff: float = 0.0
    problem: str | None = None     # None: the same run


def read_trec(path: Path) -> dict[str, list[tuple[str, float]]]:
    """``{query: [(doc, score), …]}`` in file order (the rank order)."""
    run: dict[str, list[tuple[str, float]]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 6:
            raise ValueError(f"{path}:{n}: expected 6 columns (qid Q0 doc rank score tag), got {len(parts)}")
        run.setdefault(parts[0], []).append((parts[2], float(parts[4])))
    return run


def compare(name: str, a: Path, b: Path, tolerance: float) -> Comparison:
    """How run file ``b`` differs from ``a``: the first difference found, or none."""
    c = Comparison(name)
    if not a.exists() or not b.exists():
        c.problem = f"missing in {'A' if not a.exists() else 'B'}"
        return c
    ra, rb = read_trec(a), read_trec(b)
    c.queries, c.docs = len(ra), sum(len(v) for v in ra.values())
    if set(ra) != set(rb):
        c.problem = f"queries differ: {len(set(ra) ^ set(rb))} in one run only"
        return c
    for q in sorted(ra):
        docs_a, docs_b = [d for d, _ in ra[q]], [d for d, _ in rb[q]]
        if docs_a != docs_b:
            rank = next((i for i, (x, y) in enumerate(zip(docs_a, docs_b)) if x != y), min(len(docs_a), len(docs_b)))
            c.problem = f"query {q}: documents differ from rank {rank + 1}"
            return c
        diff = max((abs(x - y) for (_, x), (_, y) in zip(ra[q], rb[q])), default=0.0)
        c.max_score_diff = max(c.max_score_diff, diff)
    if c.max_score_diff > tolerance:
        c.problem = f"scores differ by up to {c.max_score_diff:.3g} (> {tolerance:g})"
    return c


def run_pairs(a: Path, b: Path) -> list[tuple[str, Path, Path]]:
    """``(name, file in A, file in B)``: the two files, or every ``runs/*.trec`` of either work directory."""
    if a.is_file() or b.is_file():
        return [(a.name, a, b)]
    names = sorted({p.name for p in (a / "runs").glob("*.trec")} | {p.name for p in (b / "runs").glob("*.trec")})
    return [(n, a / "runs" / n, b / "runs" / n) for n in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="work directory or run file")
    p.add_argument("b", type=Path, help="work directory or run file")
    p.add_argument("--tolerance", type=float, default=1e-5, help="largest score difference taken as equal")
    args = p.parse_args(argv)
    pairs = run_pairs(args.a, args.b)
    if not pairs:
        print(f"no run files under {args.a}/runs or {args.b}/runs", file=sys.stderr)
        return 1
    results = [compare(name, fa, fb, args.tolerance) for name, fa, fb in pairs]
    width = max(len(r.name) for r in results)
    print(f"{'run':<{width}}  queries    docs  max |Δscore|  result")
    for r in results:
        print(f"{r.name:<{width}}  {r.queries:7d} {r.docs:7d}  {r.max_score_diff:12.3g}  {r.problem or 'same'}")
    differ = [r for r in results if r.problem]
    print(f"{len(results) - len(differ)} of {len(results)} run files the same")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
