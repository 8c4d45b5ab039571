"""CLEAR's retrievers over the dense index (``ckray.rankers.clear.faiss_index``): dense retrieval, and the
BM25 + dense hybrid (Eq. 8) with its λ_test; the pipeline factories of the first stages ``clear-dense`` and ``clear``.

Hybrid (Gao et al. 2020, Eq. 8): ``s(q, d) = λ_test · s_lex(q, d) + s_emb(q, d)`` over the union of
the BM25 top ``lex_depth`` and the dense top ``dense_depth``, on the raw scores
(``HybridConfig.normalization = "none"``, the paper's and the default: CLEAR is trained as the residual of
raw BM25) or on each side's scores normalised per query (``"tmm"``, ``ckray.fusion.theoretical_min_max``:
BM25 / its query maximum, (cos + 1) / (its query maximum + 1)), which carries an untrained encoder's
λ_test better to another collection and is what a CLEAR trained on normalised BM25 is served on
(:func:`trained_normalization`). A union member found by only one side gets its *exact* missing
score: s_emb from its stored vector, s_lex from the Lucene scorer (``BM25Searcher.score``); retrievers
without a scorer fall back to the smallest score that side returned for the query (an upper bound,
documented in :func:`hybrid_candidates`). λ_test is chosen by grid search on nDCG@10 over training
queries (:func:`tune_lambda`), never by hand, and saved to ``W/dense/hybrid.json``
(``ckray.rankers.clear.layout``).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from ckray.data.shards import write_json_atomic
from ckray.errors import ConfigError, MissingArtifactError
from ckray.fusion import (DEFAULT_HYBRID_NORMALIZATION, DEFAULT_LAMBDA_RULE, Candidates, Run, check_hybrid_normalization,
                          check_weight_rule, grid_search, judged_queries, linear_fusion)
from ckray.rankers.clear.faiss_index import DenseIndex
from ckray.rankers.clear.layout import default_checkpoint, dense_root, index_dir

HYBRID_FILE = "hybrid.json"


# ---------------------------------------------------------------------------------------------
# Dense retrieval
# ---------------------------------------------------------------------------------------------

class DenseRetriever:
    """``search(queries, k) -> run`` with a CLEAR checkpoint (query tower) over a :class:`DenseIndex`."""

    def __init__(self, checkpoint: Any, index: DenseIndex | str | os.PathLike, query_batch_size: int = 128,
                 device: str | None = None):
        import torch

        from ckray.models.checkpoint import load_model

        self.checkpoint: str | None = None   # its directory, when loaded from one
        if isinstance(checkpoint, torch.nn.Module):
            self.model = checkpoint
        else:
            self.model, self.checkpoint = load_model(checkpoint), str(checkpoint)
        if device is None:
            from ckray.device import default_device

            device = str(default_device())
        self.model = self.model.to(device).eval()
        self.index = index if isinstance(index, DenseIndex) else DenseIndex.load(index)
        self.query_batch_size = query_batch_size

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        return self.model.encode_queries(list(texts), batch_size=self.query_batch_size).float().numpy()

    def search(self, queries: Mapping[str, str], k: int = 1000) -> Run:
        qids = [q for q, t in queries.items() if t and t.strip()]
        run: Run = {q: [] for q in queries}
        if qids:
            for qid, hits in zip(qids, self.index.search(self.encode([queries[q] for q in qids]), k)):
                run[qid] = hits
        return run

    def score(self, queries: Mapping[str, str], candidates: Mapping[str, Iterable[str]]) -> dict[str, dict[str, float]]:
        """Exact s_emb(q, d) for given (query, document) pairs, from the stored document vectors."""
        qids = [q for q in candidates if q in queries]
        out: dict[str, dict[str, float]] = {}
        if not qids:
            return out
        vq = self.encode([queries[q] for q in qids])
        for i, q in enumerate(qids):
            ids = [d for d in candidates[q] if d in self.index]
            out[q] = dict(zip(ids, self.index.scores(vq[i], ids).tolist()))
        return out


# ---------------------------------------------------------------------------------------------
# Hybrid retrieval (Eq. 8) and λ_test tuning
# ---------------------------------------------------------------------------------------------

DEFAULT_LAMBDA_GRID: tuple[float, ...] = (0.0, *[round(float(x), 6) for x in np.geomspace(1e-3, 10.0, 41)])


def hybrid_candidates(lex_run: Run, dense_run: Run,
                      lex_score: Callable[[str, list[str]], Mapping[str, float]] | None = None,
                      emb_score: Callable[[str, list[str]], Mapping[str, float]] | None = None) -> Candidates:
    """The union of both runs with both scores per (query, document).

    A member found by one side only gets the other side's score from ``lex_score(qid, doc_ids)`` /
    ``emb_score(qid, doc_ids)`` (exact), or, without a scorer, the lowest score that side returned for
    the query. The document ranked below that side's cut-off, so this is an upper bound on its true
    score: cheap, but it can favour such documents slightly, which is why retrievers fetch exact
    scores by default (``HybridConfig.exact``).
    """
    out: Candidates = {}
    for qid in set(lex_run) | set(dense_run):
        lex = dict(lex_run.get(qid, []))
        emb = dict(dense_run.get(qid, []))
        need_lex = [d for d in emb if d not in lex]
        need_emb = [d for d in lex if d not in emb]
        lex.update(_fill(qid, need_lex, lex_score, lex))
        emb.update(_fill(qid, need_emb, emb_score, emb))
        out[qid] = {d: (float(lex[d]), float(emb[d])) for d in lex.keys() | emb.keys() if d in lex and d in emb}
    return out


def _fill(qid: str, ids: list[str], scorer, have: Mapping[str, float]) -> dict[str, float]:
    if not ids:
        return {}
    if scorer is not None:
        got = dict(scorer(qid, ids))
        if len(got) == len(ids):
            return got
        ids = [d for d in ids if d not in got]
    else:
        got = {}
    floor = min(have.values()) if have else 0.0
    return {**got, **{d: floor for d in ids}}


def tune_lambda(candidates: Candidates, qrels: Mapping[str, Mapping[str, int]],
                grid: Sequence[float] = DEFAULT_LAMBDA_GRID, k: int = 1000,
                normalization: str = "none", rule: str = DEFAULT_LAMBDA_RULE) -> tuple[float, dict[float, float]]:
    """Grid search of λ_test for nDCG@10 of Eq. 8 (``ckray.fusion.linear_fusion``, ``s = λ ·
    s_lex + s_emb`` on the scores as ``normalization`` gives them) over the judged queries in
    ``candidates``, chosen by ``rule`` (``ckray.fusion.grid_search``: ``"best"``, ties to the smaller λ;
    ``"one-se"``, the largest λ within one standard error of the best).

    Returns ``(chosen λ, {λ: nDCG@10})``.
    """
    judged = judged_queries(qrels, candidates, "tune_lambda")
    cands = {q: candidates[q] for q in judged}
    return grid_search(lambda lam: linear_fusion(cands, lam, k, normalization), judged, grid, "λ_test", rule)


@dataclass
class HybridConfig:
    """Eq. 8 retrieval. ``lam`` is λ_test, applied to the scores as ``normalization`` gives them
    (module docstring; a file written without the field meant ``"none"``, :func:`load_hybrid_config`);
    depths are the candidate lists taken from each side."""

    lam: float = 0.05
    normalization: str = DEFAULT_HYBRID_NORMALIZATION
    rule: str = DEFAULT_LAMBDA_RULE   # how λ was chosen from the dev grid (ckray.fusion.grid_search)
    lex_depth: int = 1000
    dense_depth: int = 100
    exact: bool = True            # fetch missing scores exactly (else: lowest score of that side)
    tuned: dict = field(default_factory=dict)
    source: str | None = None     # where a λ not tuned here came from (a checkpoint's deploy.json, ckray.deploy)

    def __post_init__(self) -> None:
        check_hybrid_normalization("HybridConfig", self.normalization)
        check_weight_rule("HybridConfig", self.rule, "rule")


class HybridRetriever:
    """BM25 ∪ dense candidates, ``s = λ_test · s_lex + s_emb`` (Eq. 8)."""

    def __init__(self, lexical: Any, dense: DenseRetriever, config: HybridConfig | None = None):
        self.lexical, self.dense, self.config = lexical, dense, config or HybridConfig()
        normalized = getattr(getattr(getattr(dense, "model", None), "config", None), "normalize", True)
        if self.config.normalization == "tmm" and not normalized:
            raise ConfigError(f"CLEAR checkpoint {getattr(dense, 'checkpoint', None)} scores by an inner product "
                              f"(normalize: false), which has no lower bound: hybrid normalization 'tmm' needs its "
                              f"cosine; use normalization 'none' (--hybrid-normalization none)")

    def candidates(self, queries: Mapping[str, str], k: int | None = None) -> Candidates:
        cfg = self.config
        lex_run = self.lexical.search(dict(queries), max(cfg.lex_depth, k or 0))
        dense_run = self.dense.search(queries, max(cfg.dense_depth, 0))
        lex_score = emb_score = None
        if cfg.exact:
            emb_score = lambda q, ids: self.dense.score({q: queries[q]}, {q: ids}).get(q, {})  # noqa: E731
            if hasattr(self.lexical, "score"):
                lex_score = lambda q, ids: {d: self.lexical.score(queries[q], d) for d in ids}  # noqa: E731
        return hybrid_candidates(lex_run, dense_run, lex_score, emb_score)

    @property
    def settings(self) -> dict:
        """The deployment setting in use and where it came from (what an evaluation records)."""
        return {"lambda": {"value": self.config.lam, "normalization": self.config.normalization,
                           "rule": self.config.rule,
                           "source": self.config.source or "tuned on this collection's training queries"}}

    def search(self, queries: Mapping[str, str], k: int = 1000) -> Run:
        run = linear_fusion(self.candidates(queries, k), self.config.lam, k, self.config.normalization)
        return {q: run.get(q, []) for q in queries}

    def tune(self, queries: Mapping[str, str], qrels: Mapping[str, Mapping[str, int]],
             grid: Sequence[float] = DEFAULT_LAMBDA_GRID) -> tuple[float, dict[float, float]]:
        """Set λ_test by grid search on nDCG@10 over ``queries`` (training queries, never test), chosen by
        the config's ``rule``."""
        chosen, table = tune_lambda(self.candidates(queries), qrels, grid, normalization=self.config.normalization,
                                    rule=self.config.rule)
        self.config.lam = chosen
        self.config.tuned = {"queries": len(queries), "ndcg@10": table[chosen], "grid": {str(k): v for k, v in table.items()}}
        return chosen, table


