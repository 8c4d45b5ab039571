"""The fault-injection suite's helpers: jobs run as real subprocesses (each its own local Ray), killed
with SIGKILL at a seeded random point, and work directories compared file by file."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[2]


def job_env() -> dict[str, str]:
    """The environment a job runs in: this one, without a Ray address (each job starts a local Ray)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    return env


def run_job(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python jobs/<args>`` to completion."""
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, env=job_env(),
                          timeout=timeout)


def kill_job_at(args: list[str], ready: Callable[[str], bool], rng: random.Random, log: Path,
                max_delay: float = 2.0, timeout: float = 600) -> str:
    """Start ``python jobs/<args>``, wait until ``ready(output so far)``, then a random 0..``max_delay`` s
    more, and SIGKILL the driver (then whatever it started, by process group: its local Ray). Fails
    when the job ended by itself first. Returns the driver's output."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env=job_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not ready(log.read_text(errors="replace")):
            assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before the kill point:\n" + log.read_text()
            assert time.monotonic() < deadline, "the kill point was never reached:\n" + log.read_text()
            time.sleep(0.05)
        time.sleep(rng.uniform(0, max_delay))
        assert proc.poll() is None, f"the job ended (exit {proc.returncode}) before it was killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver's local Ray, started in its session
        except ProcessLookupError:
            pass
    return log.read_text(errors="replace")


def assert_ok(p: subprocess.CompletedProcess) -> None:
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]


def same_files(a: Path, b: Path, pattern: str, exclude: tuple[str, ...] = ()) -> list[str]:
    """The names matching ``pattern`` under ``a`` (less those in ``exclude``), asserted to be the same set
    with the same bytes under ``b``."""
    def listing(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.glob(pattern) if p.is_file() and p.name not in exclude)

    names = listing(a)
    assert names == listing(b)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    return names


# Impact weights are scored in batches of documents padded to the batch's longest; a resumed job's batches
# hold other documents than an uninterrupted job's (Ray Data batches straddle shard boundaries), and on some
# CPUs a matrix product's float rounding depends on its shape: the same document's weights then differ in
# the last bit (about 1e-7). What Lucene indexes, the quantised impacts, is compared to one quantisation step.
WEIGHT_ROUNDING = dict(rel=1e-5, abs=1e-6)
DIGESTS = ("sha256", "bytes", "jsonl_sha256")


def same_impact_shards(a: Path, b: Path) -> list[str]:
    """The impact shards (``impact/shards/*``) under ``a`` and ``b``: the same names, documents and terms,
    weights equal to float rounding (``WEIGHT_ROUNDING``), and markers equal but for the digests of those
    bytes."""
    import json

    import pytest

    def listing(root: Path) -> list[str]:
        return sorted(p.name for p in (root / "impact" / "shards").iterdir() if p.is_file())

    names = listing(a)
    assert names == listing(b)
    for name in names:
        x, y = a / "impact" / "shards" / name, b / "impact" / "shards" / name
        if name.endswith(".parquet"):
            rx, ry = pq.read_table(x).to_pylist(), pq.read_table(y).to_pylist()
            assert [r["doc_id"] for r in rx] == [r["doc_id"] for r in ry], name
            for r, s in zip(rx, ry):
                wx, wy = dict(zip(r["terms"], r["weights"])), dict(zip(s["terms"], s["weights"]))
                assert wx.keys() == wy.keys(), (name, r["doc_id"])
                assert [wy[t] for t in wx] == pytest.approx(list(wx.values()), **WEIGHT_ROUNDING), (name, r["doc_id"])
        else:
            assert same_but_digests(json.loads(x.read_text()), json.loads(y.read_text())), name
    return names


