"""The QDS-Transformer's training task: how the model plugs into the shared training loop (:mod:`ckray.training`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from ckray.models.encoders import load_tokenizer
from ckray.rankers.qds.model import QDSConfig, QDSTransformer, collate_triples, triple_loss
from ckray.training import RankerTask


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

    def build_model(self) -> QDSTransformer:
        return QDSTransformer(self.model_config)

    def collate(self, rows: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return collate_triples(rows, load_tokenizer(self.model_config.encoder), self.model_config)

    def loss(self, model: QDSTransformer, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return triple_loss(model, batch, self.loss_kind, self.margin)

    def param_groups(self, model: QDSTransformer, lr: float, weight_decay: float) -> list[dict]:
        """The encoder at ``lr``, the score head ``head_lr_multiplier`` times faster."""
        from ckray.training import weight_decay_groups

        head = {id(p) for p in model.score.parameters()}
        return (weight_decay_groups([p for p in model.parameters() if id(p) not in head], weight_decay)
                + weight_decay_groups(model.score.parameters(), weight_decay, lr=lr * self.head_lr_multiplier))
