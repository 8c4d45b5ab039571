"""The main job: every stage on one collection, then a report (Markdown table + PNG chart).

    prepare   Ray Data shards, BM25 index, BM25 negatives of the training queries
    train     CK-QTI, CLEAR, CEDR-KNRM, QDS-Transformer (the registry's training stages, ``ckray.rankers``:
              the very functions behind jobs/train_*.py), a few steps each on the *training* queries
    index     CK-QTI impact index; CLEAR dense index + hybrid λ_test tuned on training queries
              (their index stages: jobs/build_*_index.py)
    evaluate  every pipeline whose artifacts exist (bm25, ck-qti, clear-dense, clear, and each reranker
              over its first stage both alone and interpolated: bm25>ck-qti, bm25+ck-qti,
              bm25>cedr-knrm, bm25+cedr-knrm, bm25>qds, bm25+qds, clear>cedr-knrm, clear+cedr-knrm)
    report    W/report.md (metrics, training, per-stage wall times), W/report.png, W/pipeline_summary.json

Each stage skips finished work: a run already at its step count is not trained again (``fit``
consolidates its best checkpoint and returns; the checkpoint directory stays byte-identical),
finished shards and up-to-date indexes are kept, and a pipeline whose inputs (queries, qrels,
depths, index metadata, reranker checkpoint hash, interpolation weight) did not change keeps its
metrics. The defaults are sized for the bundled sample on 2 CPU cores; ``max_steps`` and the
per-model ``flags`` scale it up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from ckray.errors import ConfigError
from ckray.options import option

if TYPE_CHECKING:
    import argparse

    from ckray.evaluation import EvaluateConfig

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class ModelRecipe:
    """How the main job trains one ranker, by field name: ``loop`` (``TrainConfig`` fields; ``max_steps``
    is the step count that ``--max-steps`` overrides) and ``options`` (fields of the ranker's training
    options, ``spec.training.options``)."""

    loop: Mapping[str, Any] = field(default_factory=dict)
    options: Mapping[str, Any] = field(default_factory=dict)


# The main job's training, per model: a few steps, small batches, short inputs, so the bundled sample
# trains every model in about a minute each on 2 CPU cores. A registered ranker without an entry trains
# with its own job's defaults.
MODEL_DEFAULTS: dict[str, ModelRecipe] = {
    "ck-qti": ModelRecipe(loop={"max_steps": 30, "batch_size": 4}, options={"layers": 1, "max_doc_len": 256}),
    "clear": ModelRecipe(loop={"max_steps": 20, "batch_size": 2, "lr": 5e-5}, options={"doc_max_len": 128}),
    "cedr-knrm": ModelRecipe(loop={"max_steps": 20, "batch_size": 2, "lr": 1e-4},
                             options={"max_length": 128, "max_segments": 1}),
    "qds": ModelRecipe(loop={"max_steps": 20, "batch_size": 2, "lr": 1e-4}, options={"max_length": 128, "window": 32}),
}
# Every model: validate on 5 held-back training queries (BM25 top 10) at the start and the end only.
DEMO_LOOP = {"eval_every": 0, "log_every": 5, "warmup_steps": 2}
DEMO_DATA = {"max_dev_queries": 5, "dev_depth": 10}
# CK-QTI's impact index in the main job: index options by field name (jobs/build_impact_index.py's flags)
DEMO_IMPACT = {"top_k": 64, "expansion_candidates": 64}

MODEL_ORDER = list(MODEL_DEFAULTS)


def comma_list(text: str) -> list[str]:
    """``"ck-qti, clear"`` → ``["ck-qti", "clear"]``; ``""`` → ``[]``."""
    return [item.strip() for item in text.split(",") if item.strip()]


@dataclass
class FullPipelineConfig:
    """The main job's settings; each field declared with :func:`~ckray.options.option` is a flag of
    ``jobs/pipeline.py``."""

    workdir: str
    data: str | None = option(None, "collection directory (default: generate the bundled sample)")
    split: str = option("test", "qrels split the pipelines are evaluated on")
    train_split: str = option("train", "qrels split the models are trained (and λ tuned) on")
    models: list[str] | None = option(None, "comma-separated models to train and index (default: all of "
                                            f"{','.join(MODEL_DEFAULTS)}; '' for none)", parse=comma_list)
    workers: int = option(2, "Ray Train workers per model")
    use_gpu: bool = option(False, "one GPU per training worker and index actor")
    max_steps: int | None = option(None, "training steps of every model (default: per model, " + ", ".join(
        f"{m} {r.loop['max_steps']}" for m, r in MODEL_DEFAULTS.items()) + ")")
    shards: int = option(4, "corpus shards")
    rerank_depth: int = option(10, "first-stage documents each reranker rescores")
    reevaluate: bool = option(False, "evaluate every pipeline again, even those whose inputs did not change")
    # per model, settings over its recipe's (ModelRecipe: loop and ranker options by field name)
    recipes: dict[str, ModelRecipe] = field(default_factory=dict)
    timings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("workers", "max_steps", "shards", "rerank_depth"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError.invalid("FullPipelineConfig", name, f"must be >= 1, got {value}")

    def selected_models(self) -> list[str]:
        from ckray.rankers import trainable

        known = list(trainable())  # registration order: first stages' rankers before the rerankers
        models = MODEL_ORDER if self.models is None else [m.strip() for m in self.models if m.strip()]
        unknown = [m for m in models if m not in known]
        if unknown:
            raise ConfigError(f"--models: unknown {', '.join(unknown)}; known: {', '.join(known)}")
        return [m for m in known if m in models]   # dependency order, no duplicates


@dataclass
class StageRun:
    """One stage in one run of the main job: whether it did its work (False: everything was up to date)."""

    did_work: bool = True


@contextmanager
def _stage(timings: dict, did_work: dict[str, bool], name: str) -> Iterator[StageRun]:
    """Time a stage into ``timings[name]``; the stage sets ``did_work`` on what it yields."""
    log.info("stage %s: started", name)
    run = StageRun()
    t0 = time.time()
    try:
        yield run
    finally:
        timings[name] = time.time() - t0
        did_work[name] = run.did_work
        log.info("stage %s: %s in %.1f s", name, "done" if run.did_work else "up to date, skipped", timings[name])


def stage_work_times(timings: dict[str, float], did_work: dict[str, bool],
                     previous: dict[str, float | None]) -> dict[str, float | None]:
    """Each stage's wall time in the last run that did its work: this run's where the stage worked, else
    ``previous`` (the last run's record; None: not known). A re-run that skips finished work thus keeps
    telling what each stage costs; its own skip times stay in ``timings``."""
    return {name: seconds if did_work[name] else previous.get(name)
            for name, seconds in timings.items() if name in did_work}


def _previous_work_times(workdir: Path) -> dict[str, float | None]:
    """The stage work times the last run of the main job wrote to ``W/pipeline_summary.json``."""
    path = workdir / "pipeline_summary.json"
    try:
        return dict(json.loads(path.read_text()).get("stage_work_s") or {}) if path.exists() else {}
    except (json.JSONDecodeError, TypeError, ValueError):
        log.warning("%s is unreadable: stage times of earlier runs are not known", path)
        return {}


def available_pipelines(workdir: str | Path, interpolated: bool = True) -> list[str]:
    """Every named pipeline whose artifacts exist in ``workdir``, in report order: BM25 and each registered
    first stage whose index exists (``ckray.rankers``), then each ranker's own
    checkpoint reranking each ready first stage it names in ``rerank_over``, as ``first>reranker`` (its
    score alone) and, with ``interpolated``, ``first+reranker`` (plus the first stage's score, the weight
    tuned on held-out training queries: ``ckray.fusion``)."""
    from ckray.pipelines import checkpoint_dir
    from ckray.rankers import first_stages, specs

    w = Path(workdir)
    # BM25 always (prepare builds it); another first stage once its stamp files (written when complete) exist
    ready = ["bm25"] + [name for name, fs in first_stages().items()
                        if name != "bm25" and all((w / a).exists() for a in fs.stamp_files or fs.artifacts)]
    own = [(r, s) for s in specs().values() for r in s.rerankers if r == s.name]  # not ablations
    have = [(r, s) for r, s in own if (checkpoint_dir(w, r) / "model.safetensors").exists()]
    names = list(ready)
    for first in ready:
        for m, spec in have:
            if first in spec.rerank_over:
                names += [f"{first}>{m}"] + ([f"{first}+{m}"] if interpolated else [])
    return names


def evaluation_stamp(workdir: str | Path, pipeline: str, split: str, queries: dict, qrels: dict,
                     config: "EvaluateConfig") -> dict:
    """What a pipeline's figures depend on: the evaluated queries and qrels, k, rerank depth, measures,
    the first stage's index metadata, the reranker checkpoint's content hash and, for
    ``first+reranker``, the tuned interpolation weight."""
    from ckray.fusion import fusion_path
    from ckray.models.checkpoint import checkpoint_digest
    from ckray.pipelines import artifact_content, checkpoint_dir, first_stage_fingerprint, is_interpolated, parse_pipeline

    def sha(obj) -> str:
        return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()

    workdir = Path(workdir)
    first, reranker = parse_pipeline(pipeline)
    return {
        "pipeline": pipeline, "split": split, "k": config.k, "rerank_depth": config.rerank_depth,
        "measures": list(config.measures), "queries_qrels_sha256": sha([queries, qrels]),
        "first_stage": first_stage_fingerprint(workdir, first),
        "reranker_sha256": checkpoint_digest(checkpoint_dir(workdir, reranker)) if reranker else None,
        "interpolation": artifact_content(fusion_path(workdir, first, reranker)) if is_interpolated(pipeline) else None,
    }


def evaluate_or_reuse(data: str, workdir: str | Path, pipelines: list[str], split: str, rerank_depth: int,
                      force: bool = False) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Evaluate each pipeline unless its metrics were computed from the same inputs (a stamp beside the
    metrics file); returns the metrics and the names evaluated now. ``first>reranker`` and
    ``first+reranker`` both due are evaluated together (one reranking, see
    ``ckray.evaluation.evaluate_pipelines``); stamps are written as each is done, so a stopped run resumes."""
    from ckray.data.collections import judged_queries, read_queries_and_qrels
    from ckray.data.shards import read_json, write_json_atomic
    from ckray.evaluation import EvaluateConfig, evaluate_pipelines, metrics_path
    from ckray.pipelines import parse_pipeline

    queries, qrels = read_queries_and_qrels(Path(data))
    if split not in qrels:
        raise ConfigError(f"--split {split!r}: {data} has qrels for {sorted(qrels)}")
    split_qrels = qrels[split]
    split_q = judged_queries(Path(data), queries, qrels, split)

    def config_for(names: list[str]) -> EvaluateConfig:
        return EvaluateConfig(data=data, workdir=str(workdir), pipelines=names, split=split,
                              rerank_depth=rerank_depth)

    def stamp_file(name: str) -> Path:
        return metrics_path(workdir, name, split).with_suffix(".stamp.json")

    results, todo = {}, []
    for name in pipelines:
        metrics_file = metrics_path(workdir, name, split)
        stamp = evaluation_stamp(workdir, name, split, split_q, split_qrels, config_for([name]))
        if not force and metrics_file.exists() and stamp_file(name).exists() and read_json(stamp_file(name)) == stamp:
            stored = read_json(metrics_file)
            results[name] = {m: stored[m] for m in config_for([name]).measures}   # the table's column order
            log.info("%s on %s: inputs unchanged, metrics reused: %s", name, split, results[name])
        else:
            todo.append(name)
    for name in todo:
        if name in results:
            continue   # evaluated with its pair
        first, reranker = parse_pipeline(name)
        pair = [f"{first}>{reranker}", f"{first}+{reranker}"] if reranker else []
        # a pair both due goes in together: evaluate_pipelines reranks it once
        got = evaluate_pipelines(config_for(pair if pair and all(p in todo for p in pair) else [name]))
        for n, metrics in got.items():
            results[n] = metrics
            # after evaluating: a first+reranker evaluation may have (re)tuned its weight, part of the stamp
            write_json_atomic(evaluation_stamp(workdir, n, split, split_q, split_qrels, config_for([n])),
                              stamp_file(n))
    return {n: results[n] for n in pipelines}, [n for n in pipelines if n in todo]


def _train_args(config: FullPipelineConfig, data: str, model: str) -> "argparse.Namespace":
    """The training job's settings of ``model`` in the main job: its recipe in ``MODEL_DEFAULTS``, then
    ``config``'s (workers, step count, GPU, its ``recipes`` entry)."""
    from ckray.stages import stage_args

    base, extra = MODEL_DEFAULTS.get(model, ModelRecipe()), config.recipes.get(model, ModelRecipe())
    loop = {**DEMO_LOOP, **base.loop, "workers": config.workers, **({"use_gpu": True} if config.use_gpu else {})}
    if config.max_steps is not None:
        loop["max_steps"] = config.max_steps
    return stage_args(f"train:{model}", data, config.workdir, loop={**loop, **extra.loop},
                      options={**base.options, **extra.options},
                      data_options={**DEMO_DATA, "split": config.train_split})


def run_full_pipeline(config: FullPipelineConfig) -> str:
    """Run every stage; returns the printed report (metrics table, stage times, report paths)."""
    from ckray.data.collections import load_collection
    from ckray.data.prepare import prepare_collection
    from ckray.ray_env import init_ray
    from ckray.report import write_report
    from ckray.rankers import indexed
    from ckray.stages import check_training_flags, run_stage, stage_args

    models = config.selected_models()
    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    timings, did_work = config.timings, {}
    t_start = time.time()
    data = config.data
    if data is None:
        from ckray.data.sample import DEMO_SAMPLE, generate_sample

        data = str(generate_sample(workdir / "sample-data", DEMO_SAMPLE))  # deterministic: same bytes every time
        log.info("generated the bundled sample collection in %s", data)
    train_args = {m: _train_args(config, data, m) for m in models}
    for model, args in train_args.items():
        check_training_flags(model, args)  # before Ray starts: a bad --max-steps fails now, not after prepare
    init_ray()

    with _stage(timings, did_work, "prepare") as stage:
        collection = load_collection(data)
        if config.split not in collection.qrels:
            raise ConfigError(f"--split {config.split!r}: {data} has qrels for {sorted(collection.qrels)}")
        if models and config.train_split not in collection.qrels:
            raise ConfigError(f"training needs qrels for {config.train_split!r}; {data} has {sorted(collection.qrels)}"
                              " (pass --models '' to evaluate BM25 only)")
        stage.did_work = prepare_collection(data, workdir, shards=config.shards, split=config.train_split,
                                            collection=collection).did_work

    training: dict[str, dict] = {}
    for model in models:
        with _stage(timings, did_work, f"train {model}") as stage:
            result = run_stage(f"train:{model}", train_args[model])
            stage.did_work = result.steps > result.start_step
        training[model] = {
            "checkpoint": str(result.best_checkpoint), "steps": result.steps,
            "steps_this_run": result.steps - result.start_step, "trained": result.steps > result.start_step,
            "best_dev_ndcg@10": result.best_metric, "best_step": result.best_step,
            "wall_time_s": timings[f"train {model}"],
        }
        log.info("%s: %s", model, "trained %d steps" % training[model]["steps_this_run"]
                 if training[model]["trained"] else f"already trained ({result.steps} steps): skipped")

    index: dict[str, dict] = {}
    gpu = {"use_gpu": True} if config.use_gpu else {}
    if "ck-qti" in models:
        with _stage(timings, did_work, "index ck-qti (impact)") as stage:
            args = stage_args("index:ck-qti", data, workdir, options={**DEMO_IMPACT, **gpu})
            s = indexed()["ck-qti"].index.build(args)
            index["ck-qti"] = {"documents": s.get("total_documents"), "shards_scored": s.get("shards_written"),
                               "shards_skipped": s.get("shards_skipped"), "index_built": s.get("index_built")}
            stage.did_work = bool(s.get("shards_written") or s.get("index_built"))
    if "clear" in models:
        with _stage(timings, did_work, "index clear (dense + λ)") as stage:
            args = stage_args("index:clear", data, workdir, options={"tune_split": config.train_split, **gpu})
            s = indexed()["clear"].index.build(args)
            index["clear"] = {"shards_embedded": s.get("shards_written"), "shards_skipped": s.get("shards_skipped"),
                              "lambda": s.get("lambda"), "tune_queries": s.get("tune_queries")}
            stage.did_work = bool(s.get("shards_written"))  # embedding is the work; the flat index and λ are redone

    with _stage(timings, did_work, "evaluate") as stage:
        pipelines = available_pipelines(workdir)
        results, evaluated = evaluate_or_reuse(data, workdir, pipelines, config.split, config.rerank_depth,
                                               force=config.reevaluate)
        stage.did_work = bool(evaluated)
    timings["total"] = time.time() - t_start
    work_times = stage_work_times(timings, did_work, _previous_work_times(workdir))
    summary = {"data": data, "split": config.split, "models": models, "pipelines": pipelines,
               "evaluated": evaluated, "rerank_depth": config.rerank_depth, "results": results,
               "training": training, "index": index, "timings_s": dict(timings), "stage_did_work": did_work,
               "stage_work_s": work_times}
    (workdir / "pipeline_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    notes = [f"Rerank depth {config.rerank_depth}; models trained on the {config.train_split!r} queries of {data}."]
    reused = [p for p in pipelines if p not in evaluated]
    if reused:
        notes.append("Metrics reused, their inputs unchanged since computed (--reevaluate to redo): "
                     f"{', '.join(reused)}.")
    return write_report(results, workdir, config.split, timings=timings, training=training, notes=notes,
                        work_times=work_times, did_work=did_work)
