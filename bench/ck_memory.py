"""Peak memory of one CK training step vs the quadratic TK baseline, by document length.

    python bench/ck_memory.py [--lengths 1000 2000 4000 8000] [--batch 8] [--budget-gib 12]

One training step = forward + backward of the pairwise loss on ``--batch`` (query, document) pairs
(batch/2 queries, each with a positive and a negative document), every document exactly |d| word
pieces long, queries 10 word pieces (MS MARCO-like). Both models are the same except the encoder:

    ck  the paper's full CK (query contextualised): Conformer blocks = depthwise 1-D convolution
        (window 7) + separable self-attention (Eq. 5-6) + feed-forward
    tk  TK: ordinary quadratic multi-head self-attention with an explicit n × n matrix, no convolution

The model is ``CKConfig``'s default, which resembles the paper's TK/CK: 2 blocks, d_model 300,
10 heads (30 dims each), feed-forward 100, no dropout, 11 RBF kernels, depthwise convolution over 7
positions; 384-dim word-piece embeddings over the 30,522-id MiniLM vocabulary (random values here:
only shapes matter), trainable, so their dense gradient (47 MB) is part of every step. The batch
(8 pairs by default) is smaller than the paper's so that TK at 2,000 tokens fits a shared CPU box.

How memory is measured:
  * CUDA: ``torch.cuda.max_memory_allocated()`` minus the memory allocated after the model and the
    inputs are on the GPU (all configurations in one process, peak statistics reset in between).
  * CPU: each configuration runs in a fresh subprocess; peak = ``ru_maxrss`` after the step minus the
    resident set size just before it (model built, inputs made). A fresh process per configuration is
    the only way to get a clean high-water mark from the OS. The subprocess runs with
    ``MALLOC_MMAP_THRESHOLD_=131072``: glibc then serves every large tensor with its own mmap and
    returns it on free (its default, adaptive threshold keeps freed tensors in the heap, and the
    high-water mark then measures fragmentation rather than tensors). RSS still includes some
    allocator overhead, so the figures are slightly above the bytes PyTorch asked for.
    (``torch.profiler``'s memory events would count requested bytes instead, but profiling every
    op of an 8,000-token step is slow.)
A configuration whose peak, extrapolated from the same model at the previous length (quadratic for
TK, linear for CK), would exceed ``--budget-gib`` is skipped and reported with that projection
(by default TK at 4,000 and 8,000 tokens: the machine this runs on is shared).

Prints a table, the two target ratios, and one JSON line last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("ck", "tk")
MIB = 1024 * 1024


def build(name: str):
    from ckray.rankers.ck_qti.model import CKConfig, CKModel, tk_config

    common = dict(embedding_init="random", max_doc_len=100_000)  # otherwise the defaults
    cfg = {"ck": CKConfig(qti=False, **common), "ck-qti": CKConfig(qti=True, **common),
           "tk": tk_config(**common)}[name]
    return CKModel(cfg)


def make_batch(batch: int, length: int, query_len: int, device):
    import torch

    g = torch.Generator().manual_seed(0)
    half = batch // 2
    q = torch.randint(1000, 30000, (half, query_len), generator=g)
    docs = torch.randint(1000, 30000, (2 * half, length), generator=g)
    ones_q, ones_d = torch.ones_like(q, dtype=torch.bool), torch.ones_like(docs[:half], dtype=torch.bool)
    return {k: v.to(device) for k, v in {"query_ids": q, "query_mask": ones_q, "pos_ids": docs[:half],
                                           "pos_mask": ones_d, "neg_ids": docs[half:], "neg_mask": ones_d}.items()}


def train_step(model, batch) -> None:
    from ckray.rankers.ck_qti.model import pairwise_loss

    pos, neg = model.pairwise_scores(batch)
    pairwise_loss(pos, neg).backward()


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_worker(name: str, length: int, batch: int, query_len: int, threads: int) -> dict:
    """Runs inside a fresh subprocess: one step, peak RSS over the pre-step RSS."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build(name).train()
    inputs = make_batch(batch, length, query_len, "cpu")
    gc.collect()
    before = current_rss()
    t0 = time.perf_counter()
    train_step(model, inputs)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_mib": (peak - before) / MIB, "seconds": seconds}


def run_cpu(name: str, length: int, args) -> dict:
    cmd = [sys.executable, __file__, "--worker", name, str(length), "--batch", str(args.batch),
           "--query-len", str(args.query_len), "--threads", str(args.threads)]
    try:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, check=False, env=env)
    except subprocess.TimeoutExpired:
        return {"status": f"timeout after {args.timeout}s"}
    if out.returncode != 0:
        return {"status": f"failed (rc {out.returncode}): {out.stderr.strip().splitlines()[-1:]}"}
    return {"status": "ok", **json.loads(out.stdout.strip().splitlines()[-1])}


