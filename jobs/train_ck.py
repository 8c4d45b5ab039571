"""Train CK-QTI (or the full CK / the TK baseline) on the shared Ray Train + DeepSpeed loop.

    python jobs/train_ck.py --data DIR --workdir W --workers N [--use-gpu] [--qti/--no-qti]

Writes the checkpoint chosen on dev nDCG@10 (held-back training queries) to W/checkpoints/ck-qti
(ck with --no-qti, tk with --attention quadratic).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import run_job  # noqa: E402
from ckray.train_job import training_parser  # noqa: E402


def main(args) -> None:
    from dataclasses import replace

    from ckray.data.shards import load_corpus_table
    from ckray.data.collections import doc_text
    from ckray.models.ck import CKConfig, corpus_statistics, tk_config
    from ckray.tasks import CKTask
    from ckray.train_job import run_training, training_data

    base = tk_config() if args.attention == "quadratic" else CKConfig(qti=args.qti)
    config = replace(base, max_doc_len=args.max_doc_len, n_layers=args.layers)
    name = args.name or ("tk" if args.attention == "quadratic" else "ck-qti" if args.qti else "ck")
    td = training_data(args)  # prepares shards, BM25 and negatives when missing
    corpus = load_corpus_table(args.workdir)
    stats = corpus_statistics((doc_text(t, x) for t, x in zip(corpus["title"].to_pylist(), corpus["text"].to_pylist())), config)
    task = CKTask(config=config, doc_freq=stats.doc_freq.numpy(), n_docs=stats.n_docs,
                  mean_doc_len=stats.mean_doc_len, name=name)
    run_training(task, args, name, td=td, lr=args.default_lr, max_steps=1000, eval_every=200, batch_size=16)


def parser():
    p = training_parser(__doc__)
    g = p.add_argument_group("model (ckray.models.ck)")
    g.add_argument("--qti", dest="qti", action="store_true", default=True, help="query term independence (CK-QTI)")
    g.add_argument("--no-qti", dest="qti", action="store_false", help="the paper's full CK (query contextualised)")
    g.add_argument("--attention", choices=("separable", "quadratic"), default="separable",
                   help="quadratic = the TK baseline")
    g.add_argument("--max-doc-len", type=int, default=4000, help="document word pieces (not cut at 512)")
    g.add_argument("--layers", type=int, default=2, help="Conformer blocks")
    g.add_argument("--name", default=None, help="checkpoint name under W/checkpoints")
    g.add_argument("--default-lr", type=float, default=1e-3, help="learning rate when --lr is not given")
    return p


if __name__ == "__main__":
    run_job(main, parser())
