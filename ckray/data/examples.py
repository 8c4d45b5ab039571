"""Training examples: (query, positive, BM25 negative) triples and a dev set carved from training queries.

The triples are a Ray Dataset that streams (:func:`build_training_data`); the driver holds the queries,
their judgments and a few integers per triple, never a negative or a triple:

1. **Negatives** (``ckray.data.negatives``, at prepare): BM25's top ``depth`` of every query of a split in
   ``W/negatives/<split>.parquet``, *sorted by query id*, so a reader of a range of query ids reads only
   the row groups that hold them.
2. **Sizes** (a Ray Data pass): the training queries, sorted, are cut into blocks; a task per block
   reads its queries' negatives and says, per query, how many positives, BM25 candidates and mined
   hard negatives it has.
3. **Replay** (driver): the sampling rule draws from one ``random.Random(seed)`` query after query, and
   what ``rng.sample`` draws depends only on the population's size, so the driver replays the draws on
   those sizes, notes the generator's state at the start of each block and ends with the same shuffle
   of the triples' order as sampling them all in one process would.
4. **Triples** (Ray Data, lazily, every time the dataset is read): each block's task restores its
   state and samples its queries' triples exactly as the single-process rule; the triples are sorted
   by their place in the shuffle (``position``) and the documents' texts are joined from the
   memory-mapped :class:`~ckray.data.docstore.DocStore` in the tasks.

So for a seed the triples, and their order, equal those of sampling everything in one process.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import random
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ckray.data.negatives import (build_negatives, judged_positives, positive_scores, positives_path, read_negatives,
                                  require_negatives, runs_by_query, stable_digest)
from ckray.errors import ConfigError, MissingArtifactError
from ckray.options import option
from ckray.workdir import WorkDir

log = logging.getLogger(__name__)

Run = dict[str, list[tuple[str, float]]]

TRIPLE_COLUMNS = ("query_id", "query", "pos_id", "pos_text", "pos_bm25", "neg_id", "neg_text", "neg_bm25")
POSITION = "position"  # a triple's place in the seeded shuffle of all triples (0 = first)
BLOCK_QUERIES = 256                # training queries per Ray Data task, at least ...
MAX_BLOCKS = 256                   # ... and at most this many tasks (the sort's all-to-all grows as its square)
SUPERVISED, WEAK = "supervised", "weak"
BM25_SCALES = ("raw", "query-max")   # the BM25 scores triples and dev candidates carry (TrainingDataConfig.bm25_scale)


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


# --------------------------------------------------------------------------- the sampling rule

def is_dev_query(qid: str, dev_fraction: float, seed: int = 0) -> bool:
    """Stable assignment of a training query to the dev split (hash of its id, not its position)."""
    h = int(hashlib.sha256(f"{seed}:{qid}".encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < dev_fraction


@dataclass
class TrainingDataConfig:
    """How training triples and the dev set are made; each field declared with
    :func:`~ckray.options.option` is a flag of every training job."""

    split: str = option("train", "qrels split used for training", flag="--train-split", metavar="SPLIT")
    dev_fraction: float = option(0.15, "training queries held back for validation")
    negatives_per_positive: int = option(8, "training triples (negatives) per judged positive")
    negative_depth: int = option(1000, "sample negatives from BM25 top-N")   # CLEAR: 1000
    dev_depth: int = option(50, "BM25 candidates reranked in validation")
    max_dev_queries: int = option(200, "validate on at most N of the held-back queries (the rest is not trained "
                                       "on either)")
    max_triples: int = option(0, "use at most N training triples, the first N of the seeded shuffle (0: all)")
    seed: int = 0
    # weak supervision from the corpus itself: never uses any query or qrels
    weak_titles: int = option(0, "weak supervision: add N corpus documents' title → body pairs with the title's "
                                 "BM25 negatives (0: off)", metavar="N")
    weak_depth: int = option(100, "weak negatives from the title's BM25 top-N")
    # of each positive's negatives_per_positive, hard_negatives_per_positive come from the non-relevant
    # documents in the run's top hard_negative_depth (those also in BM25's top negative_depth, whose BM25
    # score CLEAR's margin needs), the rest from BM25 as without a run
    hard_negative_run: str | None = option(None, "hard negatives mined by a trained model: a TREC run on the "
                                                 "training queries, e.g. W/runs/ck-qti-train.trec from "
                                                 "jobs/evaluate.py --split train (default: BM25 only)",
                                           metavar="RUN")
    hard_negatives_per_positive: int = option(4, "of --negatives-per-positive, this many from the run's top "
                                                 "--hard-negative-depth")
    hard_negative_depth: int = option(100, "hard negatives from the run's top-N")
    bm25_scale: str = option("raw", "the BM25 scores of the triples and dev candidates, which CLEAR's margin and "
                                    "validation read: raw (the paper's) or query-max (each divided by the query's "
                                    "top BM25 score, the lexical side of --hybrid-normalization tmm; --lambda-train "
                                    "is then in those units)", choices=BM25_SCALES)

    def __post_init__(self) -> None:
        checks = [("dev_fraction", 0 <= self.dev_fraction <= 1, "in [0, 1]"),
                  ("negatives_per_positive", self.negatives_per_positive >= 1, ">= 1"),
                  ("negative_depth", self.negative_depth >= 1, ">= 1"),
                  ("dev_depth", self.dev_depth >= 1, ">= 1"),
                  ("max_dev_queries", self.max_dev_queries >= 0, ">= 0"),
                  ("max_triples", self.max_triples >= 0, ">= 0 (0: all)"),
                  ("weak_titles", self.weak_titles >= 0, ">= 0 (0 = off)"),
                  ("weak_depth", self.weak_depth >= 1, ">= 1"),
                  ("hard_negatives_per_positive",
                   self.hard_negatives_per_positive >= 0 and (
                       not self.hard_negative_run or self.hard_negatives_per_positive <= self.negatives_per_positive),
                   f"in [0, --negatives-per-positive = {self.negatives_per_positive}]"),
                  ("hard_negative_depth", self.hard_negative_depth >= 1, ">= 1"),
                  ("bm25_scale", self.bm25_scale in BM25_SCALES, f"one of {', '.join(BM25_SCALES)}")]
        for name, ok, rule in checks:
            if not ok:
                raise ConfigError.invalid("TrainingDataConfig", name, f"must be {rule}, got {getattr(self, name)!r}")


def _sample_negatives(rng: random.Random, pool: list[tuple[str, float]], hard: list[tuple[str, float]],
                      config: TrainingDataConfig) -> list[tuple[str, float]]:
    """``negatives_per_positive`` distinct (doc, BM25 score): up to ``hard_negatives_per_positive`` from the
    mined ``hard`` list (empty without a run), the rest from the BM25 ``pool``."""
    picked = rng.sample(hard, min(config.hard_negatives_per_positive, len(hard)))  # none drawn: no random call
    taken = {d for d, _ in picked}
    rest = [x for x in pool if x[0] not in taken]
    return picked + rng.sample(rest, min(config.negatives_per_positive - len(picked), len(rest)))


def _replay_negatives(rng: random.Random, pool: int, hard: int, config: TrainingDataConfig) -> int:
    """:func:`_sample_negatives`'s draws on a pool of ``pool`` and a hard list of ``hard`` (distinct)
    documents, made on indices: ``rng`` ends where sampling the documents leaves it (``rng.sample``
    draws by position, whatever the population holds). Returns how many negatives it picks."""
    picked = len(rng.sample(range(hard), min(config.hard_negatives_per_positive, hard)))
    return picked + len(rng.sample(range(pool - picked), min(config.negatives_per_positive - picked, pool - picked)))


def _replay_query(rng: random.Random, kind: str, positives: int, pool: int, hard: int,
                  config: TrainingDataConfig) -> int:
    """The draws of one query's triples (see :func:`_query_triples`) on its sizes; returns its triple count."""
    if kind == WEAK:
        return len(rng.sample(range(pool), min(config.negatives_per_positive, pool)))
    if not positives or not pool:
        return 0
    return sum(_replay_negatives(rng, pool, hard, config) for _ in range(positives))


