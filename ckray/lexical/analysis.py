"""A query's words as the BM25 first stage's Lucene analyser keeps them.

Pyserini's English analyser (Lucene's ``StandardTokenizer``, lower-casing, the English possessive
filter and Lucene's English stop set: *a, an, and, are, as, at, be, …, with*) drops punctuation and stop
words. ``query_words`` runs it without the Porter stemmer, so the words it returns are whole words a
word-piece tokenizer can cut again (``"What is the role of p53?"`` → ``what role p53``).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _analyzer() -> Any:
    from ckray.lexical.jvm import ensure_jvm

    ensure_jvm()
    from pyserini.analysis import Analyzer, get_lucene_analyzer

    return Analyzer(get_lucene_analyzer(stemming=False))


def query_words(texts: Sequence[str]) -> list[str]:
    """Each text's words that Lucene's English analyser keeps (no stemming), joined by spaces; ``""``
    for a text made only of stop words and punctuation."""
    with _lock:
        analyzer = _analyzer()
    return [" ".join(analyzer.analyze(str(text))) for text in texts]
