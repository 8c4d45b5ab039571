"""Shard I/O shared by every job: atomic Parquet/JSON writes, per-shard "done" markers, and readers
for the corpus shards (``W/shards/part-NNNNN.parquet`` with ``doc_id, title, text``), and ``DocStore``
(``doc_id → (title, text)`` from memory-mapped files, :mod:`ckray.data.docstore`).

A shard counts as finished only when its Parquet file is readable *and* its marker
``<shard>.done.json`` records the same inputs, row count, size in bytes and (checked unless the
shard is older than its marker) sha256; anything else (a crash mid-write, a stale input,
a shard truncated or overwritten since) is redone. Files appear under their final name only by
``os.replace`` of a complete temporary file; a write that fails (full or read-only file system)
raises :class:`~ckray.errors.CkrayError` naming the path and the reason, leaves no temporary file
and the previous file, if any, untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from ckray.errors import CkrayError, MissingArtifactError
from ckray.workdir import WorkDir

if TYPE_CHECKING:
    from ckray.data.docstore import DocStore  # noqa: F401  (re-exported by __getattr__ below)

MANIFEST = "_manifest.json"


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_failed(path: str | os.PathLike, error: BaseException) -> CkrayError:
    """The error a failed write of ``path`` raises: the path, the OS's reason, and that nothing changed."""
    reason = getattr(error, "strerror", None) or str(error) or type(error).__name__
    return CkrayError(f"cannot write {path}: {reason}; the previous {Path(path).name}, if any, is unchanged")


@contextmanager
def atomic_target(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path next to ``path`` to write the whole file to; on success it replaces ``path``
    (``os.replace``). On failure the temporary file is removed, ``path`` is left as it was and an
    ``OSError`` (full or read-only file system, no permission) becomes :func:`write_failed`'s error."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.replace(tmp, path)
    except (OSError, pa.ArrowException) as e:
        raise write_failed(path, e) from e
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def write_parquet_atomic(table: pa.Table, path: str | os.PathLike) -> Path:
    with atomic_target(path) as tmp:
        pq.write_table(table, tmp)
    return Path(path)


def write_corpus_parquet(rows: Iterable[tuple[str, str, str]], path: str | os.PathLike,
                         batch_rows: int = 8192, batch_bytes: int = 1 << 24) -> int:
    """Write ``(doc_id, title, text)`` rows as a corpus shard (atomically), a row group per batch of at
    most ``batch_rows`` rows or about ``batch_bytes`` of text, so memory holds one batch whatever the
    number of rows. Returns the number of rows."""
    from ckray.data.collections import CORPUS_SCHEMA

    def table(batch: list[tuple[str, str, str]]) -> pa.Table:
        return pa.table([list(column) for column in zip(*batch)] if batch else [[], [], []], schema=CORPUS_SCHEMA)

    total = 0
    with atomic_target(path) as tmp, pq.ParquetWriter(tmp, CORPUS_SCHEMA) as writer:
        batch: list[tuple[str, str, str]] = []
        size = 0
        for row in rows:
            batch.append(row)
            size += len(row[1]) + len(row[2])
            if len(batch) >= batch_rows or size >= batch_bytes:
                writer.write_table(table(batch))
                total += len(batch)
                batch, size = [], 0
        if batch or not total:  # a range without documents still gets a readable (empty) shard
            writer.write_table(table(batch))
            total += len(batch)
    return total


def write_json_atomic(obj: Any, path: str | os.PathLike) -> Path:
    with atomic_target(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True))
    return Path(path)


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


# the keys of an index's stamp that describe its files (:func:`index_files_record`)
INDEX_FILES_KEYS = ("files", "rebuild_with")


def index_files_record(directory: str | os.PathLike, stamp: str, rebuild: str) -> dict:
    """What an index's stamp (the JSON file ``stamp`` in ``directory``, written after the index) adds to
    record its files: ``{"files": directory_record(...), "rebuild_with": rebuild}``, ``rebuild`` being
    the command that rebuilds the index (what :func:`check_index_files` tells a user)."""
    return {"files": directory_record(directory, exclude=(stamp,)), "rebuild_with": rebuild}


