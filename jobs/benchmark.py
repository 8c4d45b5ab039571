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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import base_parser, run_job  # noqa: E402

IMPACT_FLAGS = ("top_k", "explicit_weight")   # of the CK-QTI impact index job's options, passed on
DENSE_FLAGS = ("doc_max_len", "lambda_rule")  # of the CLEAR dense index job's options, passed on
BOTH_FLAGS = ("passages",)                    # of both jobs: how much of a long document is read


def _given(args, flags: tuple[str, ...]) -> dict:
    """The index job options among ``flags`` that were given on the command line."""
    return {k: getattr(args, k) for k in flags if getattr(args, k) is not None}


def main(args) -> None:
    from ckray.benchmark import BenchmarkConfig, markdown_table, run_benchmark
    from ckray.options import options_from_args

    from_workdir = str(Path(args.from_workdir) / "checkpoints") if args.from_workdir else None
    index_options = {"ck-qti": _given(args, IMPACT_FLAGS + BOTH_FLAGS), "clear": _given(args, DENSE_FLAGS + BOTH_FLAGS)}
    c = options_from_args(BenchmarkConfig, args, checkpoints=from_workdir,   # --checkpoints wins
                          index_options=index_options)
    table = run_benchmark(c)
    print(markdown_table(table))
    print(f"written: {', '.join(str(Path(c.workdir_root) / f) for f in ('benchmark.md', 'benchmark.json', 'benchmark.png'))}")


def parser():
    from ckray.benchmark import BenchmarkConfig
    from ckray.options import add_options
    from ckray.rankers.ck_qti.options import ImpactIndexOptions
    from ckray.rankers.clear.options import DenseIndexOptions

    p = add_options(base_parser(__doc__, data=False, workdir=False), BenchmarkConfig)
    p.add_argument("--from-workdir", default=None, metavar="W",
                   help="the training work directory: its W/checkpoints (instead of --checkpoints)")
    add_options(p, ImpactIndexOptions, "CK-QTI impact index", only=IMPACT_FLAGS)
    add_options(p, DenseIndexOptions, "CLEAR dense index", only=DENSE_FLAGS)
    return add_options(p, ImpactIndexOptions, "long documents (CK-QTI and CLEAR indexes)", only=BOTH_FLAGS)


if __name__ == "__main__":
    run_job(main, parser())
