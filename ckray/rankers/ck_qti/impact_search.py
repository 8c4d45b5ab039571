"""Retrieval from a CK-QTI impact index (the ``ck-qti`` first stage): ``S_qd = Σ_{t∈q} s_td``, each
document's stored weights of the query's terms added up, as BM25 adds its term weights.

``ImpactRetriever``: a query's terms (``query_term_counts``) are the word pieces of the
words the BM25 first stage's analyser keeps (``ckray.lexical.analysis``: no punctuation, no stop
words), all of them, their ids counted (a repeated term weighs twice, as it is summed twice in
``S_qd``), and searched with ``LuceneImpactSearcher(index, query_encoder=None)``: its default
encoder splits the string ``"t12 t12 t845"`` on spaces and counts, and the impact similarity scores
Σ_t count_t · weight_td. ``min_idf`` is set to −∞ so a term present in every document is not dropped
from the query (Pyserini's default keeps only idf > 0). Scores are divided by ``scale``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ckray.data.shards import check_index_files
from ckray.fusion import Run
from ckray.rankers.ck_qti.impact import META_FILE, impact_index_dir, read_index_meta, term_string
from ckray.rankers.ck_qti.impact_settings import recorded_settings


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
