"""Ray Data batch inference on an actor pool: the one mechanism behind the CK-QTI impact job
(``ckray.rankers.ck_qti.impact``), the CLEAR embedding job (``ckray.rankers.clear.embed``) and Ray reranking
(``ckray.rerank``).

Rows → ``Dataset.map_batches(<callable class>, compute=ActorPoolStrategy(size=actors))``
(:func:`map_on_actors`): each actor loads its model once, on a GPU of its own with ``use_gpu``, and
results stream back to the driver batch by batch.

**A lost actor.** Ray restarts it (``max_restarts``) and Ray Data retries the batch it was running
(``max_task_retries``). A retried batch can come back twice, so every result row is keyed — by a
document id, or a (query, document) pair — and collected in :class:`KeyedRows`: a repeated key is
dropped (the models are deterministic; the first copy is kept and counted in ``repeated_rows``), a key
that was not asked for is an error (the inputs changed during the job), and keys still missing when
the job ends are a :class:`BatchInferenceError` that names them (:func:`raise_if_missing`).

**Shard jobs** (:func:`run_shard_job`): one output shard per corpus shard ``W/shards/part-NNNNN.parquet``.
The shards not done yet (``ckray.data.shards.is_done`` against the job's stamp) are read with
``read_parquet(include_paths=True)`` and cut into blocks of one actor batch, so every actor of the pool
gets work, results stream back and a slow actor holds back at most one batch. Results come back in the
shards' order; the driver groups rows by their source shard (reading a shard's ids when its first row
arrives) and writes an output shard — rows in the corpus shard's order — with its done marker as soon as
all of its documents are in, so it holds one shard's results at a time, a re-run skips finished shards
and redoes half-written ones. An empty corpus shard gets an empty output shard without Ray.

**Timing.** Actors add per-row columns (:func:`timing_columns`): their share of the batch's wall and
process-CPU seconds, and the batch's completion time by the actor's clock. The driver sums the shares
(``actor_seconds``, ``actor_cpu_seconds``) and reports ``steady_docs_per_s`` (:func:`steady_rate`).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from ckray.data.shards import is_done
from ckray.errors import CkrayError, ConfigError

log = logging.getLogger(__name__)

SHOWN_MISSING = 5   # missing keys named per group in an error
# what Ray Data appends to the message of an exception raised in a map function
RAY_DATA_RETRY_NOTE = "\nFailed to apply UDF transform after "


class BatchInferenceError(CkrayError):
    """Batch inference returned a row nobody asked for, or ended with rows missing (named)."""


def ckray_cause(exc: BaseException | None, depth: int = 0) -> CkrayError | None:
    """The CkrayError a Ray task, actor or Train worker raised, out of Ray's wrappers (``RayTaskError``,
    Ray Data's ``UserCodeException``, Train's ``WorkerGroupError``): followed through ``cause``,
    ``__cause__``, ``__context__`` and a worker group's failures. None: no CkrayError in the chain."""
    if exc is None or depth > 8:
        return None
    if isinstance(exc, CkrayError):  # RayTaskError.as_instanceof_cause() is an instance of the cause's class too
        return exc.cause if isinstance(getattr(exc, "cause", None), CkrayError) else exc
    inner: list[BaseException | None] = [getattr(exc, "cause", None), exc.__cause__, exc.__context__,
                                         getattr(exc, "controller_failure", None)]
    inner += list(getattr(exc, "worker_failures", {}).values())
    for e in inner:
        found = ckray_cause(e, depth + 1)
        if found is not None:
            return found
    return None


@contextmanager
def ckray_errors_surfaced() -> Iterator[None]:
    """Around the driver's iteration over a Ray Data pipeline: a CkrayError raised in a task or actor
    (a missing checkpoint, a malformed row) is raised here as itself — its own type and message, which a
    job prints as one line with exit 2 — instead of inside Ray's wrappers and their tracebacks."""
    try:
        yield
    except Exception as exc:
        cause = ckray_cause(exc)
        if cause is None or cause is exc:
            raise
        message = cause.args[0] if cause.args and isinstance(cause.args[0], str) else None
        if message is not None and RAY_DATA_RETRY_NOTE in message:  # our one line, without Ray's note
            cause.args = (message[:message.index(RAY_DATA_RETRY_NOTE)], *cause.args[1:])
        raise cause from exc


