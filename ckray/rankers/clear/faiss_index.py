"""The faiss index over CLEAR's embedding shards (``W/dense/index``, ``ckray.rankers.clear.layout``) and its
build job (:func:`build_dense_index`: the embedding job, ``ckray.rankers.clear.embed``, then the index).

Index (:class:`DenseIndex`): inner product over the embeddings (Eq. 4); ``flat`` (exact) by default, ``hnsw``,
``ivf`` and ``ivfpq`` for large corpora; on GPU faiss when ``faiss.get_num_gpus() > 0``. A document stored as
several passage vectors (``EmbedConfig.passages``) is scored by its best passage (MaxP, Dai & Callan 2019).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ckray.data.shards import INDEX_FILES_KEYS, check_index_files, index_files_record
from ckray.errors import ConfigError, MissingArtifactError
from ckray.rankers.clear.embed import EmbedConfig, embed_corpus, embedding_matrix, embedding_shard_paths
from ckray.rankers.clear.layout import default_checkpoint, embeddings_dir, index_dir

log = logging.getLogger(__name__)

INDEX_FILE = "index.faiss"
IDS_FILE = "doc_ids.parquet"
META_FILE = "meta.json"
INDEX_KINDS = ("flat", "hnsw", "ivf", "ivfpq")


@dataclass
class IndexConfig:
    """The faiss index over the embeddings (metric: inner product, Eq. 4).

    kind:         "flat" (exact), "hnsw" (graph; no training), "ivf" (inverted lists, exact vectors),
                  "ivfpq" (inverted lists + product quantisation: smallest, approximate scores).
    nlist:        IVF cells (None: 4·sqrt(N), at least 1).   nprobe: cells visited per query.
    hnsw_m, ef_construction, ef_search: HNSW graph degree and beam widths.
    pq_m, pq_bits: sub-quantisers (None: D/4, or the largest divisor of D ≤ D/4) and bits per code.
    train_sample: vectors used to train IVF/PQ (a random sample).
    use_gpu:      None: GPU faiss when ``faiss.get_num_gpus() > 0`` (HNSW always runs on the CPU).
    """

    kind: str = "flat"
    nlist: int | None = None
    nprobe: int = 32
    hnsw_m: int = 32
    ef_construction: int = 200
    ef_search: int = 256
    pq_m: int | None = None
    pq_bits: int = 8
    train_sample: int = 262144
    use_gpu: bool | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ConfigError(f"IndexConfig.kind must be one of {INDEX_KINDS}, not {self.kind!r}")

    def factory(self, dim: int, n: int) -> str:
        """The faiss ``index_factory`` string for this configuration."""
        nlist = self.nlist or max(1, int(4 * math.sqrt(max(n, 1))))
        if self.kind == "flat":
            return "Flat"
        if self.kind == "hnsw":
            return f"HNSW{self.hnsw_m}"
        if self.kind == "ivf":
            return f"IVF{nlist},Flat"
        m = self.pq_m or max(d for d in range(1, max(1, dim // 4) + 1) if dim % d == 0)
        if dim % m:
            raise ConfigError(f"IndexConfig.pq_m={m} must divide the embedding dimension {dim}")
        return f"IVF{nlist},PQ{m}x{self.pq_bits}"


class DocIdMap:
    """The dense index's row ↔ doc id mapping without a Python object per document: the ids as one Arrow
    string array (row → id) and ``ckray.data.docstore.HashedIds`` over them (id → row): about 16 bytes per
    document beside the ids' own bytes, where a list and a dict of Python strings take ~150."""

    def __init__(self, doc_ids: "Sequence[str] | pa.Array | pa.ChunkedArray"):
        from ckray.data.docstore import HashedIds, id_hashes

        ids = doc_ids if isinstance(doc_ids, (pa.Array, pa.ChunkedArray)) else pa.array(list(doc_ids), pa.string())
        self.ids: pa.Array = ids.combine_chunks() if isinstance(ids, pa.ChunkedArray) else ids
        step = 1 << 16   # ids hashed a slice at a time: the Python strings of one slice exist at once
        hashes = np.concatenate([id_hashes(self.ids.slice(i, step).to_pylist()) for i in range(0, len(self.ids), step)]
                                or [np.zeros(0, np.uint64)])
        self._index = HashedIds.of(hashes, self.__getitem__)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, row: int) -> str:
        return self.ids[int(row)].as_py()

    def row(self, doc_id: str) -> int | None:
        """The row of ``doc_id``, or None."""
        return self._index.row(doc_id)

    def first_duplicate(self) -> str | None:
        """An id that occurs twice, or None."""
        found = self._index.duplicate()
        return found[0] if found else None


