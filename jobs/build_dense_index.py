"""Encode the corpus with a CLEAR checkpoint (Ray Data actor pool), build the faiss index, and tune
the hybrid weight λ_test on *training* queries.

    python jobs/build_dense_index.py --data DIR --workdir W --checkpoint CKPT [--actors N] [--use-gpu]

Writes W/dense/shards (embedding shards, resumable), W/dense/index (faiss + doc ids) and
W/dense/hybrid.json (λ_test). Pipelines: clear-dense, clear.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import base_parser, run_job  # noqa: E402


def main(args) -> None:
    from ckray.stages import build_dense

    summary = build_dense(args)
    lam = summary.pop("lambda")
    tuned = {k: summary.pop(k) for k in ("tune_queries", "tune_split") if k in summary}
    print(f"embedding job: {summary}")
    if lam is not None:
        print(f"λ_test = {lam} (tuned on {tuned['tune_queries']} {tuned['tune_split']} queries)")


def parser():
    from ckray.stages import add_dense_args

    return add_dense_args(base_parser(__doc__))


if __name__ == "__main__":
    run_job(main, parser())