def index_files_changed(directory: str | os.PathLike, stamp: str) -> list[str] | None:
    """The files of the index in ``directory`` that are not those its stamp (the JSON file ``stamp``
    there, with an :func:`index_files_record`) describes (:func:`changed_files`); None when the stamp
    records no files."""
    path = Path(directory) / stamp
    recorded = read_json(path).get("files")
    if recorded is None:
        return None
    return changed_files(directory, recorded, path.stat().st_mtime_ns, exclude=(stamp,))


def check_index_files(directory: str | os.PathLike, stamp: str) -> None:
    """Refuse an index whose files are not those its stamp describes (:func:`index_files_changed`): a
    :class:`MissingArtifactError` naming the index, the changed files and the command that rebuilds it,
    never a search over a damaged file. A stamp that records no files checks nothing."""
    directory = Path(directory)
    changed = index_files_changed(directory, stamp)
    if changed:
        rebuild = read_json(directory / stamp).get("rebuild_with", "the job that built it")
        raise MissingArtifactError(f"index {directory}: {', '.join(changed)} differ(s) from what was written "
                                   f"(missing, truncated or changed since); rebuild it with {rebuild}")


def marker_path(shard: Path) -> Path:
    return shard.with_name(shard.name + ".done.json")


def mark_done(shard: str | os.PathLike, meta: dict) -> None:
    """Record that ``shard`` is complete (its row count, size and sha256 with ``meta``); call after the
    shard itself was written atomically."""
    shard = Path(shard)
    rows = pq.read_metadata(shard).num_rows
    write_json_atomic({**meta, "rows": rows, "bytes": shard.stat().st_size, "sha256": file_sha256(shard)},
                      marker_path(shard))


def is_done(shard: str | os.PathLike, meta: dict) -> bool:
    """True when ``shard`` is readable, has a marker whose fields equal ``meta``, and is the file the
    marker describes: same row count always, and size and sha256 as :func:`file_unchanged` checks them
    (so a shard truncated or overwritten since is not done). Markers written before sizes and digests
    were recorded are checked by row count only."""
    shard = Path(shard)
    marker = marker_path(shard)
    try:
        recorded = read_json(marker)
        marker_mtime = marker.stat().st_mtime_ns
        rows = pq.read_metadata(shard).num_rows
    except Exception:
        return False
    if not all(recorded.get(k) == v for k, v in meta.items()) or recorded.get("rows") != rows:
        return False
    if "bytes" not in recorded:
        return True
    return file_unchanged(shard, recorded, marker_mtime)


def file_record(path: str | os.PathLike) -> dict:
    """What a stamp records of a file it describes: ``{"bytes": size, "sha256": digest}``."""
    return {"bytes": Path(path).stat().st_size, "sha256": file_sha256(path)}


def file_unchanged(path: str | os.PathLike, recorded: dict, recorded_ns: int) -> bool:
    """True when ``path`` is the file ``recorded`` (a :func:`file_record`) describes: the same size
    always, and the same sha256 unless the file is older than the record (``recorded_ns``: the mtime
    of the stamp, written after the file). A file truncated or overwritten in place since is newer
    than its stamp, so its digest is checked; a file system's coarse clock can give both the same
    time, which checks the digest too."""
    try:
        stat = Path(path).stat()
    except OSError:
        return False
    if recorded.get("bytes") != stat.st_size:
        return False
    return stat.st_mtime_ns < recorded_ns or recorded.get("sha256") == file_sha256(path)


def directory_record(directory: str | os.PathLike, exclude: Iterable[str] = ()) -> dict[str, dict]:
    """:func:`file_record` of every file directly in ``directory`` but ``exclude``d names (an index's
    stamp records its own files this way)."""
    skip = set(exclude)
    return {f.name: file_record(f) for f in sorted(Path(directory).iterdir()) if f.is_file() and f.name not in skip}


