"""Train CLEAR (the BM25-residual dense retriever) on the shared Ray Train + DeepSpeed loop.

    python jobs/train_clear.py --data DIR --workdir W --workers N [--use-gpu] [--constant-margin]

Loss: [m_r − s_emb(q,d+) + s_emb(q,d−)]_+ with m_r = ξ − λ_train·(s_lex(q,d+) − s_lex(q,d−)), negatives
from BM25's top 1000. Writes W/checkpoints/clear (clear-constant with --constant-margin).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import run_job  # noqa: E402
from ckray.train_job import training_parser  # noqa: E402


def main(args) -> None:
    from ckray.models.clear import CLEARConfig, CLEARLossConfig, CLEARTask
    from ckray.train_job import run_training

    name = args.name or ("clear-constant" if args.constant_margin else "clear")
    task = CLEARTask(model_config=CLEARConfig(encoder=args.encoder, doc_max_len=args.doc_max_len),
                     loss_config=CLEARLossConfig(xi=args.xi, lambda_train=args.lambda_train,
                                                 constant_margin=args.constant_margin), name=name)
    run_training(task, args, name, lr=2e-5, max_steps=500, eval_every=100, batch_size=8, warmup_steps=20)


def parser():
    from ckray.models.encoders import DEFAULT_ENCODER

    p = training_parser(__doc__)
    g = p.add_argument_group("model (ckray.models.clear)")
    g.add_argument("--encoder", default=DEFAULT_ENCODER, help="Hugging Face id or directory of a BERT encoder")
    g.add_argument("--doc-max-len", type=int, default=256)
    g.add_argument("--xi", type=float, default=0.2, help="ξ, the margin before the lexical residual")
    g.add_argument("--lambda-train", type=float, default=0.05, help="λ_train, weight of the BM25 gap in the margin")
    g.add_argument("--constant-margin", action="store_true", help="ablation: m = ξ (no lexical residual)")
    g.add_argument("--name", default=None, help="checkpoint name under W/checkpoints")
    return p


if __name__ == "__main__":
    run_job(main, parser())