# --------------------------------------------------------------------------- training data

@dataclass
class TriplePlan:
    """What the driver knows of the triples: one row per block of queries (``specs``: the block's query
    ids and texts, judged positives and their BM25 scores, the generator's state where the block
    starts and the shuffle position of each of its triples) and the counts. :meth:`dataset` makes the
    triples from it in Ray Data tasks."""

    specs: pa.Table
    workdir: str
    config: TrainingDataConfig
    size: int                       # triples in all
    weak_positions: np.ndarray      # the shuffle positions of the weak title → body triples
    hard_dir: str | None = None     # the mined run, split by block (see _hard_negative_parts)

    def dataset(self, limit: int | None = None) -> Any:
        """The triples (``TRIPLE_COLUMNS`` and ``position``) as a lazy Ray Dataset, in shuffle order;
        ``limit``: only the first ``limit`` of that order."""
        import ray.data

        from ckray.ray_env import init_ray

        init_ray()
        n = self.size if limit is None else min(limit, self.size)
        ds = ray.data.from_arrow([self.specs.slice(i, 1) for i in range(self.specs.num_rows)] or
                                 [_spec_schema().empty_table()])
        ds = ds.map_batches(_block_triples, batch_size=1, batch_format="pyarrow",
                            fn_kwargs={"workdir": self.workdir, "config": self.config, "hard_dir": self.hard_dir,
                                       "limit": n})
        parts = max(1, min(self.specs.num_rows, math.ceil(n / 1024)))
        ds = ds.sort(POSITION, boundaries=[n * i // parts for i in range(1, parts)] or [n])  # no sampling pass
        return ds.map_batches(_join_texts, batch_format="pyarrow", fn_kwargs={"workdir": self.workdir})


@dataclass
class TrainingData:
    """The triples (a lazy Ray Dataset: :attr:`triples`), the dev set and the training queries.
    ``limit``: only the first ``limit`` triples of the shuffle (``--max-triples``)."""

    plan: TriplePlan
    dev: DevSet
    train_queries: list[str]
    config: TrainingDataConfig = field(default_factory=TrainingDataConfig)
    limit: int | None = None

    @functools.cached_property
    def triples(self) -> Any:
        return self.plan.dataset(self.limit)

    @property
    def num_triples(self) -> int:
        return self.plan.size if self.limit is None else min(self.limit, self.plan.size)

    @property
    def weak_triples(self) -> int:
        """Of the triples, how many are weak title → body pairs."""
        return int((self.plan.weak_positions < self.num_triples).sum())

    def limited(self, n: int) -> "TrainingData":
        """The same data cut to the first ``n`` triples of the shuffle."""
        return replace(self, limit=n if self.limit is None else min(n, self.limit))

    def head(self, n: int) -> pa.Table:
        """The first ``n`` triples of the shuffle as a table (made in Ray Data tasks, ``n`` rows here)."""
        import ray

        n = min(n, self.num_triples)
        if n <= 0:
            return _triples_schema().empty_table()
        ds = self.plan.dataset(n)
        tables = ray.get(ds.to_arrow_refs())
        return pa.concat_tables(tables).sort_by(POSITION) if tables else _triples_schema().empty_table()


def build_training_data(workdir: str | os.PathLike, queries: dict[str, str], qrels: dict[str, dict[str, int]],
                        config: TrainingDataConfig = TrainingDataConfig()) -> TrainingData:
    """Triples (query, positive, BM25 negative) for the non-dev training queries, as a lazy Ray Dataset,
    and a DevSet of held-back training queries. Test queries never enter here.

    Per training query (sorted by id), for each judged positive in the corpus, ``negatives_per_positive``
    distinct negatives are drawn from its non-relevant BM25 top ``negative_depth`` (up to
    ``hard_negatives_per_positive`` of them from the mined run), all from one ``random.Random(seed)``;
    then come the weak title → body pairs, then one shuffle of all the triples' order."""
    from ckray.data.shards import DocStore

    workdir = str(Path(workdir).resolve())
    require_negatives(workdir, config.split)
    if config.hard_negative_run and not Path(config.hard_negative_run).exists():
        raise MissingArtifactError(f"--hard-negative-run {config.hard_negative_run}: no such run file (make one on "
                                   "the training queries, e.g. jobs/evaluate.py --pipeline ck-qti --split train)")
    store = DocStore(workdir)  # built here when missing, before any task opens it
    rng = random.Random(config.seed)
    qids = sorted(q for q in qrels if q in queries and any(r > 0 for r in qrels[q].values()))
    held_out = [q for q in qids if is_dev_query(q, config.dev_fraction, config.seed)]
    dev_q = held_out[: config.max_dev_queries]  # the cap bounds validation time; the rest is not trained on
    train_q = [q for q in qids if not is_dev_query(q, config.dev_fraction, config.seed)]

    blocks = _blocks(train_q)
    hard_dir = (_hard_negative_parts(workdir, Path(config.hard_negative_run), blocks)
                if config.hard_negative_run else None)
    pos_scores = positive_scores(positives_path(workdir, config.split))
    specs = [_spec(i, SUPERVISED, config.split, block, queries,
                   [judged_positives(qrels[q]) for q in block], pos_scores) for i, block in enumerate(blocks)]
    specs, n_supervised = _replayed(specs, rng, workdir, config, hard_dir, start=0)
    if config.weak_titles > 0:
        weak = _weak_specs(workdir, store, config, rng, first_block=len(specs))
        weak, n_total = _replayed(weak, rng, workdir, config, None, start=n_supervised)
        specs += weak
    else:
        n_total = n_supervised
    order = np.arange(n_total, dtype=np.int64)
    if n_total:
        rng.shuffle(order)  # the same draws as shuffling a list of n_total rows
    positions = np.empty(n_total, dtype=np.int64)
    positions[order] = np.arange(n_total, dtype=np.int64)
    plan = TriplePlan(specs=_spec_table(specs, positions), workdir=workdir, config=config, size=n_total,
                      weak_positions=positions[n_supervised:], hard_dir=hard_dir)

    run = read_negatives(workdir, config.split, dev_q, config.dev_depth)
    candidates = {q: run.get(q, []) for q in dev_q}
    if config.bm25_scale == "query-max":
        candidates = {q: divided_by_query_top(c)[0] for q, c in candidates.items()}
    texts = {d: store.text(d) for docs in candidates.values() for d, _ in docs}
    dev = DevSet(queries={q: queries[q] for q in dev_q}, candidates=candidates, doc_text=texts,
                 qrels={q: qrels[q] for q in dev_q}, meta={"depth": config.dev_depth})
    log.info("training data: %d triples from %d queries in %d blocks (+ %d weak title triples); dev: %d queries "
             "× %d candidates", n_supervised, len(train_q), len(blocks), n_total - n_supervised, len(dev_q),
             config.dev_depth)
    return TrainingData(plan=plan, dev=dev, train_queries=train_q, config=config)


def _blocks(qids: list[str]) -> list[list[str]]:
    """``qids`` (sorted) cut into the consecutive blocks that one task each samples."""
    size = max(BLOCK_QUERIES, math.ceil(len(qids) / MAX_BLOCKS))
    return [qids[i:i + size] for i in range(0, len(qids), size)]


def _spec(block: int, kind: str, split: str, qids: list[str], queries: dict[str, str], positives: list[list[str]],
          pos_scores: dict[tuple[str, str], float]) -> dict:
    """One block of queries to sample: ids, texts, judged positives with their BM25 scores."""
    return {"block": block, "kind": kind, "split": split, "qids": qids, "texts": [queries[q] for q in qids],
            "positives": positives,
            "pos_scores": [[pos_scores.get((q, d), 0.0) if kind == SUPERVISED else pos_scores[(q, d)] for d in ps]
                           for q, ps in zip(qids, positives)]}


def _spec_schema() -> pa.Schema:
    return pa.schema([("block", pa.int64()), ("kind", pa.string()), ("split", pa.string()),
                      ("qids", pa.list_(pa.string())), ("texts", pa.list_(pa.string())),
                      ("positives", pa.list_(pa.list_(pa.string()))),
                      ("pos_scores", pa.list_(pa.list_(pa.float64()))), ("state", pa.list_(pa.int64())),
                      ("first", pa.int64()), ("count", pa.int64()), ("positions", pa.list_(pa.int64()))])


def _spec_table(specs: list[dict], positions: np.ndarray) -> pa.Table:
    """The specs as one Arrow table; each row gets the shuffle positions of its triples."""
    offsets = np.array([0] + [s["count"] for s in specs], dtype=np.int64).cumsum()
    values = np.concatenate([positions[s["first"]:s["first"] + s["count"]] for s in specs] or [np.empty(0, np.int64)])
    columns = {name: [s[name] for s in specs] for name in _spec_schema().names if name != "positions"}
    columns["positions"] = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.int64()))
    return pa.table(columns, schema=_spec_schema())


