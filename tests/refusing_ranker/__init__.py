"""A reranker's model for fault tests: it scores a pair by the words its query and document share, and
refuses any document that contains :data:`REFUSED` with a :class:`ckray.errors.CollectionError` (as a
model refuses input it cannot score). Not a registered ranker: importing it changes no registry.
Importable in Ray's workers: ``tests/`` is on their ``PYTHONPATH`` (``tests/conftest.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ckray.errors import CollectionError

REFUSED = "unscoreable"


def refusal(doc: str) -> str:
    return f"document text {doc[:40]!r} cannot be scored (it contains {REFUSED!r})"


@dataclass
class RefusingConfig:
    scale: float = 1.0


class RefusingModel(nn.Module):
    def __init__(self, config: RefusingConfig):
        super().__init__()
        self.config = config
        self.scale = nn.Parameter(torch.tensor(config.scale))

    @torch.no_grad()
    def score_texts(self, queries: list[str], docs: list[str]) -> torch.Tensor:
        for doc in docs:
            if REFUSED in doc:
                raise CollectionError(refusal(doc))
        shared = [len(set(q.lower().split()) & set(d.lower().split())) for q, d in zip(queries, docs)]
        return self.scale * torch.tensor(shared, dtype=torch.float32)
