"""The whole chain on one collection: prepare → train → index → evaluate → report.

    python jobs/pipeline.py --workdir W                # bundled synthetic sample (generated), local Ray
    python jobs/pipeline.py --workdir W --data DIR     # any BEIR / MS MARCO directory
    python jobs/pipeline.py --workdir W --models ck-qti,cedr-knrm --max-steps 200

Stages: prepare (shards, BM25, negatives) → train CK-QTI, CLEAR, CEDR-KNRM, QDS-Transformer a few
steps each on the training queries (the code of jobs/train_*.py) → CK-QTI impact index, CLEAR dense
index + hybrid λ (jobs/build_*_index.py) → evaluate every pipeline whose artifacts exist → report.
A re-run skips finished work (training already at its step count, built shards and indexes, and
the evaluation of pipelines whose inputs did not change).
Writes W/report.md (every pipeline's metrics, training, stage wall times), W/report.png and
W/pipeline_summary.json.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import base_parser, run_job  # noqa: E402


def main(args) -> None:
    from ckray.full_pipeline import FullPipelineConfig, run_full_pipeline

    config = FullPipelineConfig(workdir=args.workdir, data=args.data, split=args.split,
                                models=args.models.split(",") if args.models is not None else None,
                                workers=args.workers, use_gpu=args.use_gpu, max_steps=args.max_steps,
                                shards=args.shards, rerank_depth=args.rerank_depth, train_split=args.train_split,
                                reevaluate=args.reevaluate)
    report = run_full_pipeline(config)
    print(report)


def parser():
    from ckray.full_pipeline import MODEL_DEFAULTS

    p = base_parser(__doc__, data=False)
    p.add_argument("--data", default=None, help="collection directory (default: generate the bundled sample)")
    p.add_argument("--split", default="test", help="qrels split the pipelines are evaluated on")
    p.add_argument("--train-split", default="train", help="qrels split the models are trained (and λ tuned) on")
    p.add_argument("--models", default=None,
                   help=f"comma-separated models to train and index (default: all of {','.join(MODEL_DEFAULTS)}; "
                        "'' for none)")
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers per model")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per training worker and index actor")
    p.add_argument("--max-steps", type=int, default=None,
                   help="training steps of every model (default: per model, "
                        + ", ".join(f"{m} {d['steps']}" for m, d in MODEL_DEFAULTS.items()) + ")")
    p.add_argument("--shards", type=int, default=4, help="corpus shards")
    p.add_argument("--rerank-depth", type=int, default=10, help="first-stage documents each reranker rescores")
    p.add_argument("--reevaluate", action="store_true",
                   help="evaluate every pipeline again, even those whose inputs did not change")
    return p


if __name__ == "__main__":
    run_job(main, parser())
