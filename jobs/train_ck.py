"""Train CK-QTI (or the full CK / the TK baseline) on the shared Ray Train + DeepSpeed loop.

    python jobs/train_ck.py --data DIR --workdir W --workers N [--use-gpu] [--qti/--no-qti]

Writes the checkpoint chosen on dev nDCG@10 (held-back training queries) to W/checkpoints/ck-qti
(ck with --no-qti, tk with --attention quadratic).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.stages import main_for  # noqa: E402

if __name__ == "__main__":
    main_for("train:ck-qti", __doc__)