def tune_hybrid(workdir: str | os.PathLike, queries: Mapping[str, str], qrels: Mapping[str, Mapping[str, int]],
                checkpoint: str | os.PathLike | None = None, config: HybridConfig | None = None,
                grid: Sequence[float] = DEFAULT_LAMBDA_GRID) -> HybridConfig:
    """Tune λ_test on *training* queries with BM25 (``W/bm25``) + the dense index, save ``W/dense/hybrid.json``."""
    from ckray.lexical.bm25 import bm25_retriever

    from ckray.deploy import save_deploy_setting

    dense = dense_retriever(workdir, checkpoint)
    hybrid = HybridRetriever(bm25_retriever(workdir), dense, config or HybridConfig())
    hybrid.tune(queries, qrels, grid)
    save_hybrid_config(workdir, hybrid.config)
    save_deploy_setting(dense.checkpoint, "lambda", {"value": hybrid.config.lam,
                                                     "normalization": hybrid.config.normalization,
                                                     "rule": hybrid.config.rule, "tuned_on": {
        "workdir": str(Path(workdir).resolve()), "queries": len(queries), "ndcg@10": hybrid.config.tuned["ndcg@10"]}})
    return hybrid.config


def trained_normalization(checkpoint: str | os.PathLike | None) -> str:
    """The hybrid normalization a CLEAR checkpoint is trained for: ``tmm`` when its margin saw BM25 divided by the
    query's top score (``--bm25-scale query-max``, tmm's lexical side), else the raw Eq. 8 (``none``; also for a
    checkpoint that was never trained here)."""
    from ckray.models.checkpoint import read_training_data_config

    if checkpoint is None:
        return DEFAULT_HYBRID_NORMALIZATION
    scale = read_training_data_config(checkpoint).get("bm25_scale")
    return "tmm" if scale == "query-max" else DEFAULT_HYBRID_NORMALIZATION


