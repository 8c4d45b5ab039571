"""Dense retrieval for CLEAR: the embedding job (Ray Data), the faiss index, and hybrid retrieval (Eq. 8).

Layout under the work directory ``W``::

    W/shards/part-NNNNN.parquet           corpus shards (doc_id, title, text)          ckray.data.shards
    W/dense/shards/part-NNNNN.parquet     one embedding shard per corpus shard, a row per passage vector:
                                          doc_id: string, embedding: fixed_size_list<float32|float16>[D],
                                          passage: int32 (0 opens a document; absent with --passages 1)
                                          (+ part-NNNNN.parquet.done.json: what it was computed from)
    W/dense/index/                        index.faiss, doc_ids.parquet (row i ↔ faiss id i), meta.json
    W/dense/hybrid.json                   λ_test tuned on training queries (``tune_lambda``)

Embedding job (:func:`embed_corpus`): a shard job of ``ckray.batch_inference`` — the corpus shards
not done yet → ``map_batches(DocumentEncoder, compute=ActorPoolStrategy(size=actors))``; each actor
loads the checkpoint once (``load_model``), on a GPU of its own when ``use_gpu``. Each embedding shard
is written atomically (``write_parquet_atomic`` + a done marker recording the checkpoint digest and
the source shard) as soon as all of its documents are in, in the corpus shard's order; a re-run skips
finished shards and redoes half-written ones. A lost actor is restarted and its batch retried: a
repeated document is dropped, a missing one is an error naming it.

Passages (``EmbedConfig.passages``): a document longer than the encoder's ``doc_max_len`` word pieces is read as
overlapping windows of that length, a vector each, and scored by its best window, s_emb(q, d) = max_p v_q · v_p
(MaxP, Dai & Callan 2019); with ``passages=1`` by its first window only, the paper's truncation (FirstP).
Documents that fit one window are encoded exactly as before.

Index (:class:`DenseIndex`): inner product over the embeddings; ``flat`` (exact) by default, ``hnsw``,
``ivf`` and ``ivfpq`` for large corpora; on GPU faiss when ``faiss.get_num_gpus() > 0``.

Hybrid (Gao et al. 2020, Eq. 8): ``s(q, d) = λ_test · s_lex(q, d) + s_emb(q, d)`` over the union of
the BM25 top ``lex_depth`` and the dense top ``dense_depth``, on the raw scores
(``HybridConfig.normalization = "none"``, the paper's and the default: CLEAR is trained as the residual of
raw BM25) or on each side's scores normalised per query (``"tmm"``, ``ckray.fusion.theoretical_min_max``:
BM25 / its query maximum, (cos + 1) / (its query maximum + 1)), which carries an untrained encoder's
λ_test better to another collection and is what a CLEAR trained on normalised BM25 is served on
(:func:`trained_normalization`). A union member found by only one side gets its *exact* missing
score: s_emb from its stored vector, s_lex from the Lucene scorer (``BM25Searcher.score``); retrievers
without a scorer fall back to the smallest score that side returned for the query (a lower bound,
documented in :func:`hybrid_candidates`). λ_test is chosen by grid search on nDCG@10 over training
queries (:func:`tune_lambda`), never by hand.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ckray.batch_inference import (ActorPoolConfig, ShardJob, actor_device, crash_once, run_shard_job,
                                   timing_columns, validate_checks)
from ckray.data.shards import (INDEX_FILES_KEYS, check_index_files, index_files_record, mark_done, shard_paths,
                               write_json_atomic, write_parquet_atomic)
from ckray.errors import ConfigError, MissingArtifactError
from ckray.fusion import (DEFAULT_HYBRID_NORMALIZATION, DEFAULT_LAMBDA_RULE, Candidates, Run, check_hybrid_normalization,
                          check_weight_rule, grid_search, judged_queries, linear_fusion)
from ckray.models.encoders import passage_overlap
from ckray.rankers.clear.options import DEFAULT_PASSAGES
from ckray.workdir import WorkDir

log = logging.getLogger(__name__)

DENSE_DIR = "dense"
INDEX_FILE = "index.faiss"
IDS_FILE = "doc_ids.parquet"
META_FILE = "meta.json"
HYBRID_FILE = "hybrid.json"
INDEX_KINDS = ("flat", "hnsw", "ivf", "ivfpq")


def dense_root(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).ranker_dir(DENSE_DIR)


def embeddings_dir(workdir: str | os.PathLike) -> Path:
    return dense_root(workdir) / "shards"


def index_dir(workdir: str | os.PathLike) -> Path:
    return dense_root(workdir) / "index"


def default_checkpoint(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).checkpoint("clear")


# =============================================================================================
# (a) Embedding job
# =============================================================================================

@dataclass
class EmbedConfig(ActorPoolConfig):
    """The Ray Data embedding job: its actor pool (``ckray.batch_inference.ActorPoolConfig``: actors,
    use_gpu — fp16 autocast on the GPU —, cpus_per_actor, batch_size — rows per actor batch, sorted by
    length inside the actor —, fault tolerance) and

    encode_batch_size: documents per forward pass inside an actor.
    float16:           store embeddings as float16 (half the disk; the index is built in float32).
    doc_max_len:       encode documents at this many word pieces instead of the checkpoint's
                       ``doc_max_len`` (e.g. train at 256, index at 512); None: the checkpoint's.
    passages:          a document longer than ``doc_max_len`` is encoded as up to this many windows of
                       ``doc_max_len`` word pieces (0: as many as it takes to read it whole), a quarter of each
                       shared with the next (:func:`passage_overlap`), one vector each, and scored by its
                       best one (MaxP, Dai & Callan 2019); 1: its first window only (FirstP, the paper's
                       truncation).
    """

    batch_size: int = 512
    encode_batch_size: int = 32
    float16: bool = False
    doc_max_len: int | None = None
    passages: int = DEFAULT_PASSAGES

    def validate(self) -> None:
        validate_checks(self, self.pool_checks() + [
            (self.doc_max_len is None or self.doc_max_len >= 1, "doc_max_len must be >= 1"),
            (self.passages >= 0, "passages must be >= 0 (0: every window of a document)"),
            (self.encode_batch_size >= 1, "encode_batch_size must be >= 1")])


class DocumentEncoder:
    """Ray Data callable class: loads the model once per actor, embeds ``doc_text(title, text)``: one row per
    document whose ``embedding`` holds its passages' vectors one after another (``EmbedConfig.passages``)."""

    def __init__(self, checkpoint: str, use_gpu: bool = False, threads: int = 0, encode_batch_size: int = 32,
                 doc_max_len: int | None = None, passages: int = DEFAULT_PASSAGES, crash_once: str | None = None):
        from ckray.models.checkpoint import load_model

        self.device = actor_device(use_gpu, threads)
        self.model = load_model(checkpoint, map_location="cpu").to(self.device).eval()
        if doc_max_len is not None:  # checked against the encoder's positions by embed_corpus
            self.model.config.doc_max_len = doc_max_len
        self.encode_batch_size = encode_batch_size
        self.passages = passages
        self.crash_once = crash_once  # ckray.batch_inference.crash_once: a test's lost actor

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        import contextlib

        import torch

        from ckray.data.collections import doc_text

        crash_once(self.crash_once)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        texts = [doc_text(t, x) for t, x in zip(batch["title"], batch["text"])]
        amp = (torch.autocast("cuda", dtype=torch.float16) if self.device.type == "cuda"
               else contextlib.nullcontext())
        with amp:
            vectors = self.model.encode_document_passages(texts, self.passages,
                                                          passage_overlap(self.model.config.doc_max_len),
                                                          batch_size=self.encode_batch_size)
        timing = timing_columns(len(texts), wall0, cpu0)
        return pa.table({
            "doc_id": pa.array([str(d) for d in batch["doc_id"]], pa.string()),
            "path": pa.array([str(p) for p in batch["path"]], pa.string()),
            "embedding": pa.array([v.float().numpy().reshape(-1) for v in vectors], pa.list_(pa.float32())),
            **{name: pa.array(values) for name, values in timing.items()}})


