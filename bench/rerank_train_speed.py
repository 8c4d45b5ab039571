"""Training cost per pair of the cross-encoder rerankers on a CPU: fp32 vs bf16 autocast, with and without
frozen bottom encoder layers, side by side.

One training step here is what ``ckray.training``'s loop does per micro-batch, without Ray and
DeepSpeed: ``task.collate`` of ``--batch-size`` SciFact training triples (query, judged relevant,
BM25 non-relevant of a non-dev training query; 2 pairs each), ``task.loss`` (forward + pairwise
loss), backward, gradient clipping at 1.0 and an AdamW step over the task's parameter groups. The
models are at their settings of record: CEDR-KNRM (MiniLM, 256 tokens × 2 segments) and the
QDS-Transformer (MiniLM, 512 tokens, window 128), both with the warm-started heads.

Each configuration (model × precision) runs ``--steps`` steps on the same batches from the same
weights; the configurations alternate over ``--rounds`` rounds (fp32, bf16, fp32, bf16, …) so that
load from other processes falls on both, and each keeps its best round. Two figures per
configuration: pairs/s (wall clock) and pairs per CPU-second of this process (steadier on a shared
machine). ``bf16`` is ``torch.autocast("cpu", torch.bfloat16)`` around ``task.loss``, as the loop's
``--precision bf16`` does; the heads' kernels, similarity tensors and losses stay fp32 (the models
disable autocast there). Also reported: the padding of the batches (real tokens / padded tokens)
and, per model, how far bf16's step-0 loss and scores are from fp32's (the same weights, the same
batch).

``--frozen-layers 0,3,5`` times each precision with that many bottom encoder layers not trained
(``ckray.models.encoders.freeze_bottom_layers``, the embedding layer counted as layer 0);
``--attention-dropout 0.1,0`` times each with that attention-probability dropout in every encoder layer
(MiniLM's own: 0.1); ratios are over fp32 at the first values. ``--models qds-sparse,qds-fused-mask``
times the QDS-Transformer with either attention kernel (``qds``: the config's ``auto``).

    python bench/rerank_train_speed.py --workdir W [--steps 3] [--rounds 2] [--batch-size 4] [--threads 2]
        [--frozen-layers 0,3,5] [--attention-dropout 0.1,0]

Ends with one JSON line.
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

from bench.rerank_warm_start import CEDR_SETTINGS, QDS_SETTINGS  # noqa: E402
from ckray.data.collections import read_queries_and_qrels  # noqa: E402
from ckray.data.docstore import DocStore  # noqa: E402
from ckray.data.examples import is_dev_query  # noqa: E402
from ckray.data.negatives import read_negatives  # noqa: E402
from ckray.models.encoders import freeze_bottom_layers  # noqa: E402

PRECISIONS = ("fp32", "bf16")


def training_rows(data: Path, workdir: str, n: int, seed: int = 0) -> list[dict[str, list[str]]]:
    """``n`` (query, relevant, BM25 top-100 non-relevant) triples of non-dev training queries."""
    queries, qrels = read_queries_and_qrels(data)
    train = {q: r for q, r in qrels["train"].items()
             if q in queries and any(v > 0 for v in r.values()) and not is_dev_query(q, 0.15, 0)}
    qids = sorted(train)
    rng = random.Random(seed)
    rng.shuffle(qids)
    run = read_negatives(workdir, "train", qids[: 2 * n], 100)
    store = DocStore(workdir)
    rows = []
    for q in qids[: 2 * n]:
        neg = [d for d, _ in run.get(q, []) if train[q].get(d, 0) <= 0]
        if neg and len(rows) < n:
            pos = rng.choice([d for d, r in train[q].items() if r > 0])
            rows.append((queries[q], store.text(pos), store.text(rng.choice(neg))))
    return rows


def make_task(model: str, probe: dict[str, list[str]]):
    from ckray.rankers.cedr.model import CEDRConfig
    from ckray.rankers.cedr.task import CEDRTask
    from ckray.rankers.qds.model import QDSConfig
    from ckray.rankers.qds.task import QDSTask

    if model == "cedr-knrm":
        return CEDRTask(model_config=CEDRConfig(variant="knrm", head_init="warm", **CEDR_SETTINGS))
    kernels = {"qds": "auto", "qds-sparse": "sparse", "qds-fused-mask": "fused-mask"}
    if model not in kernels:
        raise SystemExit(f"unknown model {model!r} (cedr-knrm, {', '.join(kernels)})")
    return QDSTask(model_config=QDSConfig(head_init="warm", attention_kernel=kernels[model], **QDS_SETTINGS),
                   warm_triples=probe)


def padding_efficiency(batches: list[dict[str, torch.Tensor]]) -> float:
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    padded = sum(b["attention_mask"].numel() for b in batches)
    return round(real / padded, 3)


def run_steps(task, model, batches, precision: str, lr: float = 2e-5) -> tuple[float, float]:
    """Wall and process-CPU seconds of one optimizer step per batch."""
    opt = torch.optim.AdamW(task.param_groups(model, lr, 0.01), lr=lr)
    model.train()
    wall, cpu = time.perf_counter(), time.process_time()
    for batch in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = task.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return time.perf_counter() - wall, time.process_time() - cpu


def precision_gap(task, model, batch) -> dict[str, float]:
    """fp32 vs bf16 autocast on the same weights and batch: loss and scores (eval mode)."""
    model.eval()
    with torch.no_grad():
        scores = {}
        for p in PRECISIONS:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=p == "bf16"):
                scores[p] = model(batch).float()
        loss = {p: float(torch.nn.functional.softplus(s.view(2, -1)[1] - s.view(2, -1)[0]).mean())
                for p, s in scores.items()}
    spread = float(scores["fp32"].std()) or 1.0
    return {"loss_fp32": round(loss["fp32"], 4), "loss_bf16": round(loss["bf16"], 4),
            "max_score_diff_over_std": round(float((scores["fp32"] - scores["bf16"]).abs().max()) / spread, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", required=True, help="a work directory prepared on SciFact (jobs/prepare.py)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "scifact"))
    ap.add_argument("--models", default="cedr-knrm,qds", help="comma-separated: cedr-knrm, qds (its auto kernel), "
                                                              "qds-sparse, qds-fused-mask")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per configuration and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4, help="triples per step (the runs of record: 4)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frozen-layers", default="0",
                    help="comma-separated: bottom encoder layers not trained (embeddings = 0), each timed in "
                         "both precisions; the first is the base of the ratios")
    ap.add_argument("--attention-dropout", default="",
                    help="comma-separated attention-probability dropout values, each timed in both precisions "
                         "(empty: the encoder's own)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    triples = training_rows(Path(args.data), args.workdir, args.steps * args.batch_size + 8)
    probe = {c: [t[i] for t in triples[-8:]] for i, c in enumerate(("query", "pos_text", "neg_text"))}
    steps = triples[: args.steps * args.batch_size]
    rows = [{c: [t[i] for t in steps[s:s + args.batch_size]] for i, c in enumerate(("query", "pos_text", "neg_text"))}
            for s in range(0, len(steps), args.batch_size)]
    result: dict = {"bench": "rerank_train_speed", "batch_size": args.batch_size, "steps": args.steps,
                    "frozen_layers": args.frozen_layers, "attention_dropout": args.attention_dropout,
                    "rounds": args.rounds, "threads": args.threads,
                    "cpu_bf16": "avx512_bf16" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists()
                    else None, "models": {}}
    frozen = [int(f) for f in args.frozen_layers.split(",")]
    dropouts = [float(d) for d in args.attention_dropout.split(",")] if args.attention_dropout else [None]
    configs = [(p, f, d) for d in dropouts for f in frozen for p in PRECISIONS]
    for name in filter(None, args.models.split(",")):
        task = make_task(name, probe)
        torch.manual_seed(0)
        model = task.build_model()
        encoder = model.encoder if hasattr(model, "encoder") else model.bert
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        own_dropout = [layer.attention.self.dropout.p for layer in encoder.encoder.layer]
        batches = [task.collate(r) for r in rows]
        best = {c: {"wall": float("inf"), "cpu": float("inf")} for c in configs}
        for _ in range(args.rounds):
            for p, f, d in configs:
                model.load_state_dict(initial)
                model.requires_grad_(True)
                freeze_bottom_layers(encoder, f)
                for layer, own in zip(encoder.encoder.layer, own_dropout):
                    layer.attention.self.dropout.p = own if d is None else d
                wall, cpu = run_steps(task, model, batches, p)
                best[p, f, d] = {"wall": min(best[p, f, d]["wall"], wall), "cpu": min(best[p, f, d]["cpu"], cpu)}
        model.load_state_dict(initial)
        for layer, own in zip(encoder.encoder.layer, own_dropout):
            layer.attention.self.dropout.p = own
        pairs = 2 * len(steps)
        base = best["fp32", frozen[0], dropouts[0]]
        entry = {f"{p}/frozen{f}" + ("" if d is None else f"/attn_dropout{d:g}"): {"pairs_per_s": round(pairs / b["wall"], 3),
                                    "pairs_per_cpu_s": round(pairs / b["cpu"], 3),
                                    "over_base_cpu": round(base["cpu"] / b["cpu"], 3),
                                    "over_base_wall": round(base["wall"] / b["wall"], 3)}
                 for (p, f, d), b in best.items()}
        entry["padding_efficiency"] = padding_efficiency(batches)
        entry.update(precision_gap(task, model, batches[0]))
        result["models"][name] = entry
        print(name, json.dumps(entry), file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
