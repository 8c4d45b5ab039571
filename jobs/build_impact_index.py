"""Build the CK-QTI impact index: Ray Data batch inference over the corpus shards, then Lucene.

    python jobs/build_impact_index.py --data DIR --workdir W --checkpoint CKPT [--top-k K] [--actors N] [--use-gpu]

Writes W/impact/shards/part-NNNNN.parquet (doc_id, terms, weights = s_td + β·s_explicit_td, β =
--explicit-weight), W/impact/jsonl/*.jsonl
(Pyserini JsonVectorCollection, integer weights) and the Lucene impact index W/impact/index (with
ckray_impact.json: checkpoint, top_k, scale, documents). A re-run skips finished shards and an
up-to-date index. The checkpoint may come from another collection (defaults to W/checkpoints/ck-qti).
Search it with the pipeline `ck-qti` (jobs/evaluate.py --pipeline ck-qti).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.stages import main_for  # noqa: E402

if __name__ == "__main__":
    main_for("index:ck-qti", __doc__)
