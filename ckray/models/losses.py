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

import torch
import torch.nn.functional as F

from ckray.errors import ConfigError

PAIRWISE_LOSSES = ("softmax", "hinge")
REDUCTIONS = ("mean", "sum", "none")


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
