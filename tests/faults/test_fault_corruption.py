"""A work directory's files damaged between runs, then the job run again: a corpus shard overwritten
with the same size and a truncated negatives file are detected by their markers and rebuilt to the
bytes of an undisturbed run; a truncated BM25 index file is rebuilt (an index file damaged at its size:
test_fault_index_files.py)."""

from __future__ import annotations

import os
import shutil

import pytest

from faultkit import assert_ok, flip_byte, prepare_args, run_job, same_files, same_tables

pytestmark = pytest.mark.slow


def test_damaged_shard_and_negatives_are_rebuilt_by_the_next_prepare(sample_data, reference, tmp_path):
    w = tmp_path / "w"
    shutil.copytree(reference, w)
    shard, negatives = w / "shards" / "part-00001.parquet", w / "negatives" / "train.parquet"
    flip_byte(shard, shard.stat().st_size // 3)  # same size, footer intact: only the digest tells
    os.truncate(negatives, negatives.stat().st_size // 2)
    p = run_job(prepare_args(sample_data, w))
    assert_ok(p)
    assert "1 of 3 shard(s) to write (2 already done)" in p.stdout
    same_files(reference, w, "shards/*")
    same_tables(reference / "negatives" / "train.parquet", negatives)


def test_truncated_bm25_index_file_is_rebuilt(reference, tmp_path):
    from ckray.lexical.bm25 import build_bm25_index

    w = tmp_path / "w"
    shutil.copytree(reference, w)
    biggest = max((f for f in (w / "bm25" / "index").iterdir() if f.name != "ckray_index.json"),
                  key=lambda f: f.stat().st_size)
    os.truncate(biggest, biggest.stat().st_size // 2)
    build_bm25_index(w, threads=1)
    assert biggest.stat().st_size == (reference / "bm25" / "index" / biggest.name).stat().st_size
