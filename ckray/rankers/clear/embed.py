"""The CLEAR embedding job (Ray Data): every corpus shard → an embedding shard under ``W/dense/shards``
(``ckray.rankers.clear.layout``), and the helpers that write and read those shards.

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
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ckray.batch_inference import (ActorPoolConfig, ShardJob, actor_device, crash_once, run_shard_job,
                                   timing_columns, validate_checks)
from ckray.data.shards import mark_done, shard_paths, write_parquet_atomic
from ckray.errors import ConfigError, MissingArtifactError
from ckray.models.encoders import passage_overlap
from ckray.rankers.clear.layout import embeddings_dir
from ckray.rankers.clear.options import DEFAULT_PASSAGES


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
    benchmarks). Building the index does not use it: ``faiss_index.DenseIndex.from_shards`` reads a shard at a time."""
    ids: list[str] = []
    mats = []
    for p in embedding_shard_paths(directory):
        t = pq.read_table(p)
        ids.extend(t.column("doc_id").to_pylist())
        mats.append(embedding_matrix(t.column("embedding")))
    x = np.concatenate(mats)
    return ids, (x if len(x) else np.zeros((0, 0), np.float32))

