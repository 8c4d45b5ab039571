"""Ray Data batch inference (ckray/batch_inference.py): keyed results after a lost actor — a repeated
row is dropped, a missing one is an error naming it — and the shard job that the impact and
embedding jobs share."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ckray.batch_inference import (ActorPoolConfig, BatchInferenceError, KeyedRows, ShardJob, crash_once,
                                   raise_if_missing, run_shard_job, steady_rate, timing_columns)
from ckray.data.shards import is_done, mark_done, shard_name, write_parquet_atomic
from ckray.errors import CollectionError

SIZES = (7, 0, 5)


# --------------------------------------------------------------------------- driver-side pieces

def test_a_repeated_row_is_dropped_and_the_first_copy_kept():
    rows = KeyedRows(["a", "b", "c"], "part-00000.parquet")
    assert rows.add("b", 1.0) and rows.add("a", 2.0)
    assert not rows.add("b", 99.0)           # a retried batch delivered b again
    assert not rows.complete() and rows.missing() == ["c"]
    assert rows.add("c", 3.0) and rows.complete()
    assert rows.values() == [2.0, 1.0, 3.0]  # in the order asked, not the order of arrival


def test_a_row_nobody_asked_for_is_an_error_naming_it():
    rows = KeyedRows([("q1", "d1")], "Ray reranking")
    with pytest.raises(BatchInferenceError, match=r"Ray reranking: .*\('q1', 'd9'\)"):
        rows.add(("q1", "d9"), 0.5)


def test_missing_rows_are_an_error_naming_them_per_group():
    done, short = KeyedRows(["x"], "part-00000.parquet"), KeyedRows([f"d{i}" for i in range(8)], "part-00002.parquet")
    done.add("x", 0)
    for i in (0, 2):
        short.add(f"d{i}", 0)
    raise_if_missing([done], "embedding", "re-run it")   # nothing missing: no error
    with pytest.raises(BatchInferenceError) as err:
        raise_if_missing([done, short], "embedding", "re-run it")
    msg = str(err.value)
    assert "6 result(s) missing" in msg and "part-00002.parquet: 6 ('d1', 'd3', 'd4', 'd5', 'd6', …)" in msg
    assert "part-00000" not in msg and msg.endswith("re-run it")


def test_steady_rate_counts_documents_after_the_first_completion():
    # batches of 10 finishing at t = 100 (after start-up), 102, 104, 106 → 30 docs in 6 s
    assert steady_rate([(104.0, 10), (100.0, 10), (106.0, 10), (102.0, 10)]) == pytest.approx(5.0)
    assert steady_rate([(1.0, 10)]) == 0.0


def test_timing_columns_share_a_batch_between_its_rows():
    wall0, cpu0 = time.perf_counter() - 2.0, time.process_time()
    cols = timing_columns(4, wall0, cpu0)
    assert cols["_seconds"].shape == (4,) and cols["_seconds"][0] == pytest.approx(0.5, abs=0.05)
    assert len(set(cols["_done_at"])) == 1 and timing_columns(0, wall0, cpu0)["_seconds"].shape == (0,)


def test_pool_checks_name_the_field():
    assert [m for ok, m in ActorPoolConfig(actors=0, cpus_per_actor=0).pool_checks() if not ok] == \
        ["actors must be >= 1", "cpus_per_actor must be > 0"]
    assert all(ok for ok, _ in ActorPoolConfig().pool_checks())


# --------------------------------------------------------------------------- the shard job on Ray

def _lengths_actor() -> type:
    """A model-free Ray Data actor class: each document's text length. ``repeat`` returns every row
    twice (a batch delivered again after a retry); ``drop`` leaves one document out; ``refuse`` raises a
    CkrayError on the batch holding that document. (Made inside a
    function so Ray ships the class by value: workers cannot import the tests.)"""

    class Lengths:
        def __init__(self, repeat: bool = False, drop: str | None = None, crash: str | None = None,
                     refuse: str | None = None):
            self.repeat, self.drop, self.crash, self.refuse = repeat, drop, crash, refuse

        def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            crash_once(self.crash)
            if self.refuse in batch["doc_id"]:
                raise CollectionError(f"document {self.refuse}: its text cannot be scored (line 10 of corpus.jsonl)")
            wall0, cpu0 = time.perf_counter(), time.process_time()
            keep = np.array([d != self.drop for d in batch["doc_id"]], dtype=bool)
            out = {"doc_id": batch["doc_id"][keep], "path": batch["path"][keep],
                   "length": np.array([len(t) for t in batch["text"][keep]], np.int64)}
            if self.repeat:
                out = {k: np.concatenate([v, v]) for k, v in out.items()}
            return {**out, **timing_columns(len(out["doc_id"]), wall0, cpu0)}

    return Lengths


def _corpus(root: Path) -> list[Path]:
    paths, n = [], 0
    for i, size in enumerate(SIZES):
        ids = [f"d{n + j:03d}" for j in range(size)]
        n += size
        table = pa.table({"doc_id": pa.array(ids, pa.string()), "title": pa.array(["t"] * size, pa.string()),
                          "text": pa.array([d * (int(d[1:]) + 1) for d in ids], pa.string())})
        write_parquet_atomic(table, root / "shards" / shard_name(i))
        paths.append(root / "shards" / shard_name(i))
    return paths


def _job(root: Path, sources: list[Path], **actor_kwargs) -> ShardJob:
    def write(path: Path, ids: list[str], lengths: list[int], stamp: dict) -> None:
        write_parquet_atomic(pa.table({"doc_id": pa.array(ids, pa.string()), "length": pa.array(lengths, pa.int64())}),
                             path)
        mark_done(path, stamp)

    return ShardJob(what="length scoring", sources=sources, out_dir=root / "out",
                    stamps={s.name: {"source": s.name} for s in sources}, actor=_lengths_actor(),
                    actor_kwargs=actor_kwargs,
                    pool=ActorPoolConfig(actors=2, batch_size=3), payloads=lambda batch: batch["length"].tolist(),
                    write=write)


def _written(root: Path) -> dict[str, list]:
    return {p.name: pq.read_table(p).to_pylist() for p in sorted((root / "out").glob("part-*.parquet"))}


@pytest.mark.slow
def test_shard_job_keeps_each_document_once_after_a_lost_actor_and_repeated_rows(tmp_path, ray_session):
    sources = _corpus(tmp_path)
    marker = tmp_path / "crashed"
    summary = run_shard_job(_job(tmp_path, sources, repeat=True, crash=str(marker)))
    assert marker.exists()                     # one actor really died; Ray retried its batch
    assert summary["shards_written"] == 3 and summary["documents"] == 12 and summary["repeated_rows"] >= 12
    out = _written(tmp_path)
    for source in sources:                     # every document once, in the corpus shard's order
        want = pq.read_table(source).column("doc_id").to_pylist()
        assert [r["doc_id"] for r in out[source.name]] == want
        assert [r["length"] for r in out[source.name]] == [len(d * (int(d[1:]) + 1)) for d in want]
        assert is_done(tmp_path / "out" / source.name, {"source": source.name})
    again = run_shard_job(_job(tmp_path, sources))
    assert again["shards_skipped"] == 3 and again["documents"] == 0


@pytest.mark.slow
def test_shard_job_holds_one_shard_at_a_time_whatever_the_corpus(tmp_path, ray_session):
    """Ten shards on two actors: results come back in the shards' order, so the driver opens a shard's group on
    its first row and writes it before the next one opens (two at once where a batch straddles the boundary)."""
    sources = []
    for i in range(10):
        ids = [f"s{i}d{j}" for j in range(7)]
        write_parquet_atomic(pa.table({"doc_id": ids, "title": ["t"] * 7, "text": [d * 3 for d in ids]}),
                             tmp_path / "shards" / shard_name(i))
        sources.append(tmp_path / "shards" / shard_name(i))
    summary = run_shard_job(_job(tmp_path, sources))
    assert summary["shards_written"] == 10 and summary["documents"] == 70
    assert 1 <= summary["max_open_shards"] <= 2
    out = _written(tmp_path)
    assert [[r["doc_id"] for r in out[s.name]] for s in sources] == \
        [pq.read_table(s).column("doc_id").to_pylist() for s in sources]


@pytest.mark.slow
def test_shard_job_names_a_document_that_never_came_back(tmp_path, ray_session):
    sources = _corpus(tmp_path)
    with pytest.raises(BatchInferenceError, match=r"part-00002\.parquet: 1 \('d009'\)"):
        run_shard_job(_job(tmp_path, sources, drop="d009"))
    assert set(_written(tmp_path)) == {shard_name(0), shard_name(1)}   # the complete shards are kept


@pytest.mark.slow
def test_a_ckray_error_in_an_actor_reaches_the_job_as_its_own_message(tmp_path, ray_session, caplog):
    """Raised inside a Ray Data actor, a CkrayError comes out of the shard job as itself (same type and
    message, not Ray's wrapper), so a job ends with that one line and exit 2; finished shards are kept."""
    from ckray.cli import base_parser, run_job

    sources = _corpus(tmp_path)
    message = "document d009: its text cannot be scored (line 10 of corpus.jsonl)"
    raised: list[tuple[type, str]] = []

    def main(args) -> None:
        try:
            run_shard_job(_job(tmp_path, sources, refuse="d009"))
        except Exception as e:
            raised.append((type(e), str(e)))
            raise

    with pytest.raises(SystemExit) as exit_:
        run_job(main, base_parser("a shard job", data=False), ["--workdir", str(tmp_path)])
    assert raised == [(CollectionError, message)]   # its own type and message, not Ray's wrapper
    assert exit_.value.code == 2
    errors = [r.getMessage() for r in caplog.records if r.name == "ckray" and r.levelname == "ERROR"]
    assert errors == [message]
    assert shard_name(2) not in _written(tmp_path) and not list((tmp_path / "out").glob(".*tmp*"))


@pytest.mark.slow
def test_batch_reranking_scores_each_pair_once_after_a_lost_actor(tmp_path, ray_session, minilm_path):
    """An actor of Ray reranking (ckray.rerank) killed with SIGKILL while the job runs: Ray restarts it and
    retries its batch; every (query, document) pair comes back once, with the scores of one process."""
    import os
    import signal
    import threading

    import psutil
    import torch

    from ckray.models.checkpoint import load_model, save_model
    from ckray.rankers.cedr.model import CEDRConfig, CEDRRanker
    from ckray.rerank import rerank, rerank_local

    torch.manual_seed(0)
    tiny = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=64)
    checkpoint = save_model(CEDRRanker(CEDRConfig(variant="knrm", random_init=tiny, max_length=32, max_query_len=8)),
                            tmp_path / "cedr")
    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(50)]
    docs = {f"d{i}": " ".join(rng.choice(words, 12)) for i in range(40)}
    queries = {f"q{i}": " ".join(rng.choice(words, 3)) for i in range(15)}
    run = {q: [(f"d{j}", float(40 - j)) for j in rng.permutation(40)] for q in queries}
    out: dict = {}
    job = threading.Thread(target=lambda: out.update(run=rerank(checkpoint, queries, run, docs, depth=40,
                                                                batch_size=4, num_actors=2)))
    job.start()
    killed = None
    while killed is None and job.is_alive():  # an actor of this test's own Ray (a descendant of this process)
        for p in psutil.Process().children(recursive=True):
            try:
                if "PairScorer" in " ".join(p.cmdline()):
                    os.kill(p.pid, signal.SIGKILL)
                    killed = p.pid
                    break
            except psutil.Error:
                continue
        time.sleep(0.1)
    job.join(timeout=600)
    assert killed is not None, "the job ended before an actor could be killed"
    local = rerank_local(load_model(checkpoint), queries, run, docs, depth=40, batch_size=4)
    assert out["run"].keys() == local.keys()
    for q in local:
        assert sorted(d for d, _ in out["run"][q]) == sorted(docs)   # every pair once, none lost
        assert dict(out["run"][q]) == pytest.approx(dict(local[q]), abs=1e-5)


