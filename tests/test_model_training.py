"""Each model's RankerTask on the shared loop: 2 CPU workers, DeepSpeed ZeRO-2, a small SciFact sample.

The same 32 training triples are seen repeatedly, so a model that learns must lower its loss;
the consolidated checkpoint must load and score.
"""

import pytest

from ckray.data.collections import doc_text, load_collection
from ckray.data.examples import DevSet
from ckray.models.checkpoint import load_model
from ckray.training import TrainConfig, fit


@pytest.fixture(scope="module")
def scifact_sample(scifact_dir):
    """32 (query, relevant, non-relevant) triples from SciFact *training* queries, and a tiny dev set."""
    import pyarrow as pa

    c = load_collection(scifact_dir)
    ids = c.corpus.column("doc_id").to_pylist()
    text = {d: doc_text(t, x)[:1200] for d, t, x in zip(ids, c.corpus["title"].to_pylist(), c.corpus["text"].to_pylist())}
    qids = sorted(c.qrels["train"])[:40]
    rows = {k: [] for k in ("query_id", "query", "pos_id", "pos_text", "pos_bm25", "neg_id", "neg_text", "neg_bm25")}
    for i, q in enumerate(qids[:32]):
        pos = next(iter(c.qrels["train"][q]))
        neg = ids[(i * 37) % len(ids)]
        for k, v in zip(rows, (q, c.queries[q], pos, text[pos], 5.0, neg, text[neg], 1.0)):
            rows[k].append(v)
    dev_q = qids[32:40]
    cands = {q: [(next(iter(c.qrels["train"][q])), 1.0)] + [(ids[(j * 11) % len(ids)], 0.5) for j in range(4)] for q in dev_q}
    dev = DevSet(queries={q: c.queries[q] for q in dev_q}, candidates=cands,
                 doc_text={d: text[d] for v in cands.values() for d, _ in v}, qrels={q: c.qrels["train"][q] for q in dev_q})
    return pa.table(rows), dev


def _train(task, data, tmp_path, steps=24, lr=1e-3):
    triples, dev = data
    config = TrainConfig(workers=2, zero_stage=2, batch_size=4, max_steps=steps, eval_every=steps // 2, lr=lr,
                         output_dir=str(tmp_path / "out"), storage_dir=str(tmp_path / "runs"), log_every=4,
                         eval_at_start=False)
    result = fit(task, triples, dev, config)
    losses = [h["loss"] for h in result.history if "loss" in h]
    assert result.steps == steps
    assert losses[-1] < losses[0], f"loss did not fall: {losses}"
    model = load_model(result.best_checkpoint)
    scores = model.score_texts([dev.queries[q] for q in dev.queries], [next(iter(dev.doc_text.values()))] * len(dev.queries))
    assert scores.shape == (len(dev.queries),)
    return result


@pytest.mark.slow
def test_ck_qti_trains_with_deepspeed_zero2(ray_session, scifact_sample, tmp_path):
    from ckray.rankers.ck_qti.model import CKConfig
    from ckray.rankers.ck_qti.task import CKTask

    config = CKConfig(embedding_init="random", emb_dim=64, d_model=64, n_heads=4, n_layers=1, ff_dim=64,
                      max_doc_len=256, max_query_len=24)
    _train(CKTask(config=config, name="ck-test"), scifact_sample, tmp_path)


@pytest.mark.slow
def test_cedr_knrm_trains_with_deepspeed_zero2(ray_session, scifact_sample, tmp_path):
    from ckray.rankers.cedr.model import CEDRConfig
    from ckray.rankers.cedr.task import CEDRTask

    config = CEDRConfig(variant="knrm", max_length=128, max_segments=2,
                        random_init={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                     "intermediate_size": 64})
    _train(CEDRTask(model_config=config, name="cedr-test"), scifact_sample, tmp_path, lr=1e-3)


@pytest.mark.slow
def test_clear_trains_with_deepspeed_zero2(ray_session, scifact_sample, tmp_path):
    from ckray.rankers.clear.model import CLEARConfig, CLEARLossConfig
    from ckray.rankers.clear.task import CLEARTask

    bert = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 3,
            "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 512}
    config = CLEARConfig(pretrained=False, bert_config=bert, doc_max_len=128, query_max_len=32)
    task = CLEARTask(model_config=config, loss_config=CLEARLossConfig(xi=0.5, lambda_train=0.05), name="clear-test")
    _train(task, scifact_sample, tmp_path, lr=1e-3)


@pytest.mark.slow
def test_qds_trains_with_deepspeed_zero2(ray_session, scifact_sample, tmp_path):
    """The pooled head (w · h_[CLS] + b + γ · cos): both heads' parameters, γ included, go through
    DeepSpeed's broadcast and ZeRO-2 partitioning, and γ is trained."""
    from ckray.rankers.qds.model import POOLED_SCALE, QDSConfig
    from ckray.rankers.qds.task import QDSTask

    bert = {"model_type": "bert", "vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "intermediate_size": 64, "max_position_embeddings": 512}
    config = QDSConfig(pretrained=False, bert_config=bert, max_length=256, window=32, head="pooled", head_init="warm")
    result = _train(QDSTask(model_config=config, name="qds-test"), scifact_sample, tmp_path, lr=1e-3)
    assert float(load_model(result.best_checkpoint).similarity_scale) != POOLED_SCALE
