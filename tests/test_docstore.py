"""DocStore: every document as the corpus has it, unknown and duplicate ids, rebuild when stale or damaged,
concurrent first opens, and memory that does not grow with the corpus. Built from Parquet shards (no Ray)."""

import multiprocessing
import os
import pickle

import numpy as np
import pyarrow as pa
import pytest

from ckray.data.collections import CORPUS_SCHEMA, doc_text, load_collection
from ckray.data.docstore import HASHES, MARKER, HashedIds, id_hashes, store_dir
from ckray.workdir import WorkDir
from ckray.data.sample import generate_sample
from ckray.data.shards import DocStore, write_corpus_shards
from ckray.errors import CollectionError


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> pa.Table:
    """The sample collection's corpus plus a document without a title (a null, as the old store kept it)."""
    table = load_collection(generate_sample(tmp_path_factory.mktemp("data"))).corpus
    extra = pa.table([["untitled"], [None], ["a body without a title"]], schema=CORPUS_SCHEMA)
    return pa.concat_tables([table, extra])


def write_shards(workdir, table: pa.Table, cuts=(100, 250), source="sample") -> None:
    bounds = [0, *cuts, table.num_rows]
    write_corpus_shards(workdir, (table.slice(a, b - a) for a, b in zip(bounds, bounds[1:])), source)


def assert_store_equals(store: DocStore, table: pa.Table) -> None:
    ids, titles, texts = (table.column(c).to_pylist() for c in ("doc_id", "title", "text"))
    assert len(store) == len(ids) and list(store.ids()) == ids
    for doc_id, title, text in zip(ids, titles, texts):
        assert doc_id in store
        assert store.get(doc_id) == (title, text)
        assert store.text(doc_id) == doc_text(title, text)


def test_every_document_as_the_corpus_has_it(corpus, tmp_path):
    write_shards(tmp_path, corpus)
    store = DocStore(tmp_path)
    assert_store_equals(store, corpus)
    ids = corpus.column("doc_id").to_pylist()
    assert store.ids()[7] == ids[7] and store.ids()[-1] == ids[-1] and store.ids()[100:103] == ids[100:103]
    with pytest.raises(IndexError):
        store.ids()[len(ids)]
    assert store.get("untitled") == (None, "a body without a title") and store.text("untitled") == "a body without a title"
    assert [p.name for p in store.path.glob("part-*.arrow")] and (store.path / MARKER).exists()
    copy = pickle.loads(pickle.dumps(store.text))  # ships the work directory, not the documents
    assert len(pickle.dumps(store)) < 1000 and copy(ids[3]) == store.text(ids[3])


def test_unknown_id_is_a_key_error_naming_it(corpus, tmp_path):
    write_shards(tmp_path, corpus)
    store = DocStore(tmp_path)
    assert "no-such-doc" not in store and 17 not in store
    with pytest.raises(KeyError, match="no-such-doc"):
        store.get("no-such-doc")
    with pytest.raises(KeyError, match="no-such-doc"):
        store.text("no-such-doc")


def test_a_hash_collision_is_told_apart_by_the_stored_id(corpus, tmp_path):
    """Index entries that share a hash with another id: the lookup checks the id stored at each position."""
    write_shards(tmp_path, corpus)
    store = DocStore(tmp_path)
    index = store._index
    a, b = corpus.column("doc_id")[0].as_py(), corpus.column("doc_id")[1].as_py()
    h_a, h_ghost = id_hashes([a, "ghost"])
    pos_a, pos_b = (index.rows[int(index.sorted_hashes.searchsorted(h))] for h in id_hashes([a, b]))
    # first among a's hash: an entry pointing at b; "ghost"'s hash pointing at a
    hashes = np.concatenate([[h_a, h_ghost], index.sorted_hashes])
    positions = np.concatenate([[pos_b, pos_a], index.rows])
    order = hashes.argsort(kind="stable")
    index.sorted_hashes, index.rows = hashes[order], positions[order]
    assert store.get(a) == (corpus["title"][0].as_py(), corpus["text"][0].as_py())
    assert store.get(b) == (corpus["title"][1].as_py(), corpus["text"][1].as_py())
    assert "ghost" not in store
    assert index.duplicate() is None   # equal hashes of different ids are no duplicate


def test_a_duplicate_is_found_within_a_run_of_equal_hashes_not_only_between_neighbours():
    """Three rows of one hash (a collision), ids a, b, a: neighbours differ, the run holds a twice."""
    ids = ["a", "b", "a", "c"]
    index = HashedIds(np.array([7, 7, 7, 9], np.uint64), np.array([0, 1, 2, 3]), ids.__getitem__)
    assert index.duplicate() == ("a", 0, 2)
    assert HashedIds(np.array([7, 7, 9], np.uint64), np.array([0, 1, 3]), ids.__getitem__).duplicate() is None
    real = HashedIds.of(id_hashes(ids[1:]), ids[1:].__getitem__)
    assert [real.row(d) for d in ("b", "a", "c", "z")] == [0, 1, 2, None] and real.duplicate() is None


