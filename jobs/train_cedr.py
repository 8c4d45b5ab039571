"""Train a CEDR reranker (KNRM, PACRR, DRMM) or the vanilla BERT ranker on the shared loop.

    python jobs/train_cedr.py --data DIR --workdir W --variant knrm|pacrr|drmm|vanilla --workers N

Pairwise loss on (query, relevant, BM25 negative) triples; the encoder is fine-tuned at --lr, the
ranker head 50× faster (the paper's 2e-5 / 1e-3). Writes W/checkpoints/cedr-<variant> (vanilla-bert).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.stages import main_for  # noqa: E402

if __name__ == "__main__":
    main_for("train:cedr-knrm", __doc__)