def changed_files(directory: str | os.PathLike, recorded: dict[str, dict | int], recorded_ns: int,
                  exclude: Iterable[str] = ()) -> list[str]:
    """The names of the files in ``directory`` that are not what :func:`directory_record` recorded:
    missing, added, or changed (:func:`file_unchanged`). A record that holds only a size (an int, as
    stamps written before digests were recorded do) is checked by size."""
    skip = set(exclude)
    present = {f.name for f in Path(directory).iterdir() if f.is_file() and f.name not in skip}
    changed = sorted(present - set(recorded))
    for name, record in sorted(recorded.items()):
        record = record if isinstance(record, dict) else {"bytes": record}
        size_only = "sha256" not in record
        if not file_unchanged(Path(directory) / name, record, 2 ** 63 - 1 if size_only else recorded_ns):
            changed.append(name)
    return sorted(changed)


def done_rows(shard: str | os.PathLike) -> int:
    return int(read_json(marker_path(Path(shard)))["rows"])


# --------------------------------------------------------------------------- corpus shards

def shards_dir(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).shards


def shard_name(i: int) -> str:
    return f"part-{i:05d}.parquet"


def read_manifest(workdir: str | os.PathLike) -> dict:
    path = shards_dir(workdir) / MANIFEST
    if not path.exists():
        raise MissingArtifactError(f"no corpus shards in {shards_dir(workdir)}: run jobs/prepare.py --workdir {workdir} first")
    return read_json(path)


def shard_paths(workdir: str | os.PathLike) -> list[Path]:
    """The finished corpus shards, in order (from the manifest)."""
    manifest = read_manifest(workdir)
    return [shards_dir(workdir) / s["name"] for s in manifest["shards"]]


def read_corpus_dataset(workdir: str | os.PathLike, **kwargs):
    """The corpus shards as a Ray Dataset (``doc_id, title, text``)."""
    import ray.data

    return ray.data.read_parquet([str(p) for p in shard_paths(workdir)], **kwargs)


def iter_doc_texts(workdir: str | os.PathLike, batch_rows: int = 4096) -> Iterator[str]:
    """Every document's ``doc_text(title, text)``, in corpus order (shard by shard, row by row), streamed
    in Arrow batches of ``batch_rows``: memory does not grow with the corpus."""
    for path in shard_paths(workdir):
        yield from shard_doc_texts(path, batch_rows)


def shard_doc_texts(path: str | os.PathLike, batch_rows: int = 4096) -> Iterator[str]:
    """The ``doc_text(title, text)`` of one corpus shard's documents, in its order, a batch at a time."""
    from ckray.data.collections import doc_text

    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows, columns=["title", "text"]):
        yield from (doc_text(t, x) for t, x in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()))


def load_corpus_table(workdir: str | os.PathLike, columns: list[str] | None = None) -> pa.Table:
    return pa.concat_tables([pq.read_table(p, columns=columns) for p in shard_paths(workdir)])


def write_corpus_shards(workdir: str | os.PathLike, tables: Iterable[pa.Table], source: str) -> dict:
    """Write ``tables`` (``doc_id, title, text``) as the corpus shards of ``workdir``, one shard each, with
    their done-markers and manifest, in the layout ``jobs/prepare.py`` writes; for corpora made in code
    (benchmarks, tests). ``source`` names them in the manifest (and stands for the input's hash). Shards of
    an earlier corpus that the new one does not have are removed. Returns the manifest."""
    out = shards_dir(workdir)
    shards, documents = [], 0
    for i, table in enumerate(tables):
        path = write_parquet_atomic(table, out / shard_name(i))
        mark_done(path, {"input_sha256": source})
        shards.append({"name": path.name, "rows": table.num_rows, "first_line": documents + 1})
        documents += table.num_rows
    for stale in out.glob("part-*.parquet"):
        if stale.name not in {s["name"] for s in shards}:
            stale.unlink()
            marker_path(stale).unlink(missing_ok=True)
    manifest = {"input": source, "format": "generated", "input_sha256": source, "num_shards_requested": len(shards),
                "documents": documents, "shards": shards}
    write_json_atomic(manifest, out / MANIFEST)
    return manifest


def __getattr__(name: str) -> Any:
    # ``DocStore`` lives in ckray.data.docstore (which imports this module); re-exported lazily here
    if name == "DocStore":
        from ckray.data.docstore import DocStore

        return DocStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
