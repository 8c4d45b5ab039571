"""CK-QTI's stages: the training job's flags and training (``jobs/train_ck.py``), the impact index job
(``jobs/build_impact_index.py``)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import replace

from ckray.rankers.ck_qti import SPEC
from ckray.options import add_options
from ckray.rankers.ck_qti.options import CKQTIOptions, ImpactIndexOptions
from ckray.stages import add_actor_pool_args, print_json as report

log = logging.getLogger(__name__)


EXPLICIT_STATS_TRIPLES = 1024  # training triples sampled for E[TF] and E[|d|] (batch scaling's start)


def train(options: CKQTIOptions, args: argparse.Namespace):
    """CK-QTI (or the full CK with ``qti=False``, the TK baseline with ``attention="quadratic"``): corpus
    statistics for the explicit-matching term, then the shared loop → W/checkpoints/<name>; the
    training data and loop from ``args`` (a training job's flags)."""
    from ckray.rankers.ck_qti.corpus_statistics import cached_corpus_statistics
    from ckray.rankers.ck_qti.model import CKConfig, explicit_training_statistics, tk_config
    from ckray.rankers.ck_qti.task import CKTask, matched_lengths
    from ckray.train_job import run_training, training_config, training_data

    o = options
    base = tk_config() if o.attention == "quadratic" else CKConfig(qti=o.qti)
    config = replace(base, max_doc_len=o.max_doc_len, n_layers=o.layers, bm25_k1=o.bm25_k1, bm25_b=o.bm25_b,
                     exact_match=o.exact_match)
    name = o.checkpoint_name
    train_config = training_config(args, name, **SPEC.training.defaults)  # every flag checked before any work
    td = training_data(args)  # prepares shards, BM25 and negatives when missing
    classes = None
    if config.exact_match == "stems":
        from ckray.lexical.analysis import stem_classes
        from ckray.ray_env import init_ray

        init_ray()   # Ray before the JVM that stems the vocabulary (ckray.lexical.jvm)
        classes = stem_classes(config.encoder)
    stats = cached_corpus_statistics(args.workdir, config, classes)  # a Ray task per shard; kept for the impact index
    sample = td.head(EXPLICIT_STATS_TRIPLES).to_pydict()  # the first triples of the seeded shuffle
    keep = matched_lengths(sample["pos_text"], sample["neg_text"], config) if o.match_pair_lengths else None
    mean_tf, mean_len = explicit_training_statistics(sample["query"] * 2, sample["pos_text"] + sample["neg_text"], config,
                                                     keep=keep, classes=classes)
    log.info("explicit match starts as BM25(k1=%.2f, b=%.2f) under E[TF]=%.2f, E[|d|]=%.0f (avgdl %.0f)",
             config.bm25_k1, config.bm25_b, mean_tf, mean_len, stats.mean_doc_len)
    task = CKTask(config=config, match_class=classes, doc_freq=stats.doc_freq.numpy(), n_docs=stats.n_docs,
                  mean_doc_len=stats.mean_doc_len, train_mean_tf=mean_tf, train_mean_len=mean_len,
                  name=name, head_lr_multiplier=o.head_lr_multiplier, dev_scoring=o.dev_scoring,
                  train_top_k=o.train_top_k, gate_temperature=o.gate_temperature,
                  match_pair_lengths=o.match_pair_lengths)
    result = run_training(task, args, train_config, td=td)
    record_training_corpus(result.best_checkpoint, stats, args.workdir)
    return result


def record_training_corpus(checkpoint, stats, workdir) -> None:
    """Save the training corpus's N and mean length with the checkpoint (``ckray.deploy``, ``corpus``):
    an index of another corpus normalises lengths by its own mean relative to this one
    (``ckray.rankers.ck_qti.corpus_statistics.corpus_adaptation``)."""
    from pathlib import Path

    from ckray.deploy import save_deploy_setting

    if (Path(checkpoint) / "model.safetensors").exists():
        save_deploy_setting(checkpoint, "corpus", {"n_docs": stats.n_docs, "mean_doc_len": stats.mean_doc_len,
                                                   "workdir": str(Path(workdir).resolve())})


def add_index_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``jobs/build_impact_index.py``'s flags: :class:`ImpactIndexOptions` and the actor pool's."""
    return add_actor_pool_args(add_options(p, ImpactIndexOptions))


def build_index(args: argparse.Namespace) -> dict:
    """The CK-QTI impact index (W/impact/index); returns ``build_impact_index``'s summary."""
    from ckray.data.prepare import prepare_collection
    from ckray.rankers.ck_qti.impact import build_impact_index, default_checkpoint
    from ckray.rankers.ck_qti.impact_settings import ImpactConfig, check_ck_qti_checkpoint, deployed_impact_settings

    checkpoint = args.checkpoint or str(default_checkpoint(args.workdir))
    check_ck_qti_checkpoint(checkpoint)  # a clear error before any work
    top_k, explicit_weight, source = deployed_impact_settings(checkpoint, args.top_k, args.explicit_weight)
    config = ImpactConfig(top_k=top_k, explicit_weight=explicit_weight,
                          expansion_candidates=args.expansion_candidates, expansion_ratio=args.expansion_ratio,
                          candidate_pool=args.candidate_pool, quant_max=args.quant_max, scale=args.scale,
                          actors=args.actors, use_gpu=args.use_gpu, cpus_per_actor=args.cpus_per_actor,
                          resources_per_actor=args.resources_per_actor,
                          batch_size=args.batch_size, token_budget=args.token_budget,
                          index_threads=args.index_threads, passages=args.passages,
                          explicit_scope=args.explicit_scope, window_pieces=args.window_pieces)
    config.validate()
    if getattr(args, "save_settings", False):
        from ckray.deploy import save_deploy_setting

        save_deploy_setting(checkpoint, "impact", {"top_k": top_k, "explicit_weight": explicit_weight,
                                                   "tuned_on": {"data": str(args.data)}})
    prepare_collection(args.data, args.workdir, split=None, bm25=False)  # shards, when there are none yet
    return build_impact_index(args.workdir, checkpoint, config, settings_source=source)
