"""Training data as a streaming Ray Data pipeline: the triples equal the one-process sampling rule (on the
generated sample, and on SciFact byte for byte with the recorded digest), and the driver holds no triple."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ckray.data import examples
from ckray.data.collections import load_collection, read_trec_run, write_trec_run
from ckray.data.examples import (POSITION, TITLE_QUERY_PREFIX, TRIPLE_COLUMNS, TrainingDataConfig,
                                 build_training_data, is_dev_query)
from ckray.data.negatives import build_negatives, negatives_path, positives_path, read_negatives
from ckray.data.sample import sample_workdir as make_sample_workdir
from ckray.data.shards import DocStore
from ckray.errors import ConfigError

# the default TrainingDataConfig's triples on SciFact (seed 0, split train), recorded from the one-process
# sampling that built every triple in the driver: sha256 of the rows as JSON lists in TRIPLE_COLUMNS order,
# joined by newlines, sorted (canonical) and in the seeded shuffle's order (ordered)
SCIFACT_TRIPLES = 6240
SCIFACT_CANONICAL_SHA256 = "a28fa6bdb7a649a2a67b3eb397064ecbe86a0cddb78de80860079f010626fe8d"
SCIFACT_ORDERED_SHA256 = "5baeb5e926668d1d634fbf8c3d7d9cd8fd418355cc77a2ef2bd6ebf6c321d446"
SCIFACT_DEV_SHA256 = "b4c0878740bea6e92f29784b8e9221e6307700a81ddb5e70e6eeb0b0db29b17b"


@pytest.fixture(scope="module")
def sample(ray_session, tmp_path_factory):
    data, w = make_sample_workdir(tmp_path_factory.mktemp("training-data"))
    c = load_collection(data)
    build_negatives(w, c.split_queries("train"), c.qrels["train"], depth=50, actors=2)
    return data, w, c


def streamed(dataset) -> list[dict]:
    """Every triple of the dataset, in the order of its ``position``."""
    import ray

    tables = ray.get(dataset.to_arrow_refs())
    rows = pa.concat_tables(tables).sort_by(POSITION).to_pylist() if tables else []
    assert [r[POSITION] for r in rows] == list(range(len(rows)))
    return [{c: r[c] for c in TRIPLE_COLUMNS} for r in rows]


def rule(w: Path, queries: dict, qrels: dict, cfg: TrainingDataConfig) -> list[dict]:
    """The sampling rule in one process, plainly: every negative read, every triple built here, one
    generator for all queries in sorted order, weak title pairs after them, one shuffle at the end."""
    store = DocStore(w)

    def read(split):
        run: dict = {}
        for r in pq.read_table(negatives_path(w, split)).sort_by([("query_id", "ascending"),
                                                                  ("rank", "ascending")]).to_pylist():
            run.setdefault(r["query_id"], []).append((r["doc_id"], r["score"]))
        positives = pq.read_table(positives_path(w, split)).to_pylist()
        return run, {(r["query_id"], r["doc_id"]): r["score"] for r in positives}

    run, pos = read(cfg.split)
    hard_run = read_trec_run(Path(cfg.hard_negative_run)) if cfg.hard_negative_run else {}
    rng = random.Random(cfg.seed)
    rows = []
    qids = sorted(q for q in qrels if q in queries and any(r > 0 for r in qrels[q].values()))
    for q in (q for q in qids if not is_dev_query(q, cfg.dev_fraction, cfg.seed)):
        positives = [d for d, r in qrels[q].items() if r > 0 and d in store]
        pool = [(d, s) for d, s in run.get(q, [])[:cfg.negative_depth] if qrels[q].get(d, 0) <= 0]
        if not positives or not pool:
            continue
        hard = [(d, dict(pool)[d]) for d, _ in hard_run.get(q, [])[:cfg.hard_negative_depth] if d in dict(pool)]
        for p in positives:
            picked = rng.sample(hard, min(cfg.hard_negatives_per_positive, len(hard)))
            rest = [x for x in pool if x[0] not in {d for d, _ in picked}]
            for d, s in picked + rng.sample(rest, min(cfg.negatives_per_positive - len(picked), len(rest))):
                rows.append(dict(zip(TRIPLE_COLUMNS, (q, queries[q], p, store.text(p), pos.get((q, p), 0.0), d,
                                                      store.text(d), s))))
    if cfg.weak_titles:
        titled = [d for d in store.ids() if len(store.get(d)[0].split()) >= 3 and store.get(d)[1].strip()]
        chosen = sorted(rng.sample(titled, min(cfg.weak_titles, len(titled))))
        run, pos = read("weak-titles")
        for source in chosen:
            q = TITLE_QUERY_PREFIX + source
            pool = [(d, s) for d, s in run.get(q, []) if d != source and store.get(d)[1].strip()]
            for d, s in rng.sample(pool, min(cfg.negatives_per_positive, len(pool))):
                rows.append(dict(zip(TRIPLE_COLUMNS, (q, store.get(source)[0], source, store.get(source)[1],
                                                      pos[(q, source)], d, store.get(d)[1], s))))
    order = list(range(len(rows)))
    rng.shuffle(order)
    return [rows[i] for i in order]


def test_streamed_triples_are_the_per_query_rule_across_many_blocks(sample, monkeypatch):
    import ray.data

    data, w, c = sample
    monkeypatch.setattr(examples, "BLOCK_QUERIES", 7)  # the sample's ~90 training queries in ~13 tasks
    cfg = TrainingDataConfig(dev_fraction=0.25, negatives_per_positive=3, negative_depth=30)
    td = build_training_data(w, c.queries, c.qrels["train"], cfg)
    assert isinstance(td.triples, ray.data.Dataset)  # lazy: made in Ray Data tasks when read
    assert td.plan.specs.num_rows >= 10
    want = rule(w, c.queries, c.qrels["train"], cfg)
    assert len(want) > 100 and td.num_triples == len(want)
    assert streamed(td.triples) == want  # same triples, same scores, same order


def test_mined_hard_negatives_weak_titles_and_a_limit_follow_the_rule(sample, tmp_path):
    data, w, c = sample
    bm25 = read_negatives(w, "train", sorted(c.qrels["train"]))
    # a "model" that ranks BM25's list backwards, written in an order other than the queries'
    mined = {q: [(d, float(i % 7)) for i, (d, _) in enumerate(docs)] for q, docs in sorted(bm25.items(), reverse=True)}
    write_trec_run(mined, tmp_path / "mined.trec", tag="mined")
    cfg = TrainingDataConfig(dev_fraction=0.25, negatives_per_positive=3, seed=3, weak_titles=5, weak_depth=20,
                             hard_negative_run=str(tmp_path / "mined.trec"), hard_negatives_per_positive=2,
                             hard_negative_depth=5)
    td = build_training_data(w, c.queries, c.qrels["train"], cfg)
    want = rule(w, c.queries, c.qrels["train"], cfg)
    got = streamed(td.triples)
    assert got == want
    weak = [r["query_id"].startswith(TITLE_QUERY_PREFIX) for r in want]
    assert td.weak_triples == sum(weak) > 0
    # --max-triples: the first n of the shuffle, and the weak ones among them
    n = len(want) // 3
    cut = td.limited(n)
    assert cut.num_triples == n and cut.weak_triples == sum(weak[:n])
    assert streamed(cut.triples) == want[:n]
    assert [{c: r[c] for c in TRIPLE_COLUMNS} for r in td.head(5).to_pylist()] == want[:5]
    # what the driver holds: a row per block of queries, no document text, a few bytes per triple
    text_bytes = sum(len(r["pos_text"]) + len(r["neg_text"]) for r in want)
    assert td.plan.specs.nbytes < text_bytes / 4, (td.plan.specs.nbytes, text_bytes)
    assert not {"pos_text", "neg_text"} & set(td.plan.specs.column_names)


def test_query_max_scale_divides_each_querys_bm25_scores_by_its_top_one(sample):
    """``bm25_scale="query-max"``: the same triples and dev candidates, each BM25 score divided by its query's
    top BM25 score (the run's rank 1, or a judged document scored higher outside it)."""
    data, w, c = sample
    raw_cfg = TrainingDataConfig(dev_fraction=0.25, negatives_per_positive=3, weak_titles=5, weak_depth=20)
    raw_td = build_training_data(w, c.queries, c.qrels["train"], raw_cfg)
    scaled_td = build_training_data(w, c.queries, c.qrels["train"], replace(raw_cfg, bm25_scale="query-max"))
    raw, scaled = streamed(raw_td.triples), streamed(scaled_td.triples)
    top = {}
    for split in ("train", "weak-titles"):
        for r in pq.read_table(negatives_path(w, split)).to_pylist() + pq.read_table(positives_path(w, split)).to_pylist():
            top[r["query_id"]] = max(top.get(r["query_id"], 0.0), r["score"])
    assert len(raw) == len(scaled) > 100 and any(r["query_id"].startswith(TITLE_QUERY_PREFIX) for r in raw)
    for r, s in zip(raw, scaled):
        assert {k: s[k] for k in TRIPLE_COLUMNS if "bm25" not in k} == {k: r[k] for k in TRIPLE_COLUMNS if "bm25" not in k}
        for side in ("pos_bm25", "neg_bm25"):
            assert s[side] == pytest.approx(r[side] / top[r["query_id"]], rel=1e-6), (r["query_id"], side)
    assert max(s["neg_bm25"] for s in scaled) <= 1 + 1e-6 and min(s["neg_bm25"] for s in scaled) < 0.9
    assert raw_td.dev.queries == scaled_td.dev.queries and scaled_td.dev.queries
    for q, docs in scaled_td.dev.candidates.items():
        raw_docs = raw_td.dev.candidates[q]
        assert [d for d, _ in docs] == [d for d, _ in raw_docs] and docs[0][1] == pytest.approx(1.0)
        assert [s for _, s in docs] == pytest.approx([s / raw_docs[0][1] for _, s in raw_docs])
    with pytest.raises(ConfigError, match="bm25_scale"):
        TrainingDataConfig(bm25_scale="max")


def test_missing_negatives_and_a_malformed_mined_run_are_clear_errors(sample, tmp_path):
    from ckray.errors import CollectionError, MissingArtifactError

    data, w, c = sample
    with pytest.raises(MissingArtifactError, match=r"no BM25 negatives for split 'other'.*--train-split other"):
        build_training_data(w, c.queries, c.qrels["train"], TrainingDataConfig(split="other"))
    bad = tmp_path / "bad.trec"
    bad.write_text("q1 Q0 d1 1 2.5 x\nq1 Q0 d2 2 high x\n")
    with pytest.raises(CollectionError, match=r"bad.trec:2: score 'high' is not a number"):
        build_training_data(w, c.queries, c.qrels["train"], TrainingDataConfig(hard_negative_run=str(bad)))


def triples_digest(rows: list[dict]) -> tuple[str, str]:
    lines = [json.dumps([r[c] for c in TRIPLE_COLUMNS]) for r in rows]
    return (hashlib.sha256("\n".join(sorted(lines)).encode()).hexdigest(),
            hashlib.sha256("\n".join(lines).encode()).hexdigest())


@pytest.mark.slow
def test_scifact_triples_equal_the_recorded_ones(ray_session, scifact_dir, tmp_path):
    from ckray.data.prepare import prepare_collection

    prepare_collection(scifact_dir, tmp_path, shards=4, split="train")  # BM25 negatives on a pool of actors
    c = load_collection(scifact_dir)
    td = build_training_data(tmp_path, c.queries, c.qrels["train"], TrainingDataConfig())
    rows = streamed(td.triples)
    assert td.num_triples == len(rows) == SCIFACT_TRIPLES
    assert triples_digest(rows) == (SCIFACT_CANONICAL_SHA256, SCIFACT_ORDERED_SHA256)
    dev = json.dumps([td.dev.queries, td.dev.candidates, td.dev.doc_text, td.dev.qrels], sort_keys=True)
    assert hashlib.sha256(dev.encode()).hexdigest() == SCIFACT_DEV_SHA256


@pytest.mark.slow
def test_streamed_triples_train_through_ray_train(sample, tmp_path):
    """The lazy dataset goes to fit as it is: each worker reads its shard with get_dataset_shard."""
    from ckray.rankers.cedr.model import CEDRConfig
    from ckray.rankers.cedr.task import CEDRTask
    from ckray.training import TrainConfig, fit

    data, w, c = sample
    td = build_training_data(w, c.queries, c.qrels["train"],
                             TrainingDataConfig(dev_fraction=0.25, negatives_per_positive=3, max_dev_queries=4))
    model = CEDRConfig(variant="knrm", max_length=64, max_segments=1,
                       random_init={"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "intermediate_size": 64})
    config = TrainConfig(workers=2, zero_stage=2, batch_size=4, max_steps=6, eval_every=6, lr=1e-3,
                         output_dir=str(tmp_path / "out"), storage_dir=str(tmp_path / "runs"), log_every=2,
                         eval_at_start=False)
    result = fit(CEDRTask(model_config=model, name="cedr-streamed"), td.triples, td.dev, config)
    assert result.steps == 6 and result.examples_seen == 6 * 4 * 2
