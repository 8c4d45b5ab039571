"""Run named pipelines on a split and evaluate them with ir-measures.

    python jobs/evaluate.py --data DIR --workdir W --pipeline bm25 [--pipeline bm25>cedr-knrm] --split test

``first>reranker`` reranks the first stage's top --rerank-depth; ``first+reranker`` also adds the first
stage's score back, ``z(s_rerank) + w·z(s_first)``, with w tuned once on the dev split of the *training*
queries and saved in W/fusion (ckray/fusion.py) and with the checkpoint (deploy.json). A collection
without training queries uses the λ and w saved with the checkpoints (ckray/deploy.py); --lambda and
--fusion-weight override. W/metrics/<pipeline>-<split>.settings.json records what was used, and from where.

Writes W/runs/<pipeline>-<split>.trec, W/metrics/<pipeline>-<split>.json (flat: measure → value)
and W/metrics/<pipeline>-<split>.per-query.json, and prints a table.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import base_parser, run_job  # noqa: E402


def main(args) -> None:
    from ckray import api
    from ckray.evaluation import format_table

    results = api.evaluate(args.pipeline or ["bm25"], args.data, args.workdir, split=args.split, k=args.k,
                           rerank_depth=args.rerank_depth, lam=args.lam, fusion_weight=args.fusion_weight)
    print(format_table(results, args.split))


def parser():
    p = base_parser(__doc__)
    p.add_argument("--pipeline", action="append",
                   help="pipeline name (repeatable), e.g. bm25, clear, bm25>cedr-knrm, clear+cedr-knrm (default: bm25)")
    p.add_argument("--split", default="test", help="qrels split whose queries are evaluated")
    p.add_argument("--k", type=int, default=1000, help="results kept per query")
    p.add_argument("--rerank-depth", type=int, default=100, help="first-stage results a reranker rescores")
    p.add_argument("--lambda", dest="lam", type=float, default=None,
                   help="CLEAR's λ_test (default: W/dense/hybrid.json: tuned on training queries, or carried "
                        "from the checkpoint's deploy.json)")
    p.add_argument("--fusion-weight", type=float, default=None,
                   help="w of every first+reranker (default: tuned on the dev training queries, or, on a "
                        "collection without them, the one saved in the reranker checkpoint's deploy.json)")
    return p


if __name__ == "__main__":
    run_job(main, parser())
