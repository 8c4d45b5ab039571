"""A document's impact vector from a CK-QTI model: the terms it is stored under and their weights w_td.
No Ray here: used by the index job's actors, by ``ck-qti-rerank``, by tests and by the benches.

With query term independence a CK-QTI score is a sum over query terms, ``S_qd = Σ_{t∈q} s_td``, and
``s_td`` depends on the term and the document only, so every document's term scores can be computed ahead
of time (the paper's Sec. 3, "QTI"); ``ckray.rankers.ck_qti.impact`` stores them in an inverted index.

**Which terms a document gets** (``TermImpactScorer``). A document is encoded once
(``CKModel.encode_documents``). Its candidate terms are

* its own word pieces (every distinct id), and, when the model counts exact matches over Porter stems
  (``CKConfig.exact_match="stems"``), every vocabulary piece of their stems (``computing`` for a document
  that says ``computer``: its exact-match score is the one a query saying ``computing`` gets), and
* ``expansion_candidates`` (M, default 256) vocabulary terms chosen cheaply: the context-free term
  vectors x₀ of the whole vocabulary (the QTI query-side encoder, ``encode_query_terms``; computed
  once per actor, special tokens and ``[unused*]`` left out since text never tokenises to them) are
  compared by cosine with the document. ``candidate_pool="window"`` (default) compares them with the
  centroid of the document's normalised contextualised vectors in each pooling window (the same
  ``pool_window``/``pool_stride`` windows the implicit sub-model pools kernel scores over; the cosine
  with a centroid is the window's mean cosine up to a per-window factor) and ranks terms by their
  best window: ``|V| × n/stride`` multiply-adds per dimension (SciFact on one CPU thread: ~10 ms a
  document, against ~32 ms to encode it and ~55 ms to score its ~400 candidates).
  ``candidate_pool="position"`` ranks by the best single position instead (``|V| × n``: ~210 ms a
  document there, so meant for GPUs).

All candidates are scored exactly with ``CKModel.term_scores`` (s_td = ReLU(α·explicit + (1−α)·implicit
+ b)); the ``top_k`` (default 256) best are kept — the paper's sparsification. Terms with s_td = 0
are dropped. The model's score for a (query, document) pair over the kept terms is therefore
exactly Σ of the stored weights of the query's terms.

**Long documents** (``passages``, default 0: all). A document longer than the checkpoint's ``max_doc_len``
is read as windows of that many word pieces, a quarter of each shared with the next
(``ckray.models.encoders.document_windows``); each window is scored as above as a document of its own
(its own terms, expansion candidates, top-k), and the document keeps every term of any window at its
best window's weight, ``w_td = max_p w_tp`` (term-level MaxP). The exact match (Eq. 9) of such a document
is counted over the whole document read, as BM25 counts it: TF_td over all the windows and |d| their length,
normalised by the collection's mean length of what is read (``document_length_scale``). With
``explicit_scope="model"`` (the default) it is counted so inside s_td's ReLU and in the part β adds, and only
the kernel-pooled part is taken from the best window:
``w_td = ReLU(α·s_explicit_td + max_p (1−α)·s_implicit_tp + b) + β·s_explicit_td``.
``"document"`` counts only β's part so and keeps the model's own s_tp of the best window:
``w_td = max_p s_tp + β·s_explicit_td``. ``"window"`` adds each window's own: ``w_td = max_p (s_tp + β·s_explicit_tp)``.
A weight still depends on the term and the document only, so QTI and the index are unchanged, and a term
counts wherever the document holds it, as BM25 counts it. ``passages=1`` reads the first window only (the
truncation training reads); a document that fits one window is scored the same either way.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ckray.errors import ConfigError
from ckray.rankers.ck_qti.impact_settings import ImpactConfig


def expansion_vocabulary(vocab_size: int, encoder: str | None) -> np.ndarray:
    """Vocabulary ids that text can tokenise to: all but [PAD]/[CLS]/… and ``[unused*]``."""
    from ckray.models.encoders import load_tokenizer

    tok = load_tokenizer(encoder)
    n = min(vocab_size, len(tok))
    tokens = tok.convert_ids_to_tokens(list(range(n)))
    special = set(tok.all_special_ids)
    keep = [i for i, t in enumerate(tokens) if i not in special and not (t.startswith("[") and t.endswith("]"))]
    return np.asarray(keep, dtype=np.int64)


class TermImpactScorer:
    """Impact vectors of documents from a CK-QTI model (see the module docstring).

    ``score_texts(texts) -> list[(term_ids int32[k], weights float32[k])]``, weights descending.
    ``document_length_scale`` multiplies the length of a document read in several windows before its
    exact-match score (``explicit_scope`` "model" or "document"): the corpus's mean first-window length over its mean
    length read (:func:`document_length_scale`), so that a document of the mean length read is normalised
    as the model normalises one of the mean first-window length; 1 where every document fits one window.
    """

    def __init__(self, model: Any, config: ImpactConfig | None = None, document_length_scale: float = 1.0):
        import torch
        import torch.nn.functional as F

        self.config = config or ImpactConfig()
        self.config.validate()
        if not getattr(model.config, "qti", False) or not hasattr(model, "term_scores"):
            raise ConfigError("impact indexing needs a CK-QTI checkpoint (a CKModel with qti=True): "
                              f"got {type(model).__name__} with qti={getattr(model.config, 'qti', None)}")
        self.model = model.eval()
        self.device = model.device
        self.document_length_scale = float(document_length_scale)
        self.vocab = torch.as_tensor(expansion_vocabulary(model.config.vocab_size, model.config.encoder),
                                     device=self.device)
        with torch.no_grad():  # context-free term vectors x₀ of the whole (usable) vocabulary, unit length
            self.vocab_vectors = F.normalize(model.encode_query_terms(self.vocab).float(), dim=-1, eps=1e-6)
        self.classes = model.counted_classes            # exact-match classes (None: word pieces) …
        self.class_array = model.match_classes()        # … and the same as NumPy, for whole-document counts
        self.alpha = torch.sigmoid(model.alpha_logit).item()   # s_td = ReLU(α·explicit + (1−α)·implicit + b)
        self.bias = model.bias.item()

    # ----------------------------------------------------------------- candidates
    def expansion(self, doc, m: int):
        """Top-``m`` vocabulary ids per document by cosine of x₀ with the document ([B, m] long)."""
        import torch

        from ckray.models.kernels import pad_for_windows

        B = len(doc)
        m = min(m, len(self.vocab))
        if m == 0:
            return torch.zeros(B, 0, dtype=torch.long, device=self.device)
        unit = doc.vectors.float() * (doc.inv_norm * doc.mask)[..., None]  # [B, n, d], 0 at padding
        if self.config.candidate_pool == "window":
            w, s = self.model.config.pool_window, self.model.config.pool_stride
            targets = pad_for_windows(unit, w, s, dim=1).unfold(1, w, s).sum(-1)  # [B, nw, d]
            valid = pad_for_windows(doc.mask.float(), w, s, dim=1).unfold(1, w, s).sum(-1) > 0
            targets = torch.nn.functional.normalize(targets, dim=-1, eps=1e-6)
        else:
            targets, valid = unit, doc.mask
        best = torch.empty(B, len(self.vocab), device=self.device)
        rows = max(1, (1 << 24) // max(1, B * targets.shape[1]))  # vocabulary rows per chunk (≤ 64 MB)
        for i in range(0, len(self.vocab), rows):
            sim = torch.einsum("vd,bnd->bvn", self.vocab_vectors[i:i + rows], targets)
            best[:, i:i + rows] = sim.masked_fill(~valid[:, None, :], -2.0).amax(-1)
        return self.vocab[best.topk(m, dim=1).indices]

    def own_terms(self, doc) -> list[Any]:
        """Each document's distinct word pieces, with every other piece of their exact-match classes when
        the model counts stems: the terms an exact match reaches."""
        import torch

        own = doc.unique_terms()
        if self.classes is None:
            return own
        return [torch.isin(self.classes, self.classes[ids]).nonzero().flatten() if ids.numel() else ids for ids in own]

    def candidates(self, doc) -> tuple[Any, Any]:
        """Own terms (:meth:`own_terms`) ∪ expansion terms, padded: (ids [B, T] long, mask [B, T] bool)."""
        import torch

        from ckray.rankers.ck_qti.model import pad_term_lists

        exp = self.expansion(doc, self.config.expansion_candidates)
        per_doc = []
        for b, own in enumerate(self.own_terms(doc)):
            if own.numel() == 0:  # an empty document: nothing to index
                per_doc.append(own)
            else:
                per_doc.append(torch.unique(torch.cat([own, exp[b]])))
        return pad_term_lists(per_doc, self.device)

    # ----------------------------------------------------------------- scoring
    def term_weights(self, ids, doc, chunk_size: int = 256):
        """The stored weight of terms ``ids`` ([T] or [B, T]) in documents already encoded:
        w_td = s_td + β·s_explicit_td (β = ``explicit_weight``; w_td = s_td at β = 0). [B, T] float32."""
        return self.weights_and_implicit(ids, doc, chunk_size)[0]

    def weights_and_implicit(self, ids, doc, chunk_size: int = 256):
        """:meth:`term_weights` and the implicit part inside s_td's ReLU, (1−α)·s_implicit_td (Eq. 11–16):
        ``(w [B, T], implicit [B, T])``, float32."""
        explicit, implicit = self.model.term_parts(ids, doc, chunk_size=chunk_size)
        weights = self.model.combine_parts(explicit, implicit).float()            # s_td
        if self.config.explicit_weight:
            weights = weights + self.config.explicit_weight * self.model.explicit_scores(ids, doc).float()
        return weights, implicit.float()

    def score_encoded(self, doc, with_implicit: bool = False) -> list[tuple[np.ndarray, ...]]:
        """Top-k (term id, w_td) of documents already encoded, w_td = s_td + β·s_explicit_td > 0,
        descending (w_td = s_td at β = 0), expansion terms capped by ``expansion_ratio``. With
        ``with_implicit``, each kept term's (1−α)·s_implicit_td too, as a third array."""
        import torch

        ids, mask = self.candidates(doc)
        B, n = doc.ids.shape
        chunk = max(16, (1 << 25) // max(1, B * n * self.model.config.n_kernels))  # kernel tensor ≤ 128 MB
        scores, implicit = self.weights_and_implicit(ids, doc, chunk_size=chunk)
        scores = scores.masked_fill(~mask, -math.inf)
        k = min(self.config.top_k, ids.shape[1])
        top, idx = scores.topk(k, dim=1)
        top_ids, top_implicit = ids.gather(1, idx), implicit.gather(1, idx)
        own = self.own_terms(doc) if self.config.expansion_ratio is not None else [None] * B
        out = []
        for b in range(B):
            keep = top[b] > 0
            vector = (top_ids[b][keep].to(torch.int32).cpu().numpy(), top[b][keep].cpu().numpy().astype(np.float32),
                      top_implicit[b][keep].cpu().numpy().astype(np.float32))
            if own[b] is not None:
                kept = expansion_kept(vector[0], own[b].cpu().numpy(), self.config.expansion_ratio)
                vector = tuple(a[kept] for a in vector)
            out.append(vector if with_implicit else vector[:2])
        return out

    def score_texts(self, texts: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Impact vectors of document texts (``doc_text(title, text)``), in input order: each window of
        ``max_doc_len`` word pieces scored (:meth:`score_pieces`; the first ``passages``, 0: all), a
        term's weight its best window's (:func:`best_window_weights`). A document that fits one window
        is scored as one document, as before."""
        if not len(texts):
            return []
        windows, per_text = self.windows(texts)
        scored = self.score_pieces(windows, with_implicit=self.config.explicit_scope == "model")
        starts = np.cumsum([0] + per_text)
        return [scored[a][:2] if b - a == 1 else
                self.document_weights(scored[a:b], windows[a:b]) if self.config.explicit_over_documents else
                best_window_weights([vector[:2] for vector in scored[a:b]])
                for a, b in zip(starts[:-1], starts[1:])]

    def windows(self, texts: Sequence[str]) -> tuple[list[list[int]], list[int]]:
        """``(windows, windows per text)`` of ``texts`` as the index reads them: a text that fits the checkpoint's
        ``max_doc_len`` word pieces is one window (as ``ck_qti.model.tokenize`` reads it); a longer one is read in
        windows of :attr:`long_window` pieces, a quarter shared with the next, the first ``passages`` (0: all)."""
        from ckray.models.encoders import document_windows, load_tokenizer

        tokenizer, cfg = load_tokenizer(self.model.config.encoder), self.model.config
        windows, per_text = document_windows(tokenizer, texts, cfg.max_doc_len, self.config.passages,
                                             add_special_tokens=False)
        if self.long_window == cfg.max_doc_len or all(n == 1 for n in per_text):
            return windows, per_text
        long = [i for i, n in enumerate(per_text) if n > 1]
        rewindowed, long_per_text = document_windows(tokenizer, [texts[i] for i in long], self.long_window,
                                                     self.config.passages, add_special_tokens=False)
        starts, long_starts = np.cumsum([0] + per_text), np.cumsum([0] + long_per_text)
        by_text = {i: rewindowed[long_starts[j]:long_starts[j + 1]] for j, i in enumerate(long)}
        out = [w for i in range(len(texts)) for w in by_text.get(i, windows[starts[i]:starts[i + 1]])]
        return out, [len(by_text[i]) if i in by_text else n for i, n in enumerate(per_text)]

    @property
    def long_window(self) -> int:
        """Word pieces a window of a document longer than ``max_doc_len`` holds: ``window_pieces`` or
        ``max_doc_len``."""
        return self.config.window_pieces or self.model.config.max_doc_len

    def document_weights(self, scored: Sequence[tuple[np.ndarray, ...]],
                         windows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """One impact vector of a document read in several ``windows`` whose vectors are ``scored``: every
        term kept in any window, descending. s_explicit_td is Eq. 9 over the whole document
        (:func:`whole_document_pieces`), its length scaled by ``document_length_scale``.

        ``explicit_scope="document"``: ``w_td = max_p s_tp + β·s_explicit_td``. A window's weight is
        w_tp = s_tp + β·s_explicit_tp, so its s_tp is w_tp less β times Eq. 9 over the window's own pieces.

        ``explicit_scope="model"`` (``scored`` holds each kept term's implicit part): the exact match inside
        s_td's ReLU is the whole document's too, ``w_td = ReLU(α·s_explicit_td + max_p (1−α)·s_implicit_tp
        + b) + β·s_explicit_td``; only the kernel-pooled part is taken from the best window."""
        from ckray.models.encoders import passage_overlap

        beta = self.config.explicit_weight
        pieces = whole_document_pieces(windows, passage_overlap(self.long_window))
        length = len(pieces) * self.document_length_scale
        if self.config.explicit_scope == "model":
            terms, implicit = best_window_weights([(terms, implicit) for terms, _, implicit in scored])
            explicit = self.explicit(terms, pieces, length)
            weights = np.maximum(self.alpha * explicit + implicit + self.bias, 0.0) + beta * explicit
            terms, weights = terms[weights > 0], weights[weights > 0]
        else:
            own = [(terms, weights - beta * self.explicit(terms, window, len(window)))
                   for (terms, weights, *_), window in zip(scored, windows)]
            terms, best = best_window_weights(own)
            weights = best + beta * self.explicit(terms, pieces, length)
        order = np.argsort(-weights, kind="stable")
        return terms[order], weights[order].astype(np.float32)

    def explicit(self, terms: np.ndarray, pieces: Sequence[int], length: float) -> np.ndarray:
        """The model's exact-match score (Eq. 9) of ``terms`` in a document of word ``pieces`` whose length
        is taken as ``length``: float32 [T], 0 for a term that does not occur."""
        import torch

        pieces, keys = np.asarray(pieces, np.int64), np.asarray(terms, np.int64)
        if self.class_array is not None:   # TF counts the term's exact-match class, as the model's does
            pieces, keys = self.class_array[pieces], self.class_array[keys]
        present, counts = np.unique(pieces, return_counts=True)
        tf = np.zeros(len(terms), np.float32)
        if len(present):
            at = np.searchsorted(present, keys).clip(max=len(present) - 1)
            hit = present[at] == keys
            tf[hit] = counts[at[hit]]
        with torch.no_grad():
            scores = self.model.explicit_match(
                torch.as_tensor(np.asarray(terms, np.int64), device=self.device)[None],
                torch.as_tensor(tf, dtype=torch.float32, device=self.device)[None],
                torch.tensor([float(length)], device=self.device))
        return scores[0].float().cpu().numpy()

    def score_pieces(self, pieces: Sequence[Sequence[int]], with_implicit: bool = False) -> list[tuple[np.ndarray, ...]]:
        """Impact vectors of word-piece sequences (each one document as the model reads it), in input order
        (with each kept term's implicit part too at ``with_implicit``: :meth:`score_encoded`).

        Sorted by length and encoded in groups of at most ``token_budget`` padded word pieces (padding
        changes scores only by float rounding, ~1e-6; it costs time). Terms tied at the top-k cut to that
        precision may swap between batchings."""
        import torch

        from ckray.rankers.ck_qti.model import pad_term_lists

        lengths = [len(p) for p in pieces]
        out: list[Any] = [None] * len(pieces)
        group: list[int] = []

        def flush() -> None:
            ids, mask = pad_term_lists([torch.as_tensor(pieces[i], dtype=torch.long) for i in group], self.device)
            with torch.no_grad():
                doc = self.model.encode_documents(ids, mask)
                for i, res in zip(group, self.score_encoded(doc, with_implicit)):
                    out[i] = res
            group.clear()

        for i in sorted(range(len(pieces)), key=lambda i: lengths[i]):
            if group and (len(group) + 1) * max(lengths[i], 1) > self.config.token_budget:
                flush()
            group.append(i)
        if group:
            flush()
        return out


def whole_document_pieces(windows: Sequence[Sequence[int]], overlap: int) -> list[int]:
    """The word pieces of a document from its consecutive ``windows``, each sharing ``overlap`` pieces with
    the one before (``ckray.models.encoders.document_windows``): each piece once."""
    return [p for i, window in enumerate(windows) for p in (window if i == 0 else window[overlap:])]


def best_window_weights(windows: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """One impact vector from a document's windows' vectors: every term kept in any window, at its best
    window's weight, w_td = max_p w_tp, descending. A term's weight still depends on the term and the
    document alone, so query term independence and the index are unchanged; a query is scored by
    Σ_t max_p w_tp, each term where the document treats it best (term-level MaxP). One window: itself."""
    if len(windows) == 1:
        return windows[0]
    terms = np.concatenate([t for t, _ in windows])
    weights = np.concatenate([w for _, w in windows])
    order = np.argsort(-weights, kind="stable")
    terms, weights = terms[order], weights[order]
    _, first = np.unique(terms, return_index=True)   # each term's first, i.e. largest, occurrence
    keep = np.sort(first)
    return terms[keep], weights[keep]


def cap_expansion(terms: np.ndarray, weights: np.ndarray, own: np.ndarray,
                  ratio: float | None) -> tuple[np.ndarray, np.ndarray]:
    """A weight-sorted impact vector with every term of ``own`` (the document's own word pieces) and
    only the first ``⌈ratio·|own|⌉`` of the others (expansion terms); unchanged at ``ratio`` None.
    A short document then gets few expansion terms, a long one as many as top-k leaves room for."""
    if ratio is None:
        return terms, weights
    keep = expansion_kept(terms, own, ratio)
    return terms[keep], weights[keep]


def expansion_kept(terms: np.ndarray, own: np.ndarray, ratio: float) -> np.ndarray:
    """Which terms of a weight-sorted vector :func:`cap_expansion` keeps (bool [T])."""
    expansion = ~np.isin(terms, own)
    return ~expansion | (np.cumsum(expansion) <= math.ceil(ratio * len(own)))
