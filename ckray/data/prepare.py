"""Corpus sharding on Ray Data: a collection file → ``W/shards/part-NNNNN.parquet`` + manifest, and
:func:`prepare_collection`, the whole prepare stage (shards → BM25 index → BM25 training negatives).

The corpus file is cut into ``num_shards`` byte ranges on line boundaries (line numbers kept, so a
malformed line is reported as ``file:line``). Ray Data runs one task per range; each parses and
validates its lines and writes its shard atomically with a done-marker. A re-run with unchanged
input does nothing; a re-run after a crash redoes only shards without a valid marker. The manifest
is withdrawn before any shard is (re)written and written again only when every shard is, so shards
left half-rewritten by a crash or a full disk never count as a prepared corpus.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import pyarrow.parquet as pq

from ckray import __version__
from ckray.data.collections import corpus_file, corpus_lines, parse_corpus_lines
from ckray.data.shards import (MANIFEST, file_sha256, is_done, mark_done, read_json, shard_name,
                               shards_dir, write_corpus_parquet, write_json_atomic)
from ckray.errors import CkrayError, CollectionError, ConfigError, DuplicateDocumentError
from ckray.options import option

if TYPE_CHECKING:
    from ckray.data.collections import Collection

log = logging.getLogger(__name__)


@dataclass
class PrepareConfig:
    data: str
    workdir: str
    shards: int = 4
    max_shard_mb: int = 32

    def __post_init__(self) -> None:
        check_prepare_options(shards=self.shards, max_shard_mb=self.max_shard_mb)

    def shard_count(self, corpus_bytes: int) -> int:
        """At least ``shards``, and enough that no shard holds more than ``max_shard_mb`` MiB of the corpus file:
        what a shard costs every later stage (a batch-inference driver holds one shard's results; a Serve
        replica or a task maps one shard at a time) stays bounded however large the corpus."""
        return max(self.shards, math.ceil(corpus_bytes / (self.max_shard_mb * 2**20)))


def check_prepare_options(shards: int | None = None, threads: int = 1, negative_depth: int = 1,
                          max_shard_mb: int = 1) -> None:
    """Refuse a shard count, thread count, negative depth or shard size below 1 (``ConfigError.invalid``: a job
    names its flag, ``--shards``)."""
    for name, value in (("shards", shards), ("threads", threads), ("negative_depth", negative_depth),
                        ("max_shard_mb", max_shard_mb)):
        if value is not None and value < 1:
            raise ConfigError.invalid("prepare", name, f"must be >= 1, got {value}")


@dataclass(frozen=True)
class PrepareOptions:
    """The prepare job's options (``jobs/prepare.py``'s flags, one per field)."""

    shards: int = option(4, "number of corpus shards, at least (more when the corpus needs them: --max-shard-mb)")
    max_shard_mb: int = option(32, "largest corpus shard, in MiB of the corpus file: a larger corpus gets more shards")
    threads: int = option(2, "Lucene indexing/search threads")
    train_split: str = option("train", "qrels split whose queries get BM25 negatives")
    negative_depth: int = option(1000, "BM25 depth for training negatives")
    negatives: bool = option(True, "BM25 negatives of the training queries (--no-negatives: skip them)")
    strict_qrels: bool = option(False, "refuse qrels that name a document not in the corpus or a query without a "
                                       "text; without it they are kept, counted and reported once")

    def __post_init__(self) -> None:
        check_prepare_options(self.shards, self.threads, self.negative_depth, self.max_shard_mb)


@dataclass
class Piece:
    """One shard's slice of the corpus file: bytes [start, end), starting at line ``first_line``."""

    index: int
    path: str
    fmt: str
    start: int
    end: int
    first_line: int
    input_sha256: str
    out: str


