"""CK-QTI: terms kept per document (top-k) against index size and effectiveness, in one run.

    python bench/impact_topk.py --data DIR --workdir W [--checkpoint W/checkpoints/ck-qti] [--ks 32,64,128,256]
                                [--explicit-weights 0,0.5,1]

``W`` holds the corpus shards and the BM25 index (``jobs/prepare.py``) and the trained CK-QTI checkpoint.
The documents are scored once, at the largest k, into ``--out`` (default ``W/impact-topk``); each smaller
k keeps the first k terms of every stored vector (they are sorted by s_td, so this is exactly what a
build with ``--top-k k`` stores) and gets its own Lucene index. For every k: index size, and nDCG@10 /
R@100 of ``ck-qti`` (full collection) and ``ck-qti-rerank`` (BM25 top 100, by stored impacts) on the
dev split of the *training* queries (where k is chosen) and on ``--split`` (reported). Each exact-match
weight β of ``--explicit-weights`` (``ImpactConfig.explicit_weight``: stored w_td = s_td + β·s_explicit_td)
is scored once at the largest k under ``--out/b<β>``; the (β, k) with the best dev nDCG@10 is the choice.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckray.cli import setup_logging  # noqa: E402


def link_corpus_shards(src_w: Path, dst_w: Path) -> None:
    """``dst_w/shards`` → ``src_w``'s corpus shards (each k's work directory shares them)."""
    dst_w.mkdir(parents=True, exist_ok=True)
    if not (dst_w / "shards").exists():
        os.symlink((src_w / "shards").resolve(), dst_w / "shards")


def truncated_copy(src_w: Path, dst_w: Path, k: int) -> None:
    """``dst_w/impact/shards``: ``src_w``'s impact shards with each vector cut to its first k terms,
    stamped as a ``--top-k k`` build (so the index job only writes JSON lines and the Lucene index)."""
    import pyarrow.parquet as pq

    from ckray.data.shards import marker_path, read_json
    from ckray.rankers.ck_qti.impact import impact_shards_dir, impact_table, write_impact_shard

    link_corpus_shards(src_w, dst_w)
    out = impact_shards_dir(dst_w)
    out.mkdir(parents=True, exist_ok=True)
    for shard in sorted(impact_shards_dir(src_w).glob("part-*.parquet")):
        t = pq.read_table(shard)
        table = impact_table(t.column("doc_id").to_pylist(), [x[:k] for x in t.column("terms").to_pylist()],
                             [x[:k] for x in t.column("weights").to_pylist()])
        stamp = {key: v for key, v in read_json(marker_path(shard)).items() if key not in ("rows", "max_weight")}
        write_impact_shard(out / shard.name, table, {**stamp, "top_k": k})  # atomic; marker with its max weight


def index_metrics(wk: Path, checkpoint: Path, config, splits: dict, first: dict, store) -> dict:
    """Index ``wk``'s impact shards with ``config`` and measure it on each split ``{name: (queries,
    qrels)}``: index size, nDCG@10 / R@100 of ``ck-qti`` and nDCG@10 of ``bm25>ck-qti`` (``first[name]``,
    BM25's top 100, reranked by stored impacts)."""
    from ckray.eval import evaluate
    from ckray.rankers.ck_qti.impact import build_impact_index, impact_index_dir
    from ckray.rankers.ck_qti.impact_search import ImpactRetriever
    from ckray.rankers.ck_qti.impact_rerank import ImpactReranker

    s = build_impact_index(wk, checkpoint, config)
    retriever = ImpactRetriever(str(impact_index_dir(wk)))
    reranker = ImpactReranker(str(checkpoint), str(wk), store.text, config=config)
    row = {"index_mb": round(s["index_bytes"] / 2**20, 2)}
    for name, (qs, judged) in splits.items():
        full = evaluate(retriever.search(qs, k=1000), judged, ("nDCG@10", "R@100"))
        rr = evaluate(reranker.rerank(qs, first[name], depth=100), judged, ("nDCG@10",))
        row[f"{name}_ndcg10"], row[f"{name}_r100"] = round(full["nDCG@10"], 4), round(full["R@100"], 4)
        row[f"{name}_rerank_ndcg10"] = round(rr["nDCG@10"], 4)
    return row


def impact_bench_arguments(doc: str, add: Callable[[argparse.ArgumentParser], None] = lambda p: None):
    """The flags of a CK-QTI index bench (``--data``, ``--workdir``, ``--checkpoint``, ``--split`` and
    ``add``'s) parsed, with logging set up → ``(args, data, W, checkpoint)``; None, after saying so,
    when ``--data`` holds no collection."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--checkpoint", default=None, help="default: W/checkpoints/ck-qti")
    p.add_argument("--split", default="test", help="the qrels split reported beside dev")
    add(p)
    args = p.parse_args()
    setup_logging("WARNING")
    data, w = Path(args.data), Path(args.workdir)
    if not (data / "corpus.jsonl").exists() and not (data / "collection.tsv").exists():
        print(f"skip: no collection at {data} (pass --data DIR)")
        return None
    return args, data, w, Path(args.checkpoint or w / "checkpoints" / "ck-qti")


def main() -> None:
    def flags(p: argparse.ArgumentParser) -> None:
        p.add_argument("--ks", default="32,64,128,256")
        p.add_argument("--explicit-weights", default="0", help="β values (comma-separated); 0 = the model's s_td")
        p.add_argument("--out", default=None, help="default: W/impact-topk")
        p.add_argument("--cpus-per-actor", type=float, default=2.0)
        p.add_argument("--expansion-candidates", type=int, default=None, help="default: the index job's (256)")
        p.add_argument("--candidate-pool", choices=("window", "position"), default=None, help="default: the job's")
        p.add_argument("--passages", type=int, default=None,
                       help="windows of a long document read (0: all; 1: the first); default: the job's (0)")

    parsed = impact_bench_arguments(__doc__, flags)
    if parsed is None:
        return
    args, data, w, checkpoint = parsed
    from ckray.data.shards import DocStore
    from ckray.fusion import measurement_splits
    from ckray.rankers.ck_qti.impact import build_impact_index
    from ckray.rankers.ck_qti.impact_settings import ImpactConfig
    from ckray.lexical.bm25 import bm25_retriever

    candidates = {k: v for k, v in (("expansion_candidates", args.expansion_candidates),
                                    ("candidate_pool", args.candidate_pool), ("passages", args.passages))
                  if v is not None}
    ks = sorted(int(k) for k in args.ks.split(","))
    out = Path(args.out or w / "impact-topk")
    splits = measurement_splits(data, args.split)
    from ckray.ray_env import init_ray

    init_ray()  # before the JVM: Ray's crash handler, installed after it, turns the JVM's own SIGSEGVs fatal
    bm25 = bm25_retriever(w)
    first = {name: bm25.search(qs, k=100) for name, (qs, _) in splits.items()}
    store = DocStore(w)

    rows = []
    for beta in sorted(float(b) for b in args.explicit_weights.split(",")):
        base = out if beta == 0 else out / f"b{beta:g}"  # β = 0 keeps the layout of earlier runs
        top = base / f"k{ks[-1]}"
        link_corpus_shards(w, top)
        t0 = time.perf_counter()
        build_impact_index(top, checkpoint, ImpactConfig(top_k=ks[-1], explicit_weight=beta,
                                                             cpus_per_actor=args.cpus_per_actor, **candidates))
        print(f"scored at k={ks[-1]}, explicit weight {beta:g} in {time.perf_counter() - t0:.0f}s", flush=True)
        for k in ks:
            wk = base / f"k{k}"
            if k != ks[-1]:
                truncated_copy(top, wk, k)
            config = ImpactConfig(top_k=k, explicit_weight=beta, **candidates)
            row = {"explicit_weight": beta, "top_k": k, **index_metrics(wk, checkpoint, config, splits, first, store)}
            rows.append(row)
            print(row, flush=True)
    best = max(rows, key=lambda r: r["dev_ndcg10"])
    print(f"\n{'β':>5} {'k':>5} {'MB':>7} {'dev nDCG':>9} {'dev R@100':>9} {'dev rerank':>10} "
          f"{args.split + ' nDCG':>10} {args.split + ' R@100':>10} {args.split + ' rerank':>11}")
    for r in rows:
        print(f"{r['explicit_weight']:>5g} {r['top_k']:>5} {r['index_mb']:>7} {r['dev_ndcg10']:>9} {r['dev_r100']:>9} "
              f"{r['dev_rerank_ndcg10']:>10} "
              f"{r[args.split + '_ndcg10']:>10} {r[args.split + '_r100']:>10} {r[args.split + '_rerank_ndcg10']:>11}")
    print(f"chosen on dev (full-collection nDCG@10): explicit weight {best['explicit_weight']:g}, k={best['top_k']}")
    print(json.dumps({"bench": "impact_topk", "checkpoint": str(checkpoint), "split": args.split, **candidates,
                      "chosen_on_dev": {"explicit_weight": best["explicit_weight"], "top_k": best["top_k"]},
                      "rows": rows}))


if __name__ == "__main__":
    main()
