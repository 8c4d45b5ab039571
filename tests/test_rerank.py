"""Reranking a first-stage run: Ray Data actor pool vs in-process, and the run contract."""

from __future__ import annotations

import pytest
import torch

from ckray.rankers.cedr.model import CEDRConfig, CEDRRanker
from ckray.models.checkpoint import load_model, save_model
from ckray.models.encoders import document_windows, text_windows
from ckray.rerank import CheckpointReranker, merge_scores, rerank, rerank_local

TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64)

QUERIES = {"q1": "vitamin d and bone fractures", "q2": "gene expression in tumours", "q3": "sleep and memory"}
DOCS = {
    "d1": "vitamin d deficiency raises fracture risk in older adults",
    "d2": "tumour cells show altered gene expression profiles " * 4,
    "d3": "sleep consolidates memory in the hippocampus",
    "d4": "bone density declines with age and low vitamin intake",
    "d5": "an unrelated document about sea turtles and their migration routes " * 3,
    "d6": "memory formation depends on synaptic plasticity",
}
# a long document whose match lies past what the tiny model reads (84 word pieces: 4 segments of 32 - 8 - 3)
LONG = ("sea turtles migrate across the ocean to nest on sandy beaches . " * 12
        + "sleep consolidates memory in the hippocampus .")
RUN = {
    "q1": [("d1", 9.0), ("d4", 8.0), ("d5", 7.0), ("d2", 6.0), ("d3", 1.0)],
    "q2": [("d2", 5.0), ("d5", 4.0), ("d6", 3.0), ("d1", 2.0)],
    "q3": [("d3", 3.0), ("d6", 2.5), ("d5", 2.0)],
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, minilm_path):
    torch.manual_seed(0)
    model = CEDRRanker(CEDRConfig(variant="knrm", random_init=TINY, max_length=32, max_query_len=8))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("ckpt") / "cedr-knrm-tiny"
    save_model(model, path)
    return path


def _check_run(reranked, depth):
    for qid, docs in RUN.items():
        out = reranked[qid]
        assert sorted(d for d, _ in out) == sorted(d for d, _ in docs)  # nothing lost or added
        scores = [s for _, s in out]
        assert scores == sorted(scores, reverse=True)
        assert [d for d, _ in out[depth:]] == [d for d, _ in docs[depth:]]  # tail keeps its order
        assert {d for d, _ in out[:depth]} == {d for d, _ in docs[:depth]}


def test_rerank_local_rescores_the_top_k(checkpoint):
    model = load_model(checkpoint)
    reranked = rerank_local(model, QUERIES, RUN, DOCS, depth=3, batch_size=2)
    _check_run(reranked, 3)
    direct = model.score_texts([QUERIES["q1"]] * 3, [DOCS["d1"], DOCS["d4"], DOCS["d5"]]).tolist()
    expected = sorted(zip(["d1", "d4", "d5"], direct), key=lambda x: -x[1])
    got = reranked["q1"][:3]
    assert [d for d, _ in got] == [d for d, _ in expected]
    assert [s for _, s in got] == pytest.approx([s for _, s in expected], abs=1e-5)
    # the doc-text lookup may be a callable
    again = rerank_local(model, QUERIES, RUN, DOCS.__getitem__, depth=3, batch_size=4)
    assert [d for d, _ in again["q1"]] == [d for d, _ in reranked["q1"]]


def test_checkpoint_reranker_contract(checkpoint):
    reranker = CheckpointReranker(str(checkpoint), DOCS, batch_size=4)
    got = reranker.rerank(QUERIES, RUN, depth=3)
    assert got == rerank_local(load_model(checkpoint), QUERIES, RUN, DOCS, depth=3, batch_size=4)


def test_merge_scores_keeps_tail_below_reranked():
    run = {"q": [("a", 10.0), ("b", 9.0), ("c", 8.0)]}
    merged = merge_scores(run, {("q", "a"): -5.0, ("q", "b"): -1.0}, depth=2)
    assert merged == {"q": [("b", -1.0), ("a", -5.0), ("c", -6.0)]}


def test_text_windows_are_the_document_windows_of_the_text():
    from ckray.models.encoders import load_tokenizer

    tok = load_tokenizer(None)
    parts = text_windows(tok, LONG, 40)
    pieces, per_text = document_windows(tok, [LONG], 40, add_special_tokens=False)
    assert len(parts) == per_text[0] > 3
    assert [tok(p, add_special_tokens=False)["input_ids"] for p in parts] == pieces
    assert LONG.startswith(parts[0]) and LONG.rstrip(" .").endswith(parts[-1].rstrip(" ."))
    assert text_windows(tok, LONG, 40, max_windows=2) == parts[:2]
    assert text_windows(tok, DOCS["d1"], 40) == [DOCS["d1"]]     # fits one window: the text itself
    assert text_windows(tok, "", 40) == [""]


