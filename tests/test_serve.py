"""The Ray Serve application over real HTTP: same results as the offline pipeline, 4xx with a reason
for every bad request, batched reranking, and no failed request after a reranker replica is killed
and restarted. One application (Serve on a free loopback port) serves the whole module."""

import asyncio
import copy
import os
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from ckray.errors import ConfigError
from ckray.pipelines import RERANKERS, RETRIEVERS
from ckray.serve import (AppArgs, FusedRetriever, RerankBatching, RetrieverSpec, SearchRequest, build_app,
                         deployment_options, reciprocal_rank_fusion, reranker_missing, retriever_missing)

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


APP = "ckray-test"
RERANKER = "cedr-knrm"
CLASSIC = {"name": "bm25-classic", "retriever": "bm25", "options": {"k1": 1.2, "b": 0.75}}
TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=128)
SMALL = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}


# ----------------------------------------------------------------------------- fast unit tests

def test_reciprocal_rank_fusion_by_hand():
    a = [("x", 9.0), ("y", 5.0), ("z", 1.0)]
    b = [("y", 0.9), ("w", 0.5)]
    fused = reciprocal_rank_fusion([a, b], k=10, rrf_k=60)
    expected = {"y": 1 / 62 + 1 / 61, "x": 1 / 61, "w": 1 / 62, "z": 1 / 63}
    assert [d for d, _ in fused] == ["y", "x", "w", "z"]
    assert dict(fused) == pytest.approx(expected)
    assert reciprocal_rank_fusion([a, b], k=2) == fused[:2]
    # one list keeps its order; ties are broken by doc id
    assert [d for d, _ in reciprocal_rank_fusion([a], k=3)] == ["x", "y", "z"]
    assert [d for d, _ in reciprocal_rank_fusion([[("b", 1.0)], [("a", 1.0)]], k=2)] == ["a", "b"]


def test_fused_retriever_is_rrf_of_its_retrievers():
    class Fixed:
        def __init__(self, hits):
            self.hits = hits

        def search(self, queries, k):
            return {q: self.hits[:k] for q in queries}

    r1, r2 = Fixed([("a", 3.0), ("b", 2.0), ("c", 1.0)]), Fixed([("c", 5.0), ("a", 1.0)])
    run = FusedRetriever([r1, r2]).search({"q": "text"}, k=2)
    assert run == {"q": reciprocal_rank_fusion([r1.hits[:2], r2.hits[:2]], 2)}
    with pytest.raises(ConfigError):
        FusedRetriever([])


