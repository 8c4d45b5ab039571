"""CK-QTI as a first-stage retriever: impact shards by Ray batch inference, a Lucene impact index,
and bag-of-terms retrieval over it.

With query term independence a CK-QTI score is a sum over query terms, ``S_qd = Σ_{t∈q} s_td``, and
``s_td`` depends on the term and the document only. So every document's term scores can be computed
ahead of time and stored in an inverted index (the paper's Sec. 3, "QTI"); a query is then scored by
adding up stored weights, like BM25.

Layout under the work directory ``W``::

    W/shards/part-NNNNN.parquet            corpus shards (doc_id, title, text)        ckray.data.shards
    W/impact/shards/part-NNNNN.parquet     one impact shard per corpus shard:
                                           doc_id: string, terms: list<int32> (word-piece ids),
                                           weights: list<float32> (w_td, descending), exact model scores
                                           (+ .done.json marker: checkpoint digest, settings, max weight)
    W/impact/jsonl/part-NNNNN.jsonl        Pyserini JsonVectorCollection lines, integer weights
    W/impact/jsonl-done/part-NNNNN.jsonl.done.json   their markers (kept out of the indexed folder)
    W/impact/index/                        the Lucene impact index + ckray_impact.json (metadata)

**Which terms a document gets** (``TermImpactScorer``). A document is encoded once
(``CKModel.encode_documents``). Its candidate terms are

* its own word pieces (every distinct id), and
* ``expansion_candidates`` (M, default 256) vocabulary terms chosen cheaply: the context-free term
  vectors x₀ of the whole vocabulary (the QTI query-side encoder, ``encode_query_terms``; computed
  once per actor, special tokens and ``[unused*]`` left out since text never tokenises to them) are
  compared by cosine with the document. ``candidate_pool="window"`` (default) compares them with the
  centroid of the document's normalised contextualised vectors in each pooling window (the same
  ``pool_window``/``pool_stride`` windows the implicit sub-model pools kernel scores over; the cosine
  with a centroid is the window's mean cosine up to a per-window factor) and ranks terms by their
  best window: ``|V| × n/stride`` multiply-adds per dimension (SciFact on one CPU thread: ~10 ms a
  document, against ~32 ms to encode it and ~55 ms to score its ~400 candidates).
  ``candidate_pool="position"`` ranks by the best single position instead (``|V| × n``: ~210 ms a
  document there, so meant for GPUs).

All candidates are scored exactly with ``CKModel.term_scores`` (s_td = ReLU(α·explicit + (1−α)·implicit
+ b)); the ``top_k`` (default 256) best are kept — the paper's sparsification. Terms with s_td = 0
are dropped. The model's score for a (query, document) pair over the kept terms is therefore
exactly Σ of the stored weights of the query's terms.

**Long documents** (``passages``, default 0: all). A document longer than the checkpoint's ``max_doc_len``
is read as windows of that many word pieces, a quarter of each shared with the next
(``ckray.models.encoders.document_windows``); each window is scored as above as a document of its own
(its own terms, expansion candidates, top-k), and the document keeps every term of any window at its
best window's weight, ``w_td = max_p w_tp`` (term-level MaxP). With ``explicit_scope="document"`` (the
default) the exact-match part that β adds is counted over the whole document read, as BM25 counts it:
``w_td = max_p s_tp + β·s_explicit_td``, Eq. 9 with TF_td over all the windows and |d| their length,
normalised by the collection's mean length of what is read (``document_length_scale``); the model's own
s_tp stays its best window's. ``"window"`` adds each window's own: ``w_td = max_p (s_tp + β·s_explicit_tp)``.
A weight still depends on the term and the document only, so QTI and the index are unchanged, and a term
counts wherever the document holds it, as BM25 counts it. ``passages=1`` reads the first window only (the
truncation training reads); a document that fits one window is scored the same either way.

**Exact-match weight at indexing** (``explicit_weight`` β, default 0.5). The stored impact may add the
model's own explicit score once more, ``w_td = s_td + β·s_explicit_td`` (Eq. 9: its learned, batch-scaled
BM25; 0 for a term not in the document), before the top-k cut. This is still one weight per (term,
document), so QTI and the index are unchanged; it moves the balance that α set in training towards
exact matching, as interpolating with BM25 does for a reranker, and β is chosen on the held-out
training queries (``bench/impact_topk.py --explicit-weights``), never on test queries. The defaults,
β = 0.5 and ``top_k`` = 256, are what SciFact's held-out training queries chose together
(β ∈ {0, 0.5, 1, 2} × k ∈ {32, 64, 128, 256}; README).

**Quantisation.** Lucene stores integer impacts (Pyserini truncates floats). The Parquet shards keep
float32 w_td; the JSON lines get ``round(w_td · scale)`` with one global ``scale = quant_max /
max_weight`` (max over the whole corpus, ``quant_max`` = 255 by default), recorded in the index
metadata; terms that round to 0 are left out. A retrieved score divided by ``scale`` is Σ_t w_td
within ``0.5/scale`` per query term.

**Term strings.** A term is written as ``"t<id>"`` (``t2003``), never as the word-piece string: these
are plain ASCII tokens that ``--pretokenized`` indexing and Lucene's term queries keep as they are
(word pieces such as ``##ing``, ``[UNK]`` or non-ASCII pieces would be at the mercy of the analyser).
Queries use the same strings (``term_string``).

**The job** (``build_impact_index``): a shard job of ``ckray.batch_inference`` — the corpus shards not
yet done (``is_done`` against a stamp of the checkpoint digest, the settings and the source shard) →
``map_batches(ImpactScorer, compute=ActorPoolStrategy(size=actors))``; each actor loads the checkpoint
once (``load_ck_model``), one GPU each with ``use_gpu``. Actors that die are restarted and their
batches retried (``max_restarts``/``max_task_retries``); each document is kept once (a retried batch
can repeat rows) and a missing one is an error naming it. An impact shard is written atomically with
its marker as soon as all its documents are in. Then every impact shard is checked against its corpus
shard (same ids, each once; totals equal the manifest) — anything else raises
:class:`ImpactIntegrityError`. JSON lines are (re)written for the current scale, and the
Lucene index is (re)built only when its metadata differs from what it would now record.

**Retrieval** (``ImpactRetriever``): a query's terms (``query_term_counts``) are the word pieces of the
words the BM25 first stage's analyser keeps (``ckray.lexical.analysis``: no punctuation, no stop
words), all of them, their ids counted (a repeated term weighs twice, as it is summed twice in
``S_qd``), and searched with ``LuceneImpactSearcher(index, query_encoder=None)``: its default
encoder splits the string ``"t12 t12 t845"`` on spaces and counts, and the impact similarity scores
Σ_t count_t · weight_td. ``min_idf`` is set to −∞ so a term present in every document is not dropped
from the query (Pyserini's default keeps only idf > 0). Scores are divided by ``scale``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ckray.batch_inference import (ActorPoolConfig, ShardJob, actor_device, crash_once, run_shard_job,
                                   timing_columns, validate_checks)
from ckray.data import statistics
from ckray.data.shards import (INDEX_FILES_KEYS, check_index_files, index_files_changed, index_files_record,
                               mark_done, read_json, read_manifest, shard_paths, write_json_atomic,
                               write_parquet_atomic)
from ckray.data.statistics import has_corpus
from ckray.errors import CkrayError, ConfigError, MissingArtifactError
from ckray.fusion import Run
from ckray.rankers.ck_qti.options import (DEFAULT_EXPLICIT_SCOPE, DEFAULT_EXPLICIT_WEIGHT, DEFAULT_PASSAGES,
                                          DEFAULT_TOP_K)
from ckray.workdir import WorkDir

log = logging.getLogger(__name__)

IMPACT_DIR = "impact"
META_FILE = "ckray_impact.json"
TERM_PREFIX = "t"
FORMAT_VERSION = 1
CANDIDATE_POOLS = ("window", "position")
EXPLICIT_SCOPES = ("document", "window")


class ImpactIntegrityError(CkrayError):
    """The impact shards do not hold every corpus document exactly once."""


def impact_root(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).ranker_dir(IMPACT_DIR)


def impact_shards_dir(workdir: str | os.PathLike) -> Path:
    return impact_root(workdir) / "shards"


def jsonl_dir(workdir: str | os.PathLike) -> Path:
    return impact_root(workdir) / "jsonl"


def jsonl_markers_dir(workdir: str | os.PathLike) -> Path:
    return impact_root(workdir) / "jsonl-done"


def impact_index_dir(workdir: str | os.PathLike) -> Path:
    return impact_root(workdir) / "index"


def default_checkpoint(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).checkpoint("ck-qti")


def term_string(term_id: int) -> str:
    """The index term for a word-piece id: ``"t<id>"`` (see the module docstring)."""
    return f"{TERM_PREFIX}{int(term_id)}"


# =============================================================================================
# Configuration
# =============================================================================================

@dataclass
class ImpactConfig(ActorPoolConfig):
    """The impact-building job: its actor pool (``ckray.batch_inference.ActorPoolConfig``: actors,
    use_gpu, cpus_per_actor, batch_size — documents per actor batch —, max_restarts,
    max_task_retries) and

    top_k:                 terms kept per document (by w_td).
    explicit_weight:       β: the stored weight is s_td + β·s_explicit_td (module docstring); 0 = s_td.
    expansion_candidates:  M vocabulary terms added to a document's own terms as candidates.
    expansion_ratio:       r: of the top_k kept, at most ⌈r·u_d⌉ are expansion terms (u_d: the document's
                           distinct own terms), the best by weight (``cap_expansion``); None = no cap.
    candidate_pool:        "window" (cosine with window centroids, cheap) or "position" (best position).
    quant_max:             the largest weight in the corpus maps to this integer.
    scale:                 a fixed quantisation scale instead (e.g. to match another index); None = from quant_max.
    token_budget:          word pieces (documents × padded length) per forward pass inside an actor.
    index_threads:         Lucene indexing threads.
    passages:              a document longer than the checkpoint's ``max_doc_len`` is read as up to this many
                           windows of that length, a quarter of each shared with the next
                           (``ckray.models.encoders.passage_overlap``), each scored as a document, and a term's
                           weight is its best window's (module docstring); 0: every window, the whole document;
                           1: the first window only (as trained).
    explicit_scope:        where β's exact-match score of a document read in windows is counted: "document"
                           (TF and |d| over every window read, as BM25 counts them) or "window" (each window's own).
    """

    top_k: int = DEFAULT_TOP_K             # both chosen on SciFact's held-out training queries (module docstring)
    explicit_weight: float = DEFAULT_EXPLICIT_WEIGHT
    expansion_candidates: int = 256
    expansion_ratio: float | None = None
    candidate_pool: str = "window"
    quant_max: int = 255
    scale: float | None = None
    batch_size: int = 64
    token_budget: int = 8192
    index_threads: int = 2
    passages: int = DEFAULT_PASSAGES
    explicit_scope: str = DEFAULT_EXPLICIT_SCOPE

    def validate(self) -> None:
        validate_checks(self, self.pool_checks() + [
            (self.top_k >= 1, "top_k must be >= 1"),
            (math.isfinite(self.explicit_weight) and self.explicit_weight >= 0,
             f"explicit_weight (--explicit-weight) must be a finite number >= 0, got {self.explicit_weight}"),
            (self.expansion_candidates >= 0, "expansion_candidates must be >= 0"),
            (self.expansion_ratio is None or (math.isfinite(self.expansion_ratio) and self.expansion_ratio >= 0),
             f"expansion_ratio (--expansion-ratio) must be a finite number >= 0, got {self.expansion_ratio}"),
            (self.candidate_pool in CANDIDATE_POOLS, f"candidate_pool must be one of {CANDIDATE_POOLS}"),
            (self.quant_max >= 1, "quant_max must be >= 1"),
            (self.scale is None or self.scale > 0, "scale must be > 0"),
            (self.token_budget >= 1, "token_budget must be >= 1"),
            (self.index_threads >= 1, "index_threads must be >= 1"),
            (self.passages >= 0, "passages (--passages) must be >= 0 (0: every window of a document)"),
            (self.explicit_scope in EXPLICIT_SCOPES,
             f"explicit_scope (--explicit-scope) must be one of {EXPLICIT_SCOPES}, got {self.explicit_scope!r}"),
        ])

    @property
    def explicit_over_documents(self) -> bool:
        """Whether β's exact-match score of a document read in several windows is counted over all of them."""
        return bool(self.explicit_weight) and self.passages != 1 and self.explicit_scope == "document"

    def scoring_settings(self) -> dict:
        """The settings that change the stored w_td (part of every shard's stamp)."""
        settings = {"top_k": self.top_k, "expansion_candidates": self.expansion_candidates,
                    "candidate_pool": self.candidate_pool, "passages": self.passages}
        if self.explicit_weight:  # absent at 0, so shards built at 0 keep their stamps
            settings["explicit_weight"] = self.explicit_weight
        if self.expansion_ratio is not None:  # absent without a cap, likewise
            settings["expansion_ratio"] = self.expansion_ratio
        if self.explicit_over_documents:  # absent for each window's own, as shards were scored before
            settings["explicit_scope"] = self.explicit_scope
        return settings


def recorded_settings(record: Mapping[str, Any], source: str) -> dict:
    """The top-k, β, expansion cap and windows read that an index's metadata or a shard's marker
    (``record``) holds, with where they came from: what an evaluation records. A record without
    ``passages`` was made before long documents were read in windows: from the first one; one without
    ``explicit_scope`` added each window's own exact-match score."""
    cap = {"expansion_ratio": record["expansion_ratio"]} if "expansion_ratio" in record else {}
    return {"top_k": record.get("top_k"), "explicit_weight": record.get("explicit_weight", 0.0), **cap,
            "passages": record.get("passages", 1), "explicit_scope": record.get("explicit_scope", "window"),
            "source": source}


def cap_expansion(terms: np.ndarray, weights: np.ndarray, own: np.ndarray,
                  ratio: float | None) -> tuple[np.ndarray, np.ndarray]:
    """A weight-sorted impact vector with every term of ``own`` (the document's own word pieces) and
    only the first ``⌈ratio·|own|⌉`` of the others (expansion terms); unchanged at ``ratio`` None.
    A short document then gets few expansion terms, a long one as many as top-k leaves room for."""
    if ratio is None:
        return terms, weights
    expansion = ~np.isin(terms, own)
    keep = ~expansion | (np.cumsum(expansion) <= math.ceil(ratio * len(own)))
    return terms[keep], weights[keep]


def deployed_impact_settings(checkpoint: str | os.PathLike, top_k: int | None = None,
                             explicit_weight: float | None = None) -> tuple[int, float, str | None]:
    """``(top_k, explicit_weight, source)``: each given value, else the one saved with the checkpoint
    (``ckray.deploy``: tuned on its training collection's held-out queries), else ``ImpactConfig``'s
    default. ``source`` names the checkpoint's deploy.json when a value came from it, else None."""
    from ckray.deploy import read_deploy, source_of

    carried = read_deploy(checkpoint).get("impact") or {}
    used = [name for name, given in (("top_k", top_k), ("explicit_weight", explicit_weight))
            if given is None and name in carried]
    return (int(top_k if top_k is not None else carried.get("top_k", ImpactConfig.top_k)),
            float(explicit_weight if explicit_weight is not None
                  else carried.get("explicit_weight", ImpactConfig.explicit_weight)),
            source_of(checkpoint) if used else None)


# =============================================================================================
# Collection statistics of the corpus being indexed
# =============================================================================================

def cached_corpus_statistics(workdir: str | os.PathLike, config: Any):
    """``ckray.data.statistics.cached_corpus_statistics`` of ``workdir``'s corpus, tokenised as the
    CK-QTI ``config``'s encoder and ``max_doc_len`` do."""
    from ckray.rankers.ck_qti.model import piece_tokenisation

    return statistics.cached_corpus_statistics(workdir, piece_tokenisation(config))


def training_mean_doc_len(checkpoint: str | os.PathLike, model: Any) -> float | None:
    """The mean document length of the corpus ``model`` was trained on: recorded with the checkpoint
    (``ckray.deploy``, ``corpus``), else that of the work directory the checkpoint lies in
    (``<W>/checkpoints/<name>``) when its corpus reproduces the checkpoint's IDF exactly; else None."""
    import torch

    from ckray.deploy import read_deploy
    from ckray.rankers.ck_qti.model import bm25_idf

    recorded = read_deploy(checkpoint).get("corpus") or {}
    if "mean_doc_len" in recorded:
        return float(recorded["mean_doc_len"])
    home = Path(checkpoint).resolve().parent.parent
    if not has_corpus(home):
        return None
    stats = cached_corpus_statistics(home, model.config)
    if torch.equal(bm25_idf(stats.doc_freq, stats.n_docs), model.idf.cpu()):
        return stats.mean_doc_len
    return None


@dataclass
class CorpusAdaptation:
    """The explicit match (Eq. 9) of a checkpoint set to the statistics of the corpus being indexed, as
    BM25 takes its IDF and average length from the collection it searches: IDF from the target's
    document frequencies, and the running E[|d|] of Eq. 10 multiplied by ``length_scale`` = the target's
    mean length over the training corpus's, so |d| is normalised relative to the target's average as
    it was to the training corpus's. On the training corpus nothing changes (``changed`` is False)."""

    doc_freq: np.ndarray | None = None   # None: IDF as trained
    n_docs: int = 0
    length_scale: float = 1.0
    mean_doc_len: float = 0.0

    @property
    def changed(self) -> bool:
        return self.doc_freq is not None or self.length_scale != 1.0

    def apply(self, model: Any) -> Any:
        """Set ``model``'s IDF and E[|d|] (in place); returns it."""
        import torch

        if self.doc_freq is not None:
            model.set_idf(torch.as_tensor(self.doc_freq), self.n_docs)
        if self.length_scale != 1.0:
            with torch.no_grad():
                model.bs_len.running_mean.mul_(self.length_scale)
        return model

    def stamp(self) -> dict:
        """What shard stamps record: nothing when the statistics are the training corpus's (stamps of
        indexes built before stay valid), else the target's statistics."""
        if not self.changed:
            return {}
        df = hashlib.sha256(np.ascontiguousarray(self.doc_freq).tobytes()).hexdigest() if self.doc_freq is not None else None
        return {"corpus_statistics": {"n_docs": self.n_docs, "doc_freq_sha256": df, "mean_doc_len": self.mean_doc_len,
                                      "length_scale": self.length_scale}}


def corpus_adaptation(workdir: str | os.PathLike, checkpoint: str | os.PathLike, model: Any = None) -> CorpusAdaptation:
    """How ``checkpoint``'s explicit match is set for ``workdir``'s corpus (:class:`CorpusAdaptation`).
    The target's IDF replaces the checkpoint's when they differ; its mean length rescales E[|d|] when
    the training corpus's is known (:func:`training_mean_doc_len`; else lengths stay as trained, logged)."""
    import torch

    from ckray.rankers.ck_qti.model import bm25_idf, load_ck_model

    model = model if model is not None else load_ck_model(checkpoint)
    target = cached_corpus_statistics(workdir, model.config)
    if torch.equal(bm25_idf(target.doc_freq, target.n_docs), model.idf.cpu()):
        return CorpusAdaptation(mean_doc_len=target.mean_doc_len)
    source_len = training_mean_doc_len(checkpoint, model)
    if source_len is None:
        log.warning("%s: the mean document length of its training corpus is not known; IDF is taken from %s, "
                    "length normalisation stays as trained", checkpoint, workdir)
    scale = target.mean_doc_len / source_len if source_len else 1.0
    log.info("CK-QTI explicit match set to %s's corpus: IDF of %d documents, mean length %.1f (training %s)",
             workdir, target.n_docs, target.mean_doc_len, f"{source_len:.1f}" if source_len else "unknown")
    return CorpusAdaptation(doc_freq=target.doc_freq.numpy(), n_docs=target.n_docs, length_scale=scale,
                            mean_doc_len=target.mean_doc_len)


def document_length_scale(workdir: str | os.PathLike, checkpoint: str | os.PathLike, config: ImpactConfig,
                          corpus: CorpusAdaptation) -> float:
    """``TermImpactScorer.document_length_scale`` for ``workdir``'s corpus: its mean length in word pieces
    counted over each document's first window (``corpus.mean_doc_len``, what Eq. 10's E[|d|] was set to)
    over its mean counted over every window read (at most ``config.passages``; cached in ``W/statistics``),
    as BM25 normalises |d| by the mean length of the documents it searches. 1 when β's exact-match score
    is counted per window (``config.explicit_over_documents`` false)."""
    from ckray.models.encoders import passage_overlap
    from ckray.rankers.ck_qti.model import CKConfig, piece_tokenisation

    if not config.explicit_over_documents:
        return 1.0
    model = CKConfig(**_check_checkpoint(checkpoint)["config"])
    window = model.max_doc_len
    read = window + (config.passages - 1) * (window - passage_overlap(window)) if config.passages else 2 ** 31 - 1
    whole = statistics.cached_corpus_statistics(workdir, piece_tokenisation(model, read))
    return corpus.mean_doc_len / whole.mean_doc_len if whole.mean_doc_len else 1.0


# =============================================================================================
# Scoring documents (no Ray here: used by the actors, by tests and by the bench)
# =============================================================================================

def expansion_vocabulary(vocab_size: int, encoder: str | None) -> np.ndarray:
    """Vocabulary ids that text can tokenise to: all but [PAD]/[CLS]/… and ``[unused*]``."""
    from ckray.models.encoders import load_tokenizer

    tok = load_tokenizer(encoder)
    n = min(vocab_size, len(tok))
    tokens = tok.convert_ids_to_tokens(list(range(n)))
    special = set(tok.all_special_ids)
    keep = [i for i, t in enumerate(tokens) if i not in special and not (t.startswith("[") and t.endswith("]"))]
    return np.asarray(keep, dtype=np.int64)


class TermImpactScorer:
    """Impact vectors of documents from a CK-QTI model (see the module docstring).

    ``score_texts(texts) -> list[(term_ids int32[k], weights float32[k])]``, weights descending.
    ``document_length_scale`` multiplies the length of a document read in several windows before its
    exact-match score (``explicit_scope="document"``): the corpus's mean first-window length over its mean
    length read (:func:`document_length_scale`), so that a document of the mean length read is normalised
    as the model normalises one of the mean first-window length; 1 where every document fits one window.
    """

    def __init__(self, model: Any, config: ImpactConfig | None = None, document_length_scale: float = 1.0):
        import torch
        import torch.nn.functional as F

        self.config = config or ImpactConfig()
        self.config.validate()
        if not getattr(model.config, "qti", False) or not hasattr(model, "term_scores"):
            raise ConfigError("impact indexing needs a CK-QTI checkpoint (a CKModel with qti=True): "
                              f"got {type(model).__name__} with qti={getattr(model.config, 'qti', None)}")
        self.model = model.eval()
        self.device = model.device
        self.document_length_scale = float(document_length_scale)
        self.vocab = torch.as_tensor(expansion_vocabulary(model.config.vocab_size, model.config.encoder),
                                     device=self.device)
        with torch.no_grad():  # context-free term vectors x₀ of the whole (usable) vocabulary, unit length
            self.vocab_vectors = F.normalize(model.encode_query_terms(self.vocab).float(), dim=-1, eps=1e-6)

    # ----------------------------------------------------------------- candidates
    def expansion(self, doc, m: int):
        """Top-``m`` vocabulary ids per document by cosine of x₀ with the document ([B, m] long)."""
        import torch

        from ckray.models.kernels import pad_for_windows

        B = len(doc)
        m = min(m, len(self.vocab))
        if m == 0:
            return torch.zeros(B, 0, dtype=torch.long, device=self.device)
        unit = doc.vectors.float() * (doc.inv_norm * doc.mask)[..., None]  # [B, n, d], 0 at padding
        if self.config.candidate_pool == "window":
            w, s = self.model.config.pool_window, self.model.config.pool_stride
            targets = pad_for_windows(unit, w, s, dim=1).unfold(1, w, s).sum(-1)  # [B, nw, d]
            valid = pad_for_windows(doc.mask.float(), w, s, dim=1).unfold(1, w, s).sum(-1) > 0
            targets = torch.nn.functional.normalize(targets, dim=-1, eps=1e-6)
        else:
            targets, valid = unit, doc.mask
        best = torch.empty(B, len(self.vocab), device=self.device)
        rows = max(1, (1 << 24) // max(1, B * targets.shape[1]))  # vocabulary rows per chunk (≤ 64 MB)
        for i in range(0, len(self.vocab), rows):
            sim = torch.einsum("vd,bnd->bvn", self.vocab_vectors[i:i + rows], targets)
            best[:, i:i + rows] = sim.masked_fill(~valid[:, None, :], -2.0).amax(-1)
        return self.vocab[best.topk(m, dim=1).indices]

    def candidates(self, doc) -> tuple[Any, Any]:
        """Own distinct terms ∪ expansion terms, padded: (ids [B, T] long, mask [B, T] bool)."""
        import torch

        from ckray.rankers.ck_qti.model import pad_term_lists

        exp = self.expansion(doc, self.config.expansion_candidates)
        per_doc = []
        for b, own in enumerate(doc.unique_terms()):
            if own.numel() == 0:  # an empty document: nothing to index
                per_doc.append(own)
            else:
                per_doc.append(torch.unique(torch.cat([own, exp[b]])))
        return pad_term_lists(per_doc, self.device)

    # ----------------------------------------------------------------- scoring
    def term_weights(self, ids, doc, chunk_size: int = 256):
        """The stored weight of terms ``ids`` ([T] or [B, T]) in documents already encoded:
        w_td = s_td + β·s_explicit_td (β = ``explicit_weight``; w_td = s_td at β = 0). [B, T] float32."""
        scores = self.model.term_scores(ids, doc, chunk_size=chunk_size).float()
        if self.config.explicit_weight:
            scores = scores + self.config.explicit_weight * self.model.explicit_scores(ids, doc).float()
        return scores

    def score_encoded(self, doc) -> list[tuple[np.ndarray, np.ndarray]]:
        """Top-k (term id, w_td) of documents already encoded, w_td = s_td + β·s_explicit_td > 0,
        descending (w_td = s_td at β = 0), expansion terms capped by ``expansion_ratio``."""
        import torch

        ids, mask = self.candidates(doc)
        B, n = doc.ids.shape
        chunk = max(16, (1 << 25) // max(1, B * n * self.model.config.n_kernels))  # kernel tensor ≤ 128 MB
        scores = self.term_weights(ids, doc, chunk_size=chunk).masked_fill(~mask, -math.inf)
        k = min(self.config.top_k, ids.shape[1])
        top, idx = scores.topk(k, dim=1)
        top_ids = ids.gather(1, idx)
        own = doc.unique_terms() if self.config.expansion_ratio is not None else [None] * B
        out = []
        for b in range(B):
            keep = top[b] > 0
            terms = top_ids[b][keep].to(torch.int32).cpu().numpy()
            weights = top[b][keep].cpu().numpy().astype(np.float32)
            if own[b] is not None:
                terms, weights = cap_expansion(terms, weights, own[b].cpu().numpy(), self.config.expansion_ratio)
            out.append((terms, weights))
        return out

    def score_texts(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Impact vectors of document texts (``doc_text(title, text)``), in input order: each window of
        ``max_doc_len`` word pieces scored (:meth:`score_pieces`; the first ``passages``, 0: all), a
        term's weight its best window's (:func:`best_window_weights`). A document that fits one window
        is scored as one document, as before."""
        from ckray.models.encoders import document_windows, load_tokenizer

        if not len(texts):
            return []
        cfg = self.model.config
        windows, per_text = document_windows(load_tokenizer(cfg.encoder), texts, cfg.max_doc_len, self.config.passages,
                                             add_special_tokens=False)   # as ck_qti.model.tokenize reads one
        scored = self.score_pieces(windows)
        starts = np.cumsum([0] + per_text)
        if not self.config.explicit_over_documents:
            return [best_window_weights(scored[a:b]) for a, b in zip(starts[:-1], starts[1:])]
        return [best_window_weights(scored[a:b]) if b - a == 1 else self.document_weights(scored[a:b], windows[a:b])
                for a, b in zip(starts[:-1], starts[1:])]

    def document_weights(self, scored: Sequence[tuple[np.ndarray, np.ndarray]],
                         windows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """One impact vector of a document read in several ``windows`` whose vectors are ``scored``: every
        term kept in any window at ``w_td = max_p s_tp + β·s_explicit_td``, descending. A window's weight is
        w_tp = s_tp + β·s_explicit_tp, so its s_tp is w_tp less β times Eq. 9 over the window's own pieces;
        s_explicit_td is Eq. 9 over the whole document (:func:`whole_document_pieces`), its length scaled
        by ``document_length_scale``."""
        from ckray.models.encoders import passage_overlap

        beta = self.config.explicit_weight
        own = [(terms, weights - beta * self.explicit(terms, window, len(window)))
               for (terms, weights), window in zip(scored, windows)]
        terms, best = best_window_weights(own)
        pieces = whole_document_pieces(windows, passage_overlap(self.model.config.max_doc_len))
        weights = best + beta * self.explicit(terms, pieces, len(pieces) * self.document_length_scale)
        order = np.argsort(-weights, kind="stable")
        return terms[order], weights[order].astype(np.float32)

    def explicit(self, terms: np.ndarray, pieces: Sequence[int], length: float) -> np.ndarray:
        """The model's exact-match score (Eq. 9) of ``terms`` in a document of word ``pieces`` whose length
        is taken as ``length``: float32 [T], 0 for a term that does not occur."""
        import torch

        present, counts = np.unique(np.asarray(pieces, np.int64), return_counts=True)
        tf = np.zeros(len(terms), np.float32)
        if len(present):
            at = np.searchsorted(present, terms).clip(max=len(present) - 1)
            hit = present[at] == terms
            tf[hit] = counts[at[hit]]
        with torch.no_grad():
            scores = self.model.explicit_match(
                torch.as_tensor(np.asarray(terms, np.int64), device=self.device)[None],
                torch.as_tensor(tf, dtype=torch.float32, device=self.device)[None],
                torch.tensor([float(length)], device=self.device))
        return scores[0].float().cpu().numpy()

    def score_pieces(self, pieces: Sequence[Sequence[int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Impact vectors of word-piece sequences (each one document as the model reads it), in input order.

        Sorted by length and encoded in groups of at most ``token_budget`` padded word pieces (padding
        changes scores only by float rounding, ~1e-6; it costs time). Terms tied at the top-k cut to that
        precision may swap between batchings."""
        import torch

        from ckray.rankers.ck_qti.model import pad_term_lists

        lengths = [len(p) for p in pieces]
        out: list[Any] = [None] * len(pieces)
        group: list[int] = []

        def flush() -> None:
            ids, mask = pad_term_lists([torch.as_tensor(pieces[i], dtype=torch.long) for i in group], self.device)
            with torch.no_grad():
                doc = self.model.encode_documents(ids, mask)
                for i, res in zip(group, self.score_encoded(doc)):
                    out[i] = res
            group.clear()

        for i in sorted(range(len(pieces)), key=lambda i: lengths[i]):
            if group and (len(group) + 1) * max(lengths[i], 1) > self.config.token_budget:
                flush()
            group.append(i)
        if group:
            flush()
        return out


def whole_document_pieces(windows: Sequence[Sequence[int]], overlap: int) -> list[int]:
    """The word pieces of a document from its consecutive ``windows``, each sharing ``overlap`` pieces with
    the one before (``ckray.models.encoders.document_windows``): each piece once."""
    return [p for i, window in enumerate(windows) for p in (window if i == 0 else window[overlap:])]


def best_window_weights(windows: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One impact vector from a document's windows' vectors: every term kept in any window, at its best
    window's weight, w_td = max_p w_tp, descending. A term's weight still depends on the term and the
    document alone, so query term independence and the index are unchanged; a query is scored by
    Σ_t max_p w_tp, each term where the document treats it best (term-level MaxP). One window: itself."""
    if len(windows) == 1:
        return windows[0]
    terms = np.concatenate([t for t, _ in windows])
    weights = np.concatenate([w for _, w in windows])
    order = np.argsort(-weights, kind="stable")
    terms, weights = terms[order], weights[order]
    _, first = np.unique(terms, return_index=True)   # each term's first, i.e. largest, occurrence
    keep = np.sort(first)
    return terms[keep], weights[keep]


# =============================================================================================
# The Ray Data actor
# =============================================================================================

class ImpactScorer:
    """Ray Data callable class: loads the checkpoint once per actor, returns impact vectors.

    ``crash_once`` is a fault-injection hook for tests (``ckray.batch_inference.crash_once``: one
    actor dies on its first batch, once).
    """

    def __init__(self, checkpoint: str, config: dict, use_gpu: bool = False, threads: int = 0,
                 crash_once: str | None = None, corpus: CorpusAdaptation | None = None,
                 document_length_scale: float = 1.0):
        from ckray.rankers.ck_qti.model import load_ck_model

        device = actor_device(use_gpu, threads)
        model = load_ck_model(checkpoint, map_location="cpu")
        if corpus is not None:
            corpus.apply(model)
        model = model.to(device).eval()
        self.scorer = TermImpactScorer(model, ImpactConfig(**config), document_length_scale)
        self.crash_once = crash_once

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        from ckray.data.collections import doc_text

        crash_once(self.crash_once)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        texts = [doc_text(t, x) for t, x in zip(batch["title"], batch["text"])]
        vectors = self.scorer.score_texts(texts)
        timing = timing_columns(len(texts), wall0, cpu0)
        return pa.table({
            "doc_id": pa.array([str(d) for d in batch["doc_id"]], pa.string()),
            "path": pa.array([str(p) for p in batch["path"]], pa.string()),
            "terms": pa.array([v[0] for v in vectors], pa.list_(pa.int32())),
            "weights": pa.array([v[1] for v in vectors], pa.list_(pa.float32())),
            **{name: pa.array(values) for name, values in timing.items()},
        })


# =============================================================================================
# Impact shards
# =============================================================================================



def _check_checkpoint(checkpoint: str | os.PathLike) -> dict:
    """The checkpoint's config (MissingArtifactError / ConfigError with what to do)."""
    from ckray.models.checkpoint import WEIGHTS_FILE, read_checkpoint_config

    payload = read_checkpoint_config(checkpoint)
    if not (Path(checkpoint) / WEIGHTS_FILE).exists():
        raise MissingArtifactError(f"checkpoint {checkpoint} has no {WEIGHTS_FILE}; it is half-written, re-train")
    if not payload.get("model_class", "").endswith("CKModel") or not payload.get("config", {}).get("qti", False):
        raise ConfigError(f"checkpoint {checkpoint} is {payload.get('model_class')} with "
                          f"qti={payload.get('config', {}).get('qti')}; impact indexing needs a CK-QTI model "
                          "(jobs/train_ck.py --qti)")
    return payload


def _shard_stamp(source: Path, rows: int, manifest: dict, digest: str, settings: dict) -> dict:
    return {"source": source.name, "source_rows": rows, "corpus_sha256": manifest.get("input_sha256"),
            "checkpoint_sha256": digest, "format": FORMAT_VERSION, **settings}


def impact_table(doc_ids: Sequence[str], terms: Sequence[np.ndarray], weights: Sequence[np.ndarray]) -> pa.Table:
    """``doc_id: string, terms: list<int32>, weights: list<float32>``."""
    return pa.table({"doc_id": pa.array(list(doc_ids), pa.string()),
                     "terms": pa.array(list(terms), pa.list_(pa.int32())),
                     "weights": pa.array(list(weights), pa.list_(pa.float32()))})


def _max_weight(table: pa.Table) -> float:
    import pyarrow.compute as pc

    flat = pc.list_flatten(table.column("weights"))
    return float(pc.max(flat).as_py() or 0.0) if len(flat) else 0.0


def write_impact_shard(path: Path, table: pa.Table, stamp: dict) -> None:
    """Write an impact shard atomically, then its marker (stamp + its largest weight + rows)."""
    write_parquet_atomic(table, path)
    mark_done(path, {**stamp, "max_weight": _max_weight(table)})


def build_impact_shards(workdir: str | os.PathLike, checkpoint: str | os.PathLike,
                        config: ImpactConfig | None = None, *, crash_once: str | None = None) -> dict:
    """Score every corpus shard not yet done with this checkpoint and settings; returns a summary:
    ``ckray.batch_inference.run_shard_job``'s (``documents`` scored now, ``shards_written``,
    ``shards_skipped``, ``repeated_rows`` — rows of retried batches dropped —, ``batches``, ``seconds``,
    ``docs_per_s``, ``steady_docs_per_s``, ``actor_seconds``, ``actor_cpu_seconds``) plus ``actors`` and
    ``checkpoint_sha256``.
    """
    config = config or ImpactConfig()
    config.validate()
    checkpoint = str(Path(checkpoint).resolve())
    _check_checkpoint(checkpoint)
    from ckray.models.checkpoint import checkpoint_digest

    digest = checkpoint_digest(checkpoint)
    manifest = read_manifest(workdir)
    sources = shard_paths(workdir)
    corpus = corpus_adaptation(workdir, checkpoint)  # this corpus's IDF and mean length
    length_scale = document_length_scale(workdir, checkpoint, config, corpus)
    settings = {**config.scoring_settings(), **corpus.stamp()}
    stamps = {s.name: _shard_stamp(s, pq.read_metadata(s).num_rows, manifest, digest, settings) for s in sources}

    def write(path: Path, ids: list[str], vectors: list[tuple[np.ndarray, np.ndarray]], stamp: dict) -> None:
        write_impact_shard(path, impact_table(ids, [v[0] for v in vectors], [v[1] for v in vectors]), stamp)

    def payloads(batch: pa.Table) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(np.asarray(t.values, np.int32), np.asarray(w.values, np.float32))
                for t, w in zip(batch.column("terms"), batch.column("weights"))]

    summary = run_shard_job(ShardJob(
        what="impact scoring", sources=sources, out_dir=impact_shards_dir(workdir), stamps=stamps,
        actor=ImpactScorer,
        actor_kwargs={"checkpoint": checkpoint, "config": asdict(config), "use_gpu": config.use_gpu,
                      "threads": config.torch_threads, "crash_once": crash_once,
                      "corpus": corpus if corpus.changed else None, "document_length_scale": length_scale},
        pool=config, payloads=payloads, write=write, batch_format="pyarrow"))
    return {**summary, "actors": config.actors, "checkpoint_sha256": digest, **corpus.stamp()}


def verify_impact_shards(workdir: str | os.PathLike) -> int:
    """Every corpus document exactly once in the impact shards (per shard, and in total against the
    manifest). Returns the number of documents; raises :class:`ImpactIntegrityError` otherwise."""
    manifest = read_manifest(workdir)
    total = 0
    problems = []
    for source in shard_paths(workdir):
        target = impact_shards_dir(workdir) / source.name
        if not target.exists():
            problems.append(f"{source.name}: no impact shard")
            continue
        want = pq.read_table(source, columns=["doc_id"]).column(0).to_pylist()
        got = pq.read_table(target, columns=["doc_id"]).column(0).to_pylist()
        dup = len(got) - len(set(got))
        missing, extra = set(want) - set(got), set(got) - set(want)
        if dup or missing or extra:
            problems.append(f"{source.name}: {len(got)} rows for {len(want)} documents ({dup} repeated, "
                            f"{len(missing)} missing e.g. {sorted(missing)[:3]}, {len(extra)} unexpected e.g. "
                            f"{sorted(extra)[:3]})")
        total += len(got)
    if total != manifest["documents"]:
        problems.append(f"{total} documents in the impact shards, {manifest['documents']} in the corpus manifest")
    if problems:
        raise ImpactIntegrityError("impact shards do not hold every document exactly once: " + "; ".join(problems)
                                   + f". Delete {impact_shards_dir(workdir)} and re-run the job.")
    return total


# =============================================================================================
# JSON vector lines and the Lucene index
# =============================================================================================

def corpus_max_weight(workdir: str | os.PathLike) -> float:
    """The largest stored weight w_td over all impact shards (from their markers)."""
    from ckray.data.shards import marker_path

    return max([0.0] + [float(read_json(marker_path(impact_shards_dir(workdir) / s.name))["max_weight"])
                        for s in shard_paths(workdir)])


def quantise(weights: np.ndarray, scale: float) -> np.ndarray:
    """Integer impacts: ``round(w · scale)`` (Pyserini would truncate floats)."""
    return np.rint(np.asarray(weights, np.float64) * scale).astype(np.int64)


def vector_lines(table: pa.Table, scale: float) -> list[str]:
    """JsonVectorCollection lines ``{"id", "contents": "", "vector": {"t<id>": int}}``; terms that
    round to 0 are left out."""
    lines = []
    for doc_id, terms, weights in zip(table.column("doc_id").to_pylist(), table.column("terms").to_pylist(),
                                      table.column("weights").to_pylist()):
        q = quantise(np.asarray(weights, np.float32), scale)
        vector = {term_string(t): int(w) for t, w in zip(terms, q) if w > 0}
        lines.append(json.dumps({"id": doc_id, "contents": "", "vector": vector}))
    return lines


def write_jsonl_shards(workdir: str | os.PathLike, scale: float) -> tuple[int, int]:
    """JSON lines for every impact shard at ``scale``; a file already written from the same impact
    shard at the same scale is kept. Returns (files written, documents whose vector is empty: Anserini
    leaves those out of the index — no term of theirs could match a query anyway)."""
    from ckray.data.shards import marker_path

    out, markers = jsonl_dir(workdir), jsonl_markers_dir(workdir)
    out.mkdir(parents=True, exist_ok=True)
    markers.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*"):  # interrupted writes must not be indexed
        stale.unlink(missing_ok=True)
    names = set()
    written = empty = 0
    for source in shard_paths(workdir):
        shard = impact_shards_dir(workdir) / source.name
        target = out / (source.stem + ".jsonl")
        names.add(target.name)
        stamp = {"scale": scale, "impact_marker": read_json(marker_path(shard))}
        marker = markers / (target.name + ".done.json")
        recorded = read_json(marker) if marker.exists() else {}
        if target.exists() and {k: v for k, v in recorded.items() if k != "empty"} == stamp:
            empty += int(recorded.get("empty", 0))
            continue
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")  # hidden: removed above if left over
        table = pq.read_table(shard)
        lines = vector_lines(table, scale)
        n_empty = sum(1 for w in table.column("weights").to_pylist() if not (quantise(np.asarray(w), scale) > 0).any())
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
        os.replace(tmp, target)
        write_json_atomic({**stamp, "empty": n_empty}, marker)
        written += 1
        empty += n_empty
    for stale in out.glob("*.jsonl"):
        if stale.name not in names:
            stale.unlink()
    return written, empty


def _directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build_impact_index(workdir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                       config: ImpactConfig | None = None, *, crash_once: str | None = None,
                       settings_source: str | None = None) -> dict:
    """The whole job: impact shards (Ray), the exactly-once check, JSON lines, the Lucene impact index
    with its metadata (``settings_source``: where top-k and β came from when not from flags or
    defaults, ``deployed_impact_settings``). Each step is skipped when its output is up to date.
    Returns a summary."""
    from ckray.lexical.bm25 import index_json_collection

    config = config or ImpactConfig()
    config.validate()
    checkpoint = Path(checkpoint) if checkpoint is not None else default_checkpoint(workdir)
    payload = _check_checkpoint(checkpoint)
    summary = build_impact_shards(workdir, checkpoint, config, crash_once=crash_once)
    documents = verify_impact_shards(workdir)
    max_weight = corpus_max_weight(workdir)
    scale = config.scale or (config.quant_max / max_weight if max_weight > 0 else 1.0)
    summary["jsonl_written"], empty = write_jsonl_shards(workdir, scale)
    if empty:
        log.warning("%d document(s) have no term left after quantisation (empty text?); the Lucene index "
                    "leaves them out, so no query retrieves them", empty)
    index = impact_index_dir(workdir)
    meta = {
        "checkpoint": str(Path(checkpoint).resolve()), "checkpoint_sha256": summary["checkpoint_sha256"],
        **config.scoring_settings(), **{k: summary[k] for k in ("corpus_statistics",) if k in summary},
        "scale": scale, "quant_max": config.quant_max, "max_weight": max_weight,
        "documents": documents, "empty_vectors": empty, "term_prefix": TERM_PREFIX,
        "encoder": payload["config"].get("encoder"), "max_query_len": payload["config"].get("max_query_len"),
        "format": FORMAT_VERSION,
        "jsonl_sha256": _jsonl_digest(workdir),
    }
    if settings_source is not None:
        meta["settings_source"] = settings_source
    if _index_up_to_date(index, meta):
        log.info("impact index %s is up to date", index)
        summary["index_built"] = False
    else:
        t0 = time.perf_counter()
        index_json_collection(jsonl_dir(workdir), index, threads=config.index_threads, impact=True)
        write_json_atomic({**meta, **index_files_record(index, META_FILE, "jobs/build_impact_index.py")},
                          index / META_FILE)
        summary["index_built"] = True
        summary["index_seconds"] = time.perf_counter() - t0
        log.info("impact index of %d documents built in %.1fs (scale %.4g)", documents,
                 summary["index_seconds"], scale)
    summary.update(index_dir=str(index), scale=scale, total_documents=documents, empty_vectors=empty,
                   index_bytes=_directory_size(index))
    return summary


def _index_up_to_date(index: Path, meta: dict) -> bool:
    """Whether the Lucene index at ``index`` was built with ``meta`` and its files are those it recorded."""
    if not (index / META_FILE).exists():
        return False
    recorded = read_json(index / META_FILE)
    if {k: v for k, v in recorded.items() if k not in INDEX_FILES_KEYS} != meta:
        return False
    changed = index_files_changed(index, META_FILE) or []   # a stamp that records no files: as before
    if changed:
        log.warning("impact index %s: %s differ(s) from what was written (truncated or changed); rebuilding",
                    index, ", ".join(changed))
    return not changed


def _jsonl_digest(workdir: str | os.PathLike) -> str:
    """A digest of the JSON-line markers (each names its impact shard's marker and the scale)."""
    h = hashlib.sha256()
    for marker in sorted(jsonl_markers_dir(workdir).glob("*.done.json")):
        if (jsonl_dir(workdir) / marker.name[:-len(".done.json")]).exists():
            h.update(marker.name.encode())
            h.update(marker.read_bytes())
    return h.hexdigest()


def read_index_meta(index_dir: str | os.PathLike) -> dict:
    path = Path(index_dir) / META_FILE
    if not path.exists():
        raise MissingArtifactError(f"no CK-QTI impact index at {index_dir}: build it with "
                                   "jobs/build_impact_index.py --data DIR --workdir W --checkpoint CKPT")
    return read_json(path)


# =============================================================================================
# Retrieval
# =============================================================================================

# QTI adds one s_td per query term, so a query is not cut at training's max_query_len; this only bounds
# a query's Lucene clauses (``ckray.lexical.jvm.MAX_QUERY_CLAUSES``) and its tokenisation
MAX_QUERY_PIECES = 1024


def query_term_counts(queries: Sequence[str], encoder: str | None, analyzed: bool = True,
                      max_pieces: int = MAX_QUERY_PIECES) -> list[dict[int, int]]:
    """Each query's word-piece ids with their counts (a repeated term is summed twice in S_qd): the
    terms ``S_qd = Σ_{t∈q} count_t · s_td`` runs over wherever a CK-QTI score is deployed (the impact
    index, ``ck-qti-rerank``, the dev scoring that picks checkpoints).

    ``analyzed`` (the default): the word pieces of the words the BM25 first stage's Lucene analyser
    keeps (``ckray.lexical.analysis.query_words``: no punctuation, no stop words; a query of stop
    words only keeps all its pieces). The implicit part of s_td (Eq. 11–16) has no IDF: a stop word
    or a punctuation mark that occurs in a document matches there as exactly as a rare term, so
    verbose queries ("I am interested in articles on …, or …?") would add such matches for every
    document. ``analyzed=False``: every word piece, as training tokenises queries (the ablation of
    ``bench/impact_query_terms.py``). At most ``max_pieces`` pieces are kept."""
    from ckray.rankers.ck_qti.model import tokenize

    texts = [str(q) for q in queries]
    if not texts:
        return []
    if analyzed:
        from ckray.lexical.analysis import query_words

        texts = [words or text for words, text in zip(query_words(texts), texts)]
    ids, mask = tokenize(texts, max_pieces, encoder)
    out = []
    for row, real in zip(ids.tolist(), mask.tolist()):
        bag: dict[int, int] = {}
        for t, r in zip(row, real):
            if r:
                bag[t] = bag.get(t, 0) + 1
        out.append(bag)
    return out


def query_terms_setting(analyzed: bool, max_pieces: int) -> dict:
    """How queries became terms (``query_term_counts``), as an evaluation's stamp records it."""
    return {"analyzed": bool(analyzed), "max_pieces": int(max_pieces)}


def impact_vector(terms: np.ndarray, weights: np.ndarray) -> dict[int, float]:
    """A document's impact vector ``{term id: s_td}`` from its parallel term and weight arrays."""
    return dict(zip(terms.tolist(), weights.tolist()))


def impact_score(bag: Mapping[int, int], vector: Mapping[int, float]) -> float:
    """S_qd = Σ_{t∈q} count_t · s_td over the document's stored terms (its impact vector ``{t: s_td}``)."""
    return float(sum(c * vector.get(t, 0.0) for t, c in bag.items()))


@dataclass
class ImpactRetriever:
    """Bag-of-terms search over a CK-QTI impact index: ``search(queries, k) -> run`` with scores
    ≈ Σ_{t∈q} s_td (divided by the index's scale)."""

    index_dir: str
    threads: int = 2
    analyze_queries: bool = True      # query_term_counts(analyzed=…, max_pieces=…)
    max_query_pieces: int = MAX_QUERY_PIECES
    meta: dict = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.meta = read_index_meta(self.index_dir)
        check_index_files(self.index_dir, META_FILE)
        self.scale = float(self.meta["scale"])
        from ckray.lexical.jvm import ensure_jvm

        ensure_jvm()
        from pyserini.search.lucene import LuceneImpactSearcher

        # query_encoder=None: Pyserini splits "t12 t12 t845" on spaces and counts (TokFreqQueryEncoder)
        self._searcher = LuceneImpactSearcher(str(self.index_dir), query_encoder=None, min_idf=-math.inf)

    @property
    def settings(self) -> dict:
        """The index's top-k, β (and expansion cap) and where they came from (what an evaluation records)."""
        return {"impact": recorded_settings(self.meta, self.meta.get("settings_source",
                                                                     "flags or defaults of the index job")),
                "query_terms": query_terms_setting(self.analyze_queries, self.max_query_pieces)}

    def query_terms(self, queries: Sequence[str]) -> list[dict[str, int]]:
        """Each query's bag of word-piece terms: ``{"t<id>": count}`` (``query_term_counts``)."""
        bags = query_term_counts(queries, self.meta.get("encoder"), self.analyze_queries, self.max_query_pieces)
        return [{term_string(t): c for t, c in bag.items()} for bag in bags]

    @staticmethod
    def _query_string(bag: Mapping[str, int]) -> str:
        return " ".join(t for t, c in bag.items() for _ in range(c))

    def search(self, queries: dict[str, str], k: int = 1000) -> Run:
        """Top-k per query, searched in parallel threads inside Lucene; an empty query gets []."""
        qids = list(queries)
        bags = self.query_terms([queries[q] for q in qids])
        todo = [(q, self._query_string(b)) for q, b in zip(qids, bags) if b]
        run: Run = {q: [] for q in qids}
        if todo:
            hits = self._searcher.batch_search([s for _, s in todo], [q for q, _ in todo], k=k, threads=self.threads)
            for q, _ in todo:
                run[q] = [(h.docid, float(h.score) / self.scale) for h in hits.get(q, [])]
        return run

    def search_one(self, query: str, k: int = 1000) -> list[tuple[str, float]]:
        """One query in this thread (for latency measurements and serving)."""
        bag = self.query_terms([query])[0]
        if not bag:
            return []
        return [(h.docid, float(h.score) / self.scale) for h in self._searcher.search(self._query_string(bag), k=k)]

    @property
    def num_docs(self) -> int:
        return int(self._searcher.num_docs)


def impact_retriever(workdir: str | os.PathLike, threads: int = 2, index_dir: str | None = None) -> ImpactRetriever:
    """Pipeline factory for ``ck-qti``: the impact index under ``W/impact/index``."""
    return ImpactRetriever(str(index_dir or impact_index_dir(workdir)), threads=threads)
