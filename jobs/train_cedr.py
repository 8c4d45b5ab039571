"""Train a CEDR reranker (KNRM, PACRR, DRMM) or the vanilla BERT ranker on the shared loop.

    python jobs/train_cedr.py --data DIR --workdir W --variant knrm|pacrr|drmm|vanilla --workers N

Pairwise loss on (query, relevant, BM25 negative) triples; the encoder is fine-tuned at --lr, the
ranker head 50× faster (the paper's 2e-5 / 1e-3). Writes W/checkpoints/cedr-<variant> (vanilla-bert).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import run_job  # noqa: E402
from ckray.train_job import training_parser  # noqa: E402


def main(args) -> None:
    from ckray.models.cedr import CEDRConfig, CEDRTask
    from ckray.train_job import run_training

    config = CEDRConfig(variant=args.variant, encoder=args.encoder, num_layers=args.num_layers,
                        max_length=args.max_length, max_segments=args.max_segments)
    task = CEDRTask(model_config=config)
    run_training(task, args, task.name, lr=2e-5, max_steps=500, eval_every=100, batch_size=4, warmup_steps=20)


def parser():
    from ckray.models.encoders import DEFAULT_ENCODER

    p = training_parser(__doc__)
    g = p.add_argument_group("model (ckray.models.cedr)")
    g.add_argument("--variant", choices=("knrm", "pacrr", "drmm", "vanilla"), default="knrm")
    g.add_argument("--encoder", default=DEFAULT_ENCODER, help="Hugging Face id or directory of a BERT encoder")
    g.add_argument("--num-layers", type=int, default=None, help="use only the first L encoder layers")
    g.add_argument("--max-length", type=int, default=512, help="tokens per (query, segment) input")
    g.add_argument("--max-segments", type=int, default=4, help="segments per long document")
    return p


if __name__ == "__main__":
    run_job(main, parser())
