"""Build the CK-QTI impact index: Ray Data batch inference over the corpus shards, then Lucene.

    python jobs/build_impact_index.py --data DIR --workdir W --checkpoint CKPT [--top-k K] [--actors N] [--use-gpu]

Writes W/impact/shards/part-NNNNN.parquet (doc_id, terms, weights = s_td), W/impact/jsonl/*.jsonl
(Pyserini JsonVectorCollection, integer weights) and the Lucene impact index W/impact/index (with
ckray_impact.json: checkpoint, top_k, scale, documents). A re-run skips finished shards and an
up-to-date index. The checkpoint may come from another collection (defaults to W/checkpoints/ck-qti).
Search it with the pipeline `ck-qti` (jobs/evaluate.py --pipeline ck-qti).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import base_parser, run_job  # noqa: E402


def build(args) -> dict:
    """The job; returns its summary (``build_impact_index``'s)."""
    from ckray.stages import build_impact

    return build_impact(args)


def main(args) -> None:
    import json

    print(json.dumps(build(args), sort_keys=True))


def parser():
    from ckray.stages import add_impact_args

    return add_impact_args(base_parser(__doc__))


if __name__ == "__main__":
    run_job(main, parser())
