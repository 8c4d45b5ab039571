"""Reranking throughput: CEDR-KNRM vs the vanilla BERT ranker, full encoder vs half its layers.

All four models score the same (query, document) pairs from SciFact (claims × abstracts: each
sampled test claim's judged abstracts plus random others), through ``ckray.rerank.rerank_local``
(tokenisation, segmenting, encoder, ranker head, sorting). The heads are untrained: this measures
speed, not effectiveness. Timings interleave the models over several rounds and keep each model's
best round, which damps noise from other work on the machine; on a shared CPU box the CPU-time
rates (docs per CPU-second of this process) are the steadier comparison, and are reported beside
the wall-clock rates.

    python bench/rerank.py [--queries 8] [--docs-per-query 8] [--batch-size 16] [--rounds 3] [--budget-s 240]

Prints a table, the ratios, and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SCIFACT = ROOT.parent / "shared" / "data" / "scifact"


def load_pairs(n_queries: int, docs_per_query: int, seed: int = 0):
    """SciFact test claims with their judged abstracts, topped up with random abstracts."""
    corpus = {}
    with open(SCIFACT / "corpus.jsonl") as f:
        for line in f:
            d = json.loads(line)
            corpus[d["_id"]] = (d.get("title", "") + " " + d.get("text", "")).strip()
    with open(SCIFACT / "queries.jsonl") as f:
        all_queries = {q["_id"]: q["text"] for q in map(json.loads, f)}
    qrels: dict[str, list[str]] = {}
    with open(SCIFACT / "qrels" / "test.tsv") as f:
        next(f)
        for line in f:
            qid, did, _ = line.rstrip("\n").split("\t")
            qrels.setdefault(qid, []).append(did)
    rng = random.Random(seed)
    qids = sorted(qrels, key=int)
    rng.shuffle(qids)
    qids = qids[:n_queries]
    doc_ids = sorted(corpus)
    run = {}
    for qid in qids:
        docs = [d for d in qrels[qid] if d in corpus][:docs_per_query]
        while len(docs) < docs_per_query:
            d = rng.choice(doc_ids)
            if d not in docs:
                docs.append(d)
        run[qid] = [(d, float(docs_per_query - i)) for i, d in enumerate(docs)]
    queries = {q: all_queries[q] for q in qids}
    needed = {d for docs in run.values() for d, _ in docs}
    return queries, run, {d: corpus[d] for d in needed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queries", type=int, default=8)
    ap.add_argument("--docs-per-query", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="start no further round once this many seconds of timing have passed (>= 1 round)")
    ap.add_argument("--max-segments", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()

    if not (SCIFACT / "corpus.jsonl").exists():
        print(f"SKIP: SciFact not found at {SCIFACT} (../shared is only on development machines and CI)")
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)

    from ckray.device import default_device
    from ckray.rankers.cedr.model import CEDRConfig, CEDRRanker
    from ckray.rerank import rerank_local

    queries, run, docs = load_pairs(args.queries, args.docs_per_query)
    n_pairs = sum(len(v) for v in run.values())
    device = default_device()
    torch.manual_seed(0)
    full_layers = None
    models = {}
    for variant in ("knrm", "vanilla"):
        m = CEDRRanker(CEDRConfig(variant=variant, max_segments=args.max_segments)).to(device).eval()
        full_layers = m.encoder.config.num_hidden_layers
        models[(variant, full_layers)] = m
    half = max(1, full_layers // 2)
    for variant in ("knrm", "vanilla"):
        m = CEDRRanker(CEDRConfig(variant=variant, num_layers=half, max_segments=args.max_segments))
        models[(variant, half)] = m.to(device).eval()

    probe = next(iter(models.values()))
    seg_counts = [
        int(probe.tokenize_pairs([queries[q]], [docs[d]])["input_ids"].shape[0])
        for q, ds in run.items() for d, _ in ds]
    doc_tokens = [len(probe.tokenizer(docs[d], add_special_tokens=False, verbose=False)["input_ids"]) for d in docs]
    print(f"device={device} torch_threads={torch.get_num_threads()} pairs={n_pairs} "
          f"queries={len(queries)} batch_size={args.batch_size}", flush=True)
    print(f"doc word pieces: mean {sum(doc_tokens) / len(doc_tokens):.0f}, max {max(doc_tokens)}; "
          f"segments per pair: mean {sum(seg_counts) / len(seg_counts):.2f}, max {max(seg_counts)}")

    # warm-up (allocator, kernels) on a few pairs per model
    warm_q = dict(list(queries.items())[:1])
    warm_run = {q: run[q][:4] for q in warm_q}
    for m in models.values():
        rerank_local(m, warm_q, warm_run, docs, depth=4, batch_size=args.batch_size)

    best = {k: float("inf") for k in models}
    best_cpu = {k: float("inf") for k in models}
    outputs = {}
    start = time.perf_counter()
    rounds = 0
    while rounds < args.rounds and (rounds == 0 or time.perf_counter() - start < args.budget_s):
        for key, m in models.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outputs[key] = rerank_local(m, queries, run, docs, depth=args.docs_per_query,
                                        batch_size=args.batch_size)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[key], best_cpu[key] = min(best[key], wall), min(best_cpu[key], cpu)
            print(f"  round {rounds + 1}: {key[0]}-L{key[1]} wall {wall:.2f}s cpu {cpu:.2f}s", flush=True)
        rounds += 1
    assert all(len(out[q]) == len(run[q]) for out in outputs.values() for q in run)

    rate = {k: n_pairs / t for k, t in best.items()}
    cpu_rate = {k: n_pairs / t for k, t in best_cpu.items()}
    name = {"knrm": "CEDR-KNRM", "vanilla": "vanilla BERT"}
    print()
    print(f"{'model':<14}{'layers':>7}{'wall s':>9}{'docs/s':>9}{'cpu s':>9}{'docs/cpu-s':>12}")
    for key, t in best.items():
        print(f"{name[key[0]]:<14}{key[1]:>7}{t:>9.2f}{rate[key]:>9.2f}{best_cpu[key]:>9.2f}{cpu_rate[key]:>12.2f}")

    def ratios_of(r):
        return {
            "knrm_over_vanilla_full": r[("knrm", full_layers)] / r[("vanilla", full_layers)],
            "knrm_over_vanilla_half": r[("knrm", half)] / r[("vanilla", half)],
            "knrm_half_over_full": r[("knrm", half)] / r[("knrm", full_layers)],
            "vanilla_half_over_full": r[("vanilla", half)] / r[("vanilla", full_layers)],
        }

    ratios, cpu_ratios = ratios_of(rate), ratios_of(cpu_rate)
    print()
    print(f"{'ratio (docs/s)':<26}{'wall':>7}{'cpu':>7}")
    for k, v in ratios.items():
        print(f"{k:<26}{v:>6.2f}x{cpu_ratios[k]:>6.2f}x")
    result = {
        "bench": "rerank", "device": str(device), "torch_threads": torch.get_num_threads(),
        "pairs": n_pairs, "batch_size": args.batch_size, "rounds": rounds,
        "full_layers": full_layers, "half_layers": half,
        "docs_per_s": {f"{v}-L{layer}": round(r, 2) for (v, layer), r in rate.items()},
        "docs_per_cpu_s": {f"{v}-L{layer}": round(r, 2) for (v, layer), r in cpu_rate.items()},
        **{k: round(v, 3) for k, v in ratios.items()},
        "cpu_ratios": {k: round(v, 3) for k, v in cpu_ratios.items()},
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
