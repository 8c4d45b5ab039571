"""CEDR (MacAvaney et al., SIGIR 2019): similarity tensor, padding, segments, variants, checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ckray.errors import ConfigError
from ckray.rankers.cedr.model import VARIANTS, CEDRConfig, CEDRRanker, matching_histogram, pairwise_loss
from ckray.models.checkpoint import load_model, save_model

TINY = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=64)
QUERIES = ["does vitamin d deficiency cause bone fractures", "gene expression in tumour cells"]
DOCS = [
    "vitamin d deficiency weakens bones and raises the risk of fractures in older adults " * 3,
    "tumour cells show altered gene expression",
]


def tiny(variant: str = "knrm", seed: int = 0, **kw) -> CEDRRanker:
    torch.manual_seed(seed)
    cfg = dict(variant=variant, random_init=TINY, max_length=32, max_query_len=8, max_segments=4)
    cfg.update(kw)
    return CEDRRanker(CEDRConfig(**cfg)).eval()


@pytest.fixture(autouse=True)
def _tokenizer(minilm_path):
    """Every model here uses the MiniLM WordPiece tokenizer (the tiny encoders are random)."""


def _expected_segments(model: CEDRRanker, query: str, doc: str) -> tuple[list[int], list[list[int]]]:
    """The split the paper prescribes, recomputed independently: equal segments that fit with the query."""
    tok, cfg = model.tokenizer, model.config
    q = tok(query, add_special_tokens=False)["input_ids"][: cfg.max_query_len]
    d = tok(doc, add_special_tokens=False)["input_ids"]
    cap = cfg.max_length - len(q) - 3
    d = d[: cfg.max_segments * cap]
    n = max(1, math.ceil(len(d) / cap))
    size = math.ceil(len(d) / n)
    return q, [d[i * size:(i + 1) * size] for i in range(n)]


def test_similarity_tensor_is_per_layer_cosine_over_concatenated_segments():
    model = tiny()
    batch = model.tokenize_pairs(QUERIES, DOCS)
    with torch.no_grad():
        enc = model.encode(batch)
    n_layers = model.encoder.config.num_hidden_layers + 1
    longest_query = int(batch["query_len"].max())
    assert enc.sim.shape[:3] == (2, n_layers, longest_query)
    tok = model.tokenizer
    for b, (query, doc) in enumerate(zip(QUERIES, DOCS)):
        q, segs = _expected_segments(model, query, doc)
        if b == 0:
            assert len(segs) == 3  # the long document really spans several segments
        blocks = []
        for seg in segs:  # each segment encoded alone, unpadded
            ids = torch.tensor([[tok.cls_token_id, *q, tok.sep_token_id, *seg, tok.sep_token_id]])
            types = torch.tensor([[0] * (len(q) + 2) + [1] * (len(seg) + 1)])
            with torch.no_grad():
                hs = model.encoder(input_ids=ids, token_type_ids=types, output_hidden_states=True).hidden_states
            qv = torch.stack([h[0, 1:1 + len(q)] for h in hs])                    # [L+1, m, H]
            dv = torch.stack([h[0, len(q) + 2:len(q) + 2 + len(seg)] for h in hs])  # [L+1, n, H]
            blocks.append(F.cosine_similarity(qv[:, :, None, :], dv[:, None, :, :], dim=-1))
        direct = torch.cat(blocks, dim=-1)                                         # [L+1, m, Σn]
        n_doc = direct.shape[-1]
        got = enc.sim[b]
        torch.testing.assert_close(got[:, : len(q), :n_doc], direct, atol=1e-5, rtol=1e-4)
        assert torch.all(got[:, len(q):, :] == 0) and torch.all(got[:, :, n_doc:] == 0)
        assert int(enc.doc_mask[b].sum()) == n_doc and int(enc.query_mask[b].sum()) == len(q)


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_contributes_nothing(variant):
    """A pair scored alone equals the same pair scored beside a longer query and a longer document
    (more row padding, more document slots, more segments in the batch)."""
    model = tiny(variant)
    alone = model.score_texts([QUERIES[1]], [DOCS[1]])
    long_q = "a much longer query with many many words about many unrelated topics"
    padded = model.score_texts([QUERIES[1], long_q], [DOCS[1], DOCS[0] * 3])
    torch.testing.assert_close(padded[:1], alone, atol=1e-5, rtol=1e-5)
    batch = model.tokenize_pairs([QUERIES[1], long_q], [DOCS[1], DOCS[0] * 3])
    assert batch["doc_mask"].shape[1] > int(batch["doc_mask"][0].sum())  # there really was padding


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_document_scored_from_all_its_segments(variant):
    model = tiny(variant)
    q, segs = _expected_segments(model, QUERIES[0], DOCS[0])
    assert len(segs) == 3
    batch = model.tokenize_pairs([QUERIES[0]], [DOCS[0]])
    assert batch["input_ids"].shape[0] == 3 and batch["row_example"].tolist() == [0, 0, 0]
    base = model.score_texts([QUERIES[0]], [DOCS[0]])
    # replace the final words (they land in the last segment) by different ones
    words = DOCS[0].split()
    changed = " ".join(words[:-3] + ["zebra", "orchestra", "volcano"])
    assert _expected_segments(model, QUERIES[0], changed)[1][:2] == segs[:2]  # first segments identical
    assert not torch.allclose(model.score_texts([QUERIES[0]], [changed]), base, atol=1e-6)


def test_token_similarities_of_the_last_segment_reach_the_knrm_features():
    """Beyond the averaged [CLS]: the kernel features see the last segment's tokens."""
    model = tiny("knrm")
    words = DOCS[0].split()
    changed = " ".join(words[:-3] + ["zebra", "orchestra", "volcano"])
    with torch.no_grad():
        e0 = model.encode(model.tokenize_pairs([QUERIES[0]], [DOCS[0]]))
        e1 = model.encode(model.tokenize_pairs([QUERIES[0]], [changed]))
        zero_cls = torch.zeros_like(e0.cls)
        assert not torch.allclose(model._knrm(e0, zero_cls), model._knrm(e1, zero_cls), atol=1e-6)


