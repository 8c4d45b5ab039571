"""The Ray Serve application over real HTTP: same results as the offline pipeline, 4xx with a reason
for every bad request, batched reranking, and no failed request after a reranker replica is killed
and restarted. One application (Serve on a free loopback port) serves the whole module."""

import asyncio
import json
import os
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest
import yaml

from ckray.errors import ConfigError
from ckray.rankers import first_stages, rerankers
from ckray.serve import (AppArgs, FusedRetriever, RerankBatching, RetrieverSpec, SearchRequest, build_app,
                         deployment_options, reciprocal_rank_fusion, reranker_deployment_name, reranker_missing,
                         retriever_deployment_name, retriever_missing)

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


def test_a_reranker_with_damaged_weights_is_reported_unavailable_with_the_reason(tmp_path):
    import torch

    from ckray.models.checkpoint import WEIGHTS_FILE, save_model
    from ckray.rankers.cedr.model import CEDRConfig, CEDRRanker

    tiny = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=64)
    torch.manual_seed(0)
    path = save_model(CEDRRanker(CEDRConfig(variant="knrm", random_init=tiny, max_length=64, max_query_len=8)),
                      tmp_path / "checkpoints" / "cedr-knrm")
    assert reranker_missing("cedr-knrm", tmp_path) is None
    weights = path / WEIGHTS_FILE
    os.truncate(weights, weights.stat().st_size - 1)
    assert reranker_missing("cedr-knrm", tmp_path) == (
        f"checkpoint {path}: {WEIGHTS_FILE} has {weights.stat().st_size} bytes, config.json records "
        f"{weights.stat().st_size + 1}; it is truncated or corrupted, re-train or restore it")


# ----------------------------------------------------------------------------- the served application

@pytest.fixture(scope="module")
def workdir(ray_session, tmp_path_factory, minilm_path):
    """A synthetic collection's shards, its BM25 index and a tiny random CEDR-KNRM checkpoint."""
    import torch

    from ckray.data.sample import sample_workdir
    from ckray.rankers.cedr.model import CEDRConfig, CEDRRanker
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


def _padded_body(query: str, size: int) -> bytes:
    """A valid search request of exactly ``size`` bytes (JSON whitespace after the object)."""
    body = json.dumps({"query": query, "k": 3}).encode()
    return body + b" " * (size - len(body))


