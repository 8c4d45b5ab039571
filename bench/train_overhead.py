"""Overhead of the shared training loop: Ray Train + DeepSpeed (1 worker) vs a plain PyTorch loop.

Both loops train the same small cross-encoder (2-layer transformer, d=256, 128 tokens per
query-document pair, pairwise softmax loss) from the same initial weights, on the same batches in
the same order (the Ray loop's shuffle is off), with the same optimizer (AdamW), LR schedule and
gradient clipping, and the same number of torch threads (the Ray worker's reserved CPUs). With one
worker ckray.training runs DeepSpeed at ZeRO stage 0 whatever ``--zero-stage`` says (nothing to
partition); measured before that rule, ZeRO-2 on one worker cost 9 % more CPU per example.

The plain loop runs as a Ray task (a Ray worker process with the same CPU reservation, hence the
same thread settings and, on Linux with autogrouped scheduling, the same share of a busy machine);
it uses no Ray Train, Ray Data or DeepSpeed.

Steady state only. Both loops are timed by the same code, inside the process that trains: every
``loss`` call stamps the wall clock and the process CPU time, and the figures cover steps
``--warmup``..last. Excluded: Ray and worker start-up, DeepSpeed initialisation, the warm-up steps,
and the final validation and checkpoint (there is none inside the window). Two figures:

* examples/s (wall clock): the target figure. On a shared machine it moves with other processes'
  load, so plain and Ray runs alternate (plain, Ray, plain, Ray, plain), each Ray run is compared
  with the mean of the plain runs on either side, and the median ratio is reported.
* examples per CPU-second of the training process: insensitive to load; counts the extra work the
  Ray worker process does (Ray Data iteration, DeepSpeed bookkeeping, Ray's own threads), though not
  the work of Ray's separate processes (raylet, data coordinator).

The whole Ray run, start-up included, is in the JSON line for information, with the load average.

    python bench/train_overhead.py [--steps 30] [--warmup 10] [--batch-size 8] [--threads 1] [--repeats 2]

Ends with one JSON line. Target: overhead <= 10 %.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
import zlib
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from ckray.data.examples import DevSet
from ckray.training import RankerTask, TrainConfig
from ckray.training.loop import _effective_zero_stage, _seed_everything, fit, lr_schedule, weight_decay_groups


@dataclass
class BenchConfig:
    vocab: int = 8192
    dim: int = 256
    layers: int = 2
    heads: int = 4
    query_len: int = 16
    doc_len: int = 112


def tokenize(texts, length: int, vocab: int) -> torch.Tensor:
    """Stable hashed word ids (0 = padding)."""
    ids = torch.zeros(len(texts), length, dtype=torch.long)
    for i, text in enumerate(texts):
        words = str(text).split()[:length]
        ids[i, :len(words)] = torch.tensor([1 + zlib.crc32(w.encode()) % (vocab - 1) for w in words])
    return ids


class BenchCrossEncoder(torch.nn.Module):
    def __init__(self, config: BenchConfig):
        super().__init__()
        self.config = config
        c = config
        self.emb = torch.nn.Embedding(c.vocab, c.dim, padding_idx=0)
        self.pos = torch.nn.Embedding(c.query_len + c.doc_len, c.dim)
        layer = torch.nn.TransformerEncoderLayer(c.dim, c.heads, 4 * c.dim, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, c.layers, enable_nested_tensor=False)
        self.out = torch.nn.Linear(c.dim, 1)

    def forward(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([q, d], 1)
        x = self.emb(ids) + self.pos.weight[: ids.shape[1]]
        return self.out(self.encoder(x, src_key_padding_mask=ids == 0)[:, 0]).squeeze(-1)

    def score_texts(self, queries, docs) -> torch.Tensor:
        c = self.config
        return self(tokenize(queries, c.query_len, c.vocab), tokenize(docs, c.doc_len, c.vocab))


class BenchTask(RankerTask):
    """The cross-encoder as a RankerTask. With ``stamp_file`` every ``loss`` call appends the
    process's wall clock and CPU time to it (the same timing code for both loops)."""

    name = "bench-overhead"

    def __init__(self, stamp_file: str = ""):
        self.stamp_file = stamp_file

    def build_model(self) -> BenchCrossEncoder:
        return BenchCrossEncoder(BenchConfig())

    def collate(self, rows):
        c = BenchConfig()
        return {"q": tokenize(rows["query"], c.query_len, c.vocab),
                "pos": tokenize(rows["pos_text"], c.doc_len, c.vocab),
                "neg": tokenize(rows["neg_text"], c.doc_len, c.vocab)}

    def loss(self, model, batch):
        if self.stamp_file:
            with open(self.stamp_file, "a") as f:
                f.write(f"{time.perf_counter()} {time.process_time()}\n")
        q = torch.cat([batch["q"], batch["q"]])
        scores = model(q, torch.cat([batch["pos"], batch["neg"]])).view(2, -1).t()
        return torch.nn.functional.cross_entropy(scores, torch.zeros(len(scores), dtype=torch.long))