def test_documents_are_truncated_to_max_segments():
    model = tiny(max_segments=2)
    batch = model.tokenize_pairs([QUERIES[0]], [DOCS[0] * 4])
    q, _ = _expected_segments(model, QUERIES[0], DOCS[0])
    assert batch["input_ids"].shape[0] == 2
    assert int(batch["doc_mask"].sum()) == 2 * (32 - len(q) - 3)
    assert batch["attention_mask"].sum(1).max() <= 32


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_trains_forward_and_backward(variant):
    model = tiny(variant).train()
    rows = {"query": np.array(QUERIES), "pos_text": np.array(DOCS), "neg_text": np.array(DOCS[::-1])}
    batch = model.collate_pairs(rows)
    assert batch["query_len"].shape[0] == 4
    loss = model.pairwise_loss(batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    enc_grad = model.encoder.encoder.layer[-1].output.dense.weight.grad
    head = [p for n, p in model.named_parameters() if not n.startswith("encoder.")]
    assert enc_grad is not None and enc_grad.abs().sum() > 0
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head)
    assert sum(float(p.grad.abs().sum()) for p in head) > 0


def test_pairwise_losses():
    pos, neg = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.5])
    expected = (-torch.log_softmax(torch.stack([pos, neg], 1), dim=1)[:, 0]).mean()
    torch.testing.assert_close(pairwise_loss(pos, neg, "softmax"), expected)
    torch.testing.assert_close(pairwise_loss(pos, neg, "hinge", margin=1.0), torch.tensor((0.0 + 1.5) / 2))


