"""BM25 through Pyserini: index from shards, batch search = one-at-a-time search, negatives, SciFact figure."""

import pyarrow.parquet as pq
import pytest

from ckray.data.collections import load_collection
from ckray.data.examples import TrainingDataConfig, build_negatives, build_training_data, negatives_path
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


def test_negatives_and_training_data(sample_workdir):
    data, w = sample_workdir
    c = load_collection(data)
    build_negatives(w, c.split_queries("train"), c.qrels["train"], depth=50)
    neg = pq.read_table(negatives_path(w)).to_pydict()
    assert set(neg["query_id"]) <= set(c.qrels["train"])
    assert max(neg["rank"]) <= 50
    td = build_training_data(w, c.queries, c.qrels["train"], TrainingDataConfig(dev_fraction=0.25, negatives_per_positive=3))
    rows = td.triples.to_pydict()
    assert td.triples.num_rows > 0
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
    assert not set(capped.triples.to_pydict()["query_id"]) & set(held_out)
    assert set(capped.train_queries) == set(td.train_queries)


@pytest.mark.slow
def test_scifact_bm25_matches_pyserini_beir_figure(ray_session, scifact_dir, tmp_path):
    prepare_collection(scifact_dir, tmp_path, shards=4, split=None)  # shards and BM25 index
    c = load_collection(scifact_dir)
    run = BM25Searcher(str(bm25_index_dir(tmp_path))).search(c.split_queries("test"), k=1000)
    metrics = evaluate(run, c.qrels["test"])
    assert metrics["nDCG@10"] == pytest.approx(0.679, abs=0.005)
    assert metrics["R@100"] == pytest.approx(0.925, abs=0.01)
