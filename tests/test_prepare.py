"""Ray Data sharding: row counts, idempotence, resume after a crash, bad input; the whole prepare stage."""

import json
import os
import time

import pyarrow.parquet as pq
import pytest

from ckray.data.collections import load_collection
from ckray.data.negatives import negatives_path
from ckray.data.prepare import PrepareConfig, prepare_collection, prepare_shards, requested_shards, split_file
from ckray.data.sample import generate_sample
from ckray.data.shards import DocStore, is_done, load_corpus_table, marker_path, read_corpus_dataset, shard_paths
from ckray.errors import CollectionError, ConfigError


@pytest.fixture()
def sample(tmp_path):
    return generate_sample(tmp_path / "data")


def test_split_file_covers_every_line_once(sample):
    path = sample / "corpus.jsonl"
    ranges = split_file(path, 5)
    data = path.read_bytes()
    assert ranges[0][0] == 0 and ranges[-1][1] == len(data)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    for start, end, first_line in ranges:
        assert data[:start].count(b"\n") + 1 == first_line
        assert start == 0 or data[start - 1:start] == b"\n"


def test_shards_sum_to_corpus_and_rerun_does_nothing(ray_session, sample, tmp_path):
    w = tmp_path / "w"
    manifest = prepare_shards(PrepareConfig(data=str(sample), workdir=str(w), shards=3))
    corpus = load_collection(sample).corpus
    assert sum(s["rows"] for s in manifest["shards"]) == corpus.num_rows == manifest["documents"]
    assert len(shard_paths(w)) == 3
    assert sorted(load_corpus_table(w).column("doc_id").to_pylist()) == sorted(corpus.column("doc_id").to_pylist())
    assert read_corpus_dataset(w).count() == corpus.num_rows
    assert DocStore(w).get("d00000") == (corpus["title"][0].as_py(), corpus["text"][0].as_py())
    mtimes = {p: p.stat().st_mtime_ns for p in shard_paths(w)}
    time.sleep(0.01)
    prepare_shards(PrepareConfig(data=str(sample), workdir=str(w), shards=3))
    assert {p: p.stat().st_mtime_ns for p in shard_paths(w)} == mtimes


def test_prepare_collection_keeps_the_shard_count_and_runs_the_steps_asked_for(ray_session, sample, tmp_path):
    w = tmp_path / "w"
    assert requested_shards(w) == PrepareConfig.shards and requested_shards(w, 5) == 5
    got = prepare_collection(sample, w, shards=3, split=None, bm25=False)  # shards only
    assert len(got.manifest["shards"]) == 3 and got.bm25_index is None and got.negatives is None and got.did_work
    assert not prepare_collection(sample, w, split=None, bm25=False).did_work  # up to date
    assert not (w / "bm25").exists() and requested_shards(w) == 3
    with pytest.raises(ValueError, match="BM25"):
        prepare_collection(sample, w, split="train", bm25=False)
    got = prepare_collection(sample, w, split="dev")  # no qrels for "dev": shards kept, BM25, no negatives
    assert got.manifest["num_shards_requested"] == 3 and got.bm25_index.is_dir() and got.negatives is None
    assert got.did_work  # the BM25 index
    got = prepare_collection(sample, w)  # the training split's negatives
    assert got.negatives == negatives_path(w, "train") and got.negatives.exists() and got.did_work
    assert not prepare_collection(sample, w).did_work  # everything up to date
    qids = pq.read_table(got.negatives, columns=["query_id"]).column(0).to_pylist()
    assert set(qids) <= set(load_collection(sample).qrels["train"])
    assert qids == sorted(qids)  # by query id: a reader of a range of queries reads only their row groups


def test_half_written_shard_is_redone_finished_ones_are_not(ray_session, sample, tmp_path):
    w = tmp_path / "w"
    prepare_shards(PrepareConfig(data=str(sample), workdir=str(w), shards=4))
    paths = shard_paths(w)
    before = {p: p.stat().st_mtime_ns for p in paths}
    # simulate a crash: shard 2 truncated mid-write, its marker still present; shard 3's marker lost
    paths[2].write_bytes(paths[2].read_bytes()[:100])
    os.remove(marker_path(paths[3]))
    (w / "shards" / "_manifest.json").unlink()
    time.sleep(0.01)
    manifest = prepare_shards(PrepareConfig(data=str(sample), workdir=str(w), shards=4))
    after = {p: p.stat().st_mtime_ns for p in paths}
    assert after[paths[0]] == before[paths[0]] and after[paths[1]] == before[paths[1]]
    assert after[paths[2]] != before[paths[2]] and after[paths[3]] != before[paths[3]]
    assert manifest["documents"] == load_collection(sample).corpus.num_rows
    assert all(pq.read_metadata(p).num_rows > 0 for p in paths)