@pytest.mark.slow
def test_a_ckray_error_in_a_reranking_actor_reaches_the_caller_as_its_own_message(tmp_path, ray_session):
    """Ray reranking (ckray.rerank) surfaces a CkrayError its actor's model raised as itself: the same
    type and one-line message, not Ray's RayTaskError or Ray Data's wrapper and their tracebacks."""
    from refusing_ranker import REFUSED, RefusingConfig, RefusingModel, refusal

    from ckray.models.checkpoint import save_model
    from ckray.rerank import rerank

    checkpoint = save_model(RefusingModel(RefusingConfig()), tmp_path / "refusing")
    docs = {f"d{i}": f"plain words number {i}" for i in range(12)}
    docs["d7"] = f"words and one {REFUSED} word"
    queries = {"q1": "plain words", "q2": "number word"}
    run = {q: [(d, float(12 - i)) for i, d in enumerate(docs)] for q in queries}
    assert rerank(checkpoint, queries, {q: hits[:7] for q, hits in run.items()}, docs, depth=7, batch_size=4)
    with pytest.raises(CollectionError) as raised:
        rerank(checkpoint, queries, run, docs, depth=12, batch_size=4)
    assert type(raised.value) is CollectionError and str(raised.value) == refusal(docs["d7"])


def test_an_actor_pool_that_takes_every_cpu_is_warned_about(ray_session, caplog):
    """Ray Data's read tasks need a CPU beside the pool's; without one the job waits forever."""
    import logging

    import ray.data

    from ckray.batch_inference import map_on_actors

    cpus = ray_session.cluster_resources()["CPU"]
    with caplog.at_level(logging.WARNING, logger="ckray"):
        map_on_actors(ray.data.range(4), _lengths_actor(), {}, ActorPoolConfig(actors=1, cpus_per_actor=cpus - 1))
        assert not [r for r in caplog.records if "takes" in r.getMessage()]
        map_on_actors(ray.data.range(4), _lengths_actor(), {}, ActorPoolConfig(actors=2, cpus_per_actor=cpus / 2))
    assert [r.getMessage() for r in caplog.records if "leaves Ray Data's read tasks none" in r.getMessage()]
