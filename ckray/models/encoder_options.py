"""The flags of a pretrained encoder that several rankers fine-tune, declared once: which encoder
(CLEAR, CEDR, QDS-Transformer) and how a cross-encoder trains it (CEDR, QDS-Transformer;
``ckray.models.encoders.freeze_bottom_layers`` and ``set_attention_dropout`` apply them).

Each function returns a new dataclass field, so a ranker's options declare the flag in their own place::

    @dataclass(frozen=True)
    class CEDROptions:
        encoder: str = encoder_option()
        frozen_layers: int = frozen_layers_option()

Imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

from ckray.models import DEFAULT_ENCODER
from ckray.options import option


def encoder_option() -> Any:
    """``--encoder``: the pretrained encoder a ranker starts from."""
    return option(DEFAULT_ENCODER, "Hugging Face id or directory of a BERT encoder")


def frozen_layers_option() -> Any:
    """``--frozen-layers``: the bottom encoder layers left untrained."""
    return option(0, "do not train the bottom N encoder layers, the embedding layer counted as layer 0 "
                     "(1: the embeddings; 1 + k: also the first k transformer layers)")


def attention_dropout_option() -> Any:
    """``--attention-dropout``: the encoder's attention-probability dropout in training."""
    return option(None, "attention-probability dropout of the encoder's layers in training (default: the "
                        "encoder's own, 0.1 in MiniLM); 0 about doubles a CPU step's pairs/s")
