"""RankerTasks: how each model plugs into the shared training loop (:mod:`ckray.training`).

Tasks stay light (configs and small tensors) because they are pickled to every worker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from ckray.rankers.ck_qti.impact_settings import ImpactConfig
from ckray.training import RankerTask

if TYPE_CHECKING:
    from ckray.rankers.ck_qti.model import CKConfig


def pair_cut(pos_mask: torch.Tensor, neg_mask: torch.Tensor) -> torch.Tensor:
    """The word pieces both documents of each pair keep when pairs are length matched: min(|d+|, |d−|)."""
    return torch.minimum(pos_mask.sum(1), neg_mask.sum(1))


def length_matched_pairs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``CKCollator`` batch whose positive and negative of each pair keep the first
    min(|d+|, |d−|) word pieces each: the pair's longer document is cut to the shorter one's length."""
    keep = pair_cut(batch["pos_mask"], batch["neg_mask"])
    width = max(int(keep.max()), 1) if len(keep) else 1
    mask = torch.arange(width)[None, :] < keep[:, None]
    out = dict(batch)
    for side in ("pos", "neg"):
        out[f"{side}_mask"] = batch[f"{side}_mask"][:, :width] & mask
        out[f"{side}_ids"] = batch[f"{side}_ids"][:, :width] * out[f"{side}_mask"]
    return out


def matched_lengths(positives: list[str], negatives: list[str], config: CKConfig) -> list[int]:
    """What :func:`length_matched_pairs` keeps of each document of ``positives + negatives`` (texts,
    tokenised as ``CKCollator`` does), for ``explicit_training_statistics(..., keep=)``."""
    from ckray.rankers.ck_qti.model import tokenize

    _, pos_mask = tokenize(positives, config.max_doc_len, config.encoder)
    _, neg_mask = tokenize(negatives, config.max_doc_len, config.encoder)
    keep = pair_cut(pos_mask, neg_mask).tolist()
    return keep + keep