def _shard_stamp(source: Path, digest: str, config: EmbedConfig, doc_max_len: int | None) -> dict:
    """What an embedding shard was made from and how: a shard made otherwise (another model, length, dtype or
    number of passages) is not reused. ``doc_max_len``: the length documents were read at."""
    st = source.stat()
    return {"source": source.name, "source_rows": pq.read_metadata(source).num_rows,
            "source_size": st.st_size, "source_mtime_ns": st.st_mtime_ns,
            "checkpoint_sha256": digest, "dtype": "float16" if config.float16 else "float32",
            "doc_max_len": doc_max_len, "passages": config.passages}


def embedding_table(doc_ids: Sequence[str], embeddings: np.ndarray, float16: bool = False,
                    passage: Sequence[int] | None = None) -> pa.Table:
    """``doc_id: string, embedding: fixed_size_list<float>[D]``, a row per vector; with ``passage`` (each row's
    position in its document, 0 opening a document) also ``passage: int32``, and a document's rows in order."""
    emb = np.ascontiguousarray(embeddings, dtype=np.float16 if float16 else np.float32)
    if emb.ndim != 2 or emb.shape[1] < 1 or len(emb) != len(doc_ids):
        raise ValueError(f"embeddings of shape {emb.shape} for {len(doc_ids)} documents")
    dim = emb.shape[1]
    values = pa.array(emb.reshape(-1))
    columns = {"doc_id": pa.array(list(doc_ids), pa.string()),
               "embedding": pa.FixedSizeListArray.from_arrays(values, dim)}
    if passage is not None:
        columns["passage"] = pa.array(np.asarray(passage, np.int32))
    return pa.table(columns)