def same_but_digests(x: dict, y: dict) -> bool:
    """Two markers or metadata files equal but for digests of bytes, floats to ``WEIGHT_ROUNDING``."""
    import pytest

    assert x.keys() == y.keys()
    for key, value in x.items():
        if key in DIGESTS:
            continue
        if isinstance(value, dict):
            same_but_digests(value, y[key])
        elif isinstance(value, float):
            assert y[key] == pytest.approx(value, **WEIGHT_ROUNDING), key
        else:
            assert y[key] == value, key
    return True


def same_impact_lines(a: Path, b: Path) -> None:
    """The JSON lines Lucene indexes under ``a`` and ``b``: the same documents and terms, each quantised
    impact within one step."""
    import json

    names = sorted(p.name for p in (a / "impact" / "jsonl").glob("*.jsonl"))
    assert names == sorted(p.name for p in (b / "impact" / "jsonl").glob("*.jsonl")) and names
    for name in names:
        lx = (a / "impact" / "jsonl" / name).read_text().splitlines()
        ly = (b / "impact" / "jsonl" / name).read_text().splitlines()
        assert len(lx) == len(ly), name
        for p, q in zip(lx, ly):
            dx, dy = json.loads(p), json.loads(q)
            assert dx["id"] == dy["id"] and dx["vector"].keys() == dy["vector"].keys(), (name, dx["id"])
            assert all(abs(dx["vector"][t] - dy["vector"][t]) <= 1 for t in dx["vector"]), (name, dx["id"])


def same_tables(a: Path, b: Path) -> None:
    assert pq.read_table(a).equals(pq.read_table(b)), (a, b)


def prepare_args(data: Path, w: Path) -> list[str]:
    """jobs/prepare.py on a small collection: 3 shards, BM25 negatives of depth 50."""
    return ["jobs/prepare.py", "--data", str(data), "--workdir", str(w), "--shards", "3", "--negative-depth", "50",
            "--threads", "1"]


def evaluate_args(data: Path, w: Path) -> list[str]:
    """jobs/evaluate.py: BM25 on the test split."""
    return ["jobs/evaluate.py", "--data", str(data), "--workdir", str(w), "--pipeline", "bm25", "--split", "test",
            "--k", "100"]


def flip_byte(path: Path, offset: int) -> None:
    """Overwrite one byte of ``path`` in place (same size), as a bad disk or a stray write would."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# A CK-QTI small enough to train in about a minute on two cores: one worker (Ray Train on one process),
# one Conformer block, six steps with a checkpoint every two.
TINY_CK = ["--workers", "1", "--max-steps", "6", "--eval-every", "2", "--batch-size", "2", "--layers", "1",
           "--max-doc-len", "128", "--max-dev-queries", "5", "--dev-depth", "10", "--no-eval-at-start"]


def train_args(data: Path, w: Path) -> list[str]:
    """jobs/train_ck.py with :data:`TINY_CK`; writes W/checkpoints/ck-qti, its run under W/train."""
    return ["jobs/train_ck.py", "--data", str(data), "--workdir", str(w), *TINY_CK]


def impact_args(data: Path, w: Path, checkpoint: Path) -> list[str]:
    """jobs/build_impact_index.py: one actor, batches of 8 documents (many batches per shard)."""
    return ["jobs/build_impact_index.py", "--data", str(data), "--workdir", str(w), "--checkpoint", str(checkpoint),
            "--actors", "1", "--batch-size", "8", "--top-k", "32", "--index-threads", "1"]


def dense_args(data: Path, w: Path, checkpoint: Path) -> list[str]:
    """jobs/build_dense_index.py: one actor, a flat index, λ tuned on the training queries."""
    return ["jobs/build_dense_index.py", "--data", str(data), "--workdir", str(w), "--checkpoint", str(checkpoint),
            "--actors", "1", "--index", "flat"]


def same_weights(a: Path, b: Path) -> list[str]:
    """The tensors of two saved checkpoints' ``model.safetensors``, asserted equal; returns their names."""
    import torch
    from safetensors.torch import load_file

    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert sorted(wa) == sorted(wb)
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, f"weights differ: {differ[:5]}"
    return sorted(wa)
