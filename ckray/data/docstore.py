"""``doc_id → (title, text)`` served from memory-mapped files, so a process's own memory does not grow
with the corpus.

The store is a copy of the corpus shards that can be read a row at a time without parsing, built once
under ``W/docstore/<key>/`` (``key``: a hash of what it was built from, see :func:`source_fingerprint`):

- ``part-NNNNN.arrow``: one uncompressed Arrow IPC file per corpus shard (``doc_id, title, text``, in
  record batches of at most :data:`BATCH_ROWS` rows); "global row" below is a row's position in the
  corpus order (shard by shard, batch by batch).
- ``id_hash.npy``: ``uint64``, the 64-bit BLAKE2b hash of every doc id, sorted.
- ``id_pos.npy``: ``int64``, the global row of each hash. A lookup binary-searches the hash and checks
  the doc id stored at that row, so a hash collision can never return the wrong document.
- ``store.json``: the marker, written last: the source fingerprint, every file's size and the
  document count. A store whose marker is missing, names another source or disagrees with a file's
  size is never read; it is rebuilt.

All of these are opened with ``mmap``: what a lookup touches is page cache shared by every process on
the machine, not memory of the process. What a process owns is one Arrow object per record batch.

Building streams shard by shard (one record batch of ids in Python at a time; the hash and position
arrays, 16 bytes a document, are sorted at the end) and happens in a temporary directory renamed into
place when complete, under an exclusive ``flock`` on ``W/docstore/.lock`` so that concurrent first opens
(several Serve replicas) build it once and the others wait and open it. A duplicate doc id fails the
build, naming the id and the shards it occurs in.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ckray.data.collections import CORPUS_SCHEMA, doc_text
from ckray.data.shards import MANIFEST, file_sha256, read_json, shard_paths, shards_dir, write_json_atomic
from ckray.errors import CollectionError, DuplicateDocumentError, MissingArtifactError
from ckray.workdir import WorkDir

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
BATCH_ROWS = 8192
MARKER = "store.json"
HASHES = "id_hash.npy"
POSITIONS = "id_pos.npy"
LOCK = ".lock"
_TMP_PREFIX = ".tmp-"


# --------------------------------------------------------------------------- ids, fingerprints, markers

def id_hash(doc_id: str) -> int:
    """The 64-bit hash the id index is sorted by (BLAKE2b of the UTF-8 id; the same in every process)."""
    return int.from_bytes(hashlib.blake2b(doc_id.encode("utf-8"), digest_size=8).digest(), "little")


def id_hashes(doc_ids: Sequence[str]) -> np.ndarray:
    """:func:`id_hash` of each id, as ``uint64``."""
    digests = b"".join(hashlib.blake2b(d.encode("utf-8"), digest_size=8).digest() for d in doc_ids)
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


class HashedIds:
    """Doc id → row without a Python object per document: the ids' :func:`id_hash` values sorted, with the row
    each belongs to (16 bytes a document, arrays that may be memory-mapped). A lookup binary-searches the hash
    and compares the id stored at each row of an equal hash (``id_at(row)``), so a hash collision never
    returns the wrong row. The one lookup behind :class:`DocStore` and the dense index's ``DocIdMap``."""

    def __init__(self, sorted_hashes: np.ndarray, rows: np.ndarray, id_at: Callable[[int], str]):
        self.sorted_hashes, self.rows, self.id_at = sorted_hashes, rows, id_at

    @classmethod
    def of(cls, hashes: np.ndarray, id_at: Callable[[int], str]) -> "HashedIds":
        """From the hashes of rows 0..n-1, in row order."""
        order = np.argsort(hashes, kind="stable")
        return cls(hashes[order], order, id_at)

    def __len__(self) -> int:
        return len(self.sorted_hashes)

    def row(self, doc_id: str) -> int | None:
        """The row of ``doc_id``, or None."""
        h = np.uint64(id_hash(doc_id))
        i = int(self.sorted_hashes.searchsorted(h))
        while i < len(self.sorted_hashes) and self.sorted_hashes[i] == h:
            row = int(self.rows[i])
            if self.id_at(row) == doc_id:
                return row
            i += 1
        return None

    def duplicate(self) -> tuple[str, int, int] | None:
        """The first id stored at two rows, as (id, first row, second row), or None. Only ids of equal hashes
        can be the same; within each run of equal hashes the ids are compared as strings."""
        checked_to = 0   # positions below it belong to runs already compared
        for start in np.flatnonzero(self.sorted_hashes[1:] == self.sorted_hashes[:-1]):
            if start < checked_to:
                continue
            end = int(start) + 2
            while end < len(self.sorted_hashes) and self.sorted_hashes[end] == self.sorted_hashes[start]:
                end += 1
            seen: dict[str, int] = {}
            for j in range(int(start), end):
                row = int(self.rows[j])
                doc_id = self.id_at(row)
                if doc_id in seen:
                    return doc_id, min(seen[doc_id], row), max(seen[doc_id], row)
                seen[doc_id] = row
            checked_to = end
        return None


