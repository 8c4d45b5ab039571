"""Which windows of a long candidate a cross-encoder reads (ckray.windows): the lexical window score, the
choice of the best N in document order, and the first N."""

from __future__ import annotations

import numpy as np
import pytest

from ckray.errors import ConfigError
from ckray.models.encoders import load_tokenizer, text_window_pieces, text_windows
from ckray.windows import CandidateWindows, best_windows, lexical_window_scores

# eight sentences on turtles, then the one the query asks about, then eight more on turtles
FILLER = "sea turtles migrate across the ocean to nest on sandy beaches . "
LONG = FILLER * 8 + "sleep consolidates memory in the hippocampus . " + FILLER * 8


def test_the_window_score_is_bm25s_saturated_tf_weighted_by_idf():
    idf = np.array([0.0, 1.0, 2.0, 3.0])
    # query pieces 1, 2 (twice: counted once); window A holds 1 once and 2 twice, B holds 3 only
    got = lexical_window_scores([1, 2, 2], [[1, 2, 2, 0], [3, 3]], idf, k1=1.2)
    assert got == pytest.approx([1.0 * 1 / 2.2 + 2.0 * 2 / 3.2, 0.0])
    assert lexical_window_scores([3], [[3] * 100], idf)[0] < 3.0   # saturates below the IDF


def test_the_best_windows_come_in_document_order_ties_to_the_earlier():
    assert best_windows([0.1, 5.0, 0.1, 7.0, 5.0], 2) == [1, 3]
    assert best_windows([0.0, 0.0, 0.0], 2) == [0, 1]           # nothing matches: the first ones
    assert best_windows([1.0, 2.0], 5) == [0, 1]


def test_window_pieces_are_the_pieces_of_the_window_texts():
    tok = load_tokenizer(None)
    texts, pieces = text_window_pieces(tok, LONG, 40)
    assert len(texts) == len(pieces) > 4 and texts == text_windows(tok, LONG, 40)
    assert [tok(t, add_special_tokens=False)["input_ids"] for t in texts] == pieces
    assert text_window_pieces(tok, "short text", 40) == (["short text"], [tok("short text", add_special_tokens=False)["input_ids"]])


def test_the_query_reads_the_windows_that_hold_its_terms():
    tok = load_tokenizer(None)
    idf = np.full(len(tok), 1.0)
    idf[tok.convert_tokens_to_ids(["sleep", "memory", "hippocampus"])] = 5.0
    texts, _ = text_window_pieces(tok, LONG, 40)
    hits = [i for i, t in enumerate(texts) if "hippocampus" in t]
    assert hits and hits[0] > 2                       # past the first two windows

    by_query = CandidateWindows(tok, 40, passages=2, choice="query", idf=idf)
    got = by_query("does sleep help memory", LONG)
    assert len(got) == 2 and {i for i, _ in got} & set(hits)
    assert [i for i, _ in got] == sorted(i for i, _ in got)       # in document order
    assert all(texts[i] == t for i, t in got)
    # a query matching nothing, and the "first" choice, read the first two
    assert [i for i, _ in by_query("quantum chromodynamics", LONG)] == [0, 1]
    assert [i for i, _ in CandidateWindows(tok, 40, 2, "first")("does sleep help memory", LONG)] == [0, 1]
    # every window (0), as many windows as the text has, or a text of one window: all of it, whole
    assert [t for _, t in CandidateWindows(tok, 40, 0, "first")("sleep", LONG)] == texts
    assert [t for _, t in CandidateWindows(tok, 40, len(texts), "query", idf)("sleep", LONG)] == texts
    assert by_query("sleep", "sleep is good") == [(0, "sleep is good")]


def test_a_bad_choice_or_a_query_choice_without_idf_is_refused():
    tok = load_tokenizer(None)
    with pytest.raises(ConfigError, match="choice"):
        CandidateWindows(tok, 40, 2, "middle")
    with pytest.raises(ConfigError, match="idf"):
        CandidateWindows(tok, 40, 2, "query")
    assert lexical_window_scores([], [[1, 2], []], np.ones(3)) == [0.0, 0.0]   # an empty query or window: 0
