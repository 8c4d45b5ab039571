"""The QDS-Transformer's training task: how the model plugs into the shared training loop (:mod:`ckray.training`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from ckray.data.statistics import CorpusStats
from ckray.errors import ConfigError
from ckray.models.encoders import load_tokenizer
from ckray.models.losses import PROBE_TRIPLES
from ckray.rankers.qds.model import QDSConfig, QDSTransformer, collate_triples, triple_loss
from ckray.training import RankerTask

PROBE_COLUMNS = ("query", "pos_text", "neg_text")


def probe_triples(td, n: int = PROBE_TRIPLES) -> dict[str, list[str]]:
    """The first ``n`` triples of a job's ``ckray.data.examples.TrainingData`` (its seeded shuffle, the
    triples training starts with) as lists of texts: what a task's ``warm_triples`` holds."""
    rows = td.head(n).to_pydict()
    return {c: [str(x) for x in rows[c]] for c in PROBE_COLUMNS}


def warm_start_from(model, triples: Mapping[str, list[str]] | None, task_name: str) -> None:
    """``model.warm_start_head`` on a task's ``warm_triples``; a clear error when the task has none."""
    if not triples or not triples.get("query"):
        raise ConfigError(f"{task_name}: head_init='warm' fits the score head to training triples, but the task "
                          f"has no warm_triples (set them with probe_triples(training_data), or use "
                          f"head_init='random')")
    model.warm_start_head(*(triples[c] for c in PROBE_COLUMNS))


@dataclass
class QDSTask(RankerTask):
    """QDS-Transformer for :func:`ckray.training.fit`: pairwise loss on (query, d+, BM25 d−) triples."""

    model_config: QDSConfig = field(default_factory=QDSConfig)
    loss_kind: str = "softmax"
    margin: float = 1.0
    name: str = "qds"
    # the [CLS] → score head starts random; >1 trains it this many times faster than the encoder, as
    # CEDR's head (ckray.rankers.cedr.model). 1.0 = the paper's plain fine-tuning. On SciFact (MiniLM, 512
    # tokens, 120 steps × 8 triples) 1× and 50× both ended at dev nDCG@10 0.31: the head is not the limit.
    head_lr_multiplier: float = 1.0
    # (query, pos_text, neg_text) texts the warm head is fitted to (``probe_triples``); used when
    # model_config.head_init == "warm" with the [CLS] head (the pooled head starts warm without data)
    warm_triples: dict[str, list[str]] | None = None
    # word-piece statistics of the training collection, read by the MaxSim head with query_weights="idf"
    collection_statistics: CorpusStats | None = None

    @property
    def needs_warm_triples(self) -> bool:
        return self.model_config.head_init == "warm" and self.model_config.head == "cls"

    def build_model(self) -> QDSTransformer:
        model = QDSTransformer(self.model_config)
        if model.collection_tokenisation is not None:
            if self.collection_statistics is None:
                raise ConfigError(f"{self.name}: query_weights='idf' weights query word pieces by their IDF, but "
                                  f"the task has no collection_statistics (the training corpus's, "
                                  f"ckray.data.statistics.cached_corpus_statistics)")
            model.set_collection_statistics(self.collection_statistics)
        if self.needs_warm_triples:
            warm_start_from(model, self.warm_triples, self.name)
        return model

    def collate(self, rows: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return collate_triples(rows, load_tokenizer(self.model_config.encoder), self.model_config)

    def loss(self, model: QDSTransformer, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return triple_loss(model, batch, self.loss_kind, self.margin)

    def param_groups(self, model: QDSTransformer, lr: float, weight_decay: float) -> list[dict]:
        """The encoder at ``lr``, the score head ``head_lr_multiplier`` times faster."""
        from ckray.training import weight_decay_groups

        head_params = model.head_parameters()
        head = {id(p) for p in head_params}
        return (weight_decay_groups([p for p in model.parameters() if id(p) not in head], weight_decay)
                + weight_decay_groups(head_params, weight_decay, lr=lr * self.head_lr_multiplier))
