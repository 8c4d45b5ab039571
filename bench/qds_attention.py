"""One attention layer, forward + backward: QDS sparse attention vs dense attention.

    python bench/qds_attention.py                       # n = 512 … 8192, CPU or CUDA, ~5 min on 2 cores
    python bench/qds_attention.py --sizes 512,2048 --repeats 3

Three methods on the same inputs (batch 1, 12 heads × 64, window w = 128, |q| = 20 query tokens +
[CLS] global, an [SOS] every 25 tokens — the QDS-Transformer setting of arXiv 2010.12683, Eq. 7–10):

* ``qds``        ``ckray.models.sparse_attention.qds_attention`` (O(n·(w + g)), no n×n tensor);
* ``dense``      ``F.scaled_dot_product_attention`` without a mask (the fully connected BERT layer);
* ``dense_mask`` ``F.scaled_dot_product_attention`` with the equivalent [n, n] boolean QDS mask.

**Time**: per size, the methods run round-robin in one process (one warm-up call each, then
``repeats`` rounds) so that a drifting machine load hits all of them alike; a speed-up is the
median over rounds of the per-round ratio. **Peak memory** of one forward + backward, excluding
the inputs (q, k, v, output gradient, and the mask or layout, reported separately as setup):

* CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation before the call.
* CPU: a fresh subprocess per (method, n) runs the method once on a tiny input (code pages,
  thread pools and library workspaces are loaded then, not counted), builds the inputs, then
  resets the kernel's RSS high-water mark (``/proc/self/clear_refs`` ← 5), runs one call and reads
  ``VmHWM`` − ``VmRSS`` before the call. With ``MALLOC_MMAP_THRESHOLD_`` fixed, glibc hands every
  freed tensor buffer back at once, so this follows the bytes really live (±a few MB) and needs
  no instrumentation of PyTorch's CPU allocator. Where the reset is not permitted it
  falls back to ``ru_maxrss`` deltas (then a peak below an earlier one reads as 0).

The run prints a table, the speed-ups, the max |QDS − dense-with-mask| output difference and the
machine's load average around each size, and ends with one JSON line holding every figure.

On a CPU shared with other busy processes, pass ``--threads 1``: with several OpenMP threads every
parallel kernel waits until all its threads are scheduled again (milliseconds on an oversubscribed
machine). QDS runs ~50 kernels per chunk of query blocks, dense SDPA one fused kernel, so such a
machine inflates QDS's time far more than dense's — a property of the machine, not of the method.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckray.models.sparse_attention import build_layout, dense_mask, qds_attention  # noqa: E402

METHODS = ("qds", "dense", "dense_mask")
DEFAULT_SIZES = (512, 1024, 2048, 4096, 8192)
TARGETS = {2048: 2.0, 8192: 4.0}   # QDS speed-up over unmasked dense (issue 7)


# ---------------------------------------------------------------------------------------------
# Inputs and the three methods
# ---------------------------------------------------------------------------------------------

def make_inputs(n: int, args: argparse.Namespace, device: torch.device, seed: int = 0) -> dict:
    """q, k, v, output gradient and the token roles of ``[CLS] q₁…q_m [SEP] ([SOS] sentence)*``."""
    gen = torch.Generator().manual_seed(seed)
    shape = (args.batch, args.heads, n, args.head_dim)
    dtype = getattr(torch, args.dtype)
    q, k, v, grad = (torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    attention_mask = torch.ones(args.batch, n, dtype=torch.bool, device=device)
    global_mask = torch.zeros_like(attention_mask)
    global_mask[:, : 1 + args.query_len] = True                       # [CLS] + query tokens
    sentence_mask = torch.zeros_like(attention_mask)
    sentence_mask[:, args.query_len + 2 :: args.sentence_every] = True   # [SOS] after [SEP]
    return dict(q=q, k=k, v=v, grad=grad, attention_mask=attention_mask,
                global_mask=global_mask, sentence_mask=sentence_mask)


def tensor_bytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return sum(tensor_bytes(v) for v in vars(obj).values() if isinstance(v, torch.Tensor))


def prepare(method: str, inp: dict, window: int):
    """Per-batch setup outside the timed call (amortised over a model's layers): the sparse layout
    or the dense mask. Returns ``(fn, setup_bytes)`` where ``fn()`` is the attention forward."""
    q, k, v = inp["q"], inp["k"], inp["v"]
    roles = (inp["attention_mask"], window, inp["global_mask"], inp["sentence_mask"], "qds")
    if method == "qds":
        layout = build_layout(*roles)
        return (lambda: qds_attention(q, k, v, layout)), tensor_bytes(layout)
    if method == "dense":
        return (lambda: F.scaled_dot_product_attention(q, k, v)), 0
    if method == "dense_mask":
        mask = dense_mask(*roles)[:, None]                                    # [B, 1, n, n]
        return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)), tensor_bytes(mask)
    raise ValueError(method)


def step(fn, inp: dict, device: torch.device) -> tuple[float, torch.Tensor]:
    """One timed forward + backward; returns (seconds, detached output)."""
    for name in ("q", "k", "v"):
        inp[name].grad = None
    _sync(device)
    start = time.perf_counter()
    out = fn()
    out.backward(inp["grad"])
    _sync(device)
    return time.perf_counter() - start, out.detach()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# Peak memory
# ---------------------------------------------------------------------------------------------

def _proc_status_kb(key: str) -> int:
    return int(re.search(rf"^{key}:\s+(\d+)", Path("/proc/self/status").read_text(), re.M).group(1))


def measure_peak(method: str, n: int, args: argparse.Namespace, device: torch.device) -> dict:
    """Peak extra memory of one forward + backward (run in this process; see module docstring)."""
    small = make_inputs(max(64, args.query_len + 8), args, device, seed=1)
    step(prepare(method, small, args.window)[0], small, device)   # load kernels, start thread pools
    del small
    inp = make_inputs(n, args, device)
    fn, setup_bytes = prepare(method, inp, args.window)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step(fn, inp, device)
        peak, how = torch.cuda.max_memory_allocated(device) - before, "cuda.max_memory_allocated"
    else:
        try:
            import ctypes
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        before = _proc_status_kb("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")      # reset VmHWM to the current RSS
            how = "VmHWM-VmRSS"
        except OSError:
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            how = "ru_maxrss delta"
        step(fn, inp, device)
        after = _proc_status_kb("VmHWM") if how == "VmHWM-VmRSS" else \
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = max(after - before, 0) * 1024
    return {"method": method, "n": n, "peak_bytes": int(peak), "setup_bytes": int(setup_bytes), "how": how}


def peak_in_subprocess(method: str, n: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker-memory", f"{method}:{n}", *args.passthrough]
    # A fixed mmap threshold makes glibc return every freed tensor buffer to the OS at once, so the
    # RSS high-water mark follows the bytes really live (not heap fragments kept for reuse).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
    if res.returncode != 0:
        raise RuntimeError(f"memory worker {method}@{n} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def default_repeats(n: int) -> int:
    return {512: 10, 1024: 8, 2048: 5, 4096: 3}.get(n, 2 if n >= 8192 else 5)


def time_size(n: int, args: argparse.Namespace, device: torch.device) -> dict:
    """Round-robin timing of all methods at one size; also checks QDS against dense + mask."""
    inp = make_inputs(n, args, device)
    fns = {}
    outs = {}
    for m in args.methods:
        fns[m], _ = prepare(m, inp, args.window)
        _, outs[m] = step(fns[m], inp, device)                     # warm-up
    max_diff = None
    if "qds" in outs and "dense_mask" in outs:
        max_diff = float((outs["qds"] - outs["dense_mask"]).abs().max())
    del outs
    times: dict[str, list[float]] = {m: [] for m in args.methods}
    for _ in range(args.repeats or default_repeats(n)):
        for m in args.methods:
            times[m].append(step(fns[m], inp, device)[0])
    return {"times": times, "max_abs_diff_qds_vs_dense_mask": max_diff}


def paired_speedup(times: dict, base: str, method: str = "qds") -> float | None:
    if base not in times or method not in times:
        return None
    return statistics.median(b / q for b, q in zip(times[base], times[method]))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="comma-separated n")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--query-len", type=int, default=20)
    p.add_argument("--sentence-every", type=int, default=25)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=0, help="timed rounds per size (0: by size)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurements")
    p.add_argument("--worker-memory", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s]
    args.methods = [m for m in args.methods.split(",") if m]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    args.passthrough = [f"--window={args.window}", f"--query-len={args.query_len}",
                        f"--sentence-every={args.sentence_every}", f"--heads={args.heads}",
                        f"--head-dim={args.head_dim}", f"--batch={args.batch}",
                        f"--device={args.device}", f"--dtype={args.dtype}", f"--threads={args.threads}"]
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.worker_memory:                                        # child process: one measurement
        method, n = args.worker_memory.split(":")
        print(json.dumps(measure_peak(method, int(n), args, device)))
        return {}

    config = {k: getattr(args, k) for k in ("window", "query_len", "sentence_every", "heads",
                                              "head_dim", "batch", "dtype")}
    config["threads"] = torch.get_num_threads() if device.type == "cpu" else None
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"cpu ({torch.get_num_threads()} threads)"
    print(f"QDS attention bench on {device_name}; {config}", flush=True)
    results, speedups, diffs = [], {}, {}
    started = time.perf_counter()
    loads = {}
    for n in args.sizes:
        load_before = os.getloadavg()[0]
        timed = time_size(n, args, device)
        loads[n] = (load_before, os.getloadavg()[0])
        diffs[n] = timed["max_abs_diff_qds_vs_dense_mask"]
        speedups[n] = {"vs_dense": paired_speedup(timed["times"], "dense"),
                       "vs_dense_mask": paired_speedup(timed["times"], "dense_mask")}
        for m in args.methods:
            row = {"n": n, "method": m,
                   "time_s_median": statistics.median(timed["times"][m]),
                   "time_s_min": min(timed["times"][m]), "rounds": len(timed["times"][m])}
            if not args.no_memory:
                mem = (measure_peak(m, n, args, device) if device.type == "cuda"
                       else peak_in_subprocess(m, n, args))
                row.update(peak_mb=mem["peak_bytes"] / 2**20, setup_mb=mem["setup_bytes"] / 2**20,
                           memory_method=mem["how"])
            results.append(row)
            mem_txt = f"  peak {row['peak_mb']:9.1f} MB  setup {row['setup_mb']:7.1f} MB" if "peak_mb" in row else ""
            print(f"n={n:6d} {m:>10s}: {row['time_s_median'] * 1e3:10.1f} ms (min {row['time_s_min'] * 1e3:.1f})"
                  f"{mem_txt}", flush=True)
        s = speedups[n]
        print(f"n={n:6d}  qds speed-up: x{s['vs_dense'] or float('nan'):.2f} vs dense, "
              f"x{s['vs_dense_mask'] or float('nan'):.2f} vs dense+mask; "
              f"max|qds - dense+mask| = {diffs[n]}; load average {loads[n][0]:.1f} → {loads[n][1]:.1f}",
              flush=True)

    print()
    print(f"{'n':>6} | " + " | ".join(f"{m + ' ms':>13}" for m in args.methods)
          + " | " + " | ".join(f"{m + ' MB':>13}" for m in args.methods) + " | x dense | x masked")
    for n in args.sizes:
        rows = {r["method"]: r for r in results if r["n"] == n}
        t = " | ".join(f"{rows[m]['time_s_median'] * 1e3:13.1f}" for m in args.methods)
        mm = " | ".join(f"{rows[m].get('peak_mb', float('nan')):13.1f}" for m in args.methods)
        s = speedups[n]
        print(f"{n:>6} | {t} | {mm} | {s['vs_dense'] or float('nan'):7.2f} | {s['vs_dense_mask'] or float('nan'):8.2f}")
    targets = {str(n): {"need": need, "got": speedups[n]["vs_dense"],
                        "ok": bool(speedups[n]["vs_dense"] and speedups[n]["vs_dense"] >= need)}
               for n, need in TARGETS.items() if n in speedups}
    summary = {"bench": "qds_attention", "device": device_name, "torch": torch.__version__,
               "config": config, "results": results,
               "speedup": {str(n): s for n, s in speedups.items()},
               "max_abs_diff_qds_vs_dense_mask": {str(n): d for n, d in diffs.items()},
               "load_average_1min": {str(n): list(v) for n, v in loads.items()},
               "cpu_count": os.cpu_count(),
               "targets": targets, "wall_s": time.perf_counter() - started}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
