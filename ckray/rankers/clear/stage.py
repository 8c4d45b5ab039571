"""CLEAR's stages: the training job's flags and training (``jobs/train_clear.py``), the dense index and
hybrid λ job (``jobs/build_dense_index.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ckray.fusion import DEFAULT_LAMBDA_RULE
from ckray.rankers.clear import SPEC
from ckray.options import add_options
from ckray.rankers.clear.options import CLEAROptions, DenseIndexOptions
from ckray.stages import add_actor_pool_args


def train(options: CLEAROptions, args: argparse.Namespace):
    """CLEAR (BM25-residual margin) → W/checkpoints/clear (clear-constant with ``constant_margin``); the
    training data and loop from ``args`` (a training job's flags)."""
    from ckray.rankers.clear.model import CLEARConfig, CLEARLossConfig
    from ckray.rankers.clear.task import CLEARTask
    from ckray.train_job import run_training, training_config, training_data_config

    o, name = options, options.checkpoint_name
    lambda_train = o.lambda_train_for(training_data_config(args).bm25_scale)
    task = CLEARTask(model_config=CLEARConfig(encoder=o.encoder, doc_max_len=o.doc_max_len),
                     loss_config=CLEARLossConfig(xi=o.xi, lambda_train=lambda_train,
                                                 constant_margin=o.constant_margin), name=name)
    return run_training(task, args, training_config(args, name, **SPEC.training.defaults))


def add_index_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``jobs/build_dense_index.py``'s flags: :class:`DenseIndexOptions` and the actor pool's."""
    return add_actor_pool_args(add_options(p, DenseIndexOptions))


def build_index(args: argparse.Namespace) -> dict:
    """Embed the corpus with a CLEAR checkpoint, build W/dense/index and tune the hybrid λ_test on
    the ``--tune-split`` queries (W/dense/hybrid.json). Returns the embedding job's summary plus
    ``lambda`` (without such a split: the λ saved with the checkpoint, ``ckray.deploy``; None when none)."""
    from ckray.data.collections import read_queries_and_qrels
    from ckray.rankers.clear.embed import EmbedConfig
    from ckray.rankers.clear.faiss_index import IndexConfig, build_dense_index
    from ckray.rankers.clear.hybrid import HybridConfig, carry_hybrid, trained_normalization, tune_hybrid
    from ckray.rankers.clear.layout import default_checkpoint
    from ckray.ray_env import init_ray

    checkpoint = args.checkpoint or str(default_checkpoint(args.workdir))
    embed = EmbedConfig(actors=args.actors, use_gpu=args.use_gpu, float16=args.float16,
                        cpus_per_actor=args.cpus_per_actor, doc_max_len=args.doc_max_len,
                        passages=args.passages, resources_per_actor=args.resources_per_actor)
    embed.validate()  # the flags are checked before Ray starts
    init_ray()
    # the built index is dropped here: tuning loads it from W/dense/index, as evaluation and Serve do (one copy)
    summary = build_dense_index(args.workdir, checkpoint, embed, IndexConfig(kind=args.index))[1]
    summary = dict(summary, **{"lambda": None})
    queries, qrels = read_queries_and_qrels(Path(args.data))
    if args.tune_split in qrels:
        if getattr(args, "tune_queries", "held-out") == "held-out":
            from ckray.fusion import dev_queries

            split_q, tune_qrels = dev_queries(queries, qrels, split=args.tune_split)
        else:
            split_q = {q: queries[q] for q in qrels[args.tune_split] if q in queries}
            tune_qrels = qrels[args.tune_split]
        normalization = getattr(args, "hybrid_normalization", None) or trained_normalization(checkpoint)
        config = tune_hybrid(args.workdir, split_q, tune_qrels, checkpoint,
                             HybridConfig(normalization=normalization,
                                          rule=getattr(args, "lambda_rule", DEFAULT_LAMBDA_RULE)))
        summary.update({"lambda": config.lam, "normalization": config.normalization, "rule": config.rule,
                        "tune_queries": len(split_q), "tune_split": args.tune_split})
    else:  # no training queries here: the λ tuned where the model was trained, when saved with it
        config = carry_hybrid(args.workdir, checkpoint)
        if config is not None:
            summary.update({"lambda": config.lam, "normalization": config.normalization,
                            "lambda_source": config.source})
    return summary


def report(summary: dict) -> None:
    """What ``jobs/build_dense_index.py`` prints: the embedding job's summary, then λ_test if tuned."""
    summary = dict(summary)
    lam = summary.pop("lambda")
    tuned = {k: summary.pop(k) for k in ("tune_queries", "tune_split", "lambda_source") if k in summary}
    normalization = summary.pop("normalization", "none")
    rule = summary.pop("rule", DEFAULT_LAMBDA_RULE)
    scores = "on raw scores" if normalization == "none" else f"on {normalization}-normalised scores"
    print(f"embedding job: {summary}")
    if lam is not None and "lambda_source" in tuned:
        print(f"λ_test = {lam} {scores} (no training queries here: carried from {tuned['lambda_source']})")
    elif lam is not None:
        print(f"λ_test = {lam} {scores} (tuned on {tuned['tune_queries']} {tuned['tune_split']} queries, "
              f"rule {rule})")
