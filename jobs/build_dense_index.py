"""Encode the corpus with a CLEAR checkpoint (Ray Data actor pool), build the faiss index, and tune
the hybrid weight λ_test on *training* queries.

    python jobs/build_dense_index.py --data DIR --workdir W --checkpoint CKPT [--actors N] [--use-gpu]

Writes W/dense/shards (embedding shards, resumable), W/dense/index (faiss + doc ids) and
W/dense/hybrid.json (λ_test). Pipelines: clear-dense, clear.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.stages import main_for  # noqa: E402

if __name__ == "__main__":
    main_for("index:clear", __doc__)
