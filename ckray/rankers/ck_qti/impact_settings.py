"""The settings of a CK-QTI impact index: what the index job is configured with, what a shard's stamp and
the index's metadata record of them, and the top-k and β carried with a checkpoint.

**Exact-match weight at indexing** (``explicit_weight`` β, default 0.5). The stored impact may add the
model's own explicit score once more, ``w_td = s_td + β·s_explicit_td`` (Eq. 9: its learned, batch-scaled
BM25; 0 for a term not in the document), before the top-k cut. This is still one weight per (term,
document), so QTI and the index are unchanged; it moves the balance that α set in training towards
exact matching, as interpolating with BM25 does for a reranker, and β is chosen on the held-out
training queries (``bench/impact_topk.py --explicit-weights``), never on test queries. The defaults,
β = 0.5 and ``top_k`` = 256, are what SciFact's held-out training queries chose together
(β ∈ {0, 0.5, 1, 2} × k ∈ {32, 64, 128, 256}; README).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ckray.batch_inference import ActorPoolConfig, validate_checks
from ckray.errors import ConfigError, MissingArtifactError
from ckray.rankers.ck_qti.options import (DEFAULT_EXPLICIT_SCOPE, DEFAULT_EXPLICIT_WEIGHT, DEFAULT_PASSAGES,
                                          DEFAULT_TOP_K)

CANDIDATE_POOLS = ("window", "position")
EXPLICIT_SCOPES = ("document", "model", "window")


@dataclass
class ImpactConfig(ActorPoolConfig):
    """The impact-building job: its actor pool (``ckray.batch_inference.ActorPoolConfig``: actors,
    use_gpu, cpus_per_actor, batch_size — documents per actor batch —, max_restarts,
    max_task_retries) and

    top_k:                 terms kept per document (by w_td).
    explicit_weight:       β: the stored weight is s_td + β·s_explicit_td (module docstring); 0 = s_td.
    expansion_candidates:  M vocabulary terms added to a document's own terms as candidates.
    expansion_ratio:       r: of the top_k kept, at most ⌈r·u_d⌉ are expansion terms (u_d: the document's
                           distinct own terms), the best by weight (``cap_expansion``); None = no cap.
    candidate_pool:        "window" (cosine with window centroids, cheap) or "position" (best position).
    quant_max:             the largest weight in the corpus maps to this integer.
    scale:                 a fixed quantisation scale instead (e.g. to match another index); None = from quant_max.
    token_budget:          word pieces (documents × padded length) per forward pass inside an actor.
    index_threads:         Lucene indexing threads.
    passages:              a document longer than the checkpoint's ``max_doc_len`` is read as up to this many
                           windows of that length, a quarter of each shared with the next
                           (``ckray.models.encoders.passage_overlap``), each scored as a document, and a term's
                           weight is its best window's (module docstring); 0: every window, the whole document;
                           1: the first window only (as trained).
    explicit_scope:        where the exact-match score of a document read in windows is counted: "document"
                           (β's over every window read, TF and |d| as BM25 counts them), "model" (the model's own
                           inside s_td too) or "window" (each window's own; ``term_impacts``' module docstring).
    window_pieces:         word pieces per window of a document longer than the checkpoint's ``max_doc_len``
                           (None: ``max_doc_len``); a document that fits ``max_doc_len`` is read whole either way.
    """

    top_k: int = DEFAULT_TOP_K             # both chosen on SciFact's held-out training queries (module docstring)
    explicit_weight: float = DEFAULT_EXPLICIT_WEIGHT
    expansion_candidates: int = 256
    expansion_ratio: float | None = None
    candidate_pool: str = "window"
    quant_max: int = 255
    scale: float | None = None
    batch_size: int = 64
    token_budget: int = 8192
    index_threads: int = 2
    passages: int = DEFAULT_PASSAGES
    explicit_scope: str = DEFAULT_EXPLICIT_SCOPE
    window_pieces: int | None = None

    def validate(self) -> None:
        validate_checks(self, self.pool_checks() + [
            (self.top_k >= 1, "top_k must be >= 1"),
            (math.isfinite(self.explicit_weight) and self.explicit_weight >= 0,
             f"explicit_weight (--explicit-weight) must be a finite number >= 0, got {self.explicit_weight}"),
            (self.expansion_candidates >= 0, "expansion_candidates must be >= 0"),
            (self.expansion_ratio is None or (math.isfinite(self.expansion_ratio) and self.expansion_ratio >= 0),
             f"expansion_ratio (--expansion-ratio) must be a finite number >= 0, got {self.expansion_ratio}"),
            (self.candidate_pool in CANDIDATE_POOLS, f"candidate_pool must be one of {CANDIDATE_POOLS}"),
            (self.quant_max >= 1, "quant_max must be >= 1"),
            (self.scale is None or self.scale > 0, "scale must be > 0"),
            (self.token_budget >= 1, "token_budget must be >= 1"),
            (self.index_threads >= 1, "index_threads must be >= 1"),
            (self.passages >= 0, "passages (--passages) must be >= 0 (0: every window of a document)"),
            (self.window_pieces is None or self.window_pieces >= 8,
             f"window_pieces (--window-pieces) must be at least 8 word pieces, got {self.window_pieces}"),
            (self.explicit_scope in EXPLICIT_SCOPES,
             f"explicit_scope (--explicit-scope) must be one of {EXPLICIT_SCOPES}, got {self.explicit_scope!r}"),
        ])

    @property
    def explicit_over_documents(self) -> bool:
        """Whether an exact-match score of a document read in several windows is counted over all of them."""
        return self.passages != 1 and (self.explicit_scope == "model" or
                                       (bool(self.explicit_weight) and self.explicit_scope == "document"))

    def scoring_settings(self) -> dict:
        """The settings that change the stored w_td (part of every shard's stamp)."""
        settings = {"top_k": self.top_k, "expansion_candidates": self.expansion_candidates,
                    "candidate_pool": self.candidate_pool, "passages": self.passages}
        if self.explicit_weight:  # absent at 0, so shards built at 0 keep their stamps
            settings["explicit_weight"] = self.explicit_weight
        if self.expansion_ratio is not None:  # absent without a cap, likewise
            settings["expansion_ratio"] = self.expansion_ratio
        if self.explicit_over_documents:  # absent for each window's own, as shards were scored before
            settings["explicit_scope"] = self.explicit_scope
        if self.window_pieces is not None:  # absent at the checkpoint's max_doc_len, likewise
            settings["window_pieces"] = self.window_pieces
        return settings


def recorded_settings(record: Mapping[str, Any], source: str) -> dict:
    """The top-k, β, expansion cap and windows read that an index's metadata or a shard's marker
    (``record``) holds, with where they came from: what an evaluation records. A record without
    ``passages`` was made before long documents were read in windows: from the first one; one without
    ``explicit_scope`` added each window's own exact-match score."""
    cap = {"expansion_ratio": record["expansion_ratio"]} if "expansion_ratio" in record else {}
    return {"top_k": record.get("top_k"), "explicit_weight": record.get("explicit_weight", 0.0), **cap,
            "passages": record.get("passages", 1), "explicit_scope": record.get("explicit_scope", "window"),
            "window_pieces": record.get("window_pieces"),
            "source": source}


def deployed_impact_settings(checkpoint: str | os.PathLike, top_k: int | None = None,
                             explicit_weight: float | None = None) -> tuple[int, float, str | None]:
    """``(top_k, explicit_weight, source)``: each given value, else the one saved with the checkpoint
    (``ckray.deploy``: tuned on its training collection's held-out queries), else ``ImpactConfig``'s
    default. ``source`` names the checkpoint's deploy.json when a value came from it, else None."""
    from ckray.deploy import read_deploy, source_of

    carried = read_deploy(checkpoint).get("impact") or {}
    used = [name for name, given in (("top_k", top_k), ("explicit_weight", explicit_weight))
            if given is None and name in carried]
    return (int(top_k if top_k is not None else carried.get("top_k", ImpactConfig.top_k)),
            float(explicit_weight if explicit_weight is not None
                  else carried.get("explicit_weight", ImpactConfig.explicit_weight)),
            source_of(checkpoint) if used else None)


def check_ck_qti_checkpoint(checkpoint: str | os.PathLike) -> dict:
    """The checkpoint's config (MissingArtifactError / ConfigError with what to do)."""
    from ckray.models.checkpoint import WEIGHTS_FILE, read_checkpoint_config

    payload = read_checkpoint_config(checkpoint)
    if not (Path(checkpoint) / WEIGHTS_FILE).exists():
        raise MissingArtifactError(f"checkpoint {checkpoint} has no {WEIGHTS_FILE}; it is half-written, re-train")
    if not payload.get("model_class", "").endswith("CKModel") or not payload.get("config", {}).get("qti", False):
        raise ConfigError(f"checkpoint {checkpoint} is {payload.get('model_class')} with "
                          f"qti={payload.get('config', {}).get('qti')}; impact indexing needs a CK-QTI model "
                          "(jobs/train_ck.py --qti)")
    return payload
