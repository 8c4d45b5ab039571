"""What a new user meets on the command line: a bad flag or a bad collection is refused at once (before
Ray starts), naming the flag or the file, and every option's --help tells its real default."""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from ckray.data.sample import generate_sample
from ckray.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RAY_STARTED = "started a local ray"  # ray.init's line and ckray.ray_env's, lower-cased


def job(script: str, *flags: str) -> subprocess.CompletedProcess:
    """``python jobs/<script> flags…`` from the repository root (no RAY_ADDRESS: a local Ray if any)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, f"jobs/{script}", *map(str, flags)], cwd=ROOT, capture_output=True,
                          text=True, env=env, timeout=300)


def refused(p: subprocess.CompletedProcess, message: str) -> bool:
    """The job exited 2 with ``message`` as its one error line, before starting Ray."""
    out = p.stdout + p.stderr
    errors = [line for line in out.splitlines() if " ERROR ckray: " in line]
    return p.returncode == 2 and len(errors) == 1 and errors[0].endswith(f" ERROR ckray: {message}") \
        and RAY_STARTED not in out.lower()


@pytest.fixture()
def sample(tmp_path) -> Path:
    return generate_sample(tmp_path / "data")


# --------------------------------------------------------------------------- collections


def test_evaluate_refuses_a_split_whose_queries_have_no_text(sample, tmp_path):
    queries, qrels = sample / "queries.jsonl", sample / "qrels" / "test.tsv"
    judged = {line.split("\t")[0] for line in qrels.read_text().splitlines()[1:]}
    lines = queries.read_text().splitlines()
    queries.write_text("")
    p = job("evaluate.py", "--data", sample, "--workdir", tmp_path / "w")
    assert refused(p, f"{queries}: none of the {len(judged)} queries judged in split 'test' ({qrels}) has a text "
                      "here (0 queries in all)"), p.stdout + p.stderr
    # a queries file with the training queries only
    kept = [line for line in lines if json.loads(line)["_id"] not in judged]
    queries.write_text("\n".join(kept) + "\n")
    p = job("evaluate.py", "--data", sample, "--workdir", tmp_path / "w", "--split", "test")
    assert refused(p, f"{queries}: none of the {len(judged)} queries judged in split 'test' ({qrels}) has a text "
                      f"here ({len(kept)} queries in all)"), p.stdout + p.stderr
    assert not (tmp_path / "w" / "metrics").exists()


def test_a_missing_data_directory_is_named(tmp_path):
    missing = tmp_path / "no-such-dir"
    p = job("evaluate.py", "--data", missing, "--workdir", tmp_path / "w")
    assert refused(p, f"{missing}: no such collection directory"), p.stdout + p.stderr
    p = job("prepare.py", "--data", missing, "--workdir", tmp_path / "w")
    assert refused(p, f"{missing}: no such collection directory"), p.stdout + p.stderr
    from ckray.errors import CollectionError
    from ckray.stages import parse_stage_args, run_stage

    args = parse_stage_args("train:ck-qti", ["--data", str(missing), "--workdir", str(tmp_path / "w")])
    with pytest.raises(CollectionError, match=f"^{missing}: no such collection directory$"):
        run_stage("train:ck-qti", args)
    assert not (tmp_path / "w").exists()


def test_qrels_naming_unknown_documents_are_counted_not_fatal_unless_strict(sample, tmp_path):
    from ckray.data.collections import load_collection

    with open(sample / "qrels" / "train.tsv", "a") as f:
        f.write("q0000\tno-such-doc\t1\n")
    assert load_collection(sample).stats["unknown_docs"] == 1
    p = job("prepare.py", "--data", sample, "--workdir", tmp_path / "w", "--strict-qrels")
    assert p.returncode == 2 and "qrels name 1 document(s) not in the corpus" in p.stdout, p.stdout + p.stderr
    assert "--allow-unknown" not in p.stdout + p.stderr and RAY_STARTED not in (p.stdout + p.stderr).lower()


# --------------------------------------------------------------------------- flags named, before Ray


def test_a_bad_training_flag_is_named_before_ray_starts(sample, tmp_path):
    w = tmp_path / "w"
    p = job("train_ck.py", "--data", sample, "--workdir", w, "--max-steps", "0")
    assert refused(p, "--max-steps must be >= 1, got 0"), p.stdout[-3000:] + p.stderr[-3000:]
    assert not w.exists()  # nothing prepared, sharded or trained


@pytest.mark.parametrize("model", ["ck-qti", "clear", "cedr-knrm", "qds"])
@pytest.mark.parametrize("flags, message", [
    (["--lr", "0"], "--lr must be > 0, got 0.0"), (["--workers", "0"], "--workers must be >= 1, got 0"),
    (["--eval-every", "-1"], "--eval-every must be >= 0 (0: validate only at the end), got -1"),
    (["--resources-per-worker", "CPU=2"], "--resources-per-worker must not name CPU or GPU"),
    (["--max-triples", "-1"], "--max-triples must be >= 0 (0: all), got -1")])
def test_every_training_stage_checks_its_loop_flags_before_any_work(model, flags, message, sample, tmp_path):
    from ckray.stages import parse_stage_args, run_stage

    w = tmp_path / "w"
    args = parse_stage_args(f"train:{model}", ["--data", str(sample), "--workdir", str(w), *flags])
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        run_stage(f"train:{model}", args)
    assert not w.exists()


@pytest.mark.parametrize("model, flags, message", [
    ("cedr-knrm", ["--frozen-layers", "-1"], "--frozen-layers must be >= 0, got -1"),
    ("cedr-knrm", ["--attention-dropout", "1"], "--attention-dropout must be in [0, 1), got 1.0"),
    ("qds", ["--frozen-layers", "-1"], "--frozen-layers must be >= 0, got -1"),
    ("qds", ["--window", "-2"], "--window must be >= 0, got -2")])
def test_a_bad_model_flag_of_a_reranker_is_named_before_any_work(model, flags, message, sample, tmp_path):
    """The model configs (CEDRConfig, QDSConfig) refuse a bad field with a ConfigError that the job
    turns into its flag's name: one error line, exit 2, before Ray, nothing written."""
    w = tmp_path / "w"
    p = job(f"train_{model.split('-')[0]}.py", "--data", sample, "--workdir", w, *flags)
    assert refused(p, message), p.stdout[-3000:] + p.stderr[-3000:]
    assert not w.exists()


