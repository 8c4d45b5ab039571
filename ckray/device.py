"""The one place that asks "is there a GPU?". Everything else is device-agnostic."""

from __future__ import annotations

from pathlib import Path

import torch

# CPU flags of native bf16 arithmetic (x86): without one, bf16 matmuls are emulated, many times slower than fp32
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def has_gpu() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    return torch.device("cuda" if has_gpu() else "cpu")


def default_dtype() -> torch.dtype:
    """bf16 on GPUs, fp32 on CPU (DeepSpeed's CPU path is tested in fp32)."""
    return torch.bfloat16 if has_gpu() else torch.float32


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes bf16 natively (an x86 flag of ``CPU_BF16_FLAGS`` in ``cpuinfo``); None when
    it cannot tell (no such file, or not an x86 CPU)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), None)
    if flags is None:
        return None
    return any(f in flags for f in CPU_BF16_FLAGS)