def _replayed(specs: list[dict], rng: random.Random, workdir: str, config: TrainingDataConfig,
              hard_dir: str | None, start: int) -> tuple[list[dict], int]:
    """Each block's sizes (a Ray Data pass), then the draws replayed on them block by block: every spec
    gets the generator's state at its start, its first triple's index and its triple count. Returns the
    specs and the index after the last triple."""
    sizes = _block_sizes_of(specs, workdir, config, hard_dir)
    n = start
    for spec in specs:
        version, state, gauss = rng.getstate()
        assert version == 3 and gauss is None, "random.Random state of an unexpected kind"
        spec.update(state=list(state), first=n)
        for positives, pool, hard in sizes[spec["block"]]:
            n += _replay_query(rng, spec["kind"], positives, pool, hard, config)
        spec["count"] = n - spec["first"]
    return specs, n


def _block_sizes_of(specs: list[dict], workdir: str, config: TrainingDataConfig,
                    hard_dir: str | None) -> dict[int, list[tuple[int, int, int]]]:
    """block → per query (positives in the corpus, BM25 pool, hard list), from one Ray Data task per block."""
    if not specs:
        return {}
    import ray
    import ray.data

    from ckray.ray_env import init_ray

    init_ray()
    table = _spec_table([{**s, "state": [], "first": 0, "count": 0} for s in specs], np.empty(0, np.int64))
    ds = ray.data.from_arrow([table.slice(i, 1) for i in range(table.num_rows)])
    ds = ds.map_batches(_block_sizes, batch_size=1, batch_format="pyarrow",
                        fn_kwargs={"workdir": workdir, "config": config, "hard_dir": hard_dir})
    out = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    return {b: list(zip(p, o, h)) for b, p, o, h in zip(*(out[c].to_pylist() for c in
                                                          ("block", "positives", "pool", "hard")))}


