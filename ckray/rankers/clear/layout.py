"""Where CLEAR's dense artifacts live under the work directory ``W`` (the paths the embedding job,
the faiss index and the retrievers share)::

    W/shards/part-NNNNN.parquet           corpus shards (doc_id, title, text)          ckray.data.shards
    W/dense/shards/part-NNNNN.parquet     one embedding shard per corpus shard, a row per passage vector:
                                          doc_id: string, embedding: fixed_size_list<float32|float16>[D],
                                          passage: int32 (0 opens a document; absent with --passages 1)
                                          (+ part-NNNNN.parquet.done.json: what it was computed from)
                                          ``ckray.rankers.clear.embed``
    W/dense/index/                        index.faiss, doc_ids.parquet (row i ↔ faiss id i), meta.json
                                          ``ckray.rankers.clear.faiss_index``
    W/dense/hybrid.json                   λ_test tuned on training queries (``ckray.rankers.clear.hybrid``)
"""

from __future__ import annotations

import os
from pathlib import Path

from ckray.workdir import WorkDir

DENSE_DIR = "dense"


def dense_root(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).ranker_dir(DENSE_DIR)


def embeddings_dir(workdir: str | os.PathLike) -> Path:
    return dense_root(workdir) / "shards"


def index_dir(workdir: str | os.PathLike) -> Path:
    return dense_root(workdir) / "index"


def default_checkpoint(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).checkpoint("clear")