def documents_of_rows(rows: pa.Table) -> tuple["pa.ChunkedArray", np.ndarray | None]:
    """``(doc ids, starts)`` of a table with a row per vector (``doc_id``, and ``passage`` where documents have
    several: 0 opens a document). ``starts``: the rows where each document's passages start, and the row count
    after them (``[documents + 1]``); None without a ``passage`` column, where each row is a document."""
    if "passage" not in rows.column_names:
        return rows.column("doc_id"), None
    passage = np.asarray(rows.column("passage").to_numpy())
    if len(passage) and passage[0] != 0:
        raise ConfigError("the embedding rows start inside a document (its passage 0 is missing); re-run the embedding job")
    starts = np.append(np.flatnonzero(passage == 0), len(passage)).astype(np.int64)
    return rows.column("doc_id").take(pa.array(starts[:-1])), starts


class DenseIndex:
    """A faiss inner-product index and its doc-id mapping: faiss id i ↔ ``doc_ids[i]``, or, where documents
    are stored as several passage vectors (``EmbedConfig.passages``), faiss ids ``starts[i]`` to
    ``starts[i + 1]`` ↔ ``doc_ids[i]``, the document scored by its best passage (MaxP)."""

    def __init__(self, index: Any, doc_ids: "Sequence[str] | pa.Array | DocIdMap", meta: dict | None = None,
                 use_gpu: bool | None = None, starts: np.ndarray | None = None):
        import faiss

        self.index = index                      # CPU index: saving, reconstructing vectors
        self.doc_ids = doc_ids if isinstance(doc_ids, DocIdMap) else DocIdMap(doc_ids)
        self.starts = starts                    # None: one vector per document
        if starts is not None and (len(starts) != len(self.doc_ids) + 1 or starts[-1] != index.ntotal):
            raise ConfigError(f"{len(starts) - 1} passage groups over {starts[-1]} rows for {len(self.doc_ids)} "
                              f"documents and {index.ntotal} vectors; rebuild the dense index")
        self.meta = dict(meta or {})
        self._apply_search_params()
        want_gpu = _want_gpu(use_gpu)
        self._search_index = self.index
        if want_gpu and self.meta.get("kind") != "hnsw":
            self._search_index = faiss.index_cpu_to_all_gpus(self.index)

    # -- building ------------------------------------------------------------------------------

    @classmethod
    def build(cls, doc_ids: "Sequence[str] | pa.Array", embeddings: np.ndarray, config: IndexConfig | None = None,
              meta: dict | None = None) -> "DenseIndex":
        """The index over ``embeddings`` (row i ↔ ``doc_ids[i]``), all in memory."""
        x = np.ascontiguousarray(embeddings, dtype=np.float32)
        ids = DocIdMap(doc_ids)
        if x.ndim != 2 or len(x) != len(ids):
            raise ConfigError(f"embeddings {x.shape} do not match {len(ids)} doc ids")
        return cls._assemble(ids, x.shape[1], lambda rows: x[rows], lambda: iter([x]), config, meta)

    @classmethod
    def from_shards(cls, directory: str | os.PathLike, config: IndexConfig | None = None,
                    meta: dict | None = None) -> "DenseIndex":
        """The index over the finished embedding shards of ``directory``, read a shard at a time: beside the
        index itself the process holds one shard's vectors, the training sample of IVF/PQ
        (``IndexConfig.train_sample`` rows at most) and the doc ids as Arrow strings (:class:`DocIdMap`)."""
        shards = embedding_shard_paths(directory)
        with_passages = {"passage" in pq.read_schema(p).names for p in shards}
        if len(with_passages) > 1:
            raise ConfigError(f"the embedding shards in {directory} mix passage vectors and one vector per document; "
                              f"re-run the embedding job")
        columns = ["doc_id", "passage"] if with_passages == {True} else ["doc_id"]
        doc_ids, groups = documents_of_rows(pa.concat_tables([pq.read_table(p, columns=columns) for p in shards]))
        dim = pq.read_schema(shards[0]).field("embedding").type.list_size
        starts = np.cumsum([0] + [pq.read_metadata(p).num_rows for p in shards])

        def vectors(path: Path) -> np.ndarray:
            return embedding_matrix(pq.read_table(path, columns=["embedding"]).column(0))

        def sample(rows: np.ndarray) -> np.ndarray:
            """The vectors of global ``rows``, in that order: each shard read once, only its rows kept."""
            out = np.empty((len(rows), dim), np.float32)
            for i, p in enumerate(shards):
                mine = np.flatnonzero((rows >= starts[i]) & (rows < starts[i + 1]))
                if len(mine):
                    out[mine] = vectors(p)[rows[mine] - starts[i]]
            return out

        def batches() -> Iterator[np.ndarray]:
            return map(vectors, shards)

        return cls._assemble(DocIdMap(doc_ids), dim, sample, batches, config,
                             {**(meta or {}), "embeddings": str(directory)}, groups)

    @classmethod
    def _assemble(cls, ids: DocIdMap, dim: int, sample: Callable[[np.ndarray], np.ndarray],
                  batches: Callable[[], Iterator[np.ndarray]], config: IndexConfig | None,
                  meta: dict | None, starts: np.ndarray | None = None) -> "DenseIndex":
        """Create the index of ``config``, train it (IVF/PQ) on ``sample(rows)`` of a seeded random choice of
        rows, then add ``batches()`` (every vector once, in row order)."""
        import faiss

        config = config or IndexConfig()
        config.validate()
        duplicate = ids.first_duplicate()
        if duplicate is not None:
            raise ConfigError(f"duplicate doc id {duplicate!r} in the embedding shards; re-run the embedding job")
        n = len(ids) if starts is None else int(starts[-1])
        spec = config.factory(dim, n)
        index = faiss.index_factory(dim, spec, faiss.METRIC_INNER_PRODUCT)
        if config.kind == "hnsw":
            index.hnsw.efConstruction = config.ef_construction
        gpu = _want_gpu(config.use_gpu) and config.kind != "hnsw"
        work = faiss.index_cpu_to_all_gpus(index) if gpu else index
        if not index.is_trained:
            rng = np.random.default_rng(config.seed)
            work.train(sample(rng.choice(n, size=min(n, config.train_sample), replace=False)))
        added = 0
        for x in batches():
            if len(x):
                work.add(np.ascontiguousarray(x, dtype=np.float32))
                added += len(x)
        if added != n:
            raise ConfigError(f"{added} embeddings for {n} doc ids; re-run the embedding job")
        if gpu:
            index = faiss.index_gpu_to_cpu(work)
        meta = {**(meta or {}), **{"kind": config.kind, "factory": spec, "dim": dim, "count": n,
                                   "documents": len(ids), "metric": "inner_product", "config": asdict(config)}}
        log.info("built faiss index %s over %d vectors of dimension %d (%d documents)", spec, n, dim, len(ids))
        return cls(index, ids, meta, use_gpu=config.use_gpu, starts=starts)

    # -- persistence ---------------------------------------------------------------------------

    def save(self, directory: str | os.PathLike) -> Path:
        """Write index, ids and metadata (with a record of the other two files, checked by :meth:`load`)
        to a temporary directory, then rename it into place."""
        import faiss

        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
        faiss.write_index(self.index, str(tmp / INDEX_FILE))
        pq.write_table(self._row_table(), tmp / IDS_FILE)
        files = index_files_record(tmp, META_FILE, "jobs/build_dense_index.py")
        (tmp / META_FILE).write_text(json.dumps({**self.meta, **files}, indent=2, sort_keys=True))
        if directory.exists():
            shutil.rmtree(directory)
        os.replace(tmp, directory)
        return directory

    @classmethod
    def load(cls, directory: str | os.PathLike, use_gpu: bool | None = None) -> "DenseIndex":
        import faiss

        directory = Path(directory)
        missing = [f for f in (INDEX_FILE, IDS_FILE, META_FILE) if not (directory / f).exists()]
        if missing:
            raise MissingArtifactError(f"no dense index at {directory} ({', '.join(missing)} missing): "
                                       f"build it with jobs/build_dense_index.py")
        check_index_files(directory, META_FILE)
        index = faiss.read_index(str(directory / INDEX_FILE))
        rows = pq.read_table(directory / IDS_FILE)   # Arrow strings: no Python object per id
        meta = json.loads((directory / META_FILE).read_text())
        meta = {k: v for k, v in meta.items() if k not in INDEX_FILES_KEYS}   # the stamp's, not the index's
        if index.ntotal != rows.num_rows:
            raise MissingArtifactError(f"dense index at {directory} has {index.ntotal} vectors but {rows.num_rows} ids; "
                                       f"rebuild it")
        ids, starts = documents_of_rows(rows)
        return cls(index, ids, meta, use_gpu=use_gpu, starts=starts)

    def _row_table(self) -> pa.Table:
        """The doc id of every faiss row (and its passage number where documents have several)."""
        if self.starts is None:
            return pa.table({"doc_id": self.doc_ids.ids})
        counts = np.diff(self.starts)
        first = np.repeat(self.starts[:-1], counts)
        return pa.table({"doc_id": self.doc_ids.ids.take(pa.array(np.repeat(np.arange(len(counts)), counts))),
                         "passage": pa.array((np.arange(self.starts[-1]) - first).astype(np.int32))})

    # -- querying ------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.doc_ids)

    @property
    def dim(self) -> int:
        return int(self.index.d)

    def _apply_search_params(self) -> None:
        import faiss

        cfg = self.meta.get("config", {})
        if self.meta.get("kind") in ("ivf", "ivfpq"):
            ivf = faiss.extract_index_ivf(self.index)
            ivf.nprobe = int(cfg.get("nprobe", 32))
            ivf.make_direct_map()            # lets vectors() reconstruct by id
        elif self.meta.get("kind") == "hnsw":
            self.index.hnsw.efSearch = int(cfg.get("ef_search", 256))

    def _search_rows(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        index = self._search_index if k <= 2048 else self.index   # GPU faiss caps k at 2048
        return index.search(q, k)

    def search(self, query_vectors: np.ndarray, k: int) -> list[list[tuple[str, float]]]:
        """Top-k (doc_id, inner product) per query vector, best first; a document stored as passages scores its
        best passage's product (MaxP), found by searching more passages until k documents are in."""
        q = np.ascontiguousarray(np.atleast_2d(query_vectors), dtype=np.float32)
        k = min(k, len(self.doc_ids))
        if k <= 0 or len(q) == 0:
            return [[] for _ in range(len(q))]
        if self.starts is None:
            scores, rows = self._search_rows(q, k)
            return [[(self.doc_ids[r], float(s)) for s, r in zip(srow, rrow) if r >= 0]
                    for srow, rrow in zip(scores, rows)]
        total = int(self.starts[-1])
        k_rows = min(total, math.ceil(k * total / len(self.doc_ids)))
        while True:
            scores, rows = self._search_rows(q, k_rows)
            hits = [self._best_passages(srow, rrow, k) for srow, rrow in zip(scores, rows)]
            if k_rows >= total or all(len(h) == k for h in hits):
                return [[(self.doc_ids[d], s) for d, s in h] for h in hits]
            k_rows = min(total, 2 * k_rows)

    def _best_passages(self, scores: np.ndarray, rows: np.ndarray, k: int) -> list[tuple[int, float]]:
        """(document, its best passage's score) for the first ``k`` documents among passage rows ranked best first."""
        found = rows >= 0
        docs = np.searchsorted(self.starts, rows[found], side="right") - 1
        _, first = np.unique(docs, return_index=True)
        first = np.sort(first)[:k]             # each document at its best passage, in rank order
        return [(int(docs[i]), float(scores[found][i])) for i in first]

    def vectors(self, doc_ids: Sequence[str]) -> np.ndarray:
        """Stored vectors of ``doc_ids`` (exact for flat/hnsw/ivf; the PQ approximation for ivfpq), one per
        document: an index of passage vectors has several per document (:meth:`scores` takes their best)."""
        if self.starts is not None:
            raise ConfigError("this dense index stores documents as passage vectors, several per document: "
                              "score them with DenseIndex.scores")
        rows = self._rows(doc_ids)
        if not rows:
            return np.zeros((0, self.dim), np.float32)
        return np.stack([self.index.reconstruct(int(r)) for r in rows])

    def scores(self, query_vector: np.ndarray, doc_ids: Sequence[str]) -> np.ndarray:
        """s_emb(q, d) for each of ``doc_ids`` from the stored vectors: ``v_q · v_d``, or the best passage's
        product where documents are stored as passages (MaxP)."""
        q = np.asarray(query_vector, np.float32).reshape(-1)
        return np.array([max(float(self.index.reconstruct(int(r)) @ q) for r in self._passage_rows(d))
                         for d in self._rows(doc_ids)], np.float32)

    def _passage_rows(self, doc: int) -> range:
        """The faiss rows of document ``doc``'s vectors."""
        return range(doc, doc + 1) if self.starts is None else range(self.starts[doc], self.starts[doc + 1])

    def _rows(self, doc_ids: Sequence[str]) -> list[int]:
        rows = [self.doc_ids.row(d) for d in doc_ids]
        if None in rows:
            raise KeyError(f"document {doc_ids[rows.index(None)]!r} is not in the dense index")
        return rows

    def __contains__(self, doc_id: str) -> bool:
        return self.doc_ids.row(doc_id) is not None


def _want_gpu(use_gpu: bool | None) -> bool:
    import faiss

    gpus = faiss.get_num_gpus() if hasattr(faiss, "get_num_gpus") else 0
    if use_gpu and gpus == 0:
        raise ConfigError("IndexConfig.use_gpu=True but faiss sees no GPU (install faiss-gpu, or leave use_gpu unset)")
    return gpus > 0 if use_gpu is None else bool(use_gpu)


def build_dense_index(workdir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                      embed: EmbedConfig | None = None, index: IndexConfig | None = None) -> tuple[DenseIndex, dict]:
    """Embedding job + index build + save to ``W/dense/index``; returns the index and the job summary."""
    checkpoint = Path(checkpoint) if checkpoint is not None else default_checkpoint(workdir)
    embed = embed or EmbedConfig()
    summary = embed_corpus(workdir, checkpoint, embed)
    dense = DenseIndex.from_shards(embeddings_dir(workdir), index,
                                   {"checkpoint": str(checkpoint.resolve()),
                                    "checkpoint_sha256": summary["checkpoint_sha256"], "passages": embed.passages})
    dense.save(index_dir(workdir))
    return dense, summary

