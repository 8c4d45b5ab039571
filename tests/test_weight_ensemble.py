"""WiSE-FT's weight-space mix (``ckray.models.weight_ensemble``, Eq. 1), on real modules."""

from __future__ import annotations

import pytest
import torch

from ckray.errors import ConfigError
from ckray.models.weight_ensemble import ensemble_with_start, interpolate_weights


def _pair(seed_start: int = 0, seed_tuned: int = 1) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(seed_start)
    start = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    torch.manual_seed(seed_tuned)
    tuned = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 2))
    return start, tuned


def test_the_mix_lies_on_the_line_between_the_two_models():
    start, tuned = _pair()
    s, t = start.state_dict(), tuned.state_dict()
    for alpha in (0.0, 0.3, 1.0):
        mixed = interpolate_weights(s, t, alpha)
        for name in t:
            assert torch.allclose(mixed[name], (1 - alpha) * s[name] + alpha * t[name], atol=1e-7), (alpha, name)
    assert torch.equal(interpolate_weights(s, t, 0.0)["1.weight"], s["1.weight"])


def test_the_mixed_model_scores_between_its_ends_for_a_linear_layer():
    start, tuned = _pair()
    x = torch.randn(3, 4)
    lin_s, lin_t = start[1](x), tuned[1](x)        # a linear map is linear in its weights
    mixed = ensemble_with_start(tuned, start, 0.5)
    assert torch.allclose(mixed[1](x), 0.5 * (lin_s + lin_t), atol=1e-6)


def test_integer_buffers_are_kept_and_must_agree():
    s = {"w": torch.zeros(2), "position_ids": torch.arange(5)}
    t = {"w": torch.ones(2), "position_ids": torch.arange(5)}
    mixed = interpolate_weights(s, t, 0.5)
    assert torch.equal(mixed["position_ids"], torch.arange(5)) and torch.allclose(mixed["w"], torch.full((2,), 0.5))
    with pytest.raises(ConfigError, match="position_ids differs"):
        interpolate_weights({**s, "position_ids": torch.arange(1, 6)}, t, 0.5)


def test_models_of_other_shapes_or_an_alpha_outside_0_1_are_refused():
    start, tuned = _pair()
    with pytest.raises(ConfigError, match=r"1\.weight is \(3, 4\) in the starting model and \(2, 4\)"):
        interpolate_weights({**start.state_dict(), "1.weight": torch.zeros(3, 4)}, tuned.state_dict(), 0.5)
    with pytest.raises(ConfigError, match=r"has no \['1\.bias'\]"):
        interpolate_weights({k: v for k, v in start.state_dict().items() if k != "1.bias"}, tuned.state_dict(), 0.5)
    with pytest.raises(ConfigError, match=r"in \[0, 1\].*got 1\.5"):
        interpolate_weights(start.state_dict(), tuned.state_dict(), 1.5)