def test_matching_histogram_counts_real_document_tokens():
    sim = torch.tensor([[[[1.0, 0.95, -1.0, 0.05, 0.0]]]])       # [B=1, L=1, Q=1, D=5]
    mask = torch.tensor([[True, True, True, True, False]])        # last slot is padding
    h = matching_histogram(sim, mask, bins=4)                      # bins [-1,-.5) [-.5,0) [0,.5) [.5,1]
    assert h.tolist() == [[[[1.0, 0.0, 1.0, 2.0]]]]


def test_training_steps_lower_the_pairwise_loss():
    model = tiny("knrm").train()
    model.cls_dropout.p = 0.0
    rows = {"query": np.array(QUERIES), "pos_text": np.array(DOCS), "neg_text": np.array(DOCS[::-1])}
    batch = model.collate_pairs(rows)
    opt = torch.optim.AdamW(model.param_groups(encoder_lr=1e-3, head_lr=1e-2))
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = model.pairwise_loss(batch)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] * 0.5


@pytest.mark.parametrize("variant", VARIANTS)
def test_checkpoint_round_trip_gives_identical_scores(variant, tmp_path):
    model = tiny(variant, seed=3)
    with torch.no_grad():  # make the head non-trivial
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_model(model, tmp_path / "cedr")
    loaded = load_model(tmp_path / "cedr")
    assert isinstance(loaded, CEDRRanker) and loaded.config == model.config
    torch.testing.assert_close(loaded.score_texts(QUERIES, DOCS), model.score_texts(QUERIES, DOCS),
                               atol=0, rtol=0)


def test_layer_truncation_uses_fewer_layers_tiny():
    model = tiny("pacrr", num_layers=1)
    assert len(model.encoder.encoder.layer) == 1 and model.n_channels == 2
    with torch.no_grad():
        enc = model.encode(model.tokenize_pairs(QUERIES, DOCS))
    assert enc.sim.shape[1] == 2
    assert torch.isfinite(model.score_texts(QUERIES, DOCS)).all()


def test_layer_truncation_of_pretrained_minilm_keeps_its_first_layers():
    """MiniLM cut to 3 of its 6 layers: 4 channels, identical to the full model's first 4."""
    full = CEDRRanker(CEDRConfig(variant="knrm", max_query_len=16)).eval()
    half = CEDRRanker(CEDRConfig(variant="knrm", max_query_len=16, num_layers=3)).eval()
    assert len(full.encoder.encoder.layer) == 6 and len(half.encoder.encoder.layer) == 3
    assert full.encoder.config.hidden_size == 384
    batch = full.tokenize_pairs(QUERIES, DOCS)
    with torch.no_grad():
        s_full, s_half = full.encode(batch).sim, half.encode(batch).sim
    assert s_full.shape[1] == 7 and s_half.shape[1] == 4
    torch.testing.assert_close(s_half, s_full[:, :4], atol=1e-5, rtol=1e-4)
    # pretrained contextual similarities: a query token matches itself in the document closely
    assert float(s_full[0, -1].max()) > 0.5


def test_cedr_task_plugs_into_the_shared_loop_interface():
    pytest.importorskip("ckray.training")
    import pickle

    from ckray.rankers.cedr.task import CEDRTask
    from ckray.training import RankerTask

    cfg = CEDRConfig(variant="drmm", random_init=TINY, max_length=32, max_query_len=8)
    task = pickle.loads(pickle.dumps(CEDRTask(cfg)))  # sent to every Ray Train worker
    assert isinstance(task, RankerTask) and task.name == "cedr-drmm"
    torch.manual_seed(0)
    model = task.build_model().eval()
    rows = {"query": np.array(QUERIES), "pos_text": np.array(DOCS), "neg_text": np.array(DOCS[::-1])}
    batch = task.collate(rows)
    assert all(isinstance(v, torch.Tensor) for v in batch.values())
    torch.testing.assert_close(task.loss(model, batch), model.pairwise_loss(model.collate_pairs(rows)))
    scores = task.score(model, QUERIES, DOCS, [1.0, 2.0])
    assert scores.shape == (2,)
    torch.testing.assert_close(scores, model.score_texts(QUERIES, DOCS))


