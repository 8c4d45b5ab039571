"""CLEAR (Gao et al. 2020): residual-margin loss (Eq. 6–7), tower sharing, pooling, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckray.errors import ConfigError
from ckray.models.checkpoint import load_model, save_model
from ckray.rankers.clear.model import CLEAR, CLEARConfig, CLEARLossConfig, clear_collate, clear_loss, mean_pool, residual_margin_loss
from ckray.rankers.clear.task import CLEARTask

TINY_BERT = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 128}


def tiny_config(minilm_path: str, **kw) -> CLEARConfig:
    return CLEARConfig(encoder=minilm_path, pretrained=False, bert_config=dict(TINY_BERT), shared_layers=2,
                       doc_max_len=64, **kw)


@pytest.fixture()
def tiny(minilm_path) -> CLEAR:
    torch.manual_seed(0)
    return CLEAR(tiny_config(minilm_path))


ROWS = {
    "query": np.array(["what causes fever", "protein folding"], dtype=object),
    "pos_text": np.array(["Fever is caused by pyrogens released during infection.",
                          "Chaperones assist protein folding in the cell."], dtype=object),
    "neg_text": np.array(["The weather was fine.", "Stock prices fell sharply on Monday after a long rally."],
                         dtype=object),
    "pos_bm25": np.array([12.0, 9.5], dtype=np.float32),
    "neg_bm25": np.array([4.0, 11.0], dtype=np.float32),
}


# ---------------------------------------------------------------------------------------------- loss

def test_residual_margin_loss_equals_formula():
    s_pos = torch.tensor([0.8, 0.2, 0.5, 0.1])
    s_neg = torch.tensor([0.3, 0.5, 0.5, 0.4])
    lex_pos = torch.tensor([10.0, 30.0, 20.0, 12.0])
    lex_neg = torch.tensor([15.0, 10.0, 20.0, 12.0])
    xi, lam = 1.0, 0.1
    loss = residual_margin_loss(s_pos, s_neg, lex_pos, lex_neg, xi, lam, reduction="none")
    # m_r = ξ − λ(s_lex+ − s_lex−):  1.5, −1.0, 1.0, 1.0
    # [m_r − s+ + s−]_+          :  1.5−0.8+0.3=1.0, max(0, −1−0.2+0.5)=0, 1.0, 1.0+0.3=1.3
    assert loss.tolist() == pytest.approx([1.0, 0.0, 1.0, 1.3])
    assert residual_margin_loss(s_pos, s_neg, lex_pos, lex_neg, xi, lam).item() == pytest.approx(3.3 / 4)
    assert residual_margin_loss(s_pos, s_neg, lex_pos, lex_neg, xi, lam, reduction="sum").item() == pytest.approx(3.3)


def test_negative_margin_when_bm25_already_separates_the_pair():
    # BM25 prefers d+ by 20 points: m_r = 1 − 0.1·20 = −1 < 0, so the embedding may even rank d− a
    # little higher (s− − s+ = 0.9 < 1) at zero loss; with a constant margin the same pair costs 1.9.
    s_pos, s_neg = torch.tensor([0.05]), torch.tensor([0.95])
    lex_pos, lex_neg = torch.tensor([30.0]), torch.tensor([10.0])
    assert residual_margin_loss(s_pos, s_neg, lex_pos, lex_neg, 1.0, 0.1).item() == 0.0
    assert residual_margin_loss(s_pos, s_neg, lex_pos, lex_neg, 1.0, 0.1, constant_margin=True).item() == \
        pytest.approx(1.9)
    # just past the negative margin the hinge is active again, with slope 1 in s_neg
    assert residual_margin_loss(s_pos, s_neg + 0.2, lex_pos, lex_neg, 1.0, 0.1).item() == pytest.approx(0.1)


def test_constant_margin_ignores_bm25():
    s_pos, s_neg = torch.tensor([0.6, 0.6]), torch.tensor([0.5, 0.5])
    a = residual_margin_loss(s_pos, s_neg, torch.tensor([0.0, 50.0]), torch.tensor([0.0, 0.0]), 0.3, 0.1,
                             constant_margin=True, reduction="none")
    assert a.tolist() == pytest.approx([0.2, 0.2])


def test_loss_gradient_pushes_pos_up_and_neg_down():
    s_pos = torch.tensor([0.1], requires_grad=True)
    s_neg = torch.tensor([0.4], requires_grad=True)
    residual_margin_loss(s_pos, s_neg, torch.tensor([5.0]), torch.tensor([8.0]), 0.2, 0.05).backward()
    assert s_pos.grad.item() == -1.0 and s_neg.grad.item() == 1.0


# ------------------------------------------------------------------------------------ architecture

def test_default_split_keeps_paper_ratio(minilm_path):
    cfg = CLEARConfig(encoder=minilm_path, pretrained=False, bert_config={**TINY_BERT, "num_hidden_layers": 12})
    m = CLEAR(cfg)
    assert (len(m.shared_layers), len(m.query_layers), len(m.doc_layers)) == (8, 4, 4)
    m6 = CLEAR(CLEARConfig(encoder=minilm_path, pretrained=False, bert_config={**TINY_BERT, "num_hidden_layers": 6}))
    assert (len(m6.shared_layers), len(m6.query_layers)) == (4, 2)


def test_invalid_configs_raise(minilm_path):
    with pytest.raises(ConfigError, match="shared_layers"):
        CLEAR(tiny_config(minilm_path).__class__(**{**tiny_config(minilm_path).__dict__, "shared_layers": 5}))
    with pytest.raises(ConfigError, match="identity"):
        CLEAR(tiny_config(minilm_path, dim=16))
    assert CLEAR(tiny_config(minilm_path, dim=16, projection_init="random")).encode_queries(["a b"]).shape == (1, 16)


def test_towers_start_equal_but_are_separate_parameters(tiny):
    for q, d in zip(tiny.query_layers.parameters(), tiny.doc_layers.parameters()):
        assert torch.equal(q, d)
        assert q.data_ptr() != d.data_ptr()
    # identical weights → identical encodings for the same text at initialisation
    text = ["fever and infection"]
    assert torch.allclose(tiny.encode_queries(text), tiny.encode_documents(text), atol=1e-6)


def _grad_norms(model: CLEAR) -> dict[str, float]:
    def norm(mod):
        grads = [p.grad for p in mod.parameters() if p.grad is not None]
        return float(sum(g.abs().sum() for g in grads)) if grads else 0.0
    return {"embeddings": norm(model.embeddings), "shared": norm(model.shared_layers),
            "query": norm(model.query_layers), "doc": norm(model.doc_layers), "head": norm(model.projection)}


def test_shared_layers_get_gradients_from_both_towers_upper_layers_from_their_own(tiny):
    tok = tiny.tokenize(["what causes fever"], 16)
    # (not .sum(): a LayerNorm output has zero mean over dimensions, so the sum of the pooled vector
    # is constant at initialisation and has no gradient)
    r = torch.randn(tiny.config.dim, generator=torch.Generator().manual_seed(1))
    tiny.zero_grad()
    (tiny.query_embeddings(tok["input_ids"], tok["attention_mask"]) @ r).sum().backward()
    g = _grad_norms(tiny)
    assert g["embeddings"] > 0 and g["shared"] > 0 and g["query"] > 0 and g["head"] > 0
    assert g["doc"] == 0.0

    tiny.zero_grad()
    (tiny.document_embeddings(tok["input_ids"], tok["attention_mask"]) @ r).sum().backward()
    g = _grad_norms(tiny)
    assert g["shared"] > 0 and g["doc"] > 0 and g["query"] == 0.0


def test_a_step_on_the_query_tower_changes_queries_only_where_expected(tiny):
    """Updating the shared layers moves both towers; updating one upper tower moves only its side."""
    text = ["protein folding"]
    before_q, before_d = tiny.encode_queries(text), tiny.encode_documents(text)
    with torch.no_grad():
        for p in tiny.query_layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert not torch.allclose(tiny.encode_queries(text), before_q, atol=1e-4)
    assert torch.equal(tiny.encode_documents(text), before_d)
    with torch.no_grad():
        for p in tiny.shared_layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    assert not torch.allclose(tiny.encode_documents(text), before_d, atol=1e-4)


# ----------------------------------------------------------------------------------------- pooling

def test_mean_pool_ignores_padding():
    tokens = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]],
                           [[5.0, 5.0], [-7.0, 9.0], [1.0, 1.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = mean_pool(tokens, mask)
    assert torch.allclose(out, torch.tensor([[2.0, 3.0], [-1 / 3, 5.0]]))


def test_encoding_does_not_depend_on_padding_in_the_batch(tiny):
    short = "fever"
    long = "fever " + " ".join(["infection pyrogen cytokine"] * 10)
    alone = tiny.encode_documents([short])
    padded = tiny.encode_documents([short, long], batch_size=2)[:1]   # padded to the long text
    assert torch.allclose(alone, padded, atol=1e-5)
    tok = tiny.tokenize([short, long], 64)
    assert tok["attention_mask"][0].sum() < tok["attention_mask"][1].sum()


def test_embeddings_are_unit_vectors_and_score_is_inner_product(tiny):
    q = ["what causes fever", "protein folding"]
    d = ["Fever is caused by pyrogens.", "Chaperones help folding."]
    vq, vd = tiny.encode_queries(q), tiny.encode_documents(d)
    assert torch.allclose(vq.norm(dim=-1), torch.ones(2), atol=1e-5)
    assert torch.allclose(tiny.score_texts(q, d), (vq * vd).sum(-1), atol=1e-6)
    # duplicate queries (dev sets) give the same scores as distinct calls
    assert torch.allclose(tiny.score_texts([q[0], q[0]], d), torch.stack(
        [tiny.score_texts([q[0]], [d[0]])[0], tiny.score_texts([q[0]], [d[1]])[0]]), atol=1e-6)


# ------------------------------------------------------------------------------------- checkpoints

def test_save_load_round_trip(tiny, tmp_path):
    with torch.no_grad():   # make the towers differ so both must be restored
        for p in tiny.query_layers.parameters():
            p.add_(0.01 * torch.randn_like(p))
    q, d = ["what causes fever"], ["Fever is caused by pyrogens released during infection."]
    before = (tiny.encode_queries(q), tiny.encode_documents(d))
    save_model(tiny, tmp_path / "clear")
    loaded = load_model(tmp_path / "clear")
    assert isinstance(loaded, CLEAR)
    assert loaded.config == tiny.config and loaded.config.pretrained is False
    assert torch.equal(loaded.encode_queries(q), before[0])
    assert torch.equal(loaded.encode_documents(d), before[1])


def test_untrained_clear_equals_the_pretrained_sentence_encoder(minilm_path):
    """Identity projection + mean pooling + L2: step 0 is exactly all-MiniLM-L6-v2."""
    st = pytest.importorskip("sentence_transformers")
    model = CLEAR(CLEARConfig(encoder=minilm_path))
    ref = st.SentenceTransformer(str(minilm_path), device="cpu")
    texts = ["Fever is caused by pyrogens.", "a", "Chaperones assist protein folding in the endoplasmic reticulum."]
    expected = torch.as_tensor(ref.encode(texts, convert_to_numpy=True))
    assert torch.allclose(model.encode_documents(texts), expected, atol=1e-5)
    assert torch.allclose(model.encode_queries(texts), expected, atol=1e-5)


# ----------------------------------------------------------------------------------- training plug

def test_collate_and_loss_match_the_pure_function(tiny):
    tiny.eval()   # no dropout: the batched loss must equal the per-text encodings
    cfg = CLEARLossConfig(xi=0.5, lambda_train=0.05)
    batch = clear_collate(ROWS, tiny.tokenizer, tiny.config)
    assert batch["q_input_ids"].shape[0] == 2 and batch["pos_bm25"].tolist() == [12.0, 9.5]
    loss = clear_loss(tiny, batch, cfg)
    vq = tiny.encode_queries(list(ROWS["query"]))
    s_pos = (vq * tiny.encode_documents(list(ROWS["pos_text"]))).sum(-1)
    s_neg = (vq * tiny.encode_documents(list(ROWS["neg_text"]))).sum(-1)
    expected = residual_margin_loss(s_pos, s_neg, torch.tensor(ROWS["pos_bm25"]), torch.tensor(ROWS["neg_bm25"]),
                                    0.5, 0.05)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


def test_task_trains_the_loss_down(minilm_path):
    torch.manual_seed(0)
    task = CLEARTask(model_config=tiny_config(minilm_path), loss_config=CLEARLossConfig(xi=0.5, lambda_train=0.01))
    model = task.build_model().train()
    model.embeddings.word_embeddings.weight.requires_grad_(False)   # a dense 30k-row gradient: slow, not needed
    batch = task.collate(ROWS)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = task.loss(model, batch)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    model.eval()
    scores = task.score(model, list(ROWS["query"]), list(ROWS["pos_text"]), [1.0, 2.0])
    s_emb = model.score_texts(list(ROWS["query"]), list(ROWS["pos_text"]))
    assert torch.allclose(scores, 0.01 * torch.tensor([1.0, 2.0]) + s_emb, atol=1e-6)   # Eq. 8 with λ_train