def test_duplicate_id_names_the_id_and_its_shards(corpus, tmp_path):
    dup = corpus.slice(120, 1).column("doc_id")[0].as_py()
    twice = pa.concat_tables([corpus, corpus.slice(120, 1)])  # the last shard repeats a doc of the second
    write_shards(tmp_path, twice)
    with pytest.raises(CollectionError, match=rf"duplicate document id '{dup}'.*part-00001.parquet and part-00002.parquet"):
        DocStore(tmp_path)
    assert not any(p for p in WorkDir(tmp_path).docstore.iterdir() if p.is_dir())  # nothing half-built left


def test_a_document_without_an_id_names_its_shard_and_row(corpus, tmp_path):
    no_id = pa.table([[None], ["t"], ["x"]], schema=CORPUS_SCHEMA)
    write_shards(tmp_path, pa.concat_tables([corpus, no_id]))
    with pytest.raises(CollectionError, match=rf"part-00002.parquet: row {corpus.num_rows - 250}: a document without a doc_id"):
        DocStore(tmp_path)


def test_a_re_prepared_corpus_makes_the_store_stale_and_rebuilt(corpus, tmp_path):
    write_shards(tmp_path, corpus)
    old = DocStore(tmp_path)
    first = corpus.column("doc_id")[0].as_py()
    changed = pa.concat_tables([corpus.slice(1), pa.table([["new-doc"], ["New"], ["fresh text"]], schema=CORPUS_SCHEMA)])
    write_shards(tmp_path, changed, cuts=(50,), source="sample-v2")
    store = DocStore(tmp_path)
    assert store.path != old.path and not old.path.exists()  # the stale store is removed
    assert_store_equals(store, changed)
    assert first not in store and store.get("new-doc") == ("New", "fresh text")


@pytest.mark.parametrize("damage", ["truncate-arrow", "truncate-index", "delete-arrow", "delete-marker"])
def test_a_damaged_store_is_detected_and_rebuilt_never_read(corpus, tmp_path, damage):
    write_shards(tmp_path, corpus)
    path = DocStore(tmp_path).path
    target = {"truncate-arrow": "part-00001.arrow", "truncate-index": HASHES, "delete-arrow": "part-00002.arrow",
              "delete-marker": MARKER}[damage]
    if damage.startswith("truncate"):
        os.truncate(path / target, (path / target).stat().st_size // 2)
    else:
        (path / target).unlink()
    store = DocStore(tmp_path)
    assert store.path == path and (path / target).exists()
    assert_store_equals(store, corpus)


def synthetic(n: int, words: int = 300) -> pa.Table:
    """``n`` documents ``doc<i>`` of about ``6 * words`` bytes each."""
    body = " ".join(["lorem ipsum dolor sit amet consectetur"] * (words // 6))
    return pa.table([[f"doc{i}" for i in range(n)], [f"title {i}" for i in range(n)], [f"{i} {body}" for i in range(n)]],
                    schema=CORPUS_SCHEMA)


def _open_together(barrier, results, workdir: str) -> None:
    barrier.wait()
    store = DocStore(workdir)
    results.put((store.path.stat().st_ino, len(store), store.get("doc123")))


def test_concurrent_first_opens_build_once(tmp_path):
    table = synthetic(20_000)  # a build long enough for the four opens to overlap
    write_shards(tmp_path, table, cuts=(7_000, 14_000))
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_open_together, args=(barrier, results, str(tmp_path))) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * 4
    got = [results.get(timeout=5) for _ in procs]
    path = store_dir(tmp_path)
    # one build: a second one would have replaced the directory (another inode) or left a temporary one
    assert set(got) == {(path.stat().st_ino, 20_000, ("title 123", table["text"][123].as_py()))}
    assert [p.name for p in WorkDir(tmp_path).docstore.iterdir() if p.is_dir()] == [path.name]


def _rss_anon_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def test_opening_and_reading_every_document_does_not_hold_the_corpus(tmp_path):
    n = 20_000
    table = synthetic(n)  # ~2 KB a document, ~40 MB
    body_chars = len(table["text"][0].as_py()) - 2
    corpus_kb = table.nbytes // 1024
    write_shards(tmp_path, table, cuts=(7_000, 14_000))
    del table
    DocStore(tmp_path)  # the build (its transient buffers are not what is measured)
    before = _rss_anon_kb()
    store = DocStore(tmp_path)
    total = sum(len(store.get(f"doc{i}")[1]) for i in range(n))
    grown = _rss_anon_kb() - before
    assert total == n * (body_chars + 1) + sum(len(str(i)) for i in range(n))
    assert grown < corpus_kb / 8, f"RssAnon grew {grown} kB reading a {corpus_kb} kB corpus"


def test_iter_doc_texts_streams_every_document_in_corpus_order(corpus, tmp_path):
    from ckray.data.shards import iter_doc_texts

    write_shards(tmp_path, corpus)
    want = [doc_text(t, x) for t, x in zip(corpus.column("title").to_pylist(), corpus.column("text").to_pylist())]
    assert list(iter_doc_texts(tmp_path, batch_rows=7)) == want  # batches cut across shard boundaries too
