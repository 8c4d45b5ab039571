"""CLEAR's typed options: the model flags of ``jobs/train_clear.py`` and the flags of
``jobs/build_dense_index.py``, one field each."""

from __future__ import annotations

from dataclasses import dataclass

from ckray.fusion import DEFAULT_HYBRID_NORMALIZATION, HYBRID_NORMALIZATIONS
from ckray.models import DEFAULT_ENCODER
from ckray.options import option


@dataclass(frozen=True)
class CLEAROptions:
    encoder: str = option(DEFAULT_ENCODER, "Hugging Face id or directory of a BERT encoder")
    doc_max_len: int = option(256, "document word pieces the encoder reads")
    xi: float = option(0.2, "ξ, the margin before the lexical residual")
    lambda_train: float = option(0.05, "λ_train, weight of the BM25 gap in the margin")
    constant_margin: bool = option(False, "ablation: m = ξ (no lexical residual)")
    name: str | None = option(None, "checkpoint name under W/checkpoints (default: clear; clear-constant with "
                                    "--constant-margin)")

    @property
    def checkpoint_name(self) -> str:
        return self.name or ("clear-constant" if self.constant_margin else "clear")


@dataclass(frozen=True)
class DenseIndexOptions:
    """``jobs/build_dense_index.py``'s flags (besides the actor pool's, ``ckray.stages.ActorPoolOptions``)."""

    checkpoint: str | None = option(None, "CLEAR checkpoint (default: W/checkpoints/clear)")
    float16: bool = option(False, "store embedding shards as float16")
    doc_max_len: int | None = option(None, "encode documents at this many word pieces (default: the checkpoint's "
                                           "doc_max_len)")
    index: str = option("flat", "faiss index kind (flat: exact inner product)", choices=("flat", "hnsw", "ivf", "ivfpq"))
    tune_split: str = option("train", "qrels split whose queries tune λ_test (never test)")
    tune_queries: str = option("held-out", "tune λ_test on the held-out dev queries of --tune-split (those CLEAR did "
                                           "not train on) or on all of them (fine for an untrained encoder)",
                               choices=("held-out", "all"))
    hybrid_normalization: str = option(DEFAULT_HYBRID_NORMALIZATION, "scores λ_test is tuned on: none (the paper's "
                                       "raw Eq. 8, what CLEAR is trained for) or tmm (each side normalised per query "
                                       "by its theoretical minimum and the query's maximum: carries an untrained "
                                       "encoder's λ better)",
                                       choices=HYBRID_NORMALIZATIONS)
