"""A query's words as the BM25 first stage's Lucene analyser keeps them.

Pyserini's English analyser (Lucene's ``StandardTokenizer``, lower-casing, the English possessive
filter and Lucene's English stop set: *a, an, and, are, as, at, be, …, with*) drops punctuation and stop
words. ``query_words`` runs it without the Porter stemmer, so the words it returns are whole words a
word-piece tokenizer can cut again (``"What is the role of p53?"`` → ``what role p53``).

``stem_classes`` groups a word-piece vocabulary by the same analyser's Porter stems, so that an exact match
can count ``computing`` in a document that says ``computer``, as BM25's stemmed index does.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

_lock = threading.Lock()


@functools.lru_cache(maxsize=2)
def _analyzer(stemming: bool = False) -> Any:
    from ckray.lexical.jvm import ensure_jvm

    ensure_jvm()
    from pyserini.analysis import Analyzer, get_lucene_analyzer

    return Analyzer(get_lucene_analyzer(stemming=stemming, stopwords=not stemming))


def query_words(texts: Sequence[str]) -> list[str]:
    """Each text's words that Lucene's English analyser keeps (no stemming), joined by spaces; ``""``
    for a text made only of stop words and punctuation."""
    with _lock:
        analyzer = _analyzer()
    return [" ".join(analyzer.analyze(str(text))) for text in texts]


@functools.lru_cache(maxsize=4)
def stem_classes(encoder: str | None) -> np.ndarray:
    """The exact-match class of each id of ``encoder``'s word-piece vocabulary (int64 ``[V]``): a piece that
    opens a word (not ``##…``, not ``[…]``) and that Lucene's English analyser reads as one word shares the
    class of every such piece with the same Porter stem (``computer``, ``computing``, ``computed``: the class
    of the smallest id among them); every other piece is a class of its own (its id). Stop words are kept
    (stemmed as themselves), so the map covers the whole vocabulary."""
    from ckray.models.encoders import load_tokenizer

    tokenizer = load_tokenizer(encoder)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    classes = np.arange(len(pieces), dtype=np.int64)
    with _lock:
        analyzer = _analyzer(stemming=True)
        first_of_stem: dict[str, int] = {}
        for i, piece in enumerate(pieces):
            if piece.startswith("##") or (piece.startswith("[") and piece.endswith("]")):
                continue
            words = analyzer.analyze(piece)
            if len(words) == 1:
                classes[i] = first_of_stem.setdefault(words[0], i)
    classes.flags.writeable = False
    return classes
