"""Train the QDS-Transformer cross-encoder on the shared Ray Train + DeepSpeed loop.

    python jobs/train_qds.py --data DIR --workdir W --workers N [--pattern qds|longformer-qa|local]

Writes W/checkpoints/qds (qds-longformer-qa, qds-local for the ablations); pipeline bm25>qds.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.stages import main_for  # noqa: E402

if __name__ == "__main__":
    main_for("train:qds", __doc__)
