"""Train the QDS-Transformer cross-encoder on the shared Ray Train + DeepSpeed loop.

    python jobs/train_qds.py --data DIR --workdir W --workers N [--pattern qds|longformer-qa|local]

Writes W/checkpoints/qds (qds-longformer-qa, qds-local for the ablations); pipeline bm25>qds.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.cli import run_job  # noqa: E402
from ckray.train_job import training_parser  # noqa: E402


def main(args) -> None:
    from ckray.models.qds import QDSConfig, QDSTask
    from ckray.train_job import run_training

    name = "qds" if args.pattern == "qds" else f"qds-{args.pattern}"
    config = QDSConfig(encoder=args.encoder, max_length=args.max_length, window=args.window, pattern=args.pattern,
                       gradient_checkpointing=args.gradient_checkpointing)
    task = QDSTask(model_config=config, name=name)
    run_training(task, args, name, lr=2e-5, max_steps=500, eval_every=100, batch_size=4, warmup_steps=20)


def parser():
    from ckray.models.encoders import DEFAULT_ENCODER

    p = training_parser(__doc__)
    g = p.add_argument_group("model (ckray.models.qds)")
    g.add_argument("--encoder", default=DEFAULT_ENCODER, help="Hugging Face id or directory of a BERT encoder")
    g.add_argument("--pattern", choices=("qds", "longformer-qa", "local"), default="qds")
    g.add_argument("--max-length", type=int, default=2048, help="tokens of [CLS] query [SEP] [SOS] sentences …")
    g.add_argument("--window", type=int, default=128, help="local attention window w")
    g.add_argument("--gradient-checkpointing", action="store_true")
    return p


if __name__ == "__main__":
    run_job(main, parser())
