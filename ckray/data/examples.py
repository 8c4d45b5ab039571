"""Training examples: (query, positive, BM25 negative) triples and a dev set carved from training queries."""

from __future__ import annotations

from dataclasses import dataclass, field

Run = dict[str, list[tuple[str, float]]]


@dataclass
class DevSet:
    """Held-back *training* queries used to pick checkpoints: rerank their BM25 candidates, score nDCG@10.

    ``candidates[qid]`` is the BM25 top list ``[(doc_id, bm25_score), ...]``; ``doc_text`` holds the
    text of every candidate (``doc_text(title, text)``); ``qrels[qid][doc_id]`` the judgments.
    """

    queries: dict[str, str]
    candidates: Run
    doc_text: dict[str, str]
    qrels: dict[str, dict[str, int]]
    name: str = "dev"
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.queries)
