"""Shard a collection with Ray Data, build the BM25 index and BM25 training negatives.

    python jobs/prepare.py --data DIR --workdir W [--shards N] [--max-shard-mb MB]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import base_parser, run_job  # noqa: E402


def main(args) -> None:
    from ckray.data.collections import load_collection
    from ckray.data.prepare import PrepareOptions, prepare_collection
    from ckray.options import options_from_args

    options = options_from_args(PrepareOptions, args)  # checked before the collection is read
    collection = load_collection(args.data, strict_qrels=options.strict_qrels)
    print(f"collection {collection.name}: {collection.stats}")
    prepared = prepare_collection(args.data, args.workdir, shards=options.shards,
                                  split=options.train_split if options.negatives else None, collection=collection,
                                  threads=options.threads, negative_depth=options.negative_depth,
                                  max_shard_mb=options.max_shard_mb)
    print(f"shards: {len(prepared.manifest['shards'])}, documents: {prepared.manifest['documents']}")


def parser():
    from ckray.data.prepare import PrepareOptions
    from ckray.options import add_options

    return add_options(base_parser(__doc__), PrepareOptions)


if __name__ == "__main__":
    run_job(main, parser())
