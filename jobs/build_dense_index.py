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
    from ckray.data.collections import read_queries_and_qrels
    from ckray.index.dense import EmbedConfig, IndexConfig, build_dense_index, tune_hybrid
    from ckray.ray_env import init_ray

    init_ray()
    checkpoint = args.checkpoint or str(Path(args.workdir) / "checkpoints" / "clear")
    _, summary = build_dense_index(args.workdir, checkpoint,
                                   EmbedConfig(actors=args.actors, use_gpu=args.use_gpu, float16=args.float16),
                                   IndexConfig(kind=args.index))
    print(f"embedding job: {summary}")
    queries, qrels = read_queries_and_qrels(Path(args.data))
    if args.tune_split in qrels:
        split_q = {q: queries[q] for q in qrels[args.tune_split] if q in queries}
        config = tune_hybrid(args.workdir, split_q, qrels[args.tune_split], checkpoint)
        print(f"λ_test = {config.lam} (tuned on {len(split_q)} {args.tune_split} queries)")


def parser():
    p = base_parser(__doc__)
    p.add_argument("--checkpoint", default=None, help="CLEAR checkpoint (default W/checkpoints/clear)")
    p.add_argument("--actors", type=int, default=1)
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--float16", action="store_true", help="store embedding shards as float16")
    p.add_argument("--index", choices=("flat", "hnsw", "ivf", "ivfpq"), default="flat")
    p.add_argument("--tune-split", default="train", help="qrels split whose queries tune λ_test (never test)")
    return p


if __name__ == "__main__":
    run_job(main, parser())