# =============================================================================================
# The actor pool
# =============================================================================================

@dataclass
class ActorPoolConfig:
    """The actor pool of a batch-inference job (the jobs' configs extend it).

    actors:            size of the pool (each actor loads the model once).
    use_gpu:           ``gpus_per_actor`` GPUs per actor (default one GPU each).
    cpus_per_actor:    logical CPUs reserved per actor; also its torch threads on CPU.
    batch_size:        rows per Ray Data batch handed to an actor.
    max_restarts, max_task_retries: Ray fault tolerance (a lost actor is restarted and its batch
                       retried; the module docstring says what happens to the rows).
    gpus_per_actor:    with ``use_gpu``: e.g. 0.5 to place two actors on one GPU.
    resources_per_actor: custom Ray resources per actor, e.g. ``{"ckray_infer": 1}``: only the nodes that
                       advertise them (cluster.yaml's inference node type) take the actors.
    """

    actors: int = 1
    use_gpu: bool = False
    cpus_per_actor: float = 1.0
    batch_size: int = 64
    max_restarts: int = 4
    max_task_retries: int = 4
    gpus_per_actor: float = 1.0
    resources_per_actor: dict[str, float] = field(default_factory=dict)

    def pool_checks(self) -> list[tuple[bool, str]]:
        """(condition, message) pairs a config's ``validate`` raises on."""
        return [(self.actors >= 1, "actors must be >= 1"), (self.cpus_per_actor > 0, "cpus_per_actor must be > 0"),
                (self.batch_size >= 1, "batch_size must be >= 1"),
                (self.max_restarts >= 0 and self.max_task_retries >= 0, "max_restarts and max_task_retries must be >= 0"),
                (not self.use_gpu or self.gpus_per_actor > 0, "gpus_per_actor must be > 0"),
                (all(v >= 0 for v in self.resources_per_actor.values()), "resources_per_actor must be amounts >= 0"),
                (not {"CPU", "GPU"} & set(self.resources_per_actor),
                 "resources_per_actor must not name CPU or GPU (cpus_per_actor, use_gpu set those)")]

    @property
    def torch_threads(self) -> int:
        """Torch threads of a CPU actor: its reserved CPUs."""
        return max(1, int(self.cpus_per_actor))


def validate_checks(config: Any, checks: Iterable[tuple[bool, str]]) -> None:
    """Raise ``ConfigError("<Config>: <message>")`` for the first failed check."""
    for ok, msg in checks:
        if not ok:
            raise ConfigError(f"{type(config).__name__}: {msg}")


def map_on_actors(ds: Any, actor: type, constructor_kwargs: Mapping[str, Any], pool: ActorPoolConfig) -> Any:
    """``ds.map_batches(actor, ...)`` on an actor pool of ``pool.actors`` (numpy batches in); iterate the
    result within :func:`ckray_errors_surfaced`."""
    import ray
    import ray.data

    cpus = ray.cluster_resources().get("CPU", 0.0)
    if pool.actors * pool.cpus_per_actor >= cpus:
        log.warning("the actor pool takes %g of the cluster's %g CPUs, which leaves Ray Data's read tasks none: the "
                    "job waits until a node is added. Use fewer actors or CPUs per actor (--actors, --cpus-per-actor) "
                    "unless the cluster autoscales", pool.actors * pool.cpus_per_actor, cpus)
    remote: dict[str, Any] = {"num_cpus": pool.cpus_per_actor, "max_restarts": pool.max_restarts,
                              "max_task_retries": pool.max_task_retries}
    if pool.use_gpu:
        remote["num_gpus"] = pool.gpus_per_actor
    if pool.resources_per_actor:
        remote["resources"] = dict(pool.resources_per_actor)
    # Ray 2.60 has no named parameter for actor fault tolerance: max_restarts/max_task_retries go
    # through ray_remote_args, which warns that it is deprecated.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ray_remote_args.*deprecated")
        mapped = ds.map_batches(actor, fn_constructor_kwargs=dict(constructor_kwargs), batch_size=pool.batch_size,
                                batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=pool.actors), **remote)
    # an actor's own exception reaches the driver as such (not only as the text of Ray Data's
    # UserCodeException), so ckray_errors_surfaced can raise a CkrayError as itself
    mapped.context.raise_original_map_exception = True
    return mapped