def make_triples(n: int, seed: int = 0) -> pa.Table:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(5000)]
    text = lambda k: " ".join(rng.choice(words) for _ in range(k))   # noqa: E731
    cols = {"query_id": [f"q{i}" for i in range(n)], "query": [text(12) for _ in range(n)],
            "pos_id": [f"p{i}" for i in range(n)], "pos_text": [text(150) for _ in range(n)],
            "pos_bm25": [rng.random() for _ in range(n)], "neg_id": [f"n{i}" for i in range(n)],
            "neg_text": [text(150) for _ in range(n)], "neg_bm25": [rng.random() for _ in range(n)]}
    return pa.table(cols)


def tiny_dev() -> DevSet:
    return DevSet(queries={"d0": "w1 w2"}, candidates={"d0": [("a", 1.0), ("b", 0.5)]},
                  doc_text={"a": "w1 w2 w3", "b": "w4 w5"}, qrels={"d0": {"a": 1}})


def plain_loop(task: BenchTask, table: pa.Table, cfg: TrainConfig) -> None:
    """A plain PyTorch loop doing what the Ray loop does: same init, batches, optimizer, schedule."""
    torch.set_num_threads(cfg.cpus_per_worker)
    _seed_everything(cfg.seed)
    model = task.build_model()
    model.train()
    opt = torch.optim.AdamW(weight_decay_groups(model.parameters(), cfg.weight_decay), lr=cfg.lr)
    sched = lr_schedule(opt, cfg)
    columns = {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
    for step in range(cfg.max_steps):
        lo = step * cfg.batch_size
        rows = {c: v[lo:lo + cfg.batch_size] for c, v in columns.items()}
        loss = task.loss(model, task.collate(rows))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        loss.detach().item()   # the Ray loop syncs on the loss too (at its log points)


def steady_rates(stamp_file: str, warmup: int, batch_size: int) -> tuple[float, float]:
    """(examples per second, examples per CPU-second) between the loss calls of step ``warmup``
    and of the last step."""
    stamps = np.loadtxt(stamp_file, ndmin=2)
    examples = (len(stamps) - 1 - warmup) * batch_size
    wall, cpu = stamps[-1] - stamps[warmup]
    return examples / wall, examples / cpu


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="steps after the warm-up (the last one closes the window)")
    ap.add_argument("--warmup", type=int, default=10, help="steps excluded from both measurements")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch threads = CPUs of the Ray worker")
    ap.add_argument("--zero-stage", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2,
                    help="Ray runs, each between two plain runs (plain, ray, plain, ray, plain, ...)")
    args = ap.parse_args(argv)

    import ray

    total = args.warmup + args.steps
    table = make_triples(total * args.batch_size)
    walls: dict[str, list[float]] = {"plain": [], "ray": []}
    cpus: dict[str, list[float]] = {"plain": [], "ray": []}
    ray_runs: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ckray-bench-") as tmp:
        cfg = TrainConfig(workers=1, zero_stage=args.zero_stage, batch_size=args.batch_size, lr=1e-4,
                          warmup_steps=2, max_steps=total, eval_every=total, eval_at_start=False,
                          log_every=10 ** 6, shuffle_buffer=0, max_failures=0, cpus_per_worker=args.threads,
                          output_dir=f"{tmp}/out", storage_dir=f"{tmp}/storage")

        def run(kind: str, i: int) -> None:
            stamps = f"{tmp}/{kind}-{i}.txt"
            t0 = time.perf_counter()
            if kind == "plain":   # in a Ray worker process too: same process setup and CPU scheduling
                ray.get(ray.remote(num_cpus=args.threads)(plain_loop).remote(BenchTask(stamps), table, cfg))
            else:
                cfg.run_name = f"bench-{i}"
                fit(BenchTask(stamps), table, tiny_dev(), cfg)
                ray_runs.append(time.perf_counter() - t0)
            wall, cpu = steady_rates(stamps, args.warmup, args.batch_size)
            walls[kind].append(wall)
            cpus[kind].append(cpu)
            label = "plain PyTorch loop" if kind == "plain" else "Ray Train + DeepSpeed"
            print(f"{label:24s}{wall:8.2f} examples/s {cpu:8.2f} examples/CPU-s", flush=True)

        if not ray.is_initialized():
            ray.init(address="local", num_cpus=max(4, args.threads + 2), include_dashboard=False,
                     log_to_driver=False)
        run("plain", 0)
        for i in range(args.repeats):
            run("ray", i)
            run("plain", i + 1)

    def ratios(rates: dict[str, list[float]]) -> list[float]:
        p, r = rates["plain"], rates["ray"]
        return [float(r[i] / ((p[i] + p[i + 1]) / 2)) for i in range(len(r))]

    wall_ratio, cpu_ratio = float(np.median(ratios(walls))), float(np.median(ratios(cpus)))
    print(f"Ray/plain examples/s per repeat {[round(x, 3) for x in ratios(walls)]}; median {wall_ratio:.3f} "
          f"-> overhead {100 * (1 - wall_ratio):.1f} % (target <= 10 %)")
    print(f"Ray/plain examples per CPU-second per repeat {[round(x, 3) for x in ratios(cpus)]}; median "
          f"{cpu_ratio:.3f} -> overhead {100 * (1 - cpu_ratio):.1f} %")
    summary = {
        "bench": "train_overhead", "model": "2-layer transformer cross-encoder d=256, 128 tokens",
        "params": sum(p.numel() for p in BenchTask().build_model().parameters()),
        "batch_size": args.batch_size, "threads": args.threads, "workers": 1, "zero_stage": args.zero_stage,
        "deepspeed_zero_stage": _effective_zero_stage(TrainConfig(zero_stage=args.zero_stage), 1),
        "warmup_steps": args.warmup, "measured_steps": args.steps - 1, "repeats": args.repeats,
        "plain_examples_per_s": [round(x, 2) for x in walls["plain"]],
        "ray_deepspeed_examples_per_s": [round(x, 2) for x in walls["ray"]],
        "ratio": round(wall_ratio, 3), "overhead_pct": round(100 * (1 - wall_ratio), 1),
        "plain_examples_per_cpu_s": [round(x, 2) for x in cpus["plain"]],
        "ray_deepspeed_examples_per_cpu_s": [round(x, 2) for x in cpus["ray"]],
        "cpu_ratio": round(cpu_ratio, 3), "cpu_overhead_pct": round(100 * (1 - cpu_ratio), 1),
        "target_overhead_pct": 10, "meets_target": bool(wall_ratio >= 0.9),
        "ray_run_s_incl_startup": [round(w, 1) for w in ray_runs], "load_avg_1m": round(os.getloadavg()[0], 1),
        "steady_state": "loss-call stamps of steps warmup..last inside the training process; start-up, "
                        "warm-up, validation and checkpointing excluded",
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
