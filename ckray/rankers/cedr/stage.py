"""CEDR's stage: the training job's flags and training (``jobs/train_cedr.py``)."""

from __future__ import annotations

import argparse

from ckray.rankers.cedr import SPEC
from ckray.rankers.cedr.options import CEDROptions


def train(options: CEDROptions, args: argparse.Namespace):
    """A CEDR reranker (or vanilla BERT) → W/checkpoints/cedr-<variant> (vanilla-bert); the training data
    and loop from ``args`` (a training job's flags)."""
    from ckray.rankers.cedr.model import CEDRConfig
    from ckray.rankers.cedr.task import CEDRTask
    from ckray.rankers.qds.task import probe_triples
    from ckray.train_job import run_training, training_config, training_data

    config = CEDRConfig(variant=options.variant, encoder=options.encoder, num_layers=options.num_layers,
                        max_length=options.max_length, max_segments=options.max_segments,
                        head_init=options.head_init, knrm_warm_layers=options.knrm_warm_layers,
                        frozen_layers=options.frozen_layers,
                        attention_dropout=options.attention_dropout)
    task = CEDRTask(model_config=config)
    train_config = training_config(args, task.name, **SPEC.training.defaults)  # flag errors before the data
    td = training_data(args)
    if task.needs_warm_triples:
        task.warm_triples = probe_triples(td, config.warm_probe_triples)
    return run_training(task, args, train_config, td)
