"""QDS-Transformer's typed training options: the model flags of ``jobs/train_qds.py``, one field each."""

from __future__ import annotations

from dataclasses import dataclass

from ckray.models.encoder_options import attention_dropout_option, encoder_option, frozen_layers_option
from ckray.options import option


@dataclass(frozen=True)
class QDSOptions:
    encoder: str = encoder_option()
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
    frozen_layers: int = frozen_layers_option()
    attention_dropout: float | None = attention_dropout_option()
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
