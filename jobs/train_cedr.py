"""Train a CEDR reranker (KNRM, PACRR, DRMM) or the vanilla BERT ranker on the shared loop.

    python jobs/train_cedr.py --data DIR --workdir W --variant knrm|pacrr|drmm|vanilla --workers N

Pairwise loss on (query, relevant, BM25 negative) triples; the encoder is fine-tuned at --lr, the
ranker head 50× faster (the paper's 2e-5 / 1e-3). Writes W/checkpoints/cedr-<variant> (vanilla-bert).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import run_job  # noqa: E402
from ckray.train_job import training_parser  # noqa: E402


def main(args) -> None:
    from ckray.stages import train_cedr

    train_cedr(args)


def parser():
    from ckray.stages import add_cedr_args

    return add_cedr_args(training_parser(__doc__))


if __name__ == "__main__":
    run_job(main, parser())
