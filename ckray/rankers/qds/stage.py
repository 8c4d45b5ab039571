"""QDS-Transformer's stage: the training job's flags and training (``jobs/train_qds.py``)."""

from __future__ import annotations

import argparse

from ckray.rankers.qds import SPEC
from ckray.rankers.qds.options import QDSOptions


def train(options: QDSOptions, args: argparse.Namespace):
    """The QDS-Transformer cross-encoder → W/checkpoints/qds (qds-<pattern> for the ablations); the
    training data and loop from ``args`` (a training job's flags)."""
    from ckray.data.statistics import cached_corpus_statistics
    from ckray.rankers.qds.model import QDSConfig, collection_tokenisation
    from ckray.rankers.qds.task import QDSTask, probe_triples
    from ckray.train_job import run_training, training_config, training_data

    o, name = options, options.checkpoint_name
    config = QDSConfig(encoder=o.encoder, max_length=o.max_length, window=o.window, pattern=o.pattern,
                       gradient_checkpointing=o.gradient_checkpointing, attention_kernel=o.attention_kernel,
                       head_init=o.head_init, head=o.head, frozen_layers=o.frozen_layers,
                       attention_dropout=o.attention_dropout, query_weights=o.query_weights)
    task = QDSTask(model_config=config, name=name, head_lr_multiplier=o.head_lr_multiplier)
    train_config = training_config(args, name, **SPEC.training.defaults)  # flag errors before the data
    td = training_data(args)  # prepares shards, BM25 and negatives when missing
    tokenisation = collection_tokenisation(config)
    if tokenisation is not None:  # a Ray task per corpus shard, cached in W/statistics
        task.collection_statistics = cached_corpus_statistics(args.workdir, tokenisation)
    if task.needs_warm_triples:
        task.warm_triples = probe_triples(td)
    return run_training(task, args, train_config, td)
