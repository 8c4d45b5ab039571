"""A fifth ranker plugs in with its own package (tests/toy_ranker) and one registry line, then trains,
reranks, evaluates and serves through ckray's own API, jobs and Serve application."""

from __future__ import annotations

import socket

import pytest
import torch

from ckray.errors import ConfigError


@pytest.fixture()
def toy():
    """The toy ranker registered (its package's last line, run on import), removed again afterwards."""
    import toy_ranker
    from ckray.rankers import register, unregister

    register(toy_ranker.SPEC)  # again after an earlier test's unregister (the same spec twice is one)
    yield toy_ranker
    unregister("toy")


def test_a_registered_ranker_is_known_to_pipelines_jobs_and_serve(toy, monkeypatch):
    from ckray.pipelines import parse_pipeline
    from ckray.rankers import plugin_modules, register, trainable, unregister
    from ckray.serve import deployment_options
    from ckray.stages import parse_stage_args, stage_parser

    assert list(trainable()) == ["ck-qti", "clear", "cedr-knrm", "qds", "toy"]
    assert parse_pipeline("bm25>toy") == ("bm25", "toy") and parse_pipeline("clear+toy") == ("clear", "toy")
    monkeypatch.setenv("COLUMNS", "1000")
    help_text = stage_parser("train:toy").format_help()
    assert "--buckets BUCKETS" in help_text and "one learned weight each (default: 4096)" in help_text
    assert "--lr LR" in help_text and "(default: 0.05)" in help_text  # the plug-in's own loop defaults
    assert parse_stage_args("train:toy", ["--data", "D", "--workdir", "W", "--buckets", "64"]).buckets == 64
    assert plugin_modules() == ["toy_ranker"]
    env = deployment_options("reranker", "reranker-toy", {})["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env == {"CKRAY_RANKERS": "toy_ranker"}
    with pytest.raises(ConfigError, match="reranker toy is already registered"):
        register(type(toy.SPEC)(name="toy2", title="clash", module="x", rerankers={"toy": "toy"}))
    with pytest.raises(ConfigError, match="'ck-qti' is built in"):
        unregister("ck-qti")


def test_the_generic_training_job_trains_a_plug_in_named_in_the_environment():
    """`CKRAY_RANKERS=toy_ranker python jobs/train.py --ranker toy`: the plug-in's flags and defaults."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "CKRAY_RANKERS": "toy_ranker", "COLUMNS": "1000"}
    p = subprocess.run([sys.executable, "jobs/train.py", "--ranker", "toy", "--data", "D", "--workdir", "W", "--help"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--buckets BUCKETS" in p.stdout and "(default: 4096)" in p.stdout, p.stderr
    p = subprocess.run([sys.executable, "jobs/train.py", "--ranker", "toy", "--data", "D", "--workdir", "W"],
                       cwd=root, env={**env, "CKRAY_RANKERS": ""}, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "invalid choice: 'toy'" in p.stderr


def test_without_registration_the_toy_is_unknown():
    from ckray.pipelines import parse_pipeline

    with pytest.raises(ConfigError, match="unknown reranker 'toy'"):
        parse_pipeline("bm25>toy")


def test_the_toy_model_scores_a_learned_term_weight_dot_product(toy):
    model = toy.ToyModel(toy.ToyConfig(buckets=64))
    with torch.no_grad():
        model.weight.copy_(torch.arange(64, dtype=torch.float32))
    q, d = toy.bag(["cat dog"], 64, log_tf=False), toy.bag(["cat cat fish"], 64, log_tf=True)
    cat = int(toy.bag(["cat"], 64, log_tf=False)[0].argmax())
    dog = int(toy.bag(["dog"], 64, log_tf=False)[0].argmax())
    want = (2 if dog == cat else 1) * cat * torch.log(torch.tensor(3.0))  # w_cat · n_q(cat) · log(1 + 2); no dog in d
    assert model.score_texts(["cat dog"], ["cat cat fish"]).item() == pytest.approx(want.item(), rel=1e-6)
    assert model(q, d).item() == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.slow
def test_the_toy_trains_reranks_evaluates_and_serves(toy, ray_session, tmp_path):
    import httpx
    from ray import serve

    from ckray import api
    from ckray.data.collections import read_queries_and_qrels
    from ckray.evaluation import run_path
    from ckray.models.checkpoint import load_model, read_checkpoint_config
    from ckray.pipelines import build_pipeline
    from ckray.data.sample import sample_workdir
    from ckray.serve import build_app

    data, w = sample_workdir(tmp_path)
    result = api.train("toy", data, w, options=toy.ToyOptions(buckets=1024), loop={"max_steps": 6, "workers": 1},
                       max_dev_queries=5, dev_depth=10)
    assert result.steps == 6 and (w / "checkpoints" / "toy" / "model.safetensors").exists()
    assert read_checkpoint_config(w / "checkpoints" / "toy")["model_class"] == "toy_ranker.ToyModel"
    model = load_model(w / "checkpoints" / "toy")
    assert model.config.buckets == 1024 and not torch.allclose(model.weight, torch.ones(1024))  # it learned

    metrics = api.evaluate(["bm25", "bm25>toy"], data, w, split="test", k=20, rerank_depth=20)
    assert set(metrics) == {"bm25", "bm25>toy"} and metrics["bm25>toy"]["nDCG@10"] >= 0
    bm25_run, toy_run = (run_path(w, p, "test").read_text().splitlines() for p in ("bm25", "bm25>toy"))
    by_query = lambda lines: {q: {ln.split()[2] for ln in lines if ln.split()[0] == q} for q in {ln.split()[0] for ln in lines}}
    assert by_query(toy_run) == by_query(bm25_run)  # the same 20 documents per query, reordered by the toy

    queries, _ = read_queries_and_qrels(data)
    query = next(iter(queries.values()))
    offline = build_pipeline("bm25>toy", w, rerank_depth=20).run({"q": query}, k=5)["q"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    small = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}
    try:
        serve.run(build_app({"workdir": str(w), "default_pipeline": "bm25>toy", "retrievers": ["bm25"],
                             "rerankers": ["toy"], "deployments": {"ingress": small, "retriever": small,
                                                                    "reranker": small}}),
                  name="toy-app", route_prefix="/")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            assert client.get("/healthz").json()["rerankers"] == ["toy"]
            got = client.post("/search", json={"query": query, "k": 5, "reranker": "toy", "rerank_depth": 20})
            assert got.status_code == 200, got.text
            results = got.json()["results"]
    finally:
        serve.shutdown()
    assert [r["doc_id"] for r in results] == [d for d, _ in offline]
    assert [r["score"] for r in results] == pytest.approx([s for _, s in offline], abs=1e-5)
