"""The whole chain on one collection: prepare → train → index → evaluate → report.

    python jobs/pipeline.py --workdir W                # bundled synthetic sample (generated), local Ray
    python jobs/pipeline.py --workdir W --data DIR     # any BEIR / MS MARCO directory

Writes W/report.md (a table of every pipeline's metrics) and W/report.png.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import base_parser, run_job  # noqa: E402


def main(args) -> None:
    from ckray.full_pipeline import FullPipelineConfig, run_full_pipeline

    config = FullPipelineConfig(workdir=args.workdir, data=args.data, split=args.split,
                                models=args.models.split(",") if args.models else None,
                                workers=args.workers, use_gpu=args.use_gpu, max_steps=args.max_steps)
    report = run_full_pipeline(config)
    print(report)


def parser():
    p = base_parser(__doc__, data=False)
    p.add_argument("--data", default=None, help="collection directory (default: generate the bundled sample)")
    p.add_argument("--split", default="test")
    p.add_argument("--models", default=None, help="comma-separated models to train (default: all available)")
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers")
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--max-steps", type=int, default=None, help="training steps per model (default: per model)")
    return p


if __name__ == "__main__":
    run_job(main, parser())