def _long_query(query: str, chars: int) -> str:
    """``query`` after two-character terms, exactly ``chars`` characters in all: 1,296 distinct terms
    (more than Lucene's default limit of 1,024 clauses) when ``chars`` is over 3,900."""
    alnum = "abcdefghijklmnopqrstuvwxyz0123456789"
    terms = " ".join(a + b for a in alnum for b in alnum)
    n = chars - len(query) - 1
    text = ((terms + " ") * (1 + n // len(terms)))[:n]
    return (text[:-1] + "x" if text.endswith(" ") else text) + " " + query


def _repeated(query: str, chars: int) -> str:
    """``query`` repeated, exactly ``chars`` characters (the few terms of ``query``)."""
    text = " ".join([query] * chars)[:chars].rstrip()
    return text + "x" * (chars - len(text))


@pytest.mark.slow
def test_request_limits_at_their_edge_and_one_past_it(server, queries):
    """Each request limit at its edge (answered) and one past it (refused with the limit named, never a 500)."""
    q = next(iter(queries.values()))
    json_body = {"headers": {"content-type": "application/json"}}
    limits = [  # (request kwargs at the edge, one past it, status past it, words in the reason)
        ({"json": {"query": q, "k": 1000}}, {"json": {"query": q, "k": 1001}}, 422, "less than or equal to 1000"),
        ({"json": {"query": q, "k": 5, "reranker": RERANKER, "rerank_depth": 1000}},
         {"json": {"query": q, "k": 5, "reranker": RERANKER, "rerank_depth": 1001}}, 422, "less than or equal to 1000"),
        ({"json": {"query": _repeated(q, 4096), "k": 3}}, {"json": {"query": _repeated(q, 4097), "k": 3}}, 422,
         "at most 4096 characters"),
        ({"content": _padded_body(q, 65536), **json_body}, {"content": _padded_body(q, 65537), **json_body}, 413,
         "over 65536 bytes"),
        ({"json": {"query": q, "retrievers": ["bm25", "bm25-classic"]}},
         {"json": {"query": q, "retrievers": [f"r{i}" for i in range(9)]}}, 422, "at most 8 items"),
    ]
    assert len(limits[2][0]["json"]["query"]) == 4096 and len(limits[2][1]["json"]["query"]) == 4097
    for edge, past, status, reason in limits:
        r = server.post("/search", **edge)
        assert r.status_code == 200, (str(edge)[:200], r.status_code, r.text[:300])
        assert r.json()["results"], r.text[:300]
        r = server.post("/search", **past)
        assert r.status_code == status, (r.status_code, r.text[:300])
        assert reason in r.json()["detail"], r.text[:300]
    assert server.get("/healthz").json()["limits"] == {"k": 1000, "rerank_depth": 1000, "body_bytes": 65536,
                                                       "query_chars": 4096}


@pytest.mark.slow
def test_a_query_at_the_length_limit_with_many_distinct_terms_is_answered(server, queries):
    long = _long_query(next(iter(queries.values())), 4096)
    assert len(long) == 4096 and len(set(long.split())) > 1100
    r = server.post("/search", json={"query": long, "k": 3})
    assert r.status_code == 200 and r.json()["results"], (r.status_code, r.text[:300])


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
    assert "/readyz" in spec["paths"]
    ready = server.get("/readyz")  # serve.run returned: every replica is constructed and warmed up
    assert ready.status_code == 200, ready.text
    assert ready.json() == {"status": "ready", "waiting_for": [],
                            "deployments": ["reranker cedr-knrm", "retriever bm25", "retriever bm25-classic"]}
    docs = server.get("/docs")  # Swagger UI from the app's own assets: renders offline
    assert docs.status_code == 200 and "cdn" not in docs.text.lower()
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        assert f"/docs-assets/{asset}" in docs.text
        r = server.get(f"/docs-assets/{asset}")
        assert r.status_code == 200 and len(r.content) > 10_000


def _replica_names(deployment: str) -> list[str]:
    import ray

    prefix = f"SERVE_REPLICA::{APP}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == "serve" and a["name"].startswith(prefix))


def _kill_replica_and_wait_until_ready(server: httpx.Client, deployment: str, waiting_for: str) -> None:
    """Kill ``deployment``'s one replica (its process: the model, or the retriever's JVM, dies with it):
    /readyz answers 503 naming ``waiting_for`` while /healthz stays live, then 200 again once Serve
    has started and warmed up a new replica."""
    import ray
    from ray import serve

    (old,) = _replica_names(deployment)
    ray.kill(ray.get_actor(old, namespace="serve"), no_restart=True)
    r = server.get("/readyz")
    assert r.status_code == 503 and r.json()["waiting_for"] == [waiting_for], r.text
    assert r.headers["retry-after"] == "2" and server.get("/healthz").status_code == 200
    deadline = time.monotonic() + 180
    while True:  # bounded wait for Serve to start a new replica and report it healthy
        names = _replica_names(deployment)
        status = serve.status().applications[APP].deployments[deployment]
        if names and old not in names and status.status == "HEALTHY" and status.replica_states.get("RUNNING") == 1:
            break
        assert time.monotonic() < deadline, (names, status)
        time.sleep(0.5)
    while server.get("/readyz").status_code != 200:
        assert time.monotonic() < deadline, "not ready again"
        time.sleep(0.5)


@pytest.mark.slow
def test_killed_reranker_replica_is_replaced_without_failed_requests(server, offline, queries):
    # not ready while the replacement loads its model (seconds): /readyz names it, /healthz stays live
    _kill_replica_and_wait_until_ready(server, reranker_deployment_name(RERANKER), f"reranker {RERANKER}")
    want = offline["rerank20"].run(queries, k=10)
    for qid, text in queries.items():
        r = server.post("/search", json={"query": text, "k": 10, "reranker": RERANKER, "rerank_depth": 20})
        assert r.status_code == 200, r.text
        assert_same_ranking(r.json()["results"], want[qid], tol=1e-5)


@pytest.mark.slow
def test_retriever_replica_lost_turns_readyz_red_then_green(server, offline, queries):
    """The BM25 retriever's replica (and with it its JVM) dies: /readyz is 503 naming it until Serve
    has a new one searching, then 200, and searches answer as before."""
    _kill_replica_and_wait_until_ready(server, retriever_deployment_name("bm25"), "retriever bm25")
    want = offline["bm25"].run(queries, k=10)
    for qid, text in queries.items():
        r = server.post("/search", json={"query": text, "k": 10})
        assert r.status_code == 200, r.text
        assert_same_ranking(r.json()["results"], want[qid])


# The README's command for one machine, exactly as written there and in serve_config.yaml's header.
SERVE_RUN = ".venv/bin/serve run --address local serve_config.yaml"

CLIENT = r"""
import json, sys, time, httpx
out, t0, ready_at, health_at, answers = {}, time.monotonic(), None, None, []
with httpx.Client(base_url="http://127.0.0.1:8000", timeout=30) as c:
    while time.monotonic() - t0 < 420 and ready_at is None:
        try:
            if health_at is None and c.get("/healthz").status_code == 200:
                health_at = time.monotonic() - t0
            r = c.get("/readyz")
            if r.headers.get("content-type") == "application/json":  # the app's answer, not the proxy's
                answers.append([r.status_code, r.json()])
            if r.status_code == 200:
                ready_at = time.monotonic() - t0
        except httpx.TransportError:
            pass
        time.sleep(1)
    out.update(ready_at=ready_at, health_at=health_at, readyz=answers[-3:], statuses=sorted({a[0] for a in answers}))
    if ready_at is not None:
        out["health"] = c.get("/healthz").json()
        out["search"] = c.get("/search", params={"q": sys.argv[1], "k": 5}).json()
        out["reranked"] = c.post("/search", json={"query": sys.argv[1], "k": 5, "reranker": "cedr-knrm",
                                                  "rerank_depth": 10}).json()
        docs = c.get("/docs")
        out["docs"] = [docs.status_code, docs.text]
        out["docs_js"] = [c.get("/docs-assets/swagger-ui-bundle.js").status_code,
                          c.get("/docs-assets/swagger-ui.css").status_code]
print("CLIENT " + json.dumps(out))
"""


def _cpus_at_one_replica(config: dict, names: dict[str, list[str]]) -> float:
    """CPUs the application of ``config`` asks for with ``names`` deployed (kind -> deployment names),
    each at its fixed or minimum replica count."""
    args = AppArgs.model_validate(config["applications"][0]["args"])
    total = 0.0
    for kind, deployments in names.items():
        for name in deployments:
            opts = deployment_options(kind, name, args.deployments)
            replicas = opts.get("num_replicas") or opts["autoscaling_config"]["min_replicas"]
            total += replicas * opts["ray_actor_options"].get("num_cpus", 1)
    return total


def test_shipped_serve_config_fits_two_cores_and_the_cluster_one_does_not_need_to():
    """serve_config.yaml (one machine) deploys everything `make demo` builds in 2 CPUs; the cluster
    file keeps whole CPUs and GPUs per replica. Both pass Serve's schema and build_app's arguments."""
    from ray.serve.schema import ServeDeploySchema

    from ckray.full_pipeline import MODEL_DEFAULTS

    demo = {"ingress": ["SearchAPI"],
            "retriever": [f"retriever-{r}" for r in ("bm25", "ck-qti", "clear-dense", "clear")],
            "reranker": [f"reranker-{m}" for m in MODEL_DEFAULTS if m in rerankers()]}
    assert len(demo["reranker"]) == 3
    laptop = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    cluster = yaml.safe_load((ROOT / "serve_config.cluster.yaml").read_text())
    for config in (laptop, cluster):
        (app,) = ServeDeploySchema.model_validate(config).applications
        assert app.import_path == "ckray.serve:build_app"
        args = AppArgs.model_validate(app.args)
        for name in args.deployments:  # a kind, or the name of a deployment build_app makes
            kind = "ingress" if name == "SearchAPI" else name.split("-")[0]
            assert kind in ("ingress", "retriever", "reranker"), name
            known = first_stages() if kind == "retriever" else rerankers()
            assert name in (kind, "SearchAPI") or name.split("-", 1)[1] in known, name
        # Serve's own `deployments:` overrides must name deployments that always exist
        assert {d.name for d in app.deployments} <= {"SearchAPI", "retriever-bm25"}
    assert AppArgs.model_validate(laptop["applications"][0]["args"]).workdir == "work/demo"
    assert _cpus_at_one_replica(laptop, demo) <= 2.0
    assert _cpus_at_one_replica(cluster, demo) > 2.0       # sized for real nodes
    assert SERVE_RUN in (ROOT / "serve_config.yaml").read_text()
    assert SERVE_RUN in (ROOT / "README.md").read_text()


@pytest.mark.slow
def test_serve_run_serve_config_yaml_as_shipped(workdir, tmp_path, isolated):
    """The README's `serve run` with the shipped serve_config.yaml, unmodified, on a fresh local Ray
    (this machine's cores) although a dead head was left as the "current cluster": /readyz turns 200
    once every deployment answers, then searches, reranking and the offline /docs work; Ctrl-C stops it."""
    app = tmp_path / "app"
    (app / "work").mkdir(parents=True)
    shutil.copy(ROOT / "serve_config.yaml", app / "serve_config.yaml")
    (app / "work" / "demo").symlink_to(workdir[1])
    (app / ".venv").symlink_to(ROOT / ".venv")
    (app / "client.py").write_text(CLIENT)
    script = f"""
set -m  # job control, as in a terminal: the background `serve run` gets Ctrl-C's SIGINT
mkdir -p "$RAY_TMPDIR/ray" && echo 127.0.0.1:1 > "$RAY_TMPDIR/ray/ray_current_cluster"  # a dead head
{SERVE_RUN} > serve.log 2>&1 &
serve_pid=$!
.venv/bin/python client.py "kasodib zom"
kill -INT $serve_pid
for i in $(seq 60); do kill -0 $serve_pid 2>/dev/null || break; sleep 1; done
kill -0 $serve_pid 2>/dev/null && echo "SERVE STILL RUNNING" || echo "SERVE STOPPED"
"""
    p = isolated(script, cwd=app, timeout=600)
    log = (app / "serve.log").read_text()[-4000:] if (app / "serve.log").exists() else ""
    lines = [line for line in p.stdout.splitlines() if line.startswith("CLIENT ")]
    assert lines, p.stdout[-2000:] + p.stderr[-2000:] + log
    out = json.loads(lines[-1][len("CLIENT "):])
    assert out["ready_at"] is not None, (out, log)
    assert set(out["statuses"]) <= {200, 503}
    assert out["health_at"] is not None and out["health_at"] <= out["ready_at"]
    health = out["health"]
    assert health["retrievers"] == ["bm25"] and health["rerankers"] == [RERANKER]
    assert "ck-qti" in health["unavailable"]["retrievers"]
    assert out["readyz"][-1][1]["waiting_for"] == []
    assert sorted(out["readyz"][-1][1]["deployments"]) == ["reranker cedr-knrm", "retriever bm25"]
    assert 1 <= len(out["search"]["results"]) <= 5
    assert out["reranked"]["reranker"] == RERANKER and len(out["reranked"]["results"]) == 5
    status, html = out["docs"]
    assert status == 200 and "/docs-assets/swagger-ui-bundle.js" in html and "cdn" not in html.lower()
    assert out["docs_js"] == [200, 200]
    assert "SERVE STOPPED" in p.stdout, log
