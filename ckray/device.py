"""The one place that asks "is there a GPU?". Everything else is device-agnostic."""

from __future__ import annotations

import torch


def has_gpu() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    return torch.device("cuda" if has_gpu() else "cpu")


def default_dtype() -> torch.dtype:
    """bf16 on GPUs, fp32 on CPU (DeepSpeed's CPU path is tested in fp32)."""
    return torch.bfloat16 if has_gpu() else torch.float32
