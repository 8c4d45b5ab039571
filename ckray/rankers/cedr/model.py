"""CEDR: contextualised embeddings for document ranking (MacAvaney, Yates, Cohan, Goharian, SIGIR 2019).

One BERT pass over ``[CLS] query [SEP] doc-segment [SEP]`` gives, for every layer ``l`` (the
embedding layer and each transformer layer), contextual vectors of the query and document
tokens. CEDR feeds them to classic interaction rankers:

* **Similarity tensor (Eq. 1).** ``S[l, q, d] = cos(ctx(q, l), ctx(d, l))`` for every query token
  ``q``, document token ``d`` and layer ``l``; the layers are the channels that the ranker sees.
  Padding (query slots past the query, document slots past the document) is zero.
* **Long documents (Section 2.2/3.1).** BERT reads at most ``max_length`` (512) word pieces, query
  included, so a document is split into equal segments that each fit with the query. All segments
  of a batch go through the encoder in one pass; the [CLS] vector is averaged over a document's
  segments and the per-segment similarity matrices are concatenated along the document axis, so the
  ranker sees one matrix over the whole document (each segment with the query contextualised in
  that segment).
* **Joint approach (Section 2.3).** BERT's [CLS] vector is added as an extra input to each
  ranker's final combination:
    - ``knrm``:  RBF kernels per layer (K-NRM), log soft-TF summed over query terms, the
      ``(L+1)·K`` kernel features concatenated with [CLS] → linear score;
    - ``pacrr``: n×n convolutions (n = 1..lg) over the layer channels, max over filters, k-max
      pooling along the document per query term (PACRR-firstk), the per-term signals of all query
      slots concatenated with [CLS] → dense layers;
    - ``drmm``:  log-count matching histograms per query term and layer (DRMM-LCH), each term's
      histograms concatenated with [CLS] → feed-forward matching network → term score, combined by
      the term-gating network (softmax over the query terms' embedding-layer vectors);
    - ``vanilla``: the "Vanilla BERT" ranker of Section 3: [CLS] → linear.
* **Layer truncation (Section 4, "speed").** ``num_layers=L`` keeps only the first ``L`` encoder
  layers, so ``S`` has ``L+1`` channels and the forward pass costs about ``L/12`` (``L/6`` for MiniLM).

Training is pairwise (Section 3.1): a query with a relevant and a non-relevant document; the loss is
the softmax cross-entropy over the pair's two scores (``loss="softmax"``) or a margin hinge
(``loss="hinge"``). Rows come as a dict of numpy arrays with ``query, pos_text, neg_text``
(``CEDRRanker.collate_pairs``). Section 3.1 trains the encoder with a smaller learning rate than
the ranker head: see ``CEDRRanker.param_groups``.

Training on the shared loop: ``CEDRTask`` is the ``ckray.training.RankerTask`` for ``ckray.training.fit``
(collate = ``collate_pairs`` on the triples' ``query, pos_text, neg_text``; loss = the pairwise loss;
score = ``score_texts``; the two learning rates through ``CEDRTask.param_groups``: the encoder at
the job's ``--lr``, the head ``head_lr_multiplier`` times faster).

Implementation choices not fixed by the paper (all in ``CEDRConfig``): query truncated to
``max_query_len`` word pieces and kept in a fixed number of query slots (PACRR's dense layers need a
fixed input size); K-NRM features scaled by ``knrm_feature_scale`` (keeps initial scores O(1);
equivalent to a smaller initial weight); DRMM histograms are hard counts as in DRMM, so for that
variant the encoder learns through [CLS] (and the gating embeddings) only; all ranker heads run in
fp32 even under autocast (the exact-match kernel has σ = 1e-3).

Warm start (``head_init="warm"``; ``"random"`` is the paper's initialisation). The ranker heads start
as a lexical matcher over ``S``, so the untrained model already ranks; no equation changes, only the
initial values of the heads' parameters. A *match* is a similarity of at least ``WARM_MATCH`` (0.6):
on SciFact with MiniLM the same word piece in query and document has a cosine of 0.82–0.95 on
average in every layer (0.35 at the least), other pairs 0.02–0.29 on average (99th percentile ≤ 0.59
in layers 0–3, up to 0.96 in layers 5–6); the exact-match kernel (μ = 1, σ = 1e-3) never fires on
these vectors, whose positions and segments differ.

* ``knrm``: the linear layer weighs the log soft-TF of the last layer's μ = 0.9 kernel by 2,
  everything else (the other kernels and layers, [CLS], the bias) by 0: Σ_q of a saturating count of
  each query term's near-exact matches in the contextual vectors, the K-NRM form of a
  coordinate-matching lexical model. ``knrm_warm_layers="all"`` reads the soft kernels centred at or
  above ``WARM_MATCH`` (μ = 0.9 and 0.7 with 11 kernels) of every layer, weighed by ``1/(L+1)``.
  ``knrm_warm_layers="probe"`` reads every kernel of every layer, weighed by the pairwise probe of
  ``KNRM_PROBE_TRIPLES`` training triples (:meth:`CEDRRanker.warm_start_head`, fitted by the training
  task; ``ckray.models.losses.pairwise_probe``): the linear function of the ``(L+1)·K`` kernel features
  that best orders those pairs, so the kernels' weights come from relevance judgements rather than by
  hand; [CLS] and the bias stay 0. Until it is fitted it is the last layer's head. On SciFact dev (80
  queries × BM25's top 30) the last layer's head starts at nDCG@10 0.672, the all-layer one at 0.629,
  the probe at 0.708 (docs/results.md, "Warm-started cross-encoders at step 0").
* ``pacrr``: filter 0 of each n×n convolution averages the similarity on its diagonal over the
  layers, minus ``WARM_MATCH`` (an in-order n-gram match detector after the ReLU); the other
  filters start at 1/100 of their random values (they stay trainable but do not win the max); the
  dense layers pass the sum of all per-term signals (unit 0 of each layer, [CLS] weight 0).
* ``drmm``: hidden unit 0 of the matching network reads the log-counts of the histogram bins at or
  above ``WARM_MATCH`` (weight ``1/(2(L+1))`` per layer), the output reads unit 0 alone, and the
  term gate starts uniform (weight 0).
* ``vanilla``: [CLS] → linear has no lexical input; its warm start is the pairwise probe of
  :meth:`CEDRRanker.warm_start_head` (the weight that best orders ``PROBE_TRIPLES`` training
  pairs, see ``ckray.models.losses.pairwise_probe``), fitted by the training task.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ckray.errors import ConfigError
from ckray.models.encoders import (DEFAULT_ENCODER, encoder_config, encoder_training_checks,
                                   freeze_bottom_layers, load_encoder, load_tokenizer, set_attention_dropout)
from ckray.models.kernels import RBFKernels, log_soft_tf
from ckray.models.losses import PROBE_TRIPLES, check_probe_triples, pairwise_loss, pairwise_probe

VARIANTS = ("knrm", "pacrr", "drmm", "vanilla")
HEAD_INITS = ("warm", "random")
WARM_MATCH = 0.6           # similarity from which the warm-started heads count a match (module docstring)
KNRM_WARM_LAYERS = ("last", "all", "probe")
KNRM_WARM_LAST_LAYER_MATCH = 0.8   # the last layer's warm KNRM kernels: μ at or above this (μ = 0.9)
KNRM_PROBE_TRIPLES = 256           # training triples the probe-fitted KNRM head is fitted to
Batch = dict[str, torch.Tensor]


@dataclass
class CEDRConfig:
    """Hyperparameters of a CEDR ranker (saved in the checkpoint's ``config.json``)."""

    variant: str = "knrm"                  # knrm | pacrr | drmm | vanilla
    encoder: str = DEFAULT_ENCODER         # HF id or directory of a BERT-style encoder
    num_layers: int | None = None          # keep only the first L encoder layers (None: all)
    max_length: int = 512                  # word pieces per encoder input, query and specials included
    max_query_len: int = 32                # query word pieces kept (= query slots of S)
    max_segments: int = 4                  # document segments per document (the rest is truncated)
    # CEDR-KNRM
    n_kernels: int = 11
    kernel_sigma: float = 0.1
    knrm_feature_scale: float = 0.01
    # CEDR-PACRR
    pacrr_max_ngram: int = 3               # lg: n-gram sizes 1..lg
    pacrr_filters: int = 32                # nf filters per n-gram size
    pacrr_kmax: int = 2                    # ns: k-max pooling along the document
    pacrr_hidden: int = 32
    # CEDR-DRMM
    drmm_bins: int = 30
    drmm_hidden: int = 32
    # shared
    dropout: float = 0.1                   # on the [CLS] vector during training
    loss: str = "softmax"                  # pairwise loss: softmax | hinge
    margin: float = 1.0                    # hinge margin
    tokenizer: str | None = None           # defaults to ``encoder``
    random_init: dict | None = None        # BertConfig kwargs: a randomly initialised encoder (tests)
    head_init: str = "random"              # warm: heads start as a lexical matcher (module docstring) | random
    knrm_warm_layers: str = "last"         # warm KNRM head: last layer | all layers | probe-fitted (module docstring)
    frozen_layers: int = 0                 # bottom layers not trained, embeddings = layer 0 (freeze_bottom_layers)
    attention_dropout: float | None = None  # encoder's attention dropout in training; None: its own (set_attention_dropout)

    def __post_init__(self) -> None:
        checks = {
            "variant": (self.variant in VARIANTS, f"must be one of {VARIANTS}, got {self.variant!r}"),
            "head_init": (self.head_init in HEAD_INITS, f"must be one of {HEAD_INITS}, got {self.head_init!r}"),
            "knrm_warm_layers": (self.knrm_warm_layers in KNRM_WARM_LAYERS,
                                 f"must be one of {KNRM_WARM_LAYERS}, got {self.knrm_warm_layers!r}"),
            "loss": (self.loss in ("softmax", "hinge"), f"must be 'softmax' or 'hinge', got {self.loss!r}"),
            "max_length": (self.max_length >= self.max_query_len + 4,
                           f"must leave room for max_query_len={self.max_query_len} query tokens, 3 special "
                           f"tokens and a document token, got {self.max_length}"),
            "max_segments": (self.max_segments >= 1, f"must be >= 1, got {self.max_segments}"),
            **encoder_training_checks(self.frozen_layers, self.attention_dropout),
        }
        ConfigError.check_fields("CEDRConfig", checks)

    @property
    def warm_head_is_fitted(self) -> bool:
        """Whether the warm head is fitted to training triples (:meth:`CEDRRanker.warm_start_head`):
        the vanilla ranker's, and CEDR-KNRM's with ``knrm_warm_layers="probe"``."""
        return self.head_init == "warm" and (
            self.variant == "vanilla" or (self.variant == "knrm" and self.knrm_warm_layers == "probe"))

    @property
    def warm_probe_triples(self) -> int:
        """How many training triples the fitted warm head is fitted to (0: it needs none)."""
        if not self.warm_head_is_fitted:
            return 0
        return PROBE_TRIPLES if self.variant == "vanilla" else KNRM_PROBE_TRIPLES


@dataclass
class CEDREncoding:
    """What the rankers read from one encoder pass (B documents, L+1 layers, Q query slots, D doc slots)."""

    sim: torch.Tensor | None     # [B, L+1, Q, D] cosine similarities, padding zeroed (Eq. 1);
                                 # Q = the batch's longest query, D = its longest document
    query_mask: torch.Tensor     # [B, Q] bool
    doc_mask: torch.Tensor       # [B, D] bool
    cls: torch.Tensor            # [B, H] last-layer [CLS], averaged over segments
    query_emb: torch.Tensor      # [B, Q, H] embedding-layer (non-contextual) query vectors


def matching_histogram(sim: torch.Tensor, doc_mask: torch.Tensor, bins: int) -> torch.Tensor:
    """DRMM's matching histogram: counts of ``sim[..., q, d]`` (``[B, L, Q, D]``) in ``bins``
    equal-width bins over [-1, 1] (1.0 falls in the last bin), per (layer, query term); padded
    document slots are not counted. Hard counts, so no gradient flows to ``sim``. → ``[B, L, Q, bins]``."""
    sim = sim.detach()
    idx = ((sim + 1) / 2 * bins).floor().long().clamp(0, bins - 1)
    real = doc_mask[:, None, None, :].expand_as(sim).to(sim.dtype)
    return sim.new_zeros(*sim.shape[:3], bins).scatter_add_(-1, idx, real)


def _as_str_list(x: Iterable[Any]) -> list[str]:
    return [str(v) for v in (x.tolist() if isinstance(x, np.ndarray) else x)]


def segment_room(config: CEDRConfig, query_len: int) -> int:
    """Document word pieces one segment holds beside a query of ``query_len`` pieces and [CLS], [SEP], [SEP]."""
    return config.max_length - query_len - 3


def tokenize_pairs(tokenizer: Any, config: CEDRConfig, queries: Iterable[str], docs: Iterable[str]) -> Batch:
    """Tokenise (query, document) pairs into one encoder batch of all their segments.

    Each document of length ``n`` with a query of ``m`` word pieces is cut into
    ``s = ceil(n / c)`` equal segments of ``ceil(n / s)`` tokens, ``c = max_length - m - 3``
    (at most ``max_segments``; the document is truncated to ``max_segments · c`` first).
    The split depends only on the pair, never on the rest of the batch.

    Returns tensors: ``input_ids, token_type_ids, attention_mask`` ``[R, T]`` (R segment rows),
    ``row_example`` ``[R]`` (the pair each row belongs to), ``query_len`` ``[B]``,
    ``first_row`` ``[B]``, and ``doc_row, doc_pos, doc_mask`` ``[B, D]`` (where each document
    token of the concatenated document sits in the rows).
    """
    cfg, tok = config, tokenizer
    queries, docs = _as_str_list(queries), _as_str_list(docs)
    if len(queries) != len(docs):
        raise ValueError(f"{len(queries)} queries but {len(docs)} documents")
    q_ids = tok(queries, add_special_tokens=False, truncation=True,
                max_length=cfg.max_query_len)["input_ids"] if queries else []
    doc_cap = cfg.max_segments * (cfg.max_length - 4)
    d_ids = tok(docs, add_special_tokens=False, truncation=True, max_length=doc_cap)["input_ids"] if docs else []
    cls_id, sep_id, pad_id = tok.cls_token_id, tok.sep_token_id, tok.pad_token_id

    rows, types, row_example, first_row, doc_locs = [], [], [], [], []
    for b, (q, d) in enumerate(zip(q_ids, d_ids)):
        cap = segment_room(cfg, len(q))
        d = d[: cfg.max_segments * cap]
        n_seg = max(1, math.ceil(len(d) / cap))
        size = max(1, math.ceil(len(d) / n_seg))
        first_row.append(len(rows))
        locs = []
        for s in range(n_seg):
            seg = d[s * size:(s + 1) * size]
            start = len(q) + 2
            locs.extend((len(rows), start + j) for j in range(len(seg)))
            rows.append([cls_id, *q, sep_id, *seg, sep_id])
            types.append([0] * (len(q) + 2) + [1] * (len(seg) + 1))
            row_example.append(b)
        doc_locs.append(locs)

    n_rows, bsz = len(rows), len(q_ids)
    t = max((len(r) for r in rows), default=1)
    d_max = max((len(x) for x in doc_locs), default=0)
    d_max = max(d_max, 1)
    input_ids = torch.full((n_rows, t), pad_id, dtype=torch.long)
    token_type_ids = torch.zeros((n_rows, t), dtype=torch.long)
    attention_mask = torch.zeros((n_rows, t), dtype=torch.long)
    for r, (ids, ty) in enumerate(zip(rows, types)):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        token_type_ids[r, : len(ty)] = torch.tensor(ty)
        attention_mask[r, : len(ids)] = 1
    doc_row = torch.zeros((bsz, d_max), dtype=torch.long)
    doc_pos = torch.zeros((bsz, d_max), dtype=torch.long)
    doc_mask = torch.zeros((bsz, d_max), dtype=torch.bool)
    for b, locs in enumerate(doc_locs):
        if locs:
            loc = torch.tensor(locs)
            doc_row[b, : len(locs)], doc_pos[b, : len(locs)] = loc[:, 0], loc[:, 1]
            doc_mask[b, : len(locs)] = True
    return {
        "input_ids": input_ids, "token_type_ids": token_type_ids, "attention_mask": attention_mask,
        "row_example": torch.tensor(row_example, dtype=torch.long),
        "first_row": torch.tensor(first_row, dtype=torch.long),
        "query_len": torch.tensor([len(q) for q in q_ids], dtype=torch.long),
        "doc_row": doc_row, "doc_pos": doc_pos, "doc_mask": doc_mask,
    }


def collate_pairs(tokenizer: Any, config: CEDRConfig, rows: Mapping[str, Any]) -> Batch:
    """Training rows (dict of arrays with ``query, pos_text, neg_text``) → one batch of 2N pairs:
    the N (query, positive) pairs first, then the N (query, negative) pairs."""
    q = _as_str_list(rows["query"])
    return tokenize_pairs(tokenizer, config, q + q,
                          _as_str_list(rows["pos_text"]) + _as_str_list(rows["neg_text"]))


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' load report / progress bars (truncated encoders report unused layers)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


class CEDRRanker(nn.Module):
    """CEDR-KNRM / CEDR-PACRR / CEDR-DRMM, or the vanilla BERT ranker, over one BERT encoder."""

    def __init__(self, config: CEDRConfig):
        super().__init__()
        self.config = config
        with _quiet_transformers():
            if config.random_init is not None:
                from transformers import BertConfig, BertModel

                kw = dict(config.random_init)
                if config.num_layers is not None:
                    kw["num_hidden_layers"] = config.num_layers
                self.encoder = BertModel(BertConfig(**kw), add_pooling_layer=False)
            else:
                available = encoder_config(config.encoder).num_hidden_layers
                if config.num_layers is not None and not 1 <= config.num_layers <= available:
                    raise ValueError(f"num_layers={config.num_layers}: {config.encoder} has {available} layers")
                self.encoder = load_encoder(config.encoder, num_layers=config.num_layers)
        self.encoder.pooler = None  # unused: CEDR reads the raw [CLS] vector
        freeze_bottom_layers(self.encoder, config.frozen_layers)
        set_attention_dropout(self.encoder, config.attention_dropout)
        enc = self.encoder.config
        if config.max_length > enc.max_position_embeddings:
            raise ValueError(f"max_length {config.max_length} exceeds the encoder's "
                             f"{enc.max_position_embeddings} positions")
        self.tokenizer = load_tokenizer(config.tokenizer or config.encoder)
        hidden = enc.hidden_size
        self.n_channels = enc.num_hidden_layers + 1  # embedding layer + each transformer layer
        self.cls_dropout = nn.Dropout(config.dropout)
        v = config.variant
        if v == "knrm":
            self.kernels = RBFKernels(config.n_kernels, config.kernel_sigma)
            self.knrm_out = nn.Linear(self.n_channels * config.n_kernels + hidden, 1)
        elif v == "pacrr":
            self.ngram_convs = nn.ModuleList(
                nn.Conv2d(self.n_channels, config.pacrr_filters, kernel_size=n)
                for n in range(1, config.pacrr_max_ngram + 1))
            n_in = config.max_query_len * config.pacrr_max_ngram * config.pacrr_kmax + hidden
            self.pacrr_mlp = nn.Sequential(
                nn.Linear(n_in, config.pacrr_hidden), nn.ReLU(),
                nn.Linear(config.pacrr_hidden, config.pacrr_hidden), nn.ReLU(),
                nn.Linear(config.pacrr_hidden, 1))
        elif v == "drmm":
            self.drmm_ffn = nn.Sequential(
                nn.Linear(self.n_channels * config.drmm_bins + hidden, config.drmm_hidden), nn.Tanh(),
                nn.Linear(config.drmm_hidden, 1))
            self.drmm_gate = nn.Linear(hidden, 1, bias=False)
        else:
            self.vanilla_out = nn.Linear(hidden, 1)
        if config.head_init == "warm":
            self._warm_start()

    # ------------------------------------------------------------------ warm start (module docstring)
    @torch.no_grad()
    def _warm_start(self) -> None:
        """Set the ranker head's initial parameters to the lexical matcher of its variant."""
        v, c = self.config.variant, self.n_channels
        if v == "knrm":
            w = self.knrm_out.weight.zero_()
            self.knrm_out.bias.zero_()
            per_layer = w[0, : c * self.kernels.n_kernels].view(c, -1)        # [L+1, K]
            soft = self.kernels.sigmas > self.kernels.sigmas.min()              # not the exact-match kernel
            if self.config.knrm_warm_layers == "all":
                per_layer[:, soft & (self.kernels.mus >= WARM_MATCH)] = 1.0 / c
            else:                       # "last", and "probe" until warm_start_head fits it
                per_layer[-1, soft & (self.kernels.mus >= KNRM_WARM_LAST_LAYER_MATCH)] = 2.0
        elif v == "pacrr":
            for n, conv in enumerate(self.ngram_convs, start=1):
                conv.weight.mul_(0.01)
                conv.bias.mul_(0.01)
                conv.weight[0] = torch.eye(n).expand(c, n, n) / (c * n)
                conv.bias[0] = -WARM_MATCH
            n_terms = self.pacrr_mlp[0].in_features - self.encoder.config.hidden_size
            for i, layer in enumerate(self.pacrr_mlp[::2]):   # unit 0 of each dense layer: the sum
                layer.weight[0].zero_()
                layer.bias[0] = 0.0
                layer.weight[0, : n_terms if i == 0 else 1] = 1.0
        elif v == "drmm":
            bins = self.config.drmm_bins
            first, out = self.drmm_ffn[0], self.drmm_ffn[2]
            lower_edge = torch.arange(bins, dtype=torch.float32) * 2 / bins - 1
            first.weight[0].zero_()
            first.bias[0] = 0.0
            first.weight[0, : c * bins].view(c, bins)[:, lower_edge >= WARM_MATCH - 1e-6] = 0.5 / c
            out.weight.zero_()
            out.weight[0, 0] = 1.0
            out.bias.zero_()
            self.drmm_gate.weight.zero_()

    @torch.no_grad()
    def warm_start_head(self, queries: list[str], pos_docs: list[str], neg_docs: list[str],
                        batch_size: int = 8) -> None:
        """Fit the warm head to (query, d+) and (query, d−) training pairs by the pairwise probe
        (``ckray.models.losses.pairwise_probe``), bias 0: the vanilla ranker's [CLS] → score weight on
        the [CLS] vectors; CEDR-KNRM's (``knrm_warm_layers="probe"``) weights of the ``(L+1)·K`` kernel
        features, its [CLS] weights 0. The other heads start warm in ``__init__``."""
        if not self.config.warm_head_is_fitted:
            raise ValueError(f"warm_start_head fits the vanilla ranker's head and CEDR-KNRM's with "
                             f"knrm_warm_layers='probe'; {self.config.variant} with head_init="
                             f"{self.config.head_init!r} and knrm_warm_layers={self.config.knrm_warm_layers!r} "
                             f"starts warm in __init__")
        check_probe_triples(queries, pos_docs, neg_docs)
        vanilla = self.config.variant == "vanilla"
        was_training = self.training
        self.eval()
        try:
            feats = []
            for docs in (pos_docs, neg_docs):
                for i in range(0, len(docs), batch_size):
                    e = self.encode(self.tokenize_pairs(queries[i:i + batch_size], docs[i:i + batch_size]),
                                    with_sim=not vanilla)
                    feats.append(e.cls if vanilla else self.knrm_features(e))
        finally:
            self.train(was_training)
        x = torch.cat(feats)
        w = pairwise_probe(x[: len(pos_docs)], x[len(pos_docs):])
        head = self.vanilla_out if vanilla else self.knrm_out
        head.weight.zero_()
        head.weight[0, : w.shape[0]] = w
        head.bias.zero_()

    # ------------------------------------------------------------------ tokenisation
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def document_pieces(self) -> int:
        """Word pieces of a document that one input reads with any query: ``max_segments`` segments of what
        a segment holds beside the longest query and three special tokens (``tokenize_pairs``); a longer
        document is cut there, or read in windows of this many pieces (``ckray.rerank``)."""
        return self.config.max_segments * segment_room(self.config, self.config.max_query_len)

    def tokenize_pairs(self, queries: Iterable[str], docs: Iterable[str]) -> Batch:
        """Tokenise (query, document) pairs into one encoder batch (see module-level ``tokenize_pairs``)."""
        return tokenize_pairs(self.tokenizer, self.config, queries, docs)

    def collate_pairs(self, rows: Mapping[str, Any]) -> Batch:
        """Training rows (dict of arrays with ``query, pos_text, neg_text``) → one batch of 2N pairs."""
        return collate_pairs(self.tokenizer, self.config, rows)

    # ------------------------------------------------------------------ encoder → S (Eq. 1)
    def encode(self, batch: Batch, with_sim: bool = True) -> CEDREncoding:
        """Run the encoder over all segment rows once and build ``S`` (Eq. 1) and the [CLS] vector."""
        dev = self.device
        batch = {k: v.to(dev) for k, v in batch.items()}
        out = self.encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           token_type_ids=batch["token_type_ids"], output_hidden_states=True)
        with torch.autocast(device_type=dev.type, enabled=False):
            first, last = out.hidden_states[0].float(), out.hidden_states[-1].float()
            n_rows, t = last.shape[0], last.shape[1]
            bsz = batch["query_len"].shape[0]
            # query slots: as many as the batch's longest query (padded slots would only add zeros);
            # PACRR pads S back to ``max_query_len`` slots for its fixed-size dense layers
            n_q = max(1, int(batch["query_len"].max())) if bsz else 1
            slots = torch.arange(n_q, device=dev)
            query_mask = slots[None, :] < batch["query_len"][:, None]      # [B, Q]
            doc_mask = batch["doc_mask"]                                    # [B, D]

            # [CLS] of the last layer, averaged over each document's segments (Section 3.1)
            row_ex = batch["row_example"]
            cls_sum = torch.zeros(bsz, last.shape[-1], device=dev).index_add_(0, row_ex, last[:, 0])
            n_seg = torch.zeros(bsz, device=dev).index_add_(0, row_ex, torch.ones(n_rows, device=dev))
            cls = cls_sum / n_seg.clamp(min=1)[:, None]

            qpos = (slots + 1).clamp(max=t - 1)                             # query tokens at 1..m
            query_emb = first[batch["first_row"]][:, qpos]                  # [B, Q, H]
            sim = None
            if with_sim:
                hs = torch.stack([h.float() for h in out.hidden_states])  # [L+1, R, T, H]
                unit = F.normalize(hs, dim=-1, eps=1e-8)
                row_sim = torch.einsum("lrqh,lrth->lrqt", unit[:, :, qpos], unit)   # [L+1, R, Q, T]
                # per-segment matrices → one matrix over the concatenated document
                sim = row_sim[:, batch["doc_row"], :, batch["doc_pos"]]     # [B, D, L+1, Q]
                sim = sim.permute(0, 2, 3, 1)                               # [B, L+1, Q, D]
                pair_mask = query_mask[:, None, :, None] & doc_mask[:, None, None, :]
                sim = sim * pair_mask.to(sim.dtype)                         # padding zeroed
        return CEDREncoding(sim=sim, query_mask=query_mask, doc_mask=doc_mask, cls=cls, query_emb=query_emb)

    # ------------------------------------------------------------------ ranker heads
    def knrm_features(self, e: CEDREncoding) -> torch.Tensor:
        """K-NRM per layer: Σ_q log Σ_d K_k(S[l, q, d]) → the ``[B, (L+1)·K]`` kernel features φ
        (scaled by ``knrm_feature_scale``)."""
        feats = []
        qm = e.query_mask.to(e.sim.dtype)
        for layer in range(e.sim.shape[1]):
            k = self.kernels(e.sim[:, layer], e.doc_mask[:, None, :])   # [B, Q, D, K]
            feats.append((log_soft_tf(k) * qm[..., None]).sum(dim=1))   # [B, K]
        return torch.cat(feats, dim=-1) * self.config.knrm_feature_scale

    def _knrm(self, e: CEDREncoding, cls: torch.Tensor) -> torch.Tensor:
        """CEDR-KNRM: the kernel features φ joined with [CLS] → linear score."""
        return self.knrm_out(torch.cat([self.knrm_features(e), cls], dim=-1)).squeeze(-1)

    def _pacrr(self, e: CEDREncoding, cls: torch.Tensor) -> torch.Tensor:
        """PACRR-firstk: n×n convolutions over the layer channels, max over filters, k-max along the
        document per query term; all query slots' signals and [CLS] → dense layers."""
        k_max = self.config.pacrr_kmax
        d_len = e.sim.shape[-1]
        q_pad = self.config.max_query_len - e.sim.shape[2]
        sim = F.pad(e.sim, (0, 0, 0, q_pad))                            # fixed query slots
        query_mask = F.pad(e.query_mask, (0, q_pad), value=False)
        signals = []
        for n, conv in enumerate(self.ngram_convs, start=1):
            x = F.pad(sim, (0, n - 1, 0, n - 1))                        # n-grams starting at (q, d)
            m = F.relu(conv(x)).amax(dim=1)                             # [B, Q, D]
            m = m.masked_fill(~e.doc_mask[:, None, :], float("-inf"))
            top = m.topk(min(k_max, d_len), dim=-1).values
            if top.shape[-1] < k_max:
                top = F.pad(top, (0, k_max - top.shape[-1]), value=float("-inf"))
            signals.append(torch.where(torch.isinf(top), torch.zeros_like(top), top))
        per_term = torch.cat(signals, dim=-1) * query_mask[..., None].to(sim.dtype)  # [B, Q, lg·k]
        return self.pacrr_mlp(torch.cat([per_term.flatten(1), cls], dim=-1)).squeeze(-1)

    def _drmm(self, e: CEDREncoding, cls: torch.Tensor) -> torch.Tensor:
        """DRMM: log-count histograms of S per (query term, layer), joined with [CLS], through the
        feed-forward matching network; term scores combined by softmax term gating."""
        hist = torch.log1p(matching_histogram(e.sim, e.doc_mask, self.config.drmm_bins))  # LCH
        hist = hist.permute(0, 2, 1, 3).flatten(2)                      # [B, Q, (L+1)·bins]
        n_q = hist.shape[1]
        x = torch.cat([hist, cls[:, None, :].expand(-1, n_q, -1)], dim=-1)
        term = self.drmm_ffn(x).squeeze(-1)                             # [B, Q]
        gate = self.drmm_gate(e.query_emb).squeeze(-1).masked_fill(~e.query_mask, -1e4)
        weight = torch.softmax(gate, dim=-1) * e.query_mask.to(term.dtype)
        return (weight * term).sum(dim=-1)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Scores ``[B]`` for a batch from ``tokenize_pairs``."""
        return self.score_encoding(self.encode(batch, with_sim=self.config.variant != "vanilla"))

    def score_encoding(self, e: CEDREncoding) -> torch.Tensor:
        """The ranker head: scores ``[B]`` of an ``encode`` result (heads of several variants over one
        encoder can share one encoding)."""
        with torch.autocast(device_type=self.device.type, enabled=False):
            cls = self.cls_dropout(e.cls)
            v = self.config.variant
            if v == "knrm":
                return self._knrm(e, cls)
            if v == "pacrr":
                return self._pacrr(e, cls)
            if v == "drmm":
                return self._drmm(e, cls)
            return self.vanilla_out(cls).squeeze(-1)

    # ------------------------------------------------------------------ training / scoring API
    def pairwise_loss(self, batch: Batch) -> torch.Tensor:
        """Loss of a ``collate_pairs`` batch (first half positives, second half negatives)."""
        scores = self.forward(batch)
        n = scores.shape[0] // 2
        return pairwise_loss(scores[:n], scores[n:], self.config.loss, self.config.margin)

    @torch.inference_mode()
    def score_texts(self, queries: list[str], docs: list[str]) -> torch.Tensor:
        """Scores ``[B]`` (on the CPU, fp32) of (query, document) pairs; no gradient. Call ``eval()`` first
        for deterministic scores (``load_model`` returns the model in eval mode)."""
        if not len(queries):
            return torch.zeros(0)
        return self.forward(self.tokenize_pairs(queries, docs)).float().cpu()

    def param_groups(self, encoder_lr: float = 2e-5, head_lr: float = 1e-3) -> list[dict]:
        """Optimizer groups: the encoder fine-tuned gently, the ranker head faster (Section 3.1); frozen
        encoder layers (``frozen_layers``) are in neither."""
        trained = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        enc = [p for n, p in trained if n.startswith("encoder.")]
        head = [p for n, p in trained if not n.startswith("encoder.")]
        return [{"params": enc, "lr": encoder_lr}, {"params": head, "lr": head_lr}]


def build_cedr(variant: str = "knrm", **kwargs: Any) -> CEDRRanker:
    """Shorthand: ``build_cedr("pacrr", num_layers=3)``."""
    return CEDRRanker(CEDRConfig(variant=variant, **kwargs))