@pytest.mark.parametrize("script, flags, message", [
    ("evaluate.py", ["--k", "0"], "--k must be >= 1, got 0"),
    ("evaluate.py", ["--rerank-depth", "0"], "--rerank-depth must be >= 1, got 0"),
    ("prepare.py", ["--shards", "0"], "--shards must be >= 1, got 0"),
    ("prepare.py", ["--negative-depth", "0"], "--negative-depth must be >= 1, got 0"),
    ("pipeline.py", ["--max-steps", "0"], "--max-steps must be >= 1, got 0"),
    ("pipeline.py", ["--workers", "0"], "--workers must be >= 1, got 0"),
    ("pipeline.py", ["--rerank-depth", "0"], "--rerank-depth must be >= 1, got 0")])
def test_job_flags_are_named_in_their_errors(script, flags, message, sample, tmp_path):
    p = job(script, "--data", sample, "--workdir", tmp_path / "w", *flags)
    assert refused(p, message), p.stdout[-3000:] + p.stderr[-3000:]
    assert not (tmp_path / "w").exists()


def test_the_main_job_checks_every_models_training_flags_before_ray(sample, tmp_path):
    from ckray.full_pipeline import FullPipelineConfig, ModelRecipe, run_full_pipeline

    w = tmp_path / "w"
    config = FullPipelineConfig(workdir=str(w), data=str(sample), models=["ck-qti", "qds"],
                                recipes={"qds": ModelRecipe(loop={"batch_size": 0})})
    with pytest.raises(ConfigError, match=r"^--batch-size must be >= 1, got 0$"):
        run_full_pipeline(config)
    config.recipes = {"ck-qti": ModelRecipe(options={"layerz": 1})}
    with pytest.raises(ConfigError, match=r"^train:ck-qti: unknown option\(s\) layerz; known: .*\blayers\b"):
        run_full_pipeline(config)
    assert list(w.iterdir()) == []  # no shards, no BM25 index: nothing prepared


