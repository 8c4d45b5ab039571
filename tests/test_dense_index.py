"""Dense index for CLEAR: the Ray Data embedding job, the faiss index, hybrid retrieval (Eq. 8)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ckray.data.shards import marker_path, shard_name, write_json_atomic, write_parquet_atomic
from ckray.errors import ConfigError, MissingArtifactError
from ckray.fusion import linear_fusion, theoretical_min_max
from ckray.rankers.clear.embed import EmbedConfig, embed_corpus, read_embedding_shards, write_embedding_shard
from ckray.rankers.clear.faiss_index import DenseIndex, IndexConfig
from ckray.rankers.clear.hybrid import DenseRetriever, HybridConfig, HybridRetriever, hybrid_candidates, tune_lambda
from ckray.rankers.clear.layout import embeddings_dir
from ckray.models.checkpoint import load_model, save_model
from ckray.rankers.clear.model import CLEAR, CLEARConfig

TINY_BERT = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 128}
WORDS = ("fever infection protein folding cell membrane virus vaccine cancer tumour gene expression "
         "neuron synapse insulin diabetes heart muscle bone calcium").split()
SHARD_SIZES = (23, 0, 17, 12)     # 52 documents, one empty shard


def make_corpus(workdir: Path, sizes=SHARD_SIZES, seed: int = 0) -> list[tuple[str, str, str]]:
    """Corpus shards + manifest in the documented layout (W/shards/part-NNNNN.parquet)."""
    rng = np.random.default_rng(seed)
    docs, shards, n = [], [], 0
    for i, size in enumerate(sizes):
        rows = []
        for _ in range(size):
            title = " ".join(rng.choice(WORDS, 2))
            text = " ".join(rng.choice(WORDS, int(rng.integers(3, 40))))
            rows.append((f"d{n:03d}", title, text))
            n += 1
        table = pa.table({c: pa.array([r[j] for r in rows], pa.string()) for j, c in enumerate(("doc_id", "title", "text"))})
        write_parquet_atomic(table, workdir / "shards" / shard_name(i))
        shards.append({"name": shard_name(i), "rows": size})
        docs.extend(rows)
    write_json_atomic({"shards": shards, "documents": n}, workdir / "shards" / "_manifest.json")
    return docs


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, minilm_path) -> Path:
    torch.manual_seed(0)
    model = CLEAR(CLEARConfig(encoder=minilm_path, pretrained=False, bert_config=dict(TINY_BERT), doc_max_len=64))
    return save_model(model, tmp_path_factory.mktemp("ckpt") / "clear")


@pytest.fixture(scope="module")
def embedded(tmp_path_factory, tiny_checkpoint, ray_session):
    """A work directory whose corpus was embedded once by the Ray Data job (one actor)."""
    workdir = tmp_path_factory.mktemp("W")
    docs = make_corpus(workdir)
    summary = embed_corpus(workdir, tiny_checkpoint, EmbedConfig(actors=1, batch_size=8, encode_batch_size=4),
                           progress=False)
    return workdir, docs, summary


@pytest.fixture(scope="module")
def encoded(tmp_path_factory, tiny_checkpoint):
    """Embedding shards written directly (no Ray): what the job writes, for the index tests."""
    workdir = tmp_path_factory.mktemp("W_direct")
    docs = make_corpus(workdir)
    expected = _expected_embeddings(tiny_checkpoint, docs)
    for i, chunk in enumerate((docs[:30], docs[30:])):
        ids = [d for d, _, _ in chunk]
        write_embedding_shard(embeddings_dir(workdir) / shard_name(i), ids, [np.stack([expected[d] for d in ids])],
                              False, {"source": shard_name(i)})
    return workdir, docs


def _expected_embeddings(checkpoint, docs) -> dict[str, np.ndarray]:
    model = load_model(checkpoint)
    emb = model.encode_documents([f"{t} {x}".strip() for _, t, x in docs]).numpy()
    return {d: e for (d, _, _), e in zip(docs, emb)}


# ------------------------------------------------------------------------------------ embedding job

@pytest.mark.slow
def test_embedding_job_writes_every_document_exactly_once(embedded, tiny_checkpoint):
    workdir, docs, summary = embedded
    assert summary["documents"] == len(docs) == 52
    assert summary["shards_written"] == len(SHARD_SIZES) and summary["shards_skipped"] == 0
    assert summary["batches"] >= 52 // 8     # results stream back per actor batch (batch_size=8)
    out = embeddings_dir(workdir)
    for i, size in enumerate(SHARD_SIZES):   # one embedding shard per corpus shard, same documents
        t = pq.read_table(out / shard_name(i))
        assert t.num_rows == size and marker_path(out / shard_name(i)).exists()
    ids, x = read_embedding_shards(out)
    assert sorted(ids) == sorted(d for d, _, _ in docs) and len(set(ids)) == len(ids)
    assert x.shape == (52, 32) and x.dtype == np.float32
    assert pq.read_table(out / shard_name(0)).schema.field("embedding").type == pa.list_(pa.float32(), 32)
    expected = _expected_embeddings(tiny_checkpoint, docs)
    np.testing.assert_allclose(x, np.stack([expected[d] for d in ids]), atol=1e-5)


@pytest.mark.slow
def test_rerun_skips_finished_shards_and_redoes_broken_ones(embedded, tiny_checkpoint):
    workdir, docs, _ = embedded
    out = embeddings_dir(workdir)
    before = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}

    again = embed_corpus(workdir, tiny_checkpoint, EmbedConfig(actors=1, batch_size=8), progress=False)
    assert again["shards_written"] == 0 and again["shards_skipped"] == len(SHARD_SIZES) and again["documents"] == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")} == before

    # a crash mid-write: shard 0 truncated under its final name, shard 2's marker never written,
    # and a temporary file of an interrupted atomic write left behind
    data = (out / shard_name(0)).read_bytes()
    (out / shard_name(0)).write_bytes(data[: len(data) // 2])
    marker_path(out / shard_name(2)).unlink()
    (out / f".{shard_name(3)}.tmp-123-abcdef12").write_bytes(b"partial")

    redo = embed_corpus(workdir, tiny_checkpoint, EmbedConfig(actors=1, batch_size=8), progress=False)
    assert redo["shards_written"] == 2 and redo["shards_skipped"] == 2
    assert redo["documents"] == SHARD_SIZES[0] + SHARD_SIZES[2]
    after = {p.name: p.stat().st_mtime_ns for p in out.glob("part-*.parquet")}
    assert after[shard_name(1)] == before[shard_name(1)] and after[shard_name(3)] == before[shard_name(3)]
    assert not list(out.glob(".*tmp*"))
    ids, x = read_embedding_shards(out)
    assert sorted(ids) == sorted(d for d, _, _ in docs) and len(set(ids)) == len(ids)
    expected = _expected_embeddings(tiny_checkpoint, docs)
    np.testing.assert_allclose(x, np.stack([expected[d] for d in ids]), atol=1e-5)


@pytest.mark.slow
def test_doc_max_len_override_reencodes_at_that_length(tmp_path, tiny_checkpoint, ray_session):
    docs = make_corpus(tmp_path, sizes=(12, 9), seed=2)
    embed_corpus(tmp_path, tiny_checkpoint, EmbedConfig(actors=1, batch_size=8), progress=False)
    short = embed_corpus(tmp_path, tiny_checkpoint, EmbedConfig(actors=1, batch_size=8, doc_max_len=6, passages=1),
                         progress=False)
    assert short["shards_written"] == 2 and short["documents"] == 21   # another length: nothing reused
    ids, x = read_embedding_shards(embeddings_dir(tmp_path))
    model = load_model(tiny_checkpoint)
    model.config.doc_max_len = 6
    want = model.encode_documents([f"{t} {x}".strip() for _, t, x in docs]).numpy()
    order = {d: i for i, (d, _, _) in enumerate(docs)}
    np.testing.assert_allclose(x, want[[order[d] for d in ids]], atol=1e-5)
    assert not np.allclose(x, np.stack([_expected_embeddings(tiny_checkpoint, docs)[d] for d in ids]), atol=1e-3)
    with pytest.raises(ConfigError, match="has 128 positions"):
        embed_corpus(tmp_path, tiny_checkpoint, EmbedConfig(doc_max_len=129), progress=False)


def test_passages_are_overlapping_windows_that_read_the_whole_document(tiny_checkpoint):
    """A document that fits one window gets encode_documents' vector; a longer one a vector per window, the first
    being its FirstP vector, consecutive windows sharing ``overlap`` word pieces, all of them read with 0."""
    model = load_model(tiny_checkpoint)
    model.config.doc_max_len = 16
    long_doc = " ".join(WORDS * 3)
    docs = ["fever infection", long_doc]
    every = model.encode_document_passages(docs, 0, overlap=4)
    tok = model.tokenizer(long_doc, add_special_tokens=False)["input_ids"]
    step = 14 - 4                                       # a window's 14 pieces besides [CLS]/[SEP], less the overlap
    assert len(tok) > 50 and [len(v) for v in every] == [1, 1 + -(-(len(tok) - 14) // step)]
    first = model.encode_documents(docs).numpy()
    np.testing.assert_allclose(np.stack([v[0].numpy() for v in every]), first, atol=1e-6)
    for i, v in enumerate(every[1]):                    # window i is the pieces [i·step, i·step + 14)
        ids = [model.tokenizer.cls_token_id, *tok[i * step: i * step + 14], model.tokenizer.sep_token_id]
        want = model.document_embeddings(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))[0]
        np.testing.assert_allclose(v.numpy(), want.detach().numpy(), atol=1e-5)
    assert [len(v) for v in model.encode_document_passages(docs, 2, overlap=4)] == [1, 2]


@pytest.mark.slow
def test_embedding_job_with_passages_writes_a_row_per_window_and_the_index_scores_the_best(tmp_path, tiny_checkpoint,
                                                                                          ray_session):
    docs = make_corpus(tmp_path, sizes=(12, 9), seed=4)
    config = EmbedConfig(actors=1, batch_size=8, doc_max_len=8, passages=3)
    embed_corpus(tmp_path, tiny_checkpoint, config, progress=False)
    model = load_model(tiny_checkpoint)
    model.config.doc_max_len = 8
    want = dict(zip([d for d, _, _ in docs], model.encode_document_passages(
        [f"{t} {x}".strip() for _, t, x in docs], 3, overlap=2)))
    assert {len(v) for v in want.values()} == {1, 2, 3}   # short documents keep one row, long ones three at most
    out = embeddings_dir(tmp_path)
    table = pq.read_table(out / shard_name(0))
    ids = table.column("doc_id").to_pylist()
    assert ids == [d for d, _, _ in docs[:12] for _ in range(len(want[d]))]        # a row per window, in order
    assert table.column("passage").to_pylist() == [i for d, _, _ in docs[:12] for i in range(len(want[d]))]
    assert pq.read_table(out / shard_name(1)).num_rows == sum(len(want[d]) for d, _, _ in docs[12:])
    # a FirstP run's shards are not reused for passages, nor the other way round
    again = embed_corpus(tmp_path, tiny_checkpoint, EmbedConfig(actors=1, batch_size=8, doc_max_len=8), progress=False)
    assert again["shards_written"] == 2
    embed_corpus(tmp_path, tiny_checkpoint, config, progress=False)

    index = DenseIndex.from_shards(out)
    assert len(index) == 21 and index.meta["count"] == sum(map(len, want.values())) and index.meta["documents"] == 21
    index.save(tmp_path / "index")
    loaded = DenseIndex.load(tmp_path / "index")
    q = np.random.default_rng(0).normal(size=(3, 32)).astype(np.float32)
    best = {d: v.numpy() @ q.T for d, v in want.items()}          # [windows, queries]
    for qi in range(3):                                          # MaxP: each document once, at its best window
        exact = sorted(((float(s[:, qi].max()), d) for d, s in best.items()), reverse=True)
        for found in (index.search(q, 5)[qi], loaded.search(q, 5)[qi]):
            assert [d for d, _ in found] == [d for _, d in exact[:5]]
            np.testing.assert_allclose([s for _, s in found], [s for s, _ in exact[:5]], rtol=1e-4)
        assert len(loaded.search(q, 21)[qi]) == 21                # all documents, though windows outnumber them
        np.testing.assert_allclose(loaded.scores(q[qi], ["d003", "d015"]),
                                   [best["d003"][:, qi].max(), best["d015"][:, qi].max()], rtol=1e-4)
    with pytest.raises(ConfigError, match="passage vectors"):
        loaded.vectors(["d003"])


@pytest.mark.slow
def test_float16_with_two_actors_a_lost_actor_and_a_new_checkpoint_redoes_everything(tmp_path, tiny_checkpoint,
                                                                                      ray_session):
    docs = make_corpus(tmp_path, sizes=(15, 15, 10), seed=1)
    crash = tmp_path / "crashed-once"
    first = embed_corpus(tmp_path, tiny_checkpoint, EmbedConfig(actors=2, batch_size=4, float16=True), progress=False,
                         crash_once=str(crash))
    assert crash.exists()  # one actor died on its first batch; Ray restarted it and retried the batch
    assert first["shards_written"] == 3 and first["documents"] == 40
    for i, size in enumerate((15, 15, 10)):  # each document once, in its corpus shard's order
        want = pq.read_table(tmp_path / "shards" / shard_name(i)).column("doc_id").to_pylist()
        assert pq.read_table(embeddings_dir(tmp_path) / shard_name(i)).column("doc_id").to_pylist() == want
    assert pq.read_table(embeddings_dir(tmp_path) / shard_name(0)).schema.field("embedding").type == \
        pa.list_(pa.float16(), 32)
    ids, x = read_embedding_shards(embeddings_dir(tmp_path))
    expected = _expected_embeddings(tiny_checkpoint, docs)
    np.testing.assert_allclose(x, np.stack([expected[d] for d in ids]), atol=2e-3)
    # another model: nothing may be reused
    other = load_model(tiny_checkpoint)
    with torch.no_grad():
        other.projection.weight.mul_(2.0)
    other_ckpt = save_model(other, tmp_path / "other")
    second = embed_corpus(tmp_path, other_ckpt, EmbedConfig(actors=1, batch_size=8, float16=True), progress=False)
    assert second["shards_written"] == 3 and second["shards_skipped"] == 0


def test_missing_checkpoint_is_reported(tmp_path):
    make_corpus(tmp_path, sizes=(3,))
    (tmp_path / "empty").mkdir()
    with pytest.raises(MissingArtifactError, match="checkpoint"):
        embed_corpus(tmp_path, tmp_path / "empty", progress=False)


# ------------------------------------------------------------------------------------- faiss index

def _brute_force(x: np.ndarray, ids: list[str], q: np.ndarray, k: int) -> list[list[str]]:
    s = q @ x.T
    return [[ids[j] for j in np.argsort(-row, kind="stable")[:k]] for row in s]


def test_flat_index_matches_brute_force_and_reloads(encoded, tmp_path):
    workdir, _ = encoded
    index = DenseIndex.from_shards(embeddings_dir(workdir))
    ids, x = read_embedding_shards(embeddings_dir(workdir))
    rng = np.random.default_rng(0)
    q = rng.normal(size=(6, 32)).astype(np.float32)
    hits = index.search(q, 10)
    assert [[d for d, _ in h] for h in hits] == _brute_force(x, ids, q, 10)
    np.testing.assert_allclose([[s for _, s in h] for h in hits], np.sort(q @ x.T, axis=1)[:, ::-1][:, :10], rtol=1e-5)

    index.save(tmp_path / "index")
    assert sorted(os.listdir(tmp_path / "index")) == ["doc_ids.parquet", "index.faiss", "meta.json"]
    loaded = DenseIndex.load(tmp_path / "index")
    assert loaded.meta["kind"] == "flat" and loaded.meta["count"] == 52 and len(loaded) == 52
    assert loaded.search(q, 10) == hits
    np.testing.assert_array_equal(loaded.vectors(ids[:5]), x[:5])


@pytest.mark.parametrize("kind", ["hnsw", "ivf", "ivfpq"])
def test_approximate_indexes_reload_identically(kind, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 32)).astype(np.float32)
    ids = [f"d{i}" for i in range(400)]
    q = rng.normal(size=(5, 32)).astype(np.float32)
    index = DenseIndex.build(ids, x, IndexConfig(kind=kind, nlist=8, nprobe=8, pq_m=8, pq_bits=4))
    hits = index.search(q, 10)
    index.save(tmp_path / kind)
    loaded = DenseIndex.load(tmp_path / kind)
    assert loaded.search(q, 10) == hits
    exact = _brute_force(x, ids, q, 10)
    overlap = np.mean([len({d for d, _ in h} & set(e)) / 10 for h, e in zip(hits, exact)])
    assert overlap >= (0.9 if kind != "ivfpq" else 0.4)      # nprobe = nlist: only PQ approximates
    assert loaded.vectors(["d3"]).shape == (1, 32)


@pytest.mark.parametrize("kind", ["flat", "ivf", "ivfpq"])
def test_index_built_a_shard_at_a_time_equals_the_index_built_in_memory(kind, tmp_path):
    """from_shards reads one embedding shard at a time (and gathers the IVF/PQ training sample shard by
    shard): the same seeded sample, the same vectors in the same order, so the same index as build()."""
    rng = np.random.default_rng(3)
    sizes = (150, 0, 97, 153)
    x = rng.normal(size=(sum(sizes), 32)).astype(np.float32)
    ids = [f"d{i}" for i in range(len(x))]
    out = tmp_path / "emb"
    start = 0
    for i, size in enumerate(sizes):
        write_embedding_shard(out / shard_name(i), ids[start:start + size], [x[start:start + size]], False,
                              {"source": shard_name(i)})
        start += size
    config = IndexConfig(kind=kind, nlist=8, nprobe=4, pq_m=8, pq_bits=4, train_sample=120)
    streamed = DenseIndex.from_shards(out, config)
    in_memory = DenseIndex.build(ids, x, config)
    q = rng.normal(size=(7, 32)).astype(np.float32)
    assert streamed.search(q, 15) == in_memory.search(q, 15)
    assert streamed.meta["count"] == len(x) and streamed.meta["embeddings"] == str(out)
    assert [streamed.doc_ids[r] for r in (0, 150, 399)] == ["d0", "d150", "d399"]

    # the same id in two shards is named before any vector is added
    write_embedding_shard(out / shard_name(9), ["d7"], [x[:1]], False, {"source": shard_name(9)})
    with pytest.raises(ConfigError, match="duplicate doc id 'd7'"):
        DenseIndex.from_shards(out, config)


def test_load_missing_index_raises(tmp_path):
    with pytest.raises(MissingArtifactError, match="build_dense_index"):
        DenseIndex.load(tmp_path / "nothing")


def test_dense_retriever_returns_brute_force_top10(encoded, tiny_checkpoint, tmp_path):
    workdir, docs = encoded
    DenseIndex.from_shards(embeddings_dir(workdir)).save(tmp_path / "index")
    retriever = DenseRetriever(tiny_checkpoint, tmp_path / "index")
    queries = {"q1": "fever infection", "q2": "protein folding in the cell", "q3": "   "}
    run = retriever.search(queries, k=10)
    assert run["q3"] == [] and len(run["q1"]) == 10
    model = load_model(tiny_checkpoint)
    vq = model.encode_queries([queries["q1"], queries["q2"]]).numpy()
    ids, x = read_embedding_shards(embeddings_dir(workdir))
    assert [[d for d, _ in run[q]] for q in ("q1", "q2")] == _brute_force(x, ids, vq, 10)
    # exact s_emb for arbitrary documents equals the score search returned
    d, s = run["q1"][3]
    assert retriever.score(queries, {"q1": [d]})["q1"][d] == pytest.approx(s, abs=1e-5)


# ------------------------------------------------------------------------------------------ hybrid

LEX = {"q1": [("A", 10.0), ("B", 5.0)], "q2": [("D", 10.0), ("C", 5.0)]}
EMB = {"q1": [("B", 0.5), ("A", 0.1)], "q2": [("C", 0.9), ("D", 0.1), ("E", 0.05)]}
QRELS = {"q1": {"A": 1}, "q2": {"C": 1}}


def test_fuse_is_eq8_over_the_union():
    cands = hybrid_candidates(LEX, EMB, lex_score=lambda q, ids: {d: 1.0 for d in ids})
    assert cands["q2"]["E"] == (1.0, 0.05)                  # dense-only: exact s_lex from the scorer
    run = linear_fusion(cands, 0.05, k=10)
    assert [d for d, _ in run["q1"]] == ["B", "A"]
    assert dict(run["q1"]) == pytest.approx({"A": 0.05 * 10 + 0.1, "B": 0.05 * 5 + 0.5})
    assert [d for d, _ in linear_fusion(cands, 1.0, k=10)["q2"]] == ["D", "C", "E"]
    assert [d for d, _ in linear_fusion(cands, 0.0, k=2)["q2"]] == ["C", "D"]
    # without a scorer the missing score is the lowest that side returned for the query
    assert hybrid_candidates(LEX, EMB)["q2"]["E"] == (5.0, 0.05)


def test_tune_lambda_finds_the_interval_that_ranks_both_relevant_documents_first():
    # q1 needs λ > 0.4/5 = 0.08 (BM25 must overturn the embedding); q2 needs λ < 0.8/5 = 0.16.
    best, table = tune_lambda(hybrid_candidates(LEX, EMB), QRELS)
    assert 0.08 < best < 0.16 and table[best] == pytest.approx(1.0)
    assert table[0.0] < 1.0 and table[max(table)] < 1.0
    assert best == min(lam for lam, v in table.items() if v == table[best])   # smallest of the ties
    # the one-standard-error rule takes the largest λ of the same ties: the most weight on BM25
    grid = (0.05, 0.1, 0.12, 0.15)
    assert tune_lambda(hybrid_candidates(LEX, EMB), QRELS, grid)[0] == 0.1
    assert tune_lambda(hybrid_candidates(LEX, EMB), QRELS, grid, rule="one-se")[0] == 0.15


class _FakeLexical:
    def search(self, queries, k):
        return {q: LEX[q][:k] for q in queries}

    def score(self, query, doc_id):
        return 2.0


class _FakeDense:
    def search(self, queries, k):
        return {q: EMB[q][:k] for q in queries}

    def score(self, queries, candidates):
        return {q: {d: -1.0 for d in ids} for q, ids in candidates.items()}


def test_hybrid_retriever_fetches_exact_scores_and_tunes_on_training_queries():
    hybrid = HybridRetriever(_FakeLexical(), _FakeDense(), HybridConfig(lam=1.0, dense_depth=3, normalization="none"))
    cands = hybrid.candidates({"q1": "x", "q2": "y"})
    assert cands["q2"]["E"] == (2.0, 0.05)                  # s_lex from the Lucene-style scorer
    best, _ = hybrid.tune({"q1": "x", "q2": "y"}, QRELS)
    assert hybrid.config.lam == best and 0.08 < best < 0.16
    run = hybrid.search({"q1": "x", "q2": "y"}, k=1)
    assert run == {"q1": [("A", pytest.approx(best * 10 + 0.1))], "q2": [("C", pytest.approx(best * 5 + 0.9))]}


def test_tmm_puts_each_side_in_0_1_with_the_querys_best_document_at_1():
    cands = hybrid_candidates(LEX, EMB, lex_score=lambda q, ids: {d: 1.0 for d in ids})
    assert theoretical_min_max(cands["q1"]) == {"A": pytest.approx((1.0, 1.1 / 1.5)), "B": pytest.approx((0.5, 1.0))}
    assert theoretical_min_max(cands["q2"])["E"] == pytest.approx((0.1, 1.05 / 1.9))
    assert dict(linear_fusion(cands, 1.0, normalization="tmm")["q1"]) == pytest.approx(
        {"A": 1.0 + 1.1 / 1.5, "B": 0.5 + 1.0})
    with pytest.raises(ConfigError, match="normalization must be one of"):
        linear_fusion(cands, 1.0, normalization="z")


def test_a_tmm_lambda_means_the_same_when_bm25_scores_scale_and_a_raw_one_does_not():
    # BM25 scores grow with query length and IDF: the same query on another collection, its BM25 scores × 6
    cands = hybrid_candidates(LEX, EMB)
    scaled = {q: {d: (6 * a, b) for d, (a, b) in docs.items()} for q, docs in cands.items()}
    best, table = tune_lambda(cands, QRELS, normalization="tmm")
    assert table[best] == pytest.approx(1.0)
    same, original = (linear_fusion(c, best, normalization="tmm") for c in (scaled, cands))
    assert {q: dict(h) for q, h in same.items()} == {q: pytest.approx(dict(h)) for q, h in original.items()}
    assert [[d for d, _ in h] for h in same.values()] == [[d for d, _ in h] for h in original.values()]
    raw_best, _ = tune_lambda(cands, QRELS)
    assert [d for d, _ in linear_fusion(scaled, raw_best)["q2"]][0] == "D"   # raw: BM25 now outweighs, C loses
    assert [d for d, _ in linear_fusion(cands, raw_best)["q2"]][0] == "C"


def test_hybrid_normalization_flags_and_models_that_do_not_fit_are_errors(tmp_path):
    from types import SimpleNamespace

    from ckray.rankers.clear.hybrid import hybrid_retriever, save_hybrid_config

    dot_product = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(normalize=False)), checkpoint="ckpt-dot")
    with pytest.raises(ConfigError, match="ckpt-dot .*normalize: false.*'none'"):
        HybridRetriever(_FakeLexical(), dot_product, HybridConfig(normalization="tmm"))
    HybridRetriever(_FakeLexical(), dot_product, HybridConfig(normalization="none"))    # raw Eq. 8 needs no bound
    with pytest.raises(ConfigError, match="HybridConfig.normalization"):
        HybridConfig(normalization="minmax")
    save_hybrid_config(tmp_path, HybridConfig(lam=0.4, normalization="tmm"))
    with pytest.raises(ConfigError, match=r"λ_test 0.4 in .*hybrid.json was tuned for hybrid normalization 'tmm', not 'none'.*--lambda"):
        hybrid_retriever(tmp_path, normalization="none")


def test_a_query_tower_other_than_the_indexed_model_is_refused_naming_both(encoded, tiny_checkpoint, tmp_path):
    from ckray.models.checkpoint import checkpoint_digest
    from ckray.rankers.clear.hybrid import dense_retriever
    from ckray.rankers.clear.layout import index_dir

    workdir, _ = encoded
    DenseIndex.from_shards(embeddings_dir(workdir), meta={
        "checkpoint": str(tiny_checkpoint), "checkpoint_sha256": checkpoint_digest(tiny_checkpoint)}).save(
        index_dir(tmp_path))
    assert dense_retriever(tmp_path).checkpoint == str(tiny_checkpoint)   # the index's own model
    torch.manual_seed(1)
    other = save_model(CLEAR(CLEARConfig(encoder=str(load_model(tiny_checkpoint).config.encoder), pretrained=False,
                                         bert_config=dict(TINY_BERT), doc_max_len=64)), tmp_path / "other")
    with pytest.raises(ConfigError, match=rf"checkpoint {other} .*not the model the dense index .*{tiny_checkpoint}"):
        dense_retriever(tmp_path, other)


def test_lambda_saved_with_the_checkpoint_is_carried_to_a_collection_without_training_queries(tiny_checkpoint,
                                                                                            tmp_path):
    import json

    from ckray.deploy import deploy_path, save_deploy_setting
    from ckray.rankers.clear.hybrid import carry_hybrid, load_hybrid_config, save_hybrid_config

    assert carry_hybrid(tmp_path, tiny_checkpoint) is None and not (tmp_path / "dense" / "hybrid.json").exists()
    save_deploy_setting(tiny_checkpoint, "lambda", {"value": 0.08, "tuned_on": {"queries": 40}})
    carried = carry_hybrid(tmp_path, tiny_checkpoint)
    loaded = load_hybrid_config(tmp_path)
    assert loaded.lam == carried.lam == 0.08 and loaded.source == str(deploy_path(tiny_checkpoint.resolve()))
    assert loaded.normalization == "none"          # a λ saved without the field was tuned on raw scores
    assert HybridRetriever(None, None, loaded).settings == {"lambda": {"value": 0.08, "normalization": "none",
                                                                       "rule": "best", "source": loaded.source}}
    save_deploy_setting(tiny_checkpoint, "lambda", {"value": 0.4, "normalization": "tmm", "rule": "one-se",
                                                    "tuned_on": {}})
    carried = carry_hybrid(tmp_path, tiny_checkpoint)
    assert (carried.normalization, carried.rule) == (load_hybrid_config(tmp_path).normalization,
                                                     load_hybrid_config(tmp_path).rule) == ("tmm", "one-se")
    with pytest.raises(ConfigError, match=r"HybridConfig.rule must be one of \('best', 'one-se'\), got 'median'"):
        HybridConfig(rule="median")
    # tuned here: the file has no source, as before
    save_hybrid_config(tmp_path, HybridConfig(lam=0.3))
    assert "source" not in json.loads((tmp_path / "dense" / "hybrid.json").read_text())
    deploy_path(tiny_checkpoint).unlink()


def test_the_hybrid_defaults_to_the_normalization_the_checkpoint_was_trained_for(tiny_checkpoint, tmp_path):
    """A CLEAR trained with --bm25-scale query-max (its margin in units of the query's top BM25 score) is served
    on tmm scores unless a flag says otherwise; one trained on raw BM25, or never trained, on the raw Eq. 8."""
    import dataclasses
    import json
    import shutil

    from ckray.data.examples import TrainingDataConfig
    from ckray.errors import MissingArtifactError
    from ckray.models.checkpoint import TRAIN_SUMMARY_FILE
    from ckray.rankers.clear.hybrid import trained_normalization

    assert trained_normalization(tiny_checkpoint) == trained_normalization(None) == "none"   # never trained here
    for scale, want in (("query-max", "tmm"), ("raw", "none")):
        ckpt = tmp_path / scale
        shutil.copytree(tiny_checkpoint, ckpt)
        (ckpt / TRAIN_SUMMARY_FILE).write_text(json.dumps(
            {"name": "clear", "data_config": dataclasses.asdict(TrainingDataConfig(bm25_scale=scale))}))
        assert trained_normalization(ckpt) == want
    (tmp_path / "raw" / TRAIN_SUMMARY_FILE).write_text("{not json")
    with pytest.raises(MissingArtifactError, match=rf"{tmp_path / 'raw' / TRAIN_SUMMARY_FILE}: not a training summary"):
        trained_normalization(tmp_path / "raw")


def test_doc_id_map_finds_rows_refuses_unknown_ids_and_names_a_duplicate():
    import pyarrow as pa

    from ckray.rankers.clear.faiss_index import DocIdMap

    ids = [f"doc-{i}" for i in range(3000)]
    m = DocIdMap(pa.chunked_array([pa.array(ids[:1000]), pa.array(ids[1000:])]))
    assert len(m) == 3000 and [m[r] for r in (0, 1999, 2999)] == ["doc-0", "doc-1999", "doc-2999"]
    assert all(m.row(d) == i for i, d in enumerate(ids)) and m.row("doc-3000") is None
    assert m.first_duplicate() is None and DocIdMap(ids + ["doc-7"]).first_duplicate() == "doc-7"
    with pytest.raises(ConfigError, match="duplicate doc id 'd1'"):
        DenseIndex.build(["d0", "d1", "d1"], np.eye(3, dtype=np.float32))
    index = DenseIndex.build(["a", "b", "c"], np.eye(3, dtype=np.float32))
    assert "b" in index and "z" not in index
    with pytest.raises(KeyError, match="'z' is not in the dense index"):
        index.vectors(["a", "z"])


def test_bad_passage_settings_and_shards_are_errors_naming_what_is_wrong(tmp_path):
    with pytest.raises(ConfigError, match=r"EmbedConfig: passages must be >= 0"):
        EmbedConfig(passages=-1).validate()
    x = np.random.default_rng(5).normal(size=(5, 8)).astype(np.float32)
    out = tmp_path / "emb"
    write_embedding_shard(out / shard_name(0), ["a", "a", "b"], [x[:3]], False, {}, passage=[0, 1, 0])
    write_embedding_shard(out / shard_name(1), ["c", "d"], [x[3:]], False, {})        # one vector per document
    with pytest.raises(ConfigError, match=f"the embedding shards in {out} mix passage vectors and one vector per"):
        DenseIndex.from_shards(out)
    write_embedding_shard(out / shard_name(1), ["c", "c"], [x[3:]], False, {}, passage=[0, 1])
    index = DenseIndex.from_shards(out)                  # both shards with passages: three documents, five vectors
    assert (len(index), index.meta["count"]) == (3, 5)
    write_embedding_shard(out / shard_name(0), ["a"], [x[:1]], False, {}, passage=[1])
    with pytest.raises(ConfigError, match=r"start inside a document \(its passage 0 is missing\)"):
        DenseIndex.from_shards(out)