# ---------------------------------------------------------------------------------------------- warm start

WARM_QUERY = "does vitamin d deficiency cause bone fractures"
WARM_DOCS = ["low vitamin d levels and deficiency raise the risk of bone fractures in older adults",
             "vitamin c supplements shorten the common cold",
             "the orchestra played a symphony in the old concert hall"]


@pytest.mark.parametrize("layers", ["last", "all"])
def test_warm_knrm_head_is_the_sum_of_near_exact_kernel_features(layers):
    """The warm KNRM head scores Σ_q log soft-TF of near-exact kernels, recomputed here from S with
    K-NRM's formula: the last layer's μ = 0.9 kernel × 2 (``knrm_warm_layers="last"``, the default), or
    Σ_layers of the μ = 0.9 and μ = 0.7 kernels / (L+1) (``"all"``); [CLS] and every other kernel weigh 0."""
    model = tiny("knrm", head_init="warm", knrm_warm_layers=layers)
    w = model.knrm_out.weight[0]
    n_feat = model.n_channels * model.config.n_kernels
    assert torch.all(w[n_feat:] == 0) and float(model.knrm_out.bias.detach()) == 0.0
    per_layer = w[:n_feat].view(model.n_channels, -1)
    if layers == "last":
        expected_weights = torch.zeros_like(per_layer)
        expected_weights[-1, 1] = 2.0                                                # last layer, μ = 0.9
        mus, read, weight = [0.9], slice(-1, None), 2.0
    else:
        expected_weights = torch.zeros_like(per_layer)
        expected_weights[:, 1:3] = 1.0 / model.n_channels                           # μ = 0.9, 0.7
        mus, read, weight = [0.9, 0.7], slice(None), 1.0 / model.n_channels
    assert torch.equal(per_layer, expected_weights)
    with torch.no_grad():
        e = model.encode(model.tokenize_pairs(QUERIES, DOCS))
        k = torch.exp(-(e.sim[:, read, ..., None] - torch.tensor(mus)) ** 2 / (2 * 0.1 ** 2))
        k = k * e.doc_mask[:, None, None, :, None]
        tf = torch.log(k.sum(dim=3).clamp(min=1e-10)) * e.query_mask[:, None, :, None]   # [B, layers, Q, kernels]
        expected = tf.sum(dim=(1, 2, 3)) * model.config.knrm_feature_scale * weight
        torch.testing.assert_close(model.score_encoding(e), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="^CEDRConfig.knrm_warm_layers must be one of"):
        CEDRConfig(knrm_warm_layers="first")


@pytest.mark.parametrize("variant", ["knrm", "pacrr", "drmm"])
def test_warm_heads_rank_by_lexical_match_at_step_0(variant):
    """MiniLM (2 layers) with a warm head: more matched query terms, higher score; with the paper's
    random head the same model gives other scores (the warm start is an initialisation of the head only)."""
    torch.manual_seed(0)
    warm = CEDRRanker(CEDRConfig(variant=variant, num_layers=2, max_length=64, head_init="warm")).eval()
    scores = warm.score_texts([WARM_QUERY] * 3, WARM_DOCS)
    assert scores[0] > scores[1] > scores[2], scores
    torch.manual_seed(0)
    random = CEDRRanker(CEDRConfig(variant=variant, num_layers=2, max_length=64)).eval()
    torch.testing.assert_close(dict(random.encoder.named_parameters())["embeddings.word_embeddings.weight"],
                               dict(warm.encoder.named_parameters())["embeddings.word_embeddings.weight"])
    assert not torch.allclose(random.score_texts([WARM_QUERY] * 3, WARM_DOCS), scores)


