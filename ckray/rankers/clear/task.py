"""The CLEAR ranker's training task: how the model plugs into the shared training loop (:mod:`ckray.training`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

from ckray.rankers.clear.model import CLEAR, CLEARConfig, CLEARLossConfig, clear_collate, clear_loss
from ckray.models.encoders import load_tokenizer
from ckray.training import RankerTask


@dataclass
class CLEARTask(RankerTask):
    """CLEAR for :func:`ckray.training.fit`: residual-margin hinge on (query, d+, BM25 d−) triples.

    Dev validation reranks BM25 candidates with the hybrid score of Eq. 8,
    ``dev_lambda · s_lex + s_emb`` (``dev_lambda`` None: ``lambda_train``), so the checkpoint kept is
    the one that complements BM25 best rather than the best stand-alone dense model.
    """

    model_config: CLEARConfig = field(default_factory=CLEARConfig)
    loss_config: CLEARLossConfig = field(default_factory=CLEARLossConfig)
    dev_lambda: float | None = None
    name: str = "clear"

    def build_model(self) -> CLEAR:
        return CLEAR(self.model_config)

    def collate(self, rows: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return clear_collate(rows, load_tokenizer(self.model_config.encoder), self.model_config)

    def loss(self, model: CLEAR, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return clear_loss(model, batch, self.loss_config)

    def score(self, model: CLEAR, queries: list[str], docs: list[str], bm25: list[float]) -> torch.Tensor:
        lam = self.loss_config.lambda_train if self.dev_lambda is None else self.dev_lambda
        s_emb = model.score_texts(queries, docs)
        return lam * torch.as_tensor(np.asarray(bm25, dtype=np.float32)) + s_emb
