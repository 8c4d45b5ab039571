"""CK-QTI: how many expansion terms a document keeps (``--expansion-ratio r``), chosen on held-out
training queries and reported on other collections, in one run.

    python bench/impact_expansion.py --data DIR --workdir W [--ratios 0,0.25,0.5,1,2] \
        [--report DIR2:W2 ...] [--out OUT]

``W`` (and each ``W2``) holds an impact index built without a cap (``jobs/build_impact_index.py``), the
corpus shards and the BM25 index. A document's stored vector is its top-k terms by weight, its own
word pieces and expansion terms mixed; ``--expansion-ratio r`` keeps every own term of those and only
the best ``⌈r·u_d⌉`` expansion terms (u_d: the document's distinct word pieces,
``ckray.rankers.ck_qti.term_impacts.cap_expansion``). That is a cut of the stored vector, so each r is made
from the uncapped shards without scoring again, exactly as a build with ``--expansion-ratio r``
stores it, and indexed under ``OUT/<collection>/r<r>``.

For each r and collection: index size, nDCG@10 and R@100 of ``ck-qti`` (the impact index) and nDCG@10
of ``bm25>ck-qti`` (BM25's top 100 by stored impacts). On ``DIR`` they are measured on the dev split of
the *training* queries, where r is chosen (the best full-collection nDCG@10; ties to the smaller
index), and on ``--split``; on each ``--report`` collection, on ``--split`` only, never to choose.
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.impact_topk import index_metrics, link_corpus_shards  # noqa: E402
from ckray.cli import setup_logging  # noqa: E402


def own_terms(corpus_shard: Path, cfg: dict) -> dict[str, "object"]:
    """doc_id → the distinct word-piece ids the impact scorer saw (the checkpoint's tokenizer and
    ``max_doc_len``), for the documents of one corpus shard."""
    import numpy as np
    import pyarrow.parquet as pq

    from ckray.data.collections import doc_text
    from ckray.rankers.ck_qti.model import tokenize

    out = {}
    for batch in pq.ParquetFile(corpus_shard).iter_batches(batch_size=512, columns=["doc_id", "title", "text"]):
        t = batch.to_pydict()
        ids, mask = tokenize([doc_text(a, b) for a, b in zip(t["title"], t["text"])], cfg["max_doc_len"],
                             cfg.get("encoder"))
        for d, row, m in zip(t["doc_id"], ids.numpy(), mask.numpy().astype(bool)):
            out[d] = np.unique(row[m])
    return out


def capped_copies(src_w: Path, dst: dict[float, Path], checkpoint: Path) -> None:
    """``dst[r]/impact/shards`` for each ratio r: ``src_w``'s shards with expansion terms capped at r,
    stamped as a build with ``--expansion-ratio r``. One impact shard (and its corpus shard's own
    terms) in memory at a time."""
    import pyarrow.parquet as pq

    from ckray.data.shards import marker_path, read_json, shard_paths
    from ckray.models.checkpoint import read_checkpoint_config
    from ckray.rankers.ck_qti.impact import impact_shards_dir, impact_table, write_impact_shard
    from ckray.rankers.ck_qti.term_impacts import cap_expansion

    cfg = read_checkpoint_config(checkpoint)["config"]
    corpus = {p.name: p for p in shard_paths(src_w)}
    for dst_w in dst.values():
        link_corpus_shards(src_w, dst_w)
        impact_shards_dir(dst_w).mkdir(parents=True, exist_ok=True)
    for shard in sorted(impact_shards_dir(src_w).glob("part-*.parquet")):
        stamp = {k: v for k, v in read_json(marker_path(shard)).items() if k not in ("rows", "max_weight")}
        if "expansion_ratio" in stamp:
            raise SystemExit(f"{shard} is already capped (expansion_ratio {stamp['expansion_ratio']}); "
                             "build the source index without --expansion-ratio")
        own = own_terms(corpus[stamp["source"]], cfg)
        t = pq.read_table(shard)
        ids = t.column("doc_id").to_pylist()
        vectors = [(terms.values.to_numpy(), weights.values.to_numpy())
                   for terms, weights in zip(t.column("terms"), t.column("weights"))]
        for ratio, dst_w in dst.items():
            capped = [cap_expansion(terms, weights, own[d], ratio) for d, (terms, weights) in zip(ids, vectors)]
            write_impact_shard(impact_shards_dir(dst_w) / shard.name,
                               impact_table(ids, [c[0] for c in capped], [c[1] for c in capped]),
                               {**stamp, "expansion_ratio": ratio})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--checkpoint", default=None, help="default: W/checkpoints/ck-qti")
    p.add_argument("--ratios", default="0,0.25,0.5,1,2")
    p.add_argument("--report", action="append", default=[], metavar="DIR:W",
                   help="another collection and its work directory, reported on --split only (repeatable)")
    p.add_argument("--out", default=None, help="default: W/impact-expansion")
    p.add_argument("--split", default="test")
    args = p.parse_args()
    setup_logging("WARNING")
    collections = [("choose", Path(args.data), Path(args.workdir))] + [
        ("report", Path(spec.split(":", 1)[0]), Path(spec.split(":", 1)[1])) for spec in args.report]
    for _, data, w in collections:
        if not (data / "corpus.jsonl").exists():
            print(f"skip: no collection at {data} (pass --data DIR / --report DIR:W)")
            return
    from ckray.data.collections import read_queries_and_qrels
    from ckray.data.shards import DocStore
    from ckray.fusion import dev_queries
    from ckray.lexical.bm25 import bm25_retriever
    from ckray.rankers.ck_qti.impact import impact_index_dir, read_index_meta
    from ckray.rankers.ck_qti.impact_settings import ImpactConfig
    from ckray.ray_env import init_ray

    checkpoint = Path(args.checkpoint or Path(args.workdir) / "checkpoints" / "ck-qti")
    ratios = sorted(float(r) for r in args.ratios.split(","))
    out = Path(args.out or Path(args.workdir) / "impact-expansion")
    init_ray()  # before the JVM: Ray's crash handler, installed after it, turns the JVM's own SIGSEGVs fatal
    rows = []
    for role, data, w in collections:
        meta = read_index_meta(impact_index_dir(w))
        queries, qrels = read_queries_and_qrels(data)
        splits = {args.split: ({q: queries[q] for q in qrels[args.split] if q in queries}, qrels[args.split])}
        if role == "choose":
            splits = {"dev": dev_queries(queries, qrels, max_queries=10**6), **splits}
        bm25 = bm25_retriever(w)
        first = {name: bm25.search(qs, k=100) for name, (qs, _) in splits.items()}
        store = DocStore(w)
        capped = {r: out / data.name / f"r{r:g}" for r in ratios}
        t0 = time.perf_counter()
        capped_copies(w, capped, checkpoint)
        print(f"{data.name}: {len(ratios)} capped copies in {time.perf_counter() - t0:.0f}s", flush=True)
        for r in [None, *ratios]:  # None: the uncapped index in W itself (today's default)
            config = ImpactConfig(top_k=meta["top_k"], explicit_weight=meta.get("explicit_weight", 0.0),
                                  expansion_candidates=meta["expansion_candidates"],
                                  candidate_pool=meta["candidate_pool"], expansion_ratio=r)
            wr = w if r is None else capped[r]
            row = {"collection": data.name, "role": role, "expansion_ratio": "none" if r is None else r,
                   **index_metrics(wr, checkpoint, config, splits, first, store)}
            rows.append(row)
            print(row, flush=True)
    chosen = max((r for r in rows if r["role"] == "choose"), key=lambda r: (r["dev_ndcg10"], -r["index_mb"]))
    print(f"\nchosen on {Path(args.data).name}'s dev queries (full-collection nDCG@10): expansion ratio "
          f"{chosen['expansion_ratio']} (dev {chosen['dev_ndcg10']})")
    print(f"{'collection':>12} {'r':>5} {'MB':>7} {'dev':>7} {args.split:>7} {'R@100':>7} {'rerank':>7}")
    for r in rows:
        print(f"{r['collection']:>12} {r['expansion_ratio']!s:>5} {r['index_mb']:>7} {r.get('dev_ndcg10', '-'):>7} "
              f"{r[args.split + '_ndcg10']:>7} {r[args.split + '_r100']:>7} {r[args.split + '_rerank_ndcg10']:>7}")
    print(json.dumps({"bench": "impact_expansion", "checkpoint": str(checkpoint), "split": args.split,
                      "chosen_on_dev": {"expansion_ratio": chosen["expansion_ratio"]}, "rows": rows}))


if __name__ == "__main__":
    main()