def _block_sizes(batch: pa.Table, workdir: str, config: TrainingDataConfig, hard_dir: str | None) -> pa.Table:
    """Ray Data task: a block's per-query sizes (see :func:`_block_sizes_of`)."""
    spec = batch.to_pylist()[0]
    sizes = [(len(positives), len(pool), len(hard))
             for _, _, positives, pool, hard in _query_pools(spec, workdir, config, hard_dir)]
    return pa.table({"block": [spec["block"]], "positives": [[s[0] for s in sizes]],
                     "pool": [[s[1] for s in sizes]], "hard": [[s[2] for s in sizes]]})


def _query_pools(spec: dict, workdir: str, config: TrainingDataConfig, hard_dir: str | None) -> Iterator[tuple]:
    """Per query of a block, what its triples are drawn from: (id, text, [(positive, its BM25 score)],
    BM25 pool [(doc, score)], hard list [(doc, score)]).

    Supervised: the judged positives in the corpus; the pool is BM25's top ``negative_depth`` less the
    judged positives; the hard list is the mined run's top ``hard_negative_depth`` that is in the pool
    (each document once). Weak (``title:<doc>``): the document's body is the positive; the pool is the
    title's BM25 list less the document itself and documents without a body."""
    from ckray.data.shards import DocStore

    store = DocStore(workdir)
    depth = config.negative_depth if spec["kind"] == SUPERVISED else None
    run = read_negatives(workdir, spec["split"], spec["qids"], depth)
    hard_run = (_read_hard_block(hard_dir, spec["block"], config.hard_negative_depth)
                if hard_dir and spec["kind"] == SUPERVISED else {})
    for q, text, judged, scores in zip(spec["qids"], spec["texts"], spec["positives"], spec["pos_scores"]):
        if config.bm25_scale == "query-max":
            run[q], scores = divided_by_query_top(run.get(q, []), scores)
        if spec["kind"] == WEAK:
            source = judged[0]
            pool = [(d, s) for d, s in run.get(q, []) if d != source and store.get(d)[1].strip()]
            yield q, text, [(source, scores[0])], pool, []
            continue
        excluded = set(judged)
        positives = [(p, s) for p, s in zip(judged, scores) if p in store]
        pool = [(d, s) for d, s in run.get(q, []) if d not in excluded]
        bm25_of = dict(pool)
        hard = list({d: bm25_of[d] for d in hard_run.get(q, []) if d in bm25_of}.items())
        yield q, text, positives, pool, hard


