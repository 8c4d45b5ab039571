"""CEDR's stage: the training job's flags and training (``jobs/train_cedr.py``)."""

from __future__ import annotations

import argparse

from ckray.rankers.cedr import SPEC


def add_train_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ckray.models.encoders import DEFAULT_ENCODER

    g = p.add_argument_group("model (ckray.rankers.cedr.model)")
    g.add_argument("--variant", choices=("knrm", "pacrr", "drmm", "vanilla"), default="knrm",
                   help="the interaction ranker over the encoder's per-layer similarity matrices, joined with "
                        "[CLS] (vanilla: BERT's [CLS] → linear alone)")
    g.add_argument("--encoder", default=DEFAULT_ENCODER, help="Hugging Face id or directory of a BERT encoder")
    g.add_argument("--num-layers", type=int, default=None,
                   help="use only the first L encoder layers (default: all of them)")
    g.add_argument("--max-length", type=int, default=512, help="tokens per (query, segment) input")
    g.add_argument("--max-segments", type=int, default=4, help="segments per long document")
    return p


def train(args: argparse.Namespace):
    """A CEDR reranker (or vanilla BERT) → W/checkpoints/cedr-<variant> (vanilla-bert)."""
    from ckray.rankers.cedr.model import CEDRConfig
    from ckray.rankers.cedr.task import CEDRTask
    from ckray.train_job import run_training, training_config

    config = CEDRConfig(variant=args.variant, encoder=args.encoder, num_layers=args.num_layers,
                        max_length=args.max_length, max_segments=args.max_segments)
    task = CEDRTask(model_config=config)
    return run_training(task, args, training_config(args, task.name, **SPEC.training.defaults))
