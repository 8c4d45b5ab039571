"""A fifth ranker as a plug-in: a learned term-weight dot product, all of it in this package.

    score(q, d) = Σ_t  n_q(t) · w_t · log(1 + tf(t, d))

over hashed word buckets ``t`` (crc32 of the lower-cased word, so every process agrees), with one
learned weight ``w_t`` per bucket, starting at 1. It plugs in with one line, ``register(SPEC)`` at the
end, run when the package is imported (by ``import toy_ranker``, or by ckray in any process that has
``CKRAY_RANKERS=toy_ranker``), and then trains, reranks (``bm25>toy``), evaluates and serves through
ckray's own jobs and API.
"""

from __future__ import annotations

import argparse
import re
import zlib
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from ckray.options import option
from ckray.rankers import RankerSpec, TrainingStage, register
from ckray.training import RankerTask

WORD = re.compile(r"\w+")


@dataclass
class ToyConfig:
    buckets: int = 4096


def bag(texts: Sequence[str], buckets: int, log_tf: bool) -> torch.Tensor:
    """``[len(texts), buckets]``: each text's word counts per hashed bucket (``log(1 + tf)`` with ``log_tf``)."""
    out = torch.zeros(len(texts), buckets)
    for i, text in enumerate(texts):
        for word in WORD.findall(str(text).lower()):
            out[i, zlib.crc32(word.encode()) % buckets] += 1.0
    return out.log1p() if log_tf else out


class ToyModel(nn.Module):
    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.ones(config.buckets))

    def forward(self, query_bags: torch.Tensor, doc_bags: torch.Tensor) -> torch.Tensor:
        return (query_bags * doc_bags) @ self.weight

    @torch.no_grad()
    def score_texts(self, queries: list[str], docs: list[str]) -> torch.Tensor:
        n = self.config.buckets
        return self.forward(bag(queries, n, log_tf=False), bag(docs, n, log_tf=True)).float()


@dataclass
class ToyTask(RankerTask):
    config: ToyConfig = field(default_factory=ToyConfig)
    name: str = "toy"

    def build_model(self) -> ToyModel:
        return ToyModel(self.config)

    def collate(self, rows: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        n = self.config.buckets
        return {"query": bag(list(rows["query"]), n, log_tf=False), "pos": bag(list(rows["pos_text"]), n, log_tf=True),
                "neg": bag(list(rows["neg_text"]), n, log_tf=True)}

    def loss(self, model: ToyModel, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        from ckray.models.losses import pairwise_loss

        return pairwise_loss(model(batch["query"], batch["pos"]), model(batch["query"], batch["neg"]))

    def score(self, model: ToyModel, queries: list[str], docs: list[str], bm25: list[float]) -> torch.Tensor:
        return model.score_texts(queries, docs)


@dataclass(frozen=True)
class ToyOptions:
    buckets: int = option(4096, "hashed word buckets, one learned weight each")


def train(options: ToyOptions, args: argparse.Namespace):
    """The toy ranker on the shared loop → W/checkpoints/toy."""
    from ckray.train_job import run_training, training_config

    task = ToyTask(config=ToyConfig(buckets=options.buckets))
    return run_training(task, args, training_config(args, task.name, **SPEC.training.defaults))


SPEC = RankerSpec(
    name="toy", title="toy: learned term weights (a plug-in)", module="toy_ranker",
    training=TrainingStage("toy_ranker", "toy_ranker:ToyOptions", "",
                           {"lr": 0.05, "max_steps": 8, "eval_every": 0, "batch_size": 4}),
    rerankers={"toy": "toy"},
)
register(SPEC)  # the plug-in's one registry line