def divided_by_query_top(run: list[tuple[str, float]],
                         judged: Sequence[float] = ()) -> tuple[list[tuple[str, float]], list[float]]:
    """``bm25_scale="query-max"``: a query's BM25 run (by rank) and the scores of its ``judged`` documents, each
    divided by the query's top BM25 score (the run's first, or a judged one scored higher outside it): the
    lexical side of tmm (``ckray.fusion.theoretical_min_max``, BM25's theoretical minimum being 0). Without a
    positive score nothing is divided."""
    top = max([s for _, s in run[:1]] + list(judged), default=0.0)
    top = top if top > 0 else 1.0
    return [(d, s / top) for d, s in run], [s / top for s in judged]


def _block_triples(batch: pa.Table, workdir: str, config: TrainingDataConfig, hard_dir: str | None,
                   limit: int) -> pa.Table:
    """Ray Data task: a block's triples, drawn from the generator state the driver noted for the block,
    each with its shuffle position; those at ``limit`` or after are left out. Texts come later
    (:func:`_join_texts`), after the sort."""
    spec = batch.to_pylist()[0]
    rng = random.Random()
    rng.setstate((3, tuple(spec["state"]), None))
    rows: dict[str, list] = {c: [] for c in ("query_id", "query", "pos_id", "pos_bm25", "neg_id", "neg_bm25")}
    for q, text, positives, pool, hard in _query_pools(spec, workdir, config, hard_dir):
        for p, p_score, d, d_score in _query_triples(rng, spec["kind"], positives, pool, hard, config):
            for col, val in zip(rows, (q, text, p, p_score, d, d_score)):
                rows[col].append(val)
    if len(rows["query_id"]) != spec["count"]:
        raise RuntimeError(f"block {spec['block']}: {len(rows['query_id'])} triples drawn, {spec['count']} expected "
                           "(the negatives changed while the training data was read?)")
    table = pa.table({**rows, POSITION: pa.array(spec["positions"], pa.int64())}, schema=_compact_schema())
    return table.filter(pc.less(table[POSITION], limit))


