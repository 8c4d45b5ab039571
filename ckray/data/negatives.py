"""BM25 negatives: the top ``depth`` of every query of a split, and the BM25 score of every judged positive,
made once at prepare and read by the training data (``ckray.data.examples``) and by the benches.

``build_negatives`` searches on a pool of Ray actors (:mod:`ckray.lexical.pool`) and writes the rows as they
arrive to ``W/negatives/<split>.parquet`` *sorted by query id* (each query's rows by rank), so a reader of a
range of query ids (``read_negatives``) reads only the row groups that hold them;
``W/negatives/<split>-positives.parquet`` holds the judged positives' scores, which CLEAR's margin needs also
when a positive is outside the top ``depth``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ckray.errors import MissingArtifactError
from ckray.workdir import WorkDir

log = logging.getLogger(__name__)

Run = dict[str, list[tuple[str, float]]]

NEGATIVES_SCHEMA = pa.schema([("query_id", pa.string()), ("doc_id", pa.string()), ("rank", pa.int32()),
                              ("score", pa.float32())])
POSITIVES_SCHEMA = pa.schema([("query_id", pa.string()), ("doc_id", pa.string()), ("score", pa.float32())])
NEGATIVES_ORDER = "query_id"       # in the negatives' marker: rows sorted by query id, each query by rank


def negatives_path(workdir: str | os.PathLike, split: str = "train") -> Path:
    return WorkDir(workdir).negatives(split)


def positives_path(workdir: str | os.PathLike, split: str = "train") -> Path:
    return WorkDir(workdir).positives(split)


def build_negatives(workdir: str | os.PathLike, queries: dict[str, str], qrels: dict[str, dict[str, int]],
                    split: str = "train", depth: int = 1000, threads: int = 2, actors: int | None = None) -> Path:
    """BM25 top-``depth`` (with scores) for each query of ``split`` → ``W/negatives/<split>.parquet``
    (sorted by query id, each query's rows by rank), and the BM25 score of every judged positive →
    ``W/negatives/<split>-positives.parquet`` (CLEAR's margin needs s_lex(q, d+) also when d+ is
    outside the top 1000). Searched on ``actors`` Ray actors with ``threads`` Lucene threads each
    (None: as many as the cluster's CPUs hold); the rows stream into the files as the actors answer.
    Files made for the same queries and qrels at ``depth`` or deeper are kept."""
    from ckray.data.shards import mark_done
    from ckray.lexical.bm25 import bm25_retriever
    from ckray.lexical.pool import SearcherPool, chunks, default_actors

    out, pos_out = negatives_path(workdir, split), positives_path(workdir, split)
    stamp = {"queries_sha": stable_digest(queries), "qrels_sha": stable_digest(qrels), "depth": depth,
             "order": NEGATIVES_ORDER}
    made = _negatives_depth(out, pos_out, stamp)
    if made is not None:
        log.info("negatives for %s are up to date (depth %d, %d asked for)", split, made, depth)
        return out
    pieces = chunks(sorted(queries))
    work = (({q: queries[q] for q in piece}, {q: judged_positives(qrels.get(q, {})) for q in piece}, depth)
            for piece in pieces)
    with _ParquetOut(out, NEGATIVES_SCHEMA) as neg_file, _ParquetOut(pos_out, POSITIVES_SCHEMA) as pos_file:
        if pieces:
            factory = functools.partial(bm25_retriever, str(Path(workdir).resolve()), threads=threads)
            with SearcherPool(factory, actors or default_actors(threads, len(pieces)), threads) as pool:
                for negatives, positives in pool.map(_negatives_of_chunk, work):
                    neg_file.write(negatives)
                    pos_file.write(positives)
    mark_done(out, stamp)
    mark_done(pos_out, stamp)
    log.info("BM25 top-%d negatives for %d %s queries → %s", depth, len(queries), split, out)
    return out


def judged_positives(judgments: dict[str, int]) -> list[str]:
    """The documents a query's judgments call relevant (grade > 0)."""
    return [d for d, rel in judgments.items() if rel > 0]


def _negatives_of_chunk(searcher: Any, queries: dict[str, str], positives: dict[str, list[str]],
                        depth: int) -> tuple[pa.Table, pa.Table]:
    """In a pool actor: the negatives rows of ``queries`` (in their order, each by rank) and the BM25
    score of each judged positive (from the run, or scored alone when outside it)."""
    run = searcher.search(queries, k=depth)
    neg = {"query_id": [], "doc_id": [], "rank": [], "score": []}
    pos = {"query_id": [], "doc_id": [], "score": []}
    for q in queries:
        for rank, (d, s) in enumerate(run[q], start=1):
            neg["query_id"].append(q), neg["doc_id"].append(d), neg["rank"].append(rank), neg["score"].append(s)
        in_run = dict(run[q])
        for d in positives[q]:
            s = in_run.get(d)
            pos["query_id"].append(q), pos["doc_id"].append(d)
            pos["score"].append(s if s is not None else searcher.score(queries[q], d))
    return pa.table(neg, schema=NEGATIVES_SCHEMA), pa.table(pos, schema=POSITIVES_SCHEMA)


class _ParquetOut:
    """A Parquet file written a table at a time into a temporary name and renamed into place when the
    ``with`` block ends without an error (removed otherwise)."""

    def __init__(self, path: Path, schema: pa.Schema):
        from ckray.data.shards import _tmp_name

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = _tmp_name(self.path)
        self.writer = pq.ParquetWriter(self.tmp, schema)

    def write(self, table: pa.Table) -> None:
        self.writer.write_table(table)

    def __enter__(self) -> "_ParquetOut":
        return self

    def __exit__(self, exc_type, *exc: Any) -> None:
        self.writer.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


def stable_digest(d: dict) -> str:
    """A short digest of a JSON-able dict, the same for the same content in any order of its keys."""
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _negatives_depth(out: Path, pos_out: Path, stamp: dict) -> int | None:
    """The depth the negatives files were made at when they serve ``stamp``: finished, for the same queries and
    qrels, at its depth or deeper (readers cut each query's list at the depth they need, :func:`read_negatives`);
    else None."""
    from ckray.data.shards import is_done, marker_path, read_json

    try:
        made = int(read_json(marker_path(out))["depth"])
    except Exception:
        return None
    if made < stamp["depth"]:
        return None
    deeper = {**stamp, "depth": made}
    return made if is_done(out, deeper) and is_done(pos_out, deeper) else None


def read_negatives(workdir: str | os.PathLike, split: str, qids: list[str], depth: int | None = None) -> Run:
    """The BM25 run of ``split`` for ``qids`` only (each query's list by rank, cut at ``depth``), read
    with a filter: the range of ``qids`` prunes row groups, nothing else is held."""
    table = _read_negatives_of(negatives_path(workdir, split), qids, depth)
    return {q: list(zip(ids, scores)) for q, ids, scores in runs_by_query(table)}


def _read_negatives_of(path: Path, qids: list[str], depth: int | None = None) -> pa.Table:
    if not qids:
        return NEGATIVES_SCHEMA.empty_table()
    filters = [("query_id", ">=", min(qids)), ("query_id", "<=", max(qids))]
    if depth is not None:
        filters.append(("rank", "<=", depth))
    table = pq.read_table(path, columns=list(NEGATIVES_SCHEMA.names), filters=filters)
    table = table.filter(pc.is_in(table["query_id"], value_set=pa.array(qids, pa.string())))
    return table.sort_by([("query_id", "ascending"), ("rank", "ascending")])


def runs_by_query(table: pa.Table) -> Iterator[tuple[str, list[str], list[float]]]:
    """(query id, doc ids, scores) for each query of a table sorted by query id (then rank)."""
    if table.num_rows == 0:
        return
    codes = table["query_id"].combine_chunks().dictionary_encode()
    idx = codes.indices.to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(idx)) + 1, [len(idx)]])
    for a, b in zip(starts[:-1], starts[1:]):
        part = table.slice(int(a), int(b - a))
        yield codes.dictionary[idx[a]].as_py(), part["doc_id"].to_pylist(), part["score"].to_pylist()


def positive_scores(path: Path) -> dict[tuple[str, str], float]:
    """The judged positives' BM25 scores (one row per judged positive: as many as the qrels)."""
    t = pq.read_table(path)
    return {(q, d): float(s) for q, d, s in zip(*(t[c].to_pylist() for c in ("query_id", "doc_id", "score")))}


def require_negatives(workdir: str | os.PathLike, split: str) -> None:
    """A MissingArtifactError naming the command to run when ``split``'s negatives were not made."""
    for path in (negatives_path(workdir, split), positives_path(workdir, split)):
        if not path.exists():
            raise MissingArtifactError(f"{path}: no BM25 negatives for split {split!r}; run jobs/prepare.py "
                                       f"--workdir {workdir} --train-split {split}")
