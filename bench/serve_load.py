"""Bounded HTTP load on the local Ray Serve application, against the same pipeline in-process.

    python bench/serve_load.py                      # generated sample + a tiny random CEDR-KNRM
    python bench/serve_load.py --workdir work/demo --reranker cedr-knrm --rerank-depth 50

Starts a local Ray and Serve on a free loopback port, deploys ``ckray.serve`` with one replica per
deployment, and measures the pipeline "BM25 top ``rerank_depth`` → reranker → top ``k``":

1. in-process vs HTTP at concurrency 1, alternating in blocks of 8 queries (so both see the same
   machine load): the same ``ckray.pipelines`` pipeline called in this process (same torch threads
   as the reranker replica) and ``POST /search``; reports the ratio of the p50s, and checks that
   every HTTP answer equals the in-process one (same ids, same order);
2. a fixed number of requests per concurrency level (default 1, 4, 16), in ``--rounds`` rounds that
   cycle through the levels (load drift hits every level alike): p50/p99 latency, requests/s, the
   mean number of requests that shared a reranker batch, and the servers' per-stage p50 timings.

Stops by itself; loopback only. Ends with one JSON line.
"""

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TINY_BERT = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=128)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def prepare_sample(root: Path, reranker: str) -> tuple[Path, Path]:
    """Generated collection → shards, BM25 index, and a tiny random CEDR-KNRM checkpoint."""
    import torch

    from ckray.data.sample import sample_workdir
    from ckray.rankers.cedr.model import CEDRConfig, CEDRRanker
    from ckray.models.checkpoint import save_model
    from ckray.pipelines import checkpoint_dir

    data, w = sample_workdir(root)
    torch.manual_seed(0)
    model = CEDRRanker(CEDRConfig(variant="knrm", random_init=TINY_BERT, max_length=128, max_query_len=16,
                                  max_segments=2))
    save_model(model, checkpoint_dir(w, reranker))
    return data, w


def load_queries(data: Path | None, workdir: Path, n: int) -> list[str]:
    if data is not None:
        from ckray.data.collections import load_collection

        texts = list(load_collection(data).queries.values())
    else:  # titles make plausible queries for any work directory
        from ckray.data.shards import DocStore

        store = DocStore(workdir)
        texts = [store.get(d)[0] for d in store.ids()]
    texts = [t for t in texts if t.strip()]
    return [texts[i % len(texts)] for i in range(n)]


def paired_c1(url: str, body: dict, pipeline, queries: list[str], k: int, block: int = 8) -> dict:
    """In-process calls and the same queries over HTTP, alternating in blocks of ``block`` queries
    (each side runs back to back within a block, as it would under steady traffic)."""
    import httpx

    local, http, mismatches = [], [], 0
    with httpx.Client(timeout=300) as client:
        for start in range(0, len(queries), block):
            expected = []
            for q in queries[start:start + block]:
                t0 = time.perf_counter()
                expected.append([d for d, _ in pipeline.run({"q": q}, k=k)["q"]])
                local.append(time.perf_counter() - t0)
            for q, want in zip(queries[start:start + block], expected):
                t0 = time.perf_counter()
                r = client.post(url, json={**body, "query": q})
                http.append(time.perf_counter() - t0)
                r.raise_for_status()
                mismatches += [h["doc_id"] for h in r.json()["results"]] != want
    return {"inprocess_p50_ms": 1000 * percentile(local, 50), "http_p50_ms": 1000 * percentile(http, 50),
            "mismatched_answers": mismatches}


async def run_level(url: str, body: dict, queries: list[str], concurrency: int) -> dict:
    """Send ``queries`` with ``concurrency`` requests in flight; latencies, wall time, server stats."""
    import httpx

    latencies, batch_requests, stages = [], [], {}
    pending = iter(queries)

    async def worker(client: httpx.AsyncClient) -> None:
        for q in pending:
            t0 = time.perf_counter()
            r = await client.post(url, json={**body, "query": q})
            latencies.append(time.perf_counter() - t0)
            r.raise_for_status()
            out = r.json()
            batch_requests.append(out["batch"].get("rerank.requests", 0))
            for stage, ms in out["timings_ms"].items():
                stages.setdefault(stage, []).append(ms)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"latencies": latencies, "wall": wall, "batch_requests": batch_requests, "stages": stages}


