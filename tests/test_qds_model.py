"""QDS-Transformer: BERT equivalence, input layout, checkpoints, long inputs, padding, training plug."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckray.errors import ConfigError
from ckray.models.checkpoint import load_model, save_model
from ckray.models.sparse_attention import fused_masked_attention, qds_attention
from ckray.rankers.qds.model import QDSConfig, QDSTransformer, resolve_attention_kernel, collate_triples, encode_pairs, pairwise_loss, split_sentences, triple_loss
from ckray.rankers.qds.task import QDSTask

TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=128, type_vocab_size=2,
                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)

QUERIES = ["does vitamin d reduce fractures?", "tumour growth in mice"]
DOCS = [
    "Vitamin D supplements were given to 2,000 adults. Fractures fell by a third! Was it the dose?\n"
    "A follow-up trial is planned.",
    "Mice with the mutation grew larger tumours. The effect was absent in controls.",
]


def tiny(**overrides) -> QDSConfig:
    cfg = dict(pretrained=False, bert_config=TINY_BERT, max_length=128, window=16)
    cfg.update(overrides)
    return QDSConfig(**cfg)


def long_doc(words: int) -> str:
    sentence = "the protein binds the receptor in human cells and changes its shape"
    return ". ".join([sentence] * (words // 12)) + "."


@pytest.fixture(scope="module")
def model() -> QDSTransformer:
    torch.manual_seed(0)
    return QDSTransformer(tiny()).eval()


# ---------------------------------------------------------------------------------------------
# Input layout
# ---------------------------------------------------------------------------------------------

def test_split_sentences():
    assert split_sentences("One. Two! Three?\nFour\n\nfive 3.5 six.") == \
        ["One.", "Two!", "Three?", "Four", "five 3.5 six."]
    assert split_sentences("   ") == []


def test_encode_pairs_builds_cls_query_sep_sos_layout(model: QDSTransformer):
    tok = model.tokenizer
    batch = encode_pairs(tok, QUERIES, DOCS, model.config)
    ids, n = batch["input_ids"], batch["input_ids"].shape[1]
    assert n % 8 == 0
    sos = tok.convert_tokens_to_ids("[unused1]")
    for i, (query, doc) in enumerate(zip(QUERIES, DOCS)):
        q_ids = tok(query, add_special_tokens=False)["input_ids"]
        length = int(batch["attention_mask"][i].sum())
        row = ids[i, :length].tolist()
        assert row[: len(q_ids) + 2] == [tok.cls_token_id, *q_ids, tok.sep_token_id]
        assert row[-1] == tok.sep_token_id and (ids[i, length:] == tok.pad_token_id).all()
        # one [SOS] per sentence, each followed by that sentence's word pieces
        sos_pos = torch.nonzero(batch["sentence_mask"][i]).flatten().tolist()
        assert sos_pos == [p for p, t in enumerate(row) if t == sos]
        assert len(sos_pos) == len(split_sentences(doc))
        first = tok(split_sentences(doc)[0], add_special_tokens=False)["input_ids"]
        assert row[sos_pos[0] + 1: sos_pos[0] + 1 + len(first)] == first
        # global = [CLS] + query; segment 0 up to the first [SEP], 1 for the document
        assert batch["global_mask"][i].nonzero().flatten().tolist() == list(range(len(q_ids) + 1))
        assert batch["token_type_ids"][i, : len(q_ids) + 2].eq(0).all()
        assert batch["token_type_ids"][i, len(q_ids) + 2: length].eq(1).all()
        assert batch["token_type_ids"][i, length:].eq(0).all()


def test_document_pieces_is_what_one_input_holds_beside_the_longest_query(model: QDSTransformer):
    cfg, tok = model.config, model.tokenizer
    query = " ".join(["protein"] * cfg.max_query_length)               # the longest query: max_query_length pieces
    sentence = " ".join(["receptor"] * (model.document_pieces + 1))    # one sentence, one piece too many
    batch = encode_pairs(tok, [query], [sentence], cfg)
    receptor = tok.convert_tokens_to_ids("receptor")
    assert int((batch["input_ids"] == receptor).sum()) == model.document_pieces   # all but the extra piece
    assert int(batch["attention_mask"].sum()) == cfg.max_length


def test_encode_pairs_truncates_to_max_length(model: QDSTransformer):
    cfg = tiny(max_length=64, max_query_length=5)
    batch = encode_pairs(model.tokenizer, ["a very long query " * 10], [long_doc(500)], cfg)
    assert batch["input_ids"].shape == (1, 64)
    assert batch["attention_mask"].all()
    assert int(batch["global_mask"].sum()) == 6                     # [CLS] + 5 query pieces
    assert batch["input_ids"][0, -1] == model.tokenizer.sep_token_id
    with pytest.raises(ConfigError):
        encode_pairs(model.tokenizer, ["q"], ["d"], tiny(sos_token="[NOT-A-TOKEN]"))
    with pytest.raises(ConfigError):
        tiny(pattern="bigbird")


# ---------------------------------------------------------------------------------------------
# The layer forward is BERT's
# ---------------------------------------------------------------------------------------------

def test_full_window_equals_original_bert(model: QDSTransformer):
    """With a window covering the whole sequence A_QDS is full attention, so the sparse layer
    forward over the BertLayer submodules must reproduce BertModel itself."""
    full = QDSTransformer(tiny(window=1000))
    full.load_state_dict(model.state_dict())
    full.eval()
    batch = full.build_batch(QUERIES, DOCS)                 # two lengths: the shorter one is padded
    ours = full.encode(batch)
    with torch.no_grad():
        ref = full.bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                        token_type_ids=batch["token_type_ids"]).last_hidden_state
    valid = batch["attention_mask"]
    torch.testing.assert_close(ours[valid], ref[valid], atol=1e-5, rtol=1e-5)
    scores = full.score(ref[:, 0]).squeeze(-1)
    torch.testing.assert_close(full(batch), scores, atol=1e-5, rtol=1e-5)


def test_patterns_are_wired(model: QDSTransformer):
    """The three attention patterns give different scores on a document longer than the window."""
    queries, docs = [QUERIES[0]], [long_doc(90)]
    scores = {}
    for pattern in ("qds", "longformer-qa", "local"):
        m = QDSTransformer(tiny(pattern=pattern))
        m.load_state_dict(model.state_dict())
        scores[pattern] = float(m.eval().score_texts(queries, docs)[0])
    assert len({round(s, 6) for s in scores.values()}) == 3


# ---------------------------------------------------------------------------------------------
# Padding, long inputs, checkpoints
# ---------------------------------------------------------------------------------------------

def test_padding_does_not_change_scores(model: QDSTransformer):
    alone = torch.stack([model(model.build_batch([q], [d]))[0] for q, d in zip(QUERIES, DOCS)])
    padded_batch = model.build_batch(QUERIES + ["x"], DOCS + [long_doc(60)])
    assert padded_batch["input_ids"].shape[1] > max(int(m.sum()) for m in padded_batch["attention_mask"][:2])
    with torch.no_grad():
        together = model(padded_batch)[:2]
    torch.testing.assert_close(together, alone.detach(), atol=1e-5, rtol=1e-5)
    # score_texts batches by length; the order of its answers is the order of its inputs
    torch.testing.assert_close(model.score_texts(QUERIES[::-1], DOCS[::-1]), alone.detach().flip(0),
                               atol=1e-5, rtol=1e-5)


def test_a_2048_token_document_runs_forward_and_backward():
    torch.manual_seed(0)
    m = QDSTransformer(tiny(max_length=2048, window=64))
    # positions beyond the pretrained 128 are copies (row i ← row i mod 128)
    table = m.bert.embeddings.position_embeddings.weight
    assert table.shape[0] == 2048
    torch.testing.assert_close(table[128:256], table[:128])
    torch.testing.assert_close(table[2047], table[2047 % 128])
    batch = m.build_batch([QUERIES[0]], [long_doc(3000)])
    assert batch["input_ids"].shape == (1, 2048)
    assert int(batch["sentence_mask"].sum()) > 100
    m.train()
    score = m(batch)
    score.sum().backward()
    assert torch.isfinite(score).all()
    assert all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)
    assert m.bert.embeddings.position_embeddings.weight.grad[2000:].abs().sum() > 0


def test_checkpoint_round_trip_gives_identical_scores(model: QDSTransformer, tmp_path):
    path = save_model(model, tmp_path / "qds")
    loaded = load_model(path)
    assert isinstance(loaded, QDSTransformer)
    assert loaded.config == model.config
    assert torch.equal(loaded.score_texts(QUERIES, DOCS), model.score_texts(QUERIES, DOCS))


def test_checkpoint_of_extended_positions_round_trips(tmp_path):
    torch.manual_seed(1)
    m = QDSTransformer(tiny(max_length=300)).eval()
    loaded = load_model(save_model(m, tmp_path / "qds300"))
    assert loaded.bert.embeddings.position_embeddings.weight.shape[0] == 300
    docs = [long_doc(250)]
    assert torch.equal(loaded.score_texts(QUERIES[:1], docs), m.score_texts(QUERIES[:1], docs))


# ---------------------------------------------------------------------------------------------
# Training plug
# ---------------------------------------------------------------------------------------------

def test_pairwise_losses():
    pos, neg = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    ce = -torch.log_softmax(torch.stack([pos, neg], 1), dim=1)[:, 0].mean()
    torch.testing.assert_close(pairwise_loss(pos, neg, "softmax"), ce)
    torch.testing.assert_close(pairwise_loss(pos, neg, "hinge", margin=1.0), torch.tensor(0.5))
    with pytest.raises(ConfigError):
        pairwise_loss(pos, neg, "listwise")


def test_task_collate_and_loss_train_the_model():
    """A few optimiser steps on one batch of triples lower its pairwise loss."""
    torch.manual_seed(0)
    task = QDSTask(model_config=tiny())
    m = task.build_model()
    rows = {"query": np.array(QUERIES, dtype=object), "pos_text": np.array(DOCS, dtype=object),
            "neg_text": np.array([long_doc(40), "unrelated text about trains. and boats."], dtype=object),
            "pos_bm25": np.array([12.0, 9.0]), "neg_bm25": np.array([10.0, 8.0])}
    batch = task.collate(rows)
    assert batch["input_ids"].shape[0] == 4
    assert torch.equal(batch["input_ids"], collate_triples(rows, m.tokenizer, m.config)["input_ids"])
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    m.eval()                                              # no dropout: a deterministic loss curve
    with torch.no_grad():
        first = task.loss(m, batch).item()
    for _ in range(6):
        opt.zero_grad()
        loss = task.loss(m, batch)
        loss.backward()
        opt.step()
    with torch.no_grad():
        assert triple_loss(m, batch).item() < first


def test_gradient_checkpointing_gives_the_same_gradients(model: QDSTransformer):
    batch = model.build_batch(QUERIES, DOCS)
    grads = []
    for ckpt in (False, True):
        m = QDSTransformer(tiny(gradient_checkpointing=ckpt))
        m.load_state_dict(model.state_dict())
        m.train()
        torch.manual_seed(0)
        m(batch).sum().backward()
        grads.append(m.bert.encoder.layer[0].attention.self.query.weight.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("pattern", ["qds", "longformer-qa"])
def test_fused_mask_kernel_computes_the_sparse_kernels_attention(model: QDSTransformer, pattern):
    """attention_kernel only chooses how the pattern is computed: the fused SDPA kernel under the
    materialised mask gives the sparse kernel's scores and gradients, padded batch included."""
    batch = model.build_batch(QUERIES + ["x"], DOCS + [long_doc(60)])
    assert not batch["attention_mask"].all()          # padding rows present
    scores, grads = {}, {}
    for kernel in ("sparse", "fused-mask"):
        m = QDSTransformer(tiny(pattern=pattern, attention_kernel=kernel))
        m.load_state_dict(model.state_dict())
        m.train()
        m.apply(lambda mod: setattr(mod, "p", 0.0) if isinstance(mod, torch.nn.Dropout) else None)
        scores[kernel] = m(batch)
        scores[kernel].sum().backward()
        grads[kernel] = m.bert.encoder.layer[0].attention.self.key.weight.grad
    chosen = {kernel: QDSTransformer(tiny(attention_kernel=kernel))._attention(batch).func
              for kernel in ("sparse", "fused-mask", "auto")}
    # on a CPU, auto trains with the sparse kernel where attention probabilities are dropped (the encoder's
    # own attention dropout here), and takes the fused one for short inputs without attention dropout
    assert chosen == {"sparse": qds_attention, "fused-mask": fused_masked_attention, "auto": qds_attention}
    assert QDSTransformer(tiny(attention_dropout=0.0)).train()._attention(batch).func is fused_masked_attention
    with torch.no_grad():
        assert QDSTransformer(tiny()).eval()._attention(batch).func is fused_masked_attention
    auto = {(device, half, drops, n): resolve_attention_kernel("auto", device, half, drops, n)
            for device in ("cuda", "cpu") for half in (True, False) for drops in (True, False) for n in (512, 513)}
    assert {key for key, kernel in auto.items() if kernel == "fused-mask"} == {
        ("cuda", True, drops, n) for drops in (True, False) for n in (512, 513)} | {
        ("cpu", half, False, 512) for half in (True, False)}
    assert resolve_attention_kernel("fused-mask", "cpu", False, True, 4096) == "fused-mask"
    assert torch.isfinite(scores["fused-mask"]).all()
    torch.testing.assert_close(scores["fused-mask"], scores["sparse"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads["fused-mask"], grads["sparse"], atol=1e-5, rtol=1e-4)
    with pytest.raises(ConfigError, match="attention_kernel"):
        tiny(attention_kernel="flash")


def test_bf16_autocast_runs_and_stays_close(model: QDSTransformer):
    """The mixed-precision path GPUs use (here CPU autocast): same scores up to bf16 rounding."""
    batch = model.build_batch(QUERIES, DOCS)
    with torch.no_grad():
        exact = model(batch)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            mixed = model(batch)
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed.float(), exact, atol=5e-2, rtol=5e-2)


