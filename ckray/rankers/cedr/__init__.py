"""CEDR (contextualized embeddings for document ranking: KNRM, PACRR, DRMM heads) and vanilla BERT.

``model.py`` the model, ``task.py`` its training task, ``stage.py`` its job's flags and training.
"""

from ckray.rankers import ENCODER_TRAIN_DEFAULTS, RankerSpec, TrainingStage

SPEC = RankerSpec(
    name="cedr-knrm", title="CEDR (BERT + KNRM / PACRR / DRMM) cross-encoder reranker",
    training=TrainingStage("ckray.rankers.cedr.stage", "ckray.rankers.cedr.options:CEDROptions", "jobs/train_cedr.py",
                           {**ENCODER_TRAIN_DEFAULTS, "batch_size": 4}),
    rerankers={"cedr-knrm": "cedr-knrm", "cedr-pacrr": "cedr-pacrr", "cedr-drmm": "cedr-drmm",
               "vanilla-bert": "vanilla-bert"},
    rerank_over=("bm25", "clear"),
)