def split_file(path: Path, n: int) -> list[tuple[int, int, int]]:
    """Cut ``path`` into ≤ n byte ranges that start and end on line boundaries: (start, end, first_line)."""
    size = path.stat().st_size
    bounds = [0]
    with open(path, "rb") as f:
        for i in range(1, n):
            f.seek(max(size * i // n, bounds[-1]))
            if f.tell() > 0:
                f.readline()
            pos = min(f.tell(), size)
            if pos > bounds[-1]:
                bounds.append(pos)
        if bounds[-1] < size or len(bounds) == 1:
            bounds.append(size)
        ranges, line = [], 1
        for start, end in zip(bounds, bounds[1:]):
            ranges.append((start, end, line))
            line += _count_newlines(f, start, end)
    return ranges


def _count_newlines(f: BinaryIO, start: int, end: int, chunk: int = 1 << 24) -> int:
    """The ``\\n`` bytes in [start, end) of the open binary file ``f``, read in chunks of ``chunk`` bytes."""
    f.seek(start)
    count, left = 0, end - start
    while left > 0:
        block = f.read(min(chunk, left))
        if not block:
            break
        count += block.count(b"\n")
        left -= len(block)
    return count


def write_piece(piece: dict) -> dict:
    """Parse one byte range and write its shard (runs as a Ray Data task), streamed: one batch of rows is
    held at a time, whatever the shard's size (duplicate ids are found afterwards, across all shards, by
    :func:`_check_unique_ids`). A CkrayError (a malformed line, a failed write) comes back as the row's
    ``error`` and ``error_type``, which Ray does not carry across processes when raised;
    :func:`raise_piece_errors` raises it in the driver."""
    p = Piece(**piece)
    path = Path(p.path)
    try:
        lines = corpus_lines(path, p.start, p.end, p.first_line)
        rows = write_corpus_parquet(parse_corpus_lines(p.fmt, path, lines, p.first_line), p.out)
        mark_done(p.out, {"input_sha256": p.input_sha256, "start": p.start, "end": p.end})
    except CkrayError as e:
        return {"index": p.index, "rows": 0, "error": str(e), "error_type": type(e).__name__}
    return {"index": p.index, "rows": rows, "error": "", "error_type": ""}


def raise_piece_errors(results: list[dict]) -> None:
    """Raise the first shard's error :func:`write_piece` reported (as a CollectionError when it was
    one, else a CkrayError)."""
    for r in sorted(results, key=lambda r: r["index"]):
        if r["error"]:
            raise (CollectionError if r["error_type"] == CollectionError.__name__ else CkrayError)(r["error"])


def prepare_shards(config: PrepareConfig) -> dict:
    """Shard the corpus of ``config.data`` into ``config.workdir/shards``; returns the manifest."""
    from ckray.ray_env import init_ray

    cfile, fmt = corpus_file(Path(config.data))
    out_dir = shards_dir(config.workdir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sha = file_sha256(cfile)
    manifest_path = out_dir / MANIFEST
    if manifest_path.exists():
        old = read_json(manifest_path)
        if old.get("input_sha256") == sha and old.get("num_shards_requested") == config.shards and \
                old.get("max_shard_mb", PrepareConfig.max_shard_mb) == config.max_shard_mb and all(
                is_done(out_dir / s["name"], {"input_sha256": sha}) for s in old["shards"]):
            log.info("shards in %s are up to date (%d documents); nothing to do", out_dir, old["documents"])
            return old
    ranges = split_file(cfile, config.shard_count(cfile.stat().st_size))
    pieces = [Piece(i, str(cfile), fmt, s, e, l, sha, str(out_dir / shard_name(i))) for i, (s, e, l) in enumerate(ranges)]
    todo = [p for p in pieces if not is_done(p.out, {"input_sha256": sha, "start": p.start, "end": p.end})]
    log.info("%d of %d shard(s) to write (%d already done)", len(todo), len(pieces), len(pieces) - len(todo))
    t0 = time.time()
    if todo:
        manifest_path.unlink(missing_ok=True)  # not a prepared corpus until every shard is written
        init_ray()
        import ray.data

        raise_piece_errors(ray.data.from_items([asdict(p) for p in todo]).map(write_piece).take_all())
    for stale in sorted(out_dir.glob("part-*.parquet")):
        if stale.name not in {Path(p.out).name for p in pieces}:
            stale.unlink()
    shards = [{"name": Path(p.out).name, "rows": pq.read_metadata(p.out).num_rows, "first_line": p.first_line}
              for p in pieces]
    manifest = {
        "input": str(cfile), "format": fmt, "input_sha256": sha, "num_shards_requested": config.shards,
        "max_shard_mb": config.max_shard_mb,
        "documents": sum(s["rows"] for s in shards), "shards": shards, "ckray_version": __version__,
    }
    write_json_atomic(manifest, manifest_path)
    _check_unique_ids(config.workdir, cfile, fmt)
    log.info("wrote %d shard(s), %d documents in %.1fs", len(todo), manifest["documents"], time.time() - t0)
    return manifest


def _check_unique_ids(workdir: str, cfile: Path, fmt: str) -> None:
    """Every document id once, before any index is built: building the document store (``W/docstore``,
    which every later reader of texts uses) sorts 64-bit id hashes instead of holding every id in a dict.
    A duplicate is reported at its two lines of the corpus file, and the manifest is withdrawn so the
    shards never count as prepared."""
    from ckray.data.docstore import ensure_store

    try:
        ensure_store(workdir)
    except DuplicateDocumentError as e:
        (shards_dir(workdir) / MANIFEST).unlink(missing_ok=True)
        first, second = _lines_of(cfile, fmt, e.doc_id)
        raise CollectionError(f"{cfile}:{second}: duplicate doc id {e.doc_id!r} (first at line {first}); "
                              "document ids must be unique") from None


def _lines_of(cfile: Path, fmt: str, doc_id: str) -> tuple[int, int]:
    """The first two line numbers of ``cfile`` whose document has id ``doc_id`` (a streaming scan, run only
    to report a duplicate: lines not containing the id's text are not parsed)."""
    found: list[int] = []
    with open(cfile, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if doc_id not in line and '"' not in doc_id and "\\" not in doc_id:
                continue
            if any(d == doc_id for d, _, _ in parse_corpus_lines(fmt, cfile, [line], first_line=lineno)):
                found.append(lineno)
                if len(found) == 2:
                    return found[0], found[1]
    raise CollectionError(f"{cfile}: duplicate doc id {doc_id!r}, but its lines were not found again")


@dataclass
class PreparedCollection:
    """What :func:`prepare_collection` made (or found up to date) under the work directory."""

    manifest: dict                      # the shards' manifest (``W/shards/_manifest.json``)
    bm25_index: Path | None = None      # ``W/bm25/index``; None when the BM25 step was not asked for
    negatives: Path | None = None       # ``W/negatives/<split>.parquet``; None when not built
    did_work: bool = False              # whether anything was (re)written; False: all was up to date


def requested_shards(workdir: str | os.PathLike, shards: int | None = None) -> int:
    """``shards`` if given, else the count the work directory was already sharded with (so an existing
    work directory is reused as it is), else :attr:`PrepareConfig.shards`."""
    if shards is not None:
        return shards
    manifest = shards_dir(workdir) / MANIFEST
    return read_json(manifest)["num_shards_requested"] if manifest.exists() else PrepareConfig.shards


def prepare_collection(data: str | os.PathLike, workdir: str | os.PathLike, shards: int | None = None,
                       split: str | None = "train", *, bm25: bool = True, collection: Collection | None = None,
                       threads: int = 2, negative_depth: int = 1000,
                       max_shard_mb: int = PrepareConfig.max_shard_mb) -> PreparedCollection:
    """The prepare stage, idempotent: shard the corpus of ``data`` (Ray Data), build the BM25 index
    from the shards, and the BM25 top-``negative_depth`` training negatives of ``split``'s queries.

    ``shards``: the shard count, at least (None: keep the work directory's, see :func:`requested_shards`);
    ``max_shard_mb``: more shards when the corpus file is larger than ``shards`` of this many MiB.
    ``split``: the qrels split whose queries get negatives; None, or a split the collection has no
    qrels for, skips them. ``bm25=False`` stops after the shards (``split`` must then be None).
    ``collection``: the already loaded collection of ``data``; loaded (before any work, so a bad
    collection fails first) only when negatives are asked for and it is not given.
    ``threads``: Lucene indexing/search threads.
    """
    if split is not None and not bm25:
        raise ValueError("BM25 negatives need the BM25 index: pass split=None with bm25=False")
    check_prepare_options(shards, threads, negative_depth, max_shard_mb)
    if split is not None and collection is None:
        from ckray.data.collections import load_collection

        collection = load_collection(data)
    workdir = str(workdir)
    outputs = _output_files(workdir, split)
    written_before = _mtimes(outputs)
    prepared = _prepare(data, workdir, shards, split, bm25, collection, threads, negative_depth, max_shard_mb)
    prepared.did_work = _mtimes(outputs) != written_before
    return prepared


def _prepare(data: str | os.PathLike, workdir: str, shards: int | None, split: str | None, bm25: bool,
             collection: Collection | None, threads: int, negative_depth: int,
             max_shard_mb: int) -> PreparedCollection:
    """:func:`prepare_collection`'s steps, each skipped when up to date."""
    manifest = prepare_shards(PrepareConfig(data=str(data), workdir=workdir, shards=requested_shards(workdir, shards),
                                            max_shard_mb=max_shard_mb))
    prepared = PreparedCollection(manifest)
    if not bm25:
        return prepared
    from ckray.lexical.bm25 import build_bm25_index

    prepared.bm25_index = build_bm25_index(workdir, threads=threads)
    if split is None:
        return prepared
    if split not in collection.qrels:
        log.info("no qrels for split %r (have %s): no BM25 negatives", split, sorted(collection.qrels))
        return prepared
    from ckray.data.negatives import build_negatives

    prepared.negatives = build_negatives(workdir, collection.split_queries(split), collection.qrels[split],
                                         split=split, depth=negative_depth, threads=threads)
    return prepared


def _output_files(workdir: str, split: str | None) -> list[Path]:
    """The files each prepare step writes last when it does its work (and leaves alone when up to date)."""
    from ckray.data.negatives import negatives_path, positives_path
    from ckray.lexical.bm25 import META, bm25_index_dir

    files = [shards_dir(workdir) / MANIFEST, bm25_index_dir(workdir) / META]
    return files + ([negatives_path(workdir, split), positives_path(workdir, split)] if split else [])


def _mtimes(files: list[Path]) -> list[int | None]:
    return [f.stat().st_mtime_ns if f.exists() else None for f in files]
