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
    # E[TF], E[|d|] of training triples (ckray.models.ck.explicit_training_statistics): the explicit
    # match then starts as BM25 under batch scaling (CKModel.start_explicit_as_bm25)
    train_mean_tf: float | None = None
    train_mean_len: float | None = None
    name: str = "ck-qti"
    head_lr_multiplier: float = 1.0      # all but the (pretrained) word embeddings train this much faster

    def build_model(self) -> torch.nn.Module:
        from ckray.models.ck import CKModel

        model = CKModel(self.config)
        if self.doc_freq is not None:
            model.set_idf(torch.as_tensor(self.doc_freq), self.n_docs, self.mean_doc_len)
        if self.train_mean_tf is not None and self.train_mean_len is not None and self.mean_doc_len:
            model.start_explicit_as_bm25(self.train_mean_tf, self.train_mean_len, self.mean_doc_len)
        return model

    def collate(self, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        from ckray.models.ck import CKCollator

        return CKCollator(self.config)(rows)

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from ckray.models.ck import pairwise_loss

        return pairwise_loss(*model.pairwise_scores(batch))

    def param_groups(self, model: torch.nn.Module, lr: float, weight_decay: float) -> list[dict] | None:
        """The pretrained word embeddings at ``lr``; the rest (Conformer blocks, kernels' MLP, the
        explicit term's w and b, α, the ReLU bias: all randomly or hand initialised) at
        ``head_lr_multiplier × lr``. None (one rate for all) when the multiplier is 1."""
        if self.head_lr_multiplier == 1.0:
            return None
        from ckray.train import weight_decay_groups

        embeddings = model.encoder.embed.weight
        rest = [p for p in model.parameters() if p is not embeddings]
        return (weight_decay_groups([embeddings], weight_decay, lr=lr)
                + weight_decay_groups(rest, weight_decay, lr=lr * self.head_lr_multiplier))