def embed_corpus(workdir: str | os.PathLike, checkpoint: str | os.PathLike, config: EmbedConfig | None = None,
                 out_dir: str | os.PathLike | None = None, progress: bool = True, *,
                 crash_once: str | None = None) -> dict:
    """Embed every corpus shard not yet embedded with this checkpoint; returns a summary dict.

    The summary is ``ckray.batch_inference.run_shard_job``'s (``documents`` embedded now,
    ``shards_written``, ``shards_skipped``, ``repeated_rows``, ``batches``, ``seconds``, ``docs_per_s``,
    ``steady_docs_per_s``) with the actors' time as ``encode_s`` / ``encode_cpu_s`` (wall and
    process-CPU seconds inside their batch calls, summed over actors), plus ``out_dir`` and
    ``checkpoint_sha256`` (the model's digest, as the stamps record it). ``crash_once``: a marker path
    that makes one actor die on its first batch (``ckray.batch_inference.crash_once``; tests).
    """
    config = config or EmbedConfig()
    config.validate()
    out_dir = Path(out_dir) if out_dir is not None else embeddings_dir(workdir)
    checkpoint = str(Path(checkpoint).resolve())
    from ckray.models.checkpoint import checkpoint_digest

    digest = checkpoint_digest(checkpoint)
    if config.doc_max_len is not None:
        _check_doc_max_len(checkpoint, config.doc_max_len)
    from ckray.models.checkpoint import read_checkpoint_config

    doc_max_len = config.doc_max_len or read_checkpoint_config(checkpoint).get("config", {}).get("doc_max_len")
    sources = shard_paths(workdir)
    stamps = {s.name: _shard_stamp(s, digest, config, doc_max_len) for s in sources}

    dim = _checkpoint_dim(checkpoint)

    def write(path: Path, ids: list[str], vectors: list[np.ndarray], stamp: dict) -> None:
        """A row per passage vector; the ``passage`` column only where documents may have several."""
        counts = [len(v) for v in vectors]
        emb = np.concatenate(vectors) if vectors else np.zeros((0, dim), np.float32)
        rows = [d for d, n in zip(ids, counts) for _ in range(n)]
        passage = [i for n in counts for i in range(n)] if config.passages != 1 else None
        write_embedding_shard(path, rows, [emb], config.float16, stamp, passage)

    def payloads(batch: pa.Table) -> list[np.ndarray]:
        return [np.asarray(v.values, np.float32).reshape(-1, dim) for v in batch.column("embedding")]

    summary = run_shard_job(ShardJob(
        what="embedding", sources=sources, out_dir=out_dir, stamps=stamps, actor=DocumentEncoder,
        actor_kwargs={"checkpoint": checkpoint, "use_gpu": config.use_gpu, "threads": config.torch_threads,
                      "encode_batch_size": config.encode_batch_size, "doc_max_len": config.doc_max_len,
                      "passages": config.passages, "crash_once": crash_once},
        pool=config, payloads=payloads, write=write, batch_format="pyarrow", progress=progress))
    summary["encode_s"] = summary.pop("actor_seconds")
    summary["encode_cpu_s"] = summary.pop("actor_cpu_seconds")
    return {**summary, "out_dir": str(out_dir), "checkpoint_sha256": digest}


