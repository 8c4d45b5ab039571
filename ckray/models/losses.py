"""The pairwise ranking loss every model trains with (CEDR, QDS-Transformer, CK, CLEAR).

A training example is a query with a relevant document d+ and a non-relevant one d−, scored
``s+ = S(q, d+)`` and ``s− = S(q, d−)``:

* ``softmax``: the cross-entropy of d+ under a softmax over the pair (CEDR, QDS-Transformer, CK)::

      L = −log(e^{s+} / (e^{s+} + e^{s−})) = softplus(s− − s+) = −log σ(s+ − s−)

* ``hinge``: a margin ``m`` between the two scores::

      L = max(0, m − s+ + s−)

  ``m`` is a number, or a tensor with one margin per pair: CLEAR's residual margin
  ``m_r = ξ − λ_train · (s_lex(q, d+) − s_lex(q, d−))`` (``ckray.rankers.clear.model``, Eq. 6–7).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ckray.errors import ConfigError

PAIRWISE_LOSSES = ("softmax", "hinge")
REDUCTIONS = ("mean", "sum", "none")
PROBE_TRIPLES = 32   # training triples a [CLS] score head is fitted to by ``pairwise_probe`` (QDS, vanilla BERT)


def pairwise_loss(pos: torch.Tensor, neg: torch.Tensor, kind: str = "softmax", margin: float | torch.Tensor = 1.0,
                  reduction: str = "mean") -> torch.Tensor:
    """The pairwise loss (module docstring) of score pairs ``pos[i]``, ``neg[i]``, in their dtype.

    ``kind``: "softmax" or "hinge" (with ``margin``); ``reduction``: "mean" (default), "sum" or "none"
    (one loss per pair).
    """
    if kind == "softmax":
        loss = F.softplus(neg - pos)
    elif kind == "hinge":
        loss = torch.clamp(margin - pos + neg, min=0.0)
    else:
        raise ConfigError(f"pairwise loss must be one of {PAIRWISE_LOSSES}, not {kind!r}")
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ConfigError(f"reduction must be one of {REDUCTIONS}, not {reduction!r}")


def check_probe_triples(queries: Sequence[str], pos_docs: Sequence[str], neg_docs: Sequence[str]) -> None:
    """The (query, d+, d−) texts a warm head is fitted to must be aligned and non-empty: a clear error before
    any of them is encoded."""
    if not (len(queries) == len(pos_docs) == len(neg_docs)) or not len(queries):
        raise ValueError(f"warm_start_head needs aligned, non-empty triples, got {len(queries)} queries, "
                         f"{len(pos_docs)} relevant and {len(neg_docs)} non-relevant documents")


def pairwise_probe(pos: torch.Tensor, neg: torch.Tensor, l2: float = 1.0) -> torch.Tensor:
    """A linear scoring direction ``w`` fitted in closed form to pairs of feature vectors ``pos[i]``,
    ``neg[i]`` (``[N, H]``): ridge regression of ``(pos[i] − neg[i]) · w ≈ 1``, i.e.
    ``w = (DᵀD + l2·tr(DᵀD)/H · I)⁻¹ Dᵀ1`` with ``D = pos − neg`` (``l2`` relative to the mean
    eigenvalue, so it does not depend on the features' scale). The least-squares stand-in for the
    pairwise loss: a score head ``w · h`` initialised with it orders each pair's d+ above its d−
    as far as a linear function of the features can from ``N`` pairs. Computed in float64 → ``[H]``."""
    if pos.shape != neg.shape or pos.dim() != 2 or pos.shape[0] < 1:
        raise ValueError(f"pairwise_probe needs two [N, H] tensors with N >= 1, got {tuple(pos.shape)} "
                         f"and {tuple(neg.shape)}")
    d = (pos - neg).double()
    gram = d.T @ d
    ridge = l2 * gram.trace().clamp(min=1e-12) / gram.shape[0]
    w = torch.linalg.solve(gram + ridge * torch.eye(gram.shape[0], dtype=d.dtype), d.sum(dim=0))
    return w.to(pos.dtype)
