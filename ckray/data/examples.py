"""Training examples: (query, positive, BM25 negative) triples and a dev set carved from training queries."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckray.errors import ConfigError, MissingArtifactError

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


# --------------------------------------------------------------------------- negatives and triples
import hashlib  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

log = logging.getLogger(__name__)

TRIPLE_COLUMNS = ("query_id", "query", "pos_id", "pos_text", "pos_bm25", "neg_id", "neg_text", "neg_bm25")


def negatives_path(workdir: str | os.PathLike, split: str = "train") -> Path:
    return Path(workdir) / "negatives" / f"{split}.parquet"


def positives_path(workdir: str | os.PathLike, split: str = "train") -> Path:
    return Path(workdir) / "negatives" / f"{split}-positives.parquet"


def build_negatives(workdir: str | os.PathLike, queries: dict[str, str], qrels: dict[str, dict[str, int]],
                    split: str = "train", depth: int = 1000, threads: int = 2) -> Path:
    """BM25 top-``depth`` (with scores) for each query of ``split`` → ``W/negatives/<split>.parquet``,
    and the BM25 score of every judged positive → ``W/negatives/<split>-positives.parquet``
    (CLEAR's margin needs s_lex(q, d+) also when d+ is outside the top 1000)."""
    from ckray.data.shards import is_done, mark_done, write_parquet_atomic
    from ckray.lexical.bm25 import BM25Searcher, bm25_index_dir

    out, pos_out = negatives_path(workdir, split), positives_path(workdir, split)
    stamp = {"queries_sha": _hash_dict(queries), "qrels_sha": _hash_dict(qrels), "depth": depth}
    if is_done(out, stamp) and is_done(pos_out, stamp):
        log.info("negatives for %s are up to date", split)
        return out
    searcher = BM25Searcher(str(bm25_index_dir(workdir)), threads=threads)
    run = searcher.search(queries, k=depth)
    qids, dids, ranks, scores = [], [], [], []
    for qid, docs in run.items():
        for rank, (did, score) in enumerate(docs, start=1):
            qids.append(qid), dids.append(did), ranks.append(rank), scores.append(score)
    write_parquet_atomic(pa.table({"query_id": qids, "doc_id": dids, "rank": pa.array(ranks, pa.int32()),
                                   "score": pa.array(scores, pa.float32())}), out)
    mark_done(out, stamp)
    in_run = {q: dict(docs) for q, docs in run.items()}
    rows = [(q, d, in_run.get(q, {}).get(d)) for q, docs in qrels.items() if q in queries for d, rel in docs.items() if rel > 0]
    pos_scores = [s if s is not None else searcher.score(queries[q], d) for q, d, s in rows]
    write_parquet_atomic(pa.table({"query_id": [r[0] for r in rows], "doc_id": [r[1] for r in rows],
                                   "score": pa.array(pos_scores, pa.float32())}), pos_out)
    mark_done(pos_out, stamp)
    log.info("BM25 top-%d negatives for %d %s queries → %s", depth, len(run), split, out)
    return out


def _hash_dict(d: dict) -> str:
    import json

    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def is_dev_query(qid: str, dev_fraction: float, seed: int = 0) -> bool:
    """Stable assignment of a training query to the dev split (hash of its id, not its position)."""
    h = int(hashlib.sha256(f"{seed}:{qid}".encode()).hexdigest()[:8], 16)
    return h / 0xFFFFFFFF < dev_fraction


@dataclass
class TrainingDataConfig:
    split: str = "train"
    dev_fraction: float = 0.15
    negatives_per_positive: int = 8
    negative_depth: int = 1000      # sample negatives from BM25's top-N (CLEAR: 1000)
    dev_depth: int = 50             # BM25 candidates reranked for validation
    max_dev_queries: int = 200
    seed: int = 0
    # weak supervision from the corpus itself: up to N documents' titles used as queries for their own
    # body (title → body pairs, BM25 negatives of the title); 0 = off. Never uses any query or qrels.
    weak_titles: int = 0
    weak_depth: int = 100           # the title's BM25 top-N the weak negatives are sampled from
    # hard negatives mined by a trained model: a TREC run on the training queries (e.g. W/runs/ck-qti-train.trec
    # from ``jobs/evaluate.py --split train``); of each positive's negatives_per_positive, this many come from
    # the non-relevant documents in the run's top hard_negative_depth (those also in BM25's top negative_depth,
    # whose BM25 score CLEAR's margin needs), the rest from BM25 as without a run
    hard_negative_run: str | None = None
    hard_negatives_per_positive: int = 4
    hard_negative_depth: int = 100

    def __post_init__(self) -> None:
        checks = [("dev_fraction", "--dev-fraction", 0 <= self.dev_fraction <= 1, "in [0, 1]"),
                  ("negatives_per_positive", "--negatives-per-positive", self.negatives_per_positive >= 1, ">= 1"),
                  ("negative_depth", "--negative-depth", self.negative_depth >= 1, ">= 1"),
                  ("dev_depth", "--dev-depth", self.dev_depth >= 1, ">= 1"),
                  ("max_dev_queries", "--max-dev-queries", self.max_dev_queries >= 0, ">= 0"),
                  ("weak_titles", "--weak-titles", self.weak_titles >= 0, ">= 0 (0 = off)"),
                  ("weak_depth", "--weak-depth", self.weak_depth >= 1, ">= 1"),
                  ("hard_negatives_per_positive", "--hard-negatives-per-positive",
                   self.hard_negatives_per_positive >= 0 and (
                       not self.hard_negative_run or self.hard_negatives_per_positive <= self.negatives_per_positive),
                   f"in [0, --negatives-per-positive = {self.negatives_per_positive}]"),
                  ("hard_negative_depth", "--hard-negative-depth", self.hard_negative_depth >= 1, ">= 1")]
        for name, flag, ok, rule in checks:
            if not ok:
                raise ConfigError(f"TrainingDataConfig.{name} ({flag}) must be {rule}, got {getattr(self, name)!r}")


@dataclass
class TrainingData:
    triples: pa.Table
    dev: DevSet
    train_queries: list[str]
    config: TrainingDataConfig = field(default_factory=TrainingDataConfig)

    @property
    def weak_triples(self) -> int:
        """Of ``triples``, how many are weak title → body pairs."""
        return sum(q.startswith(TITLE_QUERY_PREFIX) for q in self.triples.column("query_id").to_pylist())


def build_training_data(workdir: str | os.PathLike, queries: dict[str, str], qrels: dict[str, dict[str, int]],
                        config: TrainingDataConfig = TrainingDataConfig()) -> TrainingData:
    """Triples (query, positive, BM25 negative) for the non-dev training queries and a DevSet of
    held-back training queries. Test queries never enter here."""
    from ckray.data.shards import DocStore

    run, pos_bm25 = _read_negatives(workdir, config.split)
    hard_run = _read_hard_negative_run(config.hard_negative_run) if config.hard_negative_run else {}
    store = DocStore(workdir)
    rng = random.Random(config.seed)
    qids = sorted(q for q in qrels if q in queries and any(r > 0 for r in qrels[q].values()))
    held_out = [q for q in qids if is_dev_query(q, config.dev_fraction, config.seed)]
    dev_q = held_out[: config.max_dev_queries]  # the cap bounds validation time; the rest is not trained on
    train_q = [q for q in qids if not is_dev_query(q, config.dev_fraction, config.seed)]
    rows: dict[str, list] = {c: [] for c in TRIPLE_COLUMNS}
    for q in train_q:
        positives = [d for d, r in qrels[q].items() if r > 0 and d in store]
        pool = [(d, s) for d, s in run.get(q, [])[: config.negative_depth] if qrels[q].get(d, 0) <= 0]
        if not positives or not pool:
            continue
        bm25_of = dict(pool)
        hard = [(d, bm25_of[d]) for d, _ in hard_run.get(q, [])[: config.hard_negative_depth] if d in bm25_of]
        for p in positives:
            for d, s in _sample_negatives(rng, pool, hard, config):
                _append_triple(rows, q, queries[q], p, store.text(p), pos_bm25.get((q, p), 0.0), d, store.text(d), s)
    n_supervised = len(rows["query_id"])
    if config.weak_titles > 0:
        _add_title_triples(rows, workdir, store, config, rng)
    triples = pa.table(rows)
    if triples.num_rows:
        order = list(range(triples.num_rows))
        rng.shuffle(order)
        triples = triples.take(order)
    candidates = {q: run.get(q, [])[: config.dev_depth] for q in dev_q}
    texts = {d: store.text(d) for docs in candidates.values() for d, _ in docs}
    dev = DevSet(queries={q: queries[q] for q in dev_q}, candidates=candidates, doc_text=texts,
                 qrels={q: qrels[q] for q in dev_q}, meta={"depth": config.dev_depth})
    log.info("training data: %d triples from %d queries (+ %d weak title triples); dev: %d queries × %d candidates",
             n_supervised, len(train_q), triples.num_rows - n_supervised, len(dev_q), config.dev_depth)
    return TrainingData(triples=triples, dev=dev, train_queries=train_q, config=config)


def _sample_negatives(rng: random.Random, pool: list[tuple[str, float]], hard: list[tuple[str, float]],
                      config: TrainingDataConfig) -> list[tuple[str, float]]:
    """``negatives_per_positive`` distinct (doc, BM25 score): up to ``hard_negatives_per_positive`` from the
    mined ``hard`` list (empty without a run), the rest from the BM25 ``pool``."""
    picked = rng.sample(hard, min(config.hard_negatives_per_positive, len(hard)))  # none drawn: no random call
    taken = {d for d, _ in picked}
    rest = [x for x in pool if x[0] not in taken]
    return picked + rng.sample(rest, min(config.negatives_per_positive - len(picked), len(rest)))


def _read_hard_negative_run(path: str) -> Run:
    """The mined run (``--hard-negative-run``); a missing file names the flag and how to make one."""
    from ckray.data.collections import read_trec_run

    if not Path(path).exists():
        raise MissingArtifactError(f"--hard-negative-run {path}: no such run file (make one on the training "
                                   "queries, e.g. jobs/evaluate.py --pipeline ck-qti --split train)")
    return read_trec_run(Path(path))


def _read_negatives(workdir: str | os.PathLike, split: str) -> tuple[Run, dict[tuple[str, str], float]]:
    """What :func:`build_negatives` wrote for ``split``: the BM25 run and the positives' BM25 scores."""
    neg = pq.read_table(negatives_path(workdir, split)).to_pydict()
    pos = pq.read_table(positives_path(workdir, split)).to_pydict()
    run: Run = {}
    for q, d, s in zip(neg["query_id"], neg["doc_id"], neg["score"]):
        run.setdefault(q, []).append((d, float(s)))
    return run, {(q, d): float(s) for q, d, s in zip(pos["query_id"], pos["doc_id"], pos["score"])}


def _append_triple(rows: dict[str, list], *values) -> None:
    """One training triple, its values in ``TRIPLE_COLUMNS`` order."""
    for col, val in zip(TRIPLE_COLUMNS, values, strict=True):
        rows[col].append(val)


TITLE_QUERY_PREFIX = "title:"
MIN_TITLE_WORDS = 3  # shorter titles ("Introduction", "Erratum") say too little to be a query


def _add_title_triples(rows: dict[str, list], workdir: str | os.PathLike, store, config: TrainingDataConfig,
                       rng: random.Random) -> None:
    """Weak supervision from the corpus (the brief's "title → abstract" pairs): a document's title is a
    query whose positive is the document's body; negatives are other bodies from the title's BM25
    top ``weak_depth``. Bodies only, so the title's own words are not handed to the model. Query ids
    are ``title:<doc_id>``, so they can never collide with, or be mistaken for, a real query. The
    lexical scores are the title's BM25 against the indexed documents (title + body)."""
    titled = [d for d in store.ids() if len(store.get(d)[0].split()) >= MIN_TITLE_WORDS and store.get(d)[1].strip()]
    chosen = sorted(rng.sample(titled, min(config.weak_titles, len(titled))))
    queries = {TITLE_QUERY_PREFIX + d: store.get(d)[0] for d in chosen}
    qrels = {TITLE_QUERY_PREFIX + d: {d: 1} for d in chosen}
    build_negatives(workdir, queries, qrels, split="weak-titles", depth=config.weak_depth)
    run, pos_bm25 = _read_negatives(workdir, "weak-titles")  # exactly these queries (the file's stamp)
    before = len(rows["query_id"])
    for q in queries:
        source = q[len(TITLE_QUERY_PREFIX):]
        body = store.get(source)[1]
        pool = [(d, s) for d, s in run.get(q, []) if d != source and store.get(d)[1].strip()]
        for d, s in rng.sample(pool, min(config.negatives_per_positive, len(pool))):
            _append_triple(rows, q, queries[q], source, body, pos_bm25[(q, source)], d, store.get(d)[1], s)
    log.info("weak supervision: %d title queries → %d body pairs", len(queries), len(rows["query_id"]) - before)
