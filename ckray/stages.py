"""The stages the jobs and the main pipeline share: training each model, building each index.

Each function takes the ``argparse.Namespace`` of its job's parser, so ``jobs/train_*.py`` and
``jobs/build_*_index.py`` are these functions behind a command line, and ``ckray.full_pipeline``
runs exactly the same code with a namespace parsed from a few flags (``parse_stage_args``)::

    args = parse_stage_args("cedr-knrm", ["--data", D, "--workdir", W, "--max-steps", "20"])
    result = MODELS["cedr-knrm"].train(args)          # == python jobs/train_cedr.py --data D ...

Every stage skips finished work: a training run already at ``--max-steps`` is not started again
(``ckray.train.fit``), finished impact / embedding shards and an up-to-date index are kept.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from ckray.errors import ConfigError

log = logging.getLogger(__name__)

# Each model's own training-loop settings (TrainConfig fields), where the job's flag is not given:
# passed to ckray.train_job.run_training and shown in the job's --help.
CK_TRAIN_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "max_steps": 1000, "eval_every": 200, "batch_size": 16}
CLEAR_TRAIN_DEFAULTS: dict[str, Any] = {"lr": 2e-5, "max_steps": 500, "eval_every": 100, "batch_size": 8,
                                        "warmup_steps": 20}
CROSS_ENCODER_TRAIN_DEFAULTS: dict[str, Any] = {**CLEAR_TRAIN_DEFAULTS, "batch_size": 4}  # CEDR, QDS-Transformer


# --------------------------------------------------------------------------- models: CK-QTI


def add_ck_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ckray.models.ck import CKConfig

    g = p.add_argument_group("model (ckray.models.ck)")
    g.add_argument("--qti", action=argparse.BooleanOptionalAction, default=True,
                   help="query term independence (CK-QTI); --no-qti: the paper's full CK (query contextualised)")
    g.add_argument("--attention", choices=("separable", "quadratic"), default="separable",
                   help="quadratic = the TK baseline")
    g.add_argument("--max-doc-len", type=int, default=4000, help="document word pieces (not cut at 512)")
    g.add_argument("--layers", type=int, default=2, help="Conformer blocks")
    g.add_argument("--bm25-k1", type=float, default=CKConfig.bm25_k1, help="the explicit match starts as BM25(k1, b)")
    g.add_argument("--bm25-b", type=float, default=CKConfig.bm25_b, help="b of that BM25 start")
    g.add_argument("--name", default=None, help="checkpoint name under W/checkpoints (default: ck-qti; ck with "
                   "--no-qti, tk with --attention quadratic)")
    g.add_argument("--head-lr-multiplier", type=float, default=1.0,
                   help="train everything but the pretrained word embeddings this many times faster")
    g.add_argument("--dev-scoring", choices=("impacts", "dense"), default="impacts",
                   help="CK-QTI checkpoints are picked on dev by Σ of each document's top-k term impacts (as "
                   "the impact index and ck-qti-rerank score; 100 SciFact dev queries × 50 candidates took "
                   "174–211 s per validation on 2 CPU cores) or by the model's dense Σ over all query terms")
    g.add_argument("--train-top-k", type=int, default=0,
                   help="train as the impact index deploys: a query term counts only as far as it is among the "
                   "document's top k terms (a sigmoid gate at the k-th best own term's s_td); 0 = off")
    g.add_argument("--gate-temperature", type=float, default=0.1,
                   help="the gate's width as a fraction of the document's threshold s_td (with --train-top-k)")
    return p


EXPLICIT_STATS_TRIPLES = 1024  # training triples sampled for E[TF] and E[|d|] (batch scaling's start)


def train_ck(args: argparse.Namespace):
    """CK-QTI (or the full CK with ``--no-qti``, the TK baseline with ``--attention quadratic``):
    corpus statistics for the explicit-matching term, then the shared loop → W/checkpoints/<name>."""
    from ckray.data.collections import doc_text
    from ckray.data.shards import load_corpus_table
    from ckray.models.ck import CKConfig, corpus_statistics, explicit_training_statistics, tk_config
    from ckray.tasks import CKTask
    from ckray.train_job import run_training, training_config, training_data

    base = tk_config() if args.attention == "quadratic" else CKConfig(qti=args.qti)
    config = replace(base, max_doc_len=args.max_doc_len, n_layers=args.layers, bm25_k1=args.bm25_k1, bm25_b=args.bm25_b)
    name = args.name or ("tk" if args.attention == "quadratic" else "ck-qti" if args.qti else "ck")
    train_config = training_config(args, name, **CK_TRAIN_DEFAULTS)  # every flag checked before any work
    td = training_data(args)  # prepares shards, BM25 and negatives when missing
    corpus = load_corpus_table(args.workdir)
    stats = corpus_statistics((doc_text(t, x) for t, x in zip(corpus["title"].to_pylist(), corpus["text"].to_pylist())),
                              config)
    sample = td.triples.slice(0, EXPLICIT_STATS_TRIPLES).to_pydict()  # the triples are shuffled
    mean_tf, mean_len = explicit_training_statistics(sample["query"] * 2, sample["pos_text"] + sample["neg_text"], config)
    log.info("explicit match starts as BM25(k1=%.2f, b=%.2f) under E[TF]=%.2f, E[|d|]=%.0f (avgdl %.0f)",
             config.bm25_k1, config.bm25_b, mean_tf, mean_len, stats.mean_doc_len)
    task = CKTask(config=config, doc_freq=stats.doc_freq.numpy(), n_docs=stats.n_docs,
                  mean_doc_len=stats.mean_doc_len, train_mean_tf=mean_tf, train_mean_len=mean_len,
                  name=name, head_lr_multiplier=args.head_lr_multiplier, dev_scoring=args.dev_scoring,
                  train_top_k=args.train_top_k, gate_temperature=args.gate_temperature)
    return run_training(task, args, train_config, td=td)


# --------------------------------------------------------------------------- models: CLEAR


def add_clear_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ckray.models.encoders import DEFAULT_ENCODER

    g = p.add_argument_group("model (ckray.models.clear)")
    g.add_argument("--encoder", default=DEFAULT_ENCODER, help="Hugging Face id or directory of a BERT encoder")
    g.add_argument("--doc-max-len", type=int, default=256, help="document word pieces the encoder reads")
    g.add_argument("--xi", type=float, default=0.2, help="ξ, the margin before the lexical residual")
    g.add_argument("--lambda-train", type=float, default=0.05, help="λ_train, weight of the BM25 gap in the margin")
    g.add_argument("--constant-margin", action="store_true", help="ablation: m = ξ (no lexical residual)")
    g.add_argument("--name", default=None,
                   help="checkpoint name under W/checkpoints (default: clear; clear-constant with --constant-margin)")
    return p


def train_clear(args: argparse.Namespace):
    """CLEAR (BM25-residual margin) → W/checkpoints/clear (clear-constant with --constant-margin)."""
    from ckray.models.clear import CLEARConfig, CLEARLossConfig, CLEARTask
    from ckray.train_job import run_training, training_config

    name = args.name or ("clear-constant" if args.constant_margin else "clear")
    task = CLEARTask(model_config=CLEARConfig(encoder=args.encoder, doc_max_len=args.doc_max_len),
                     loss_config=CLEARLossConfig(xi=args.xi, lambda_train=args.lambda_train,
                                                 constant_margin=args.constant_margin), name=name)
    return run_training(task, args, training_config(args, name, **CLEAR_TRAIN_DEFAULTS))


# --------------------------------------------------------------------------- models: CEDR


def add_cedr_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ckray.models.encoders import DEFAULT_ENCODER

    g = p.add_argument_group("model (ckray.models.cedr)")
    g.add_argument("--variant", choices=("knrm", "pacrr", "drmm", "vanilla"), default="knrm",
                   help="the interaction ranker over the encoder's per-layer similarity matrices, joined with "
                        "[CLS] (vanilla: BERT's [CLS] → linear alone)")
    g.add_argument("--encoder", default=DEFAULT_ENCODER, help="Hugging Face id or directory of a BERT encoder")
    g.add_argument("--num-layers", type=int, default=None,
                   help="use only the first L encoder layers (default: all of them)")
    g.add_argument("--max-length", type=int, default=512, help="tokens per (query, segment) input")
    g.add_argument("--max-segments", type=int, default=4, help="segments per long document")
    return p


def train_cedr(args: argparse.Namespace):
    """A CEDR reranker (or vanilla BERT) → W/checkpoints/cedr-<variant> (vanilla-bert)."""
    from ckray.models.cedr import CEDRConfig, CEDRTask
    from ckray.train_job import run_training, training_config

    config = CEDRConfig(variant=args.variant, encoder=args.encoder, num_layers=args.num_layers,
                        max_length=args.max_length, max_segments=args.max_segments)
    task = CEDRTask(model_config=config)
    return run_training(task, args, training_config(args, task.name, **CROSS_ENCODER_TRAIN_DEFAULTS))


# --------------------------------------------------------------------------- models: QDS-Transformer


def add_qds_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ckray.models.encoders import DEFAULT_ENCODER

    g = p.add_argument_group("model (ckray.models.qds)")
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


def train_qds(args: argparse.Namespace):
    """The QDS-Transformer cross-encoder → W/checkpoints/qds (qds-<pattern> for the ablations)."""
    from ckray.models.qds import QDSConfig, QDSTask
    from ckray.train_job import run_training, training_config

    name = "qds" if args.pattern == "qds" else f"qds-{args.pattern}"
    config = QDSConfig(encoder=args.encoder, max_length=args.max_length, window=args.window, pattern=args.pattern,
                       gradient_checkpointing=args.gradient_checkpointing)
    task = QDSTask(model_config=config, name=name, head_lr_multiplier=args.head_lr_multiplier)
    return run_training(task, args, training_config(args, name, **CROSS_ENCODER_TRAIN_DEFAULTS))


@dataclass(frozen=True)
class ModelStage:
    """One trainable model: its job's flags, its training function (returns a TrainResult) and the
    training-loop defaults that function uses (shown in the job's --help)."""

    name: str                                                          # default checkpoint name
    add_args: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
    train: Callable[[argparse.Namespace], object]
    job: str                                                           # its command-line job
    train_defaults: dict[str, Any]


MODELS: dict[str, ModelStage] = {
    "ck-qti": ModelStage("ck-qti", add_ck_args, train_ck, "jobs/train_ck.py", CK_TRAIN_DEFAULTS),
    "clear": ModelStage("clear", add_clear_args, train_clear, "jobs/train_clear.py", CLEAR_TRAIN_DEFAULTS),
    "cedr-knrm": ModelStage("cedr-knrm", add_cedr_args, train_cedr, "jobs/train_cedr.py",
                            CROSS_ENCODER_TRAIN_DEFAULTS),
    "qds": ModelStage("qds", add_qds_args, train_qds, "jobs/train_qds.py", CROSS_ENCODER_TRAIN_DEFAULTS),
}


def model_parser(name: str, description: str | None = None) -> argparse.ArgumentParser:
    """The full flag set of a model's training job: common flags, training data, loop, model."""
    from ckray.train_job import training_parser

    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    model = MODELS[name]
    return model.add_args(training_parser(description or f"train {name}", model.train_defaults))


def check_training_flags(model: str, args: argparse.Namespace) -> None:
    """Refuse ``model``'s invalid training-loop flags (naming the flag) without doing anything: what its
    training stage checks first, for a caller that runs the stage later (the main job, before Ray)."""
    from ckray.train_job import training_config, training_data_config

    training_data_config(args)
    training_config(args, MODELS[model].name, **MODELS[model].train_defaults)


# --------------------------------------------------------------------------- indexes


def add_actor_pool_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The Ray Data actor pool of an index job (impact scoring, dense embedding)."""
    p.add_argument("--actors", type=int, default=1, help="actor pool size (one model copy each)")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per actor")
    p.add_argument("--cpus-per-actor", type=float, default=1.0, help="CPUs (and torch threads) per actor")
    return p


# --------------------------------------------------------------------------- indexes: CK-QTI impact


def add_impact_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ckray.index.impact import ImpactConfig

    p.add_argument("--checkpoint", default=None, help="CK-QTI checkpoint directory (default: W/checkpoints/ck-qti)")
    p.add_argument("--top-k", type=int, default=ImpactConfig.top_k, help="terms kept per document")
    p.add_argument("--explicit-weight", type=float, default=ImpactConfig.explicit_weight,
                   help="β: store s_td + β·(the model's exact-match score, Eq. 9) per term; choose it on held-out "
                   "training queries with bench/impact_topk.py --explicit-weights")
    p.add_argument("--expansion-candidates", type=int, default=256,
                   help="vocabulary terms added to a document's own terms as candidates")
    p.add_argument("--candidate-pool", choices=("window", "position"), default="window",
                   help="how expansion candidates are chosen (window: cheap; position: GPU)")
    p.add_argument("--quant-max", type=int, default=255, help="integer the largest weight maps to")
    p.add_argument("--scale", type=float, default=None,
                   help="fixed quantisation scale, overriding --quant-max (default: from --quant-max)")
    add_actor_pool_args(p)
    p.add_argument("--batch-size", type=int, default=64, help="documents per Ray Data batch")
    p.add_argument("--token-budget", type=int, default=8192, help="padded word pieces per forward pass")
    p.add_argument("--index-threads", type=int, default=2, help="Lucene indexing threads")
    return p


def build_impact(args: argparse.Namespace) -> dict:
    """The CK-QTI impact index (W/impact/index); returns ``build_impact_index``'s summary."""
    from ckray.data.prepare import prepare_collection
    from ckray.index.impact import ImpactConfig, _check_checkpoint, build_impact_index, default_checkpoint

    checkpoint = args.checkpoint or str(default_checkpoint(args.workdir))
    _check_checkpoint(checkpoint)  # a clear error before any work
    config = ImpactConfig(top_k=args.top_k, explicit_weight=args.explicit_weight,
                          expansion_candidates=args.expansion_candidates,
                          candidate_pool=args.candidate_pool, quant_max=args.quant_max, scale=args.scale,
                          actors=args.actors, use_gpu=args.use_gpu, cpus_per_actor=args.cpus_per_actor,
                          batch_size=args.batch_size, token_budget=args.token_budget,
                          index_threads=args.index_threads)
    config.validate()
    prepare_collection(args.data, args.workdir, split=None, bm25=False)  # shards, when there are none yet
    return build_impact_index(args.workdir, checkpoint, config)


# --------------------------------------------------------------------------- indexes: CLEAR dense + hybrid


def add_dense_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--checkpoint", default=None, help="CLEAR checkpoint (default: W/checkpoints/clear)")
    add_actor_pool_args(p)
    p.add_argument("--float16", action="store_true", help="store embedding shards as float16")
    p.add_argument("--doc-max-len", type=int, default=None,
                   help="encode documents at this many word pieces (default: the checkpoint's doc_max_len)")
    p.add_argument("--index", choices=("flat", "hnsw", "ivf", "ivfpq"), default="flat",
                   help="faiss index kind (flat: exact inner product)")
    p.add_argument("--tune-split", default="train", help="qrels split whose queries tune λ_test (never test)")
    p.add_argument("--tune-queries", choices=("held-out", "all"), default="held-out",
                   help="tune λ_test on the held-out dev queries of --tune-split (those CLEAR did not train on) "
                        "or on all of them (fine for an untrained encoder)")
    return p


def build_dense(args: argparse.Namespace) -> dict:
    """Embed the corpus with a CLEAR checkpoint, build W/dense/index and tune the hybrid λ_test on
    the ``--tune-split`` queries (W/dense/hybrid.json). Returns the embedding job's summary plus
    ``lambda`` (None when the collection has no such split)."""
    from ckray.data.collections import read_queries_and_qrels
    from ckray.index.dense import EmbedConfig, IndexConfig, build_dense_index, tune_hybrid
    from ckray.ray_env import init_ray

    checkpoint = args.checkpoint or str(Path(args.workdir) / "checkpoints" / "clear")
    embed = EmbedConfig(actors=args.actors, use_gpu=args.use_gpu, float16=args.float16,
                        cpus_per_actor=args.cpus_per_actor, doc_max_len=args.doc_max_len)
    embed.validate()  # the flags are checked before Ray starts
    init_ray()
    _, summary = build_dense_index(args.workdir, checkpoint, embed, IndexConfig(kind=args.index))
    summary = dict(summary, **{"lambda": None})
    queries, qrels = read_queries_and_qrels(Path(args.data))
    if args.tune_split in qrels:
        if getattr(args, "tune_queries", "held-out") == "held-out":
            from ckray.fusion import dev_queries

            split_q, tune_qrels = dev_queries(queries, qrels, split=args.tune_split)
        else:
            split_q = {q: queries[q] for q in qrels[args.tune_split] if q in queries}
            tune_qrels = qrels[args.tune_split]
        config = tune_hybrid(args.workdir, split_q, tune_qrels, checkpoint)
        summary.update({"lambda": config.lam, "tune_queries": len(split_q), "tune_split": args.tune_split})
    return summary


def print_dense_summary(summary: dict) -> None:
    """What ``jobs/build_dense_index.py`` prints: the embedding job's summary, then λ_test if tuned."""
    summary = dict(summary)
    lam = summary.pop("lambda")
    tuned = {k: summary.pop(k) for k in ("tune_queries", "tune_split") if k in summary}
    print(f"embedding job: {summary}")
    if lam is not None:
        print(f"λ_test = {lam} (tuned on {tuned['tune_queries']} {tuned['tune_split']} queries)")


def print_json(summary: dict) -> None:
    """Print a job's summary as one line of JSON."""
    import json

    print(json.dumps(summary, sort_keys=True))


@dataclass(frozen=True)
class IndexStage:
    """One model's index: its job's flags, the build function (returns a summary) and how the job
    prints that summary."""

    add_args: Callable[[argparse.ArgumentParser], argparse.ArgumentParser]
    build: Callable[[argparse.Namespace], dict]
    report: Callable[[dict], None]


INDEXES: dict[str, IndexStage] = {
    "ck-qti": IndexStage(add_impact_args, build_impact, print_json),
    "clear": IndexStage(add_dense_args, build_dense, print_dense_summary),
}


# --------------------------------------------------------------------------- stages as jobs


def stage_parser(stage: str, description: str | None = None) -> argparse.ArgumentParser:
    """The parser of a stage's job: ``"train:<model>"`` (a :data:`MODELS` key) or ``"index:<model>"``
    (an :data:`INDEXES` key). ``description``: the job's help text."""
    from ckray.cli import base_parser

    kind, _, model = stage.partition(":")
    if kind == "train":
        return model_parser(model, description)
    if kind == "index" and model in INDEXES:
        return INDEXES[model].add_args(base_parser(description or f"{model} index"))
    raise ConfigError(f"unknown stage {stage!r}")


def parse_stage_args(stage: str, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv`` with a stage's job parser (see :func:`stage_parser`); unset flags get the job's
    defaults."""
    return stage_parser(stage).parse_args(argv)


def run_stage(stage: str, args: argparse.Namespace) -> Any:
    """Run a stage on its parsed flags: a training stage returns its TrainResult (and prints one line
    itself), an index stage prints its summary the way its job does and returns it."""
    kind, _, model = stage.partition(":")
    if kind == "train":
        return MODELS[model].train(args)
    index = INDEXES[model]
    summary = index.build(args)
    index.report(summary)
    return summary


def main_for(stage: str, description: str | None = None, argv: list[str] | None = None) -> None:
    """The whole of a stage's job script (``jobs/train_*.py``, ``jobs/build_*_index.py``): parse
    ``argv`` (default: the command line) with :func:`stage_parser`, then :func:`run_stage` under
    :func:`ckray.cli.run_job` (logging, ``--address``, a CkrayError ends the job with exit code 2).
    Exits the process."""
    from ckray.cli import run_job

    def main(args: argparse.Namespace) -> None:
        run_stage(stage, args)  # its result is not an exit code

    run_job(main, stage_parser(stage, description), argv)