def source_fingerprint(workdir: str | os.PathLike) -> dict:
    """What a store is built from: the shards' manifest (its hash) and each shard's name, size and mtime,
    so a re-prepared corpus, or a shard rewritten under the same manifest, makes the store stale."""
    shards = shard_paths(workdir)
    stats = [(p.name, p.stat()) for p in shards]
    return {"format": FORMAT_VERSION, "manifest_sha256": file_sha256(shards_dir(workdir) / MANIFEST),
            "shards": [[name, st.st_size, st.st_mtime_ns] for name, st in stats]}


def store_key(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def store_dir(workdir: str | os.PathLike, fingerprint: dict | None = None) -> Path:
    """``W/docstore/<key>``: where the store of the corpus shards as they are now lives."""
    return WorkDir(workdir).docstore / store_key(fingerprint or source_fingerprint(workdir))


def is_complete(path: Path, fingerprint: dict) -> bool:
    """True when ``path`` holds a finished store of ``fingerprint``: its marker names that source and every
    file it lists exists with the recorded size."""
    try:
        marker = read_json(path / MARKER)
        return marker.get("source") == fingerprint and all(
            (path / name).stat().st_size == size for name, size in marker["files"].items())
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return False


def ensure_store(workdir: str | os.PathLike) -> Path:
    """The directory of an up-to-date, complete store for the corpus shards of ``workdir``, building it
    first when it is missing, stale or damaged (see the module docstring)."""
    fingerprint = source_fingerprint(workdir)
    path = store_dir(workdir, fingerprint)
    if is_complete(path, fingerprint):
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MissingArtifactError(f"{path.parent}: cannot create the document store ({e.strerror}); open a "
                                   f"DocStore once where {workdir} is writable, which builds it") from None
    with _exclusive(path.parent / LOCK):
        if not is_complete(path, fingerprint):  # another process may have built it while we waited
            _build(workdir, fingerprint, path)
    return path


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# --------------------------------------------------------------------------- building

def _build(workdir: str | os.PathLike, fingerprint: dict, path: Path) -> None:
    """Write the store into a temporary directory and rename it to ``path``; call with the lock held.
    Leftovers (stale stores, temporary directories of crashed builds) are removed afterwards."""
    root = path.parent
    tmp = root / f"{_TMP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    t0 = time.time()
    try:
        files, documents = _write_store(workdir, tmp, [name for name, _, _ in fingerprint["shards"]])
        write_json_atomic({"source": fingerprint, "files": files, "documents": documents}, tmp / MARKER)
        if path.exists():  # damaged (is_complete said no): never read, replaced whole
            _remove(path)
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        pa.default_memory_pool().release_unused()  # the build's transient buffers are not kept by this process
    for other in root.iterdir():  # under the lock no other build runs; a reader of a stale store keeps its mmaps
        if other.is_dir() and other.name != path.name:
            _remove(other)
    log.info("document store %s: %d documents in %.1fs", path, documents, time.time() - t0)


def _remove(path: Path) -> None:
    """Delete a directory by first renaming it away, so it is never seen half-deleted under its name."""
    trash = path.with_name(f"{_TMP_PREFIX}trash-{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _write_store(workdir: str | os.PathLike, out: Path, shard_names: list[str]) -> tuple[dict[str, int], int]:
    """The Arrow files and the id index of the shards of ``workdir`` under ``out``: (file sizes, documents)."""
    shards = shards_dir(workdir)
    hashes: list[np.ndarray] = []
    for i, name in enumerate(shard_names):
        pf = pq.ParquetFile(shards / name)
        missing = {"doc_id", "title", "text"} - set(pf.schema_arrow.names)
        if missing:
            raise CollectionError(f"{shards / name}: corpus shard lacks column(s) {sorted(missing)}")
        row = 0
        with pa.OSFile(str(out / arrow_name(i)), "wb") as sink, pa.ipc.new_file(sink, CORPUS_SCHEMA) as writer:
            # one thread: the buffers it decodes into go back to the pool's free lists on this thread,
            # which release_unused (end of _build) returns to the system
            for batch in pf.iter_batches(batch_size=BATCH_ROWS, columns=CORPUS_SCHEMA.names, use_threads=False):
                batch = batch.cast(CORPUS_SCHEMA)
                if batch.column(0).null_count:
                    bad = row + batch.column(0).is_null().to_pylist().index(True)
                    raise CollectionError(f"{shards / name}: row {bad}: a document without a doc_id")
                writer.write_batch(batch)
                row += batch.num_rows
                hashes.append(id_hashes(batch.column(0).to_pylist()))
    all_hashes = np.concatenate(hashes) if hashes else np.zeros(0, np.uint64)
    del hashes
    order = np.argsort(all_hashes, kind="stable")
    sorted_hashes = all_hashes[order]
    del all_hashes
    np.save(out / HASHES, sorted_hashes)
    np.save(out / POSITIONS, order.astype(np.int64))
    _check_unique(out, shard_names, sorted_hashes, order)
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    return files, int(order.size)


def _check_unique(out: Path, shard_names: list[str], sorted_hashes: np.ndarray, order: np.ndarray) -> None:
    """Raise :class:`DuplicateDocumentError` for a doc id stored twice (:meth:`HashedIds.duplicate`), naming the
    shards it occurs in."""
    if not np.any(sorted_hashes[1:] == sorted_hashes[:-1]):
        return
    rows = _Rows(out)
    found = HashedIds(sorted_hashes, order, rows.doc_id).duplicate()
    if found is None:
        return
    doc_id, first_row, second_row = found
    first, second = shard_names[rows.file_of(first_row)], shard_names[rows.file_of(second_row)]
    where = f"shard {first}" if first == second else f"shards {first} and {second}"
    raise DuplicateDocumentError(f"duplicate document id {doc_id!r} in the corpus shards ({where}); "
                                 "re-prepare the collection (jobs/prepare.py) from a corpus with unique ids", doc_id)


def arrow_name(i: int) -> str:
    return f"part-{i:05d}.arrow"


# --------------------------------------------------------------------------- reading

class _Strings:
    """A string column of one record batch, read without Arrow scalars: its offsets as a NumPy view and
    its character data as a memoryview, both on the mapped file."""

    __slots__ = ("array", "offsets", "data")

    def __init__(self, array: pa.Array):
        _, offsets, data = array.buffers()
        self.array = array
        self.offsets = np.frombuffer(offsets, dtype=np.int32)[array.offset: array.offset + len(array) + 1]
        self.data = memoryview(data if data is not None else b"")

    def __getitem__(self, row: int) -> str | None:
        if self.array.null_count and not self.array[row].is_valid:
            return None
        return str(self.data[self.offsets[row]: self.offsets[row + 1]], "utf-8")


class _Rows:
    """The Arrow files of a store, memory-mapped: columns of a row by its global row number."""

    def __init__(self, path: Path):
        self._columns: list[tuple[_Strings, _Strings, _Strings]] = []
        self._starts = [0]
        self._batch_file: list[int] = []
        for i, file in enumerate(sorted(path.glob("part-*.arrow"))):
            reader = pa.ipc.open_file(pa.memory_map(str(file)))
            for b in range(reader.num_record_batches):
                batch = reader.get_batch(b)
                self._columns.append(tuple(_Strings(batch.column(c)) for c in range(3)))
                self._starts.append(self._starts[-1] + batch.num_rows)
                self._batch_file.append(i)

    def __len__(self) -> int:
        return self._starts[-1]

    def _locate(self, pos: int) -> tuple[int, int]:
        b = bisect.bisect_right(self._starts, pos) - 1
        return b, pos - self._starts[b]

    def doc_id(self, pos: int) -> str:
        b, row = self._locate(pos)
        return self._columns[b][0][row]

    def title_text(self, pos: int) -> tuple[str, str]:
        b, row = self._locate(pos)
        _, titles, texts = self._columns[b]
        return titles[row], texts[row]

    def file_of(self, pos: int) -> int:
        return self._batch_file[self._locate(pos)[0]]

    def id_batches(self) -> Iterator[pa.Array]:
        for ids, _, _ in self._columns:
            yield ids.array


class DocIds(Sequence):
    """The doc ids of a :class:`DocStore` in corpus order, read on demand (not a list held in memory)."""

    def __init__(self, rows: _Rows):
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: int | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"document index {i} out of range ({n} documents)")
        return self._rows.doc_id(i % n)

    def __iter__(self) -> Iterator[str]:
        for ids in self._rows.id_batches():
            yield from ids.to_pylist()


class DocStore:
    """doc_id → (title, text) for the corpus shards of a work directory, from memory-mapped files
    (``W/docstore``, built on first use; see :mod:`ckray.data.docstore`).

    Pickles as its work directory (an unpickled copy reopens the files), so handing ``store.text`` to
    another process ships no documents.
    """

    def __init__(self, workdir: str | os.PathLike):
        self._workdir = str(workdir)
        self.path = ensure_store(workdir)
        self._rows = _Rows(self.path)
        # plain ndarray views of the mapped files (np.memmap's own indexing is several times slower)
        self._index = HashedIds(np.load(self.path / HASHES, mmap_mode="r").view(np.ndarray),
                                np.load(self.path / POSITIONS, mmap_mode="r").view(np.ndarray), self._rows.doc_id)

    def __reduce__(self) -> tuple[Any, ...]:
        return DocStore, (self._workdir,)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, doc_id: object) -> bool:
        return isinstance(doc_id, str) and self._find(doc_id) is not None

    def ids(self) -> DocIds:
        """Every doc id in corpus order: a sequence (``len``, ``[i]``, iteration) read on demand."""
        return DocIds(self._rows)

    def get(self, doc_id: str) -> tuple[str, str]:
        pos = self._find(doc_id) if isinstance(doc_id, str) else None
        if pos is None:
            raise KeyError(f"unknown document id {doc_id!r}")
        return self._rows.title_text(pos)

    def text(self, doc_id: str) -> str:
        """``doc_text(title, text)``: what every neural model reads for the document."""
        return doc_text(*self.get(doc_id))

    def _find(self, doc_id: str) -> int | None:
        """The global row of ``doc_id``, or None."""
        return self._index.row(doc_id)