# ---------------------------------------------------------------------------------------------
# The real pretrained encoder
# ---------------------------------------------------------------------------------------------

def test_pretrained_minilm_with_full_window_matches_the_encoder(minilm_path):
    from transformers import AutoModel

    m = QDSTransformer(QDSConfig(max_length=1024, window=4096)).eval()
    assert m.config.pretrained is False and m.config.bert_config["max_position_embeddings"] == 1024
    table = m.bert.embeddings.position_embeddings.weight
    torch.testing.assert_close(table[512:1024], table[:512])
    ref_model = AutoModel.from_pretrained(minilm_path).eval()
    batch = m.build_batch(QUERIES, DOCS)
    with torch.no_grad():
        ref = ref_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"].long(),
                        token_type_ids=batch["token_type_ids"]).last_hidden_state
        ours = m.encode(batch)
    valid = batch["attention_mask"]
    torch.testing.assert_close(ours[valid], ref[valid], atol=1e-4, rtol=1e-4)


def test_score_head_learns_faster_than_the_encoder_and_every_parameter_is_trained_once():
    task = QDSTask(model_config=tiny(), head_lr_multiplier=50.0)
    m = task.build_model()
    groups = task.param_groups(m, lr=2e-5, weight_decay=0.01)
    grouped = [id(p) for g in groups for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in m.parameters() if p.requires_grad)
    head = {id(p) for p in m.score.parameters()}
    for g in groups:
        is_head = {id(p) in head for p in g["params"]}
        assert len(is_head) == 1, "a group mixes head and encoder parameters"
        assert g.get("lr") == (pytest.approx(1e-3) if is_head == {True} else None), g.keys()


