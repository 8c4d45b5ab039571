"""BM25 through Pyserini: index from shards, batch search = one-at-a-time search, negatives, SciFact figure."""

import numpy as np
import pyarrow.parquet as pq
import pytest

from ckray.data.collections import load_collection
from ckray.data.examples import TrainingDataConfig, build_training_data
from ckray.data.negatives import build_negatives, negatives_path
from ckray.data.prepare import prepare_collection
from ckray.data.sample import sample_workdir as make_sample_workdir
from ckray.errors import MissingArtifactError
from ckray.eval import evaluate
from ckray.lexical.bm25 import BM25Searcher, bm25_index_dir


@pytest.fixture(scope="module")
def sample_workdir(ray_session, tmp_path_factory):
    return make_sample_workdir(tmp_path_factory.mktemp("bm25"))


def test_batch_search_equals_single_search(sample_workdir):
    data, w = sample_workdir
    c = load_collection(data)
    s = BM25Searcher(str(bm25_index_dir(w)))
    assert s.num_docs == c.corpus.num_rows
    queries = dict(list(c.split_queries("test").items())[:10])
    batch = s.search(queries, k=20)
    for qid, text in queries.items():
        single = s.search_one(text, k=20)
        assert [d for d, _ in batch[qid]] == [d for d, _ in single]
        assert [round(x, 4) for _, x in batch[qid]] == [round(x, 4) for _, x in single]
        assert all(a[1] >= b[1] for a, b in zip(batch[qid], batch[qid][1:]))
    d, score = batch[next(iter(queries))][0]
    assert s.score(queries[next(iter(queries))], d) == pytest.approx(score, rel=1e-4)


def test_empty_query_returns_nothing(sample_workdir):
    _, w = sample_workdir
    s = BM25Searcher(str(bm25_index_dir(w)))
    assert s.search({"q": "   "}, k=10) == {"q": []}


def test_missing_index_is_a_clear_error(tmp_path):
    with pytest.raises(MissingArtifactError, match="no Lucene index"):
        BM25Searcher(str(tmp_path / "nope"))


def test_a_pool_of_searchers_returns_one_searchers_run(sample_workdir):
    from functools import partial

    from ckray.lexical.bm25 import bm25_retriever
    from ckray.lexical.pool import search_many

    data, w = sample_workdir
    queries = load_collection(data).split_queries("train")
    one = BM25Searcher(str(bm25_index_dir(w))).search(queries, k=30)
    many = search_many(partial(bm25_retriever, w), queries, k=30, actors=2, chunk=7)
    assert list(many) == list(queries) and many == one  # the same documents, scores and order
    assert bm25_retriever(w, actors=2).search(queries, k=30) == one


