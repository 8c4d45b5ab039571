"""A reranker for fault tests: the toy plug-in's model, refusing any document that contains
:data:`REFUSED` with a :class:`ckray.errors.CollectionError` (as a model refuses input it cannot score).
Importable in Ray's workers: ``tests/`` is on their ``PYTHONPATH`` (``tests/conftest.py``)."""

from __future__ import annotations

from ckray.errors import CollectionError
from toy_ranker import ToyModel

REFUSED = "unscoreable"


def refusal(doc: str) -> str:
    return f"document text {doc[:40]!r} cannot be scored (it contains {REFUSED!r})"


class RefusingModel(ToyModel):
    def score_texts(self, queries: list[str], docs: list[str]):
        for doc in docs:
            if REFUSED in doc:
                raise CollectionError(refusal(doc))
        return super().score_texts(queries, docs)