# ---------------------------------------------------------------------------------------------
# Warm start: the score head fitted to training triples (an initialisation, not a new score)
# ---------------------------------------------------------------------------------------------

WARM_TRIPLES = {"query": QUERIES + QUERIES[::-1], "pos_text": DOCS + DOCS[::-1],
                "neg_text": [long_doc(30), "unrelated text about trains. and boats.", DOCS[0], DOCS[1]]}


def test_warm_start_head_orders_the_triples_it_is_fitted_to(tmp_path):
    torch.manual_seed(0)
    task = QDSTask(model_config=tiny(head_init="warm"), warm_triples=WARM_TRIPLES)
    m = task.build_model()
    q, pos, neg = (WARM_TRIPLES[c] for c in ("query", "pos_text", "neg_text"))
    s_pos, s_neg = m.score_texts(q, pos), m.score_texts(q, neg)
    assert torch.all(s_pos > s_neg), (s_pos, s_neg)
    assert float(m.score.bias.detach()) == 0.0
    cls = m.cls_vectors(q, pos)
    torch.testing.assert_close(m.score(cls).squeeze(-1), s_pos, atol=1e-5, rtol=1e-5)  # still w · h_[CLS] + b
    save_model(m, tmp_path / "qds")
    loaded = load_model(tmp_path / "qds")
    assert loaded.config.head_init == "warm"
    torch.testing.assert_close(loaded.score_texts(q, pos), s_pos, atol=0, rtol=0)


