"""Jobs run as plain scripts (local Ray in-process) and through `ray job submit` to a local head."""

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from ckray.data.sample import generate_sample

ROOT = Path(__file__).resolve().parents[1]


def run(cmd, env=None, timeout=600):
    e = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    e.update(env or {})
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=e, timeout=timeout)


def submit(ray_head, job: list[str], timeout=900):
    """`ray job submit` to the local head; retried while the head's job agent is still starting."""
    import time

    cmd = [ray_head["ray_bin"], "job", "submit", "--address", ray_head["dashboard"], "--working-dir", ".", "--", *job]
    for _ in range(12):
        p = run(cmd, env=ray_head["env"], timeout=timeout)
        if "No available agent" not in p.stdout + p.stderr:
            return p
        time.sleep(10)
    return p


@pytest.mark.slow
def test_prepare_and_evaluate_as_scripts(tmp_path):
    data = generate_sample(tmp_path / "data")
    w = tmp_path / "w"
    p = run([sys.executable, "jobs/prepare.py", "--data", str(data), "--workdir", str(w), "--shards", "2"])
    assert p.returncode == 0, p.stdout + p.stderr
    p = run([sys.executable, "jobs/evaluate.py", "--data", str(data), "--workdir", str(w), "--pipeline", "bm25", "--split", "test"])
    assert p.returncode == 0, p.stdout + p.stderr
    metrics = json.loads((w / "metrics" / "bm25-test.json").read_text())
    assert set(metrics) == {"nDCG@10", "RR@10", "R@100", "AP@1000"}
    assert 0.3 < metrics["nDCG@10"] <= 1.0
    assert (w / "runs" / "bm25-test.trec").stat().st_size > 0
    assert "bm25" in p.stdout and "nDCG@10" in p.stdout


def test_bad_flags_give_clear_errors(tmp_path):
    data = generate_sample(tmp_path / "data")
    p = run([sys.executable, "jobs/evaluate.py", "--data", str(data), "--workdir", str(tmp_path / "w"),
             "--pipeline", "nonsense", "--split", "test"])
    assert p.returncode == 2 and "unknown first stage 'nonsense'" in p.stdout
    p = run([sys.executable, "jobs/evaluate.py", "--data", str(tmp_path), "--workdir", str(tmp_path / "w")])
    assert p.returncode == 2 and "not a collection directory" in p.stdout


@pytest.mark.parametrize("flags, named", [
    (["--weak-titles", "-1"], "--weak-titles"), (["--weak-depth", "0"], "--weak-depth"),
    (["--dev-fraction", "1.5"], "--dev-fraction"), (["--negatives-per-positive", "0"], "--negatives-per-positive"),
    (["--bm25-k1", "0"], "--bm25-k1"), (["--bm25-b", "-0.1"], "--bm25-b")])
def test_bad_training_flags_are_refused_before_any_work(tmp_path, flags, named):
    from ckray.errors import ConfigError
    from ckray.stages import parse_stage_args, run_stage

    w = tmp_path / "w"
    args = parse_stage_args("train:ck-qti", ["--data", str(tmp_path / "data"), "--workdir", str(w), *flags])
    with pytest.raises(ConfigError, match=re.escape(named)):
        run_stage("train:ck-qti", args)
    assert not w.exists()  # nothing prepared, sharded or trained


STAGE_JOBS = ["train_ck", "train_clear", "train_cedr", "train_qds", "build_impact_index", "build_dense_index"]