def ensure_ray() -> None:
    """Use the running Ray cluster, or start a local one (``ckray.ray_env.init_ray``)."""
    from ckray.ray_env import init_ray

    init_ray()


# =============================================================================================
# Inside an actor
# =============================================================================================

def actor_device(use_gpu: bool, threads: int) -> Any:
    """The torch device of an actor's model: ``cuda`` when the pool gives it a GPU; on CPU it uses
    ``threads`` torch threads."""
    import torch

    if threads > 0 and not use_gpu:
        torch.set_num_threads(threads)
    return torch.device("cuda" if use_gpu else "cpu")


def crash_once(marker: str | None) -> None:
    """Fault injection for tests: when ``marker`` is set and does not exist yet, create it and end this
    process (the actor dies once, on its first batch; Ray restarts it and retries the batch)."""
    if marker and not os.path.exists(marker):
        Path(marker).touch()
        os._exit(1)


def timing_columns(rows: int, wall0: float, cpu0: float) -> dict[str, np.ndarray]:
    """Per-row share of a batch's wall (``_seconds``) and process-CPU (``_cpu_seconds``) time since
    ``wall0``/``cpu0`` (``time.perf_counter``/``time.process_time``), and its completion time ``_done_at``."""
    n = max(rows, 1)
    return {"_seconds": np.full(rows, (time.perf_counter() - wall0) / n),
            "_cpu_seconds": np.full(rows, (time.process_time() - cpu0) / n),
            "_done_at": np.full(rows, time.time())}


# =============================================================================================
# On the driver
# =============================================================================================

class KeyedRows:
    """Results of one group of inputs (a corpus shard, a rerank call), keyed by what was asked for.

    ``add`` keeps the first row of a key and returns False for a repeat (a retried batch); a key
    that was not asked for is a :class:`BatchInferenceError`. ``values()`` are in the order asked.
    """

    def __init__(self, expected: Iterable[Hashable], name: str):
        self.expected = list(expected)
        self.name = name
        self.rows: dict[Hashable, Any] = {}
        self._expected = set(self.expected)

    def add(self, key: Hashable, value: Any) -> bool:
        if key in self.rows:
            return False
        if key not in self._expected:
            raise BatchInferenceError(f"{self.name}: batch inference returned {key!r}, which it was not given; "
                                      "the inputs changed during the job, re-run it")
        self.rows[key] = value
        return True

    def complete(self) -> bool:
        return len(self.rows) == len(self._expected)

    def missing(self) -> list[Hashable]:
        return [k for k in dict.fromkeys(self.expected) if k not in self.rows]

    def values(self) -> list[Any]:
        return [self.rows[k] for k in self.expected]


def raise_if_missing(groups: Iterable[KeyedRows], what: str, hint: str) -> None:
    """A :class:`BatchInferenceError` naming the missing keys of every incomplete group, if any."""
    missing = {g.name: g.missing() for g in groups if not g.complete()}
    if not missing:
        return
    parts = [f"{name}: {len(keys)} ({', '.join(repr(k) for k in keys[:SHOWN_MISSING])}"
             f"{', …' if len(keys) > SHOWN_MISSING else ''})" for name, keys in missing.items()]
    raise BatchInferenceError(f"{what} ended with {sum(map(len, missing.values()))} result(s) missing — "
                              f"{'; '.join(parts)}; {hint}")


def steady_rate(completions: Sequence[tuple[float, int]]) -> float:
    """Rows completed after the first batch / time from the first to the last completion.

    ``completions`` are (completion time by the actor's clock, rows) per batch, so neither actor
    start-up and model loading nor the latency of handing results to the driver count; 0.0 with
    fewer than two batches.
    """
    if len(completions) < 2:
        return 0.0
    completions = sorted(completions)
    span = completions[-1][0] - completions[0][0]
    return sum(n for _, n in completions[1:]) / span if span > 0 else 0.0