def _query_triples(rng: random.Random, kind: str, positives: list[tuple[str, float]], pool: list[tuple[str, float]],
                   hard: list[tuple[str, float]],
                   config: TrainingDataConfig) -> Iterator[tuple[str, float, str, float]]:
    """(positive, its score, negative, its score) of one query, drawn with ``rng`` (the rule the driver's
    :func:`_replay_query` replays on sizes)."""
    if kind == WEAK:
        (p, p_score), = positives
        for d, s in rng.sample(pool, min(config.negatives_per_positive, len(pool))):
            yield p, p_score, d, s
        return
    if not positives or not pool:
        return
    for p, p_score in positives:
        for d, s in _sample_negatives(rng, pool, hard, config):
            yield p, p_score, d, s


def _compact_schema() -> pa.Schema:
    return pa.schema([("query_id", pa.string()), ("query", pa.string()), ("pos_id", pa.string()),
                      ("pos_bm25", pa.float64()), ("neg_id", pa.string()), ("neg_bm25", pa.float64()),
                      (POSITION, pa.int64())])


def _triples_schema() -> pa.Schema:
    compact = _compact_schema()
    strings = {"pos_text", "neg_text"}
    return pa.schema([pa.field(c, pa.string()) if c in strings else compact.field(c) for c in TRIPLE_COLUMNS] +
                     [compact.field(POSITION)])