# --------------------------------------------------------------------------- --help


def option_help(text: str) -> dict[str, str]:
    """Each option of a --help text → its help on one line (``--qti, --no-qti`` → under ``--qti``)."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        start = re.match(r"  (-[^\s,]+)", line)
        if start:
            current = start.group(1)
            entries[current] = line.strip()
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def job_parsers() -> dict[str, object]:
    from ckray.rankers import indexed, trainable
    from ckray.stages import stage_parser

    parsers = {job: runpy.run_path(str(ROOT / "jobs" / job))["parser"]()
               for job in ("prepare.py", "evaluate.py", "pipeline.py")}
    parsers.update({f"train:{m}": stage_parser(f"train:{m}") for m in trainable()})
    parsers.update({f"index:{m}": stage_parser(f"index:{m}") for m in indexed()})
    return parsers


def test_every_option_of_every_job_shows_its_default(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # no option's help wrapped
    for name, parser in job_parsers().items():
        required = {"--data", "--workdir"} if name != "pipeline.py" else {"--workdir"}
        for flag, text in option_help(parser.format_help()).items():
            if flag in ("-h", *required):
                continue
            assert text.count("(default: ") == 1 and "(default: None)" not in text, (name, text)


def test_on_off_flags_are_one_pair_with_one_default(monkeypatch):
    from ckray.stages import parse_stage_args, stage_parser

    monkeypatch.setenv("COLUMNS", "1000")
    entries = option_help(stage_parser("train:ck-qti").format_help())
    assert entries["--qti"].startswith("--qti, --no-qti ") and entries["--qti"].endswith("(default: True)")
    assert "--no-qti" not in entries
    argv = ["--data", "D", "--workdir", "W"]
    assert parse_stage_args("train:ck-qti", argv).qti is True
    assert parse_stage_args("train:ck-qti", [*argv, "--no-qti"]).qti is False
    assert parse_stage_args("train:ck-qti", [*argv, "--no-qti", "--qti"]).qti is True


def test_ck_learning_rate_is_lr_with_the_models_default_shown(monkeypatch, tmp_path):
    from ckray.rankers import spec, trainable
    from ckray.stages import parse_stage_args, stage_parser
    from ckray.train_job import training_config

    monkeypatch.setenv("COLUMNS", "1000")
    for name, model in trainable().items():  # each model's own loop defaults are the ones --help shows
        entries = option_help(stage_parser(f"train:{name}").format_help())
        for field, value in model.training.defaults.items():
            assert entries["--" + field.replace("_", "-")].endswith(f"(default: {value!r})"), (name, field)
        assert entries["--output-dir"].endswith("(default: W/checkpoints/<name>)")
    assert "--default-lr" not in stage_parser("train:ck-qti").format_help()
    argv = ["--data", str(tmp_path), "--workdir", str(tmp_path / "w")]
    with pytest.raises(SystemExit):
        parse_stage_args("train:ck-qti", [*argv, "--default-lr", "1e-3"])
    ck_defaults = spec("ck-qti").training.defaults
    assert training_config(parse_stage_args("train:ck-qti", argv), "ck-qti", **ck_defaults).lr == 1e-3
    assert training_config(parse_stage_args("train:ck-qti", [*argv, "--lr", "5e-4"]), "ck-qti",
                           **ck_defaults).lr == 5e-4
