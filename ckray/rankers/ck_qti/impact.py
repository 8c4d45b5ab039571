"""The CK-QTI impact index job: impact shards by Ray batch inference, then a Lucene impact index.

With query term independence a CK-QTI score is a sum over query terms, ``S_qd = Σ_{t∈q} s_td``, and
``s_td`` depends on the term and the document only. So every document's term scores can be computed
ahead of time and stored in an inverted index (the paper's Sec. 3, "QTI"); a query is then scored by
adding up stored weights, like BM25.

Layout under the work directory ``W``::

    W/shards/part-NNNNN.parquet            corpus shards (doc_id, title, text)        ckray.data.shards
    W/impact/shards/part-NNNNN.parquet     one impact shard per corpus shard:
                                           doc_id: string, terms: list<int32> (word-piece ids),
                                           weights: list<float32> (w_td, descending), exact model scores
                                           (+ .done.json marker: checkpoint digest, settings, max weight)
    W/impact/jsonl/part-NNNNN.jsonl        Pyserini JsonVectorCollection lines, integer weights
    W/impact/jsonl-done/part-NNNNN.jsonl.done.json   their markers (kept out of the indexed folder)
    W/impact/index/                        the Lucene impact index + ckray_impact.json (metadata)

Which terms a document gets and their weights are ``ckray.rankers.ck_qti.term_impacts``'s; the index job's
settings, top-k and β, ``impact_settings``'s; the corpus statistics set into the model, ``corpus_statistics``'s;
retrieval, ``impact_search``'s.

**Quantisation.** Lucene stores integer impacts (Pyserini truncates floats). The Parquet shards keep
float32 w_td; the JSON lines get ``round(w_td · scale)`` with one global ``scale = quant_max /
max_weight`` (max over the whole corpus, ``quant_max`` = 255 by default), recorded in the index
metadata; terms that round to 0 are left out. A retrieved score divided by ``scale`` is Σ_t w_td
within ``0.5/scale`` per query term.

**Term strings.** A term is written as ``"t<id>"`` (``t2003``), never as the word-piece string: these
are plain ASCII tokens that ``--pretokenized`` indexing and Lucene's term queries keep as they are
(word pieces such as ``##ing``, ``[UNK]`` or non-ASCII pieces would be at the mercy of the analyser).
Queries use the same strings (``term_string``).

**The job** (``build_impact_index``): a shard job of ``ckray.batch_inference`` — the corpus shards not
yet done (``is_done`` against a stamp of the checkpoint digest, the settings and the source shard) →
``map_batches(ImpactScorer, compute=ActorPoolStrategy(size=actors))``; each actor loads the checkpoint
once (``load_ck_model``), one GPU each with ``use_gpu``. Actors that die are restarted and their
batches retried (``max_restarts``/``max_task_retries``); each document is kept once (a retried batch
can repeat rows) and a missing one is an error naming it. An impact shard is written atomically with
its marker as soon as all its documents are in. Then every impact shard is checked against its corpus
shard (same ids, each once; totals equal the manifest) — anything else raises
:class:`ImpactIntegrityError`. JSON lines are (re)written for the current scale, and the
Lucene index is (re)built only when its metadata differs from what it would now record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ckray.batch_inference import ShardJob, actor_device, crash_once, run_shard_job, timing_columns
from ckray.data.shards import (INDEX_FILES_KEYS, index_files_changed, index_files_record, mark_done, read_json,
                               read_manifest, shard_paths, write_json_atomic, write_parquet_atomic)
from ckray.errors import CkrayError, MissingArtifactError
from ckray.rankers.ck_qti.corpus_statistics import CorpusAdaptation, corpus_adaptation, document_length_scale
from ckray.rankers.ck_qti.impact_settings import ImpactConfig, check_ck_qti_checkpoint
from ckray.rankers.ck_qti.term_impacts import TermImpactScorer
from ckray.workdir import WorkDir

log = logging.getLogger(__name__)

IMPACT_DIR = "impact"
META_FILE = "ckray_impact.json"
TERM_PREFIX = "t"
FORMAT_VERSION = 1


class ImpactIntegrityError(CkrayError):
    """The impact shards do not hold every corpus document exactly once."""


def impact_root(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).ranker_dir(IMPACT_DIR)


def impact_shards_dir(workdir: str | os.PathLike) -> Path:
    return impact_root(workdir) / "shards"


def jsonl_dir(workdir: str | os.PathLike) -> Path:
    return impact_root(workdir) / "jsonl"


def jsonl_markers_dir(workdir: str | os.PathLike) -> Path:
    return impact_root(workdir) / "jsonl-done"


def impact_index_dir(workdir: str | os.PathLike) -> Path:
    return impact_root(workdir) / "index"


def default_checkpoint(workdir: str | os.PathLike) -> Path:
    return WorkDir(workdir).checkpoint("ck-qti")


def term_string(term_id: int) -> str:
    """The index term for a word-piece id: ``"t<id>"`` (see the module docstring)."""
    return f"{TERM_PREFIX}{int(term_id)}"


# =============================================================================================
# The Ray Data actor
# =============================================================================================

class ImpactScorer:
    """Ray Data callable class: loads the checkpoint once per actor, returns impact vectors.

    ``crash_once`` is a fault-injection hook for tests (``ckray.batch_inference.crash_once``: one
    actor dies on its first batch, once).
    """

    def __init__(self, checkpoint: str, config: dict, use_gpu: bool = False, threads: int = 0,
                 crash_once: str | None = None, corpus: CorpusAdaptation | None = None,
                 document_length_scale: float = 1.0):
        from ckray.rankers.ck_qti.model import load_ck_model

        device = actor_device(use_gpu, threads)
        model = load_ck_model(checkpoint, map_location="cpu")
        if corpus is not None:
            corpus.apply(model)
        model = model.to(device).eval()
        self.scorer = TermImpactScorer(model, ImpactConfig(**config), document_length_scale)
        self.crash_once = crash_once

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        from ckray.data.collections import doc_text

        crash_once(self.crash_once)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        texts = [doc_text(t, x) for t, x in zip(batch["title"], batch["text"])]
        vectors = self.scorer.score_texts(texts)
        timing = timing_columns(len(texts), wall0, cpu0)
        return pa.table({
            "doc_id": pa.array([str(d) for d in batch["doc_id"]], pa.string()),
            "path": pa.array([str(p) for p in batch["path"]], pa.string()),
            "terms": pa.array([v[0] for v in vectors], pa.list_(pa.int32())),
            "weights": pa.array([v[1] for v in vectors], pa.list_(pa.float32())),
            **{name: pa.array(values) for name, values in timing.items()},
        })


# =============================================================================================
# Impact shards
# =============================================================================================

def _shard_stamp(source: Path, rows: int, manifest: dict, digest: str, settings: dict) -> dict:
    return {"source": source.name, "source_rows": rows, "corpus_sha256": manifest.get("input_sha256"),
            "checkpoint_sha256": digest, "format": FORMAT_VERSION, **settings}


def impact_table(doc_ids: Sequence[str], terms: Sequence[np.ndarray], weights: Sequence[np.ndarray]) -> pa.Table:
    """``doc_id: string, terms: list<int32>, weights: list<float32>``."""
    return pa.table({"doc_id": pa.array(list(doc_ids), pa.string()),
                     "terms": pa.array(list(terms), pa.list_(pa.int32())),
                     "weights": pa.array(list(weights), pa.list_(pa.float32()))})


def _max_weight(table: pa.Table) -> float:
    import pyarrow.compute as pc

    flat = pc.list_flatten(table.column("weights"))
    return float(pc.max(flat).as_py() or 0.0) if len(flat) else 0.0


def write_impact_shard(path: Path, table: pa.Table, stamp: dict) -> None:
    """Write an impact shard atomically, then its marker (stamp + its largest weight + rows)."""
    write_parquet_atomic(table, path)
    mark_done(path, {**stamp, "max_weight": _max_weight(table)})


def build_impact_shards(workdir: str | os.PathLike, checkpoint: str | os.PathLike,
                        config: ImpactConfig | None = None, *, crash_once: str | None = None) -> dict:
    """Score every corpus shard not yet done with this checkpoint and settings; returns a summary:
    ``ckray.batch_inference.run_shard_job``'s (``documents`` scored now, ``shards_written``,
    ``shards_skipped``, ``repeated_rows`` — rows of retried batches dropped —, ``batches``, ``seconds``,
    ``docs_per_s``, ``steady_docs_per_s``, ``actor_seconds``, ``actor_cpu_seconds``) plus ``actors`` and
    ``checkpoint_sha256``.
    """
    config = config or ImpactConfig()
    config.validate()
    checkpoint = str(Path(checkpoint).resolve())
    check_ck_qti_checkpoint(checkpoint)
    from ckray.models.checkpoint import checkpoint_digest

    digest = checkpoint_digest(checkpoint)
    manifest = read_manifest(workdir)
    sources = shard_paths(workdir)
    corpus = corpus_adaptation(workdir, checkpoint)  # this corpus's IDF and mean length
    length_scale = document_length_scale(workdir, checkpoint, config, corpus)
    settings = {**config.scoring_settings(), **corpus.stamp()}
    stamps = {s.name: _shard_stamp(s, pq.read_metadata(s).num_rows, manifest, digest, settings) for s in sources}

    def write(path: Path, ids: list[str], vectors: list[tuple[np.ndarray, np.ndarray]], stamp: dict) -> None:
        write_impact_shard(path, impact_table(ids, [v[0] for v in vectors], [v[1] for v in vectors]), stamp)

    def payloads(batch: pa.Table) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(np.asarray(t.values, np.int32), np.asarray(w.values, np.float32))
                for t, w in zip(batch.column("terms"), batch.column("weights"))]

    summary = run_shard_job(ShardJob(
        what="impact scoring", sources=sources, out_dir=impact_shards_dir(workdir), stamps=stamps,
        actor=ImpactScorer,
        actor_kwargs={"checkpoint": checkpoint, "config": asdict(config), "use_gpu": config.use_gpu,
                      "threads": config.torch_threads, "crash_once": crash_once,
                      "corpus": corpus if corpus.changed else None, "document_length_scale": length_scale},
        pool=config, payloads=payloads, write=write, batch_format="pyarrow"))
    return {**summary, "actors": config.actors, "checkpoint_sha256": digest, **corpus.stamp()}


def verify_impact_shards(workdir: str | os.PathLike) -> int:
    """Every corpus document exactly once in the impact shards (per shard, and in total against the
    manifest). Returns the number of documents; raises :class:`ImpactIntegrityError` otherwise."""
    manifest = read_manifest(workdir)
    total = 0
    problems = []
    for source in shard_paths(workdir):
        target = impact_shards_dir(workdir) / source.name
        if not target.exists():
            problems.append(f"{source.name}: no impact shard")
            continue
        want = pq.read_table(source, columns=["doc_id"]).column(0).to_pylist()
        got = pq.read_table(target, columns=["doc_id"]).column(0).to_pylist()
        dup = len(got) - len(set(got))
        missing, extra = set(want) - set(got), set(got) - set(want)
        if dup or missing or extra:
            problems.append(f"{source.name}: {len(got)} rows for {len(want)} documents ({dup} repeated, "
                            f"{len(missing)} missing e.g. {sorted(missing)[:3]}, {len(extra)} unexpected e.g. "
                            f"{sorted(extra)[:3]})")
        total += len(got)
    if total != manifest["documents"]:
        problems.append(f"{total} documents in the impact shards, {manifest['documents']} in the corpus manifest")
    if problems:
        raise ImpactIntegrityError("impact shards do not hold every document exactly once: " + "; ".join(problems)
                                   + f". Delete {impact_shards_dir(workdir)} and re-run the job.")
    return total


# =============================================================================================
# JSON vector lines and the Lucene index
# =============================================================================================

def corpus_max_weight(workdir: str | os.PathLike) -> float:
    """The largest stored weight w_td over all impact shards (from their markers)."""
    from ckray.data.shards import marker_path

    return max([0.0] + [float(read_json(marker_path(impact_shards_dir(workdir) / s.name))["max_weight"])
                        for s in shard_paths(workdir)])


def quantise(weights: np.ndarray, scale: float) -> np.ndarray:
    """Integer impacts: ``round(w · scale)`` (Pyserini would truncate floats)."""
    return np.rint(np.asarray(weights, np.float64) * scale).astype(np.int64)


def vector_lines(table: pa.Table, scale: float) -> list[str]:
    """JsonVectorCollection lines ``{"id", "contents": "", "vector": {"t<id>": int}}``; terms that
    round to 0 are left out."""
    lines = []
    for doc_id, terms, weights in zip(table.column("doc_id").to_pylist(), table.column("terms").to_pylist(),
                                      table.column("weights").to_pylist()):
        q = quantise(np.asarray(weights, np.float32), scale)
        vector = {term_string(t): int(w) for t, w in zip(terms, q) if w > 0}
        lines.append(json.dumps({"id": doc_id, "contents": "", "vector": vector}))
    return lines


def write_jsonl_shards(workdir: str | os.PathLike, scale: float) -> tuple[int, int]:
    """JSON lines for every impact shard at ``scale``; a file already written from the same impact
    shard at the same scale is kept. Returns (files written, documents whose vector is empty: Anserini
    leaves those out of the index — no term of theirs could match a query anyway)."""
    from ckray.data.shards import marker_path

    out, markers = jsonl_dir(workdir), jsonl_markers_dir(workdir)
    out.mkdir(parents=True, exist_ok=True)
    markers.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(".*"):  # interrupted writes must not be indexed
        stale.unlink(missing_ok=True)
    names = set()
    written = empty = 0
    for source in shard_paths(workdir):
        shard = impact_shards_dir(workdir) / source.name
        target = out / (source.stem + ".jsonl")
        names.add(target.name)
        stamp = {"scale": scale, "impact_marker": read_json(marker_path(shard))}
        marker = markers / (target.name + ".done.json")
        recorded = read_json(marker) if marker.exists() else {}
        if target.exists() and {k: v for k, v in recorded.items() if k != "empty"} == stamp:
            empty += int(recorded.get("empty", 0))
            continue
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")  # hidden: removed above if left over
        table = pq.read_table(shard)
        lines = vector_lines(table, scale)
        n_empty = sum(1 for w in table.column("weights").to_pylist() if not (quantise(np.asarray(w), scale) > 0).any())
        with open(tmp, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
        os.replace(tmp, target)
        write_json_atomic({**stamp, "empty": n_empty}, marker)
        written += 1
        empty += n_empty
    for stale in out.glob("*.jsonl"):
        if stale.name not in names:
            stale.unlink()
    return written, empty


def _directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def build_impact_index(workdir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
                       config: ImpactConfig | None = None, *, crash_once: str | None = None,
                       settings_source: str | None = None) -> dict:
    """The whole job: impact shards (Ray), the exactly-once check, JSON lines, the Lucene impact index
    with its metadata (``settings_source``: where top-k and β came from when not from flags or
    defaults, ``deployed_impact_settings``). Each step is skipped when its output is up to date.
    Returns a summary."""
    from ckray.lexical.bm25 import index_json_collection

    config = config or ImpactConfig()
    config.validate()
    checkpoint = Path(checkpoint) if checkpoint is not None else default_checkpoint(workdir)
    payload = check_ck_qti_checkpoint(checkpoint)
    summary = build_impact_shards(workdir, checkpoint, config, crash_once=crash_once)
    documents = verify_impact_shards(workdir)
    max_weight = corpus_max_weight(workdir)
    scale = config.scale or (config.quant_max / max_weight if max_weight > 0 else 1.0)
    summary["jsonl_written"], empty = write_jsonl_shards(workdir, scale)
    if empty:
        log.warning("%d document(s) have no term left after quantisation (empty text?); the Lucene index "
                    "leaves them out, so no query retrieves them", empty)
    index = impact_index_dir(workdir)
    meta = {
        "checkpoint": str(Path(checkpoint).resolve()), "checkpoint_sha256": summary["checkpoint_sha256"],
        **config.scoring_settings(), **{k: summary[k] for k in ("corpus_statistics",) if k in summary},
        "scale": scale, "quant_max": config.quant_max, "max_weight": max_weight,
        "documents": documents, "empty_vectors": empty, "term_prefix": TERM_PREFIX,
        "encoder": payload["config"].get("encoder"), "max_query_len": payload["config"].get("max_query_len"),
        "format": FORMAT_VERSION,
        "jsonl_sha256": _jsonl_digest(workdir),
    }
    if settings_source is not None:
        meta["settings_source"] = settings_source
    if _index_up_to_date(index, meta):
        log.info("impact index %s is up to date", index)
        summary["index_built"] = False
    else:
        t0 = time.perf_counter()
        index_json_collection(jsonl_dir(workdir), index, threads=config.index_threads, impact=True)
        write_json_atomic({**meta, **index_files_record(index, META_FILE, "jobs/build_impact_index.py")},
                          index / META_FILE)
        summary["index_built"] = True
        summary["index_seconds"] = time.perf_counter() - t0
        log.info("impact index of %d documents built in %.1fs (scale %.4g)", documents,
                 summary["index_seconds"], scale)
    summary.update(index_dir=str(index), scale=scale, total_documents=documents, empty_vectors=empty,
                   index_bytes=_directory_size(index))
    return summary


def _index_up_to_date(index: Path, meta: dict) -> bool:
    """Whether the Lucene index at ``index`` was built with ``meta`` and its files are those it recorded."""
    if not (index / META_FILE).exists():
        return False
    recorded = read_json(index / META_FILE)
    if {k: v for k, v in recorded.items() if k not in INDEX_FILES_KEYS} != meta:
        return False
    changed = index_files_changed(index, META_FILE) or []   # a stamp that records no files: as before
    if changed:
        log.warning("impact index %s: %s differ(s) from what was written (truncated or changed); rebuilding",
                    index, ", ".join(changed))
    return not changed


def _jsonl_digest(workdir: str | os.PathLike) -> str:
    """A digest of the JSON-line markers (each names its impact shard's marker and the scale)."""
    h = hashlib.sha256()
    for marker in sorted(jsonl_markers_dir(workdir).glob("*.done.json")):
        if (jsonl_dir(workdir) / marker.name[:-len(".done.json")]).exists():
            h.update(marker.name.encode())
            h.update(marker.read_bytes())
    return h.hexdigest()


def read_index_meta(index_dir: str | os.PathLike) -> dict:
    path = Path(index_dir) / META_FILE
    if not path.exists():
        raise MissingArtifactError(f"no CK-QTI impact index at {index_dir}: build it with "
                                   "jobs/build_impact_index.py --data DIR --workdir W --checkpoint CKPT")
    return read_json(path)
