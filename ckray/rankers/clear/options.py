"""CLEAR's typed training options: the model flags of ``jobs/train_clear.py``, one field each."""

from __future__ import annotations

from dataclasses import dataclass

from ckray.models import DEFAULT_ENCODER
from ckray.options import option


@dataclass(frozen=True)
class CLEAROptions:
    encoder: str = option(DEFAULT_ENCODER, "Hugging Face id or directory of a BERT encoder")
    doc_max_len: int = option(256, "document word pieces the encoder reads")
    xi: float = option(0.2, "ξ, the margin before the lexical residual")
    lambda_train: float = option(0.05, "λ_train, weight of the BM25 gap in the margin")
    constant_margin: bool = option(False, "ablation: m = ξ (no lexical residual)")
    name: str | None = option(None, "checkpoint name under W/checkpoints (default: clear; clear-constant with "
                                    "--constant-margin)")

    @property
    def checkpoint_name(self) -> str:
        return self.name or ("clear-constant" if self.constant_margin else "clear")