@pytest.mark.parametrize("job", STAGE_JOBS)
def test_stage_job_scripts_show_their_help(job, monkeypatch, capsys):
    """Each jobs/ wrapper runs as a script (here in-process); its help is the job's docstring and no
    option claims a default of None."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script prepends the repository root
    monkeypatch.setattr(sys, "argv", [f"jobs/{job}.py", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / "jobs" / f"{job}.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert f"python jobs/{job}.py --data DIR --workdir W" in out and "(default: None)" not in out


def test_stage_job_main_exits_0_after_the_stage_and_2_on_a_ckray_error(monkeypatch, tmp_path):
    from ckray import stages
    from ckray.rankers import TrainingStage

    ran = []
    monkeypatch.setattr(TrainingStage, "train",  # a TrainResult-like return value is not an exit code
                        lambda stage, args: ran.append(args) or object())
    with pytest.raises(SystemExit) as exit_:
        stages.main_for("train:ck-qti", argv=["--data", str(tmp_path), "--workdir", str(tmp_path / "w"), "--lr", "0.5"])
    assert exit_.value.code == 0 and ran[0].loop_lr == 0.5 and ran[0].loop_max_steps is None
    with pytest.raises(SystemExit) as exit_:
        stages.main_for("index:ck-qti", argv=["--data", str(tmp_path), "--workdir", str(tmp_path / "w"),
                                              "--checkpoint", str(tmp_path / "no-such-ckpt")])
    assert exit_.value.code == 2 and not (tmp_path / "w").exists()


def test_quiet_local_workers_drops_only_the_state_api_warning(caplog):
    import logging

    from ckray.ray_env import PLACEMENT_GROUP_CLEANER_LOGGER, STATE_API_UNAVAILABLE, quiet_local_workers

    quiet_local_workers()
    cleaner = logging.getLogger(PLACEMENT_GROUP_CLEANER_LOGGER)
    with caplog.at_level(logging.WARNING, logger=PLACEMENT_GROUP_CLEANER_LOGGER):
        cleaner.warning(STATE_API_UNAVAILABLE + ". State API may be temporarily unavailable. Continuing to monitor.")
        cleaner.warning("Detected that the Ray Train controller actor (a1) is dead. Cleaning up placement group")
    assert [r.getMessage()[:30] for r in caplog.records] == ["Detected that the Ray Train co"]


@pytest.mark.slow
def test_training_script_on_a_local_ray_shows_progress_without_state_api_warnings(tmp_path):
    """A training job run as a plain script starts a local Ray without a dashboard, so without a State
    API; Ray Train's placement-group cleaner would log a warning about it every second, burying the
    progress lines (``ckray.ray_env.quiet_local_workers`` drops exactly that warning)."""
    from ckray.ray_env import STATE_API_UNAVAILABLE

    data = generate_sample(tmp_path / "data")
    p = run([sys.executable, "jobs/train_ck.py", "--data", str(data), "--workdir", str(tmp_path / "w"),
             "--workers", "1", "--max-steps", "4", "--eval-every", "2", "--log-every", "2", "--batch-size", "2",
             "--layers", "1", "--max-doc-len", "128", "--max-dev-queries", "5", "--dev-depth", "10"])
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "step 4/4" in out and "ex/s" in out
    assert STATE_API_UNAVAILABLE not in out


@pytest.mark.slow
def test_ray_job_submit_to_a_local_head(ray_head, tmp_path):
    data = generate_sample(tmp_path / "data")
    w = tmp_path / "w"
    for job in (["jobs/prepare.py", "--data", str(data), "--workdir", str(w), "--shards", "2"],
                ["jobs/evaluate.py", "--data", str(data), "--workdir", str(w), "--pipeline", "bm25"]):
        p = submit(ray_head, ["python", *job])
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "succeeded" in (p.stdout + p.stderr).lower()
    assert json.loads((w / "metrics" / "bm25-test.json").read_text())["nDCG@10"] > 0.3


@pytest.mark.slow
def test_ray_job_submit_train_ck(ray_head, tmp_path):
    """`ray job submit -- python jobs/train_ck.py …` against a local head: 2 workers, DeepSpeed ZeRO-2; exact matches
    over Porter stems, whose class map the driver computes and the checkpoint keeps."""
    data = generate_sample(tmp_path / "data")
    w = tmp_path / "w"
    p = submit(ray_head, ["python", "jobs/train_ck.py", "--data", str(data), "--workdir", str(w), "--workers", "2",
             "--max-steps", "4", "--eval-every", "2", "--batch-size", "2", "--layers", "1", "--max-doc-len", "128",
             "--max-dev-queries", "5", "--dev-depth", "10", "--exact-match", "stems"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((w / "checkpoints" / "ck-qti" / "train_summary.json").read_text())
    assert summary["steps"] == 4 and summary["config"]["workers"] == 2 and summary["config"]["zero_stage"] == 2
    assert (w / "checkpoints" / "ck-qti" / "model.safetensors").exists()
    from ckray.models.encoders import load_tokenizer
    from ckray.rankers.ck_qti.model import load_ck_model

    model = load_ck_model(w / "checkpoints" / "ck-qti")
    computer, computing, program = load_tokenizer(None).convert_tokens_to_ids(["computer", "computing", "program"])
    assert model.config.exact_match == "stems"
    assert model.match_class[computer] == model.match_class[computing] != model.match_class[program]
    assert model.idf[computer] == model.idf[computing]