def test_deployment_options_merge_kind_then_name():
    opts = deployment_options("reranker", "reranker-qds", {
        "reranker": {"ray_actor_options": {"num_gpus": 1}},
        "reranker-qds": {"autoscaling_config": {"max_replicas": 8}, "max_ongoing_requests": 7}})
    assert opts["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}
    assert opts["autoscaling_config"]["max_replicas"] == 8 and opts["autoscaling_config"]["min_replicas"] == 1
    assert opts["max_ongoing_requests"] == 7
    fixed = deployment_options("retriever", "retriever-bm25", {"retriever": {"num_replicas": 2}})
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed


def test_request_and_args_validation():
    assert SearchRequest(query="a b").retrievers == ["bm25"]
    for bad in ({"query": " \t"}, {"query": "a", "k": 0}, {"query": "a", "k": 1001}, {"query": "a", "k": "5"},
                {"query": "a", "rerank_depth": 1001}, {"query": "a", "retrievers": ["bm25", "bm25"]},
                {"query": "a", "retrievers": []}, {"query": "a", "other": 1}):
        with pytest.raises(ValueError):
            SearchRequest.model_validate(bad)
    with pytest.raises(ConfigError):
        RerankBatching(max_batch_pairs=0)
    with pytest.raises(ValueError):
        AppArgs.model_validate({"workdir": "w", "unknown": 1})


def test_artifact_checks(tmp_path):
    assert "missing" in retriever_missing(RetrieverSpec(name="bm25"), tmp_path)
    assert "unknown retriever" in retriever_missing(RetrieverSpec(name="x", retriever="nope"), tmp_path)
    (tmp_path / "bm25" / "index").mkdir(parents=True)
    assert "missing" in retriever_missing(RetrieverSpec(name="bm25"), tmp_path)  # empty directory
    (tmp_path / "bm25" / "index" / "segments_1").write_text("")
    assert retriever_missing(RetrieverSpec(name="bm25"), tmp_path) is None
    assert "no checkpoint" in reranker_missing("cedr-knrm", tmp_path)
    assert "unknown reranker" in reranker_missing("nope", tmp_path)


def test_serve_config_yaml_is_valid():
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.import_path == "ckray.serve:build_app"
    args = AppArgs.model_validate(app.args)
    assert args.workdir == "work/demo"
    for name in args.deployments:  # a kind, or the name of a deployment build_app makes
        kind = "ingress" if name == "SearchAPI" else name.split("-")[0]
        assert kind in ("ingress", "retriever", "reranker"), name
        known = RETRIEVERS if kind == "retriever" else RERANKERS
        assert name in (kind, "SearchAPI") or name.split("-", 1)[1] in known, name
        deployment_options(kind, name, args.deployments)
    # Serve's own `deployments:` overrides must name deployments that always exist
    assert {d.name for d in app.deployments} <= {"SearchAPI", "retriever-bm25"}


# ----------------------------------------------------------------------------- the served application

@pytest.fixture(scope="module")
def workdir(ray_session, tmp_path_factory, minilm_path):
    """A synthetic collection's shards, its BM25 index and a tiny random CEDR-KNRM checkpoint."""
    import torch

    from ckray.data.sample import sample_workdir
    from ckray.models.cedr import CEDRConfig, CEDRRanker
    from ckray.models.checkpoint import save_model
    from ckray.pipelines import checkpoint_dir

    data, w = sample_workdir(tmp_path_factory.mktemp("serve"))
    torch.manual_seed(0)
    model = CEDRRanker(CEDRConfig(variant="knrm", random_init=TINY_BERT, max_length=128, max_query_len=16,
                                  max_segments=2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    save_model(model, checkpoint_dir(w, RERANKER))
    return data, w


@pytest.fixture(scope="module")
def queries(workdir):
    from ckray.data.collections import load_collection

    return dict(list(load_collection(workdir[0]).split_queries("test").items())[:6])


@pytest.fixture(scope="module")
def server(workdir):
    """The application on a free loopback port; Serve is shut down after the module."""
    from ray import serve

    _, w = workdir
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"workdir": str(w), "default_pipeline": "bm25", "retrievers": ["bm25", CLASSIC, "ck-qti"],
            "batching": {"batch_wait_timeout_s": 0.1, "forward_batch_size": 16, "torch_threads": 1},
            "deployments": {"ingress": SMALL, "retriever": SMALL, "reranker": SMALL}}
    serve.run(build_app(args), name=APP, route_prefix="/")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        assert client.get("/healthz").status_code == 200
        yield client
    serve.shutdown()


@pytest.fixture(scope="module")
def offline(workdir):
    """Offline pipelines built with ckray.pipelines, as jobs/evaluate.py builds them."""
    from ckray.lexical.bm25 import bm25_retriever
    from ckray.pipelines import Pipeline, build_pipeline, build_reranker

    _, w = workdir
    reranker = build_reranker(RERANKER, w)
    fused = FusedRetriever([bm25_retriever(w), bm25_retriever(w, k1=1.2, b=0.75)])
    return {"bm25": build_pipeline("bm25", w),
            "rerank20": Pipeline("bm25>cedr-knrm", build_pipeline("bm25", w).retriever, reranker, rerank_depth=20),
            "rrf": Pipeline("rrf", fused),
            "rrf>rerank15": Pipeline("rrf>cedr-knrm", fused, reranker, rerank_depth=15)}


def assert_same_ranking(results: list[dict], expected: list[tuple[str, float]], tol: float = 0.0):
    """Same documents, same order, same scores. With ``tol`` > 0 (neural scores: another batch
    composition changes the last float bits), scores agree within ``tol`` and documents whose
    offline scores are within ``tol`` of each other may appear in either order."""
    assert [r["rank"] for r in results] == list(range(1, len(results) + 1))
    assert [r["score"] for r in results] == pytest.approx([s for _, s in expected], abs=max(tol, 1e-12))
    if tol == 0.0:
        assert [r["doc_id"] for r in results] == [d for d, _ in expected]
        return
    i = 0
    while i < len(expected):  # compare groups of offline near-ties as sets
        j = i + 1
        while j < len(expected) and abs(expected[j - 1][1] - expected[j][1]) <= tol:
            j += 1
        assert {r["doc_id"] for r in results[i:j]} == {d for d, _ in expected[i:j]}, (i, results, expected)
        i = j


@pytest.mark.slow
def test_bm25_equals_offline_pipeline(server, offline, queries):
    want = offline["bm25"].run(queries, k=10)
    for qid, text in queries.items():
        got = server.post("/search", json={"query": text, "k": 10})
        assert got.status_code == 200, got.text
        body = got.json()
        assert_same_ranking(body["results"], want[qid])
        assert body["retrievers"] == ["bm25"] and body["reranker"] is None
        assert {"retrieve", "retrieve.bm25", "total"} <= set(body["timings_ms"])
        assert all(v >= 0 for v in body["timings_ms"].values())
        assert all(r["title"] for r in body["results"])
        # GET /search runs the default pipeline (bm25): the same answer
        assert server.get("/search", params={"q": text, "k": 10}).json()["results"] == body["results"]


@pytest.mark.slow
def test_reranked_equals_offline_reranking(server, offline, queries):
    want = offline["rerank20"].run(queries, k=10)
    first = offline["bm25"].run(queries, k=20)
    for qid, text in queries.items():
        got = server.post("/search", json={"query": text, "k": 10, "reranker": RERANKER, "rerank_depth": 20})
        assert got.status_code == 200, got.text
        body = got.json()
        assert_same_ranking(body["results"], want[qid], tol=1e-5)
        assert body["rerank_depth"] == 20 and body["batch"]["rerank.pairs"] >= len(first[qid][:20])
        assert {"rerank", "rerank.forward"} <= set(body["timings_ms"])
        assert [r["doc_id"] for r in body["results"]] != [d for d, _ in first[qid][:10]]  # it did rerank


@pytest.mark.slow
def test_interpolated_reranking_equals_the_offline_plus_pipeline(server, workdir, queries):
    """``interpolate: true`` serves ``bm25+cedr-knrm`` with the weight saved in W/fusion, as offline."""
    from ckray.fusion import InterpolationConfig, save_interpolation
    from ckray.pipelines import build_pipeline

    _, w = workdir
    body = {"query": next(iter(queries.values())), "k": 10, "reranker": RERANKER, "rerank_depth": 20,
            "interpolate": True}
    missing = server.post("/search", json=body)
    assert missing.status_code == 400 and "no tuned interpolation weight" in missing.json()["detail"]
    save_interpolation(w, "bm25", RERANKER, InterpolationConfig(weight=0.8, depth=20))
    want = build_pipeline(f"bm25+{RERANKER}", w, rerank_depth=20).run(queries, k=10)
    plain = build_pipeline(f"bm25>{RERANKER}", w, rerank_depth=20).run(queries, k=10)
    assert any([d for d, _ in want[q]] != [d for d, _ in plain[q]] for q in queries)  # w changes rankings
    for qid, text in queries.items():
        got = server.post("/search", json={**body, "query": text})
        assert got.status_code == 200, got.text
        assert got.json()["interpolation_weight"] == 0.8
        assert_same_ranking(got.json()["results"], want[qid], tol=1e-4)
    two = server.post("/search", json={**body, "retrievers": ["bm25", CLASSIC["name"]]})
    assert two.status_code == 400 and "exactly one retriever" in two.json()["detail"]


@pytest.mark.slow
def test_rrf_fusion_equals_offline(server, offline, queries):
    plain, reranked = offline["rrf"].run(queries, k=10), offline["rrf>rerank15"].run(queries, k=10)
    for qid, text in queries.items():
        body = server.post("/search", json={"query": text, "k": 10, "retrievers": ["bm25", "bm25-classic"]}).json()
        assert_same_ranking(body["results"], plain[qid])
        assert "fusion" in body["timings_ms"]
        body = server.post("/search", json={"query": text, "k": 10, "retrievers": ["bm25", "bm25-classic"],
                                            "reranker": RERANKER, "rerank_depth": 15}).json()
        assert_same_ranking(body["results"], reranked[qid], tol=1e-5)


@pytest.mark.slow
def test_concurrent_requests_share_reranker_batches(server, offline, queries):
    want = offline["rerank20"].run(queries, k=10)

    async def send_all():
        async with httpx.AsyncClient(base_url=str(server.base_url), timeout=120) as client:
            return await asyncio.gather(*(
                client.post("/search", json={"query": text, "k": 10, "reranker": RERANKER, "rerank_depth": 20})
                for text in queries.values()))

    responses = asyncio.run(send_all())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    for (qid, _), r in zip(queries.items(), responses):
        assert_same_ranking(r.json()["results"], want[qid], tol=1e-5)
    assert max(r.json()["batch"]["rerank.requests"] for r in responses) > 1
    assert max(r.json()["batch"]["rerank.pairs"] for r in responses) > 20


BAD_REQUESTS = [
    # (method, path, request kwargs, status, words in the reason)
    ("POST", "/search", {"json": {"query": ""}}, 422, "empty"),
    ("POST", "/search", {"json": {"query": "  \n\t "}}, 422, "empty"),
    ("POST", "/search", {"json": {"query": "a", "k": 1001}}, 422, "less than or equal to 1000"),
    ("POST", "/search", {"json": {"query": "a", "k": 0}}, 422, "greater than or equal to 1"),
    ("POST", "/search", {"json": {"query": "a", "reranker": RERANKER, "rerank_depth": 5000}}, 422,
     "less than or equal to 1000"),
    ("POST", "/search", {"json": {"query": "a", "retrievers": ["nope"]}}, 400, "unknown retriever 'nope'"),
    ("POST", "/search", {"json": {"query": "a", "reranker": "nope"}}, 400, "unknown reranker 'nope'"),
    ("POST", "/search", {"json": {"query": "a", "retrievers": ["ck-qti"]}}, 400, "not available here: missing"),
    ("POST", "/search", {"json": {"query": "a", "reranker": "qds"}}, 400, "not available here: no checkpoint"),
    ("POST", "/search", {"json": {"query": "a", "retrievers": ["clear"]}}, 400, "not deployed"),
    ("POST", "/search", {"json": {"query": "a", "retrievers": ["bm25", "bm25"]}}, 422, "distinct"),
    ("POST", "/search", {"json": {"query": "a", "retrievers": []}}, 422, "at least 1"),
    ("POST", "/search", {"json": {"query": "a", "k": "ten"}}, 422, "valid integer"),
    ("POST", "/search", {"json": {"query": "a", "k": 2.5}}, 422, "valid integer"),
    ("POST", "/search", {"json": {"query": 42}}, 422, "valid string"),
    ("POST", "/search", {"json": {"query": "a", "retrievers": "bm25"}}, 422, "valid list"),
    ("POST", "/search", {"json": {"query": "a", "colour": "red"}}, 422, "Extra inputs"),
    ("POST", "/search", {"json": {"k": 3}}, 422, "Field required"),
    ("POST", "/search", {"content": b"{not json", "headers": {"content-type": "application/json"}}, 422, "JSON"),
    ("POST", "/search", {"json": {"query": "a" * 70_000}}, 413, "over 65536 bytes"),
    ("POST", "/search", {"json": {"query": "a" * 5000}}, 422, "at most 4096 characters"),
    ("GET", "/search", {"params": {"q": ""}}, 422, "empty"),
    ("GET", "/search", {"params": {"q": "   "}}, 422, "empty"),
    ("GET", "/search", {}, 422, "Field required"),
    ("GET", "/search", {"params": {"q": "a", "k": 1001}}, 422, "less than or equal to 1000"),
    ("GET", "/search", {"params": {"q": "a", "k": "many"}}, 422, "valid integer"),
    ("GET", "/documents/no-such-doc", {}, 404, "unknown document id 'no-such-doc'"),
]


@pytest.mark.slow
def test_bad_requests_get_4xx_with_a_reason(server):
    for method, path, kwargs, status, reason in BAD_REQUESTS:
        r = server.request(method, path, **kwargs)
        assert r.status_code == status, (method, path, kwargs, r.status_code, r.text[:300])
        assert reason in r.json()["detail"], (reason, r.text[:300])
    # a body streamed without Content-Length is limited too
    r = server.post("/search", content=iter([b'{"query": "', b"a" * 70_000, b'"}']),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert server.get("/healthz").json()["status"] == "ok"  # nothing crashed


@pytest.mark.slow
def test_documents_health_and_openapi(server, workdir):
    from ckray.data.shards import DocStore

    store = DocStore(workdir[1])
    doc_id = store.ids()[7]
    body = server.get(f"/documents/{doc_id}").json()
    assert (body["title"], body["text"]) == store.get(doc_id)
    health = server.get("/healthz").json()
    assert health["retrievers"] == ["bm25", "bm25-classic"] and health["rerankers"] == [RERANKER]
    assert health["documents"] == len(store)
    assert "ck-qti" in health["unavailable"]["retrievers"] and "qds" in health["unavailable"]["rerankers"]
    spec = server.get("/openapi.json").json()
    assert {"/search", "/documents/{doc_id}", "/healthz"} <= set(spec["paths"])
    assert set(spec["paths"]["/search"]) == {"get", "post"}
    assert server.get("/docs").status_code == 200


def _replica_names(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))


@pytest.mark.slow
def test_killed_reranker_replica_is_replaced_without_failed_requests(server, offline, queries):
    import ray
    from ray import serve

    deployment = f"reranker-{RERANKER}"
    (old,) = _replica_names(deployment)
    ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 180
    while True:  # bounded wait for Serve to start a new replica and report it healthy
        names = _replica_names(deployment)
        status = serve.status().applications[APP].deployments[deployment]
        if names and old not in names and status.status == "HEALTHY" and status.replica_states.get("RUNNING") == 1:
            break
        assert time.monotonic() < deadline, (names, status)
        time.sleep(0.5)
    want = offline["rerank20"].run(queries, k=10)
    for qid, text in queries.items():
        r = server.post("/search", json={"query": text, "k": 10, "reranker": RERANKER, "rerank_depth": 20})
        assert r.status_code == 200, r.text
        assert_same_ranking(r.json()["results"], want[qid], tol=1e-5)


@pytest.mark.slow
def test_serve_run_serve_config_yaml(ray_head, workdir, tmp_path):
    """`serve run serve_config.yaml` (work directory and port replaced) on a separate local Ray head."""
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    port = free_port()
    config = copy.deepcopy(config)
    config["http_options"] = {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}
    app = config["applications"][0]
    app["args"]["workdir"] = str(workdir[1])
    app["args"]["deployments"] = {k: {**v, **SMALL} for k, v in app["args"].get("deployments", {}).items()}
    for kind in ("ingress", "retriever", "reranker"):
        app["args"]["deployments"].setdefault(kind, SMALL)
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_bin = str(Path(ray_head["ray_bin"]).with_name("serve"))
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **ray_head["env"]}
    p = subprocess.run([serve_bin, "run", "--non-blocking", "--address", ray_head["gcs"], str(path)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    try:
        deadline = time.monotonic() + 240
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "the application did not come up"
                time.sleep(1)
            r = client.get("/search", params={"q": "test query", "k": 5})
            assert r.status_code == 200 and len(r.json()["results"]) <= 5
            assert RERANKER in client.get("/healthz").json()["rerankers"]
    finally:
        subprocess.run([serve_bin, "shutdown", "-y", "--address", ray_head["dashboard"]], env=env,
                       capture_output=True, timeout=120)
