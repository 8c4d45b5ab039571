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
    from ckray.options import options_from_args

    print(run_full_pipeline(options_from_args(FullPipelineConfig, args, workdir=args.workdir)))


def parser():
    from ckray.full_pipeline import FullPipelineConfig
    from ckray.options import add_options

    return add_options(base_parser(__doc__, data=False), FullPipelineConfig)


if __name__ == "__main__":
    run_job(main, parser())