def test_a_long_document_scores_as_its_best_window(checkpoint):
    """passages 0: every window of the word pieces one input reads, the document its best window's score
    (MaxP); 1: the text whole, cut where the model cuts it; N: the first N windows. A document that fits one
    input scores the same under every setting."""
    model = load_model(checkpoint)
    docs = {**DOCS, "long": LONG}
    run = {"q3": [("long", 3.0), ("d3", 2.0), ("d5", 1.0)]}
    parts = text_windows(model.tokenizer, LONG, model.document_pieces)
    query = " ".join(["memory"] * model.config.max_query_len)   # the longest query reads document_pieces of LONG
    assert int(model.tokenize_pairs([query], [LONG])["doc_mask"].sum()) == model.document_pieces < len(
        model.tokenizer(LONG, add_special_tokens=False)["input_ids"])
    assert len(parts) >= 3
    per_window = model.score_texts([QUERIES["q3"]] * len(parts), parts).tolist()
    whole = model.score_texts([QUERIES["q3"]], [LONG]).item()
    short = model.score_texts([QUERIES["q3"]] * 2, [DOCS["d3"], DOCS["d5"]]).tolist()
    for passages, expected in ((0, max(per_window)), (1, whole), (2, max(per_window[:2]))):
        reranker = CheckpointReranker(str(checkpoint), docs, passages=passages, batch_size=2)
        got = dict(reranker.rerank(QUERIES, run, depth=3)["q3"])
        assert got["long"] == pytest.approx(expected, abs=1e-5)
        assert [got["d3"], got["d5"]] == pytest.approx(short, abs=1e-5)
        assert reranker.settings["reranker_passages"] == passages
    assert max(per_window) != pytest.approx(whole, abs=1e-4)    # the windows change the long document's score
    with pytest.raises(Exception, match="passages"):
        CheckpointReranker(str(checkpoint), docs, passages=-1)


@pytest.mark.slow
def test_ray_actor_pool_rerank_matches_local(checkpoint, ray_session):
    local = rerank_local(load_model(checkpoint), QUERIES, RUN, DOCS, depth=4, batch_size=3)
    distributed = rerank(checkpoint, QUERIES, RUN, DOCS, depth=4, batch_size=3, num_actors=2)
    _check_run(distributed, 4)
    assert distributed.keys() == local.keys()
    for qid in local:
        assert [d for d, _ in distributed[qid]] == [d for d, _ in local[qid]]
        assert [s for _, s in distributed[qid]] == pytest.approx([s for _, s in local[qid]], abs=1e-5)
    # a long document's windows: rows of their own on the actors, its best window's score back here
    model = load_model(checkpoint)
    windows = CheckpointReranker(str(checkpoint), DOCS, passages=0).windows()
    docs, run = {**DOCS, "long": LONG}, {"q3": [("long", 3.0), *RUN["q3"]]}
    local = rerank_local(model, QUERIES, run, docs, depth=4, batch_size=3, windows=windows)
    distributed = rerank(checkpoint, QUERIES, run, docs, depth=4, batch_size=3, num_actors=2, windows=windows)
    assert [d for d, _ in distributed["q3"]] == [d for d, _ in local["q3"]]
    assert [s for _, s in distributed["q3"]] == pytest.approx([s for _, s in local["q3"]], abs=1e-5)


def test_a_negative_rerank_passages_is_refused_naming_the_field():
    from ckray.errors import ConfigError
    from ckray.evaluation import EvaluateConfig

    with pytest.raises(ConfigError, match="rerank_passages"):
        EvaluateConfig(data="d", workdir="w", rerank_passages=-1)
    assert EvaluateConfig(data="d", workdir="w", rerank_passages=0).rerank_passages == 0
    with pytest.raises(ConfigError, match="rerank_window_choice"):
        EvaluateConfig(data="d", workdir="w", rerank_window_choice="middle")


@pytest.mark.slow
def test_with_a_corpus_a_reranker_reads_the_windows_that_match_the_query(checkpoint, ray_session, tmp_path):
    """passages N < a document's windows: the N windows whose word pieces match the query best, weighted by
    the IDF of the work directory's corpus (counted on Ray), read in order; ``first``: the first N."""
    import pyarrow as pa

    from ckray.data.collections import CORPUS_SCHEMA
    from ckray.data.shards import write_corpus_shards

    docs = {**DOCS, "long": LONG}
    write_corpus_shards(tmp_path, [pa.table([list(docs), [""] * len(docs), list(docs.values())],
                                            schema=CORPUS_SCHEMA)], "test")
    model = load_model(checkpoint)
    parts = text_windows(model.tokenizer, LONG, model.document_pieces)
    per_window = model.score_texts([QUERIES["q3"]] * len(parts), parts).tolist()
    run = {"q3": [("long", 3.0), ("d3", 2.0), ("d5", 1.0)]}
    last = len(parts) - 1                       # the only window holding "sleep … memory"
    assert last >= 2 and "memory" in parts[last] and not any("memory" in p for p in parts[:last])

    by_query = CheckpointReranker(str(checkpoint), docs, workdir=str(tmp_path), passages=2, batch_size=2)
    chosen = [i for i, _ in by_query.windows()(QUERIES["q3"], LONG)]
    assert len(chosen) == 2 and last in chosen and by_query.settings["reranker_window_choice"] == "query"
    got = dict(by_query.rerank(QUERIES, run, depth=3)["q3"])
    assert got["long"] == pytest.approx(max(per_window[i] for i in chosen), abs=1e-5)

    first = CheckpointReranker(str(checkpoint), docs, workdir=str(tmp_path), passages=2, window_choice="first")
    assert dict(first.rerank(QUERIES, run, depth=3)["q3"])["long"] == pytest.approx(max(per_window[:2]), abs=1e-5)
    assert first.settings["reranker_window_choice"] == "first"
    with pytest.raises(Exception, match="window_choice"):
        CheckpointReranker(str(checkpoint), docs, window_choice="middle")
