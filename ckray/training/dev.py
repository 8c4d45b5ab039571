"""Validation during training: rerank the dev set's BM25 candidates with the model, nDCG@10."""

from __future__ import annotations

import math

import torch

from ckray.data.examples import DevSet
from ckray.errors import ConfigError
from ckray.eval import ndcg_at_10
from ckray.training.task import RankerTask


def _validate_dev(dev: DevSet) -> None:
    if not dev.queries:
        raise ConfigError("the dev set has no queries: validation needs at least one")
    for qid in dev.queries:
        for did, _ in dev.candidates.get(qid, []):
            if did not in dev.doc_text:
                raise ConfigError(f"dev set: candidate {did} of query {qid} has no entry in doc_text")


class _DevEvaluator:
    """Rerank the dev candidates with ``task.dev_scorer(model)`` and compute nDCG@10.

    The (query, doc) pairs are cut into chunks of ``batch_size``; rank r scores chunks r, r+W, ...
    and the scores are all-gathered, so every rank returns the same figure. With ``pad`` (ZeRO-3,
    where a forward is a collective) every rank makes the same number of ``score`` calls.
    """

    def __init__(self, task: RankerTask, dev: DevSet, rank: int, world: int, batch_size: int, pad: bool):
        self.task, self.dev, self.rank, self.world, self.pad = task, dev, rank, world, pad
        self.pairs = [(qid, did, float(bm25)) for qid in sorted(dev.queries)
                      for did, bm25 in dev.candidates.get(qid, [])]
        self.chunks = [self.pairs[i:i + batch_size] for i in range(0, len(self.pairs), batch_size)]

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> float:
        import torch.distributed as dist

        was_training = model.training
        model.eval()
        mine: list[tuple[str, str, float]] = []
        score = self.task.dev_scorer(model)
        rounds = math.ceil(len(self.chunks) / self.world)
        for r in range(rounds):
            i = r * self.world + self.rank
            if i >= len(self.chunks) and not self.pad:
                break
            chunk = self.chunks[i] if i < len(self.chunks) else self.chunks[0]
            scores = score([self.dev.queries[q] for q, _, _ in chunk],
                           [self.dev.doc_text[d] for _, d, _ in chunk], [b for _, _, b in chunk])
            scores = scores.detach().float().reshape(-1).cpu().tolist()
            if len(scores) != len(chunk):
                raise ConfigError(f"{type(self.task).__name__}.dev_scorer returned {len(scores)} scores "
                                  f"for {len(chunk)} pairs")
            if i < len(self.chunks):
                mine += [(q, d, s) for (q, d, _), s in zip(chunk, scores)]
        everyone = [mine]
        if dist.is_initialized() and self.world > 1:
            everyone = [None] * self.world  # type: ignore[list-item]
            dist.all_gather_object(everyone, mine)
        run: dict[str, list[tuple[str, float]]] = {q: [] for q in self.dev.queries}
        for part in everyone:
            for q, d, s in part:
                run[q].append((d, s))
        for q in run:
            run[q].sort(key=lambda x: (-x[1], x[0]))
        model.train(was_training)
        return float(ndcg_at_10(run, self.dev.qrels))
