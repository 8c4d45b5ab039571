"""Zero-shot evaluation over several collections (BEIR-style): trained checkpoints on collections they
never saw, one table.

    python jobs/benchmark.py --from-workdir W --data DIR1 --data DIR2 --pipeline bm25 --pipeline ck-qti \
        --pipeline clear --pipeline bm25+ck-qti --workdir-root bench-W

Each collection gets a work directory under --workdir-root: prepared (shards, BM25; idempotent), the
checkpoints linked from --checkpoints (or --from-workdir's W/checkpoints), the first stages' indexes
built from them, every pipeline evaluated on --split. A collection without training queries uses the λ,
w, top-k and β saved with the checkpoints where they were trained (deploy.json); nothing is tuned on
--split. Writes benchmark.md, benchmark.json and benchmark.png under --workdir-root (a row per
pipeline, a column per collection, the mean) and prints the table.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import HelpFormatter, run_job  # noqa: E402


def main(args) -> None:
    from ckray import api
    from ckray.benchmark import markdown_table

    checkpoints = args.checkpoints or (str(Path(args.from_workdir) / "checkpoints") if args.from_workdir else None)
    if checkpoints is None:
        from ckray.errors import ConfigError

        raise ConfigError("--checkpoints DIR or --from-workdir W: where the trained checkpoints are")
    index_options = {"ck-qti": {k: v for k, v in (("top_k", args.top_k), ("explicit_weight", args.explicit_weight))
                                if v is not None}}
    table = api.benchmark(args.data, checkpoints, pipelines=args.pipeline or ["bm25"],
                          workdir_root=args.workdir_root, split=args.split, measure=args.measure, k=args.k,
                          rerank_depth=args.rerank_depth, shards=args.shards, index_options=index_options,
                          lam=args.lam, fusion_weight=args.fusion_weight)
    print(markdown_table(table))
    print(f"written: {', '.join(str(Path(args.workdir_root) / f) for f in ('benchmark.md', 'benchmark.json', 'benchmark.png'))}")


def parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--data", action="append", required=True, help="collection directory (repeatable: a column each)")
    p.add_argument("--workdir-root", default="benchmark", help="one work directory per collection under it, and the table")
    p.add_argument("--checkpoints", default=None, help="directory of the trained checkpoints (a training W/checkpoints)")
    p.add_argument("--from-workdir", default=None, help="the training work directory (its W/checkpoints)")
    p.add_argument("--pipeline", action="append",
                   help="pipeline name (repeatable), e.g. bm25, ck-qti, clear, bm25+ck-qti (default: bm25)")
    p.add_argument("--split", default="test", help="qrels split evaluated in every collection")
    p.add_argument("--measure", default="nDCG@10", help="measure of the table")
    p.add_argument("--k", type=int, default=1000, help="results kept per query")
    p.add_argument("--rerank-depth", type=int, default=100, help="first-stage results a reranker rescores")
    p.add_argument("--shards", type=int, default=4, help="corpus shards per collection")
    p.add_argument("--top-k", type=int, default=None,
                   help="CK-QTI impact index: terms kept per document (default: the checkpoint's deploy.json, else 256)")
    p.add_argument("--explicit-weight", type=float, default=None,
                   help="CK-QTI impact index: β (default: the checkpoint's deploy.json, else 0.5)")
    p.add_argument("--lambda", dest="lam", type=float, default=None, help="CLEAR's λ_test instead of the carried one")
    p.add_argument("--fusion-weight", type=float, default=None, help="w of every first+reranker instead of the carried one")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level")
    return p


if __name__ == "__main__":
    run_job(main, parser())
