"""Training steps of the four rankers through the training loop's own DeepSpeed engine on one device
(CUDA when present): fp32 vs bf16 autocast, ZeRO-0 vs ZeRO-2, side by side.

One step is what every Ray Train worker of ``ckray.training.fit`` runs:
:func:`ckray.training.loop.build_engine` (AdamW over the task's parameter groups, the LR schedule,
gradient clipping, DeepSpeed with the ZeRO stage) and :func:`ckray.training.loop.train_micro_batch`
(``task.collate``, ``task.loss`` under :func:`ckray.training.loop.precision_context`, backward,
``engine.step``). Without Ray: one process, ``torch.distributed`` initialised here with world size 1
(NCCL on CUDA, gloo on CPU). ZeRO-2 at world size 1 partitions nothing, but it runs ZeRO's optimizer
path (flat fp32 gradient buckets, the partitioned step), the code each worker of a cluster runs; the
loop itself would pick stage 0 for one worker.

Models at their settings of record: CK-QTI and CLEAR with their configs' defaults, CEDR-KNRM (256 tokens ×
2 segments) and the QDS-Transformer (512 tokens, window 128), both with warm-started heads; ``qds-sparse`` and
``qds-fused-mask`` compute its attention with either kernel (``QDSConfig.attention_kernel``), ``qds``
with the one ``auto`` picks. Triples:
training queries of ``--data`` (BEIR layout) with a judged relevant document and, as the negative, a
random other corpus document; their lexical scores are 0 (they shift CLEAR's margin, not the cost).

Per model × configuration, from the same initial weights: ``--warmup`` steps, then ``--steps`` timed
steps (the device synchronised before each clock read). Reported: pairs/s, the ratio over fp32/ZeRO-0,
peak device memory (CUDA), the first and last loss (a non-finite loss fails the run), and per model
how far bf16's first loss is from fp32's (the same weights and batch).

    python bench/train_step_device.py --data ../shared/data/scifact [--encoder DIR] [--batch-size 16]
        [--steps 20] [--warmup 3] [--models ck-qti,clear,cedr-knrm,qds-sparse,qds-fused-mask]
        [--qds-max-length 512] [--min-doc-words 0]

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.rerank_warm_start import CEDR_SETTINGS, QDS_SETTINGS  # noqa: E402  (the settings of record)
from ckray.data.collections import doc_text, load_collection  # noqa: E402
from ckray.training.config import TrainConfig  # noqa: E402
from ckray.training.loop import build_engine, precision_context, train_micro_batch  # noqa: E402

CONFIGS = (("fp32", 0), ("bf16", 0), ("bf16", 2))   # (precision, ZeRO stage); the first is the base


def triples(data: Path, n: int, seed: int = 0, min_words: int = 0) -> dict[str, np.ndarray]:
    """``n`` (query, judged relevant, random other document) triples of ``data``'s training queries, as
    the columns ``ckray.training.task.TRIPLE_COLUMNS`` names; with ``min_words``, each document text is
    followed by random other documents until it has that many words (long inputs from a short-document
    collection, for timing)."""
    coll = load_collection(data)
    texts = dict(zip(coll.corpus.column("doc_id").to_pylist(),
                     (doc_text(t, b) for t, b in zip(coll.corpus.column("title").to_pylist(),
                                                     coll.corpus.column("text").to_pylist()))))
    rng = random.Random(seed)
    doc_ids = sorted(texts)
    rows: dict[str, list] = {c: [] for c in ("query_id", "query", "pos_id", "pos_text", "pos_bm25",
                                              "neg_id", "neg_text", "neg_bm25")}
    judged = sorted((q, d) for q, docs in coll.qrels["train"].items() for d, r in docs.items()
                    if r > 0 and q in coll.queries and d in texts)
    rng.shuffle(judged)
    def long(text: str) -> str:
        while len(text.split()) < min_words:
            text += " " + texts[rng.choice(doc_ids)]
        return text

    for q, pos in (judged * (1 + n // max(len(judged), 1)))[:n]:
        neg = rng.choice(doc_ids)
        for col, value in (("query_id", q), ("query", coll.queries[q]), ("pos_id", pos), ("pos_text", long(texts[pos])),
                           ("pos_bm25", 0.0), ("neg_id", neg), ("neg_text", long(texts[neg])), ("neg_bm25", 0.0)):
            rows[col].append(value)
    return {c: np.asarray(v, dtype=np.float32 if c.endswith("bm25") else object) for c, v in rows.items()}


def make_task(name: str, encoder: str | None, probe: dict[str, list[str]], qds_max_length: int):
    from ckray.rankers.cedr.model import CEDRConfig
    from ckray.rankers.cedr.task import CEDRTask
    from ckray.rankers.ck_qti.model import CKConfig
    from ckray.rankers.ck_qti.task import CKTask
    from ckray.rankers.clear.model import CLEARConfig
    from ckray.rankers.clear.task import CLEARTask
    from ckray.rankers.qds.model import QDSConfig
    from ckray.rankers.qds.task import QDSTask

    enc = {"encoder": encoder} if encoder else {}
    if name == "ck-qti":
        return CKTask(config=CKConfig(**enc))
    if name == "clear":
        return CLEARTask(model_config=CLEARConfig(**enc))
    if name == "cedr-knrm":
        return CEDRTask(model_config=CEDRConfig(variant="knrm", head_init="warm", **CEDR_SETTINGS, **enc))
    if name in ("qds", "qds-sparse", "qds-fused-mask"):   # qds: the config's attention_kernel ("auto")
        kernel = {"attention_kernel": name[len("qds-"):]} if name != "qds" else {}
        settings = {**QDS_SETTINGS, "max_length": qds_max_length}
        return QDSTask(model_config=QDSConfig(head_init="warm", **settings, **kernel, **enc), warm_triples=probe)
    raise SystemExit(f"unknown model {name!r} (ck-qti, clear, cedr-knrm, qds, qds-sparse, qds-fused-mask)")


def init_distributed(device: torch.device) -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
                          RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_config(task, initial: dict, batches: list[dict], cfg: TrainConfig, precision: str, zero: int,
                warmup: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = task.build_model()
    model.load_state_dict(initial)
    engine = build_engine(task, model, cfg, world=1, zero_stage=zero)
    autocast = precision_context(precision, engine.device)
    engine.train()
    losses = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i, rows in enumerate(batches):
        if i == warmup:
            sync(device)
            t0 = time.perf_counter()
        losses.append(float(train_micro_batch(engine, task, rows, autocast)))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"{task.name} {precision} ZeRO-{zero}: loss {losses[-1]} at step {i}")
    sync(device)
    seconds = time.perf_counter() - t0
    pairs = 2 * cfg.batch_size * (len(batches) - warmup)
    out = {"pairs_per_s": round(pairs / seconds, 2), "first_loss": round(losses[0], 4),
           "last_loss": round(losses[-1], 4)}
    if device.type == "cuda":
        out["peak_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2 ** 30, 2)
    del engine, model
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "scifact"),
                    help="a BEIR-layout collection with training queries")
    ap.add_argument("--encoder", default=None, help="HF id or directory of the encoder (default: the models')")
    ap.add_argument("--models", default="ck-qti,clear,cedr-knrm,qds-sparse,qds-fused-mask")
    ap.add_argument("--batch-size", type=int, default=16, help="triples per step")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--qds-max-length", type=int, default=QDS_SETTINGS["max_length"],
                    help="QDS-Transformer tokens per input (the run of record: 512; the paper: 2048)")
    ap.add_argument("--min-doc-words", type=int, default=0,
                    help="extend each document with random others to at least this many words (long inputs)")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads on CPU (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_distributed(device)

    n_batches = args.warmup + args.steps
    cols = triples(Path(args.data), args.batch_size * n_batches + 8, min_words=args.min_doc_words)
    batches = [{c: v[i * args.batch_size:(i + 1) * args.batch_size] for c, v in cols.items()} for i in range(n_batches)]
    probe = {c: [str(x) for x in cols[c][-8:]] for c in ("query", "pos_text", "neg_text")}
    cfg = TrainConfig(batch_size=args.batch_size, grad_accum=1, max_steps=n_batches, warmup_steps=1, lr=2e-5)
    result: dict = {"bench": "train_step_device", "device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu", "torch": torch.__version__, "batch_size": args.batch_size, "steps": args.steps,
                    "qds_max_length": args.qds_max_length, "min_doc_words": args.min_doc_words, "models": {}}
    for name in filter(None, args.models.split(",")):
        task = make_task(name, args.encoder, probe, args.qds_max_length)
        torch.manual_seed(0)
        initial = {k: v.clone() for k, v in task.build_model().state_dict().items()}
        entry = {}
        for precision, zero in CONFIGS:
            entry[f"{precision}/zero{zero}"] = time_config(task, initial, batches, cfg, precision, zero,
                                                           args.warmup, device)
            print(name, precision, f"ZeRO-{zero}", json.dumps(entry[f"{precision}/zero{zero}"]), file=sys.stderr,
                  flush=True)
        base = entry["fp32/zero0"]["pairs_per_s"]
        for key in list(entry):
            entry[key]["over_fp32_zero0"] = round(entry[key]["pairs_per_s"] / base, 2)
        entry["bf16_first_loss_diff"] = round(abs(entry["bf16/zero0"]["first_loss"] - entry["fp32/zero0"]["first_loss"]), 4)
        result["models"][name] = entry
    print(json.dumps(result))


if __name__ == "__main__":
    main()
