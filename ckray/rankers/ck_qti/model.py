"""Conformer-Kernel (CK) with Query Term Independence (QTI).

Mitra, Hofstätter, Zamani, Craswell (2020), "Improving Transformer-Kernel Ranking Model Using
Conformer and Query Term Independence", arXiv 2007.10434. Equation and figure numbers are the paper's.

Reading order (top to bottom, like nanoGPT):

    CKConfig                 hyperparameters (defaults: 2 blocks, d=300, 10 heads, |d| ≤ 4,000)
    SeparableSelfAttention   Eq. 5–6   A = softmax(Kᵀ) V ;  Out = softmax_rows(Q) A      (linear in n)
    QuadraticSelfAttention   the TK baseline: softmax(QKᵀ/√d) V                        (n × n)
    ConformerBlock           Fig. 1c   windowed 1-D convolution + self-attention + feed-forward
    Encoder                  word-piece embedding → projection → sinusoidal positions → L blocks
    BatchScale               Eq. 10    BS(x) = x / (E[x] + ε), running E[x] for inference
    CKModel                  explicit (Eq. 9) + implicit (Eq. 11–16) per-term scores,
                             s_td = ReLU(α·s_explicit + (1−α)·s_implicit + b),  S_qd = Σ_t s_td

With ``qti=True`` a query term is embedded without context (embedding + projection only), so
``s_td`` depends on the term and the document alone: a document is encoded once
(``encode_documents``) and any number of candidate terms are scored against it (``term_scores``),
which is what an impact index needs. ``qti=False`` contextualises the query with the same encoder
(the paper's full CK). ``tk_config()`` gives the TK-style baseline (quadratic attention, no
convolution) used by ``bench/ck_memory.py``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import warnings
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ckray.data import statistics
from ckray.data.statistics import CorpusStats, Tokenisation, bm25_idf
from ckray.errors import ConfigError
from ckray.models.kernels import RBFKernels, pad_for_windows, window_mask, windowed_soft_tf
from ckray.models.losses import pairwise_loss  # noqa: F401  (CK's training loss, importable from here)


# --------------------------------------------------------------------------- configuration
@dataclass
class CKConfig:
    # vocabulary and embeddings: the offline MiniLM's WordPiece vocabulary and 384-dim word vectors
    vocab_size: int = 30522
    emb_dim: int = 384
    embedding_init: str = "pretrained"  # "pretrained" (MiniLM word embeddings) | "random"
    encoder: str | None = None  # tokenizer / embedding source; None = offline all-MiniLM-L6-v2
    # encoder, sized like TK (Hofstätter et al. 2020): 2 layers, 300 dims, 10 heads, feed-forward 100
    d_model: int = 300
    n_layers: int = 2
    n_heads: int = 10
    ff_dim: int = 100
    conv_window: int = 7  # odd; 0 = no convolution (TK)
    attention: str = "separable"  # "separable" (CK, Eq. 5-6) | "quadratic" (TK)
    dropout: float = 0.0  # TK used none; set > 0 to regularise the encoder
    qti: bool = True  # query term independence: context-free query terms
    # implicit matching (Eq. 11-16)
    n_kernels: int = 11
    kernel_sigma: float = 0.1
    pool_window: int = 40  # windowed kernel pooling: window length …
    pool_stride: int = 20  # … and stride (overlapping windows)
    implicit_hidden: int = 32  # the small MLP over each window's log kernel features
    # explicit matching (Eq. 9-10); it starts as BM25 with these parameters. On word pieces, SciFact's
    # held-out training queries prefer k1=1, b=0.75 (dev nDCG@10 0.667) to Anserini's 0.9, 0.4 (0.659)
    bm25_k1: float = 1.0
    bm25_b: float = 0.75
    bs_momentum: float = 0.1  # running E[x] for batch scaling
    eps: float = 1e-6
    # what TF_td and IDF_t of Eq. 9 count: the word piece itself ("pieces"), or every piece opening a word
    # with the same Porter stem as BM25's index stems it ("stems", ckray.lexical.analysis.stem_classes;
    # the map is kept in the checkpoint as CKModel.match_class)
    exact_match: str = "pieces"
    # input lengths (word pieces)
    max_query_len: int = 30
    max_doc_len: int = 4000

    def __post_init__(self) -> None:
        if self.attention not in ("separable", "quadratic"):
            raise ConfigError(f"CKConfig.attention must be 'separable' or 'quadratic', not {self.attention!r}")
        if self.embedding_init not in ("pretrained", "random"):
            raise ConfigError(f"CKConfig.embedding_init must be 'pretrained' or 'random', not {self.embedding_init!r}")
        if self.d_model % self.n_heads:
            raise ConfigError(f"CKConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads}")
        if self.conv_window < 0 or (self.conv_window and self.conv_window % 2 == 0):
            raise ConfigError(f"CKConfig.conv_window must be odd (or 0 for none), not {self.conv_window}")
        if not 0 < self.pool_stride <= self.pool_window:
            raise ConfigError("CKConfig needs 0 < pool_stride <= pool_window")
        if self.exact_match not in ("pieces", "stems"):
            raise ConfigError(f"CKConfig.exact_match must be 'pieces' or 'stems', not {self.exact_match!r}")
        if self.bm25_k1 <= 0 or not 0 <= self.bm25_b <= 1:
            raise ConfigError(f"CKConfig needs bm25_k1 > 0 (--bm25-k1) and 0 <= bm25_b <= 1 (--bm25-b), "
                              f"got k1={self.bm25_k1}, b={self.bm25_b}")


def tk_config(**overrides) -> CKConfig:
    """The TK-style baseline: ordinary quadratic self-attention, no convolution, query contextualised."""
    return CKConfig(**{"attention": "quadratic", "conv_window": 0, "qti": False, **overrides})


# --------------------------------------------------------------------------- attention
class SeparableSelfAttention(nn.Module):
    """Separable self-attention, Eq. 5–6, per head h:

        A_h   = softmax(K_hᵀ) V_h          (Eq. 5; softmax over the sequence axis, [d_h × d_h])
        Out_h = softmax_rows(Q_h) A_h      (Eq. 6; softmax over each row's d_h features)

    Memory and time are O(n·d_h²) — the n × n attention matrix is never formed. Padding is masked on
    the key side (its softmax weight is exactly 0), so real tokens never see padded ones. Q and K come
    from one projection and V from another, so the raw Q, K activations can be freed once their
    softmaxes are taken (only the softmax outputs and V are kept for the backward pass).
    """

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qk = nn.Linear(d_model, 2 * d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)

    def heads(self, x: torch.Tensor, parts: int) -> torch.Tensor:
        """[B, n, parts·D] -> [parts, B, H, n, d_h]"""
        B, n, PD = x.shape
        return x.view(B, n, parts, self.n_heads, PD // parts // self.n_heads).permute(2, 0, 3, 1, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, n, D = x.shape
        q, k = self.heads(self.qk(x), 2)
        v = self.heads(self.v(x), 1)[0]
        k = k.masked_fill(~mask[:, None, :, None], torch.finfo(k.dtype).min)
        a = k.softmax(dim=2).transpose(-1, -2) @ v  # Eq. 5  [B, H, d_h, d_h]
        y = q.softmax(dim=-1) @ a  # Eq. 6  [B, H, n, d_h]
        return self.out(y.transpose(1, 2).reshape(B, n, D))


class QuadraticSelfAttention(SeparableSelfAttention):
    """Ordinary multi-head self-attention (TK): softmax(Q Kᵀ / √d_h) V with an explicit n × n matrix
    (as TK's 2020 implementation did; no fused/flash kernel, so memory grows as n²). Same projections
    as the separable attention, so the two differ only in how Q, K and V are combined."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, n, D = x.shape
        q, k = self.heads(self.qk(x), 2)
        v = self.heads(self.v(x), 1)[0]
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)  # [B, H, n, n]
        scores = scores.masked_fill(~mask[:, None, None, :], torch.finfo(scores.dtype).min)
        y = scores.softmax(dim=-1) @ v
        return self.out(y.transpose(1, 2).reshape(B, n, D))


# --------------------------------------------------------------------------- encoder
class WindowedConv(nn.Module):
    """Depthwise 1-D convolution over a window of k positions (each channel its own filter, as in
    the Conformer's depthwise convolution):

        y_i = b + Σ_{o=0}^{k-1} w_o ⊙ x_{i + o − ⌊k/2⌋}        (zero outside the sequence)

    Written as k shifted multiply-adds over views of one padded copy of x, so only that copy is
    kept for the backward pass (PyTorch's CPU convolution keeps k-times larger unfolded buffers)."""

    def __init__(self, d_model: int, window: int):
        super().__init__()
        bound = 1 / math.sqrt(window)  # nn.Conv1d's default init for a depthwise filter
        self.weight = nn.Parameter(torch.empty(window, d_model).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(d_model).uniform_(-bound, bound))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, n = self.weight.shape[0], x.shape[1]
        xp = F.pad(x, (0, 0, k // 2, k // 2))
        y = self.bias + xp[:, :n] * self.weight[0]
        for o in range(1, k):
            y = y + xp[:, o:o + n] * self.weight[o]
        return y


class ConformerBlock(nn.Module):
    """The Conformer block (Fig. 1c): a windowed 1-D (depthwise) convolution and self-attention in one
    block, then a feed-forward layer; each sub-layer is pre-layer-normed and residual:

        x ← x + GELU(Conv(LN(x)))  (local context: a window of ``conv_window`` positions)
        x ← x + SelfAttn(LN(x))    (global context: separable, or quadratic for TK)
        x ← x + FFN(LN(x))

    Padded positions are zeroed before the convolution (so a real token near the end of a document
    sees the same zeros it would see unpadded) and at the block's output.
    """

    def __init__(self, cfg: CKConfig):
        super().__init__()
        d = cfg.d_model
        self.conv = None
        if cfg.conv_window:
            self.conv_norm = nn.LayerNorm(d)
            self.conv = WindowedConv(d, cfg.conv_window)
        self.attn_norm = nn.LayerNorm(d)
        attn = SeparableSelfAttention if cfg.attention == "separable" else QuadraticSelfAttention
        self.attn = attn(d, cfg.n_heads)
        self.ff_norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, cfg.ff_dim), nn.GELU(), nn.Linear(cfg.ff_dim, d))
        self.drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        m = mask.unsqueeze(-1).to(x.dtype)
        if self.conv is not None:
            x = x + self.drop(F.gelu(self.conv(self.conv_norm(x) * m)))
        x = x + self.drop(self.attn(self.attn_norm(x), mask))
        x = x + self.drop(self.ff(self.ff_norm(x)))
        return x * m


def sinusoidal_positions(n: int, d: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Vaswani et al.'s fixed positions: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(…)."""
    pos = torch.arange(n, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / d))
    pe = torch.zeros(n, d, device=device)
    pe[:, 0::2] = torch.sin(pos * freq)
    pe[:, 1::2] = torch.cos(pos * freq[: d // 2])
    return pe.to(dtype)


class Encoder(nn.Module):
    """Word pieces → embedding (MiniLM-initialised, trainable) → projection to d_model (the
    context-free term vector x₀) → + scaled sinusoidal positions → L Conformer blocks.

    The blocks are pre-norm and residual, so x₀ runs through to the output: the cosine between a
    context-free query term and a contextualised document term starts out as their embedding
    similarity (the role TK's learned mix of contextualised and context-free vectors plays). No
    final LayerNorm: the implicit match only uses cosines, which ignore scale. The positions are
    scaled by a learned scalar, initialised so that PE rows have norm 0.5 — about the norm of x₀
    from MiniLM's embeddings — instead of √(d/2) ≈ 12, which would drown the word vectors.
    """

    def __init__(self, cfg: CKConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.emb_dim, padding_idx=0)
        self.proj = nn.Linear(cfg.emb_dim, cfg.d_model)
        self.pos_scale = nn.Parameter(torch.tensor([0.5 / math.sqrt(cfg.d_model / 2)]))  # shape (1,): DeepSpeed cannot broadcast 0-d
        self.blocks = nn.ModuleList(ConformerBlock(cfg) for _ in range(cfg.n_layers))

    def terms(self, ids: torch.Tensor) -> torch.Tensor:
        """Context-free term vectors x₀ = W·E[t] + b (QTI's query side: embedding + projection only)."""
        return self.proj(self.embed(ids))

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x0 = self.terms(ids)
        x = x0 + self.pos_scale * sinusoidal_positions(ids.shape[1], x0.shape[-1], x0.device, x0.dtype)
        for block in self.blocks:
            x = block(x, mask)  # zero at padded positions
        return x


# --------------------------------------------------------------------------- explicit matching helpers
class BatchScale(nn.Module):
    """Batch scaling, Eq. 10: BS(x) = x / (E[x] + ε).

    Training: E[x] is the mean of x over the batch's real entries, and a running value is kept
    (``running = (1−m)·running + m·E_batch[x]``; the first batch sets it). Evaluation: the running
    value is used, so a score depends on one (term, document) pair only — QTI holds exactly.
    """

    def __init__(self, momentum: float, eps: float):
        super().__init__()
        self.momentum, self.eps = momentum, eps
        self.register_buffer("running_mean", torch.ones(()))
        self.register_buffer("num_batches_tracked", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                w = torch.ones_like(x) if mask is None else mask.to(x.dtype)
                mean = (x * w).sum() / w.sum().clamp(min=1)
                first = self.num_batches_tracked == 0  # no .item(): no device sync per step
                m = torch.where(first, torch.ones_like(self.running_mean), torch.full_like(self.running_mean, self.momentum))
                self.running_mean.mul_(1 - m).add_(m * mean.to(self.running_mean.dtype))
                self.num_batches_tracked.add_(1)
        else:
            mean = self.running_mean
        return x / (mean.to(x.dtype) + self.eps)


def term_frequency(doc_ids: torch.Tensor, doc_mask: torch.Tensor, term_ids: torch.Tensor,
                   classes: torch.Tensor | None = None) -> torch.Tensor:
    """TF_{t,d} of each term id in each document ``[B, n]`` (real positions in ``doc_mask``):
    ``term_ids [T] or [B, T] -> [B, T]`` (float). With ``classes`` (each vocabulary id's exact-match class,
    ``CKConfig.exact_match``) a position counts when its piece is in the term's class."""
    if classes is not None:
        doc_ids, term_ids = classes[doc_ids], classes[term_ids]
    if term_ids.dim() == 1:
        term_ids = term_ids.expand(doc_ids.shape[0], -1)
    hits = (doc_ids[:, None, :] == term_ids[:, :, None]) & doc_mask[:, None, :]
    return hits.sum(-1).to(torch.float32)


# --------------------------------------------------------------------------- documents, encoded once
@dataclass
class DocRepr:
    """A batch of documents encoded once, for scoring any number of terms against them.

    ``ids``/``mask`` [B, n] (word pieces, real positions), ``vectors`` [B, n, d] contextualised term
    vectors, ``inv_norm`` [B, n] = 1/‖vector‖ (float32; the cosine is taken as (q̂·d)·inv_norm, which
    keeps one copy of the vectors for the backward pass), ``length`` [B] = |d| (real word pieces),
    ``classes`` the model's exact-match classes of the vocabulary (None: each piece its own)."""

    ids: torch.Tensor
    mask: torch.Tensor
    vectors: torch.Tensor
    inv_norm: torch.Tensor
    length: torch.Tensor
    classes: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    def term_frequency(self, term_ids: torch.Tensor) -> torch.Tensor:
        """TF_{t,d}: occurrences of each term id in each document, ``[T] or [B, T] -> [B, T]`` (float)."""
        return term_frequency(self.ids, self.mask, term_ids, self.classes)

    def unique_terms(self) -> list[torch.Tensor]:
        """The distinct word-piece ids of each document (its own candidate terms for an impact index)."""
        return [ids[m].unique() for ids, m in zip(self.ids, self.mask)]

    def select(self, index: torch.Tensor | slice | Sequence[int]) -> "DocRepr":
        return DocRepr(self.ids[index], self.mask[index], self.vectors[index], self.inv_norm[index],
                       self.length[index], self.classes)


def pad_term_lists(terms: Sequence[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document term id lists → (ids [B, T] long, mask [B, T] bool), padded with 0 (T ≥ 1)."""
    T = max([1] + [len(t) for t in terms])
    ids = torch.zeros(len(terms), T, dtype=torch.long, device=device)
    mask = torch.zeros(len(terms), T, dtype=torch.bool, device=device)
    for b, t in enumerate(terms):
        ids[b, :len(t)], mask[b, :len(t)] = t, True
    return ids, mask


# --------------------------------------------------------------------------- tokenisation
def tokenize(texts: Sequence[str], max_len: int, encoder: str | None = None,
             pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Word pieces without [CLS]/[SEP], truncated to ``max_len``, right-padded with 0 to the longest
    text (or ``pad_to``), at least one column. Returns ``(ids [B, n] long, mask [B, n] bool)``."""
    from ckray.models.encoders import load_tokenizer

    pieces = load_tokenizer(encoder)(list(texts), add_special_tokens=False, truncation=True,
                                     max_length=max_len)["input_ids"]
    n = max([1, pad_to or 0] + [len(p) for p in pieces])
    ids = torch.zeros(len(pieces), n, dtype=torch.long)
    for i, p in enumerate(pieces):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    lengths = torch.tensor([len(p) for p in pieces], dtype=torch.long)
    return ids, torch.arange(n)[None, :] < lengths[:, None]


def piece_tokenisation(config: CKConfig, read_length: int | None = None) -> Tokenisation:
    """How CK-QTI reads a document: its encoder's word pieces, truncated at ``read_length`` (default
    ``max_doc_len``, one window; longer where the impact index reads several)."""
    return Tokenisation(config.encoder, config.vocab_size, read_length or config.max_doc_len)


def corpus_statistics(texts: Iterable[str], config: CKConfig, batch_size: int = 256,
                      classes: np.ndarray | None = None) -> CorpusStats:
    """Document frequencies (of the exact-match ``classes`` when given) and mean length over ``texts``,
    tokenised (and truncated) as the model does."""
    return statistics.corpus_statistics(texts, piece_tokenisation(config), batch_size, classes)


def explicit_training_statistics(queries: Sequence[str], docs: Sequence[str], config: CKConfig,
                                 batch_size: int = 128, keep: Sequence[int] | None = None,
                                 classes: np.ndarray | None = None) -> tuple[float, float]:
    """(E[TF], E[|d|]) as batch scaling (Eq. 10) measures them in training: TF of every real query
    word-piece position in its paired document, and |d| in word pieces, tokenised and truncated as the
    model does. ``queries[i]`` is paired with ``docs[i]`` (give each triple's query twice, with its
    positive and its negative); ``keep[i]``, when given, cuts ``docs[i]`` to that many word pieces, as
    training cuts it (``ckray.rankers.ck_qti.task.length_matched_pairs``); TF counts the exact-match
    ``classes`` when given, as the model does."""
    if len(queries) != len(docs) or not docs or (keep is not None and len(keep) != len(docs)):
        raise ConfigError(f"explicit_training_statistics needs paired, non-empty inputs "
                          f"({len(queries)} queries, {len(docs)} documents"
                          f"{'' if keep is None else f', {len(keep)} cuts'})")
    tf_sum, tf_n, len_sum = 0.0, 0, 0.0
    class_map = None if classes is None else torch.as_tensor(np.array(classes, dtype=np.int64))
    for i in range(0, len(docs), batch_size):
        q_ids, q_mask = tokenize(queries[i: i + batch_size], config.max_query_len, config.encoder)
        d_ids, d_mask = tokenize(docs[i: i + batch_size], config.max_doc_len, config.encoder)
        if keep is not None:
            d_mask &= torch.arange(d_mask.shape[1])[None, :] < torch.tensor(keep[i: i + batch_size])[:, None]
        tf = term_frequency(d_ids, d_mask, q_ids, class_map)
        tf_sum += float(tf[q_mask].sum())
        tf_n += int(q_mask.sum())
        len_sum += float(d_mask.sum())
    return tf_sum / max(tf_n, 1), len_sum / len(docs)


# --------------------------------------------------------------------------- loading checkpoints
_SKIP_PRETRAINED: contextvars.ContextVar[bool] = contextvars.ContextVar("ck_skip_pretrained", default=False)


@contextlib.contextmanager
def pretrained_init_skipped():
    """Inside this block ``CKModel(config)`` keeps its random word embeddings instead of copying the
    pretrained ones (which loads the whole encoder, seconds): for rebuilding a model whose weights are
    loaded from a checkpoint right after, as ``load_ck_model`` does."""
    token = _SKIP_PRETRAINED.set(True)
    try:
        yield
    finally:
        _SKIP_PRETRAINED.reset(token)


def load_ck_model(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> nn.Module:
    """``ckray.models.checkpoint.load_model`` without the pretrained-embedding load in ``__init__``
    (the checkpoint's weights replace them anyway; every weight is checked to be in the checkpoint)."""
    from ckray.models.checkpoint import load_model

    with pretrained_init_skipped():
        return load_model(path, map_location=map_location)


# --------------------------------------------------------------------------- the model
class CKModel(nn.Module):
    """Conformer-Kernel ranker. ``forward(query_ids, query_mask, doc_ids, doc_mask) -> S_qd [B]``."""

    _non_persistent_ok = ("match_class",)   # checkpoints saved before exact-match classes load with the identity
    _init_config_must_agree = ("exact_match",)   # --init-from: its IDF and classes count what this model counts

    def __init__(self, config: CKConfig):
        super().__init__()
        self.config = cfg = config
        self.encoder = Encoder(cfg)
        # explicit matching (Eq. 9-10); w = k1·b, w₀ = k1·(1−b) start it as BM25(k1, b) while E[TF] = 1
        # (start_explicit_as_bm25 keeps it BM25 under the training batches' statistics)
        self.register_buffer("idf", torch.ones(cfg.vocab_size))
        # TF and IDF count exact-match classes (CKConfig.exact_match): the identity for "pieces"; a
        # checkpoint saved before the map existed loads with the identity
        self.register_buffer("match_class", torch.arange(cfg.vocab_size))
        self.bs_tf = BatchScale(cfg.bs_momentum, cfg.eps)
        self.bs_len = BatchScale(cfg.bs_momentum, cfg.eps)
        self.len_w = nn.Parameter(torch.tensor([cfg.bm25_k1 * cfg.bm25_b]))
        self.len_b = nn.Parameter(torch.tensor([cfg.bm25_k1 * (1 - cfg.bm25_b)]))
        # implicit matching (Eq. 11-16)
        self.kernels = RBFKernels(cfg.n_kernels, cfg.kernel_sigma)
        self.window_mlp = nn.Sequential(nn.Linear(cfg.n_kernels, cfg.implicit_hidden), nn.ReLU(),
                                        nn.Linear(cfg.implicit_hidden, 1))
        self.len_norm_logit = nn.Parameter(torch.zeros(1))  # λ = sigmoid(·) in Eq. 16, 0.5 at init
        # combination: s_td = ReLU(α·s_explicit + (1−α)·s_implicit + b), α = sigmoid(alpha_logit)
        self.alpha_logit = nn.Parameter(torch.zeros(1))
        self.bias = nn.Parameter(torch.tensor([0.1]))  # > 0: every term starts alive under the ReLU
        self._init_weights()

    # ----------------------------------------------------------------- initialisation
    def _init_weights(self) -> None:
        nn.init.normal_(self.window_mlp[2].weight, std=0.01)  # implicit part starts near 0: S ≈ α·explicit
        nn.init.zeros_(self.window_mlp[2].bias)
        if self.config.embedding_init == "pretrained" and not _SKIP_PRETRAINED.get():
            self._load_pretrained_embeddings()

    @torch.no_grad()
    def _load_pretrained_embeddings(self) -> None:
        """Copy the encoder's word-piece embeddings (MiniLM: 30,522 × 384) into ours, where available."""
        from ckray.models.encoders import load_encoder

        try:
            weight = load_encoder(self.config.encoder).embeddings.word_embeddings.weight
        except Exception as exc:  # no offline copy and no network: keep the random init, say so
            warnings.warn(f"CK: pretrained word embeddings unavailable ({exc}); using a random init")
            return
        if tuple(weight.shape) != (self.config.vocab_size, self.config.emb_dim):
            raise ConfigError(f"pretrained embeddings are {tuple(weight.shape)}, but CKConfig has "
                              f"vocab_size={self.config.vocab_size}, emb_dim={self.config.emb_dim}")
        self.encoder.embed.weight.copy_(weight)

    @torch.no_grad()
    def set_match_classes(self, classes: np.ndarray | torch.Tensor) -> None:
        """Each vocabulary id's exact-match class (``ckray.lexical.analysis.stem_classes``), kept in the
        checkpoint; TF and IDF of Eq. 9 then count a term's class. Set before :meth:`set_idf`."""
        classes = torch.as_tensor(np.array(classes, dtype=np.int64))   # a copy: the map may be read-only
        if classes.shape != self.match_class.shape or int(classes.min()) < 0 or int(classes.max()) >= len(classes):
            raise ConfigError(f"exact-match classes must map each of the {len(self.match_class)} vocabulary ids "
                              f"to one of them; got {tuple(classes.shape)} values in "
                              f"[{int(classes.min())}, {int(classes.max())}]")
        self.match_class.copy_(classes.to(self.match_class.device))

    @property
    def counted_classes(self) -> torch.Tensor | None:
        """The exact-match classes TF and IDF count: ``match_class`` when ``exact_match="stems"``, else None
        (each word piece its own)."""
        return self.match_class if self.config.exact_match == "stems" else None

    def match_classes(self) -> np.ndarray | None:
        """:attr:`counted_classes` as a NumPy array, what corpus statistics for this model count."""
        classes = self.counted_classes
        return None if classes is None else classes.cpu().numpy()

    def idf_of(self, doc_freq: torch.Tensor, n_docs: int) -> torch.Tensor:
        """IDF_t of every vocabulary id from document frequencies counted as :meth:`match_classes` says:
        each id takes its class's (``[V]``, on the CPU)."""
        return bm25_idf(doc_freq.reshape(-1), n_docs)[self.match_class.cpu()]

    @torch.no_grad()
    def set_idf(self, doc_freq: torch.Tensor, n_docs: int, mean_doc_len: float | None = None) -> None:
        """IDF_t of Eq. 9 from corpus document frequencies ``doc_freq[vocab]`` (kept in the checkpoint),
        counted over the model's exact-match classes (:meth:`match_classes`).

        ``mean_doc_len`` (word pieces), when given, also starts the running E[|d|] of Eq. 10 at the
        corpus mean (BM25's avgdl), so an untrained model in eval mode normalises lengths sensibly;
        the first training batch replaces it with the batch mean."""
        if doc_freq.numel() != self.config.vocab_size:
            raise ConfigError(f"doc_freq has {doc_freq.numel()} entries, the vocabulary {self.config.vocab_size}")
        self.idf.copy_(self.idf_of(doc_freq, n_docs).to(self.idf.device))
        if mean_doc_len is not None:
            self.bs_len.running_mean.fill_(float(mean_doc_len))

    @torch.no_grad()
    def start_explicit_as_bm25(self, mean_tf: float, mean_len: float, avgdl: float) -> None:
        """Initialise Eq. 9–10 so that s_explicit is BM25(k1, b) under the training batches' statistics.

        Batch scaling divides TF by E[TF] and |d| by E[|d|], the means over training batches (E[TF]
        of query terms in BM25 candidates is about 3 on SciFact, not 1). With E[TF] and E[|d|]
        measured on training triples (:func:`explicit_training_statistics`) as the running values and

            w = k1·b·E[|d|] / (avgdl·E[TF]),   w₀ = k1·(1−b) / E[TF]

        the denominator is (TF + k1·(1 − b + b·|d|/avgdl)) / E[TF], so
        s_explicit = IDF·TF / (TF + k1·(1 − b + b·|d|/avgdl)): BM25 (up to its constant k1 + 1).
        Without this, the first batch would turn k1 into k1·E[TF] and training would start from a
        worse lexical model than the first stage. The running values then move with momentum
        (they are not replaced by the first batch)."""
        k1, b = self.config.bm25_k1, self.config.bm25_b
        if mean_tf <= 0 or mean_len <= 0 or avgdl <= 0:
            raise ConfigError(f"explicit-match statistics must be positive: E[TF]={mean_tf}, "
                              f"E[|d|]={mean_len}, avgdl={avgdl}")
        for scale, value in ((self.bs_tf, mean_tf), (self.bs_len, mean_len)):
            scale.running_mean.fill_(float(value))
            scale.num_batches_tracked.fill_(1)
        self.len_w.fill_(k1 * b * mean_len / (avgdl * mean_tf))
        self.len_b.fill_(k1 * (1 - b) / mean_tf)

    def set_idf_from_texts(self, texts: Iterable[str]) -> CorpusStats:
        """Tokenise ``texts`` (the corpus) and set IDF and the initial E[|d|] from them."""
        stats = corpus_statistics(texts, self.config, classes=self.match_classes())
        self.set_idf(stats.doc_freq, stats.n_docs, stats.mean_doc_len)
        return stats

    @property
    def device(self) -> torch.device:
        return self.idf.device

    # ----------------------------------------------------------------- encoding
    def encode_documents(self, doc_ids: torch.Tensor, doc_mask: torch.Tensor) -> DocRepr:
        """Encode documents once: contextualised term vectors, ids (for TF) and |d|."""
        mask = doc_mask.bool()
        vectors = self.encoder(doc_ids, mask)
        inv_norm = vectors.float().norm(dim=-1).clamp(min=1e-6).reciprocal()
        return DocRepr(doc_ids, mask, vectors, inv_norm, mask.sum(-1).to(torch.float32), self.counted_classes)

    def encode_query_terms(self, term_ids: torch.Tensor) -> torch.Tensor:
        """QTI query side: each term on its own, embedding + projection only (no context)."""
        return self.encoder.terms(term_ids)

    def encode_queries(self, query_ids: torch.Tensor, query_mask: torch.Tensor) -> torch.Tensor:
        """Query term vectors: context-free with QTI, contextualised by the encoder without (full CK)."""
        if self.config.qti:
            return self.encode_query_terms(query_ids)
        return self.encoder(query_ids, query_mask.bool())

    # ----------------------------------------------------------------- per-term scores
    def explicit_scores(self, term_ids: torch.Tensor, doc: DocRepr, term_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 9 (with Eq. 10's batch scaling BS):

            s_explicit = IDF_t · BS(TF_td) / (BS(TF_td) + ReLU(w·BS(|d|) + b) + ε)        [B, T]

        BM25's saturation with learned length normalisation; 0 when t does not occur in d."""
        return self.explicit_match(term_ids, doc.term_frequency(term_ids), doc.length, term_mask)

    def explicit_match(self, term_ids: torch.Tensor, tf: torch.Tensor, length: torch.Tensor,
                       term_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Eq. 9 from its counts: TF_td ``[B, T]`` of ``term_ids`` (``[T]`` or ``[B, T]``) and |d| ``[B]``."""
        tf_s = self.bs_tf(tf, term_mask)
        len_s = self.bs_len(length)
        denom = tf_s + F.relu(self.len_w * len_s[:, None] + self.len_b) + self.config.eps
        idf = self.idf[term_ids]
        return (idf if idf.dim() == 2 else idf.expand_as(tf)) * tf_s / denom

    def implicit_scores(self, term_vectors: torch.Tensor, doc: DocRepr) -> torch.Tensor:
        """Eq. 11–16, for query term vectors ``[B, T, d]`` (or ``[T, d]``, shared) against ``doc``:

            R_ti   = cos(q_t, d_i)                                    cosine with each document term
            K_tik  = exp(−(R_ti − μ_k)² / 2σ_k²)                      RBF kernels (padding zeroed)
            K_tjk  = Σ_{i ∈ window j} K_tik                           windowed kernel pooling
            L_tjk  = log(1 + K_tjk)                                   log soft-TF (0 for an empty window)
            f_tj   = MLP(L_tj)                                        a small MLP scores each window
            s_t    = Σ_j f_tj / n_windows(d)^λ                        length normalisation, learned λ ∈ (0,1)

        Computed in float32 (the exact-match kernel has σ = 10⁻³). Returns ``[B, T]``."""
        cfg = self.config
        q = F.normalize(term_vectors.float(), dim=-1, eps=1e-6)
        if q.dim() == 2:
            q = q.expand(len(doc), -1, -1)
        w, s = cfg.pool_window, cfg.pool_stride
        sim = torch.einsum("btc,bnc->btn", q, doc.vectors.float()) * doc.inv_norm[:, None, :]  # cosine
        sim = pad_for_windows(sim, w, s, dim=-1)  # [B, T, n'] so that every window is complete
        mask = pad_for_windows(doc.mask, w, s, dim=1)
        k = self.kernels(sim, mask[:, None, :])  # [B, T, n, K]
        feats = torch.log1p(windowed_soft_tf(k, w, s))  # [B, T, n_windows, K]
        mlp_dtype = self.window_mlp[0].weight.dtype
        f = self.window_mlp(feats.to(mlp_dtype)).squeeze(-1).float()  # [B, T, n_windows]
        valid = window_mask(mask, w, s).to(f.dtype)  # [B, n_windows]
        n_valid = valid.sum(-1).clamp(min=1)
        lam = torch.sigmoid(self.len_norm_logit)
        return (f * valid[:, None, :]).sum(-1) / n_valid[:, None] ** lam

    def weighted_parts(self, term_ids: torch.Tensor, term_vectors: torch.Tensor, doc: DocRepr,
                       term_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The two terms inside s_td's ReLU: ``(α·s_explicit, (1−α)·s_implicit)``, each [B, T]."""
        alpha = torch.sigmoid(self.alpha_logit)
        return (alpha * self.explicit_scores(term_ids, doc, term_mask),
                (1 - alpha) * self.implicit_scores(term_vectors, doc))

    def _combine(self, term_ids: torch.Tensor, term_vectors: torch.Tensor, doc: DocRepr,
                 term_mask: torch.Tensor | None) -> torch.Tensor:
        """s_td = ReLU(α·s_explicit + (1−α)·s_implicit + b)  [B, T]."""
        return self.combine_parts(*self.weighted_parts(term_ids, term_vectors, doc, term_mask))

    def combine_parts(self, explicit: torch.Tensor, implicit: torch.Tensor) -> torch.Tensor:
        """s_td = ReLU(α·s_explicit + (1−α)·s_implicit + b) from :meth:`weighted_parts`' two terms."""
        return F.relu(explicit + implicit + self.bias)

    def term_scores(self, term_ids: torch.Tensor, doc: DocRepr, term_mask: torch.Tensor | None = None,
                    chunk_size: int = 256) -> torch.Tensor:
        """QTI per-term scores s_td of candidate terms against documents encoded once.

        ``term_ids``: [T] (the same terms for every document) or [B, T]. Returns [B, T]. In eval mode
        the terms are scored ``chunk_size`` at a time (memory), and Σ_t of the result over a query's
        terms equals ``forward`` on that query. Requires ``config.qti``."""
        return self.combine_parts(*self.term_parts(term_ids, doc, term_mask, chunk_size))

    def term_parts(self, term_ids: torch.Tensor, doc: DocRepr, term_mask: torch.Tensor | None = None,
                   chunk_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`weighted_parts` of QTI's context-free query terms, ``(α·s_explicit, (1−α)·s_implicit)``
        [B, T] each, ``chunk_size`` terms at a time in eval mode; s_td is ReLU of their sum plus b."""
        if not self.config.qti:
            raise ConfigError("term_scores needs a QTI model (CKConfig.qti=True): without QTI a "
                              "term's score depends on the rest of the query")
        T = term_ids.shape[-1]
        if self.training or T <= chunk_size:
            return self.weighted_parts(term_ids, self.encode_query_terms(term_ids), doc, term_mask)
        parts = [self.weighted_parts(ids, self.encode_query_terms(ids), doc, None)
                 for ids in term_ids.split(chunk_size, dim=-1)]
        return torch.cat([e for e, _ in parts], dim=-1), torch.cat([i for _, i in parts], dim=-1)

    @torch.no_grad()
    def impact_thresholds(self, doc: DocRepr, top_k: int, chunk_size: int = 64) -> torch.Tensor:
        """θ_d: the k-th largest s_td among each document's own distinct terms, scored as the impact
        index scores them (eval mode, so batch scaling uses its running E[x]); 0 where a document has
        at most k distinct terms (the index keeps all of them). Returns [B] (float32)."""
        ids, mask = pad_term_lists(doc.unique_terms(), doc.ids.device)
        U = ids.shape[1]
        was_training = self.training
        self.eval()
        try:
            scores = self.term_scores(ids, doc, chunk_size=chunk_size).float().masked_fill(~mask, -math.inf)
        finally:
            self.train(was_training)
        if U <= top_k:
            return torch.zeros(len(ids), device=scores.device)
        kth = scores.topk(top_k, dim=1).values[:, -1]
        return torch.where(mask.sum(1) > top_k, kth, torch.zeros_like(kth))

    # ----------------------------------------------------------------- query-document scores
    def forward(self, query_ids: torch.Tensor, query_mask: torch.Tensor, doc_ids: torch.Tensor,
                doc_mask: torch.Tensor, keep_top_k: int = 0, gate_temperature: float = 0.1) -> torch.Tensor:
        """S_qd = Σ_{t ∈ q} s_td over the real query terms (QTI's decomposition). Returns [B].

        ``keep_top_k = k`` trains what the impact index deploys: it keeps only a document's k best
        terms, so a query term counts only where s_td ≥ θ_d (``impact_thresholds``). A hard cut would
        give a cut term no gradient, so the cut is relaxed into a gate,

            S_qd = Σ_t s_td · σ((s_td − θ_d) / (τ·θ_d)),    τ = ``gate_temperature``

        (a term at the threshold counts half, one 30 % above it 95 % at τ = 0.1; no gate where θ_d = 0)."""
        query_mask = query_mask.bool()
        doc = self.encode_documents(doc_ids, doc_mask)
        q = self.encode_queries(query_ids, query_mask)
        s = self._combine(query_ids, q, doc, query_mask)
        if keep_top_k:
            theta = self.impact_thresholds(doc, keep_top_k).to(s.dtype)[:, None]
            gate = torch.sigmoid((s - theta) / (gate_temperature * theta).clamp(min=1e-12))
            s = s * torch.where(theta > 0, gate, torch.ones_like(gate))
        return (s * query_mask.to(s.dtype)).sum(-1)

    def tokenize_queries(self, queries: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return tokenize(queries, self.config.max_query_len, self.config.encoder)

    def tokenize_documents(self, docs: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        return tokenize(docs, self.config.max_doc_len, self.config.encoder)

    @torch.no_grad()
    def score_texts(self, queries: Sequence[str], docs: Sequence[str], batch_size: int = 16) -> torch.Tensor:
        """Score (query, document) text pairs: tokenise (documents truncated to ``max_doc_len``),
        run ``forward`` ``batch_size`` pairs at a time. Returns a CPU float32 tensor [B]."""
        if len(queries) != len(docs):
            raise ValueError(f"{len(queries)} queries but {len(docs)} documents")
        out = []
        for i in range(0, len(queries), batch_size):
            q_ids, q_mask = self.tokenize_queries(queries[i: i + batch_size])
            d_ids, d_mask = self.tokenize_documents(docs[i: i + batch_size])
            dev = self.device
            out.append(self(q_ids.to(dev), q_mask.to(dev), d_ids.to(dev), d_mask.to(dev)).float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    # ----------------------------------------------------------------- pairwise training
    def pairwise_scores(self, batch: Mapping[str, torch.Tensor], keep_top_k: int = 0,
                        gate_temperature: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores of (query, positive) and (query, negative) from a ``CKCollator`` batch, computed as
        one batch of 2B pairs so batch scaling sees positives and negatives together
        (``keep_top_k``/``gate_temperature``: see ``forward``)."""
        B = batch["query_ids"].shape[0]
        scores = self(batch["query_ids"].repeat(2, 1), batch["query_mask"].repeat(2, 1),
                      torch.cat([batch["pos_ids"], batch["neg_ids"]]),
                      torch.cat([batch["pos_mask"], batch["neg_mask"]]), keep_top_k, gate_temperature)
        return scores[:B], scores[B:]


@dataclass
class CKCollator:
    """Turns training rows (a dict of numpy arrays with ``query``, ``pos_text``, ``neg_text``, as Ray
    Data's ``iter_batches`` yields them) into tensors for ``CKModel.pairwise_scores``. Holds only the
    config (picklable); the tokenizer is loaded once per process."""

    config: CKConfig

    def __call__(self, rows: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
        cfg = self.config
        queries = [str(x) for x in rows["query"]]
        docs = [str(x) for x in rows["pos_text"]] + [str(x) for x in rows["neg_text"]]
        q_ids, q_mask = tokenize(queries, cfg.max_query_len, cfg.encoder)
        d_ids, d_mask = tokenize(docs, cfg.max_doc_len, cfg.encoder)  # one width for pos and neg
        B = len(queries)
        return {"query_ids": q_ids, "query_mask": q_mask, "pos_ids": d_ids[:B], "pos_mask": d_mask[:B],
                "neg_ids": d_ids[B:], "neg_mask": d_mask[B:]}


def small_config(**overrides) -> CKConfig:
    """A tiny randomly initialised configuration for tests and smoke runs."""
    base = CKConfig(vocab_size=1000, emb_dim=24, embedding_init="random", d_model=24, n_layers=2,
                    n_heads=4, ff_dim=32, conv_window=3, n_kernels=11, pool_window=8,
                    pool_stride=4, implicit_hidden=8, dropout=0.0, max_query_len=12, max_doc_len=256)
    return replace(base, **overrides)
