"""QDS-Transformer scoring throughput with each attention kernel, side by side: the sparse kernel
(``qds_attention``) against the fused-mask kernel (torch's SDPA under the pattern's mask), by input length
and precision, on this machine's CPU or GPU. What ``QDSConfig.attention_kernel="auto"`` picks for scoring
rests on these figures (``ckray.rankers.qds.model.resolve_attention_kernel``).

The model is MiniLM with the QDS pattern (window 128) at ``max_length`` n, scoring in eval mode without
gradients (``score_texts``, as reranking does) SciFact training triples' relevant documents, each extended
with random other documents to ``n`` × 0.88 words (``bench/train_step_device.triples``), so inputs fill
n tokens. The kernels alternate over ``--rounds`` rounds (sparse, fused, sparse, fused, …) and each keeps
its best round; the two kernels' scores are compared too (they compute the same attention).

    python bench/qds_kernels.py [--lengths 512,1024,2048] [--pairs 32] [--rounds 2] [--threads 2]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.train_step_device import sync, triples  # noqa: E402
from ckray.rankers.qds.model import QDSConfig, QDSTransformer  # noqa: E402

KERNELS = ("sparse", "fused-mask")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "scifact"))
    ap.add_argument("--lengths", default="512,1024,2048", help="comma-separated max_length n")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--pairs", type=int, default=32, help="(query, document) pairs scored per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    result: dict = {"bench": "qds_kernels", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "pairs": args.pairs, "rounds": args.rounds, "threads": torch.get_num_threads(),
                    "results": {}}
    for n in map(int, args.lengths.split(",")):
        cols = triples(Path(args.data), args.pairs, min_words=int(0.88 * n))
        queries, docs = list(cols["query"]), list(cols["pos_text"])
        models = {}
        for kernel in KERNELS:   # the same weights: the pretrained encoder, a head from the same seed
            torch.manual_seed(0)
            models[kernel] = QDSTransformer(QDSConfig(max_length=n, window=128, attention_kernel=kernel))
            models[kernel].to(device).eval()
        for precision in args.precisions.split(","):
            best, scores = {k: float("inf") for k in KERNELS}, {}
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                for kernel in KERNELS:   # warm-up
                    models[kernel].score_texts(queries[:2], docs[:2])
                for _ in range(args.rounds):
                    for kernel in KERNELS:
                        sync(device)
                        t0 = time.perf_counter()
                        scores[kernel] = models[kernel].score_texts(queries, docs).float().cpu()
                        sync(device)
                        best[kernel] = min(best[kernel], time.perf_counter() - t0)
            entry = {f"{k}_pairs_per_s": round(args.pairs / best[k], 2) for k in KERNELS}
            entry["fused_over_sparse"] = round(best["sparse"] / best["fused-mask"], 2)
            entry["max_score_diff"] = round(float((scores["sparse"] - scores["fused-mask"]).abs().max()), 5)
            result["results"][f"{n}/{precision}"] = entry
            print(f"n={n} {precision}", json.dumps(entry), file=sys.stderr, flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