def column(batch: Any, name: str) -> np.ndarray:
    """A column of a result batch (numpy dict or Arrow table) as a numpy array."""
    if isinstance(batch, pa.Table):
        return batch.column(name).to_numpy(zero_copy_only=False)
    return np.asarray(batch[name])


def _progress(total: int, enabled: bool, desc: str) -> Any:
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="doc", desc=desc, disable=not enabled)
    except ImportError:  # pragma: no cover
        class _Null:
            def update(self, n: int) -> None: ...
            def close(self) -> None: ...
        return _Null()


# =============================================================================================
# Shard jobs
# =============================================================================================

@dataclass
class ShardJob:
    """One shard-producing job (module docstring): ``actor`` maps batches of ``doc_id, title, text``
    (+ ``path``) rows to result rows that keep ``doc_id`` and ``path`` and add :func:`timing_columns`.

    what:          names the job in logs, errors and the progress bar ("embedding", "impact scoring").
    sources:       every corpus shard, in order; ``out_dir / source.name`` is its output shard.
    stamps:        source shard name → what its output's done marker must record (``is_done``).
    payloads:      a result batch → one value per row (what ``write`` gets for that document).
    write:         ``(output path, doc ids in the source's order, their values, stamp)`` → writes the
                   shard atomically, then its marker; called with no rows for an empty source.
    batch_format:  how result batches reach the driver: "numpy", or "pyarrow" for list columns.
    """

    what: str
    sources: Sequence[Path]
    out_dir: Path
    stamps: Mapping[str, dict]
    actor: type
    actor_kwargs: Mapping[str, Any]
    pool: ActorPoolConfig
    payloads: Callable[[Any], Sequence[Any]]
    write: Callable[[Path, list[str], list[Any], dict], None]
    batch_format: str = "numpy"
    progress: bool = False


def run_shard_job(job: ShardJob) -> dict:
    """Run ``job`` over its shards not done yet; returns a summary.

    ``documents`` (processed now), ``shards_written``, ``shards_skipped``, ``repeated_rows`` (rows of
    retried batches dropped), ``batches``, ``seconds`` (whole job: actor start, model load, inference,
    writing), ``docs_per_s``, ``steady_docs_per_s`` (after the first batch, by the actors' clocks),
    ``actor_seconds`` / ``actor_cpu_seconds`` (wall / process-CPU time inside the actors' batch calls,
    summed over actors).
    """
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(".part-*.tmp-*"):  # leftovers of an interrupted write
        stale.unlink(missing_ok=True)
    todo = [s for s in job.sources if not is_done(out_dir / s.name, job.stamps[s.name])]
    summary = {"documents": 0, "shards_written": 0, "shards_skipped": len(job.sources) - len(todo),
               "repeated_rows": 0, "batches": 0, "seconds": 0.0, "docs_per_s": 0.0, "steady_docs_per_s": 0.0,
               "actor_seconds": 0.0, "actor_cpu_seconds": 0.0}
    log.info("%s %d of %d corpus shard(s) into %s (%d already done)", job.what, len(todo), len(job.sources),
             out_dir, summary["shards_skipped"])
    t0 = time.perf_counter()
    pending = []
    for source in todo:
        if pq.read_metadata(source).num_rows == 0:
            job.write(out_dir / source.name, [], [], job.stamps[source.name])
            summary["shards_written"] += 1
        else:
            pending.append(source)
    if pending:
        _stream(job, pending, summary)
    end = time.perf_counter()
    summary.update(seconds=end - t0, docs_per_s=summary["documents"] / max(end - t0, 1e-9))
    if pending:
        log.info("%s: %d documents in %.1fs (%.1f docs/s; %.1f docs/s after the first batch)", job.what,
                 summary["documents"], summary["seconds"], summary["docs_per_s"], summary["steady_docs_per_s"])
    return summary


