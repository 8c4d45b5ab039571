"""Train the QDS-Transformer cross-encoder on the shared Ray Train + DeepSpeed loop.

    python jobs/train_qds.py --data DIR --workdir W --workers N [--pattern qds|longformer-qa|local]

Writes W/checkpoints/qds (qds-longformer-qa, qds-local for the ablations); pipeline bm25>qds.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import run_job  # noqa: E402
from ckray.train_job import training_parser  # noqa: E402


def main(args) -> None:
    from ckray.stages import train_qds

    train_qds(args)


def parser():
    from ckray.stages import add_qds_args

    return add_qds_args(training_parser(__doc__))


if __name__ == "__main__":
    run_job(main, parser())