def _check_doc_max_len(checkpoint: str, doc_max_len: int) -> None:
    """An encoder cannot read past its position embeddings (512 for BERT and MiniLM)."""
    from ckray.models.checkpoint import read_checkpoint_config

    positions = read_checkpoint_config(checkpoint).get("config", {}).get("bert_config", {}).get(
        "max_position_embeddings")
    if positions is not None and doc_max_len > positions:
        raise ConfigError(f"doc_max_len {doc_max_len}: the encoder of {checkpoint} has {positions} positions")


def _checkpoint_dim(checkpoint: str) -> int:
    """Embedding dimension recorded in the checkpoint (``config.dim``, else the encoder's hidden size)."""
    from ckray.models.checkpoint import read_checkpoint_config

    cfg = read_checkpoint_config(checkpoint).get("config", {})
    dim = cfg.get("dim") or (cfg.get("bert_config") or {}).get("hidden_size")
    if not dim:
        raise MissingArtifactError(f"checkpoint {checkpoint} records no embedding dimension (config.dim)")
    return int(dim)


def write_embedding_shard(path: str | os.PathLike, ids: Sequence[str], vecs: Sequence[np.ndarray], float16: bool,
                          stamp: dict, passage: Sequence[int] | None = None) -> None:
    """Write one embedding shard atomically (:func:`embedding_table`), then its done marker (``stamp`` + row count)."""
    emb = np.concatenate(vecs)
    write_parquet_atomic(embedding_table(ids, emb, float16, passage), path)
    mark_done(path, stamp)


def embedding_shard_paths(directory: str | os.PathLike) -> list[Path]:
    """The finished embedding shards (those with a done marker), in name order."""
    directory = Path(directory)
    shards = sorted(p for p in directory.glob("part-*.parquet") if (p.parent / (p.name + ".done.json")).exists())
    if not shards:
        raise MissingArtifactError(f"no embedding shards in {directory}: run jobs/build_dense_index.py")
    return shards


def embedding_matrix(column: "pa.Array | pa.ChunkedArray") -> np.ndarray:
    """An ``embedding`` column (fixed-size lists of float16/float32) → a float32 matrix [rows, D]."""
    col = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    dim = col.type.list_size
    if len(col) == 0:
        return np.zeros((0, dim), np.float32)
    return col.flatten().to_numpy(zero_copy_only=False).astype(np.float32).reshape(-1, dim)