def carry_hybrid(workdir: str | os.PathLike, checkpoint: str | os.PathLike) -> HybridConfig | None:
    """For a collection with no training queries: λ_test saved with ``checkpoint`` (``ckray.deploy``)
    written to ``W/dense/hybrid.json`` with its ``source``; None (nothing written) when none was saved."""
    from ckray.deploy import carried_lambda, source_of

    carried = carried_lambda(checkpoint)
    if carried is None:
        return None
    config = HybridConfig(lam=float(carried["value"]), normalization=carried.get("normalization", "none"),
                          rule=carried.get("rule", DEFAULT_LAMBDA_RULE), source=source_of(checkpoint),
                          tuned=dict(carried.get("tuned_on") or {}))
    save_hybrid_config(workdir, config)
    return config


def save_hybrid_config(workdir: str | os.PathLike, config: HybridConfig) -> Path:
    record = asdict(config)
    if record["source"] is None:  # tuned here: the file reads as it always has
        del record["source"]
    return write_json_atomic(record, dense_root(workdir) / HYBRID_FILE)


def load_hybrid_config(workdir: str | os.PathLike) -> HybridConfig:
    path = dense_root(workdir) / HYBRID_FILE
    if not path.exists():
        raise MissingArtifactError(f"no tuned λ_test at {path}: run jobs/build_dense_index.py (it tunes λ on "
                                   f"training queries, or carries the λ saved with the checkpoint), or pass --lambda")
    record = json.loads(path.read_text())
    record.setdefault("normalization", "none")   # written before the field: the raw Eq. 8
    return HybridConfig(**record)


