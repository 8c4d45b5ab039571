"""Shard a collection with Ray Data, build the BM25 index and BM25 training negatives.

    python jobs/prepare.py --data DIR --workdir W [--shards N]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import base_parser, run_job  # noqa: E402


def main(args) -> None:
    from ckray.data.collections import load_collection
    from ckray.data.prepare import check_prepare_options, prepare_collection

    check_prepare_options(args.shards, args.threads, args.negative_depth)  # before reading the collection
    collection = load_collection(args.data, strict_qrels=args.strict_qrels)
    print(f"collection {collection.name}: {collection.stats}")
    prepared = prepare_collection(args.data, args.workdir, shards=args.shards,
                                  split=None if args.no_negatives else args.train_split, collection=collection,
                                  threads=args.threads, negative_depth=args.negative_depth)
    print(f"shards: {len(prepared.manifest['shards'])}, documents: {prepared.manifest['documents']}")


def parser():
    p = base_parser(__doc__)
    p.add_argument("--shards", type=int, default=4, help="number of corpus shards")
    p.add_argument("--threads", type=int, default=2, help="Lucene indexing/search threads")
    p.add_argument("--train-split", default="train", help="qrels split whose queries get BM25 negatives")
    p.add_argument("--negative-depth", type=int, default=1000, help="BM25 depth for training negatives")
    p.add_argument("--no-negatives", action="store_true", help="skip the training negatives")
    p.add_argument("--strict-qrels", action="store_true",
                   help="refuse qrels that name a document not in the corpus or a query without a text; "
                        "without it they are kept, counted and reported once")
    return p


if __name__ == "__main__":
    run_job(main, parser())