@pytest.mark.parametrize("variant", ["pacrr", "drmm"])
def test_warm_heads_keep_every_parameter_trainable(variant):
    """Warm PACRR/DRMM: every head parameter gets a gradient from the first training batch."""
    model = tiny(variant, head_init="warm").train()
    rows = {"query": np.array(QUERIES), "pos_text": np.array(DOCS), "neg_text": np.array(DOCS[::-1])}
    model.pairwise_loss(model.collate_pairs(rows)).backward()
    for name, p in model.named_parameters():
        if not name.startswith("encoder."):
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
    head = [p for n, p in model.named_parameters() if not n.startswith("encoder.")]
    assert sum(float(p.grad.abs().sum()) for p in head) > 0


def test_vanilla_warm_start_fits_the_cls_head_to_training_pairs(tmp_path):
    model = tiny("vanilla", head_init="warm")
    queries = QUERIES + QUERIES[::-1]
    pos, neg = DOCS + DOCS[::-1], DOCS[::-1] + DOCS
    before = model.vanilla_out.weight.clone()
    model.warm_start_head(queries, pos, neg, batch_size=3)
    assert not torch.equal(model.vanilla_out.weight, before) and float(model.vanilla_out.bias.detach()) == 0.0
    s_pos, s_neg = model.score_texts(queries[:2], pos[:2]), model.score_texts(queries[:2], neg[:2])
    assert torch.all(s_pos > s_neg)  # 2 distinct pairs, 32 dimensions: the probe orders both
    save_model(model, tmp_path / "v")
    loaded = load_model(tmp_path / "v")
    assert loaded.config.head_init == "warm"
    torch.testing.assert_close(loaded.score_texts(QUERIES, DOCS), model.score_texts(QUERIES, DOCS), atol=0, rtol=0)
    with pytest.raises(ValueError, match="starts warm in __init__"):
        tiny("knrm", head_init="warm").warm_start_head(queries, pos, neg)


def test_probe_knrm_head_is_the_pairwise_probe_of_the_kernel_features(tmp_path):
    """``knrm_warm_layers="probe"``: before fitting, the last layer's head; ``warm_start_head`` sets the
    (L+1)·K kernel weights to the pairwise probe of the kernel features of the (query, d+) and (query, d−)
    pairs (recomputed here), [CLS] weights and bias 0, so the head orders the pairs it was fitted to;
    the fitted head is saved and loaded with the model."""
    from ckray.models.losses import pairwise_probe

    model = tiny("knrm", head_init="warm", knrm_warm_layers="probe")
    last = tiny("knrm", head_init="warm", knrm_warm_layers="last")
    assert torch.equal(model.knrm_out.weight, last.knrm_out.weight)
    queries = QUERIES + QUERIES[::-1]
    pos, neg = DOCS + DOCS[::-1], DOCS[::-1] + DOCS
    model.warm_start_head(queries, pos, neg, batch_size=3)
    n_feat = model.n_channels * model.config.n_kernels
    w = model.knrm_out.weight[0]
    assert torch.all(w[n_feat:] == 0) and float(model.knrm_out.bias.detach()) == 0.0
    with torch.no_grad():
        phi_pos = model.knrm_features(model.encode(model.tokenize_pairs(queries, pos)))
        phi_neg = model.knrm_features(model.encode(model.tokenize_pairs(queries, neg)))
    torch.testing.assert_close(w[:n_feat], pairwise_probe(phi_pos, phi_neg), atol=1e-5, rtol=1e-4)
    assert not torch.allclose(w[:n_feat], last.knrm_out.weight[0, :n_feat])
    assert torch.all(model.score_texts(queries, pos) > model.score_texts(queries, neg))
    save_model(model, tmp_path / "k")
    torch.testing.assert_close(load_model(tmp_path / "k").score_texts(QUERIES, DOCS),
                               model.score_texts(QUERIES, DOCS), atol=0, rtol=0)
    with pytest.raises(ValueError, match="aligned, non-empty triples"):
        model.warm_start_head(queries, pos, neg[:1])