def read_embedding_shards(directory: str | os.PathLike) -> tuple[list[str], np.ndarray]:
    """All finished embedding shards in name order → (doc_ids, float32 matrix [N, D]), in memory (tests,
    benchmarks). Building the index does not use it: :meth:`DenseIndex.from_shards` reads a shard at a time."""
    ids: list[str] = []
    mats = []
    for p in embedding_shard_paths(directory):
        t = pq.read_table(p)
        ids.extend(t.column("doc_id").to_pylist())
        mats.append(embedding_matrix(t.column("embedding")))
    x = np.concatenate(mats)
    return ids, (x if len(x) else np.zeros((0, 0), np.float32))


# =============================================================================================
# (b) faiss index
# =============================================================================================

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


# =============================================================================================
# Retrievers
# =============================================================================================

class DenseRetriever:
    """``search(queries, k) -> run`` with a CLEAR checkpoint (query tower) over a :class:`DenseIndex`."""

    def __init__(self, checkpoint: Any, index: DenseIndex | str | os.PathLike, query_batch_size: int = 128,
                 device: str | None = None):
        import torch

        from ckray.models.checkpoint import load_model

        self.checkpoint: str | None = None   # its directory, when loaded from one
        if isinstance(checkpoint, torch.nn.Module):
            self.model = checkpoint
        else:
            self.model, self.checkpoint = load_model(checkpoint), str(checkpoint)
        if device is None:
            from ckray.device import default_device

            device = str(default_device())
        self.model = self.model.to(device).eval()
        self.index = index if isinstance(index, DenseIndex) else DenseIndex.load(index)
        self.query_batch_size = query_batch_size

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return self.model.encode_queries(list(texts), batch_size=self.query_batch_size).float().numpy()

    def search(self, queries: Mapping[str, str], k: int = 1000) -> Run:
        qids = [q for q, t in queries.items() if t and t.strip()]
        run: Run = {q: [] for q in queries}
        if qids:
            for qid, hits in zip(qids, self.index.search(self.encode([queries[q] for q in qids]), k)):
                run[qid] = hits
        return run

    def score(self, queries: Mapping[str, str], candidates: Mapping[str, Iterable[str]]) -> dict[str, dict[str, float]]:
        """Exact s_emb(q, d) for given (query, document) pairs, from the stored document vectors."""
        qids = [q for q in candidates if q in queries]
        out: dict[str, dict[str, float]] = {}
        if not qids:
            return out
        vq = self.encode([queries[q] for q in qids])
        for i, q in enumerate(qids):
            ids = [d for d in candidates[q] if d in self.index]
            out[q] = dict(zip(ids, self.index.scores(vq[i], ids).tolist()))
        return out


# ---------------------------------------------------------------------------------------------
# (c) Hybrid retrieval (Eq. 8) and λ_test tuning
# ---------------------------------------------------------------------------------------------

DEFAULT_LAMBDA_GRID: tuple[float, ...] = (0.0, *[round(float(x), 6) for x in np.geomspace(1e-3, 10.0, 41)])


def hybrid_candidates(lex_run: Run, dense_run: Run,
                      lex_score: Callable[[str, list[str]], Mapping[str, float]] | None = None,
                      emb_score: Callable[[str, list[str]], Mapping[str, float]] | None = None) -> Candidates:
    """The union of both runs with both scores per (query, document).

    A member found by one side only gets the other side's score from ``lex_score(qid, doc_ids)`` /
    ``emb_score(qid, doc_ids)`` (exact), or, without a scorer, the lowest score that side returned for
    the query. The document ranked below that side's cut-off, so this is an upper bound on its true
    score: cheap, but it can favour such documents slightly, which is why retrievers fetch exact
    scores by default (``HybridConfig.exact``).
    """
    out: Candidates = {}
    for qid in set(lex_run) | set(dense_run):
        lex = dict(lex_run.get(qid, []))
        emb = dict(dense_run.get(qid, []))
        need_lex = [d for d in emb if d not in lex]
        need_emb = [d for d in lex if d not in emb]
        lex.update(_fill(qid, need_lex, lex_score, lex))
        emb.update(_fill(qid, need_emb, emb_score, emb))
        out[qid] = {d: (float(lex[d]), float(emb[d])) for d in lex.keys() | emb.keys() if d in lex and d in emb}
    return out


