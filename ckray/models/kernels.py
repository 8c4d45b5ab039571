"""RBF kernel pooling shared by CK (implicit match) and CEDR-KNRM.

K-NRM (Xiong et al. 2017), Eq. 3-4: for a cosine-similarity matrix ``M[q, d]``
    K_k(M_q) = Σ_d exp(-(M_qd - μ_k)² / (2σ_k²))          (soft term frequency per kernel)
    φ(M)     = Σ_q log K(M_q)                              (log-sum over query terms)
Padding positions contribute nothing: their kernel values are multiplied by the document mask.
"""

from __future__ import annotations

import torch
from torch import nn


def kernel_centres(n_kernels: int = 11, sigma: float = 0.1, exact_sigma: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """K-NRM's kernel placement: one exact-match kernel at μ=1 (σ tiny) and n-1 soft kernels
    evenly spaced over [-1, 1) at μ = 0.9, 0.7, …, -0.9 (for n=11)."""
    if n_kernels < 2:
        raise ValueError("n_kernels must be at least 2")
    step = 2.0 / (n_kernels - 1)
    mus = [1.0] + [1.0 - step / 2 - i * step for i in range(n_kernels - 1)]
    sigmas = [exact_sigma] + [sigma] * (n_kernels - 1)
    return torch.tensor(mus), torch.tensor(sigmas)


class RBFKernels(nn.Module):
    """Maps similarities ``[..., d]`` to kernel activations ``[..., d, K]`` (padding zeroed)."""

    def __init__(self, n_kernels: int = 11, sigma: float = 0.1, exact_sigma: float = 1e-3):
        super().__init__()
        mus, sigmas = kernel_centres(n_kernels, sigma, exact_sigma)
        self.register_buffer("mus", mus, persistent=False)
        self.register_buffer("sigmas", sigmas, persistent=False)

    @property
    def n_kernels(self) -> int:
        return int(self.mus.numel())

    def forward(self, sim: torch.Tensor, doc_mask: torch.Tensor | None = None) -> torch.Tensor:
        scale = -0.5 / self.sigmas**2                    # exp(-(s - μ)² / 2σ²) = exp((s - μ)² · scale)
        if torch.is_grad_enabled() and sim.requires_grad:
            k = torch.exp((sim.unsqueeze(-1) - self.mus) ** 2 * scale)
            return k if doc_mask is None else k * doc_mask.unsqueeze(-1).to(k.dtype)
        # inference (impact building, dev scoring, reranking): one [..., d, K] tensor, updated in
        # place, instead of a temporary per operation (2.6x faster on 2 CPU cores at [16, 200, 400])
        k = (sim.unsqueeze(-1) - self.mus).square_().mul_(scale).exp_()
        return k if doc_mask is None else k.mul_(doc_mask.unsqueeze(-1).to(k.dtype))


def soft_tf(kernels: torch.Tensor) -> torch.Tensor:
    """Σ over the document axis: ``[..., d, K] -> [..., K]`` (K-NRM Eq. 3)."""
    return kernels.sum(dim=-2)


def log_soft_tf(kernels: torch.Tensor, floor: float = 1e-10) -> torch.Tensor:
    """log of the soft term frequency, floored so empty kernels give log(floor), not -inf (K-NRM Eq. 4)."""
    return torch.log(torch.clamp(soft_tf(kernels), min=floor))


# --------------------------------------------------------------------------- windowed kernel pooling
# TKL (Hofstätter et al. 2020) and CK (Mitra et al. 2020, Eq. 11-16) pool kernels over fixed-size
# windows of a long document instead of over the whole document. Windows are ``window`` positions
# long and start at 0, stride, 2·stride, … — every start inside the (padded) document, so padding a
# document further only adds windows that hold no real token.


def window_count(length: int, stride: int) -> int:
    """Number of windows over ``length`` positions: one per start 0, stride, … < length (at least 1)."""
    return max(1, -(-int(length) // int(stride)))


def windowed_length(length: int, window: int, stride: int) -> int:
    """Length the document axis must be zero-padded to so that every window is complete."""
    return (window_count(length, stride) - 1) * stride + window


def pad_for_windows(x: torch.Tensor, window: int, stride: int, dim: int = -1) -> torch.Tensor:
    """Zero-pad ``x`` along ``dim`` to ``windowed_length`` (a no-op when already long enough)."""
    dim = dim % x.dim()
    extra = windowed_length(x.shape[dim], window, stride) - x.shape[dim]
    if extra <= 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return torch.nn.functional.pad(x, pad)


def windowed_soft_tf(kernels: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """Soft term frequency per document window: ``[..., d, K] -> [..., n_windows, K]``.

    The windowed form of K-NRM Eq. 3 (Σ over the positions of each window); padding must already be
    zeroed in ``kernels`` (``RBFKernels(sim, doc_mask)`` does that)."""
    kernels = pad_for_windows(kernels, window, stride, dim=-2)
    return kernels.unfold(-2, window, stride).sum(-1)


def window_mask(doc_mask: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """``[..., d] -> [..., n_windows]`` bool: the windows that hold at least one real token."""
    m = pad_for_windows(doc_mask.to(torch.float32), window, stride, dim=-1)
    return m.unfold(-1, window, stride).sum(-1) > 0