def test_head_init_is_checked_and_the_vanilla_task_needs_warm_triples():
    from ckray.rankers.cedr.task import CEDRTask

    with pytest.raises(ConfigError, match="^CEDRConfig.head_init must be one of"):
        CEDRConfig(head_init="lexical")
    cfg = CEDRConfig(variant="vanilla", random_init=TINY, max_length=32, max_query_len=8, head_init="warm")
    with pytest.raises(ConfigError, match="warm_triples"):
        CEDRTask(cfg).build_model()
    triples = {"query": QUERIES, "pos_text": DOCS, "neg_text": DOCS[::-1]}
    model = CEDRTask(cfg, warm_triples=triples).build_model().eval()
    assert torch.all(model.score_texts(QUERIES, DOCS) > model.score_texts(QUERIES, DOCS[::-1]))
    assert not CEDRTask(CEDRConfig(variant="knrm", random_init=TINY, max_length=32, max_query_len=8,
                                   head_init="warm")).needs_warm_triples
    knrm = dict(variant="knrm", random_init=TINY, max_length=32, max_query_len=8, knrm_warm_layers="probe")
    assert CEDRTask(CEDRConfig(**knrm, head_init="warm")).needs_warm_triples
    assert not CEDRTask(CEDRConfig(**knrm, head_init="random")).needs_warm_triples
    assert [CEDRConfig(**c).warm_probe_triples for c in (cfg.__dict__, {**knrm, "head_init": "warm"},
                                                         {**knrm, "head_init": "random"})] == [32, 256, 0]
    with pytest.raises(ConfigError, match="warm_triples"):
        CEDRTask(CEDRConfig(**knrm, head_init="warm")).build_model()


def test_frozen_layers_leave_the_scores_and_drop_the_encoders_bottom_from_the_optimizer():
    """``frozen_layers=1``: the embeddings get no gradient and no optimizer group; the similarity
    tensor of every layer (embedding layer included) still reaches the head, so scores are unchanged."""
    full, frozen = tiny("knrm", head_init="warm"), tiny("knrm", head_init="warm", frozen_layers=1)
    frozen.load_state_dict(full.state_dict())
    batch = full.tokenize_pairs(QUERIES, DOCS)
    torch.testing.assert_close(frozen(batch), full(batch), atol=0, rtol=0)
    frozen(batch).sum().backward()
    assert all(p.grad is None for p in frozen.encoder.embeddings.parameters())
    assert frozen.encoder.encoder.layer[0].attention.self.query.weight.grad is not None
    grouped = {id(p) for g in frozen.param_groups() for p in g["params"]}
    assert grouped == {id(p) for n, p in frozen.named_parameters() if not n.startswith("encoder.embeddings.")}
    with pytest.raises(ConfigError, match="^CEDRConfig.frozen_layers must be >= 0, got -1$"):
        CEDRConfig(frozen_layers=-1)


def test_attention_dropout_sets_every_layers_attention_dropout_and_only_that():
    """attention_dropout=0 removes the encoder's attention-probability dropout in training (a
    training-mode forward then equals eval mode when the other dropouts are 0 too); None keeps the
    encoder's own; a value outside [0, 1) is refused."""
    noisy = dict(TINY, attention_probs_dropout_prob=0.5, hidden_dropout_prob=0.0)
    batch = tiny().tokenize_pairs(QUERIES, DOCS)
    for attention_dropout, deterministic in ((None, False), (0.0, True)):
        model = tiny(random_init=noisy, dropout=0.0, attention_dropout=attention_dropout)
        assert {layer.attention.self.dropout.p for layer in model.encoder.encoder.layer} == {
            0.5 if attention_dropout is None else 0.0}
        with torch.no_grad():
            expected = model.eval()(batch)
            model.train()
            torch.manual_seed(1)
            trained = model(batch)
        assert torch.allclose(trained, expected, atol=1e-5) == deterministic
    with pytest.raises(ConfigError, match="attention_dropout"):
        tiny(attention_dropout=1.0)
    with pytest.raises(ConfigError, match="^CEDRConfig.attention_dropout must be in \\[0, 1\\), got -0.1$"):
        CEDRConfig(variant="knrm", attention_dropout=-0.1)   # refused with the config, before any model is built