def _fill(qid: str, ids: list[str], scorer, have: Mapping[str, float]) -> dict[str, float]:
    if not ids:
        return {}
    if scorer is not None:
        got = dict(scorer(qid, ids))
        if len(got) == len(ids):
            return got
        ids = [d for d in ids if d not in got]
    else:
        got = {}
    floor = min(have.values()) if have else 0.0
    return {**got, **{d: floor for d in ids}}


def tune_lambda(candidates: Candidates, qrels: Mapping[str, Mapping[str, int]],
                grid: Sequence[float] = DEFAULT_LAMBDA_GRID, k: int = 1000,
                normalization: str = "none", rule: str = DEFAULT_LAMBDA_RULE) -> tuple[float, dict[float, float]]:
    """Grid search of λ_test for nDCG@10 of Eq. 8 (``ckray.fusion.linear_fusion``, ``s = λ ·
    s_lex + s_emb`` on the scores as ``normalization`` gives them) over the judged queries in
    ``candidates``, chosen by ``rule`` (``ckray.fusion.grid_search``: ``"best"``, ties to the smaller λ;
    ``"one-se"``, the largest λ within one standard error of the best).

    Returns ``(chosen λ, {λ: nDCG@10})``.
    """
    judged = judged_queries(qrels, candidates, "tune_lambda")
    cands = {q: candidates[q] for q in judged}
    return grid_search(lambda lam: linear_fusion(cands, lam, k, normalization), judged, grid, "λ_test", rule)


@dataclass
class HybridConfig:
    """Eq. 8 retrieval. ``lam`` is λ_test, applied to the scores as ``normalization`` gives them
    (module docstring; a file written without the field meant ``"none"``, :func:`load_hybrid_config`);
    depths are the candidate lists taken from each side."""

    lam: float = 0.05
    normalization: str = DEFAULT_HYBRID_NORMALIZATION
    rule: str = DEFAULT_LAMBDA_RULE   # how λ was chosen from the dev grid (ckray.fusion.grid_search)
    lex_depth: int = 1000
    dense_depth: int = 100
    exact: bool = True            # fetch missing scores exactly (else: lowest score of that side)
    tuned: dict = field(default_factory=dict)
    source: str | None = None     # where a λ not tuned here came from (a checkpoint's deploy.json, ckray.deploy)

    def __post_init__(self) -> None:
        check_hybrid_normalization("HybridConfig", self.normalization)
        check_weight_rule("HybridConfig", self.rule, "rule")


class HybridRetriever:
    """BM25 ∪ dense candidates, ``s = λ_test · s_lex + s_emb`` (Eq. 8)."""

    def __init__(self, lexical: Any, dense: DenseRetriever, config: HybridConfig | None = None):
        self.lexical, self.dense, self.config = lexical, dense, config or HybridConfig()
        normalized = getattr(getattr(getattr(dense, "model", None), "config", None), "normalize", True)
        if self.config.normalization == "tmm" and not normalized:
            raise ConfigError(f"CLEAR checkpoint {getattr(dense, 'checkpoint', None)} scores by an inner product "
                              f"(normalize: false), which has no lower bound: hybrid normalization 'tmm' needs its "
                              f"cosine; use normalization 'none' (--hybrid-normalization none)")

    def candidates(self, queries: Mapping[str, str], k: int | None = None) -> Candidates:
        cfg = self.config
        lex_run = self.lexical.search(dict(queries), max(cfg.lex_depth, k or 0))
        dense_run = self.dense.search(queries, max(cfg.dense_depth, 0))
        lex_score = emb_score = None
        if cfg.exact:
            emb_score = lambda q, ids: self.dense.score({q: queries[q]}, {q: ids}).get(q, {})  # noqa: E731
            if hasattr(self.lexical, "score"):
                lex_score = lambda q, ids: {d: self.lexical.score(queries[q], d) for d in ids}  # noqa: E731
        return hybrid_candidates(lex_run, dense_run, lex_score, emb_score)

    @property
    def settings(self) -> dict:
        """The deployment setting in use and where it came from (what an evaluation records)."""
        return {"lambda": {"value": self.config.lam, "normalization": self.config.normalization,
                           "rule": self.config.rule,
                           "source": self.config.source or "tuned on this collection's training queries"}}

    def search(self, queries: Mapping[str, str], k: int = 1000) -> Run:
        run = linear_fusion(self.candidates(queries, k), self.config.lam, k, self.config.normalization)
        return {q: run.get(q, []) for q in queries}

    def tune(self, queries: Mapping[str, str], qrels: Mapping[str, Mapping[str, int]],
             grid: Sequence[float] = DEFAULT_LAMBDA_GRID) -> tuple[float, dict[float, float]]:
        """Set λ_test by grid search on nDCG@10 over ``queries`` (training queries, never test), chosen by
        the config's ``rule``."""
        chosen, table = tune_lambda(self.candidates(queries), qrels, grid, normalization=self.config.normalization,
                                    rule=self.config.rule)
        self.config.lam = chosen
        self.config.tuned = {"queries": len(queries), "ndcg@10": table[chosen], "grid": {str(k): v for k, v in table.items()}}
        return chosen, table


