"""RankerTasks: how each model plugs into the shared training loop (:mod:`ckray.train`).

Tasks stay light (configs and small tensors) because they are pickled to every worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ckray.train import RankerTask


@dataclass
class CKTask(RankerTask):
    """CK-QTI / CK / TK: pairwise softmax loss over (q, d+, d−); IDF from the corpus (Eq. 9)."""

    config: "object"                     # ckray.models.ck.CKConfig
    doc_freq: np.ndarray | None = None   # corpus document frequency per vocabulary id
    n_docs: int = 0
    mean_doc_len: float | None = None
    name: str = "ck-qti"

    def build_model(self) -> torch.nn.Module:
        from ckray.models.ck import CKModel

        model = CKModel(self.config)
        if self.doc_freq is not None:
            model.set_idf(torch.as_tensor(self.doc_freq), self.n_docs, self.mean_doc_len)
        return model

    def collate(self, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        from ckray.models.ck import CKCollator

        return CKCollator(self.config)(rows)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from ckray.models.ck import pairwise_loss

        return pairwise_loss(*model.pairwise_scores(batch))