def test_warm_start_needs_triples_and_a_known_head_init():
    with pytest.raises(ConfigError, match="head_init"):
        tiny(head_init="lexical")
    with pytest.raises(ConfigError, match="warm_triples"):
        QDSTask(model_config=tiny(head_init="warm")).build_model()
    torch.manual_seed(0)
    m = QDSTransformer(tiny())
    with pytest.raises(ValueError, match="aligned, non-empty"):
        m.warm_start_head(QUERIES, DOCS, DOCS[:1])


def _similarity_by_hand(head: str, query_vectors: torch.Tensor, doc_vectors: torch.Tensor) -> torch.Tensor:
    """The similarity term of a head, from the query's and the document's final vectors [m, h], [k, h]."""
    if head == "pooled":                                         # cos(q̄, d̄)
        return torch.nn.functional.cosine_similarity(query_vectors.mean(0), doc_vectors.mean(0), dim=0)
    unit_q = torch.nn.functional.normalize(query_vectors, dim=-1)   # (1/m) Σ_i max_j cos(q_i, d_j)
    unit_d = torch.nn.functional.normalize(doc_vectors, dim=-1)
    return (unit_q @ unit_d.T).max(dim=1).values.mean()


@pytest.mark.parametrize("head", ["pooled", "maxsim"])
def test_similarity_heads_start_as_their_scaled_similarity_of_query_and_document_vectors(tmp_path, head):
    """head="pooled" / "maxsim", warm: w = 0, b = 0, γ = 20, so the step-0 score is 20 · cos(q̄, d̄) /
    20 · ColBERT's MaxSim of the joint encoding, computed here by hand from the token positions (the
    batch holds queries of different lengths, so padding rows are tested too); no training triple is
    needed; the checkpoint keeps the head."""
    from ckray.rankers.qds.model import POOLED_SCALE

    torch.manual_seed(0)
    task = QDSTask(model_config=tiny(head=head, head_init="warm"))
    assert not task.needs_warm_triples
    m = task.build_model().eval()
    assert float(m.similarity_scale) == POOLED_SCALE and torch.all(m.score.weight == 0)
    batch = m.build_batch(QUERIES, DOCS)
    with torch.no_grad():
        hidden = m.encode(batch)
        scores = m(batch)
    q_lens = [len(m.tokenizer(query, add_special_tokens=False)["input_ids"]) for query in QUERIES]
    assert len(set(q_lens)) > 1
    for i, q_len in enumerate(q_lens):
        ids = batch["input_ids"][i]
        n = int(batch["attention_mask"][i].sum())
        doc_positions = [j for j in range(q_len + 2, n) if int(ids[j]) != m.tokenizer.convert_tokens_to_ids("[unused1]")]
        expected = POOLED_SCALE * _similarity_by_hand(head, hidden[i, 1: q_len + 1], hidden[i, doc_positions])
        torch.testing.assert_close(scores[i], expected, atol=1e-5, rtol=1e-5)
    save_model(m, tmp_path / "qds")
    loaded = load_model(tmp_path / "qds")
    assert loaded.config.head == head
    torch.testing.assert_close(loaded.score_texts(QUERIES, DOCS), m.score_texts(QUERIES, DOCS), atol=0, rtol=0)


