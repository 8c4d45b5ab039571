"""QDS-Transformer (query-directed sparse attention over long documents).

``model.py`` the model, ``task.py`` its training task, ``stage.py`` its job's flags and training.
"""

from ckray.rankers import ENCODER_TRAIN_DEFAULTS, RankerSpec, TrainingStage

SPEC = RankerSpec(
    name="qds", title="QDS-Transformer (query-directed sparse attention) reranker",
    training=TrainingStage("ckray.rankers.qds.stage", "ckray.rankers.qds.options:QDSOptions", "jobs/train_qds.py",
                           {**ENCODER_TRAIN_DEFAULTS, "batch_size": 4}),
    rerankers={"qds": "qds", "qds-longformer-qa": "qds-longformer-qa", "qds-local": "qds-local"},
)
