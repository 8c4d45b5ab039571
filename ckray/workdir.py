"""The work directory's layout: where every artifact of every stage lives, in one place.

A work directory ``W`` holds everything the jobs make from one collection (README, "The work
directory")::

    W/shards/part-NNNNN.parquet (+ .done.json)     corpus shards                      prepare
    W/docstore/<digest>/                           doc_id → title, text (memory-mapped) prepare
    W/bm25/index/                                  Lucene index                       prepare
    W/negatives/<split>.parquet                    BM25 top-N per training query      prepare
    W/checkpoints/<name>/                          a trained model (+ deploy.json)    train
    W/train/<name>/                                Ray Train run state                train
    W/<ranker's directory>/                        a ranker's index (impact/, dense/) build_*_index
    W/fusion/<first>+<reranker>.json               tuned interpolation weight         evaluate
    W/runs/<pipeline>-<split>.trec                 TREC run                           evaluate
    W/metrics/<pipeline>-<split>.json              measure → value                    evaluate
    W/report.md, report.png, pipeline_summary.json the main job's report              pipeline
    W/sample-data/                                 the generated collection           pipeline

Modules ask this one for paths (``WorkDir(w).negatives("train")``) rather than joining names
themselves; a ranker's own index files are its package's business, under :meth:`WorkDir.ranker_dir`.
Imports nothing heavy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WorkDir:
    """The paths of a work directory's artifacts (nothing is created or read here)."""

    root: Path

    def __init__(self, root: str | os.PathLike) -> None:
        object.__setattr__(self, "root", Path(root))

    # ---------------------------------------------------------------- prepare
    @property
    def shards(self) -> Path:
        return self.root / "shards"

    @property
    def docstore(self) -> Path:
        return self.root / "docstore"

    @property
    def bm25_index(self) -> Path:
        return self.root / "bm25" / "index"

    @property
    def negatives_dir(self) -> Path:
        return self.root / "negatives"

    def negatives(self, split: str = "train") -> Path:
        """BM25's top-N candidates of ``split``'s queries (``query_id, doc_id, rank, score``)."""
        return self.negatives_dir / f"{split}.parquet"

    def positives(self, split: str = "train") -> Path:
        """The judged positives' BM25 scores of ``split``'s queries."""
        return self.negatives_dir / f"{split}-positives.parquet"

    def hard_negatives(self, key: str) -> Path:
        """Negatives mined from a trained model's run (``key``: the run's digest)."""
        return self.negatives_dir / f"hard-{key}"

    # ---------------------------------------------------------------- train
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, name: str) -> Path:
        """A trained model ``W/checkpoints/<name>`` (config.json, model.safetensors, deploy.json)."""
        return self.checkpoints / name

    @property
    def train_runs(self) -> Path:
        """Ray Train's storage: one run directory per checkpoint name (resumed from)."""
        return self.root / "train"

    # ---------------------------------------------------------------- index
    def ranker_dir(self, name: str) -> Path:
        """A ranker's own index directory (``impact`` for CK-QTI, ``dense`` for CLEAR)."""
        return self.root / name

    # ---------------------------------------------------------------- evaluate
    @property
    def fusion_dir(self) -> Path:
        return self.root / "fusion"

    def fusion(self, first: str, reranker: str) -> Path:
        """The interpolation weight of ``first+reranker``, tuned on dev queries."""
        return self.fusion_dir / f"{first}+{reranker}.json"

    def run(self, pipeline: str, split: str) -> Path:
        return self.root / "runs" / f"{pipeline}-{split}.trec"

    def metrics(self, pipeline: str, split: str) -> Path:
        return self.root / "metrics" / f"{pipeline}-{split}.json"

    # ---------------------------------------------------------------- the main job
    @property
    def report(self) -> Path:
        return self.root / "report.md"

    @property
    def summary(self) -> Path:
        return self.root / "pipeline_summary.json"

    @property
    def sample_data(self) -> Path:
        return self.root / "sample-data"
