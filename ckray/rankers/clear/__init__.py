"""CLEAR (dense retrieval with a BM25-residual margin).

``model.py`` the model, ``task.py`` its training task, ``stage.py`` its jobs' flags and stages,
``embed.py`` the embedding job, ``faiss_index.py`` the faiss index (``jobs/build_dense_index.py``), ``hybrid.py``
the dense and BM25 + dense hybrid retrievers (first stages ``clear-dense``, ``clear``), ``layout.py`` their paths
under the work directory.
"""

from ckray.rankers import ENCODER_TRAIN_DEFAULTS, FirstStage, IndexStage, RankerSpec, TrainingStage

SPEC = RankerSpec(
    name="clear", title="CLEAR (BM25-residual dense retrieval)",
    training=TrainingStage("ckray.rankers.clear.stage", "ckray.rankers.clear.options:CLEAROptions", "jobs/train_clear.py",
                           ENCODER_TRAIN_DEFAULTS),
    index=IndexStage("ckray.rankers.clear.stage", "jobs/build_dense_index.py"),
    first_stages={
        "clear-dense": FirstStage("ckray.rankers.clear.hybrid:dense_retriever", artifacts=("dense/index",),
                                  stamp_files=("dense/index/meta.json",)),
        "clear": FirstStage("ckray.rankers.clear.hybrid:hybrid_retriever",
                            artifacts=("bm25/index", "dense/index", "dense/hybrid.json"),
                            stamp_files=("dense/index/meta.json", "dense/hybrid.json",
                                         "bm25/index/ckray_index.json")),
    },
)
