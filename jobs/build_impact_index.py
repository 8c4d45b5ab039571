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


def ensure_shards(data: str, workdir: str) -> None:
    """Shard the corpus when the work directory has no shards yet (idempotent otherwise)."""
    from ckray.data.prepare import PrepareConfig, prepare_shards
    from ckray.data.shards import MANIFEST, read_json, shards_dir

    manifest = shards_dir(workdir) / MANIFEST
    shards = read_json(manifest)["num_shards_requested"] if manifest.exists() else PrepareConfig.shards
    prepare_shards(PrepareConfig(data=data, workdir=workdir, shards=shards))


def build(args) -> dict:
    """The job; returns its summary (``build_impact_index``'s)."""
    from ckray.index.impact import ImpactConfig, _check_checkpoint, build_impact_index, default_checkpoint

    checkpoint = args.checkpoint or str(default_checkpoint(args.workdir))
    _check_checkpoint(checkpoint)  # a clear error before any work
    config = ImpactConfig(top_k=args.top_k, expansion_candidates=args.expansion_candidates,
                          candidate_pool=args.candidate_pool, quant_max=args.quant_max, scale=args.scale,
                          actors=args.actors, use_gpu=args.use_gpu, cpus_per_actor=args.cpus_per_actor,
                          batch_size=args.batch_size, token_budget=args.token_budget,
                          index_threads=args.index_threads)
    config.validate()
    ensure_shards(args.data, args.workdir)
    return build_impact_index(args.workdir, checkpoint, config)


def main(args) -> None:
    import json

    print(json.dumps(build(args), sort_keys=True))


def parser():
    p = base_parser(__doc__)
    p.add_argument("--checkpoint", default=None, help="CK-QTI checkpoint directory (default: W/checkpoints/ck-qti)")
    p.add_argument("--top-k", type=int, default=128, help="terms kept per document")
    p.add_argument("--expansion-candidates", type=int, default=256,
                   help="vocabulary terms added to a document's own terms as candidates")
    p.add_argument("--candidate-pool", choices=("window", "position"), default="window",
                   help="how expansion candidates are chosen (window: cheap; position: GPU)")
    p.add_argument("--quant-max", type=int, default=255, help="integer the largest weight maps to")
    p.add_argument("--scale", type=float, default=None, help="fixed quantisation scale (overrides --quant-max)")
    p.add_argument("--actors", type=int, default=1, help="actor pool size (one model copy each)")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per actor")
    p.add_argument("--cpus-per-actor", type=float, default=1.0, help="CPUs (and torch threads) per actor")
    p.add_argument("--batch-size", type=int, default=64, help="documents per Ray Data batch")
    p.add_argument("--token-budget", type=int, default=8192, help="padded word pieces per forward pass")
    p.add_argument("--index-threads", type=int, default=2, help="Lucene indexing threads")
    return p


if __name__ == "__main__":
    run_job(main, parser())
