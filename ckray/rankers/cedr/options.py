"""CEDR's typed training options: the model flags of ``jobs/train_cedr.py``, one field each."""

from __future__ import annotations

from dataclasses import dataclass

from ckray.models.encoder_options import attention_dropout_option, encoder_option, frozen_layers_option
from ckray.options import option


@dataclass(frozen=True)
class CEDROptions:
    variant: str = option("knrm", "the interaction ranker over the encoder's per-layer similarity matrices, joined "
                                  "with [CLS] (vanilla: BERT's [CLS] → linear alone)",
                          choices=("knrm", "pacrr", "drmm", "vanilla"))
    encoder: str = encoder_option()
    num_layers: int | None = option(None, "use only the first L encoder layers (default: all of them)")
    max_length: int = option(512, "tokens per (query, segment) input")
    max_segments: int = option(4, "segments per long document")
    frozen_layers: int = frozen_layers_option()
    attention_dropout: float | None = attention_dropout_option()
    head_init: str = option("warm", "how the ranker head starts: as a lexical matcher over the similarity matrices "
                                    "(warm; vanilla: fitted to the first training triples) or the paper's random "
                                    "initialisation (random)", choices=("warm", "random"))
    knrm_warm_layers: str = option("last", "CEDR-KNRM's warm head: the μ = 0.9 kernel of the encoder's last layer "
                                           "(last), the μ = 0.9 and 0.7 kernels averaged over every layer (all), "
                                           "or every kernel of every layer weighed by the pairwise probe of the "
                                           "first 256 training triples (probe)",
                                   choices=("last", "all", "probe"))