@pytest.mark.parametrize("head", ["pooled", "maxsim"])
def test_similarity_head_from_random_is_the_papers_cls_head_and_trains_its_scale(head):
    """head_init="random": γ starts at 0, so the score is the paper's w · h_[CLS] + b of the same
    weights; γ is a head parameter (the head's learning rate) and gets a gradient."""
    torch.manual_seed(0)
    cls_model = QDSTransformer(tiny()).eval()
    similarity_model = QDSTransformer(tiny(head=head))
    state = cls_model.state_dict()
    similarity_model.load_state_dict({**state, "similarity_scale": torch.zeros(1)})
    similarity_model.eval()
    batch = cls_model.build_batch(QUERIES, DOCS)
    torch.testing.assert_close(similarity_model(batch), cls_model(batch), atol=1e-6, rtol=1e-6)
    task = QDSTask(model_config=tiny(head=head), head_lr_multiplier=10.0)
    groups = task.param_groups(similarity_model, lr=1e-4, weight_decay=0.01)
    head_group = [g for g in groups if g.get("lr") == 1e-3]
    assert any(p is similarity_model.similarity_scale for g in head_group for p in g["params"])
    similarity_model(batch).sum().backward()
    assert similarity_model.similarity_scale.grad is not None and float(similarity_model.similarity_scale.grad) != 0.0
    with pytest.raises(ConfigError, match="head must be one of"):
        tiny(head="mean")


