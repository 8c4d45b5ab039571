"""Write a long-document test collection (BEIR layout) from a collection of short ones.

Each new document joins ``k`` of the source's documents (shuffled; ``k`` drawn from --sizes with --weights), so
lengths run from one abstract to thousands of words; a query's relevant documents are those holding one of its
judged documents, at that judgement. Only the source's --split qrels and their queries are written, as ``test``:
made from test queries, the collection is for reporting how a pipeline reads long documents, never for choosing
anything. ``--held-out`` keeps instead the held-out training queries (``ckray.fusion.dev_queries``: those training
left out, where settings are chosen), over the same documents: a long-document dev collection.

    python scripts/long_collection.py --data ../shared/data/scifact --out T/longsci      # 441 documents, 190 queries
    python scripts/long_collection.py --data ../shared/data/scifact --out T/longsci-dev --held-out   # 441, 79 queries
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from ckray.data.collections import read_beir_qrels, read_queries_and_qrels
from ckray.fusion import dev_queries


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, help="source BEIR directory (corpus.jsonl, queries.jsonl, qrels/)")
    p.add_argument("--out", required=True, help="directory to write the long collection to")
    p.add_argument("--split", default="test", help="source qrels split kept (written as test)")
    p.add_argument("--documents", type=int, default=3000, help="source documents used")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64,300", help="source documents joined per new document")
    p.add_argument("--weights", default="40,20,15,10,6,4,3,0.3", help="relative frequency of each size")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--held-out", action="store_true",
                   help="keep the held-out queries of the source's train split (its dev queries) instead of --split's")
    a = p.parse_args()
    src, out, rng = Path(a.data), Path(a.out), random.Random(a.seed)
    sizes, weights = [int(x) for x in a.sizes.split(",")], [float(x) for x in a.weights.split(",")]
    if len(sizes) != len(weights):
        raise SystemExit(f"--sizes has {len(sizes)} values and --weights {len(weights)}")
    docs = [json.loads(line) for line in (src / "corpus.jsonl").open(encoding="utf-8") if line.strip()]
    rng.shuffle(docs)
    docs = docs[:a.documents]

    joined, holder, i = [], {}, 0
    while i < len(docs):
        part = docs[i:i + rng.choices(sizes, weights)[0]]
        i += len(part)
        doc_id = f"L{len(joined)}"
        holder.update({d["_id"]: doc_id for d in part})
        joined.append({"_id": doc_id, "title": part[0].get("title", ""),
                       "text": "\n\n".join(f"{d.get('title', '')}. {d.get('text', '')}" for d in part)})
    if a.held_out:
        source = dev_queries(*read_queries_and_qrels(src), max_queries=10**6)[1]
    else:
        source = read_beir_qrels(src / "qrels" / f"{a.split}.tsv")
    qrels = {}
    for q, judged in source.items():
        kept = {}
        for d, grade in judged.items():
            if d in holder:
                kept[holder[d]] = max(grade, kept.get(holder[d], grade))
        if kept:
            qrels[q] = kept

    (out / "qrels").mkdir(parents=True, exist_ok=True)
    with (out / "corpus.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(d) + "\n" for d in joined)
    with (out / "qrels" / "test.tsv").open("w", encoding="utf-8") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        f.writelines(f"{q}\t{d}\t{g}\n" for q, judged in qrels.items() for d, g in judged.items())
    with (out / "queries.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(line for line in (src / "queries.jsonl").open(encoding="utf-8")
                     if line.strip() and json.loads(line)["_id"] in qrels)
    words = sorted(len(d["text"].split()) for d in joined)
    print(f"{len(joined)} documents (words: median {words[len(words) // 2]}, max {words[-1]}), "
          f"{len(qrels)} judged queries → {out}")


if __name__ == "__main__":
    main()
