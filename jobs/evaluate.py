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
    from ckray.evaluation import EvaluateConfig, evaluate_pipelines, format_table
    from ckray.options import options_from_args

    c = options_from_args(EvaluateConfig, args, data=args.data, workdir=args.workdir)
    results = evaluate_pipelines(c)
    print(format_table(results, c.split))


def parser():
    from ckray.evaluation import EvaluateConfig
    from ckray.options import add_options

    return add_options(base_parser(__doc__), EvaluateConfig)


if __name__ == "__main__":
    run_job(main, parser())