def test_pairwise_probe_recovers_a_separating_direction():
    from ckray.models.losses import pairwise_probe

    g = torch.Generator().manual_seed(0)
    direction = torch.randn(16, generator=g)
    neg = torch.randn(64, 16, generator=g)
    pos = neg + 0.5 * direction + 0.1 * torch.randn(64, 16, generator=g)
    w = pairwise_probe(pos, neg)
    assert torch.all((pos - neg) @ w > 0)
    assert torch.nn.functional.cosine_similarity(w, direction, dim=0) > 0.9
    torch.testing.assert_close(pairwise_probe(10 * pos, 10 * neg), w / 10)  # scale-free ridge


# ---------------------------------------------------------------------------------------------
# Frozen bottom layers: a cheaper training step, the same forward pass
# ---------------------------------------------------------------------------------------------

def test_frozen_layers_are_not_trained_and_the_rest_gets_the_same_gradients(model: QDSTransformer):
    """``frozen_layers=2`` (embeddings + layer 0): no gradient and no optimizer group for them; the
    scores and the gradients of the layers above are those of the fully trained model."""
    batch = model.build_batch(QUERIES, DOCS)
    models = {}
    for n in (0, 2):
        m = QDSTransformer(tiny(frozen_layers=n))
        m.load_state_dict(model.state_dict())
        m.eval()                                              # no dropout: comparable gradients
        m(batch).sum().backward()
        models[n] = m
    full, frozen = models[0], models[2]
    torch.testing.assert_close(frozen(batch), full(batch), atol=0, rtol=0)
    assert all(p.grad is None for p in frozen.bert.embeddings.parameters())
    assert all(p.grad is None for p in frozen.bert.encoder.layer[0].parameters())
    top = ("bert.encoder.layer.1.", "score.")
    for (name, p), q in zip(frozen.named_parameters(), full.parameters()):
        if name.startswith(top):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)
    groups = QDSTask(model_config=tiny(frozen_layers=2)).param_groups(frozen, lr=2e-5, weight_decay=0.01)
    grouped = {id(p) for g in groups for p in g["params"]}
    assert grouped == {id(p) for n, p in frozen.named_parameters() if n.startswith(top)}


def test_frozen_layers_beyond_the_encoder_or_negative_are_refused():
    with pytest.raises(ValueError, match="frozen_layers=4: the encoder has 3 layers"):
        QDSTransformer(tiny(frozen_layers=4))
    with pytest.raises(ConfigError, match="frozen_layers"):
        tiny(frozen_layers=-1)


