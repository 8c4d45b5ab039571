"""Weight-space ensembles of a fine-tuned model and the model it started from (WiSE-FT).

Wortsman, Ilharco, Kim, Li, Kornblith, Roelofs, Gontijo-Lopes, Hajishirzi, Farhadi, Namkoong, Schmidt
(2022), "Robust fine-tuning of zero-shot models", CVPR. Eq. 1 of the paper::

    θ_α = (1 − α) · θ_0 + α · θ_1

with ``θ_0`` the weights before fine-tuning (here: the pretrained encoder, e.g. all-MiniLM-L6-v2, with the
model's own initialisation of any head) and ``θ_1`` the fine-tuned ones. Fine-tuning on one small
collection (SciFact's 800 training claims) moves an encoder trained on a billion pairs towards that
collection; the paper finds that the mix keeps most of the gain there and loses less under
distribution shift, at ``α = 0.5`` across its shifts. ``α = 1`` is the fine-tuned model. For CLEAR
trained on SciFact the mix kept SciFact's figure but did not help on CACM (``docs/transfer.md``).

The two models must share an architecture; the line is exact for every floating-point tensor and takes
integer buffers (position ids) from the fine-tuned model, where they must be equal.
"""

from __future__ import annotations

from typing import Mapping

import torch

from ckray.errors import ConfigError


def interpolate_weights(start: Mapping[str, torch.Tensor], tuned: Mapping[str, torch.Tensor],
                        alpha: float) -> dict[str, torch.Tensor]:
    """Eq. 1: ``(1 − α) · start + α · tuned`` for every floating-point tensor of ``tuned``."""
    if not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"the weight-ensemble α must be in [0, 1] (1: the fine-tuned weights alone), got {alpha}")
    missing = sorted(set(tuned) - set(start))
    if missing:
        raise ConfigError(f"cannot mix weights: the starting model has no {missing[:3]} (another architecture)")
    out: dict[str, torch.Tensor] = {}
    for name, theta_1 in tuned.items():
        theta_0 = start[name]
        if theta_0.shape != theta_1.shape:
            raise ConfigError(f"cannot mix weights: {name} is {tuple(theta_0.shape)} in the starting model and "
                              f"{tuple(theta_1.shape)} in the fine-tuned one")
        if theta_1.is_floating_point():
            out[name] = torch.lerp(theta_0.to(theta_1.dtype), theta_1, alpha)
        elif torch.equal(theta_0, theta_1):
            out[name] = theta_1
        else:
            raise ConfigError(f"cannot mix weights: the integer tensor {name} differs between the models")
    return out


def ensemble_with_start(model: torch.nn.Module, start: torch.nn.Module, alpha: float) -> torch.nn.Module:
    """Load Eq. 1's ``θ_α`` into ``model`` (holding ``θ_1``) from ``start`` (holding ``θ_0``); returns ``model``."""
    if alpha == 1.0:
        return model
    mixed = interpolate_weights(start.state_dict(), model.state_dict(), alpha)
    model.load_state_dict(mixed)
    return model
