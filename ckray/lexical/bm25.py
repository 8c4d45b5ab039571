"""Lucene BM25 through Pyserini: index the corpus shards, search in batches with threads.

The index holds one field, ``contents = title + " " + text`` (as BEIR's flat Pyserini indexes),
analysed by Lucene's default English analyser. Default parameters k1=0.9, b=0.4 (Anserini's).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from ckray.data.collections import doc_text
from ckray.workdir import WorkDir
from ckray.data.shards import (check_index_files, index_files_changed, index_files_record, read_json,
                               read_manifest, shard_paths, write_json_atomic)
from ckray.errors import MissingArtifactError
from ckray.lexical.anserini import run_anserini
from ckray.lexical.pool import PooledRetriever

log = logging.getLogger(__name__)

Run = dict[str, list[tuple[str, float]]]
META = "ckray_index.json"


def bm25_index_dir(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).bm25_index


def index_json_collection(input_dir: Path, index_dir: Path, threads: int = 2, impact: bool = False,
                          extra_args: tuple[str, ...] = ()) -> None:
    """Build a Lucene index from a directory of JSON lines files (atomically: tmp dir, then rename)."""
    index_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{index_dir.name}.", dir=index_dir.parent))
    args = ["-collection", "JsonVectorCollection" if impact else "JsonCollection", "-input", str(input_dir),
            "-index", str(tmp), "-generator", "DefaultLuceneDocumentGenerator", "-threads", str(threads)]
    args += ["-impact", "-pretokenized"] if impact else ["-storePositions", "-storeDocvectors"]
    run_anserini("IndexCollection", args + list(extra_args))
    if index_dir.exists():
        shutil.rmtree(index_dir)
    os.replace(tmp, index_dir)


def build_bm25_index(workdir: str | os.PathLike, threads: int = 2) -> Path:
    """Index ``W/shards`` into ``W/bm25/index``; skipped when the shards have not changed. The shards are
    rewritten as Anserini's JSON lines a batch of rows at a time; Lucene indexes them in a subprocess
    whose heap is ``$CKRAY_JVM_HEAP``."""
    index_dir = bm25_index_dir(workdir)
    manifest = read_manifest(workdir)
    stamp = {"shards_sha256": manifest["input_sha256"], "documents": manifest["documents"]}
    if (index_dir / META).exists():
        recorded = read_json(index_dir / META)
        changed = index_files_changed(index_dir, META)   # None: a stamp that records no files is rebuilt
        if {k: recorded.get(k) for k in stamp} == stamp and changed == []:
            log.info("BM25 index %s is up to date", index_dir)
            return index_dir
        if changed:
            log.warning("BM25 index %s: %s differ(s) from what was written (truncated or changed); rebuilding",
                        index_dir, ", ".join(changed))
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=Path(workdir)) as tmp:
        for shard in shard_paths(workdir):
            with open(Path(tmp) / (shard.stem + ".jsonl"), "w", encoding="utf-8") as f:
                for batch in pq.ParquetFile(shard).iter_batches(batch_size=4096, columns=["doc_id", "title", "text"]):
                    for did, title, text in zip(*(batch.column(c).to_pylist() for c in range(3))):
                        f.write(json.dumps({"id": did, "contents": doc_text(title, text)}) + "\n")
        index_json_collection(Path(tmp), index_dir, threads=threads)
    write_json_atomic({**stamp, **index_files_record(index_dir, META, "jobs/prepare.py")}, index_dir / META)
    log.info("BM25 index of %d documents built in %.1fs", manifest["documents"], time.time() - t0)
    return index_dir


def check_bm25_index(index_dir: str | os.PathLike) -> None:
    """:class:`MissingArtifactError` when there is no Lucene index at ``index_dir``, or its files are not
    those its stamp records (``check_index_files``)."""
    if (Path(index_dir) / META).exists():
        check_index_files(index_dir, META)
    elif not any(Path(index_dir).glob("segments_*")):
        raise MissingArtifactError(f"no Lucene index at {index_dir}: build it with jobs/prepare.py")


@dataclass
class BM25Searcher:
    """Batch BM25 search over a Lucene index (one JVM per process)."""

    index_dir: str
    k1: float = 0.9
    b: float = 0.4
    threads: int = 2

    def __post_init__(self):
        check_bm25_index(self.index_dir)
        from ckray.lexical.jvm import ensure_jvm

        ensure_jvm()
        from pyserini.search.lucene import LuceneSearcher

        self._searcher = LuceneSearcher(str(self.index_dir))
        self._searcher.set_bm25(self.k1, self.b)
        self._reader = None

    def search(self, queries: dict[str, str], k: int = 1000) -> Run:
        """Top-k per query, searched in parallel threads inside Lucene."""
        qids = [q for q, text in queries.items() if text.strip()]
        if not qids:
            return {q: [] for q in queries}
        hits = self._searcher.batch_search([queries[q] for q in qids], qids, k=k, threads=self.threads)
        run: Run = {q: [(h.docid, float(h.score)) for h in hits.get(q, [])] for q in qids}
        return {q: run.get(q, []) for q in queries}

    def search_one(self, query: str, k: int = 1000) -> list[tuple[str, float]]:
        if not query.strip():
            return []
        return [(h.docid, float(h.score)) for h in self._searcher.search(query, k=k)]

    def score(self, query: str, doc_id: str) -> float:
        """BM25 score of one (query, document) pair, also for documents outside the top-k
        (Lucene's own scorer with the same k1, b, so it equals the score the search returns)."""
        if self._reader is None:
            from jnius import autoclass
            from pyserini.index.lucene import LuceneIndexReader

            self._reader = LuceneIndexReader(str(self.index_dir))
            self._similarity = autoclass("org.apache.lucene.search.similarities.BM25Similarity")(self.k1, self.b)
        return float(self._reader.compute_query_document_score(doc_id, query, similarity=self._similarity))

    @property
    def num_docs(self) -> int:
        return int(self._searcher.num_docs)


def bm25_retriever(workdir: str | os.PathLike, k1: float = 0.9, b: float = 0.4, threads: int = 2,
                   actors: int | None = 0) -> BM25Searcher | PooledRetriever:
    """Pipeline factory for ``bm25``: a searcher in this process (``actors=0``), or one that searches on
    a pool of Ray actors, each its own searcher with ``threads`` threads: ``actors`` of them, or with
    None as many as the cluster's CPUs hold (:mod:`ckray.lexical.pool`)."""
    if actors is None or actors > 0:
        check_bm25_index(bm25_index_dir(workdir))   # here: an actor that fails to open it dies in its creation
        factory = functools.partial(bm25_retriever, str(Path(workdir).resolve()), k1=k1, b=b, threads=threads)
        return PooledRetriever(factory, actors=actors, cpus_per_actor=threads)
    return BM25Searcher(str(bm25_index_dir(workdir)), k1=k1, b=b, threads=threads)