def run_cuda(name: str, length: int, args) -> dict:
    import torch

    torch.manual_seed(0)
    model = build(name).cuda().train()
    inputs = make_batch(args.batch, length, args.query_len, "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    try:
        train_step(model, inputs)
        torch.cuda.synchronize()
        result = {"status": "ok", "peak_mib": (torch.cuda.max_memory_allocated() - before) / MIB,
                  "seconds": time.perf_counter() - t0}
    except torch.cuda.OutOfMemoryError:
        result = {"status": "out of GPU memory"}
    del model, inputs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def projected_mib(name: str, length: int, results: dict) -> float | None:
    """Extrapolate from the longest length measured so far: TK quadratic, CK linear in |d|."""
    done = [(n, r["peak_mib"]) for n, r in results.get(name, {}).items() if r.get("status") == "ok" and n < length]
    if not done:
        return None
    n, mib = max(done)
    return mib * (length / n) ** (2 if name == "tk" else 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=["ck", "ck-qti", "tk"])
    p.add_argument("--batch", type=int, default=8, help="(query, document) pairs per step, even")
    p.add_argument("--query-len", type=int, default=10)
    p.add_argument("--budget-gib", type=float, default=12.0, help="skip configurations projected above this")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=int, default=300, help="seconds per configuration (CPU)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.worker:
        print(json.dumps(cpu_worker(args.worker[0], int(args.worker[1]), args.batch, args.query_len, args.threads)))
        return

    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    run = run_cuda if device == "cuda" else run_cpu
    results: dict[str, dict[int, dict]] = {m: {} for m in args.models}
    t_start = time.perf_counter()
    for length in sorted(args.lengths):
        for name in args.models:
            guess = projected_mib(name, length, results)
            if guess is not None and guess > args.budget_gib * 1024:
                results[name][length] = {"status": f"skipped: projected {guess / 1024:.1f} GiB > budget "
                                                   f"{args.budget_gib:g} GiB", "projected_mib": guess}
            else:
                results[name][length] = run(name, length, args)
            r = results[name][length]
            print(f"  {name:6s} |d|={length:5d}  " + (f"{r['peak_mib']:9.1f} MiB  {r['seconds']:6.1f} s"
                                                     if r["status"] == "ok" else r["status"]), flush=True)

    def mib(name: str, n: int) -> float | None:
        r = results.get(name, {}).get(n, {})
        return r.get("peak_mib") if r.get("status") == "ok" else None

    print(f"\nPeak memory of one training step (forward + backward), batch {args.batch}, {device}, MiB")
    header = f"{'|d|':>6} " + " ".join(f"{m:>10}" for m in args.models)
    if "ck" in args.models and "tk" in args.models:
        header += f" {'tk / ck':>9}"
    print(header)
    for n in sorted(args.lengths):
        cells = [f"{mib(m, n):10.1f}" if mib(m, n) is not None else f"{'—':>10}" for m in args.models]
        row = f"{n:>6} " + " ".join(cells)
        if "ck" in args.models and "tk" in args.models:
            ratio = mib("tk", n) / mib("ck", n) if mib("tk", n) and mib("ck", n) else None
            row += f" {ratio:9.2f}" if ratio else f" {'—':>9}"
        print(row)

    from ckray.rankers.ck_qti.model import CKConfig

    cfg = CKConfig(embedding_init="random")
    tk_over_ck = (mib("tk", 2000) / mib("ck", 2000)) if mib("tk", 2000) and mib("ck", 2000) else None
    ck_growth = (mib("ck", 8000) / mib("ck", 2000)) if mib("ck", 8000) and mib("ck", 2000) else None
    print(f"\nTK / CK at |d| = 2,000: {tk_over_ck:.2f}x (target >= 8)" if tk_over_ck else "\nTK / CK at 2,000: n/a")
    print(f"CK 8,000 / CK 2,000:    {ck_growth:.2f} (target <= 4.5)" if ck_growth else "CK growth: n/a")
    summary = {
        "bench": "ck_memory", "device": device, "batch": args.batch, "query_len": args.query_len,
        "method": "cuda.max_memory_allocated" if device == "cuda" else "subprocess ru_maxrss - pre-step rss",
        "model": {k: getattr(cfg, k) for k in ("n_layers", "d_model", "n_heads", "ff_dim", "emb_dim",
                                                "vocab_size", "conv_window", "n_kernels", "dropout")},
        "peak_mib": {m: {str(n): (round(r["peak_mib"], 1) if r["status"] == "ok" else r["status"])
                         for n, r in sorted(results[m].items())} for m in args.models},
        "tk_over_ck_at_2000": round(tk_over_ck, 2) if tk_over_ck else None,
        "ck_8000_over_2000": round(ck_growth, 2) if ck_growth else None,
        "targets_met": {"tk_over_ck_at_2000>=8": bool(tk_over_ck and tk_over_ck >= 8),
                        "ck_8000_over_2000<=4.5": bool(ck_growth and ck_growth <= 4.5)},
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