def tune_hybrid(workdir: str | os.PathLike, queries: Mapping[str, str], qrels: Mapping[str, Mapping[str, int]],
                checkpoint: str | os.PathLike | None = None, config: HybridConfig | None = None,
                grid: Sequence[float] = DEFAULT_LAMBDA_GRID) -> HybridConfig:
    """Tune λ_test on *training* queries with BM25 (``W/bm25``) + the dense index, save ``W/dense/hybrid.json``."""
    from ckray.lexical.bm25 import bm25_retriever

    from ckray.deploy import save_deploy_setting

    dense = dense_retriever(workdir, checkpoint)
    hybrid = HybridRetriever(bm25_retriever(workdir), dense, config or HybridConfig())
    hybrid.tune(queries, qrels, grid)
    save_hybrid_config(workdir, hybrid.config)
    save_deploy_setting(dense.checkpoint, "lambda", {"value": hybrid.config.lam,
                                                     "normalization": hybrid.config.normalization,
                                                     "rule": hybrid.config.rule, "tuned_on": {
        "workdir": str(Path(workdir).resolve()), "queries": len(queries), "ndcg@10": hybrid.config.tuned["ndcg@10"]}})
    return hybrid.config


def trained_normalization(checkpoint: str | os.PathLike | None) -> str:
    """The hybrid normalization a CLEAR checkpoint is trained for: ``tmm`` when its margin saw BM25 divided by the
    query's top score (``--bm25-scale query-max``, tmm's lexical side), else the raw Eq. 8 (``none``; also for a
    checkpoint that was never trained here)."""
    from ckray.models.checkpoint import read_training_data_config

    if checkpoint is None:
        return DEFAULT_HYBRID_NORMALIZATION
    scale = read_training_data_config(checkpoint).get("bm25_scale")
    return "tmm" if scale == "query-max" else DEFAULT_HYBRID_NORMALIZATION


def carry_hybrid(workdir: str | os.PathLike, checkpoint: str | os.PathLike) -> HybridConfig | None:
    """For a collection with no training queries: λ_test saved with ``checkpoint`` (``ckray.deploy``)
    written to ``W/dense/hybrid.json`` with its ``source``; None (nothing written) when none was saved."""
    from ckray.deploy import carried_lambda, source_of

    carried = carried_lambda(checkpoint)
    if carried is None:
        return None
    config = HybridConfig(lam=float(carried["value"]), normalization=carried.get("normalization", "none"),
                          rule=carried.get("rule", DEFAULT_LAMBDA_RULE), source=source_of(checkpoint),
                          tuned=dict(carried.get("tuned_on") or {}))
    save_hybrid_config(workdir, config)
    return config


