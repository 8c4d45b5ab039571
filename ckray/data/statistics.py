"""Word-piece statistics of a corpus: document frequency of each vocabulary id, N and mean length.

What a model needs from the collection it indexes or searches, as BM25 takes its IDF and average
length from the collection it searches: CK-QTI's explicit match (Eq. 9 of Mitra et al. 2020) and the
QDS-Transformer's IDF-weighted MaxSim head read them. They are counted over the corpus shards of a
work directory, one Ray task per shard (memory: one vocabulary-sized count per task), and cached in
``W/statistics/word-pieces-<digest>.npz`` for the corpus manifest and tokenisation they were counted
for; counts of parts of a corpus add up, so the sharded count equals one pass.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

STATISTICS_DIR = "statistics"


@dataclass(frozen=True)
class Tokenisation:
    """How a model turns a document into word pieces: its tokenizer, vocabulary size and the number of
    pieces of a document it reads (longer documents are truncated, and counted truncated)."""

    encoder: str
    vocab_size: int
    max_length: int


@dataclass
class CorpusStats:
    """Document frequency per vocabulary id, N, mean |d| in word pieces. Counted over exact-match classes
    (``count_pieces``' ``classes``), a class's frequency is at its own id, the others' stay 0."""

    doc_freq: torch.Tensor
    n_docs: int
    mean_doc_len: float

    @classmethod
    def of_counts(cls, doc_freq: np.ndarray, n_docs: int, n_pieces: int) -> "CorpusStats":
        """From :func:`count_pieces`' counts (of a whole corpus, or summed over its parts)."""
        return cls(torch.from_numpy(doc_freq), n_docs, n_pieces / max(n_docs, 1))

    @property
    def idf(self) -> torch.Tensor:
        """``bm25_idf`` of every vocabulary id ``[V]``."""
        return bm25_idf(self.doc_freq, self.n_docs)

    def digest(self) -> str:
        """sha256 of the document frequencies (what a stamp records to name the statistics)."""
        return hashlib.sha256(np.ascontiguousarray(self.doc_freq.numpy()).tobytes()).hexdigest()


def bm25_idf(doc_freq: torch.Tensor, n_docs: int) -> torch.Tensor:
    """IDF_t = log(1 + (N − df_t + 0.5) / (df_t + 0.5)) (Lucene's BM25 idf; always positive)."""
    df = doc_freq.to(torch.float64)
    return torch.log1p((n_docs - df + 0.5) / (df + 0.5)).to(torch.float32)


def count_pieces(texts: Iterable[str], tokenisation: Tokenisation, batch_size: int = 256,
                 classes: np.ndarray | None = None) -> tuple[np.ndarray, int, int]:
    """(document frequency of each word piece, documents, word pieces) over ``texts``, tokenised as
    ``tokenisation`` says: counts that add up over parts of a corpus. With ``classes`` (each vocabulary id's
    exact-match class, ``ckray.lexical.analysis.stem_classes``) a document counts once for each class it
    holds, at the class's id."""
    from ckray.models.encoders import load_tokenizer

    tok = load_tokenizer(tokenisation.encoder)
    df = np.zeros(tokenisation.vocab_size, dtype=np.int64)
    n_docs, n_pieces, batch = 0, 0, []

    def flush() -> None:
        nonlocal n_pieces
        for p in tok(batch, add_special_tokens=False, truncation=True, max_length=tokenisation.max_length)["input_ids"]:
            ids = np.asarray(p, dtype=np.int64)
            df[np.unique(ids if classes is None else classes[ids])] += 1
            n_pieces += len(p)
        batch.clear()

    for text in texts:
        batch.append(text)
        n_docs += 1
        if len(batch) >= batch_size:
            flush()
    if batch:
        flush()
    return df, n_docs, n_pieces


def corpus_statistics(texts: Iterable[str], tokenisation: Tokenisation, batch_size: int = 256,
                      classes: np.ndarray | None = None) -> CorpusStats:
    """Document frequencies (of word pieces, or of their ``classes``) and mean length over ``texts`` in one pass."""
    return CorpusStats.of_counts(*count_pieces(texts, tokenisation, batch_size, classes))


def has_corpus(workdir: str | os.PathLike) -> bool:
    """Whether ``workdir`` holds prepared corpus shards (a manifest)."""
    from ckray.data.shards import MANIFEST, shards_dir

    return (shards_dir(workdir) / MANIFEST).exists()


def sharded_corpus_statistics(workdir: str | os.PathLike, tokenisation: Tokenisation,
                              classes: np.ndarray | None = None) -> CorpusStats:
    """:func:`corpus_statistics` of ``workdir``'s corpus with one Ray task per corpus shard, the counts
    summed as the tasks finish: the same statistics as one pass in one process, spread over the
    cluster's CPUs; the driver holds one vocabulary-sized count at a time. Inside a Ray actor (a Serve
    replica, which may hold the last free CPU a task would wait for) the shards are counted in turn in
    the actor itself, streamed as :func:`ckray.data.shards.iter_doc_texts` reads them."""
    import ray

    from ckray.data.shards import iter_doc_texts, shard_paths
    from ckray.ray_env import init_ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        return corpus_statistics(iter_doc_texts(workdir), tokenisation, classes=classes)
    init_ray()
    count = ray.remote(num_cpus=1)(_count_shard)
    shared_classes = None if classes is None else ray.put(classes)
    pending = [count.remote(str(p), tokenisation, shared_classes) for p in shard_paths(workdir)]
    doc_freq, n_docs, n_pieces = np.zeros(tokenisation.vocab_size, np.int64), 0, 0
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        df, docs, pieces = ray.get(done[0])
        doc_freq += df
        n_docs += docs
        n_pieces += pieces
    return CorpusStats.of_counts(doc_freq, n_docs, n_pieces)


def _count_shard(path: str, tokenisation: Tokenisation, classes: np.ndarray | None) -> tuple[np.ndarray, int, int]:
    """Ray task of :func:`sharded_corpus_statistics`: one shard's counts."""
    from ckray.data.shards import shard_doc_texts

    return count_pieces(shard_doc_texts(path), tokenisation, classes=classes)


def cached_corpus_statistics(workdir: str | os.PathLike, tokenisation: Tokenisation,
                             classes: np.ndarray | None = None) -> CorpusStats:
    """:func:`sharded_corpus_statistics` of ``workdir``, kept in ``W/statistics/`` for its corpus
    manifest, ``tokenisation`` and exact-match ``classes`` (written atomically; a changed corpus,
    tokenisation or class map counts again)."""
    from ckray.data.shards import read_manifest

    grouped = {} if classes is None else {
        "classes_sha256": hashlib.sha256(np.ascontiguousarray(classes, dtype=np.int64).tobytes()).hexdigest()}
    key = json.dumps({"corpus_sha256": read_manifest(workdir).get("input_sha256"), **asdict(tokenisation), **grouped},
                     sort_keys=True)
    path = Path(workdir) / STATISTICS_DIR / f"word-pieces-{hashlib.sha256(key.encode()).hexdigest()[:16]}.npz"
    if path.exists():
        with np.load(path) as saved:
            if str(saved["key"]) == key:
                return CorpusStats(torch.from_numpy(saved["doc_freq"]), int(saved["n_docs"]),
                                   float(saved["mean_doc_len"]))
    stats = sharded_corpus_statistics(workdir, tokenisation, classes)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.npz")
    np.savez(tmp, key=key, doc_freq=stats.doc_freq.numpy(), n_docs=stats.n_docs, mean_doc_len=stats.mean_doc_len)
    os.replace(tmp, path)
    return stats


def workdir_statistics(workdir: str | os.PathLike | None, tokenisation: Tokenisation | None) -> CorpusStats | None:
    """:func:`cached_corpus_statistics` of ``workdir``'s corpus; None without a tokenisation, a work
    directory or a corpus in it to count."""
    if tokenisation is None or workdir is None or not has_corpus(workdir):
        return None
    return cached_corpus_statistics(workdir, tokenisation)


def collection_statistics_for(model: object, workdir: str | os.PathLike | None) -> CorpusStats | None:
    """The word-piece statistics of ``workdir``'s corpus that ``model`` reads (a model that reads any
    names their ``collection_tokenisation``); None when it reads none, or without a corpus to count."""
    return workdir_statistics(workdir, getattr(model, "collection_tokenisation", None))


def statistics_stamp(workdir: str | os.PathLike, stats: CorpusStats) -> dict:
    """What an evaluation records of the collection statistics a reranker read."""
    return {"workdir": str(workdir), "n_docs": stats.n_docs, "mean_doc_len": round(stats.mean_doc_len, 3),
            "doc_freq_sha256": stats.digest()}