def _stream(job: ShardJob, pending: Sequence[Path], summary: dict) -> None:
    """Map the pending shards on the actor pool; write each output shard once all its rows are in.

    The rows come back in the shards' order (``preserve_order``), and a shard's ids are read only when its
    first result arrives, so the driver holds the ids and results of the shard being completed (two where a
    batch straddles a boundary), never the corpus's: ``max_open_shards`` in the summary says how many it held.
    """
    ensure_ray()
    import ray.data

    ds = ray.data.read_parquet([str(s) for s in pending], include_paths=True, columns=["doc_id", "title", "text"])
    ds = ds.repartition(target_num_rows_per_block=job.pool.batch_size)
    ds = map_on_actors(ds, job.actor, job.actor_kwargs, job.pool)
    ds.context.execution_options.preserve_order = True
    shards = ShardGroups(pending)
    bar = _progress(sum(pq.read_metadata(s).num_rows for s in pending), job.progress, job.what)
    with ckray_errors_surfaced():
        _collect(job, ds, shards, summary, bar)
    bar.close()
    summary["max_open_shards"] = shards.max_open
    raise_if_missing(shards.unfinished(), job.what, "re-run it (finished shards are kept)")
    if summary["repeated_rows"]:
        log.warning("%s: dropped %d repeated rows (batches retried after a lost actor)", job.what,
                    summary["repeated_rows"])


class ShardGroups:
    """The :class:`KeyedRows` of the shards a job is reading, opened (the shard's ids read) on the shard's first
    result row and closed when its output is written."""

    def __init__(self, pending: Sequence[Path]):
        self.paths = {p.name: p for p in pending}
        self.open: dict[str, KeyedRows] = {}
        self.written: set[str] = set()
        self.max_open = 0

    def group(self, name: str) -> KeyedRows | None:
        """The open group of shard ``name`` (opened now if need be), or None for a shard already written."""
        if name in self.written:
            return None
        if name not in self.open:
            if name not in self.paths:
                raise KeyError(name)
            self.open[name] = self._rows_of(name)
            self.max_open = max(self.max_open, len(self.open))
        return self.open[name]

    def close(self, name: str) -> KeyedRows:
        self.written.add(name)
        return self.open.pop(name)

    def unfinished(self) -> list[KeyedRows]:
        """Every shard not written: the open ones, and those no row of which came back."""
        return [self.open.get(n) or self._rows_of(n) for n in self.paths if n not in self.written]

    def _rows_of(self, name: str) -> KeyedRows:
        """An empty group expecting the ids of shard ``name``, in its order."""
        return KeyedRows(pq.read_table(self.paths[name], columns=["doc_id"]).column(0).to_pylist(), name)


def _collect(job: ShardJob, ds: Any, shards: ShardGroups, summary: dict, bar: Any) -> None:
    """Take the result batches as they come; write each output shard once all its rows are in."""
    completions: list[tuple[float, int]] = []
    for batch in ds.iter_batches(batch_size=None, batch_format=job.batch_format):
        doc_ids, paths = column(batch, "doc_id"), column(batch, "path")
        touched = set()
        for doc_id, path, value in zip(doc_ids, paths, job.payloads(batch)):
            name = Path(str(path)).name
            try:
                group = shards.group(name)
            except KeyError:
                raise BatchInferenceError(f"{job.what}: a row of {path}, which the job did not read") from None
            if group is not None and group.add(str(doc_id), value):
                summary["documents"] += 1
                touched.add(name)
            else:  # a repeat from a retried batch
                summary["repeated_rows"] += 1
        summary["batches"] += 1
        summary["actor_seconds"] += float(np.sum(column(batch, "_seconds")))
        summary["actor_cpu_seconds"] += float(np.sum(column(batch, "_cpu_seconds")))
        done_at = column(batch, "_done_at")
        completions += [(float(t), int(np.sum(done_at == t))) for t in np.unique(done_at)]
        for name in sorted(touched):
            if shards.open[name].complete():
                group = shards.close(name)
                job.write(job.out_dir / name, [str(d) for d in group.expected], group.values(), job.stamps[name])
                summary["shards_written"] += 1
                log.info("%s %s: %d documents (%d/%d shards done)", job.what, name, len(group.expected),
                         summary["shards_skipped"] + summary["shards_written"], len(job.sources))
        bar.update(len(doc_ids))
    summary["steady_docs_per_s"] = steady_rate(completions)
