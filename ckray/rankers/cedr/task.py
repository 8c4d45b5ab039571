"""The CEDR ranker's training task: how the model plugs into the shared training loop (:mod:`ckray.training`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from ckray.models.encoders import load_tokenizer
from ckray.rankers.cedr.model import Batch, CEDRConfig, CEDRRanker, collate_pairs
from ckray.rankers.qds.task import warm_start_from
from ckray.training import RankerTask


@dataclass
class CEDRTask(RankerTask):
    """CEDR for :func:`ckray.training.fit`: pairwise loss on (query, relevant, BM25 negative) triples;
    dev validation reranks BM25 candidates with the model alone."""

    model_config: CEDRConfig = field(default_factory=CEDRConfig)
    name: str = ""
    head_lr_multiplier: float = 50.0
    # (query, pos_text, neg_text) texts a fitted warm head is fitted to (``ckray.rankers.qds.task.probe_triples``,
    # ``model_config.warm_probe_triples`` of them): vanilla's and CEDR-KNRM's probe head; the others need none
    warm_triples: dict[str, list[str]] | None = None

    def __post_init__(self) -> None:
        if not self.name:
            v = self.model_config.variant
            self.name = "vanilla-bert" if v == "vanilla" else f"cedr-{v}"

    @property
    def needs_warm_triples(self) -> bool:
        return self.model_config.warm_head_is_fitted

    def build_model(self) -> CEDRRanker:
        model = CEDRRanker(self.model_config)
        if self.needs_warm_triples:
            warm_start_from(model, self.warm_triples, self.name)
        return model

    def collate(self, rows: Mapping[str, np.ndarray]) -> Batch:
        cfg = self.model_config
        return collate_pairs(load_tokenizer(cfg.tokenizer or cfg.encoder), cfg, rows)

    def loss(self, model: CEDRRanker, batch: Batch) -> torch.Tensor:
        return model.pairwise_loss(batch)

    def score(self, model: CEDRRanker, queries: list[str], docs: list[str], bm25: list[float]) -> torch.Tensor:
        return model.score_texts(queries, docs)

    def param_groups(self, model: CEDRRanker, lr: float, weight_decay: float) -> list[dict]:
        """Section 3.1: the encoder at the base rate (2e-5 in the paper), the ranker head 50× faster (1e-3)."""
        return model.param_groups(encoder_lr=lr, head_lr=lr * self.head_lr_multiplier)