def test_negatives_searched_on_a_pool_are_one_searchers_sorted_by_query(sample_workdir, monkeypatch):
    from ckray.data.negatives import positives_path
    from ckray.lexical import pool

    data, w = sample_workdir
    c = load_collection(data)
    queries = c.split_queries("train")
    monkeypatch.setattr(pool, "CHUNK_QUERIES", 9)
    build_negatives(w, queries, c.qrels["train"], split="pooled", depth=50, actors=2)
    neg = pq.read_table(negatives_path(w, "pooled"))
    assert pq.ParquetFile(negatives_path(w, "pooled")).metadata.num_row_groups == -(-len(queries) // 9)  # streamed
    rows = neg.to_pylist()
    assert [(r["query_id"], r["rank"]) for r in rows] == sorted((r["query_id"], r["rank"]) for r in rows)
    searcher = BM25Searcher(str(bm25_index_dir(w)))
    one = searcher.search(queries, k=50)
    got: dict = {}
    for r in rows:
        got.setdefault(r["query_id"], []).append((r["doc_id"], r["score"]))
    assert got == {q: [(d, float(np.float32(s))) for d, s in docs] for q, docs in one.items() if docs}
    for r in pq.read_table(positives_path(w, "pooled")).to_pylist():
        assert c.qrels["train"][r["query_id"]][r["doc_id"]] > 0
        in_run = dict(one[r["query_id"]]).get(r["doc_id"])  # else scored alone (outside the top 50)
        want = in_run if in_run is not None else searcher.score(queries[r["query_id"]], r["doc_id"])
        assert r["score"] == float(np.float32(want))


def test_evaluating_many_queries_searches_bm25_on_a_pool(sample_workdir, monkeypatch):
    from ckray.data.collections import read_trec_run
    from ckray.evaluation import EvaluateConfig, evaluate_pipelines, first_stage_options, run_path
    from ckray.lexical import pool
    from ckray.pipelines import build_pipeline

    data, w = sample_workdir
    config = EvaluateConfig(data=str(data), workdir=str(w), split="test", k=100)
    alone = evaluate_pipelines(config)
    run_alone = read_trec_run(run_path(w, "bm25", "test"))
    assert first_stage_options("bm25", pool.POOL_MIN_QUERIES - 1) == {}
    monkeypatch.setattr(pool, "POOL_MIN_QUERIES", 10)
    assert first_stage_options("bm25", 10) == {"actors": None} and first_stage_options("ck-qti", 10 ** 6) == {}
    assert isinstance(build_pipeline("bm25", w, retriever_options=first_stage_options("bm25", 10)).retriever,
                      pool.PooledRetriever)
    assert evaluate_pipelines(config) == alone
    assert read_trec_run(run_path(w, "bm25", "test")) == run_alone


def test_negatives_and_training_data(sample_workdir):
    data, w = sample_workdir
    c = load_collection(data)
    build_negatives(w, c.split_queries("train"), c.qrels["train"], depth=50)
    neg = pq.read_table(negatives_path(w)).to_pydict()
    assert set(neg["query_id"]) <= set(c.qrels["train"])
    assert max(neg["rank"]) <= 50
    # negatives made at depth 50 serve a shallower request as they are (readers cut at their depth) ...
    made = negatives_path(w).stat().st_mtime_ns
    build_negatives(w, c.split_queries("train"), c.qrels["train"], depth=20)
    assert negatives_path(w).stat().st_mtime_ns == made
    td = build_training_data(w, c.queries, c.qrels["train"], TrainingDataConfig(dev_fraction=0.25, negatives_per_positive=3))
    rows = td.head(td.num_triples).to_pydict()
    assert td.num_triples > 0 and len(rows["query_id"]) == td.num_triples
    assert not set(rows["query_id"]) & set(td.dev.queries), "dev queries must not be trained on"
    assert not set(rows["query_id"]) & set(c.qrels["test"]), "test queries must never be trained on"
    for q, p, n in zip(rows["query_id"], rows["pos_id"], rows["neg_id"]):
        assert c.qrels["train"][q].get(p, 0) > 0 and c.qrels["train"][q].get(n, 0) <= 0
    assert all(len(v) <= 50 for v in td.dev.candidates.values())
    assert set(td.dev.doc_text) >= {d for v in td.dev.candidates.values() for d, _ in v}
    # capping the dev set bounds validation time; the capped-off held-out queries are not trained on either,
    # so the interpolation weights (ckray.fusion) can be tuned on every held-out query
    from ckray.fusion import dev_queries

    capped = build_training_data(w, c.queries, c.qrels["train"],
                                 TrainingDataConfig(dev_fraction=0.25, negatives_per_positive=3, max_dev_queries=1))
    held_out, _ = dev_queries(c.queries, c.qrels, dev_fraction=0.25)
    assert len(capped.dev) == 1 and len(held_out) > 1
    assert not set(capped.head(capped.num_triples).to_pydict()["query_id"]) & set(held_out)
    assert set(capped.train_queries) == set(td.train_queries)
    # a deeper request than the files were made at searches again
    build_negatives(w, c.split_queries("train"), c.qrels["train"], depth=60)
    assert negatives_path(w).stat().st_mtime_ns != made and max(pq.read_table(negatives_path(w))["rank"].to_pylist()) > 50


def test_weak_title_pairs_add_body_triples_and_leave_the_supervised_ones_alone(sample_workdir):
    from ckray.data.examples import TITLE_QUERY_PREFIX
    from ckray.data.shards import DocStore

    data, w = sample_workdir
    c = load_collection(data)
    build_negatives(w, c.split_queries("train"), c.qrels["train"], depth=50)
    base_cfg = TrainingDataConfig(dev_fraction=0.25, negatives_per_positive=3)
    plain = build_training_data(w, c.queries, c.qrels["train"], base_cfg)
    weak = build_training_data(w, c.queries, c.qrels["train"],
                               TrainingDataConfig(dev_fraction=0.25, negatives_per_positive=3, weak_titles=5, weak_depth=20))
    weak_rows, plain_rows = weak.head(weak.num_triples).to_pylist(), plain.head(plain.num_triples).to_pylist()
    is_weak = [r["query_id"].startswith(TITLE_QUERY_PREFIX) for r in weak_rows]
    assert weak.weak_triples == sum(is_weak) and 0 < weak.weak_triples <= 5 * 3
    assert weak.num_triples == len(weak_rows) == plain.num_triples + weak.weak_triples
    # the supervised triples are the same ones, and the dev set is untouched
    key = lambda r: (r["query_id"], r["pos_id"], r["neg_id"])  # noqa: E731
    assert sorted(key(r) for r in weak_rows if not r["query_id"].startswith(TITLE_QUERY_PREFIX)) == \
        sorted(key(r) for r in plain_rows)
    assert weak.dev.queries == plain.dev.queries
    store = DocStore(w)
    for r in weak_rows:
        if not r["query_id"].startswith(TITLE_QUERY_PREFIX):
            continue
        source = r["query_id"][len(TITLE_QUERY_PREFIX):]
        title, body = store.get(source)
        assert r["query"] == title and r["pos_id"] == source and r["pos_text"] == body  # the body, not the title
        assert r["neg_id"] != source and r["neg_text"] == store.get(r["neg_id"])[1]
        assert r["pos_bm25"] > 0
    assert len({r["query_id"] for r, wk in zip(weak_rows, is_weak) if wk}) == 5


def test_hard_negatives_from_a_mined_run_replace_part_of_the_bm25_ones(sample_workdir, tmp_path):
    from ckray.data.negatives import read_negatives
    from ckray.errors import ConfigError
    from ckray.data.collections import write_trec_run

    data, w = sample_workdir
    c = load_collection(data)
    build_negatives(w, c.split_queries("train"), c.qrels["train"], depth=50)
    bm25 = read_negatives(w, "train", sorted(c.qrels["train"]))
    # a "model" that ranks BM25's list backwards: its top 5 are BM25's ranks 46-50, never BM25's favourites
    mined = {q: [(d, float(i)) for i, (d, _) in enumerate(docs)] for q, docs in bm25.items()}
    run_file = tmp_path / "mined-train.trec"
    write_trec_run(mined, run_file, tag="mined")
    cfg = dict(dev_fraction=0.25, negatives_per_positive=3)
    plain = build_training_data(w, c.queries, c.qrels["train"], TrainingDataConfig(**cfg))
    hard = build_training_data(w, c.queries, c.qrels["train"], TrainingDataConfig(
        **cfg, hard_negative_run=str(run_file), hard_negatives_per_positive=2, hard_negative_depth=5))
    hard_rows, plain_rows = hard.head(hard.num_triples).to_pylist(), plain.head(plain.num_triples).to_pylist()
    assert hard.num_triples == plain.num_triples and hard.dev.queries == plain.dev.queries
    per_positive: dict = {}
    for r in hard_rows:
        per_positive.setdefault((r["query_id"], r["pos_id"]), []).append(r["neg_id"])
        assert r["neg_bm25"] == pytest.approx(dict(bm25[r["query_id"]])[r["neg_id"]])  # CLEAR's s_lex(d−)
    def mined_top5(q):
        return [d for d, _ in sorted(mined[q], key=lambda x: -x[1]) if c.qrels["train"][q].get(d, 0) <= 0][:5]

    wanted = hits = 0
    for (q, p), negs in per_positive.items():
        assert len(set(negs)) == len(negs) == 3
        assert sum(d in mined_top5(q) for d in negs) >= min(2, len(mined_top5(q))), (q, negs)
        wanted, hits = wanted + min(2, len(mined_top5(q))), hits + sum(d in mined_top5(q) for d in negs)
    plain_hits = sum(r["neg_id"] in mined_top5(r["query_id"]) for r in plain_rows)
    assert hits >= wanted > plain_hits  # BM25 sampling alone rarely picks those 5 of 50
    with pytest.raises(MissingArtifactError, match="--hard-negative-run .*nope.trec.*--split train"):
        build_training_data(w, c.queries, c.qrels["train"],
                            TrainingDataConfig(**cfg, hard_negative_run=str(tmp_path / "nope.trec"), hard_negatives_per_positive=1))
    with pytest.raises(ConfigError, match=r"^TrainingDataConfig\.hard_negatives_per_positive must be in \[0, "):
        TrainingDataConfig(negatives_per_positive=3, hard_negatives_per_positive=4, hard_negative_run=str(run_file))


def test_a_training_split_that_yields_no_triples_is_a_clear_error(sample_workdir):
    from ckray.errors import ConfigError
    from ckray.train_job import training_data, training_parser

    data, w = sample_workdir
    args = training_parser("t").parse_args(["--data", str(data), "--workdir", str(w), "--dev-fraction", "1.0"])
    with pytest.raises(ConfigError, match=r"no training triples from split 'train'"):
        training_data(args)  # every training query held back for dev: nothing left to train on


@pytest.mark.slow
def test_scifact_bm25_matches_pyserini_beir_figure(ray_session, scifact_dir, tmp_path):
    prepare_collection(scifact_dir, tmp_path, shards=4, split=None)  # shards and BM25 index
    c = load_collection(scifact_dir)
    run = BM25Searcher(str(bm25_index_dir(tmp_path))).search(c.split_queries("test"), k=1000)
    metrics = evaluate(run, c.qrels["test"])
    assert metrics["nDCG@10"] == pytest.approx(0.679, abs=0.005)
    assert metrics["R@100"] == pytest.approx(0.925, abs=0.01)


def test_a_failed_lucene_indexer_raises_with_the_end_of_its_output(tmp_path):
    from ckray.errors import CkrayError
    from ckray.lexical.anserini import run_anserini

    with pytest.raises(CkrayError, match=r"Anserini IndexCollection failed \(exit [1-9]\d*\):\n(.|\n)*\S"):
        run_anserini("IndexCollection", ["-collection", "NoSuchCollection", "-input", str(tmp_path / "none"),
                                         "-index", str(tmp_path / "index")])