# ---------------------------------------------------------------------------------------------
# Pipeline factories (ckray.pipelines: "clear-dense", "clear")
# ---------------------------------------------------------------------------------------------

def dense_retriever(workdir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                    **options: Any) -> DenseRetriever:
    """``clear-dense``: the CLEAR query tower over ``W/dense/index`` (its checkpoint from the index metadata)."""
    index = DenseIndex.load(index_dir(workdir))
    ckpt = checkpoint or index.meta.get("checkpoint") or default_checkpoint(workdir)
    if not Path(ckpt).exists():
        ckpt = default_checkpoint(workdir)
    check_index_checkpoint(index, ckpt, index_dir(workdir))
    return DenseRetriever(ckpt, index, **options)


def check_index_checkpoint(index: DenseIndex, checkpoint: str | os.PathLike, where: str | os.PathLike) -> None:
    """The query tower must be the model whose documents the index holds: a ConfigError naming both
    checkpoints otherwise (another model's query vectors would score silently wrong)."""
    from ckray.models.checkpoint import checkpoint_digest, read_checkpoint_config

    built = index.meta.get("checkpoint_sha256")
    if built is None:
        return
    if checkpoint_digest(checkpoint) != built:
        encoder = read_checkpoint_config(checkpoint).get("config", {}).get("encoder")
        raise ConfigError(f"checkpoint {checkpoint} (encoder {encoder}) is not the model the dense index at {where} "
                          f"was built with ({index.meta.get('checkpoint')}, sha256 {built[:12]}…): its query vectors "
                          f"do not fit that index; rebuild it with jobs/build_dense_index.py --checkpoint {checkpoint}")


def hybrid_retriever(workdir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                     lam: float | None = None, normalization: str | None = None, **options: Any) -> HybridRetriever:
    """``clear``: BM25 + CLEAR dense with the λ_test tuned on training queries (``W/dense/hybrid.json``).
    ``lam`` / ``normalization`` (flags) override the file's. A λ means something only on the scores it
    was tuned on, so another normalization than the file's needs a λ too (a ConfigError otherwise)."""
    from ckray.lexical.bm25 import bm25_retriever

    if normalization is not None:
        check_hybrid_normalization("hybrid_retriever", normalization)
    path = dense_root(workdir) / HYBRID_FILE
    if lam is not None and not path.exists():
        dense = dense_retriever(workdir, checkpoint, **options)
        config = HybridConfig(lam=lam, normalization=normalization or trained_normalization(dense.checkpoint),
                              source="flag")
        return HybridRetriever(bm25_retriever(workdir), dense, config)
    config = load_hybrid_config(workdir)
    if normalization not in (None, config.normalization) and lam is None:
        raise ConfigError(f"λ_test {config.lam} in {path} was tuned for hybrid normalization "
                          f"{config.normalization!r}, not {normalization!r}: pass --lambda with "
                          f"--hybrid-normalization")
    if lam is not None:
        config.lam, config.normalization, config.source = lam, normalization or config.normalization, "flag"
    return HybridRetriever(bm25_retriever(workdir), dense_retriever(workdir, checkpoint, **options), config)
