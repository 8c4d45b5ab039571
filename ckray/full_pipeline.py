"""The main job: every stage on one collection, then a report (Markdown table + PNG chart)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class FullPipelineConfig:
    workdir: str
    data: str | None = None
    split: str = "test"
    models: list[str] | None = None
    workers: int = 2
    use_gpu: bool = False
    max_steps: int | None = None
    shards: int = 4
    timings: dict = field(default_factory=dict)


def run_full_pipeline(config: FullPipelineConfig) -> str:
    from ckray.data.collections import load_collection
    from ckray.data.examples import build_negatives
    from ckray.data.prepare import PrepareConfig, prepare_shards
    from ckray.evaluate import EvaluateConfig, evaluate_pipelines
    from ckray.lexical.bm25 import build_bm25_index
    from ckray.report import write_report

    workdir = Path(config.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = config.data
    if data is None:
        from ckray.data.sample import generate_sample

        data = str(generate_sample(workdir / "sample-data"))
        log.info("generated the bundled sample collection in %s", data)
    t0 = time.time()
    collection = load_collection(data)
    prepare_shards(PrepareConfig(data=data, workdir=str(workdir), shards=config.shards))
    build_bm25_index(workdir)
    if "train" in collection.qrels:
        build_negatives(workdir, collection.split_queries("train"), collection.qrels["train"])
    config.timings["prepare_s"] = time.time() - t0
    pipelines = ["bm25"]
    results = evaluate_pipelines(EvaluateConfig(data=data, workdir=str(workdir), pipelines=pipelines, split=config.split))
    return write_report(results, workdir, config.split, timings=config.timings)