def test_attention_dropout_is_set_on_every_encoder_layer():
    for attention_dropout, expected in ((None, TINY_BERT["attention_probs_dropout_prob"]), (0.0, 0.0), (0.2, 0.2)):
        model = QDSTransformer(tiny(attention_dropout=attention_dropout))
        assert {layer.attention.self.dropout.p for layer in model.bert.encoder.layer} == {expected}
    with pytest.raises(ConfigError, match="attention_dropout must be in \\[0, 1\\), got 1.5"):
        tiny(attention_dropout=1.5)


def test_idf_query_weights_weight_each_query_piece_by_its_collection_idf_and_the_checkpoint_keeps_them(tmp_path):
    """query_weights="idf": the MaxSim head is Σ_i idf(q_i) · max_j cos(h_qi, h_dj) / Σ_i idf(q_i), computed
    here by hand with BM25's IDF of a small collection; the training task sets the IDF from its
    collection_statistics (an error without them) and the checkpoint keeps it."""
    from ckray.data.statistics import bm25_idf, corpus_statistics
    from ckray.rankers.qds.model import POOLED_SCALE

    collection = DOCS + ["vitamin d was measured in every adult", "the mice were fed a control diet"]
    config = tiny(head="maxsim", head_init="warm", query_weights="idf")
    stats = corpus_statistics(collection, QDSTransformer(config).collection_tokenisation)
    with pytest.raises(ConfigError, match="no collection_statistics"):
        QDSTask(model_config=config).build_model()
    torch.manual_seed(0)
    m = QDSTask(model_config=config, collection_statistics=stats).build_model().eval()
    torch.testing.assert_close(m.piece_idf, bm25_idf(stats.doc_freq, stats.n_docs))
    batch = m.build_batch(QUERIES, DOCS)
    with torch.no_grad():
        hidden = m.encode(batch)
        scores = m(batch)
    uniform = QDSTransformer(tiny(head="maxsim", head_init="warm")).eval()
    uniform.load_state_dict({k: v for k, v in m.state_dict().items() if k != "piece_idf"})
    with torch.no_grad():
        assert not torch.allclose(uniform(batch), scores, atol=1e-3)   # the weights change the score
    for i, query in enumerate(QUERIES):
        q_ids = m.tokenizer(query, add_special_tokens=False)["input_ids"]
        ids, n = batch["input_ids"][i], int(batch["attention_mask"][i].sum())
        doc_positions = [j for j in range(len(q_ids) + 2, n) if int(ids[j]) != m.tokenizer.convert_tokens_to_ids("[unused1]")]
        unit_q = torch.nn.functional.normalize(hidden[i, 1: len(q_ids) + 1], dim=-1)
        unit_d = torch.nn.functional.normalize(hidden[i, doc_positions], dim=-1)
        idf = m.piece_idf[torch.tensor(q_ids)]
        expected = POOLED_SCALE * (idf * (unit_q @ unit_d.T).max(dim=1).values).sum() / idf.sum()
        torch.testing.assert_close(scores[i], expected, atol=1e-5, rtol=1e-5)
    save_model(m, tmp_path / "qds")
    loaded = load_model(tmp_path / "qds")
    assert loaded.config.query_weights == "idf" and torch.equal(loaded.piece_idf, m.piece_idf)


def test_idf_query_weights_need_the_maxsim_head_and_statistics_of_the_models_vocabulary():
    with pytest.raises(ConfigError, match="'idf' needs head='maxsim'"):
        tiny(head="cls", query_weights="idf")
    with pytest.raises(ConfigError, match="query_weights must be one of"):
        tiny(head="maxsim", query_weights="bm25")
    from ckray.data.statistics import CorpusStats

    m = QDSTransformer(tiny(head="maxsim", query_weights="idf"))
    with pytest.raises(ConfigError, match=r"statistics of 100 word pieces do not fit .* vocabulary of 30522"):
        m.set_collection_statistics(CorpusStats(torch.ones(100, dtype=torch.long), 10, 5.0))
    with pytest.raises(ConfigError, match="reads no collection statistics"):
        QDSTransformer(tiny(head="maxsim")).set_collection_statistics(CorpusStats(torch.ones(30522), 10, 5.0))
