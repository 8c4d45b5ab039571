"""QDS-Transformer's typed training options: the model flags of ``jobs/train_qds.py``, one field each."""

from __future__ import annotations

from dataclasses import dataclass

from ckray.models import DEFAULT_ENCODER
from ckray.options import option


@dataclass(frozen=True)
class QDSOptions:
    encoder: str = option(DEFAULT_ENCODER, "Hugging Face id or directory of a BERT encoder")
    pattern: str = option("qds", "attention: local window + [CLS]/query global + [SOS] sentence hierarchy (qds), "
                                 "without the hierarchy (longformer-qa), or the local window alone (local)",
                          choices=("qds", "longformer-qa", "local"))
    max_length: int = option(2048, "tokens of [CLS] query [SEP] [SOS] sentences …")
    window: int = option(128, "local attention window w")
    gradient_checkpointing: bool = option(False, "recompute activations in the backward pass: less memory, slower")
    attention_kernel: str = option("auto", "how the attention pattern is computed (never what): the sparse kernel, "
                                           "O(n·(w + g)) memory (sparse); torch's fused attention under the "
                                           "materialised n × n mask, faster on GPUs in bf16 and for short inputs "
                                           "on a CPU without attention dropout (fused-mask); auto: fused-mask on "
                                           "CUDA in bf16/fp16 and on a CPU up to 512 tokens without attention "
                                           "dropout, sparse elsewhere", choices=("auto", "sparse", "fused-mask"))
    frozen_layers: int = option(0, "do not train the bottom N encoder layers, the embedding layer counted as "
                                   "layer 0 (1: the embeddings; 1 + k: also the first k transformer layers)")
    attention_dropout: float | None = option(None, "attention-probability dropout of the encoder's layers in "
                                                   "training (default: the encoder's own, 0.1 in MiniLM); 0 "
                                                   "about doubles a CPU step's pairs/s")
    head_init: str = option("warm", "how the score head starts: its similarity term, or with --head cls fitted to the "
                                    "first training triples, before step 0 (warm); the paper's random "
                                    "initialisation, γ = 0 (random)",
                            choices=("warm", "random"))
    head: str = option("maxsim", "score head: w · h_[CLS] + b plus γ · cos of the mean query and document vectors "
                                 "of the joint encoding (pooled), plus γ · ColBERT's MaxSim of them (maxsim), "
                                 "or the paper's w · h_[CLS] + b alone (cls); warm, the first two start as "
                                 "their similarity", choices=("pooled", "maxsim", "cls"))
    query_weights: str = option("uniform", "how the MaxSim head averages its query word pieces' best matches: "
                                           "equally (uniform), or weighted by their IDF in the collection being "
                                           "reranked (idf)", choices=("uniform", "idf"))
    head_lr_multiplier: float = option(1.0, "train the score head (w, b and a similarity head's γ) this many times "
                                            "faster than the encoder")

    @property
    def checkpoint_name(self) -> str:
        return "qds" if self.pattern == "qds" else f"qds-{self.pattern}"
