"""Which windows of a long candidate a cross-encoder reads.

A cross-encoder reads ``document_pieces`` word pieces of a document per input. A longer candidate is cut
into windows of that many pieces, each sharing a quarter with the next (``ckray.models.encoders``), and
scored as its best window (MaxP, Dai & Callan 2019). Each window read is a forward pass per query, so a
reranker reads at most ``passages`` of them. Which ones:

* ``"query"`` (the default): the ``passages`` windows that match the query best under a cheap lexical
  score, read in document order: the first stage of a cascade inside the document, as IDCM selects
  passages with a cheap model before the expensive one (Hofstätter et al. 2021). A window's score is
  BM25's saturated term frequency summed over the query's distinct word pieces, each weighted by its IDF
  in the collection being reranked (windows are of equal length, so BM25's length norm drops out):
  ``s(q, w) = Σ_{t ∈ q} idf_t · tf_{t,w} / (tf_{t,w} + k1)``. Ties go to the earlier window, so a query
  that matches nothing reads the first ``passages`` windows.
* ``"first"``: the first ``passages`` windows, wherever the query's terms are.

A candidate that fits one input, or has no more windows than ``passages``, is read whole either way.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckray.errors import ConfigError

WINDOW_CHOICES = ("query", "first")
DEFAULT_WINDOW_CHOICE = "query"
WINDOW_K1 = 1.2          # BM25's k1 for a window's term frequencies (Robertson & Zaragoza 2009)


def check_window_choice(owner: str, choice: str, field: str = "window_choice") -> None:
    """A ConfigError naming ``owner.field`` unless ``choice`` is one of :data:`WINDOW_CHOICES`."""
    if choice not in WINDOW_CHOICES:
        raise ConfigError.invalid(owner, field, f"must be one of {WINDOW_CHOICES}, got {choice!r}")


def lexical_window_scores(query_pieces: list[int], windows: list[list[int]], idf: np.ndarray,
                          k1: float = WINDOW_K1) -> list[float]:
    """``s(q, w) = Σ_{t ∈ q} idf_t · tf_{t,w} / (tf_{t,w} + k1)`` of each window (word-piece ids), the
    query's word pieces counted once each."""
    terms = set(query_pieces)
    scores = []
    for window in windows:
        tf = Counter(t for t in window if t in terms)
        scores.append(float(sum(idf[t] * n / (n + k1) for t, n in tf.items())))
    return scores


def best_windows(scores: list[float], n: int) -> list[int]:
    """Positions of the ``n`` best-scoring windows (ties: the earlier), in document order."""
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return sorted(ranked[:n])


@dataclass
class CandidateWindows:
    """``(query, text) -> [(window position, window text)]``: the windows of ``text`` a cross-encoder reads
    for ``query`` (module docstring). ``pieces``: word pieces per window; ``passages``: windows read (0:
    every one); ``idf``: IDF of each vocabulary id in the collection being reranked (``choice="query"``
    needs it). A document's windows are cut once and kept for the next queries (``cache_size`` texts)."""

    tokenizer: Any
    pieces: int
    passages: int
    choice: str = DEFAULT_WINDOW_CHOICE
    idf: np.ndarray | None = None
    cache_size: int = 1024
    _cut: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_window_choice("CandidateWindows", self.choice, "choice")
        if self.choice == "query" and self.idf is None:
            raise ConfigError.invalid("CandidateWindows", "idf", "choosing windows by the query needs the IDF of "
                                      "the collection being reranked")
        self._cut = functools.lru_cache(maxsize=self.cache_size)(self._windows)

    def _windows(self, text: str) -> tuple[list[str], list[list[int]]]:
        from ckray.models.encoders import text_window_pieces

        return text_window_pieces(self.tokenizer, text, self.pieces)

    def __call__(self, query: str, text: str) -> list[tuple[int, str]]:
        texts, pieces = self._cut(text)
        if not self.passages or len(texts) <= self.passages:
            return list(enumerate(texts))
        if self.choice == "first":
            chosen = list(range(self.passages))
        else:
            query_pieces = self.tokenizer(query, add_special_tokens=False)["input_ids"]
            chosen = best_windows(lexical_window_scores(query_pieces, pieces, self.idf), self.passages)
        return [(i, texts[i]) for i in chosen]
