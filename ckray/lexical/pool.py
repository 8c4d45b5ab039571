"""First-stage search of many queries on a pool of Ray actors, each holding its own retriever.

A retriever (:class:`ckray.lexical.bm25.BM25Searcher`: one JVM, a Lucene searcher, ``threads`` search
threads) answers a batch of queries in one process. For hundreds of thousands of queries (BM25
negatives of MS MARCO's 503 k training queries, evaluation of a training split) one process is the
bottleneck, so the queries are cut into chunks and each chunk goes to whichever of N actors is free.
Results come back in the order of the chunks, so a caller can write them out as they arrive
(``build_negatives`` streams them into one Parquet file) without holding every result at once.

Every actor builds its retriever with the same ``factory`` (a picklable callable, e.g.
``functools.partial(bm25_retriever, workdir)``) over the same index, and a query's hits do not
depend on which other queries share its batch, so the run equals one searcher's.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ckray.errors import ConfigError

log = logging.getLogger(__name__)

Run = dict[str, list[tuple[str, float]]]

CHUNK_QUERIES = 256          # queries per actor call: large enough for the threads, small enough to stream
HELD_PER_ACTOR = 2           # finished results per actor that may wait for an earlier, slower one
POOL_MIN_QUERIES = 2000      # below this a pool's start-up (one JVM per actor) costs more than it saves


def default_actors(cpus_per_actor: float, n_chunks: int) -> int:
    """As many actors as the cluster's CPUs hold at ``cpus_per_actor`` each (at least one), and no more
    than there are chunks to search. Starts (or connects to) Ray."""
    import ray

    from ckray.ray_env import init_ray

    init_ray()
    cpus = float(ray.cluster_resources().get("CPU", 1))
    return max(1, min(int(cpus // max(cpus_per_actor, 1e-9)), n_chunks))


def _actor_class():
    import ray

    @ray.remote
    class SearchActor:
        """One retriever in its own process (its own JVM for Lucene)."""

        def __init__(self, factory: Callable[[], Any]):
            self.retriever = factory()

        def call(self, fn: Callable[..., Any], *args: Any) -> Any:
            return fn(self.retriever, *args)

        def pid(self) -> int:
            return os.getpid()

    return SearchActor


class SearcherPool:
    """``actors`` Ray actors, each with ``factory()``'s retriever; :meth:`map` runs a function on them.

    ``cpus_per_actor`` is what each actor reserves (a Lucene searcher with ``threads`` threads keeps as
    many cores busy). Use as a context manager, or call :meth:`close`, to end the actors."""

    def __init__(self, factory: Callable[[], Any], actors: int, cpus_per_actor: float = 1.0):
        if actors < 1:
            raise ConfigError(f"a searcher pool needs at least one actor, got actors={actors}")
        import ray

        from ckray.ray_env import init_ray

        init_ray()
        total = float(ray.cluster_resources().get("CPU", 1))
        cls = _actor_class().options(num_cpus=min(cpus_per_actor, total))
        self.actors = [cls.remote(factory) for _ in range(actors)]
        ray.get([a.pid.remote() for a in self.actors])  # a retriever that cannot start fails here, by name

    def map(self, fn: Callable[..., Any], items: Iterable[tuple]) -> Iterator[Any]:
        """``fn(retriever, *item)`` for each item, an item at a time on whichever actor is free; results
        in the order of ``items``. At most :data:`HELD_PER_ACTOR` finished results per actor wait
        for an earlier one; beyond that no new item starts."""
        import ray

        pending, end = iter(items), object()
        idle = deque(self.actors)
        running: dict = {}    # ObjectRef → (index, actor)
        finished: dict = {}   # index → ObjectRef of a result that waits for an earlier one
        submitted = emitted = 0
        exhausted = False
        while True:
            while idle and not exhausted and len(finished) < HELD_PER_ACTOR * len(self.actors):
                item = next(pending, end)
                if item is end:
                    exhausted = True
                    break
                actor = idle.popleft()
                running[actor.call.remote(fn, *item)] = (submitted, actor)
                submitted += 1
            if not running:
                return
            [ref], _ = ray.wait(list(running), num_returns=1)
            index, actor = running.pop(ref)
            idle.append(actor)
            finished[index] = ref
            while emitted in finished:
                yield ray.get(finished.pop(emitted))
                emitted += 1

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
        self.actors = []

    def __enter__(self) -> "SearcherPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def chunks(qids: list[str], size: int | None = None) -> list[list[str]]:
    """``qids`` cut into consecutive pieces of at most ``size`` (None: :data:`CHUNK_QUERIES`)."""
    size = size or CHUNK_QUERIES
    if size < 1:
        raise ConfigError(f"chunk size must be >= 1, got {size}")
    return [qids[i:i + size] for i in range(0, len(qids), size)]


def _search(retriever: Any, queries: dict[str, str], k: int) -> Run:
    return retriever.search(queries, k=k)


def iter_search(factory: Callable[[], Any], queries: dict[str, str], k: int, actors: int | None = None,
                cpus_per_actor: float = 1.0, chunk: int | None = None) -> Iterator[Run]:
    """The run of ``queries`` in pieces of ``chunk`` queries (None: :data:`CHUNK_QUERIES`; in the order
    of ``queries``), searched on ``actors`` actors (None: :func:`default_actors`)."""
    pieces = chunks(list(queries), chunk)
    if not pieces:
        return
    n = actors or default_actors(cpus_per_actor, len(pieces))
    with SearcherPool(factory, n, cpus_per_actor) as pool:
        yield from pool.map(_search, (({q: queries[q] for q in piece}, k) for piece in pieces))


def search_many(factory: Callable[[], Any], queries: dict[str, str], k: int, actors: int | None = None,
                cpus_per_actor: float = 1.0, chunk: int | None = None) -> Run:
    """The run of ``queries`` (top ``k`` each), searched on a pool of actors: equal to
    ``factory().search(queries, k)``."""
    run: Run = {}
    for part in iter_search(factory, queries, k, actors, cpus_per_actor, chunk):
        run.update(part)
    return run


class PooledRetriever:
    """A retriever (``search(queries, k) -> run``) that searches on a pool of ``actors`` actors, each
    built with ``factory``; the pool lives for one call."""

    def __init__(self, factory: Callable[[], Any], actors: int | None = None, cpus_per_actor: float = 1.0):
        self.factory, self.actors, self.cpus_per_actor = factory, actors, cpus_per_actor

    def search(self, queries: dict[str, str], k: int = 1000) -> Run:
        return search_many(self.factory, queries, k, self.actors, self.cpus_per_actor)
