"""How each stage scales with the corpus: wall time, documents/s and peak memory at N documents.

    python bench/scale.py                          # N = 10 k and 100 k passages of ~60 words
    python bench/scale.py --large                  # also 1 M
    python bench/scale.py --long --sizes 10000     # documents of ~1,000 words
    python bench/scale.py --sizes 10000 --stages prepare,training-data,evaluate --workdir /tmp/scale

For each N a synthetic BEIR collection is generated (``--root``, kept for reruns): N documents of
words drawn from a Zipf-like vocabulary, ``--train-queries`` training and ``--test-queries`` test
queries of 4 words taken from one document each (that document is their one relevant one). Then,
on one local Ray head (``ckray.cluster.local_head``, 4 logical CPUs, shared by all stages), each stage
runs in a process of its own, as its job would:

- ``prepare``: ``api.prepare`` (Ray Data shards, document store, BM25 index, BM25 negatives of the
  training queries at ``--negative-depth`` on the actor pool);
- ``training-data``: ``build_training_data``, every triple streamed through (counted, not kept);
- ``train``: ``--steps`` steps of a tiny CK-QTI (1 Conformer layer, 128 document word pieces);
- ``impact-index``: ``api.build_index("ck-qti")`` with that checkpoint (``--top-k`` terms a document; a
  tiny random CK-QTI when ``train`` did not run). Not among the default stages: scoring each document
  with its expansion candidates is by far the slowest stage on CPUs (``--stages`` names it);
- ``dense-index``: ``api.build_index("clear")`` with a tiny random CLEAR (2-layer BERT, hidden 32),
  λ tuned on held-out training queries;
- ``evaluate``: ``api.evaluate`` of ``bm25`` (and ``ck-qti`` / ``clear`` when their index was built) on
  the test queries;
- ``serve``: one Serve application (ingress with the document store, one BM25 retriever replica; with
  ``--serve-dense`` also a CLEAR replica) answering the test queries over HTTP.

Per stage and N one JSON line: ``wall_s``, ``docs_per_s`` (N / wall time), ``driver_peak_rss_mb`` (the
stage process's ``ru_maxrss``), ``worker_peak_rss_mb`` and ``worker_peak`` (the largest process of the
stage's Ray cluster, ``ray::*``, or a subprocess of the stage such as Lucene's indexer, sampled
every 0.2 s; the JVM's heap is capped by ``$CKRAY_JVM_HEAP`` and counted there); ``driver_peak_anon_mb`` and
``worker_peak_anon_mb``, the same for anonymous memory only (``RssAnon``, sampled: what a process owns, without
the pages of the files it maps — the document store, Lucene's index — which the kernel can drop); where the
stage process runs Lucene in-process, ``jvm_heap_committed_mb`` and ``driver_peak_anon_less_jvm_heap_mb``
(what Python holds: the JVM commits heap lazily, up to its cap, and seldom returns it), the load average
before and after, and the stage's own figures. Then one summary line with, for each stage, the
growth from the smallest N to each larger one of the driver's and the largest worker's peak RSS and
of the time per document. The machine may be shared: times are upper bounds (the load is printed).
A stage that fails is reported with its error and the stages that need it are skipped.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STAGES = ("prepare", "training-data", "train", "impact-index", "dense-index", "evaluate", "serve")
DEFAULT_STAGES = tuple(s for s in STAGES if s != "impact-index")  # see the module docstring
NEEDS = {"training-data": "prepare", "train": "prepare", "impact-index": "prepare", "dense-index": "prepare",
         "evaluate": "prepare", "serve": "prepare"}
VOCAB = 30_000
SEED = 11
TINY_BERT = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 128}


# --------------------------------------------------------------------------- data

def vocabulary(rng: random.Random) -> list[str]:
    consonants, vowels = "bcdfghklmnprstvz", "aeiou"
    words = set()
    while len(words) < VOCAB:
        words.add("".join(rng.choice(consonants) + rng.choice(vowels) for _ in range(rng.randint(2, 4))))
    return sorted(words)


def generate(root: Path, n: int, words: int, train_queries: int, test_queries: int) -> Path:
    """A BEIR directory of ``n`` documents of about ``words`` words (kept: a finished one has ``.done``)."""
    out = root / f"n{n}-w{words}"
    if (out / ".done").exists():
        return out
    rng = random.Random(SEED)
    vocab = vocabulary(rng)
    weights = [1.0 / (r + 10) for r in range(VOCAB)]  # Zipf-like: a few frequent words, a long tail
    cum = list(itertools.accumulate(weights))
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    judged = rng.sample(range(n), min(n, train_queries + test_queries))
    texts: dict[int, list[str]] = {}
    wanted = set(judged)
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for i in range(n):
            body = rng.choices(vocab, cum_weights=cum, k=rng.randint(words * 2 // 3, words * 4 // 3))
            title = rng.choices(vocab, cum_weights=cum, k=rng.randint(3, 8))
            f.write(json.dumps({"_id": f"d{i}", "title": " ".join(title), "text": " ".join(body)}) + "\n")
            if i in wanted:
                texts[i] = body
    rank = {w: r for r, w in enumerate(vocab)}
    queries, qrels = [], {"train": [], "test": []}
    for j, i in enumerate(judged):  # 4 of the document's 8 rarest words: BM25 finds it, not always first
        rare = sorted(set(texts[i]), key=rank.__getitem__, reverse=True)[:8]
        queries.append({"_id": f"q{j}", "text": " ".join(rng.sample(rare, min(4, len(rare))))})
        qrels["train" if j < train_queries else "test"].append(f"q{j}\td{i}\t1")
    (out / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    for split, lines in qrels.items():
        (out / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(l + "\n" for l in lines))
    (out / ".done").write_text("")
    return out


# --------------------------------------------------------------------------- stages (each in its own process)

def stage_prepare(a: argparse.Namespace) -> dict:
    from ckray import api

    prepared = api.prepare(a.data, a.workdir, shards=a.shards, train_split="train", negative_depth=a.negative_depth)
    return {"documents": prepared.manifest["documents"], "shards": len(prepared.manifest["shards"])}


def stage_training_data(a: argparse.Namespace) -> dict:
    from ckray.data.collections import read_queries_and_qrels
    from ckray.data.examples import TrainingDataConfig, build_training_data

    queries, qrels = read_queries_and_qrels(Path(a.data))
    config = TrainingDataConfig(negative_depth=a.negative_depth, max_dev_queries=20, dev_depth=20)
    data = build_training_data(a.workdir, queries, qrels["train"], config)
    triples = sum(len(batch["query"]) for batch in data.triples.iter_batches(batch_size=1024, batch_format="numpy"))
    return {"triples": triples}


def stage_train(a: argparse.Namespace) -> dict:
    from ckray import api
    from ckray.rankers.ck_qti.options import CKQTIOptions

    result = api.train("ck-qti", a.data, a.workdir, options=CKQTIOptions(layers=1, max_doc_len=128),
                       loop={"max_steps": a.steps, "workers": 1}, max_dev_queries=10, dev_depth=10,
                       negative_depth=a.negative_depth)
    return {"steps": result.steps}


def stage_impact_index(a: argparse.Namespace) -> dict:
    """With the CK-QTI the ``train`` stage trained, else (that stage skipped or failed) a tiny random one
    whose IDF comes from the corpus (streamed)."""
    import torch

    from ckray import api
    from ckray.data.shards import iter_doc_texts
    from ckray.models.checkpoint import save_model
    from ckray.rankers.ck_qti.impact import default_checkpoint
    from ckray.rankers.ck_qti.model import CKModel, small_config

    checkpoint = default_checkpoint(a.workdir)
    trained = (checkpoint / "config.json").exists()
    if not trained:
        checkpoint = Path(a.workdir) / "checkpoints" / "ck-qti-random"
        torch.manual_seed(0)
        model = CKModel(small_config(vocab_size=30522, max_doc_len=128)).eval()
        model.set_idf_from_texts(iter_doc_texts(a.workdir))
        save_model(model, checkpoint)
    s = api.build_index("ck-qti", a.data, a.workdir, checkpoint=str(checkpoint), top_k=a.top_k, actors=1,
                        batch_size=64)
    return {"documents": s.get("total_documents"), "index_bytes": s.get("index_bytes"),
            "checkpoint": "trained" if trained else "random"}


def stage_dense_index(a: argparse.Namespace) -> dict:
    import torch

    from ckray import api
    from ckray.models.checkpoint import save_model
    from ckray.models.encoders import resolve_encoder
    from ckray.rankers.clear.model import CLEAR, CLEARConfig

    checkpoint = Path(a.workdir) / "checkpoints" / "clear"
    if not (checkpoint / "config.json").exists():
        torch.manual_seed(0)
        save_model(CLEAR(CLEARConfig(encoder=resolve_encoder(None), pretrained=False, bert_config=dict(TINY_BERT),
                                     doc_max_len=64)), checkpoint)
    s = api.build_index("clear", a.data, a.workdir, checkpoint=str(checkpoint), actors=1)
    return {k: s.get(k) for k in ("documents", "shards_written") if k in s}


def stage_evaluate(a: argparse.Namespace) -> dict:
    from ckray import api
    from ckray.rankers.ck_qti.impact import impact_index_dir
    from ckray.rankers.clear.layout import index_dir

    pipelines = ["bm25"] + (["ck-qti"] if impact_index_dir(a.workdir).is_dir() else []) + (
        ["clear"] if index_dir(a.workdir).is_dir() else [])
    metrics = api.evaluate(pipelines, a.data, a.workdir, split="test", k=100)
    return {"queries": a.test_queries, "nDCG@10": {p: round(m["nDCG@10"], 4) for p, m in metrics.items()}}


def stage_serve(a: argparse.Namespace) -> dict:
    import socket

    import httpx
    import ray
    from ray import serve

    from ckray.data.collections import read_queries_and_qrels
    from ckray.serve import build_app

    queries, qrels = read_queries_and_qrels(Path(a.data))
    texts = [queries[q] for q in qrels["test"]]
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    retrievers = ["bm25"] + (["clear"] if a.serve_dense else [])
    t0 = time.perf_counter()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"workdir": a.workdir, "default_pipeline": "bm25", "retrievers": retrievers, "rerankers": [],
                         "deployments": {"ingress": {"num_replicas": 1}, "retriever": {"num_replicas": 1}}}),
              name="ckray-scale", route_prefix="/", logging_config={"enable_access_log": False})
    started = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        with httpx.Client(timeout=300) as client:
            for text in texts:
                for pipeline in retrievers:
                    r = client.post(f"http://127.0.0.1:{port}/search",
                                    json={"query": text, "k": 10, "retrievers": [pipeline]})
                    r.raise_for_status()
        answering = time.perf_counter() - t1
    finally:
        serve.shutdown()
    return {"start_s": round(started, 1), "queries": len(texts) * len(retrievers),
            "queries_per_s": round(len(texts) * len(retrievers) / answering, 1)}


def run_stage(a: argparse.Namespace) -> None:
    """The child process: run one stage, print its figures and this process's peak RSS as JSON."""
    import resource

    from ckray.cli import setup_logging

    setup_logging("WARNING")
    t0 = time.perf_counter()
    out = globals()["stage_" + a.run_stage.replace("-", "_")](a)
    out["stage_s"] = round(time.perf_counter() - t0, 2)
    out["driver_peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    heap = jvm_heap_committed_mb()
    if heap is not None:   # an in-process JVM (Lucene): its heap grows lazily up to $CKRAY_JVM_HEAP
        out["jvm_heap_committed_mb"] = heap
    print("STAGE-RESULT " + json.dumps(out), flush=True)


def jvm_heap_committed_mb() -> float | None:
    """The heap this process's JVM has committed (``Runtime.totalMemory``), or None without a JVM. It only grows
    (up to ``-Xmx``, ``$CKRAY_JVM_HEAP``), so subtracting it from the peak RSS leaves what Python holds."""
    import jnius_config

    if not jnius_config.vm_running:
        return None
    import jnius

    return round(jnius.autoclass("java.lang.Runtime").getRuntime().totalMemory() / 2**20, 1)


# --------------------------------------------------------------------------- the parent: processes and memory

def anon_rss(pid: int) -> int:
    """The anonymous resident memory of ``pid`` in bytes (``RssAnon``: what the process owns, without the pages of
    files it maps, such as the document store's Arrow files and Lucene's index), 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler(threading.Thread):
    """Largest RSS among the cluster's Ray worker processes and the stage process's subprocesses; the largest
    anonymous RSS among them, and the stage process's own anonymous RSS."""

    def __init__(self, cluster_pids, stage_pid: int, interval: float = 0.2):
        super().__init__(daemon=True)
        self.cluster_pids, self.stage_pid, self.interval = cluster_pids, stage_pid, interval
        self.peak, self.name = 0, ""
        self.peak_anon, self.driver_anon = 0, 0
        self.stop = threading.Event()

    def _candidates(self):
        import psutil

        seen = set()
        for pid in self.cluster_pids():
            seen.add(pid)
            try:
                p = psutil.Process(pid)
                if p.name().startswith("ray::") or (p.cmdline()[:1] and p.cmdline()[0].startswith("ray::")):
                    yield p
            except (psutil.Error, IndexError):
                continue
        try:
            for p in psutil.Process(self.stage_pid).children(recursive=True):
                if p.pid not in seen:
                    yield p
        except psutil.Error:
            return

    def run(self) -> None:
        import psutil

        while not self.stop.is_set():
            self.driver_anon = max(self.driver_anon, anon_rss(self.stage_pid))
            for p in self._candidates():
                try:
                    rss = p.memory_info().rss
                    if rss > self.peak:
                        title = " ".join(p.cmdline()[:3])
                        self.peak, self.name = rss, title[:80]
                    self.peak_anon = max(self.peak_anon, anon_rss(p.pid))
                except psutil.Error:
                    continue
            self.stop.wait(self.interval)


def measure(stage: str, a: argparse.Namespace, data: Path, workdir: Path, head) -> dict:
    cmd = [sys.executable, __file__, "--run-stage", stage, "--data", str(data), "--workdir", str(workdir)]
    for flag in ("shards", "negative_depth", "steps", "top_k", "test_queries"):
        cmd += [f"--{flag.replace('_', '-')}", str(getattr(a, flag))]
    cmd += ["--serve-dense"] if a.serve_dense else []
    env = {**head.env, "RAY_ADDRESS": head.gcs_address}
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = PeakSampler(head.processes, proc.pid)
    sampler.start()
    try:
        stdout, stderr = proc.communicate()
    finally:
        if proc.poll() is None:  # interrupted: the stage goes too (the cluster is stopped by local_head)
            proc.kill()
        sampler.stop.set()
        sampler.join()
    wall = time.perf_counter() - t0
    row = {"bench": "scale", "stage": stage, "n": a.current_n, "long": a.long, "wall_s": round(wall, 1),
           "docs_per_s": round(a.current_n / wall, 1), "worker_peak_rss_mb": round(sampler.peak / 2**20, 1),
           "worker_peak_anon_mb": round(sampler.peak_anon / 2**20, 1),
           "driver_peak_anon_mb": round(sampler.driver_anon / 2**20, 1),
           "worker_peak": sampler.name, "loadavg_1m": [round(load, 1), round(os.getloadavg()[0], 1)]}
    result = [line for line in stdout.splitlines() if line.startswith("STAGE-RESULT ")]
    if proc.returncode != 0 or not result:
        row["error"] = (stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1][:300]
        (workdir / f"{stage}.log").write_text(stdout + stderr)
    else:
        row.update(json.loads(result[-1][len("STAGE-RESULT "):]))
        if "jvm_heap_committed_mb" in row:
            row["driver_peak_anon_less_jvm_heap_mb"] = round(row["driver_peak_anon_mb"] - row["jvm_heap_committed_mb"], 1)
    return row


def summarize(rows: list[dict]) -> dict:
    """Growth of each stage's peak RSS (driver, largest worker) and time per document from the smallest N."""
    growth: dict[str, dict] = {}
    ok = [r for r in rows if "error" not in r]
    for stage in dict.fromkeys(r["stage"] for r in ok):
        by_n = {r["n"]: r for r in ok if r["stage"] == stage}
        sizes = sorted(by_n)
        for big in sizes[1:]:
            small = by_n[sizes[0]]
            b = by_n[big]
            growth.setdefault(stage, {})[f"{sizes[0]}->{big}"] = {
                "driver_rss": round(b["driver_peak_rss_mb"] / small["driver_peak_rss_mb"], 2),
                "driver_anon": round(b["driver_peak_anon_mb"] / max(small["driver_peak_anon_mb"], 1), 2),
                **({"driver_anon_less_jvm_heap": round(b["driver_peak_anon_less_jvm_heap_mb"]
                                                       / small["driver_peak_anon_less_jvm_heap_mb"], 2)}
                   if "driver_peak_anon_less_jvm_heap_mb" in b and "driver_peak_anon_less_jvm_heap_mb" in small else {}),
                "worker_anon": round(max(b["worker_peak_anon_mb"], 1) / max(small["worker_peak_anon_mb"], 1), 2),
                "worker_rss": round(max(b["worker_peak_rss_mb"], 1) / max(small["worker_peak_rss_mb"], 1), 2),
                "time_per_doc": round((b["wall_s"] / big) / (small["wall_s"] / sizes[0]), 3)}
    return {"bench": "scale-summary", "growth": growth, "cores": os.cpu_count(),
            "failed": [f"{r['stage']}@{r['n']}" for r in rows if "error" in r]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--large", action="store_true", help="also N = 1,000,000")
    p.add_argument("--long", action="store_true", help="documents of ~1,000 words instead of ~60")
    p.add_argument("--stages", default=",".join(DEFAULT_STAGES),
                   help=f"comma-separated, of {', '.join(STAGES)} (default: all but impact-index)")
    p.add_argument("--root", default="/tmp/ckray-scale", help="generated collections and work directories")
    p.add_argument("--train-queries", type=int, default=300)
    p.add_argument("--test-queries", type=int, default=300)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--negative-depth", type=int, default=100)
    p.add_argument("--steps", type=int, default=4, help="training steps of the tiny CK-QTI")
    p.add_argument("--top-k", type=int, default=32, help="impact terms per document")
    p.add_argument("--serve-dense", action="store_true", help="serve the CLEAR retriever too")
    p.add_argument("--run-stage", choices=STAGES, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    a = p.parse_args()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout`/kill: clean up as on Ctrl-C
    if a.run_stage:
        run_stage(a)
        return
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        p.error(f"--stages: unknown stage(s) {', '.join(unknown)}; known: {', '.join(STAGES)}")
    sizes = sorted(set(a.sizes + ([1_000_000] if a.large else [])))
    from ckray.cluster import local_head

    root = Path(a.root)
    rows = []
    with local_head(4, cwd=str(Path(__file__).resolve().parents[1])) as head:
        for n in sizes:
            a.current_n = n
            t0 = time.perf_counter()
            data = generate(root / "data", n, 1000 if a.long else 60, a.train_queries, a.test_queries)
            print(json.dumps({"bench": "scale", "stage": "generate", "n": n, "wall_s": round(time.perf_counter() - t0, 1),
                              "corpus_mb": round((data / "corpus.jsonl").stat().st_size / 2**20, 1)}), flush=True)
            workdir = root / "work" / data.name
            workdir.mkdir(parents=True, exist_ok=True)
            failed: set[str] = set()
            for stage in stages:
                if NEEDS.get(stage) in failed:
                    failed.add(stage)
                    continue
                row = measure(stage, a, data, workdir, head)
                if "error" in row:
                    failed.add(stage)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps(summarize(rows)), flush=True)


if __name__ == "__main__":
    main()
