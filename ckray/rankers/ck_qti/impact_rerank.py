"""CK-QTI as a reranker, scored the way its impact index scores: ``bm25>ck-qti`` (``ck-qti-rerank``).

With query term independence a document's CK-QTI representation does not depend on the query: its
top-k term impacts ``{t: s_td}`` (``ckray.rankers.ck_qti.term_impacts.TermImpactScorer``: the document's own terms and
expansion candidates, the ``top_k`` best kept). Reranking a candidate is then a lookup,

    S_qd = Σ_{t ∈ q} count_t · s_td · 1[t ∈ top_k(d)]

which is exactly what the Lucene impact index adds up for ``ck-qti`` (before its integer
quantisation), so ``ck-qti-rerank`` orders BM25's candidates as ``ck-qti`` would.

Why the top-k cut and not the model's dense Σ over all query terms (kept as the ablation
``bm25>ck-qti-unpruned``): a query term that is not among a document's top-k terms still gets a small
positive s_td, and on SciFact's dev queries (held-out *training* queries) those terms made up about
half of a candidate's score, were larger for longer documents (correlation 0.35 with length) and
larger for non-relevant ones. Dropping them, as the index does, gave dev nDCG@10 0.719 against 0.699
for the dense sum when reranking BM25's top 100.

Where the vectors come from: the impact shards ``W/impact/shards`` when every one of them was built
from this checkpoint (their markers record its digest and the top-k settings), so reranking costs
no model time at all; otherwise the model computes them for the candidates it sees
(``TermImpactScorer`` with ``ImpactConfig()``'s settings), once per document, and keeps them.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ckray.data.shards import marker_path, read_json
from ckray.fusion import Run
from ckray.rankers.ck_qti.impact import impact_shards_dir
from ckray.rankers.ck_qti.impact_search import (MAX_QUERY_PIECES, impact_score, impact_vector, query_term_counts,
                                                query_terms_setting)
from ckray.rankers.ck_qti.impact_settings import (ImpactConfig, check_ck_qti_checkpoint, deployed_impact_settings,
                                                  recorded_settings)

log = logging.getLogger(__name__)
Vector = dict[int, float]


def shards_for_checkpoint(workdir: str | os.PathLike, digest: str) -> list[Path] | None:
    """The impact shards when every one has a marker naming checkpoint ``digest``; None otherwise."""
    shards = sorted(impact_shards_dir(workdir).glob("part-*.parquet"))
    if not shards:
        return None
    for shard in shards:
        marker = marker_path(shard)
        if not marker.exists() or read_json(marker).get("checkpoint_sha256") != digest:
            return None
    return shards


@dataclass
class StoredImpacts:
    """Every document's stored impact vector as flat arrays: row i's terms and weights are
    ``terms[offsets[i]:offsets[i+1]]``, 8 bytes a stored term. SciFact's 5,183 top-128 vectors take
    5.5 MiB so, against 57 MiB as a Python dict per document (which would not fit for MS MARCO)."""

    rows: dict[str, int]
    offsets: np.ndarray      # int64 [n + 1]
    terms: np.ndarray        # int32 [Σ k_d]
    weights: np.ndarray      # float32 [Σ k_d]
    top_k: int | None = None

    @classmethod
    def read(cls, shards: Sequence[Path]) -> "StoredImpacts":
        tables = [pq.read_table(s, columns=["doc_id", "terms", "weights"]) for s in shards]
        table = pa.concat_tables(tables)
        terms = pa.concat_arrays(table.column("terms").chunks or [pa.array([], pa.list_(pa.int32()))])
        weights = pa.concat_arrays(table.column("weights").chunks or [pa.array([], pa.list_(pa.float32()))])
        offsets = terms.offsets.to_numpy().astype(np.int64)
        n_terms, n_weights = np.diff(offsets), np.diff(weights.offsets.to_numpy())
        for row in np.flatnonzero(n_terms != n_weights)[:1]:  # the first bad row, named by shard and doc id
            shard = shards[int(np.searchsorted(np.cumsum([t.num_rows for t in tables]), row, side="right"))]
            raise ValueError(f"impact shard {shard}: document {table.column('doc_id')[row].as_py()!r} has "
                             f"{n_terms[row]} terms but {n_weights[row]} weights; rebuild it with "
                             "jobs/build_impact_index.py")
        top_ks = {read_json(marker_path(s)).get("top_k") for s in shards}
        return cls(rows={d: i for i, d in enumerate(table.column("doc_id").to_pylist())}, offsets=offsets,
                   terms=terms.values.to_numpy(), weights=weights.values.to_numpy(),
                   top_k=top_ks.pop() if len(top_ks) == 1 else None)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return self.offsets.nbytes + self.terms.nbytes + self.weights.nbytes

    def vector(self, doc_id: str) -> Vector:
        i = self.rows[doc_id]
        a, b = self.offsets[i], self.offsets[i + 1]
        return impact_vector(self.terms[a:b], self.weights[a:b])


@dataclass
class ImpactReranker:
    """``rerank(queries, run, depth) -> run`` by Σ of stored (or freshly computed) top-k term impacts."""

    checkpoint: str
    workdir: str
    doc_text: Callable[[str], str]
    config: ImpactConfig | None = None   # None: top-k and β saved with the checkpoint, else the defaults
    cache_documents: int = 100_000   # computed vectors kept (least recently used dropped first)
    analyze_queries: bool = True     # query_term_counts(analyzed=…, max_pieces=…)
    max_query_pieces: int = MAX_QUERY_PIECES
    _vectors: "OrderedDict[str, Vector]" = field(default_factory=OrderedDict, init=False, repr=False)
    _scorer: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        from ckray.models.checkpoint import checkpoint_digest

        model_config = check_ck_qti_checkpoint(self.checkpoint)["config"]
        self.settings_source = "given"
        if self.config is None:
            top_k, beta, source = deployed_impact_settings(self.checkpoint)
            self.config = ImpactConfig(top_k=top_k, explicit_weight=beta)
            self.settings_source = source or "ImpactConfig defaults"
        self.encoder = model_config.get("encoder")
        self.shards = shards_for_checkpoint(self.workdir, checkpoint_digest(self.checkpoint))
        self.stored = StoredImpacts.read(self.shards) if self.shards else None
        if self.stored is not None:
            log.info("ck-qti reranker: %d documents' impact vectors (top %s terms) from %d shard(s), %.1f MiB",
                     len(self.stored), self.stored.top_k, len(self.shards), self.stored.nbytes / 2**20)
        else:
            log.info("ck-qti reranker: no impact shards of this checkpoint under %s; computing impact vectors "
                     "of the candidates with the model", self.workdir)

    @property
    def source(self) -> str:
        return "shards" if self.shards else "model"

    @property
    def settings(self) -> dict:
        """The top-k and β of the impact vectors and where they came from (what an evaluation records)."""
        terms = {"reranker_query_terms": query_terms_setting(self.analyze_queries, self.max_query_pieces)}
        if self.shards:
            return {"reranker_impact": recorded_settings(read_json(marker_path(self.shards[0])),
                                                         f"impact shards {impact_shards_dir(self.workdir)}"), **terms}
        return {"reranker_impact": {"top_k": self.config.top_k, "explicit_weight": self.config.explicit_weight,
                                    "passages": self.config.passages, "explicit_scope": self.config.explicit_scope,
                                    "source": self.settings_source}, **terms}

    def _compute(self, doc_ids: list[str]) -> None:
        if self._scorer is None:
            from ckray.data.statistics import has_corpus
            from ckray.device import default_device
            from ckray.rankers.ck_qti.corpus_statistics import corpus_adaptation, document_length_scale
            from ckray.rankers.ck_qti.term_impacts import TermImpactScorer
            from ckray.rankers.ck_qti.model import load_ck_model

            model = load_ck_model(self.checkpoint)
            length_scale = 1.0
            if has_corpus(self.workdir):  # the explicit match with this corpus's IDF and mean length
                corpus = corpus_adaptation(self.workdir, self.checkpoint, model)
                corpus.apply(model)
                length_scale = document_length_scale(self.workdir, self.checkpoint, self.config, corpus)
            elif self.config.explicit_over_documents:
                log.warning("ck-qti reranker: no corpus under %s to count mean lengths; the exact-match score of a "
                            "document read in windows is counted in each window", self.workdir)
                self.config = replace(self.config, explicit_scope="window")
            model = model.to(default_device()).eval()
            self._scorer = TermImpactScorer(model, self.config, length_scale)
        for doc_id, (terms, weights) in zip(doc_ids, self._scorer.score_texts([self.doc_text(d) for d in doc_ids])):
            self._vectors[doc_id] = impact_vector(terms, weights)
        while len(self._vectors) > max(self.cache_documents, len(doc_ids)):
            self._vectors.popitem(last=False)

    def vectors(self, doc_ids: Sequence[str]) -> list[Vector]:
        """The impact vectors ``{term id: s_td}`` of ``doc_ids`` (an unknown id is a KeyError naming it)."""
        if self.stored is not None:
            missing = [d for d in dict.fromkeys(doc_ids) if d not in self.stored.rows]
            if missing:
                raise KeyError(f"document {missing[0]!r} is not in the impact shards under {self.workdir} "
                               f"({len(missing)} of {len(doc_ids)} candidates missing)")
            return [self.stored.vector(d) for d in doc_ids]
        missing = []
        for d in dict.fromkeys(doc_ids):
            if d in self._vectors:
                self._vectors.move_to_end(d)  # recently used: dropped last
            else:
                missing.append(d)
        if missing:
            self._compute(missing)
        return [self._vectors[d] for d in doc_ids]

    def score(self, query: str, doc_ids: Sequence[str]) -> list[float]:
        """S_qd of one query against each document."""
        bag = query_term_counts([query], self.encoder, self.analyze_queries, self.max_query_pieces)[0]
        return [impact_score(bag, vec) for vec in self.vectors(doc_ids)]

    def rerank(self, queries: Mapping[str, str], run: Run, depth: int = 100) -> Run:
        from ckray.rerank import merge_scores, rerank_candidates

        scores: dict[tuple[str, str], float] = {}
        for qid, top in rerank_candidates(queries, run, depth).items():
            scores.update({(str(qid), d): s for d, s in zip(top, self.score(queries[qid], top))})
        return merge_scores(run, scores, depth)


def impact_reranker(checkpoint: str | os.PathLike, workdir: str | os.PathLike, doc_text: Callable[[str], str],
                    **options) -> ImpactReranker:
    """Reranker factory for ``ck-qti`` (``ckray.pipelines.build_reranker``)."""
    return ImpactReranker(str(checkpoint), str(workdir), doc_text, **options)