def _join_texts(batch: pa.Table, workdir: str) -> pa.Table:
    """Ray Data task: the positive's and the negative's text of each triple, from the document store
    (``doc_text(title, text)``; the body alone for a weak title query, whose title is the query)."""
    from ckray.data.shards import DocStore

    store = DocStore(workdir)
    weak = [q.startswith(TITLE_QUERY_PREFIX) for q in batch["query_id"].to_pylist()]

    def texts(ids: list[str]) -> list[str]:
        return [store.get(d)[1] if w else store.text(d) for d, w in zip(ids, weak)]

    columns = {c: batch[c] for c in batch.column_names}
    columns["pos_text"] = pa.array(texts(batch["pos_id"].to_pylist()), pa.string())
    columns["neg_text"] = pa.array(texts(batch["neg_id"].to_pylist()), pa.string())
    return pa.table({c: columns[c] for c in _triples_schema().names}, schema=_triples_schema())


# --------------------------------------------------------------------------- a mined run, split by block

def _hard_negative_parts(workdir: str, run: Path, blocks: list[list[str]]) -> str:
    """The lines of the mined run (``--hard-negative-run``) whose query is a training query, split by
    block: ``W/negatives/hard-<key>/block=<b>/*.parquet`` (``query_id, doc_id, score, line``), written
    once per run file and block layout (``key``), streaming, so a task reads only its own block's."""
    import pyarrow.dataset as pads

    block_of = {q: b for b, block in enumerate(blocks) for q in block}
    st = run.stat()
    key = stable_digest({"run": str(run.resolve()), "size": st.st_size, "mtime": st.st_mtime_ns,
                         "blocks": stable_digest({"b": blocks})})
    out = WorkDir(workdir).hard_negatives(key)
    if (out / "_done").exists():
        return str(out)
    for stale in out.parent.glob("hard-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    schema = pa.schema([("block", pa.int32()), ("query_id", pa.string()), ("doc_id", pa.string()),
                        ("score", pa.float64()), ("line", pa.int64())])
    pads.write_dataset(_run_batches(run, block_of, schema), tmp, schema=schema, format="parquet",
                       partitioning=pads.partitioning(pa.schema([("block", pa.int32())]), flavor="hive"),
                       existing_data_behavior="delete_matching")
    (tmp / "_done").write_text(str(run))
    os.replace(tmp, out)
    return str(out)


