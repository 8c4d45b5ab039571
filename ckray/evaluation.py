"""Evaluate named pipelines on a split: run files, metrics JSON, per-query JSON, a table."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ckray.data.collections import judged_queries, read_queries_and_qrels, write_trec_run
from ckray.data.shards import write_json_atomic
from ckray.errors import ConfigError
from ckray.fusion import DEFAULT_WEIGHT_RULE, HYBRID_NORMALIZATIONS, WEIGHT_RULES, check_weight_rule
from ckray.options import option
from ckray.rerank import DEFAULT_RERANK_PASSAGES
from ckray.windows import DEFAULT_WINDOW_CHOICE, WINDOW_CHOICES, check_window_choice
from ckray.workdir import WorkDir
from ckray.eval import DEFAULT_MEASURES, evaluate, per_query

log = logging.getLogger(__name__)


@dataclass
class EvaluateConfig:
    data: str
    workdir: str
    pipelines: list[str] = option(help="pipeline name (repeatable), e.g. bm25, clear, bm25>cedr-knrm, "
                                       "clear+cedr-knrm (default: bm25)", flag="--pipeline", metavar="PIPELINE",
                                  repeatable=True, default_factory=lambda: ["bm25"])
    split: str = option("test", "qrels split whose queries are evaluated")
    k: int = option(1000, "results kept per query")
    rerank_depth: int = option(100, "first-stage results a reranker rescores")
    measures: tuple[str, ...] = DEFAULT_MEASURES
    lam: float | None = option(None, "CLEAR's λ_test (default: W/dense/hybrid.json: tuned on training queries, or "
                                     "carried from the checkpoint's deploy.json)", flag="--lambda")
    hybrid_normalization: str | None = option(None, "scores CLEAR's λ_test applies to: tmm or none (default: "
                                                    "W/dense/hybrid.json's; another one needs --lambda)",
                                              choices=HYBRID_NORMALIZATIONS)
    fusion_weight: float | None = option(None, "w of every first+reranker (default: tuned on the dev training "
                                               "queries, or, on a collection without them, the one saved in the "
                                               "reranker checkpoint's deploy.json)")
    rerank_passages: int = option(DEFAULT_RERANK_PASSAGES, "windows of a long document a cross-encoder reranker reads, "
                                  "each as many word pieces as one of its inputs holds, the document scoring as "
                                  "its best window: 0 every one, 1 the first (cut as in training), N of them "
                                  "(--rerank-window-choice)")
    rerank_window_choice: str = option(DEFAULT_WINDOW_CHOICE, "which N windows of a longer document a cross-encoder "
                                       "reads: query (those matching the query best, by BM25's tf and the "
                                       "collection's IDF over word pieces) or first", choices=WINDOW_CHOICES)
    weight_rule: str = option(DEFAULT_WEIGHT_RULE, "how w is chosen from the dev queries' grid: one-se (the largest "
                                                 "w within one standard error of the best: leans on the first "
                                                 "stage, which transfers) or best (the argmax)", choices=WEIGHT_RULES)

    @property
    def reranker_options(self) -> dict:
        """How a cross-encoder reads a long candidate (``ckray.pipelines.build_reranker``)."""
        return {"passages": self.rerank_passages, "window_choice": self.rerank_window_choice}

    def __post_init__(self) -> None:
        for name in ("k", "rerank_depth"):
            if getattr(self, name) < 1:
                raise ConfigError.invalid("EvaluateConfig", name, f"must be >= 1, got {getattr(self, name)}")
        if self.rerank_passages < 0:
            raise ConfigError.invalid("EvaluateConfig", "rerank_passages",
                                      f"must be >= 0 (0: every window), got {self.rerank_passages}")
        check_window_choice("EvaluateConfig", self.rerank_window_choice, "rerank_window_choice")
        if not self.pipelines:
            raise ConfigError.invalid("EvaluateConfig", "pipelines", "must name at least one pipeline")
        check_weight_rule("EvaluateConfig", self.weight_rule)


def run_path(workdir, pipeline: str, split: str) -> Path:
    return WorkDir(workdir).run(pipeline, split)


def metrics_path(workdir, pipeline: str, split: str) -> Path:
    return WorkDir(workdir).metrics(pipeline, split)


def interpolation_stamps(workdir: str | os.PathLike, first: str, reranker: str,
                         passages: int = DEFAULT_RERANK_PASSAGES,
                         window_choice: str = DEFAULT_WINDOW_CHOICE) -> dict[str, str | int]:
    """What a tuned ``first+reranker`` weight depends on besides the depth: the reranker checkpoint
    (``checkpoint_digest``), the first stage's index (``first_stage_digest``) and the windows of a long
    document the reranker reads (``reranker_passages``, ``reranker_window_choice``)."""
    from ckray.models.checkpoint import checkpoint_digest
    from ckray.pipelines import checkpoint_dir, first_stage_digest, reranker_passages, reranker_window_choice

    return {"checkpoint_stamp": checkpoint_digest(checkpoint_dir(workdir, reranker)),
            "first_stage_stamp": first_stage_digest(workdir, first),
            "reranker_passages": reranker_passages(reranker, passages),
            "reranker_window_choice": reranker_window_choice(reranker, passages, window_choice)}


def tune_interpolation(workdir: str, pipeline: str, queries: dict[str, str], qrels: dict, rerank_depth: int,
                       train_split: str = "train", rule: str | None = None,
                       rerank_passages: int = DEFAULT_RERANK_PASSAGES,
                       window_choice: str = DEFAULT_WINDOW_CHOICE):
    """Tune w of a ``first+reranker`` pipeline on the dev split of the *training* queries (the ones the
    reranker validated on, never test queries) and save it to ``W/fusion`` (``ckray.fusion``)."""
    from ckray.fusion import dev_queries, save_interpolation, tune_weight
    from ckray.pipelines import build_pipeline, parse_pipeline

    first, reranker = parse_pipeline(pipeline)
    dev_q, dev_qrels = dev_queries(queries, qrels, split=train_split)
    if not dev_q:
        raise ConfigError(f"{pipeline}: no dev queries in the {train_split!r} split to tune the interpolation on")
    log.info("%s: tuning the interpolation weight on %d dev (training) queries at depth %d",
             pipeline, len(dev_q), rerank_depth)
    pipe = build_pipeline(f"{first}>{reranker}", workdir, rerank_depth=rerank_depth,
                          reranker_options={"passages": rerank_passages, "window_choice": window_choice})
    first_run = pipe.retriever.search(dev_q, k=rerank_depth)
    reranked = pipe.reranker.rerank(dev_q, first_run, depth=rerank_depth)
    config = dataclasses.replace(tune_weight(first_run, reranked, dev_qrels, rerank_depth,
                                             rule=rule or DEFAULT_WEIGHT_RULE),
                                 **interpolation_stamps(workdir, first, reranker, rerank_passages, window_choice))
    save_interpolation(workdir, first, reranker, config)
    save_with_checkpoint(workdir, first, reranker, config)
    return config


def save_with_checkpoint(workdir: str, first: str, reranker: str, config) -> None:
    """Save a ``w`` tuned in ``workdir`` with the reranker's checkpoint (``ckray.deploy``), for
    collections without training queries."""
    from ckray.deploy import save_fusion_weight
    from ckray.pipelines import checkpoint_dir, first_stage_models

    save_fusion_weight(checkpoint_dir(workdir, reranker), first, {
        "weight": config.weight, "depth": config.depth, "rule": config.rule,
        "reranker_passages": config.reranker_passages, "reranker_window_choice": config.reranker_window_choice,
        "first_stage_models": first_stage_models(workdir, first),
        "tuned_on": {"workdir": str(Path(workdir).resolve()), "dev_queries": config.dev_queries}})


def carry_interpolation(workdir: str, first: str, reranker: str, rerank_depth: int,
                        rerank_passages: int = DEFAULT_RERANK_PASSAGES, window_choice: str = DEFAULT_WINDOW_CHOICE):
    """For a collection with no training queries: the ``w`` saved with the reranker's checkpoint for
    this first stage (``ckray.deploy``), written to ``W/fusion`` with its ``source`` and this work
    directory's stamps. A MissingArtifactError when none was saved; a ConfigError when the saved ones
    were tuned over other first stages, or over another model of this first stage (another CLEAR or
    CK-QTI checkpoint than the one this collection's index was built with)."""
    from ckray.deploy import carried_fusion_weight, deploy_path, source_of
    from ckray.errors import MissingArtifactError
    from ckray.fusion import InterpolationConfig, save_interpolation
    from ckray.pipelines import checkpoint_dir, first_stage_files, first_stage_models

    checkpoint = checkpoint_dir(workdir, reranker)
    carried = carried_fusion_weight(checkpoint, first)
    if carried is None:
        raise MissingArtifactError(
            f"{first}+{reranker}: this collection has no training queries to tune w on, and {deploy_path(checkpoint)} "
            "holds no weight tuned where the model was trained; evaluate the pipeline on the training collection "
            "first (it saves w with the checkpoint), or pass --fusion-weight")
    tuned_over, here = carried.get("first_stage_models"), first_stage_models(workdir, first)
    if tuned_over is None:
        log.warning("%s+%s: %s does not say which %s model w was tuned over; used as is", first, reranker,
                    deploy_path(checkpoint), first)
    elif sorted(tuned_over) != here:
        raise ConfigError(
            f"{first}+{reranker}: the w in {deploy_path(checkpoint)} was tuned over the {first} model(s) "
            f"{', '.join(d[:12] for d in tuned_over) or 'none'}, but this collection's {first} index was built with "
            f"{', '.join(d[:12] for d in here) or 'none'} ({', '.join(map(str, first_stage_files(workdir, first)))}): "
            f"tune {first}+{reranker} again on the training collection with this {first} model, or pass --fusion-weight")
    if int(carried.get("depth", rerank_depth)) != rerank_depth:
        log.warning("%s+%s: w = %s was tuned at rerank depth %s, used here at %d", first, reranker,
                    carried["weight"], carried.get("depth"), rerank_depth)
    stamps = interpolation_stamps(workdir, first, reranker, rerank_passages, window_choice)
    tuned_with = (int(carried.get("reranker_passages", 1)), carried.get("reranker_window_choice", "first"))
    if tuned_with != (stamps["reranker_passages"], stamps["reranker_window_choice"]):
        log.warning("%s+%s: w = %s was tuned with the reranker reading %s window(s) of a long document (%s), used "
                    "here with %s (%s; 0: every one)", first, reranker, carried["weight"], *tuned_with,
                    stamps["reranker_passages"], stamps["reranker_window_choice"])
    config = InterpolationConfig(weight=float(carried["weight"]), depth=rerank_depth,
                                 table={}, source=source_of(checkpoint), rule=carried.get("rule", "best"),
                                 **stamps)
    save_interpolation(workdir, first, reranker, config)
    return config


def ensure_interpolation(workdir: str, pipeline: str, queries: dict[str, str], qrels: dict, rerank_depth: int,
                         train_split: str = "train", rule: str | None = None,
                         rerank_passages: int = DEFAULT_RERANK_PASSAGES,
                         window_choice: str = DEFAULT_WINDOW_CHOICE):
    """The weight of a ``first+reranker`` pipeline: the saved one when it was tuned (or carried) at this
    depth for this checkpoint on this first-stage index; otherwise tuned again on the dev split of
    ``train_split`` (``tune_interpolation``) or, when the collection has no such split, the one saved
    with the checkpoint (``carry_interpolation``). ``rule``: how a tuned ``w`` is chosen
    (``ckray.fusion.grid_search``; default ``DEFAULT_WEIGHT_RULE``); one chosen by another is tuned again,
    as is one tuned with the reranker reading other windows of long documents (``rerank_passages``,
    ``window_choice``)."""
    from ckray.fusion import fusion_path, load_interpolation
    from ckray.pipelines import parse_pipeline

    rule = rule or DEFAULT_WEIGHT_RULE
    first, reranker = parse_pipeline(pipeline)
    tuned = load_interpolation(workdir, first, reranker) if fusion_path(workdir, first, reranker).exists() else None
    stamps = interpolation_stamps(workdir, first, reranker, rerank_passages, window_choice)
    if (tuned is None or tuned.depth != rerank_depth or tuned.source   # a carried w is read again: it may have been re-tuned
            or (train_split in qrels and tuned.rule != rule)
            or any(getattr(tuned, field) != stamp for field, stamp in stamps.items())):
        if train_split in qrels:
            tuned = tune_interpolation(workdir, pipeline, queries, qrels, rerank_depth, train_split, rule,
                                       rerank_passages, window_choice)
        else:
            tuned = carry_interpolation(workdir, first, reranker, rerank_depth, rerank_passages, window_choice)
    elif not tuned.source:  # tuned here before checkpoints carried their settings: saved with it now
        from ckray.deploy import read_deploy
        from ckray.pipelines import checkpoint_dir

        if first not in (read_deploy(checkpoint_dir(workdir, reranker)).get("fusion") or {}):
            save_with_checkpoint(workdir, first, reranker, tuned)
    return tuned


def interpolation_setting(workdir: str, first: str, reranker: str, weight: float | None = None) -> dict:
    """The ``w`` a ``first+reranker`` evaluation used and where it came from (its settings record)."""
    from ckray.fusion import fusion_path, load_interpolation

    if weight is not None:
        return {"value": weight, "source": "flag"}
    tuned = load_interpolation(workdir, first, reranker)
    return {"value": tuned.weight, "depth": tuned.depth, "rule": tuned.rule,
            "source": tuned.source or f"tuned on {tuned.dev_queries} dev queries of this collection's training split",
            "file": str(fusion_path(workdir, first, reranker))}


def first_stage_options(first: str, n_queries: int, lam: float | None = None,
                        normalization: str | None = None) -> dict:
    """The first stage's options for ``n_queries`` queries: from ``POOL_MIN_QUERIES`` queries on, BM25
    searches on a pool of Ray actors, as many as the cluster's CPUs hold (``ckray.lexical.pool``; the
    run equals one searcher's); other first stages and fewer queries search in this process. ``lam``
    (``--lambda``) and ``normalization`` (``--hybrid-normalization``) go to a first stage whose factory
    takes them (CLEAR's hybrid)."""
    import inspect

    from ckray import rankers
    from ckray.lexical.pool import POOL_MIN_QUERIES

    options = {"actors": None} if first == "bm25" and n_queries >= POOL_MIN_QUERIES else {}
    accepted = inspect.signature(rankers.resolve(rankers.first_stages()[first].factory)).parameters
    for name, value in (("lam", lam), ("normalization", normalization)):
        if value is not None and name in accepted:
            options[name] = value
    return options


def pipeline_settings(pipe, config: EvaluateConfig) -> dict:
    """The deployment settings a pipeline ran with and where each came from: its first stage's and
    reranker's (their ``settings``: CLEAR's λ, CK-QTI's top-k and β) and, interpolated, its ``w``."""
    from ckray.pipelines import parse_pipeline

    settings = {**getattr(pipe.retriever, "settings", {}), **getattr(pipe.reranker, "settings", {})}
    if pipe.interpolation_weight is not None:
        first, reranker = parse_pipeline(pipe.name)
        settings["fusion_weight"] = interpolation_setting(config.workdir, first, reranker, config.fusion_weight)
    return settings


def settings_path(workdir, pipeline: str, split: str) -> Path:
    return metrics_path(workdir, pipeline, split).with_suffix(".settings.json")


def write_results(config: EvaluateConfig, name: str, run, qrels: dict, settings: dict | None = None) -> dict[str, float]:
    """Evaluate one pipeline's run on ``config.split`` and write its run file, metrics, per-query metrics
    and the deployment settings it ran with (``<pipeline>-<split>.settings.json``)."""
    metrics = evaluate(run, qrels, config.measures)
    write_trec_run(run, run_path(config.workdir, name, config.split), tag=name.replace(">", "_"))
    write_json_atomic(metrics, metrics_path(config.workdir, name, config.split))
    write_json_atomic(per_query(run, qrels, config.measures),
                      metrics_path(config.workdir, name, config.split).with_suffix(".per-query.json"))
    write_json_atomic({"pipeline": name, "split": config.split, "settings": settings or {}},
                      settings_path(config.workdir, name, config.split))
    return metrics


def evaluate_pipelines(config: EvaluateConfig) -> dict[str, dict[str, float]]:
    """Evaluate each of ``config.pipelines`` on ``config.split`` and write its run and metrics.
    ``first>reranker`` and ``first+reranker`` both asked for share one reranking
    (:func:`evaluate_reranker_pair`): the reranker is the expensive part."""
    from ckray.pipelines import build_pipeline, is_interpolated, parse_pipeline

    queries, qrels = read_queries_and_qrels(Path(config.data))
    if config.split not in qrels:
        raise ConfigError(f"--split {config.split!r}: {config.data} has qrels for {sorted(qrels)}")
    split_q = judged_queries(Path(config.data), queries, qrels, config.split)  # none: an error, before any work
    results = {}
    for name in config.pipelines:
        if name in results:
            continue
        first, reranker = parse_pipeline(name)
        partner = next((other for other in config.pipelines if reranker and parse_pipeline(other) == (first, reranker)
                        and is_interpolated(other) != is_interpolated(name)), None)  # also through aliases
        if partner is not None:
            plain, plus = (partner, name) if is_interpolated(name) else (name, partner)
            results.update(evaluate_reranker_pair(config, first, reranker, names=(plain, plus)))
            continue
        t0 = time.time()
        if is_interpolated(name) and config.fusion_weight is None:
            ensure_interpolation(config.workdir, name, queries, qrels, config.rerank_depth, rule=config.weight_rule,
                                 rerank_passages=config.rerank_passages, window_choice=config.rerank_window_choice)
        pipe = build_pipeline(name, config.workdir, rerank_depth=config.rerank_depth,
                              reranker_options=config.reranker_options,
                              retriever_options=first_stage_options(
                                  first, len(split_q), config.lam, config.hybrid_normalization),
                              interpolation_weight=config.fusion_weight)
        run = pipe.run(split_q, k=config.k)
        wall = time.time() - t0
        metrics = write_results(config, name, run, qrels[config.split], pipeline_settings(pipe, config))
        log.info("%s on %s: %s (%.1fs for %d queries)", name, config.split, metrics, wall, len(split_q))
        results[name] = metrics
    return {name: results[name] for name in config.pipelines}


def evaluate_reranker_pair(config: "EvaluateConfig", first: str, reranker: str,
                           names: tuple[str, str] | None = None) -> dict[str, dict[str, float]]:
    """``first>reranker`` and ``first+reranker`` from ONE reranking of the first stage's top depth.

    Each run is made with the steps of ``ckray.pipelines.Pipeline.run`` (first stage, rerank,
    interpolate with the weight tuned on held-out training queries) and written like
    :func:`evaluate_pipelines` writes a single pipeline's (run file, metrics, per-query metrics), so the
    figures equal evaluating each alone; only the reranker's scores are computed once, not twice.
    ``names``: what the two runs are called, when asked for by an alias (``ck-qti-rerank``)."""
    from ckray.fusion import interpolate
    from ckray.pipelines import build_pipeline

    plain, plus = f"{first}>{reranker}", f"{first}+{reranker}"
    out_plain, out_plus = names or (plain, plus)
    queries, qrels = read_queries_and_qrels(Path(config.data))
    split_q = {q: queries[q] for q in qrels[config.split] if q in queries}  # checked by evaluate_pipelines
    t0 = time.time()
    weight = config.fusion_weight
    if weight is None:
        weight = ensure_interpolation(config.workdir, plus, queries, qrels, config.rerank_depth,
                                      rule=config.weight_rule, rerank_passages=config.rerank_passages,
                                      window_choice=config.rerank_window_choice).weight
    pipe = build_pipeline(plain, config.workdir, rerank_depth=config.rerank_depth,
                          reranker_options=config.reranker_options,
                          retriever_options=first_stage_options(
                              first, len(split_q), config.lam, config.hybrid_normalization))
    first_run = pipe.retriever.search(split_q, k=max(config.k, pipe.rerank_depth))
    reranked = pipe.reranker.rerank(split_q, first_run, depth=pipe.rerank_depth)
    runs = {out_plain: reranked, out_plus: interpolate(first_run, reranked, pipe.rerank_depth, weight)}
    wall = time.time() - t0
    settings = pipeline_settings(pipe, config)
    results = {}
    for name, run in runs.items():
        run = {q: docs[:config.k] for q, docs in run.items()}
        used = settings if name == out_plain else {
            **settings, "fusion_weight": interpolation_setting(config.workdir, first, reranker, config.fusion_weight)}
        metrics = write_results(config, name, run, qrels[config.split], used)
        log.info("%s on %s: %s (%.1fs for %d queries, with %s)", name, config.split, metrics, wall,
                 len(split_q), out_plus if name == out_plain else out_plain)
        results[name] = metrics
    return results


def format_table(results: dict[str, dict[str, float]], split: str) -> str:
    if not results:
        return "(no results)"
    measures = list(next(iter(results.values())))
    width = max(len("pipeline"), *(len(n) for n in results))
    lines = [f"{'pipeline':<{width}}  " + "  ".join(f"{m:>8}" for m in measures),
             "-" * (width + 10 * len(measures))]
    for name, metrics in results.items():
        lines.append(f"{name:<{width}}  " + "  ".join(f"{metrics[m]:>8.4f}" for m in measures))
    return f"split: {split}\n" + "\n".join(lines)