def summarize(concurrency: int, parts: list[dict]) -> dict:
    lat = [x for p in parts for x in p["latencies"]]
    stages: dict[str, list[float]] = {}
    for p in parts:
        for k, v in p["stages"].items():
            stages.setdefault(k, []).extend(v)
    return {"concurrency": concurrency, "requests": len(lat), "p50_ms": 1000 * percentile(lat, 50),
            "p99_ms": 1000 * percentile(lat, 99), "rps": len(lat) / sum(p["wall"] for p in parts),
            "mean_batch_requests": statistics.mean(x for p in parts for x in p["batch_requests"]),
            "stage_p50_ms": {k: statistics.median(v) for k, v in stages.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None, help="serve this work directory (default: a generated sample)")
    p.add_argument("--data", default=None, help="collection directory for queries (default: the sample's)")
    p.add_argument("--reranker", default="cedr-knrm")
    p.add_argument("--rerank-depth", type=int, default=20)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--requests", type=int, default=96, help="requests per concurrency level (all rounds)")
    p.add_argument("--paired", type=int, default=48, help="in-process / HTTP pairs at concurrency 1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--torch-threads", type=int, default=1, help="reranker threads, in Serve and in-process")
    p.add_argument("--batch-wait-ms", type=float, default=0.0)
    p.add_argument("--forward-batch-size", type=int, default=16, help="pairs per forward pass (both sides)")
    p.add_argument("--reranker-replicas", type=int, default=1,
                   help="reranker replicas (each with --torch-threads CPUs); 1 isolates what batching gives")
    args = p.parse_args()

    import ray
    import torch
    from ray import serve

    from ckray.pipelines import build_pipeline
    from ckray.rankers import reranker_factory
    from ckray.serve import build_app

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tmp = tempfile.TemporaryDirectory(prefix="ckray-serve-bench-") if args.workdir is None else None
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    if tmp is not None:
        data, workdir = prepare_sample(Path(tmp.name), args.reranker)
    else:
        data, workdir = (Path(args.data) if args.data else None), Path(args.workdir)
    load_before = os.getloadavg()[0]
    levels = [int(c) for c in args.concurrency.split(",")]
    queries = load_queries(data, workdir, max(args.requests, args.paired))
    pipeline = f"bm25>{args.reranker}"

    torch.set_num_threads(args.torch_threads)
    # a checkpoint reranker's forward batch; a lookup reranker (ck-qti: stored impacts) has none
    options = {} if reranker_factory(args.reranker) is not None else {"batch_size": args.forward_batch_size}
    local = build_pipeline(pipeline, workdir, rerank_depth=args.rerank_depth, reranker_options=options)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    one = {"num_replicas": 1}
    serve.run(build_app({
        "workdir": str(workdir), "default_pipeline": pipeline, "retrievers": ["bm25"], "rerankers": [args.reranker],
        "batching": {"batch_wait_timeout_s": args.batch_wait_ms / 1000, "forward_batch_size": args.forward_batch_size,
                     "torch_threads": args.torch_threads},
        "deployments": {"ingress": one, "retriever": one,
                        "reranker": {"num_replicas": args.reranker_replicas,
                                     "ray_actor_options": {"num_cpus": args.torch_threads}}}}),
        name="ckray-bench", route_prefix="/", logging_config={"enable_access_log": False})
    url = f"http://127.0.0.1:{port}/search"
    body = {"k": args.k, "retrievers": ["bm25"], "reranker": args.reranker, "rerank_depth": args.rerank_depth}
    try:
        local.run({"warm": queries[0]}, k=args.k)
        asyncio.run(run_level(url, body, queries[:16], 4))  # warm-up: connections, first-call paths
        paired = paired_c1(url, body, local, queries[:args.paired], args.k)
        per_round = max(1, args.requests // args.rounds)
        parts: dict[int, list[dict]] = {c: [] for c in levels}
        for r in range(args.rounds):
            chunk = queries[r * per_round:(r + 1) * per_round] or queries[:per_round]
            for c in levels:
                parts[c].append(asyncio.run(run_level(url, body, chunk, c)))
    finally:
        serve.shutdown()
        ray.shutdown()
        if tmp is not None:
            tmp.cleanup()

    results = [summarize(c, parts[c]) for c in levels]
    by_c = {r["concurrency"]: r for r in results}
    print(f"pipeline {pipeline}, rerank_depth {args.rerank_depth}, k {args.k}; {os.cpu_count()} CPUs, "
          f"load average {load_before:.1f} → {os.getloadavg()[0]:.1f}")
    print(f"concurrency 1, alternating: in-process p50 {paired['inprocess_p50_ms']:.1f} ms, "
          f"HTTP p50 {paired['http_p50_ms']:.1f} ms, {paired['mismatched_answers']} mismatched answers")
    print(f"{'conc':>4} {'reqs':>5} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} {'batch':>6}  server-side p50 ms")
    for r in results:
        print(f"{r['concurrency']:>4} {r['requests']:>5} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} {r['rps']:>7.1f} "
              f"{r['mean_batch_requests']:>6.2f}  " + ", ".join(f"{k} {v:.1f}" for k, v in r["stage_p50_ms"].items()))
    summary = {
        "bench": "serve_load", "pipeline": pipeline, "model": "CEDR-KNRM, random 2-layer BERT (hidden 32), "
        "max_length 128, 2 segments" if tmp is not None else args.reranker,
        "rerank_depth": args.rerank_depth, "k": args.k, "torch_threads": args.torch_threads,
        "batch_wait_ms": args.batch_wait_ms, "forward_batch_size": args.forward_batch_size, "cpus": os.cpu_count(),
        "reranker_replicas": args.reranker_replicas,
        "inprocess_p50_ms": round(paired["inprocess_p50_ms"], 2),
        "http_c1_paired_p50_ms": round(paired["http_p50_ms"], 2),
        "http_over_inprocess_p50_c1": round(paired["http_p50_ms"] / paired["inprocess_p50_ms"], 3),
        "mismatched_answers": paired["mismatched_answers"],
        "loadavg_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "levels": {str(r["concurrency"]): {k: round(r[k], 2) for k in ("requests", "p50_ms", "p99_ms", "rps",
                                                                         "mean_batch_requests")} for r in results},
    }
    if 1 in by_c and 16 in by_c:
        summary["throughput_16_over_1"] = round(by_c[16]["rps"] / by_c[1]["rps"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