def _run_batches(run: Path, block_of: dict[str, int], schema: pa.Schema, rows: int = 65536) -> Iterator[pa.RecordBatch]:
    """The run's lines of training queries as record batches (``line``: the line's place among the run's
    lines, which breaks ties of score as the file's order does); a malformed line is an error naming it."""
    from ckray.data.collections import trec_run_lines

    cols: dict[str, list] = {name: [] for name in schema.names}
    for line, (qid, did, score) in enumerate(trec_run_lines(run)):
        if qid not in block_of:
            continue
        for name, value in zip(schema.names, (block_of[qid], qid, did, score, line)):
            cols[name].append(value)
        if len(cols["line"]) >= rows:
            yield pa.RecordBatch.from_pydict(cols, schema=schema)
            cols = {name: [] for name in schema.names}
    yield pa.RecordBatch.from_pydict(cols, schema=schema)


def _read_hard_block(hard_dir: str, block: int, depth: int) -> dict[str, list[str]]:
    """The mined run's top ``depth`` documents of each query of ``block`` (by score, ties in file order,
    as :func:`ckray.data.collections.read_trec_run` orders them)."""
    part = Path(hard_dir) / f"block={block}"
    if not part.exists():
        return {}
    t = pq.read_table(part, columns=["query_id", "doc_id", "score", "line"])
    t = t.sort_by([("query_id", "ascending"), ("score", "descending"), ("line", "ascending")])
    return {q: ids[:depth] for q, ids, _ in runs_by_query(t)}


# --------------------------------------------------------------------------- weak title → body pairs

TITLE_QUERY_PREFIX = "title:"
MIN_TITLE_WORDS = 3  # shorter titles ("Introduction", "Erratum") say too little to be a query
WEAK_SPLIT = "weak-titles"


def _weak_specs(workdir: str, store: Any, config: TrainingDataConfig, rng: random.Random,
                first_block: int) -> list[dict]:
    """Weak supervision from the corpus (the brief's "title → abstract" pairs): a document's title is a
    query whose positive is the document's body; negatives are other bodies from the title's BM25
    top ``weak_depth``. Bodies only, so the title's own words are not handed to the model. Query ids
    are ``title:<doc_id>``, so they can never collide with, or be mistaken for, a real query. The
    lexical scores are the title's BM25 against the indexed documents (title + body).

    The titled documents are drawn by index (two streaming passes over the store, none held), the
    chosen ones' BM25 lists built by :func:`build_negatives`; returns their blocks' specs."""
    n_titled = sum(1 for _ in _titled(store))
    wanted = set(rng.sample(range(n_titled), min(config.weak_titles, n_titled)))
    chosen = sorted(d for i, d in enumerate(_titled(store)) if i in wanted)
    queries = {TITLE_QUERY_PREFIX + d: store.get(d)[0] for d in chosen}
    qrels = {TITLE_QUERY_PREFIX + d: {d: 1} for d in chosen}
    build_negatives(workdir, queries, qrels, split=WEAK_SPLIT, depth=config.weak_depth)
    pos_scores = positive_scores(positives_path(workdir, WEAK_SPLIT))
    blocks = _blocks(list(queries))
    log.info("weak supervision: %d title queries", len(queries))
    return [_spec(first_block + i, WEAK, WEAK_SPLIT, block, queries, [[q[len(TITLE_QUERY_PREFIX):]] for q in block],
                  pos_scores) for i, block in enumerate(blocks)]


def _titled(store: Any) -> Iterator[str]:
    """The documents whose title is a query (at least MIN_TITLE_WORDS words) and whose body is not empty."""
    for d in store.ids():
        title, body = store.get(d)
        if len(title.split()) >= MIN_TITLE_WORDS and body.strip():
            yield d
