"""SIGKILL of a job's driver at a seeded random point, then the same command again: the job resumes
from what was finished, redoes the rest, and its outputs equal those of an uninterrupted run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from faultkit import assert_ok, evaluate_args, kill_job_at, prepare_args, run_job, same_files, same_tables

pytestmark = pytest.mark.slow

SEED = 25


@pytest.fixture(scope="module")
def resumed(sample_data, tmp_path_factory) -> Path:
    """prepare killed once at a random point (a random one of its steps, then a random delay), then run again."""
    rng = random.Random(SEED)
    root = tmp_path_factory.mktemp("killed")
    w = root / "w"
    w_str = str(w)
    steps = {  # output so far → the step is under way
        "shards": lambda out: "shard(s) to write" in out,
        "docstore": lambda out: "document store" in out or (w / "docstore").exists(),
        "bm25": lambda out: (w / "bm25").exists(),
    }
    step = rng.choice(sorted(steps))
    out = kill_job_at(prepare_args(sample_data, w), steps[step], rng, root / "killed.log", max_delay=1.0)
    assert w_str in out or step != "shards"
    again = run_job(prepare_args(sample_data, w))
    assert_ok(again)
    return w


def test_prepare_killed_then_rerun_equals_an_uninterrupted_run(reference, resumed):
    shards = same_files(reference, resumed, "shards/*")  # shard bytes, markers, manifest
    assert {"_manifest.json", "part-00000.parquet", "part-00002.parquet.done.json"} <= {Path(s).name for s in shards}
    # the BM25 stamp: the same shards, documents and Lucene files of the same sizes; not the same sha256,
    # since Lucene writes a random id into each segment it builds
    stamps = [json.loads((w / "bm25" / "index" / "ckray_index.json").read_text()) for w in (reference, resumed)]
    for stamp in stamps:
        assert all(record.pop("sha256") for record in stamp["files"].values())
    assert stamps[0] == stamps[1]
    stores = [next(p for p in (w / "docstore").iterdir() if p.is_dir()) for w in (reference, resumed)]
    # the document store's data (its directory and store.json record the shards' mtimes)
    assert len(same_files(*stores, "*", exclude=("store.json",))) >= 2
    for name in ("train.parquet",):
        same_tables(reference / "negatives" / name, resumed / "negatives" / name)
    assert not list(resumed.rglob(".*tmp*")), "a temporary file was left behind"


def test_evaluate_killed_then_rerun_equals_an_uninterrupted_run(sample_data, reference, resumed, tmp_path):
    rng = random.Random(SEED + 1)
    out = kill_job_at(evaluate_args(sample_data, resumed), lambda out: "ckray" in out or "Ray" in out, rng,
                      tmp_path / "killed.log", max_delay=3.0)
    assert "nDCG@10" not in out  # killed before it finished
    assert_ok(run_job(evaluate_args(sample_data, resumed)))
    same_files(reference, resumed, "runs/bm25-test.trec")
    assert json.loads((resumed / "metrics" / "bm25-test.json").read_text()) == \
        json.loads((reference / "metrics" / "bm25-test.json").read_text())
    same_files(reference, resumed, "metrics/*")
