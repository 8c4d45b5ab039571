"""Train CLEAR (the BM25-residual dense retriever) on the shared Ray Train + DeepSpeed loop.

    python jobs/train_clear.py --data DIR --workdir W --workers N [--use-gpu] [--constant-margin]

Loss: [m_r − s_emb(q,d+) + s_emb(q,d−)]_+ with m_r = ξ − λ_train·(s_lex(q,d+) − s_lex(q,d−)), negatives
from BM25's top 1000. Writes W/checkpoints/clear (clear-constant with --constant-margin).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.stages import main_for  # noqa: E402

if __name__ == "__main__":
    main_for("train:clear", __doc__)
