"""QDS-Transformer: a long-document BERT cross-encoder with query-directed sparse attention.

Jiang, Xiong, Lee, Wang (2020), "Long Document Ranking with Query-Directed Sparse Transformer",
Findings of EMNLP 2020, arXiv:2010.12683.

Input (§3): one sequence per (query, document) pair, the document split into sentences, each
opened by a sentence-start token::

    [CLS] q₁ … q_m [SEP] [SOS] s₁,₁ … s₁,ₖ [SOS] s₂,₁ … [SEP]          (up to ``max_length`` tokens)

[SOS] is a reserved vocabulary entry (``[unused1]`` in BERT's WordPiece vocabulary); sentences come
from a simple punctuation regex. Segment ids are 0 for ``[CLS] query [SEP]`` and 1 for the rest.

Attention (Eq. 7–10): every layer's self-attention is replaced by
``A_QDS = A_local ∪ A_sent ∪ A_query ∪ A_[CLS]`` — a local window of w tokens, every token attends to
every [SOS], and the query tokens and [CLS] attend to and are attended by every token — computed by
``ckray.models.sparse_attention.qds_attention`` in O(n·(w + g)). ``pattern="longformer-qa"`` (local +
[CLS]/query global, no [SOS] hierarchy) and ``pattern="local"`` are the ablations.

Weights: a pretrained BERT (default: the offline all-MiniLM-L6-v2, 6 layers, 384 hidden, 12 heads,
512 positions). Everything except the attention pattern is BERT's own layer: the query/key/value
projections, the attention output dense + LayerNorm, the intermediate and output feed-forward +
LayerNorm are the ``BertLayer`` submodules, run by ``QDSTransformer._layer`` below. Position
embeddings are extended past 512 by copying the pretrained table (row i ← row i mod 512), as
Longformer did. The relevance score is a linear head on the final [CLS] vector.

Score heads (``head``):

* ``"cls"`` (the paper's): ``s = w · h_[CLS] + b``.
* ``"pooled"``: ``s = w · h_[CLS] + b + γ · cos(q̄, d̄)``, q̄ and d̄ the means of the final vectors of the
  query's and the document's word pieces in the same joint encoding, γ a learned scalar. MiniLM was
  trained as a bi-encoder on exactly this cosine (mean pooling, scale 20), so the term ranks before
  any fine-tuning; the [CLS] term learns what it adds. The attention is the paper's either way.
* ``"maxsim"``: ``s = w · h_[CLS] + b + γ · (1/m) Σ_i max_j cos(h_qi, h_dj)``, the late interaction of
  ColBERT (Khattab & Zaharia 2020, Eq. 3; here the mean over the m query word pieces, not the sum) read
  from the same joint encoding: each query word piece's best-matching document word piece. Unlike the
  pooled cosine it does not average the query's vectors, which QDS's global attention has mixed with
  the whole document, into one; at step 0 it ranks level with the zero-shot MiniLM bi-encoder on
  SciFact dev, the pooled cosine well below it (docs/results.md, "Warm-started cross-encoders").

Query weights of the MaxSim head (``query_weights``): ``"uniform"``, the mean above, or ``"idf"``, the
mean weighted by each query word piece's IDF in the collection being reranked,
``Σ_i idf(q_i) · max_j cos(h_qi, h_dj) / Σ_i idf(q_i)``, as BM25 weights its query terms (Robertson &
Zaragoza 2009, Eq. 3.3's IDF; ``ckray.data.statistics.bm25_idf``), so "the" and "of" count less than the
words that carry the query. The IDF comes from the collection a checkpoint reranks, not the one it was
trained on (``set_collection_statistics``, called by ``ckray.rerank.CheckpointReranker`` with its work
directory's word-piece statistics); the checkpoint keeps its training collection's for use without one.

Warm start (``head_init="warm"``; ``"random"``: the paper's N(0, 0.02) head, and γ = 0). With
``head="cls"`` the head's initial weight is the pairwise probe of a few training triples
(``QDSTransformer.warm_start_head``, ``ckray.models.losses.pairwise_probe``): the linear function of
the untrained model's [CLS] vector that best orders each d+ above its d−, bias 0, fitted by the
training task before step 0. With ``head="pooled"`` or ``"maxsim"`` w = 0, b = 0 and γ = 20: the step-0
score is that similarity, and no training triple is needed. Only initial values change.

With a window covering the whole sequence the model is exactly BERT on ``[CLS] q [SEP] d [SEP]``
(plus the [SOS] tokens), which ``tests/test_qds_model.py`` checks. Encoders: BERT-family models
whose layers have BERT's submodules and whose positions start at 0 (BERT, MiniLM, ELECTRA);
RoBERTa's position offset and vocabulary (no ``[unused*]`` tokens) are not handled.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModel

from ckray.data.statistics import CorpusStats, Tokenisation
from ckray.errors import ConfigError
from ckray.models.encoders import (DEFAULT_ENCODER, architecture_of, encoder_config, encoder_training_checks,
                                   freeze_bottom_layers, load_tokenizer, mean_pool, resolve_encoder,
                                   set_attention_dropout)
from ckray.models.losses import check_probe_triples, pairwise_loss, pairwise_probe
from ckray.models.sparse_attention import PATTERNS, build_layout, dense_mask, fused_masked_attention, qds_attention


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

HEAD_INITS = ("warm", "random")
HEADS = ("cls", "pooled", "maxsim")
ATTENTION_KERNELS = ("auto", "sparse", "fused-mask")
SIMILARITY_HEADS = ("pooled", "maxsim")   # the heads with a γ · similarity term
QUERY_WEIGHTS = ("uniform", "idf")        # how the MaxSim head averages over the query's word pieces
POOLED_SCALE = 20.0   # γ of a warm similarity head: the cosine scale MiniLM's bi-encoder was trained at

FUSED_CPU_MAX_LENGTH = 512   # on a CPU, inputs up to this long run faster with the fused kernel (no attention dropout)


def resolve_attention_kernel(kernel: str, device_type: str, reduced_precision: bool, attention_dropout: bool,
                             length: int) -> str:
    """The kernel ``QDSConfig.attention_kernel`` stands for (docs/gpu.md, ``bench/qds_kernels.py`` and
    ``bench/rerank_train_speed.py`` measured each rule); ``attention_dropout``: are attention
    probabilities dropped (training with an attention dropout above 0)?

    * on CUDA, ``auto`` is the fused-mask kernel in bf16/fp16 (autocast or a half-precision model): an
      H200 trains 1.09× (2,048 tokens) to 1.47× (512) the sparse kernel's pairs/s with it, while in fp32
      at 2,048 tokens the sparse kernel is 1.17× faster;
    * on a CPU, ``auto`` is the fused-mask kernel for inputs of at most ``FUSED_CPU_MAX_LENGTH`` tokens
      when no attention probability is dropped: scoring runs 1.22× (fp32) to 1.68× (bf16) the sparse
      kernel's pairs/s at 512 tokens (1.00× and 1.18× at 1,024, 0.69× and 0.75× at 2,048), and a
      training step without attention dropout about 1.2×; with attention dropout torch's fused attention
      leaves its fast path on a CPU and a training step runs 0.43× (fp32) the sparse kernel's pairs/s,
      so the sparse kernel stays there.
    """
    if kernel != "auto":
        return kernel
    if device_type == "cuda":
        return "fused-mask" if reduced_precision else "sparse"
    return "fused-mask" if not attention_dropout and length <= FUSED_CPU_MAX_LENGTH else "sparse"


@dataclass
class QDSConfig:
    """Hyperparameters of the QDS-Transformer (everything needed to rebuild it from a checkpoint).

    encoder:          Hugging Face id or directory of a BERT-family encoder (absolute positions) and
                      its tokenizer.
    max_length:       tokens per (query, document) sequence, [CLS]/[SEP]/[SOS] included (paper: 2048).
    max_query_length: query word pieces kept.
    window:           local attention span w: token i sees j when |i − j| ≤ w // 2 (Eq. 7).
    pattern:          "qds" (Eq. 7–10), "longformer-qa" (local + [CLS]/query global) or "local".
    sentence_rows_global: also let [SOS] rows attend to every token (symmetric sentence hierarchy).
    sos_token:        the vocabulary entry used as [SOS].
    block_size:       band block of the sparse attention (None: w // 2).
    attention_kernel: how the pattern's attention is computed, never what: "sparse"
                      (``qds_attention``, O(n·(w + g)) memory), "fused-mask" (torch's fused SDPA under
                      the materialised [n, n] mask, ``fused_masked_attention``: faster on GPUs in bf16)
                      or "auto" (``resolve_attention_kernel``: fused-mask on CUDA in bf16/fp16 and on a CPU
                      for inputs of at most 512 tokens without attention dropout, else sparse).
    num_layers:       keep only the first layers of the encoder (None: all).
    gradient_checkpointing: recompute each layer in the backward pass (memory for long inputs).
    frozen_layers:    bottom layers not trained, the embedding layer counted as layer 0
                      (``ckray.models.encoders.freeze_bottom_layers``): less backward work per pair.
    attention_dropout: the encoder's attention-probability dropout in training (None: its own, 0.1 in
                      MiniLM; ``ckray.models.encoders.set_attention_dropout``).
    head:             "cls" (the paper's ``w · h_[CLS] + b``), "pooled" (plus ``γ · cos(q̄, d̄)``) or
                      "maxsim" (plus γ · ColBERT's MaxSim), module docstring.
    query_weights:    how the MaxSim head averages its query word pieces' best matches: "uniform" or
                      "idf" (weighted by their IDF in the collection being reranked, module docstring).
    head_init:        "warm" (the score head fitted by ``warm_start_head`` before training, module
                      docstring) or "random"; recorded so a checkpoint says how its training started.
    pretrained:       load pretrained encoder weights in ``__init__``. A constructed model records the
                      (position-extended) architecture in ``bert_config`` and sets this to False in
                      ``self.config``, so a checkpoint rebuilds it without fetching weights.
    bert_config:      encoder architecture (a ``transformers`` config dict); with ``pretrained=False``
                      the encoder is built from it with random weights (tests use a tiny one).
    """

    encoder: str = DEFAULT_ENCODER
    max_length: int = 2048
    max_query_length: int = 64
    window: int = 128
    pattern: str = "qds"
    sentence_rows_global: bool = False
    sos_token: str = "[unused1]"
    block_size: int | None = None
    attention_kernel: str = "auto"
    num_layers: int | None = None
    gradient_checkpointing: bool = False
    frozen_layers: int = 0
    attention_dropout: float | None = None
    head_init: str = "random"
    head: str = "cls"
    query_weights: str = "uniform"
    pretrained: bool = True
    bert_config: dict[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        self.encoder = str(self.encoder)
        checks = {
            "pattern": (self.pattern in PATTERNS, f"must be one of {PATTERNS}, got {self.pattern!r}"),
            "head_init": (self.head_init in HEAD_INITS, f"must be one of {HEAD_INITS}, got {self.head_init!r}"),
            "attention_kernel": (self.attention_kernel in ATTENTION_KERNELS,
                                 f"must be one of {ATTENTION_KERNELS}, got {self.attention_kernel!r}"),
            "head": (self.head in HEADS, f"must be one of {HEADS}, got {self.head!r}"),
            "query_weights": (self.query_weights in QUERY_WEIGHTS and (self.query_weights == "uniform"
                                                                       or self.head == "maxsim"),
                              f"must be one of {QUERY_WEIGHTS}, and 'idf' needs head='maxsim', got "
                              f"{self.query_weights!r} with head={self.head!r}"),
            "window": (self.window >= 0, f"must be >= 0, got {self.window}"),
            **encoder_training_checks(self.frozen_layers, self.attention_dropout),
            "max_length": (self.max_query_length >= 1 and self.max_length >= self.max_query_length + 4,
                           f"must leave room for max_query_length={self.max_query_length} + [CLS], [SEP], "
                           f"[SOS], [SEP], got {self.max_length}"),
        }
        ConfigError.check_fields("QDSConfig", checks)


# ---------------------------------------------------------------------------------------------
# Input: [CLS] query [SEP] [SOS] sentence … [SEP]
# ---------------------------------------------------------------------------------------------

_SENTENCE_BREAK = re.compile(r"(?<=[.!?])\s+|\n+")


def collection_tokenisation(config: QDSConfig) -> Tokenisation | None:
    """How the word-piece statistics a QDS model reads are counted: its tokenizer, documents truncated at
    ``max_length``; None when it reads none (``query_weights="uniform"``)."""
    if config.query_weights != "idf":
        return None
    return Tokenisation(config.encoder, load_tokenizer(config.encoder).vocab_size, config.max_length)


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text``: breaks after ``.``, ``!``, ``?`` followed by white space, and at newlines."""
    return [s for s in (p.strip() for p in _SENTENCE_BREAK.split(text)) if s]


def encode_pairs(tokenizer, queries: Sequence[str], docs: Sequence[str], config: QDSConfig,
                 pad_to_multiple_of: int = 8) -> dict[str, torch.Tensor]:
    """Tokenise (query, document) pairs into one padded batch of QDS sequences.

    Returns ``input_ids``, ``token_type_ids`` (long), and ``attention_mask`` (real tokens),
    ``global_mask`` ([CLS] + query tokens, Eq. 9–10), ``sentence_mask`` ([SOS] tokens, Eq. 8) (bool),
    all ``[B, n]``. Documents are cut at ``config.max_length`` tokens; a sentence that does not fit
    is truncated and the rest dropped.
    """
    if len(queries) != len(docs):
        raise ValueError(f"need aligned lists, got {len(queries)} queries and {len(docs)} documents")
    sos = tokenizer.convert_tokens_to_ids(config.sos_token)
    if sos is None or sos == tokenizer.unk_token_id:
        raise ConfigError(f"QDSConfig.sos_token {config.sos_token!r} is not in the vocabulary of "
                          f"{config.encoder}; pick a reserved/unused token of that tokenizer")
    cls, sep, pad = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
    limit = config.max_length
    query_ids = tokenizer([str(q) for q in queries], add_special_tokens=False, truncation=True,
                          max_length=config.max_query_length)["input_ids"]
    # No document sentence can use more than max_length tokens; cap the text read accordingly.
    sentences = [split_sentences(str(d)[: 12 * limit]) for d in docs]
    flat = [s for ss in sentences for s in ss]
    flat_ids = tokenizer(flat, add_special_tokens=False, truncation=True,
                         max_length=limit)["input_ids"] if flat else []

    rows: list[tuple[list[int], int, list[int]]] = []      # (ids, query length, [SOS] positions)
    cursor = 0
    for q_ids, doc_sentences in zip(query_ids, sentences):
        ids = [cls, *q_ids, sep]
        sos_positions = []
        for s_ids in flat_ids[cursor: cursor + len(doc_sentences)]:
            room = limit - 1 - len(ids)                        # keep one slot for the final [SEP]
            if room < 2:
                break
            sos_positions.append(len(ids))
            ids += [sos, *s_ids[: room - 1]]
        cursor += len(doc_sentences)
        rows.append((ids + [sep], len(q_ids), sos_positions))

    n = max(len(ids) for ids, _, _ in rows)
    n = min(limit, math.ceil(n / pad_to_multiple_of) * pad_to_multiple_of) if pad_to_multiple_of else n
    batch = {
        "input_ids": torch.full((len(rows), n), pad, dtype=torch.long),
        "token_type_ids": torch.zeros(len(rows), n, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), n, dtype=torch.bool),
        "global_mask": torch.zeros(len(rows), n, dtype=torch.bool),
        "sentence_mask": torch.zeros(len(rows), n, dtype=torch.bool),
    }
    for i, (ids, q_len, sos_positions) in enumerate(rows):
        batch["input_ids"][i, : len(ids)] = torch.tensor(ids)
        batch["token_type_ids"][i, q_len + 2: len(ids)] = 1
        batch["attention_mask"][i, : len(ids)] = True
        batch["global_mask"][i, : q_len + 1] = True
        batch["sentence_mask"][i, sos_positions] = True
    return batch


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

class QDSTransformer(nn.Module):
    """BERT layers with QDS attention; ``score = w · h_[CLS] + b`` (``+ γ · similarity`` with ``head="pooled"``
    or ``"maxsim"``)."""

    def __init__(self, config: QDSConfig | None = None):
        super().__init__()
        config = config or QDSConfig()
        bert = self._build_encoder(config)
        _extend_positions(bert, config.max_length)
        freeze_bottom_layers(bert, config.frozen_layers)
        set_attention_dropout(bert, config.attention_dropout)
        self.bert = bert
        hidden = bert.config.hidden_size
        self.dropout = nn.Dropout(bert.config.hidden_dropout_prob)
        self.score = nn.Linear(hidden, 1)
        nn.init.normal_(self.score.weight, std=bert.config.initializer_range)
        nn.init.zeros_(self.score.bias)
        if config.head in SIMILARITY_HEADS:
            warm = config.head_init == "warm"
            # shape [1], not a 0-dim scalar: DeepSpeed broadcasts parameters as byte views
            self.similarity_scale = nn.Parameter(torch.full((1,), POOLED_SCALE if warm else 0.0))
            if warm:
                nn.init.zeros_(self.score.weight)
        if config.query_weights == "idf":
            # IDF of each word piece in the collection being reranked: ones until set_collection_statistics
            self.register_buffer("piece_idf", torch.ones(bert.config.vocab_size))
        self.config = replace(config, pretrained=False, bert_config=architecture_of(bert.config))
        self.tokenizer = load_tokenizer(config.encoder)

    @staticmethod
    def _build_encoder(config: QDSConfig) -> nn.Module:
        hf_config = encoder_config(config.encoder, None if config.pretrained else config.bert_config)
        if config.num_layers is not None:
            hf_config.num_hidden_layers = config.num_layers
        if config.pretrained:
            return AutoModel.from_pretrained(resolve_encoder(config.encoder), config=hf_config,
                                             add_pooling_layer=False)
        return AutoModel.from_config(hf_config, add_pooling_layer=False)

    @property
    def device(self) -> torch.device:
        return self.score.weight.device

    # -- collection statistics (query_weights="idf") --------------------------------------------

    @property
    def collection_tokenisation(self) -> Tokenisation | None:
        """How the word-piece statistics this model reads are counted (None: it reads none)."""
        return collection_tokenisation(self.config)

    @torch.no_grad()
    def set_collection_statistics(self, stats: CorpusStats) -> None:
        """Weight the MaxSim head's query word pieces by their IDF in ``stats``' collection."""
        if self.collection_tokenisation is None:
            raise ConfigError("set_collection_statistics: this QDS model reads no collection statistics "
                              f"(query_weights={self.config.query_weights!r})")
        if stats.doc_freq.numel() != self.piece_idf.numel():
            raise ConfigError(f"collection statistics of {stats.doc_freq.numel()} word pieces do not fit this QDS "
                              f"model's vocabulary of {self.piece_idf.numel()} ({self.config.encoder})")
        self.piece_idf.copy_(stats.idf.to(self.piece_idf))

    def head_parameters(self) -> list[nn.Parameter]:
        """The score head's parameters: ``w``, ``b`` and, with a similarity head, ``γ``."""
        return [*self.score.parameters(), *([self.similarity_scale] if self.config.head in SIMILARITY_HEADS else [])]

    # -- forward ----------------------------------------------------------------------------------

    def _layer(self, layer: nn.Module, hidden: torch.Tensor, attend: Callable) -> torch.Tensor:
        """One ``BertLayer`` with its self-attention computed by ``attend(q, k, v, dropout_p, scale)``."""
        attn = layer.attention.self
        bsz, n, _ = hidden.shape

        def heads(x: torch.Tensor) -> torch.Tensor:                          # [B, n, H·d] → [B, H, n, d]
            return x.view(bsz, n, attn.num_attention_heads, attn.attention_head_size).transpose(1, 2)

        q, k, v = heads(attn.query(hidden)), heads(attn.key(hidden)), heads(attn.value(hidden))
        context = attend(q, k, v, dropout_p=attn.dropout.p if self.training else 0.0,
                         scale=attn.attention_head_size ** -0.5)
        context = context.transpose(1, 2).reshape(bsz, n, -1)
        hidden = layer.attention.output(context, hidden)               # dense, dropout, LN(x + ·)
        return layer.output(layer.intermediate(hidden), hidden)        # FFN, dropout, LN(x + ·)

    def encode(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Final hidden states ``[B, n, hidden]`` of a batch from ``encode_pairs``."""
        input_ids = batch["input_ids"].to(self.device)
        bsz, n = input_ids.shape
        if n > self.bert.config.max_position_embeddings:
            raise ConfigError(f"sequence of {n} tokens exceeds max_length={self.config.max_length}")
        position_ids = torch.arange(n, device=self.device).expand(bsz, n)
        hidden = self.bert.embeddings(input_ids=input_ids, position_ids=position_ids,
                                      token_type_ids=batch["token_type_ids"].to(self.device))
        attend = self._attention(batch)
        for layer in self.bert.encoder.layer:
            if self.config.gradient_checkpointing and self.training:
                hidden = checkpoint(self._layer, layer, hidden, attend, use_reentrant=False)
            else:
                hidden = self._layer(layer, hidden, attend)
        return hidden

    def _attention(self, batch: Mapping[str, torch.Tensor]) -> Callable:
        """``attend(q, k, v, dropout_p, scale)`` under the batch's QDS pattern (Eq. 7–10), with what the
        pattern needs built once for all layers: the sparse layout, or the dense mask for the fused kernel."""
        cfg = self.config
        masks = (batch["attention_mask"].to(self.device), cfg.window, batch["global_mask"].to(self.device),
                 batch["sentence_mask"].to(self.device))
        half = torch.is_autocast_enabled(self.device.type) or self.bert.dtype != torch.float32
        drops = self.training and any(layer.attention.self.dropout.p > 0 for layer in self.bert.encoder.layer)
        length = batch["attention_mask"].shape[1]
        if resolve_attention_kernel(cfg.attention_kernel, self.device.type, half, drops, length) == "fused-mask":
            mask = dense_mask(*masks, pattern=cfg.pattern, sentence_rows_global=cfg.sentence_rows_global)
            return functools.partial(fused_masked_attention, mask=mask)
        layout = build_layout(*masks, pattern=cfg.pattern, sentence_rows_global=cfg.sentence_rows_global,
                              block_size=cfg.block_size)
        return functools.partial(qds_attention, layout=layout)

    def forward(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Relevance scores ``[B]`` of a batch from ``encode_pairs`` (or ``build_batch``)."""
        hidden = self.encode(batch)
        score = self.score(self.dropout(hidden[:, 0])).squeeze(-1)
        if self.config.head == "pooled":
            score = score + self.similarity_scale * pooled_similarity(hidden, batch)
        elif self.config.head == "maxsim":
            score = score + self.similarity_scale * maxsim_similarity(hidden, batch, self.query_piece_weights())
        return score

    def query_piece_weights(self) -> torch.Tensor | None:
        """``[V]`` weight of each vocabulary id as a query word piece of the MaxSim head (None: uniform)."""
        return self.piece_idf if self.config.query_weights == "idf" else None

    def cls_vectors(self, queries: Sequence[str], docs: Sequence[str], batch_size: int = 8) -> torch.Tensor:
        """Final [CLS] vectors ``[N, hidden]`` (fp32, CPU) of aligned (query, document) texts; no gradient,
        eval mode (mode restored)."""
        was_training = self.training
        self.eval()
        try:
            with torch.no_grad():
                return torch.cat([self.encode(self.build_batch(queries[i:i + batch_size], docs[i:i + batch_size]))
                                  [:, 0].float().cpu() for i in range(0, len(docs), batch_size)])
        finally:
            self.train(was_training)

    @torch.no_grad()
    def warm_start_head(self, queries: Sequence[str], pos_docs: Sequence[str], neg_docs: Sequence[str],
                        batch_size: int = 8) -> None:
        """Set the score head to the pairwise probe of (query, d+, d−) triples (module docstring)."""
        check_probe_triples(queries, pos_docs, neg_docs)
        pos = self.cls_vectors(queries, pos_docs, batch_size)
        neg = self.cls_vectors(queries, neg_docs, batch_size)
        self.score.weight.copy_(pairwise_probe(pos, neg)[None].to(self.score.weight))
        self.score.bias.zero_()

    # -- text API ---------------------------------------------------------------------------------

    @property
    def document_pieces(self) -> int:
        """Word pieces of a one-sentence document that one input holds beside the longest query, [CLS], two
        [SEP] and the sentence's [SOS] (``encode_pairs``); each further sentence's [SOS] takes one more, so
        when a long document is read in windows of this many pieces (``ckray.rerank``) a window's last words
        may be cut, and the next window, which shares a quarter of it, reads them."""
        c = self.config
        return max(1, c.max_length - c.max_query_length - 4)

    def build_batch(self, queries: Sequence[str], docs: Sequence[str]) -> dict[str, torch.Tensor]:
        """``encode_pairs`` with this model's tokenizer and config."""
        return encode_pairs(self.tokenizer, queries, docs, self.config)

    @torch.no_grad()
    def score_texts(self, queries: Sequence[str], docs: Sequence[str], batch_size: int = 8) -> torch.Tensor:
        """``[N]`` scores of aligned (query, document) texts, on CPU, in eval mode (mode restored).

        Pairs are scored in batches of similar document length (less padding), returned in input order.
        """
        if len(queries) != len(docs):
            raise ValueError(f"score_texts needs aligned lists, got {len(queries)} queries and {len(docs)} documents")
        was_training = self.training
        self.eval()
        try:
            order = np.argsort([-len(str(d)) for d in docs], kind="stable")
            scores = torch.empty(len(docs))
            for i in range(0, len(docs), batch_size):
                idx = order[i:i + batch_size]
                batch = self.build_batch([queries[j] for j in idx], [docs[j] for j in idx])
                scores[torch.as_tensor(idx)] = self(batch).float().cpu()
            return scores
        finally:
            self.train(was_training)


def query_and_document_masks(batch: Mapping[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, n]`` masks of the query's word pieces (the global tokens after [CLS]) and of the
    document's (segment 1 less the [SOS] tokens: its word pieces and the closing [SEP])."""
    query_mask = batch["global_mask"].to(device).clone()
    query_mask[:, 0] = False                                                     # [CLS]
    doc_mask = (batch["token_type_ids"] == 1) & batch["attention_mask"] & ~batch["sentence_mask"]
    return query_mask, doc_mask.to(device)


def pooled_similarity(hidden: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """``cos(q̄, d̄)`` ``[B]``: the means of the final vectors of the query's and of the document's word
    pieces, in fp32."""
    hidden = hidden.float()
    query_mask, doc_mask = query_and_document_masks(batch, hidden.device)
    return torch.nn.functional.cosine_similarity(mean_pool(hidden, query_mask), mean_pool(hidden, doc_mask), dim=-1)


def maxsim_similarity(hidden: torch.Tensor, batch: Mapping[str, torch.Tensor],
                      piece_weights: torch.Tensor | None = None) -> torch.Tensor:
    """``(1/m) Σ_i max_j cos(h_qi, h_dj)`` ``[B]`` (ColBERT's Eq. 3, averaged over the m query word
    pieces) of the final vectors, cast to fp32 (under bf16 autocast the cosine matrix is a bf16 matmul,
    as every matmul is there). With ``piece_weights`` ``[V]`` the average is weighted:
    ``Σ_i u(q_i) · max_j cos(h_qi, h_dj) / Σ_i u(q_i)``, u the weight of q_i's vocabulary id."""
    query_mask, doc_mask = query_and_document_masks(batch, hidden.device)
    unit = torch.nn.functional.normalize(hidden.float(), dim=-1)
    m = int(query_mask.any(dim=0).nonzero().max()) + 1 if query_mask.any() else 1   # query rows lie in [0, m)
    cos = unit[:, :m] @ unit.transpose(1, 2)                                     # [B, m, n]
    best = cos.masked_fill(~doc_mask[:, None, :], -1.0).max(dim=-1).values       # [B, m]: best document match
    weights = query_mask[:, :m].to(best.dtype)
    if piece_weights is not None:
        weights = weights * piece_weights.to(best)[batch["input_ids"][:, :m].to(best.device)]
    return (best * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-6)


def _extend_positions(bert: nn.Module, max_length: int) -> None:
    """Grow the absolute position table to ``max_length`` rows by copying the pretrained rows
    (row i ← row i mod P, as Longformer initialised its 4096 positions from RoBERTa's 512)."""
    emb = bert.embeddings
    old = emb.position_embeddings.weight
    if max_length <= old.shape[0]:
        return
    reps = math.ceil(max_length / old.shape[0])
    table = nn.Embedding(max_length, old.shape[1]).to(device=old.device, dtype=old.dtype)
    with torch.no_grad():
        table.weight.copy_(old.detach().repeat(reps, 1)[:max_length])
    emb.position_embeddings = table
    bert.config.max_position_embeddings = max_length
    # transformers keeps [1, P] id buffers for calls without explicit ids; keep them consistent.
    if hasattr(emb, "position_ids"):
        emb.position_ids = torch.arange(max_length, device=old.device).expand(1, -1)
    if hasattr(emb, "token_type_ids"):
        emb.token_type_ids = torch.zeros(1, max_length, dtype=torch.long, device=old.device)


# ---------------------------------------------------------------------------------------------
# Training: pairwise loss on (query, d+, d−) triples, the RankerTask plug
# ---------------------------------------------------------------------------------------------

def collate_triples(rows: Mapping[str, Any], tokenizer, config: QDSConfig) -> dict[str, torch.Tensor]:
    """A batch of triples (dict of arrays with ``query``, ``pos_text``, ``neg_text``) → one QDS batch
    of 2B sequences: the B (query, d+) pairs first, then the B (query, d−) pairs."""
    queries = [str(q) for q in rows["query"]]
    docs = [str(d) for d in rows["pos_text"]] + [str(d) for d in rows["neg_text"]]
    return encode_pairs(tokenizer, queries + queries, docs, config)


def triple_loss(model: QDSTransformer, batch: Mapping[str, torch.Tensor], kind: str = "softmax",
                margin: float = 1.0) -> torch.Tensor:
    """Score a ``collate_triples`` batch and apply ``ckray.models.losses.pairwise_loss`` to its (d+, d−) halves."""
    scores = model(batch)
    pos, neg = scores.view(2, -1)
    return pairwise_loss(pos, neg, kind, margin)
