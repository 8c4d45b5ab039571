"""CK-QTI's typed options: the model flags of ``jobs/train_ck.py`` and the flags of
``jobs/build_impact_index.py``, one field each."""

from __future__ import annotations

from dataclasses import dataclass

from ckray.options import option


@dataclass(frozen=True)
class CKQTIOptions:
    qti: bool = option(True, "query term independence (CK-QTI); --no-qti: the paper's full CK (query contextualised)")
    attention: str = option("separable", "quadratic = the TK baseline", choices=("separable", "quadratic"))
    max_doc_len: int = option(4000, "document word pieces (not cut at 512)")
    layers: int = option(2, "Conformer blocks")
    bm25_k1: float = option(1.0, "the explicit match starts as BM25(k1, b)")
    bm25_b: float = option(0.75, "b of that BM25 start")
    exact_match: str = option("pieces", "what the explicit match's TF and IDF count: the word piece itself (pieces), "
                                         "or every piece opening a word with the same Porter stem, as BM25's index "
                                         "stems words (stems; docs/transfer.md compares them)",
                              choices=("pieces", "stems"))
    name: str | None = option(None, "checkpoint name under W/checkpoints (default: ck-qti; ck with --no-qti, tk with "
                                    "--attention quadratic)")
    head_lr_multiplier: float = option(1.0, "train everything but the pretrained word embeddings this many times "
                                            "faster")
    dev_scoring: str = option(
        "impacts", "CK-QTI checkpoints are picked on dev by Σ of each document's top-k term impacts (as the impact "
        "index and ck-qti-rerank score; 100 SciFact dev queries × 50 candidates took 174–211 s per validation on "
        "2 CPU cores) or by the model's dense Σ over all query terms", choices=("impacts", "dense"))
    train_top_k: int = option(0, "train as the impact index deploys: a query term counts only as far as it is among "
                                 "the document's top k terms (a sigmoid gate at the k-th best own term's s_td); 0 = off")
    gate_temperature: float = option(0.1, "the gate's width as a fraction of the document's threshold s_td (with "
                                          "--train-top-k)")
    match_pair_lengths: bool = option(False, "cut each training pair's longer document to the shorter one's word "
                                             "pieces, so length cannot tell the positive from the negative")

    @property
    def checkpoint_name(self) -> str:
        return self.name or ("tk" if self.attention == "quadratic" else "ck-qti" if self.qti else "ck")


# the impact index's deployment settings when neither a flag nor the checkpoint's deploy.json gives them:
# both chosen on SciFact's held-out training queries (ckray/rankers/ck_qti/impact.py's docstring)
DEFAULT_TOP_K = 256
DEFAULT_EXPLICIT_WEIGHT = 0.5
# every window of a long document is read and a term weighs what its best window gives it: a long-document collection
# of SciFact's held-out training queries chose it over the first window alone (docs/transfer.md, long documents)
DEFAULT_PASSAGES = 0
# the exact-match score of a document read in windows is counted over the whole document, as BM25 counts it, inside
# s_td and in β's part: the same long-document dev collection chose it over β's part alone and over each window's own
# (docs/transfer.md, long documents)
DEFAULT_EXPLICIT_SCOPE = "model"


@dataclass(frozen=True)
class ImpactIndexOptions:
    """``jobs/build_impact_index.py``'s flags (besides the actor pool's, ``ckray.stages.ActorPoolOptions``)."""

    checkpoint: str | None = option(None, "CK-QTI checkpoint directory (default: W/checkpoints/ck-qti)")
    top_k: int | None = option(None, f"terms kept per document (default: the checkpoint's deploy.json, else "
                                     f"{DEFAULT_TOP_K})")
    explicit_weight: float | None = option(None, "β: store s_td + β·(the model's exact-match score, Eq. 9) per term; "
                                                 "choose it on held-out training queries with bench/impact_topk.py "
                                                 "--explicit-weights (default: the checkpoint's deploy.json, else "
                                                 f"{DEFAULT_EXPLICIT_WEIGHT})")
    expansion_candidates: int = option(256, "vocabulary terms added to a document's own terms as candidates")
    expansion_ratio: float | None = option(None, "keep at most ⌈r·(the document's distinct terms)⌉ expansion terms "
                                                 "among its top-k, so a short document gets few; choose r on held-out "
                                                 "training queries with bench/impact_expansion.py (default: no cap)")
    candidate_pool: str = option("window", "how expansion candidates are chosen (window: cheap; position: GPU)",
                                 choices=("window", "position"))
    quant_max: int = option(255, "integer the largest weight maps to")
    scale: float | None = option(None, "fixed quantisation scale, overriding --quant-max (default: from --quant-max)")
    passages: int = option(DEFAULT_PASSAGES, "read a document longer than the checkpoint's max_doc_len as up to this "
                                             "many overlapping windows, a term weighing what its best window gives it "
                                             "(0: every window, the whole document; 1: the first only, as trained)")
    explicit_scope: str = option(DEFAULT_EXPLICIT_SCOPE, "where the exact-match score of a document read in several "
                                                        "windows is counted: document: β's over the whole document (TF "
                                                        "and length, as BM25 counts them); model: the model's own "
                                                        "inside s_td too; window: each window's own",
                                 choices=("document", "model", "window"))
    window_pieces: int | None = option(None, "word pieces per window of a document longer than the checkpoint's "
                                             "max_doc_len (default: max_doc_len); a shorter one is read whole")
    save_settings: bool = option(False, "save this --top-k and --explicit-weight with the checkpoint (deploy.json), "
                                        "as chosen on its training collection's held-out queries: indexes of other "
                                        "collections then use them")
    batch_size: int = option(64, "documents per Ray Data batch")
    token_budget: int = option(8192, "padded word pieces per forward pass")
    index_threads: int = option(2, "Lucene indexing threads")
