"""QDS-Transformer's stage: the training job's flags and training (``jobs/train_qds.py``)."""

from __future__ import annotations

import argparse

from ckray.rankers.qds import SPEC


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ckray.models.encoders import DEFAULT_ENCODER

    g = p.add_argument_group("model (ckray.rankers.qds.model)")
    g.add_argument("--encoder", default=DEFAULT_ENCODER, help="Hugging Face id or directory of a BERT encoder")
    g.add_argument("--pattern", choices=("qds", "longformer-qa", "local"), default="qds",
                   help="attention: local window + [CLS]/query global + [SOS] sentence hierarchy (qds), "
                        "without the hierarchy (longformer-qa), or the local window alone (local)")
    g.add_argument("--max-length", type=int, default=2048, help="tokens of [CLS] query [SEP] [SOS] sentences …")
    g.add_argument("--window", type=int, default=128, help="local attention window w")
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in the backward pass: less memory, slower")
    g.add_argument("--head-lr-multiplier", type=float, default=1.0,
                   help="train the [CLS] score head this many times faster than the encoder")
    return p


def train(args: argparse.Namespace):
    """The QDS-Transformer cross-encoder → W/checkpoints/qds (qds-<pattern> for the ablations)."""
    from ckray.rankers.qds.model import QDSConfig
    from ckray.rankers.qds.task import QDSTask
    from ckray.train_job import run_training, training_config

    name = "qds" if args.pattern == "qds" else f"qds-{args.pattern}"
    config = QDSConfig(encoder=args.encoder, max_length=args.max_length, window=args.window, pattern=args.pattern,
                       gradient_checkpointing=args.gradient_checkpointing)
    task = QDSTask(model_config=config, name=name, head_lr_multiplier=args.head_lr_multiplier)
    return run_training(task, args, training_config(args, name, **SPEC.training.defaults))
