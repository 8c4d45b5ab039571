"""Train CK-QTI (or the full CK / the TK baseline) on the shared Ray Train + DeepSpeed loop.

    python jobs/train_ck.py --data DIR --workdir W --workers N [--use-gpu] [--qti/--no-qti]

Writes the checkpoint chosen on dev nDCG@10 (held-back training queries) to W/checkpoints/ck-qti
(ck with --no-qti, tk with --attention quadratic).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import run_job  # noqa: E402
from ckray.train_job import training_parser  # noqa: E402


def main(args) -> None:
    from ckray.stages import train_ck

    train_ck(args)


def parser():
    from ckray.stages import add_ck_args

    return add_ck_args(training_parser(__doc__))


if __name__ == "__main__":
    run_job(main, parser())
