"""CK-QTI (Conformer-Kernel with query term independence; the full CK and the TK baseline as variants).

``model.py`` the model, ``task.py`` its training task, ``stage.py`` its jobs' flags and stages,
the learned-impact index: ``term_impacts.py`` a document's term impacts, ``impact_settings.py`` the
index's settings (top-k, β), ``corpus_statistics.py`` the indexed corpus's IDF and mean length set into the
model, ``impact.py`` the index job (Ray batch inference, then Lucene), ``impact_search.py`` retrieval from
it (the first stage ``ck-qti``); ``impact_rerank.py`` the reranker that scores as that index does.
"""

from ckray.rankers import FirstStage, IndexStage, RankerSpec, TrainingStage

SPEC = RankerSpec(
    name="ck-qti", title="CK-QTI (Conformer-Kernel, query term independence)",
    training=TrainingStage("ckray.rankers.ck_qti.stage", "ckray.rankers.ck_qti.options:CKQTIOptions",
                           "jobs/train_ck.py", {"lr": 1e-3, "max_steps": 1000, "eval_every": 200, "batch_size": 16}),
    index=IndexStage("ckray.rankers.ck_qti.stage", "jobs/build_impact_index.py"),
    first_stages={"ck-qti": FirstStage("ckray.rankers.ck_qti.impact_search:impact_retriever", artifacts=("impact/index",),
                                       stamp_files=("impact/index/ckray_impact.json",))},
    # ck-qti reranks by the documents' top-k term impacts, as its index scores; ck-qti-unpruned is the
    # same checkpoint's dense Σ over every query term (the ablation)
    rerankers={"ck-qti": "ck-qti", "ck-qti-unpruned": "ck-qti", "ck": "ck"},
    reranker_factories={"ck-qti": "ckray.rankers.ck_qti.impact_rerank:impact_reranker"},
)
