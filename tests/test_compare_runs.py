"""scripts/compare_runs.py: same documents in the same order with scores within 1e-5, or exit 1."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compare():
    return runpy.run_path(str(ROOT / "scripts" / "compare_runs.py"))["main"]


def write_run(workdir: Path, name: str, rows: list[tuple[str, str, float]]) -> None:
    (workdir / "runs").mkdir(parents=True, exist_ok=True)
    lines = [f"{q} Q0 {d} {i + 1} {s} x" for i, (q, d, s) in enumerate(rows)]
    (workdir / "runs" / name).write_text("\n".join(lines) + "\n")


RUN = [("q1", "d1", 2.0), ("q1", "d2", 1.0), ("q2", "d3", 0.5)]


@pytest.mark.parametrize("other, code, says", [
    (RUN, 0, "1 of 1 run files the same"),
    ([("q1", "d1", 2.000004), ("q1", "d2", 1.0), ("q2", "d3", 0.5)], 0, "same"),
    ([("q1", "d1", 2.0001), ("q1", "d2", 1.0), ("q2", "d3", 0.5)], 1, "scores differ by up to 0.0001"),
    ([("q1", "d2", 2.0), ("q1", "d1", 1.0), ("q2", "d3", 0.5)], 1, "query q1: documents differ from rank 1"),
    ([("q1", "d1", 2.0), ("q1", "d2", 1.0)], 1, "queries differ: 1 in one run only"),
])
def test_runs_are_compared_by_documents_order_and_scores(compare, tmp_path, capsys, other, code, says):
    write_run(tmp_path / "a", "bm25-test.trec", RUN)
    write_run(tmp_path / "b", "bm25-test.trec", other)
    assert compare([str(tmp_path / "a"), str(tmp_path / "b")]) == code
    assert says in capsys.readouterr().out


def test_a_run_missing_on_one_side_is_a_difference(compare, tmp_path, capsys):
    write_run(tmp_path / "a", "bm25-test.trec", RUN)
    write_run(tmp_path / "a", "clear-test.trec", RUN)
    write_run(tmp_path / "b", "bm25-test.trec", RUN)
    assert compare([str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "missing in B" in capsys.readouterr().out


def test_paired_runs_prints_each_shared_run_s_mean_difference_and_its_standard_error(tmp_path, capsys):
    paired = runpy.run_path(str(ROOT / "scripts" / "paired_runs.py"))["main"]
    data = tmp_path / "data"
    (data / "qrels").mkdir(parents=True)
    (data / "corpus.jsonl").write_text("".join(f'{{"_id": "d{i}", "text": "x"}}\n' for i in (1, 2, 3)))
    (data / "queries.jsonl").write_text('{"_id": "q1", "text": "a"}\n{"_id": "q2", "text": "b"}\n')
    (data / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\nq2\td3\t1\n")
    write_run(tmp_path / "a", "bm25-test.trec", RUN)                                         # d1 first: 1.0
    write_run(tmp_path / "b", "bm25-test.trec", [("q1", "d2", 2.0), ("q1", "d1", 1.0), ("q2", "d3", 0.5)])
    write_run(tmp_path / "a", "ck-qti-test.trec", RUN)                                       # in A only: left out
    assert paired([str(tmp_path / "a"), str(tmp_path / "b"), "--data", str(data)]) == 0
    out = capsys.readouterr().out
    # q1: 1 − 1/log2(3) = 0.3691, q2: 0 → mean 0.1845, standard error 0.1845
    assert "bm25 " in out and "+0.1845  0.1845" in out and "ck-qti" not in out
    assert paired([str(tmp_path / "a"), str(tmp_path / "b"), "--data", str(data), "--split", "train"]) == 1
    # --against: every run of A against B's bm25 (here ck-qti, in A only, is compared too)
    assert paired([str(tmp_path / "a"), str(tmp_path / "b"), "--data", str(data), "--against", "bm25"]) == 0
    out = capsys.readouterr().out
    assert "ck-qti" in out and out.count("+0.1845  0.1845") == 2
    assert paired([str(tmp_path / "a"), str(tmp_path / "b"), "--data", str(data), "--against", "clear"]) == 1