@dataclass
class CKTask(RankerTask):
    """CK-QTI / CK / TK: pairwise softmax loss over (q, d+, d−); IDF from the corpus (Eq. 9)."""

    config: "object"                     # ckray.rankers.ck_qti.model.CKConfig
    match_class: np.ndarray | None = None  # exact-match class per vocabulary id (CKConfig.exact_match "stems")
    doc_freq: np.ndarray | None = None   # corpus document frequency per vocabulary id (per class with match_class)
    n_docs: int = 0
    mean_doc_len: float | None = None
    # E[TF], E[|d|] of training triples (ckray.rankers.ck_qti.model.explicit_training_statistics): the explicit
    # match then starts as BM25 under batch scaling (CKModel.start_explicit_as_bm25)
    train_mean_tf: float | None = None
    train_mean_len: float | None = None
    name: str = "ck-qti"
    head_lr_multiplier: float = 1.0      # all but the (pretrained) word embeddings train this much faster
    # How a QTI model's dev candidates are scored when picking checkpoints: "impacts" = Σ of each
    # document's top-k term impacts, exactly what the impact index and ``ck-qti-rerank`` deploy;
    # "dense" = the model's forward (Σ over every query term, also those outside the top k)
    dev_scoring: str = "impacts"
    dev_top_k: int = ImpactConfig.top_k  # the impact index's defaults (its explicit_weight too)
    # Train as deployed: > 0 gates each query term by the document's top-k cut (CKModel.forward's
    # keep_top_k; 0 = the plain Σ over every query term), with temperature τ
    train_top_k: int = 0
    gate_temperature: float = 0.1
    # Each pair's longer document cut to the shorter one's word pieces (length_matched_pairs): a training
    # collection whose positives are shorter than its BM25 negatives then teaches no preference for length
    match_pair_lengths: bool = False

    def __post_init__(self) -> None:
        from ckray.errors import ConfigError

        if self.dev_scoring not in ("impacts", "dense"):
            raise ConfigError(f"--dev-scoring must be 'impacts' or 'dense', got {self.dev_scoring!r}")
        if self.dev_top_k < 1:
            raise ConfigError(f"CKTask.dev_top_k must be ≥ 1, got {self.dev_top_k}")
        if self.train_top_k < 0 or (self.train_top_k and not self.config.qti):
            raise ConfigError(f"--train-top-k must be ≥ 0 and needs a QTI model, got {self.train_top_k} "
                              f"with qti={self.config.qti}")
        if self.gate_temperature <= 0:
            raise ConfigError(f"--gate-temperature must be > 0, got {self.gate_temperature}")

    def build_model(self) -> torch.nn.Module:
        from ckray.rankers.ck_qti.model import CKModel

        model = CKModel(self.config)
        if self.match_class is not None:
            model.set_match_classes(self.match_class)
        if self.doc_freq is not None:
            # a copy: the task reaches workers through Ray, whose numpy arrays are read-only
            model.set_idf(torch.tensor(self.doc_freq), self.n_docs, self.mean_doc_len)
        if self.train_mean_tf is not None and self.train_mean_len is not None and self.mean_doc_len:
            model.start_explicit_as_bm25(self.train_mean_tf, self.train_mean_len, self.mean_doc_len)
        return model

    def collate(self, rows: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        from ckray.rankers.ck_qti.model import CKCollator

        batch = CKCollator(self.config)(rows)
        return length_matched_pairs(batch) if self.match_pair_lengths else batch

    def loss(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The pairwise softmax loss (``ckray.models.losses``) of the pair's scores, in float32."""
        from ckray.models.losses import pairwise_loss

        pos, neg = model.pairwise_scores(batch, self.train_top_k, self.gate_temperature)
        return pairwise_loss(pos.float(), neg.float())

    def score(self, model: torch.nn.Module, queries: list[str], docs: list[str], bm25: list[float]) -> torch.Tensor:
        return self.dev_scorer(model)(queries, docs, bm25)

    @property
    def _scores_dev_by_impacts(self) -> bool:
        return bool(self.config.qti) and self.dev_scoring == "impacts"

    @property
    def dev_scoring_forwards_per_chunk_fixed(self) -> bool:
        """Impact scoring encodes a chunk's new documents in length-sorted groups: a data-dependent count."""
        return not self._scores_dev_by_impacts

    def dev_scorer(self, model: torch.nn.Module) -> Callable[[list[str], list[str], list[float]], torch.Tensor]:
        """Dev scores. With QTI and ``dev_scoring="impacts"``: S_qd = Σ_{t∈q} s_td · 1[t ∈ top_k(d)]
        (``ckray.rankers.ck_qti.impact_rerank``), so checkpoints are chosen by the scoring that is deployed. The
        vocabulary's term vectors (expansion candidates) are encoded once per validation, and each
        distinct document once, however many queries and chunks it appears in."""
        if not self._scores_dev_by_impacts:
            return lambda queries, docs, bm25: model.score_texts(queries, docs)
        from ckray.rankers.ck_qti.impact_search import impact_score, impact_vector, query_term_counts
        from ckray.rankers.ck_qti.term_impacts import TermImpactScorer

        # validation has no corpus to count mean lengths in: a document read in windows (rare among dev's
        # candidates) gets each window's own exact-match score
        scorer = TermImpactScorer(model, ImpactConfig(top_k=self.dev_top_k, explicit_scope="window"))
        vectors: dict[str, dict[int, float]] = {}

        def impact_scores(queries: list[str], docs: list[str], bm25: list[float]) -> torch.Tensor:
            new = [d for d in dict.fromkeys(docs) if d not in vectors]
            vectors.update({d: impact_vector(t, w) for d, (t, w) in zip(new, scorer.score_texts(new))})
            bags = query_term_counts(queries, self.config.encoder)
            return torch.tensor([impact_score(bag, vectors[d]) for bag, d in zip(bags, docs)], dtype=torch.float32)

        return impact_scores

    def param_groups(self, model: torch.nn.Module, lr: float, weight_decay: float) -> list[dict] | None:
        """The pretrained word embeddings at ``lr``; the rest (Conformer blocks, kernels' MLP, the
        explicit term's w and b, α, the ReLU bias: all randomly or hand initialised) at
        ``head_lr_multiplier × lr``. None (one rate for all) when the multiplier is 1."""
        if self.head_lr_multiplier == 1.0:
            return None
        from ckray.training import weight_decay_groups

        embeddings = model.encoder.embed.weight
        rest = [p for p in model.parameters() if p is not embeddings]
        return (weight_decay_groups([embeddings], weight_decay, lr=lr)
                + weight_decay_groups(rest, weight_decay, lr=lr * self.head_lr_multiplier))
