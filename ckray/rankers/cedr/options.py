"""CEDR's typed training options: the model flags of ``jobs/train_cedr.py``, one field each."""

from __future__ import annotations

from dataclasses import dataclass

from ckray.models import DEFAULT_ENCODER
from ckray.options import option


@dataclass(frozen=True)
class CEDROptions:
    variant: str = option("knrm", "the interaction ranker over the encoder's per-layer similarity matrices, joined "
                                  "with [CLS] (vanilla: BERT's [CLS] → linear alone)",
                          choices=("knrm", "pacrr", "drmm", "vanilla"))
    encoder: str = option(DEFAULT_ENCODER, "Hugging Face id or directory of a BERT encoder")
    num_layers: int | None = option(None, "use only the first L encoder layers (default: all of them)")
    max_length: int = option(512, "tokens per (query, segment) input")
    max_segments: int = option(4, "segments per long document")
    frozen_layers: int = option(0, "do not train the bottom N encoder layers, the embedding layer counted as "
                                   "layer 0 (1: the embeddings; 1 + k: also the first k transformer layers)")
    attention_dropout: float | None = option(None, "attention-probability dropout of the encoder's layers in "
                                                   "training (default: the encoder's own, 0.1 in MiniLM); 0 "
                                                   "about doubles a CPU step's pairs/s")
    head_init: str = option("warm", "how the ranker head starts: as a lexical matcher over the similarity matrices "
                                    "(warm; vanilla: fitted to the first training triples) or the paper's random "
                                    "initialisation (random)", choices=("warm", "random"))
    knrm_warm_layers: str = option("last", "CEDR-KNRM's warm head: the μ = 0.9 kernel of the encoder's last layer "
                                           "(last), the μ = 0.9 and 0.7 kernels averaged over every layer (all), "
                                           "or every kernel of every layer weighed by the pairwise probe of the "
                                           "first 256 training triples (probe)",
                                   choices=("last", "all", "probe"))

