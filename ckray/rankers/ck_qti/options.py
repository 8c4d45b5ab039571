"""CK-QTI's typed training options: the model flags of ``jobs/train_ck.py``, one field each."""

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

    @property
    def checkpoint_name(self) -> str:
        return self.name or ("tk" if self.attention == "quadratic" else "ck-qti" if self.qti else "ck")
