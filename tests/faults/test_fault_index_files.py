"""An index's own files damaged in place: each index's stamp records its files (size and sha256), a
searcher refuses a damaged one naming the index, the file and the job that rebuilds it, and that job
rebuilds it. (The impact index's case is in tests/test_impact.py, beside the index it builds.)"""

from __future__ import annotations

import os
import re
import shutil
import time

import numpy as np
import pytest

from faultkit import flip_byte

from ckray.data.shards import changed_files, check_index_files, index_files_record, write_json_atomic
from ckray.errors import MissingArtifactError


def _biggest(directory, stamp: str):
    return max((f for f in directory.iterdir() if f.name != stamp), key=lambda f: f.stat().st_size)


def test_a_file_changed_in_place_at_its_size_is_found_and_an_untouched_copy_is_not(tmp_path):
    d = tmp_path / "index"
    d.mkdir()
    for name, size in (("a.bin", 4096), ("b.bin", 100)):
        (d / name).write_bytes(np.random.default_rng(len(name) + size).bytes(size))
    write_json_atomic(index_files_record(d, "stamp.json", "the job"), d / "stamp.json")
    check_index_files(d, "stamp.json")   # as written: accepted

    copy = tmp_path / "copy"
    shutil.copytree(d, copy, copy_function=shutil.copy)   # new times: a file newer than the stamp is hashed
    check_index_files(copy, "stamp.json")

    flip_byte(d / "a.bin", 2048)
    (d / "c.bin").write_bytes(b"x")
    os.remove(d / "b.bin")
    assert (d / "a.bin").stat().st_size == 4096
    with pytest.raises(MissingArtifactError, match=rf"index {d}: a\.bin, b\.bin, c\.bin differ.*rebuild it with the job"):
        check_index_files(d, "stamp.json")


def test_a_record_of_sizes_only_is_checked_by_size(tmp_path):
    """Stamps written before digests were recorded hold each file's size: a size change still shows."""
    d = tmp_path / "index"
    d.mkdir()
    (d / "a.bin").write_bytes(b"0123456789")
    stamp_ns = time.time_ns()
    assert changed_files(d, {"a.bin": 10}, stamp_ns) == []
    flip_byte(d / "a.bin", 5)
    assert changed_files(d, {"a.bin": 10}, stamp_ns) == []      # what a size cannot see
    os.truncate(d / "a.bin", 4)
    assert changed_files(d, {"a.bin": 10}, stamp_ns) == ["a.bin"]


def test_bm25_index_file_corrupted_in_place_is_refused_then_rebuilt_by_prepare(ray_session, reference, sample_data,
                                                                               tmp_path):
    """(``ray_session``: Ray starts before this process's JVM, ``ckray.lexical.jvm``.)"""
    from ckray.data.collections import read_beir_queries
    from ckray.lexical.bm25 import META, BM25Searcher, bm25_index_dir, bm25_retriever, build_bm25_index
    from ckray.serve import RetrieverSpec, retriever_missing

    w = tmp_path / "w"
    shutil.copytree(reference, w)
    index = bm25_index_dir(w)
    queries = dict(list(read_beir_queries(sample_data / "queries.jsonl").items())[:5])
    before = BM25Searcher(str(index), threads=1).search(queries, k=10)
    assert all(before.values())
    assert retriever_missing(RetrieverSpec(name="bm25"), w) is None
    damaged = _biggest(index, META)
    size = damaged.stat().st_size
    flip_byte(damaged, size // 2)
    assert damaged.stat().st_size == size
    refused = rf"index {index}: .*{damaged.name}.*rebuild it with jobs/prepare.py"
    with pytest.raises(MissingArtifactError, match=refused):
        BM25Searcher(str(index), threads=1)
    with pytest.raises(MissingArtifactError, match=refused):   # a pool of Ray actors: refused on the driver
        bm25_retriever(w, actors=1)
    assert re.fullmatch(refused + ".*", retriever_missing(RetrieverSpec(name="bm25"), w))  # Serve: unavailable
    build_bm25_index(w, threads=1)
    assert BM25Searcher(str(index), threads=1).search(queries, k=10) == before


def test_dense_index_file_corrupted_in_place_is_refused(tmp_path):
    from ckray.rankers.clear.faiss_index import IDS_FILE, INDEX_FILE, DenseIndex, IndexConfig

    vectors = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)   # unit length: each is its own nearest
    ids = [f"d{i}" for i in range(50)]
    built = DenseIndex.build(ids, vectors, IndexConfig(kind="flat"), meta={"checkpoint": "c"})
    directory = built.save(tmp_path / "dense")
    loaded = DenseIndex.load(directory)
    assert loaded.meta == built.meta    # the record of its files is the stamp's, not the index's metadata
    assert loaded.search(vectors[:1], 3)[0][0][0] == "d0"
    for name in (INDEX_FILE, IDS_FILE):
        copy = tmp_path / f"copy-{name}"
        shutil.copytree(directory, copy)
        flip_byte(copy / name, (copy / name).stat().st_size // 2)
        with pytest.raises(MissingArtifactError, match=rf"index {copy}: {name} differ.*jobs/build_dense_index.py"):
            DenseIndex.load(copy)
