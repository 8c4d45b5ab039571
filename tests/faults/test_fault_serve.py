"""Serve under overload: more concurrent requests than the deployments' ``max_ongoing_requests`` plus
their ``max_queued_requests`` hold. Every request is answered: 200 with the same results as when the
service is idle, or 503 with ``Retry-After`` (the ingress's queue is full: Serve's proxy; the reranker's
is: the ingress, after its retries) — never a 500, never a hang; afterwards the service answers again."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

pytestmark = pytest.mark.slow

RERANKER = "cedr-knrm"
TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=128)
BURST = 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def overload_server(ray_session, tmp_path_factory):
    """The application on the sample with tiny limits: ingress 4 ongoing + 2 queued, reranker 1 + 1."""
    import torch
    from ray import serve

    from ckray.data.sample import sample_workdir
    from ckray.models.checkpoint import save_model
    from ckray.pipelines import checkpoint_dir
    from ckray.rankers.cedr.model import CEDRConfig, CEDRRanker
    from ckray.serve import build_app

    data, w = sample_workdir(tmp_path_factory.mktemp("overload"))
    torch.manual_seed(0)
    save_model(CEDRRanker(CEDRConfig(variant="knrm", random_init=TINY_BERT, max_length=128, max_query_len=16,
                                     max_segments=2)), checkpoint_dir(w, RERANKER))
    small = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}
    limits = {"ingress": {**small, "max_ongoing_requests": 4, "max_queued_requests": 2,
                          "backpressure_config": {"retry_after_s": 1}},
              "retriever": small,
              "reranker": {**small, "max_ongoing_requests": 1, "max_queued_requests": 1}}
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = {"workdir": str(w), "default_pipeline": "bm25", "retrievers": ["bm25"], "rerankers": [RERANKER],
            "batching": {"batch_wait_timeout_s": 0.05, "forward_batch_size": 16, "torch_threads": 1},
            "deployments": limits}
    serve.run(build_app(args), name="ckray-overload", route_prefix="/")
    from ckray.data.collections import load_collection

    queries = list(load_collection(data).split_queries("test").values())[:BURST]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
        assert client.get("/healthz").status_code == 200
        yield client, queries
    serve.delete("ckray-overload")
    serve.shutdown()


def body(query: str) -> dict:
    return {"query": query, "k": 10, "reranker": RERANKER, "rerank_depth": 50}


def test_overload_gets_200_or_503_with_retry_after_never_500_or_a_hang(overload_server):
    client, queries = overload_server
    idle = {}
    for q in queries:  # one at a time: what each query's answer is
        r = client.post("/search", json=body(q))
        assert r.status_code == 200, r.text
        idle[q] = [(h["doc_id"], h["score"]) for h in r.json()["results"]]

    async def burst() -> list[tuple[str, httpx.Response]]:
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120) as ac:
            responses = await asyncio.gather(*(ac.post("/search", json=body(q)) for q in queries))
            return list(zip(queries, responses))

    answered = asyncio.run(burst())  # httpx raises on a hang (timeout 120 s): the test fails
    codes = sorted(r.status_code for _, r in answered)
    assert set(codes) <= {200, 503}, [(r.status_code, r.text[:300]) for _, r in answered]
    assert 200 in codes and 503 in codes, codes
    for q, r in answered:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1, (r.headers, r.text)
        else:
            got = [(h["doc_id"], h["score"]) for h in r.json()["results"]]
            assert [d for d, _ in got] == [d for d, _ in idle[q]]
            assert [s for _, s in got] == pytest.approx([s for _, s in idle[q]], abs=1e-5)
    # the overload is over: every query is answered again
    for q in queries[:3]:
        assert client.post("/search", json=body(q)).status_code == 200
