"""A work directory on a full or a read-only file system: the write fails with a CkrayError (a job: exit 2)
naming the path and the reason, no temporary file is left, and what was there before is untouched.

The file systems are a tiny tmpfs in a mount namespace of the test's own (``unshare -m``), remounted
read-only where asked (root ignores file permissions, not a read-only mount). Skipped where mount
namespaces cannot be made."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from faultkit import ROOT, job_env


def in_mount_namespace(script: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a bash ``script`` in a private mount namespace (its mounts vanish with it)."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare (util-linux) to make a mount namespace")
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-c",
                            "d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && umount $d && rmdir $d"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")
    return subprocess.run(["unshare", "-m", "--propagation", "private", "bash", "-euc", script], cwd=ROOT,
                          env={**job_env(), "PYTHON": sys.executable}, capture_output=True, text=True, timeout=timeout)


WRITERS = r'''
import json, os, sys
from pathlib import Path
import numpy as np, pyarrow as pa
from ckray.data.collections import write_trec_run
from ckray.data.shards import write_json_atomic, write_parquet_atomic
from ckray.errors import CkrayError

d, mode = Path(sys.argv[1]), sys.argv[2]
rng = np.random.default_rng(0)
big = pa.table({"doc_id": [f"d{i}" for i in range(2000)],
                "text": [rng.bytes(200).hex() for _ in range(2000)]})  # ~800 kB, incompressible
results = {}
for name, write in (("part.parquet", lambda p: write_parquet_atomic(big, p)),
                    ("meta.json", lambda p: write_json_atomic({"x": "y" * 400_000}, p)),
                ("run.trec", lambda p: write_trec_run({f"q{i}": [(f"d{j}", 1.0) for j in range(1000)]
                                                       for i in range(20)}, p))):  # ~0.6 MB
    try:
        write(d / name)
        results[name] = "written"
    except CkrayError as e:
        results[name] = str(e)
if mode == "checkpoint":
    import torch
    from ckray.models.checkpoint import save_model
    from ckray.rankers.cedr.model import CEDRConfig, CEDRRanker
    tiny = dict(vocab_size=4000, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, max_position_embeddings=64)
    try:
        save_model(CEDRRanker(CEDRConfig(variant="knrm", random_init=tiny, max_length=64, max_query_len=8,
                                         max_segments=1)), d / "ckpt")
        results["ckpt"] = "written"
    except CkrayError as e:
        results["ckpt"] = str(e)
print("RESULTS " + json.dumps(results))
'''


def previous_artifacts() -> str:
    """bash: write the artifacts a failed write must leave alone."""
    return ('mkdir -p "$D/ckpt" && echo previous > "$D/part.parquet" && echo "{}" > "$D/meta.json" '
            '&& echo "q0 Q0 d0 1 1.000000 previous" > "$D/run.trec" && echo old > "$D/ckpt/config.json"\n')


def results_of(p: subprocess.CompletedProcess) -> dict:
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULTS ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


def after(p: subprocess.CompletedProcess) -> dict:
    lines = [line for line in p.stdout.splitlines() if line.startswith("AFTER ")]
    return json.loads(lines[-1][len("AFTER "):])


LIST_AFTER = ('$PYTHON -c "import json,sys,pathlib; d=pathlib.Path(sys.argv[1]); '
              'print(\'AFTER \' + json.dumps({str(p.relative_to(d)): p.read_text() for p in d.rglob(\'*\') if p.is_file()}))" "$D"\n')


@pytest.mark.parametrize("fs", ["full", "read-only"])
def test_atomic_writers_on_a_full_or_read_only_file_system(tmp_path, fs):
    d = tmp_path / "w"
    d.mkdir()
    (tmp_path / "writers.py").write_text(WRITERS)
    remount = 'mount -o remount,ro "$D"\n' if fs == "read-only" else ""
    p = in_mount_namespace(f'D={d}\nmount -t tmpfs -o size=256k tmpfs "$D"\n' + previous_artifacts() + remount +
                           f'$PYTHON {tmp_path / "writers.py"} "$D" checkpoint\n' + LIST_AFTER)
    results = results_of(p)
    reason = "No space left on device" if fs == "full" else "Read-only file system"
    for name in ("part.parquet", "meta.json", "run.trec", "ckpt"):
        message = results[name]
        assert message.startswith(f"cannot write {d / name}: ") and reason in message, message
        assert message.endswith(f"; the previous {name}, if any, is unchanged"), message
    # previous artifacts untouched, no temporary file left
    assert after(p) == {"part.parquet": "previous\n", "meta.json": "{}\n", "run.trec": "q0 Q0 d0 1 1.000000 previous\n",
                        "ckpt/config.json": "old\n"}


def test_a_run_file_write_that_fails_midway_leaves_the_previous_run(tmp_path):
    """write_trec_run stopped by an error after some lines were written: the previous run file is
    as it was and no temporary file is left; a later write replaces it whole."""
    from ckray.data.collections import read_trec_run, write_trec_run

    path = tmp_path / "runs" / "bm25-test.trec"
    write_trec_run({"q1": [("d1", 2.0), ("d2", 1.0)]}, path, tag="previous")
    before = path.read_bytes()
    bad = {f"q{i}": [(f"d{j}", 1.0) for j in range(100)] for i in range(50)}
    bad["q49"][50] = ("d50", None)  # cannot be formatted: the write fails after ~4,950 lines
    with pytest.raises(TypeError):
        write_trec_run(bad, path)
    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["bm25-test.trec"], "a temporary file was left behind"
    bad["q49"][50] = ("d50", 1.0)
    write_trec_run(bad, path)
    assert {q: len(d) for q, d in read_trec_run(path).items()} == {f"q{i}": 100 for i in range(50)}


@pytest.mark.slow
def test_prepare_on_a_full_file_system_exits_2_naming_the_path(sample_data, tmp_path):
    """A first prepare fits; after the corpus grew, rewriting its shards does not: exit 2 with the path
    and the reason, no temporary file, the manifest withdrawn (the half-rewritten shards are not a
    prepared corpus; every shard left has a marker that describes it) and the BM25 index untouched."""
    from ckray.data.shards import file_sha256, read_json

    data = tmp_path / "data"
    shutil.copytree(sample_data, data)
    d = tmp_path / "w"
    d.mkdir()
    prepare = f'$PYTHON jobs/prepare.py --data {data} --workdir "$D" --shards 2 --no-negatives --threads 1'
    corpus = (data / "corpus.jsonl").read_text()
    grown = tmp_path / "grown.jsonl"  # every document again under a new id: twice the size
    grown.write_text(corpus + corpus.replace('"_id": "', '"_id": "x'))
    grow = f'cp {grown} {data}/corpus.jsonl\n'
    script = (f'D={d}\nmount -t tmpfs -o size=3m tmpfs "$D"\n{prepare} > {tmp_path}/first.log 2>&1\n'
              f'cp -r "$D" {tmp_path}/before\n'
              f'fallocate -l $(( $(stat -f -c "%a*%S" "$D") - 96*1024 )) "$D/filler" || true\n'
              f'{grow}set +e\n{prepare} > {tmp_path}/second.log 2>&1\necho "EXIT $?"\n'
              f'rm "$D/filler"\ncp -r "$D" {tmp_path}/after\n')
    p = in_mount_namespace(script, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:] + (tmp_path / "first.log").read_text()[-3000:]
    second = (tmp_path / "second.log").read_text()
    assert "EXIT 2" in p.stdout, p.stdout + second[-4000:]
    assert f"cannot write {d}/shards/part-0000" in second and "No space left on device" in second, second[-4000:]
    assert "Traceback" not in second
    before, after = tmp_path / "before", tmp_path / "after"
    assert (before / "shards" / "_manifest.json").exists() and not (after / "shards" / "_manifest.json").exists()
    assert not [f for f in after.rglob("*") if ".tmp" in f.name], "a temporary file was left"
    for shard in (after / "shards").glob("part-*.parquet"):
        marker = read_json(shard.with_name(shard.name + ".done.json"))
        assert (marker["bytes"], marker["sha256"]) == (shard.stat().st_size, file_sha256(shard))
    index = sorted(f.relative_to(before) for f in (before / "bm25").rglob("*") if f.is_file())
    assert index and index == sorted(f.relative_to(after) for f in (after / "bm25").rglob("*") if f.is_file())
    assert all((before / f).read_bytes() == (after / f).read_bytes() for f in index)


def test_a_job_on_a_read_only_work_directory_exits_2_naming_the_path(sample_data, tmp_path):
    d = tmp_path / "w"
    d.mkdir()
    script = (f'D={d}\nmount -t tmpfs -o size=64k tmpfs "$D"\nmkdir "$D/old" && echo keep > "$D/old/file"\n'
              f'mount -o remount,ro "$D"\nset +e\n'
              f'$PYTHON jobs/prepare.py --data {sample_data} --workdir "$D/sub" --no-negatives\necho "EXIT $?"\n'
              'cat "$D/old/file"\n')
    p = in_mount_namespace(script)
    assert "EXIT 2" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"cannot write {d}/sub" in p.stdout and "Read-only file system" in p.stdout, p.stdout[-3000:]
    assert "Traceback" not in p.stdout + p.stderr
    assert p.stdout.rstrip().endswith("keep")
