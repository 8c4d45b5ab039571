"""How a model plugs into the loop (:class:`RankerTask`) and what a run returns (:class:`TrainResult`).

Writing a task
--------------
* ``build_model()`` must be deterministic given the torch seed and return an ``nn.Module`` with a
  dataclass ``config`` and ``__init__(config)`` (so ``save_model``/``load_model`` work).
* ``collate(rows)`` receives a dict of numpy arrays (columns of the triples table, ``batch_size``
  rows) and returns a dict of tensors; the loop moves tensors to the device (dtypes unchanged).
* ``loss(model, batch)`` and ``score(model, queries, docs, bm25)`` receive the bare module
  (``engine.module``), not the DeepSpeed engine, so any method of the model may be called.
  ``score`` gets a flat list of (query, doc) pairs and returns one score per pair.
* The task object is pickled to the workers: keep it light (paths and hyperparameters, not models).
* Hash words with a stable hash (``zlib.crc32``), never ``hash()``: it differs between processes.
* ZeRO stage 3 partitions parameters: use them only inside submodule ``forward`` calls.

torch and numpy appear here only in annotations: importing this module imports neither.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import numpy as np
    import torch

METRIC = "dev_ndcg@10"            # the dev figure checkpoints are picked by
TRIPLE_COLUMNS = ("query_id", "query", "pos_id", "pos_text", "pos_bm25", "neg_id", "neg_text", "neg_bm25")


class RankerTask(ABC):
    """How a model plugs into :func:`fit`. Must be picklable: it is sent to every worker."""

    name: str = "ranker"

    @abstractmethod
    def build_model(self) -> torch.nn.Module:
        """A fresh model (deterministic given the torch seed) with a dataclass ``.config``."""

    @abstractmethod
    def collate(self, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """Turn a Ray Data batch of triples (numpy columns, see ``TRIPLE_COLUMNS``) into tensors."""

    @abstractmethod
    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """A scalar training loss for one micro-batch (``batch`` is already on the model's device)."""

    def score(self, model: torch.nn.Module, queries: list[str], docs: list[str],
              bm25: list[float]) -> torch.Tensor:
        """One relevance score per (query, doc) pair; called under ``torch.no_grad`` in eval mode."""
        return model.score_texts(queries, docs)

    def dev_scorer(self, model: torch.nn.Module) -> Callable[[list[str], list[str], list[float]], torch.Tensor]:
        """``(queries, docs, bm25) -> scores`` for every chunk of one validation, built once per validation
        from the current weights (a task can precompute there what all chunks share); default :meth:`score`."""
        return lambda queries, docs, bm25: self.score(model, queries, docs, bm25)

    @property
    def dev_scoring_forwards_per_chunk_fixed(self) -> bool:
        """Whether :meth:`dev_scorer` runs the same number of forward passes for every chunk. ZeRO-3 makes
        each forward a collective across workers (validation pads every rank to the same number of chunks),
        so :func:`fit` refuses ZeRO-3 over several workers for a task that says False."""
        return True

    def param_groups(self, model: torch.nn.Module, lr: float, weight_decay: float) -> list[dict] | None:
        """Optional AdamW parameter groups (e.g. a slower learning rate for a pretrained encoder);
        ``None``: one learning rate, no weight decay on biases and norms. Group ``lr`` values are
        scaled by the warm-up/decay schedule like the base rate."""
        return None


@dataclass
class TrainResult:
    best_checkpoint: Path            # output_dir: consolidated config.json + model.safetensors
    best_metric: float               # dev nDCG@10 of that checkpoint
    best_step: int
    history: list[dict]              # one entry per validation: step, epoch, loss, lr, dev_ndcg@10, examples_per_s
    steps: int                       # optimizer steps done in total (across resumes)
    examples_seen: int               # training triples consumed in total
    wall_time: float                 # seconds this fit() call took, start-up and consolidation included
    start_step: int = 0              # step this call started (resumed) from; 0 for a fresh run
    restarts: int = 0                # worker-group restarts (FailureConfig) during this call
    attempts: list[int] = field(default_factory=list)   # start step of each worker-group attempt
    run_dir: str = ""                # Ray Train run directory (checkpoints, snapshot)
