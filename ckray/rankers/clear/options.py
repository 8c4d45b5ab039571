"""CLEAR's typed options: the model flags of ``jobs/train_clear.py`` and the flags of
``jobs/build_dense_index.py``, one field each."""

from __future__ import annotations

from dataclasses import dataclass

from ckray.fusion import DEFAULT_LAMBDA_RULE, HYBRID_NORMALIZATIONS, WEIGHT_RULES
from ckray.models.encoder_options import encoder_option
from ckray.options import option


# λ_train by the BM25 scale of the triples (TrainingDataConfig.bm25_scale), each near the λ_test that BM25 + the
# untrained MiniLM gets on SciFact's dev queries in those units (raw: 0.050; query-max: tmm's 0.316 on cosines
# that tmm divides by 1 + the query's best, about 1.6), so the margin asks for the residual the hybrid serves
LAMBDA_TRAIN_DEFAULTS = {"raw": 0.05, "query-max": 0.5}


# every window of a document is read (MaxP): SciFact's held-out training queries chose it over the first window
# alone (FirstP), and a long document is otherwise known by its beginning only (docs/transfer.md, long documents)
DEFAULT_PASSAGES = 0


@dataclass(frozen=True)
class CLEAROptions:
    encoder: str = encoder_option()
    doc_max_len: int = option(256, "document word pieces the encoder reads")
    xi: float = option(0.2, "ξ, the margin before the lexical residual")
    lambda_train: float | None = option(None, "λ_train, weight of the BM25 gap in the margin, in --bm25-scale's "
                                              "units (default: 0.05 on raw scores, 0.5 on query-max ones)")
    constant_margin: bool = option(False, "ablation: m = ξ (no lexical residual)")
    name: str | None = option(None, "checkpoint name under W/checkpoints (default: clear; clear-constant with "
                                    "--constant-margin)")

    def lambda_train_for(self, bm25_scale: str) -> float:
        """λ_train on BM25 scores at ``bm25_scale``: the flag's, else that scale's default
        (:data:`LAMBDA_TRAIN_DEFAULTS`)."""
        return LAMBDA_TRAIN_DEFAULTS[bm25_scale] if self.lambda_train is None else self.lambda_train

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
    passages: int = option(DEFAULT_PASSAGES, "encode a document longer than --doc-max-len as up to this many "
                                             "overlapping windows (0: all of them, the whole document) and score it "
                                             "by its best one (MaxP); 1: its first window only (FirstP, the paper's)")
    index: str = option("flat", "faiss index kind (flat: exact inner product)", choices=("flat", "hnsw", "ivf", "ivfpq"))
    tune_split: str = option("train", "qrels split whose queries tune λ_test (never test)")
    tune_queries: str = option("held-out", "tune λ_test on the held-out dev queries of --tune-split (those CLEAR did "
                                           "not train on) or on all of them (fine for an untrained encoder)",
                               choices=("held-out", "all"))
    hybrid_normalization: str | None = option(None, "scores λ_test is tuned on: none (the paper's raw Eq. 8) or "
                                              "tmm (each side normalised per query by its theoretical minimum and "
                                              "the query's maximum: carries an untrained encoder's λ better) "
                                              "(default: what the checkpoint was trained for, tmm after "
                                              "--bm25-scale query-max, else none)",
                                              choices=HYBRID_NORMALIZATIONS)
    lambda_rule: str = option(DEFAULT_LAMBDA_RULE, "how λ_test is chosen from the dev grid: best (the argmax) or one-se (the "
                                      "largest λ, the most weight on BM25, within one standard error of it)",
                              choices=WEIGHT_RULES)