def test_changed_input_rebuilds(ray_session, sample, tmp_path):
    w = tmp_path / "w"
    prepare_shards(PrepareConfig(data=str(sample), workdir=str(w), shards=2))
    with open(sample / "corpus.jsonl", "a") as f:
        f.write(json.dumps({"_id": "extra", "title": "t", "text": "new document"}) + "\n")
    manifest = prepare_shards(PrepareConfig(data=str(sample), workdir=str(w), shards=2))
    assert "extra" in load_corpus_table(w).column("doc_id").to_pylist()
    assert manifest["documents"] == load_collection(sample).corpus.num_rows
    assert all(is_done(p, {"input_sha256": manifest["input_sha256"]}) for p in shard_paths(w))


def test_malformed_line_is_reported_with_its_line_number(ray_session, sample, tmp_path):
    lines = (sample / "corpus.jsonl").read_text().splitlines()
    lines[200] = '{"_id": "broken", "text": '
    (sample / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(Exception, match=r"corpus\.jsonl:201: malformed JSON"):
        prepare_shards(PrepareConfig(data=str(sample), workdir=str(tmp_path / "w"), shards=3))


def test_duplicate_ids_across_shards(ray_session, sample, tmp_path):
    lines = (sample / "corpus.jsonl").read_text().splitlines()
    lines.append(lines[0])
    (sample / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    w = tmp_path / "w"
    with pytest.raises(CollectionError, match=rf"corpus\.jsonl:{len(lines)}: duplicate doc id 'd00000' \(first at line 1\)"):
        prepare_shards(PrepareConfig(data=str(sample), workdir=str(w), shards=3))
    assert not (w / "shards" / "_manifest.json").exists()  # never counted as prepared
    assert not (w / "bm25").exists()                       # found before any index is written
    with pytest.raises(CollectionError, match="duplicate doc id 'd00000'"):  # and again on a re-run
        prepare_collection(str(sample), str(w), shards=3, split=None, bm25=True)
    assert not (w / "bm25").exists()


def test_duplicate_ids_within_a_shard_are_named_with_both_lines(ray_session, sample, tmp_path):
    lines = (sample / "corpus.jsonl").read_text().splitlines()
    lines[4] = lines[2]
    (sample / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    assert load_collection(sample).stats["documents"] == len(lines)  # the driver's pass keeps no set of ids
    with pytest.raises(CollectionError, match=r"corpus\.jsonl:5: duplicate doc id 'd00002' \(first at line 3\)"):
        prepare_shards(PrepareConfig(data=str(sample), workdir=str(tmp_path / "w"), shards=1))
    assert not (tmp_path / "w" / "shards" / "_manifest.json").exists()


def test_shards_are_written_a_batch_at_a_time_and_never_half(tmp_path):
    """A shard task holds one batch of rows (a row group each); a malformed line stops it with no file."""
    from ckray.data.collections import corpus_lines, parse_corpus_lines
    from ckray.data.shards import write_corpus_parquet

    cfile = generate_sample(tmp_path / "data") / "corpus.jsonl"
    out = tmp_path / "part-00000.parquet"
    assert write_corpus_parquet(parse_corpus_lines("beir", cfile, corpus_lines(cfile)), out, batch_rows=100) == 360
    assert pq.read_metadata(out).num_row_groups == 4
    ids = [json.loads(line)["_id"] for line in cfile.read_text().splitlines()]
    assert pq.read_table(out).column("doc_id").to_pylist() == ids and len(set(ids)) == 360
    lines = cfile.read_text().splitlines()
    lines[250] = "{broken"
    cfile.write_text("\n".join(lines) + "\n")
    out.unlink()
    with pytest.raises(CollectionError, match=r"corpus\.jsonl:251: malformed JSON"):
        write_corpus_parquet(parse_corpus_lines("beir", cfile, corpus_lines(cfile)), out, batch_rows=100)
    assert list(tmp_path.glob("*.parquet")) == [] and list(tmp_path.glob(".part-*")) == []


def test_shard_count_grows_with_the_corpus_past_max_shard_mb():
    config = PrepareConfig(data="d", workdir="w", shards=4, max_shard_mb=32)
    assert [config.shard_count(n) for n in (0, 7_800_000, 128 * 2**20, 128 * 2**20 + 1, 3 * 2**30)] == [4, 4, 4, 5, 96]
    with pytest.raises(ConfigError, match="max_shard_mb"):
        PrepareConfig(data="d", workdir="w", max_shard_mb=0)


def test_a_corpus_larger_than_shards_times_max_shard_mb_gets_more_shards(ray_session, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "corpus.jsonl", "w") as f:   # about 2.6 MiB
        for i in range(9000):
            f.write(json.dumps({"_id": f"d{i}", "title": "", "text": f"word{i % 97} " * 30}) + "\n")
    w = tmp_path / "w"
    manifest = prepare_shards(PrepareConfig(data=str(data), workdir=str(w), shards=1, max_shard_mb=1))
    assert len(manifest["shards"]) == 3 and manifest["documents"] == 9000 and manifest["max_shard_mb"] == 1
    assert all(pq.read_metadata(p).num_rows > 0 for p in shard_paths(w))
    again = prepare_shards(PrepareConfig(data=str(data), workdir=str(w), shards=1, max_shard_mb=2))
    assert len(again["shards"]) == 2 and len(shard_paths(w)) == 2 and again["documents"] == 9000