def save_hybrid_config(workdir: str | os.PathLike, config: HybridConfig) -> Path:
    record = asdict(config)
    if record["source"] is None:  # tuned here: the file reads as it always has
        del record["source"]
    return write_json_atomic(record, dense_root(workdir) / HYBRID_FILE)


def load_hybrid_config(workdir: str | os.PathLike) -> HybridConfig:
    path = dense_root(workdir) / HYBRID_FILE
    if not path.exists():
        raise MissingArtifactError(f"no tuned λ_test at {path}: run jobs/build_dense_index.py (it tunes λ on "
                                   f"training queries, or carries the λ saved with the checkpoint), or pass --lambda")
    record = json.loads(path.read_text())
    record.setdefault("normalization", "none")   # written before the field: the raw Eq. 8
    return HybridConfig(**record)


# ---------------------------------------------------------------------------------------------
# Pipeline factories (ckray.pipelines: "clear-dense", "clear")
# ---------------------------------------------------------------------------------------------

def dense_retriever(workdir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                    **options: Any) -> DenseRetriever:
    """``clear-dense``: the CLEAR query tower over ``W/dense/index`` (its checkpoint from the index metadata)."""
    index = DenseIndex.load(index_dir(workdir))
    ckpt = checkpoint or index.meta.get("checkpoint") or default_checkpoint(workdir)
    if not Path(ckpt).exists():
        ckpt = default_checkpoint(workdir)
    check_index_checkpoint(index, ckpt, index_dir(workdir))
    return DenseRetriever(ckpt, index, **options)


def check_index_checkpoint(index: DenseIndex, checkpoint: str | os.PathLike, where: str | os.PathLike) -> None:
    """The query tower must be the model whose documents the index holds: a ConfigError naming both
    checkpoints otherwise (another model's query vectors would score silently wrong)."""
    from ckray.models.checkpoint import checkpoint_digest, read_checkpoint_config

    built = index.meta.get("checkpoint_sha256")
    if built is None:
        return
    if checkpoint_digest(checkpoint) != built:
        encoder = read_checkpoint_config(checkpoint).get("config", {}).get("encoder")
        raise ConfigError(f"checkpoint {checkpoint} (encoder {encoder}) is not the model the dense index at {where} "
                          f"was built with ({index.meta.get('checkpoint')}, sha256 {built[:12]}…): its query vectors "
                          f"do not fit that index; rebuild it with jobs/build_dense_index.py --checkpoint {checkpoint}")


def hybrid_retriever(workdir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                     lam: float | None = None, normalization: str | None = None, **options: Any) -> HybridRetriever:
    """``clear``: BM25 + CLEAR dense with the λ_test tuned on training queries (``W/dense/hybrid.json``).
    ``lam`` / ``normalization`` (flags) override the file's. A λ means something only on the scores it
    was tuned on, so another normalization than the file's needs a λ too (a ConfigError otherwise)."""
    from ckray.lexical.bm25 import bm25_retriever

    if normalization is not None:
        check_hybrid_normalization("hybrid_retriever", normalization)
    path = dense_root(workdir) / HYBRID_FILE
    if lam is not None and not path.exists():
        dense = dense_retriever(workdir, checkpoint, **options)
        config = HybridConfig(lam=lam, normalization=normalization or trained_normalization(dense.checkpoint),
                              source="flag")
        return HybridRetriever(bm25_retriever(workdir), dense, config)
    config = load_hybrid_config(workdir)
    if normalization not in (None, config.normalization) and lam is None:
        raise ConfigError(f"λ_test {config.lam} in {path} was tuned for hybrid normalization "
                          f"{config.normalization!r}, not {normalization!r}: pass --lambda with "
                          f"--hybrid-normalization")
    if lam is not None:
        config.lam, config.normalization, config.source = lam, normalization or config.normalization, "flag"
    return HybridRetriever(bm25_retriever(workdir), dense_retriever(workdir, checkpoint, **options), config)
