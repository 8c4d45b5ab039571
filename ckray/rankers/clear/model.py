"""CLEAR: a dense retriever trained on the *residual* of BM25.

Gao, Dai, Chen, Fan, Van Durme, Callan (2020), "Complementing Lexical Retrieval with Semantic
Residual Embedding", arXiv:2004.13969.

Model (Eq. 1–4). A query ``q`` and a document ``d`` are encoded by two BERT towers that share their
lower layers (the embeddings and the first ``shared_layers`` transformer layers) and own a private
copy of the upper layers::

    H_q = BERT_Q(q) = Upper_Q(Lower(q))          H_d = BERT_D(d) = Upper_D(Lower(d))      (Eq. 1–2)
    v_q = MeanPool(LN(W H_q))                    v_d = MeanPool(LN(W H_d))                (Eq. 3)
    s_emb(q, d) = v_q · v_d                                                               (Eq. 4)

The paper shares the lower 8 of BERT-base's 12 layers; by default the split keeps that ratio
(``round(8/12 · L)``, i.e. 4 of MiniLM's 6 layers). The mean runs over real (non-padding) tokens.
Both upper towers start as copies of the pretrained upper layers, so an untrained CLEAR equals the
pretrained encoder.

Starting from a sentence-embedding encoder (the offline default all-MiniLM-L6-v2 was trained with
mean pooling + L2 normalisation) the head is initialised so that nothing changes at step 0: the
projection ``W`` starts as the identity, the layer norm is optional (``layer_norm``; off by default
because a fresh LN re-centres and re-scales every token and measurably hurts zero-shot ranking, see
the measurement in ``CLEARConfig``), and ``normalize`` adds the L2 normalisation the encoder was trained with, so
``s_emb`` is a cosine in [-1, 1]. A fresh random projection / LN is available for bert-base-style
encoders that were never trained for embeddings (``projection_init="random"``, ``layer_norm=True``).

Training (Eq. 6–7): a hinge on a BM25 negative ``d-`` with a *residual* margin::

    L = [ m_r − s_emb(q, d+) + s_emb(q, d−) ]_+                                           (Eq. 6)
    m_r = ξ − λ_train · (s_lex(q, d+) − s_lex(q, d−))                                     (Eq. 7)

When BM25 already separates the pair by a lot, ``m_r`` is small or negative and the embedding need
not try; when BM25 ranks the negative above the positive, ``m_r > ξ`` and the embedding must make up
the difference. ``constant_margin=True`` gives the ablation ``m_r = ξ``.

Retrieval (Eq. 8) interpolates both scores, ``s = λ_test · s_lex + s_emb`` (``ckray.rankers.clear.hybrid``).
Since ``λ·s_lex + s_emb`` ranks ``d+`` over ``d-`` exactly when ``s_emb(d+) − s_emb(d−) >
−λ·Δs_lex``, choosing ``λ_train ≈ λ_test`` makes the training margin the one the hybrid needs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from transformers import AutoModel

from ckray.errors import ConfigError
from ckray.models.encoders import (DEFAULT_ENCODER, architecture_of, document_windows, encoder_config, load_tokenizer,
                                   mean_pool, resolve_encoder)
from ckray.models.losses import pairwise_loss


# ---------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------

@dataclass
class CLEARConfig:
    """Hyperparameters of the CLEAR encoder (everything needed to rebuild it from a checkpoint).

    encoder:          Hugging Face id or directory of the BERT-style encoder and its tokenizer.
    shared_layers:    transformer layers shared by both towers (None: round(8/12 · depth), the paper's ratio).
    dim:              output dimension of the projection W (None: the encoder's hidden size).
    projection_init:  "identity" (needs dim == hidden; keeps the pretrained geometry) or "random".
    layer_norm:       apply a LayerNorm to the projected tokens before pooling (Eq. 3).
    normalize:        L2-normalise v_q, v_d (s_emb becomes a cosine; what the MiniLM was trained with).

    Zero-shot check of these head options on the untrained MiniLM (150 SciFact *training* queries,
    ranking their judged documents among 1,500 others, nDCG@10): mean + L2 (the default) 0.775;
    fresh token LN + mean + L2 0.764; LN initialised from the last layer's LN + L2 0.762; fresh LN
    without L2 0.740; plain mean without L2 0.728. Hence ``layer_norm=False, normalize=True``.
    query_max_len / doc_max_len: truncation lengths in word pieces.
    pretrained:       load pretrained encoder weights in ``__init__``. A constructed model records the
                      encoder architecture in ``bert_config`` and sets this to False in ``self.config``,
                      so a checkpoint rebuilds the architecture without fetching weights it overwrites.
    bert_config:      architecture of the encoder (a ``transformers`` config dict); when given with
                      ``pretrained=False`` the encoder is built from it with random weights (tests).
    """

    encoder: str = DEFAULT_ENCODER
    shared_layers: int | None = None
    dim: int | None = None
    projection_init: str = "identity"
    layer_norm: bool = False
    normalize: bool = True
    query_max_len: int = 64
    doc_max_len: int = 256
    pretrained: bool = True
    bert_config: dict[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        self.encoder = str(self.encoder)   # a Path is fine to pass; the checkpoint stores JSON


@dataclass
class CLEARLossConfig:
    """Eq. 6–7. ``xi`` (ξ) is the base margin, ``lambda_train`` weights the BM25 score gap.

    With ``normalize=True`` s_emb is a cosine, so ξ is on the cosine scale; λ_train ≈ the λ_test the
    hybrid will use (≈ 0.05 for BM25 + MiniLM cosine on SciFact) keeps training and retrieval consistent.
    """

    xi: float = 0.2
    lambda_train: float = 0.05
    constant_margin: bool = False


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

def _bidirectional_mask(config, embeddings: torch.Tensor, attention_mask: torch.Tensor):
    """The attention mask in the form the encoder's attention implementation expects."""
    try:  # transformers >= 5
        from transformers.masking_utils import create_bidirectional_mask

        return create_bidirectional_mask(config=config, inputs_embeds=embeddings, attention_mask=attention_mask)
    except ImportError:  # pragma: no cover - transformers 4.x: additive [B, 1, 1, T] mask
        ext = attention_mask[:, None, None, :].to(embeddings.dtype)
        return (1.0 - ext) * torch.finfo(embeddings.dtype).min


class CLEAR(nn.Module):
    """Two-tower BERT with shared lower layers; ``s_emb(q, d) = v_q · v_d`` (Eq. 1–4)."""

    def __init__(self, config: CLEARConfig | None = None):
        super().__init__()
        config = config or CLEARConfig()
        bert = self._build_encoder(config)
        depth = bert.config.num_hidden_layers
        shared = config.shared_layers if config.shared_layers is not None else round(depth * 8 / 12)
        if not 0 <= shared <= depth:
            raise ConfigError(f"CLEARConfig.shared_layers={shared} must lie in [0, {depth}] for {config.encoder}")
        hidden = bert.config.hidden_size
        dim = config.dim or hidden
        if config.projection_init not in ("identity", "random"):
            raise ConfigError(f"CLEARConfig.projection_init must be 'identity' or 'random', not {config.projection_init!r}")
        if config.projection_init == "identity" and dim != hidden:
            raise ConfigError(f"CLEARConfig.projection_init='identity' needs dim == hidden size ({hidden}), got {dim}")

        self.bert_config = bert.config
        # Shared lower part: embeddings + layers [0, shared).
        self.embeddings = bert.embeddings
        self.shared_layers = nn.ModuleList(bert.encoder.layer[:shared])
        # Tower-specific upper parts, both initialised from the pretrained layers [shared, depth).
        self.doc_layers = nn.ModuleList(bert.encoder.layer[shared:])
        self.query_layers = copy.deepcopy(self.doc_layers)
        # Head (Eq. 3), shared by both towers so v_q and v_d live in one space.
        self.projection = nn.Linear(hidden, dim)
        if config.projection_init == "identity":
            with torch.no_grad():
                self.projection.weight.copy_(torch.eye(dim, hidden))
                self.projection.bias.zero_()
        self.norm = nn.LayerNorm(dim) if config.layer_norm else nn.Identity()

        # What a checkpoint needs: the resolved depth split and the architecture, not the weights.
        self.config = replace(config, shared_layers=shared, dim=dim, pretrained=False,
                              bert_config=architecture_of(bert.config))
        self.tokenizer = load_tokenizer(config.encoder)

    @staticmethod
    def _build_encoder(config: CLEARConfig):
        """The BERT-family encoder (BERT, RoBERTa, ELECTRA, MiniLM: layers in ``encoder.layer``)."""
        if config.pretrained:
            bert = _no_pooler(lambda **kw: AutoModel.from_pretrained(resolve_encoder(config.encoder), **kw))
        else:
            hf_config = encoder_config(config.encoder, config.bert_config)
            bert = _no_pooler(lambda **kw: AutoModel.from_config(hf_config, **kw))
        if not hasattr(getattr(bert, "encoder", None), "layer") or not hasattr(bert, "embeddings"):
            raise ConfigError(f"CLEARConfig.encoder={config.encoder!r} is a {type(bert).__name__}; CLEAR needs a "
                              f"BERT-family encoder with .embeddings and .encoder.layer (bert, roberta, electra)")
        return bert

    # -- towers ---------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.projection.weight.device

    def _encode(self, upper: nn.ModuleList, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Eq. 1–3 for one tower: shared lower layers, the tower's upper layers, head, mean pool."""
        h = self.embeddings(input_ids=input_ids)
        mask = _bidirectional_mask(self.bert_config, h, attention_mask)
        for layer in self.shared_layers:
            h = _layer_out(layer(h, mask))
        for layer in upper:
            h = _layer_out(layer(h, mask))
        v = mean_pool(self.norm(self.projection(h)), attention_mask)
        if self.config.normalize:
            v = nn.functional.normalize(v, dim=-1)
        return v

    def query_embeddings(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """v_q for tokenised queries ``[B, T]`` → ``[B, D]`` (differentiable)."""
        return self._encode(self.query_layers, input_ids, attention_mask)

    def document_embeddings(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """v_d for tokenised documents ``[B, T]`` → ``[B, D]`` (differentiable)."""
        return self._encode(self.doc_layers, input_ids, attention_mask)

    def forward(self, q_input_ids, q_attention_mask, d_input_ids, d_attention_mask) -> torch.Tensor:
        """s_emb(q_i, d_i) for aligned batches (Eq. 4)."""
        vq = self.query_embeddings(q_input_ids, q_attention_mask)
        vd = self.document_embeddings(d_input_ids, d_attention_mask)
        return (vq * vd).sum(-1)

    # -- text API -------------------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str], max_len: int) -> dict[str, torch.Tensor]:
        enc = self.tokenizer(list(texts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}

    @torch.no_grad()
    def _encode_texts(self, texts: Sequence[str], query: bool, batch_size: int) -> torch.Tensor:
        """``[B, D]``: each text truncated at the tower's length (``query_max_len`` / ``doc_max_len``)."""
        max_len = self.config.query_max_len if query else self.config.doc_max_len
        ids = self.tokenizer(list(texts), truncation=True, max_length=max_len)["input_ids"] if len(texts) else []
        return self._encode_ids(self.query_layers if query else self.doc_layers, ids, batch_size)

    def _encode_ids(self, upper: nn.ModuleList, ids: list[list[int]], batch_size: int) -> torch.Tensor:
        """Encode word-piece sequences in length-sorted batches (less padding), rows in input order, on CPU.

        Always in eval mode (no dropout), whatever mode the module is in; the mode is restored.
        """
        was_training = self.training
        self.eval()
        try:
            order = np.argsort([-len(x) for x in ids], kind="stable")
            out = torch.empty(len(ids), self.config.dim)
            for i in range(0, len(ids), batch_size):
                idx = order[i:i + batch_size]
                tok = self.tokenizer.pad({"input_ids": [ids[j] for j in idx]}, return_tensors="pt")
                v = self._encode(upper, tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device))
                out[torch.as_tensor(idx)] = v.float().cpu()
            return out
        finally:
            self.train(was_training)

    def encode_queries(self, queries: Sequence[str], batch_size: int = 128) -> torch.Tensor:
        """``[B, D]`` query embeddings v_q (no gradient)."""
        return self._encode_texts(queries, True, batch_size)

    def encode_documents(self, documents: Sequence[str], batch_size: int = 32) -> torch.Tensor:
        """``[B, D]`` document embeddings v_d (no gradient). Texts are ``doc_text(title, text)``."""
        return self._encode_texts(documents, False, batch_size)

    @torch.no_grad()
    def encode_document_passages(self, documents: Sequence[str], max_passages: int, overlap: int,
                                 batch_size: int = 32) -> list[torch.Tensor]:
        """``[n_p, D]`` per document: v_d of each window of ``doc_max_len`` word pieces (consecutive windows share
        ``overlap`` of them; the first ``max_passages``, or all of them with 0), for scoring a document by its
        best passage (MaxP, Dai & Callan 2019). A document that fits one window gets the one row
        :meth:`encode_documents` gives it. No gradient."""
        if not len(documents):
            return []
        windows, per_doc = document_windows(self.tokenizer, documents, self.config.doc_max_len, max_passages, overlap)
        return list(torch.split(self._encode_ids(self.doc_layers, windows, batch_size), per_doc))

    def score_texts(self, queries: Sequence[str], documents: Sequence[str]) -> torch.Tensor:
        """``[B]`` s_emb(q_i, d_i) for aligned lists (Eq. 4)."""
        if len(queries) != len(documents):
            raise ValueError(f"score_texts needs aligned lists, got {len(queries)} queries and {len(documents)} documents")
        row = {q: i for i, q in enumerate(dict.fromkeys(queries))}  # dev sets repeat each query per candidate
        vq = self.encode_queries(list(row))[torch.as_tensor([row[q] for q in queries], dtype=torch.long)]
        return (vq * self.encode_documents(documents)).sum(-1)


def _no_pooler(build):
    """Build without the unused pooler where the architecture has the option."""
    try:
        return build(add_pooling_layer=False)
    except TypeError:
        return build()


def _layer_out(out):
    """A transformers layer returns a tensor (v5) or a tuple whose first item is one (v4)."""
    return out[0] if isinstance(out, tuple) else out


# ---------------------------------------------------------------------------------------------
# Loss (Eq. 6–7) and the training-loop plug (RankerTask)
# ---------------------------------------------------------------------------------------------

def residual_margin_loss(s_pos: torch.Tensor, s_neg: torch.Tensor, lex_pos: torch.Tensor, lex_neg: torch.Tensor,
                         xi: float, lambda_train: float, constant_margin: bool = False,
                         reduction: str = "mean") -> torch.Tensor:
    """``[m_r − s_emb(q,d+) + s_emb(q,d−)]_+`` with ``m_r = ξ − λ_train·(s_lex(q,d+) − s_lex(q,d−))`` (Eq. 6–7):
    the hinge of ``ckray.models.losses.pairwise_loss`` with one margin per pair.

    ``constant_margin=True`` uses ``m_r = ξ`` (the ablation). ``reduction``: "mean", "sum" or "none".
    """
    lex_gap = (lex_pos - lex_neg).to(s_pos.dtype)
    margin = torch.full_like(s_pos, xi) if constant_margin else xi - lambda_train * lex_gap
    return pairwise_loss(s_pos, s_neg, "hinge", margin, reduction)


def clear_collate(rows: Mapping[str, Any], tokenizer, config: CLEARConfig) -> dict[str, torch.Tensor]:
    """Tokenise a batch of triples (dict of arrays: query, pos_text, neg_text, pos_bm25, neg_bm25)."""

    def tok(texts, max_len, prefix):
        enc = tokenizer([str(t) for t in texts], padding=True, truncation=True, max_length=max_len,
                        return_tensors="pt")
        return {f"{prefix}_input_ids": enc["input_ids"], f"{prefix}_attention_mask": enc["attention_mask"]}

    return {
        **tok(rows["query"], config.query_max_len, "q"),
        **tok(rows["pos_text"], config.doc_max_len, "p"),
        **tok(rows["neg_text"], config.doc_max_len, "n"),
        "pos_bm25": torch.as_tensor(np.asarray(rows["pos_bm25"], dtype=np.float32)),
        "neg_bm25": torch.as_tensor(np.asarray(rows["neg_bm25"], dtype=np.float32)),
    }


def clear_loss(model: CLEAR, batch: Mapping[str, torch.Tensor], loss_config: CLEARLossConfig) -> torch.Tensor:
    """Eq. 6–7 on a collated batch: one query pass, positive and negative documents in one doc pass."""
    vq = model.query_embeddings(batch["q_input_ids"], batch["q_attention_mask"])
    p_ids, n_ids = batch["p_input_ids"], batch["n_input_ids"]
    width = max(p_ids.shape[1], n_ids.shape[1])
    ids = torch.cat([_pad_to(p_ids, width), _pad_to(n_ids, width)])
    mask = torch.cat([_pad_to(batch["p_attention_mask"], width), _pad_to(batch["n_attention_mask"], width)])
    vd = model.document_embeddings(ids, mask)
    vp, vn = vd[: len(p_ids)], vd[len(p_ids):]
    s_pos, s_neg = (vq * vp).sum(-1), (vq * vn).sum(-1)
    return residual_margin_loss(s_pos, s_neg, batch["pos_bm25"].to(s_pos.device), batch["neg_bm25"].to(s_pos.device),
                                loss_config.xi, loss_config.lambda_train, loss_config.constant_margin)


def _pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    return nn.functional.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x
