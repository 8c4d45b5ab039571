"""Ray Serve application: retrieve (→ fuse) → rerank over HTTP, built from the offline pipeline's pieces.

Deployments (each replica is one Ray actor with its own resources and autoscaling settings)::

    SearchAPI (FastAPI ingress, DocStore for titles)
      ├──► retriever-<name>   one per first stage whose artifacts exist in the work directory
      │                       (``ckray.pipelines.build_retriever``: BM25 and CK-QTI hold one JVM per
      │                       replica, CLEAR a faiss index and its query tower); concurrent queries
      │                       with the same depth go to ``search`` together (``@serve.batch``)
      ├──  reciprocal-rank fusion of the retrievers' lists (in the ingress) when several are asked for
      └──► reranker-<name>    one per checkpoint ``W/checkpoints/<name>`` with ``name`` in
                              the ranker registry (``ckray.rankers``); ``@serve.batch`` pools the (query, doc)
                              pairs of concurrent requests into shared ``score_texts`` forward passes

Results equal the offline pipeline (``ckray.pipelines.build_pipeline(...).run``) for the same
queries: the retrievers are the same objects, searched to the same depth ``max(k, rerank_depth)``;
the reranker forms its pairs with ``ckray.rerank.rerank_pairs`` (a long document in the same windows)
and merges with ``ckray.rerank.best_passages`` and ``ckray.rerank.merge_scores``. First-stage scores are identical; a neural score can differ from the
offline one in its last float bits (a pair's padding depends on the pairs batched with it).
Several retrievers are fused by :func:`reciprocal_rank_fusion`; :class:`FusedRetriever` is the same
fusion as an offline ``Retriever``.

Deploy with ``serve run serve_config.yaml`` (builder :func:`build_app`), or from Python::

    serve.start(http_options={"host": "127.0.0.1", "port": 8123})
    serve.run(build_app({"workdir": "work/demo", "default_pipeline": "bm25"}), name="ckray")
"""

# No ``from __future__ import annotations`` here: FastAPI must see the route parameters' real types
# (under Serve's class-based ingress, string annotations turn the JSON body into a query parameter).
import asyncio
import copy
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field, field_validator
from ray import serve
from ray.serve.handle import DeploymentHandle

import swagger_ui_bundle

from ckray import __version__
from ckray import rankers as registry
from ckray.data.shards import check_index_files
from ckray.errors import CkrayError, ConfigError
from ckray.fusion import RRF_K, FusedRetriever, Hits, reciprocal_rank_fusion  # noqa: F401 (FusedRetriever: re-exported)
from ckray.pipelines import build_retriever, checkpoint_dir, is_interpolated, parse_pipeline, served_by_default

log = logging.getLogger(__name__)

MAX_K = 1000                 # results per request
MAX_RERANK_DEPTH = 1000      # documents rescored per request
MAX_QUERY_CHARS = 4096
MAX_RETRIEVERS = 8           # retrievers fused in one request
MAX_BODY_BYTES = 64 * 1024   # request bodies above this get 413
ATTEMPTS = 3                 # tries of a call to a deployment whose replica died (Serve restarts it)
READY_TIMEOUT_S = 2.0        # GET /readyz: how long each deployment may take to answer
WARM_UP_QUERY = "ready"      # searched / scored once by each replica before it takes traffic
DOCS_ASSETS = "/docs-assets"  # Swagger UI's JavaScript and CSS, served by the ingress itself


# ============================================================================ configuration

class RetrieverSpec(BaseModel):
    """A first stage to deploy: ``name`` is what requests ask for; ``retriever`` the registered first
    stage it builds (default: ``name``), with factory keyword ``options`` (e.g. BM25's k1, b)."""

    model_config = ConfigDict(extra="forbid")
    name: str
    retriever: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)

    @property
    def factory(self) -> str:
        return self.retriever or self.name


@dataclass
class RerankBatching:
    """How a reranker replica pools pairs (its deployment's ``user_config``, changeable live).

    A request's pairs join the current batch unless it would exceed ``max_batch_pairs``; a batch
    starts ``batch_wait_timeout_s`` after its first request (or when full) and runs as forward
    passes of ``forward_batch_size`` pairs, sorted by length. While one batch runs, the next fills:
    every request that arrives during a batch is in the next one, so no wait is needed for
    batching under load, and none is added to a lone request.
    """

    max_batch_pairs: int = 1024
    batch_wait_timeout_s: float = 0.0
    forward_batch_size: int = 16       # CPU: per-pair cost grows past ~16; raise it on GPUs
    torch_threads: int | None = None   # default: what Ray gives the actor (its num_cpus)
    bf16_on_gpu: bool = True           # autocast on a GPU (fp32 on CPU: equal to offline scores)

    def __post_init__(self) -> None:
        if self.max_batch_pairs < 1 or self.forward_batch_size < 1 or self.batch_wait_timeout_s < 0:
            raise ConfigError(f"invalid reranker batching {self}")


# Deployment options by kind, overridable per deployment name (AppArgs.deployments, or the
# ``deployments:`` section of serve_config.yaml). ``num_replicas`` replaces autoscaling.
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "ingress": {"ray_actor_options": {"num_cpus": 0.5}, "max_ongoing_requests": 256,
                "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}},
    "retriever": {"ray_actor_options": {"num_cpus": 1}, "max_ongoing_requests": 64,
                  "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 16}},
    "reranker": {"ray_actor_options": {"num_cpus": 1, "num_gpus": 0}, "max_ongoing_requests": 128,
                 "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 32}},
}
INGRESS = "SearchAPI"


def retriever_deployment_name(name: str) -> str:
    return f"retriever-{name}"


def reranker_deployment_name(name: str) -> str:
    return f"reranker-{name}"


class AppArgs(BaseModel):
    """Arguments of :func:`build_app` (the ``args:`` of an application in serve_config.yaml)."""

    model_config = ConfigDict(extra="forbid")
    workdir: str
    default_pipeline: str = "bm25"                    # what GET /search runs: "<first stage>[><reranker>]"
    retrievers: list[str | RetrieverSpec] | None = None   # None: every registered first stage whose artifacts exist
    rerankers: list[str] | None = None                # None: every registered reranker's checkpoint in W/checkpoints (not ablations)
    default_k: int = Field(10, ge=1, le=MAX_K)
    rerank_depth: int = Field(100, ge=1, le=MAX_RERANK_DEPTH)   # default depth (the offline default)
    rrf_k: int = Field(RRF_K, ge=1)
    batching: RerankBatching = Field(default_factory=RerankBatching)
    # options by deployment kind ("ingress", "retriever", "reranker") or name ("retriever-bm25", …);
    # unlike serve_config.yaml's own ``deployments:`` section, entries for deployments that are not
    # deployed (missing artifacts) are simply unused
    deployments: dict[str, dict[str, Any]] = Field(default_factory=dict)


def _is_present(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def _probe_retriever(factory: str, workdir: str, options: dict) -> str | None:
    """Build the retriever once in a throwaway Ray task; the reason it cannot be built, or None."""
    import ray

    @ray.remote(num_cpus=0)
    def probe() -> str | None:
        try:
            build_retriever(factory, workdir, **options)
            return None
        except Exception as e:  # noqa: BLE001 - any failure means "not deployable", with its reason
            return f"{type(e).__name__}: {e}"

    return ray.get(probe.remote())


def retriever_missing(spec: RetrieverSpec, workdir: str | os.PathLike) -> str | None:
    """Why ``spec`` cannot be served from ``workdir`` (a missing artifact), or None when it can."""
    known = registry.first_stages()
    if spec.factory not in known:
        return f"unknown retriever {spec.factory!r}; known: {', '.join(sorted(known))}"
    # the files its factory loads (a directory must be non-empty); a first stage that names none is
    # probed by building it once in a throwaway Ray task
    artifacts = known[spec.factory].artifacts
    if not artifacts:
        return _probe_retriever(spec.factory, str(workdir), spec.options)
    missing = [p for p in artifacts if not _is_present(Path(workdir) / p)]
    if missing:
        return f"missing {', '.join(str(Path(workdir) / p) for p in missing)}"
    try:   # an index whose stamp records its files: a damaged one is reported here, not by dying replicas
        for stamp in (Path(workdir) / f for f in known[spec.factory].stamp_files):
            if stamp.is_file():
                check_index_files(stamp.parent, stamp.name)
    except CkrayError as e:
        return str(e)
    return None


def reranker_missing(name: str, workdir: str | os.PathLike) -> str | None:
    if name not in registry.rerankers():
        return f"unknown reranker {name!r}; known: {', '.join(sorted(registry.rerankers()))}"
    path = checkpoint_dir(workdir, name)
    missing = [f for f in ("config.json", "model.safetensors") if not (path / f).is_file()]
    if missing:
        return f"no checkpoint at {path} (missing {', '.join(missing)})"
    from ckray.models.checkpoint import verify_checkpoint   # (torch: not imported by the ingress)

    try:   # damaged weights: reported here, not as replicas that die loading them
        verify_checkpoint(path)
    except CkrayError as e:
        return str(e)
    return None


def deployment_options(kind: str, name: str, overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Options of deployment ``name``: ``DEFAULT_OPTIONS[kind]``, then ``overrides[kind]`` (every
    deployment of that kind), then ``overrides[name]``. ``ray_actor_options`` and
    ``autoscaling_config`` merge key by key; ``num_replicas`` replaces autoscaling. Registered plug-in
    rankers reach the replicas as ``$CKRAY_RANKERS`` in their runtime environment."""
    opts = copy.deepcopy(DEFAULT_OPTIONS[kind])
    for layer in (overrides.get(kind, {}), overrides.get(name, {})):
        for key, value in copy.deepcopy(layer).items():
            if key in ("ray_actor_options", "autoscaling_config") and isinstance(value, dict) and key in opts:
                opts[key].update(value)
            else:
                opts[key] = value
            if key == "num_replicas":
                opts.pop("autoscaling_config", None)
            elif key == "autoscaling_config":
                opts.pop("num_replicas", None)
    if plugins := registry.plugin_modules():  # the replicas register the plug-in rankers this process has
        env = opts.setdefault("ray_actor_options", {}).setdefault("runtime_env", {}).setdefault("env_vars", {})
        env[registry.PLUGINS_ENV] = ",".join(plugins)
    return opts


# ============================================================================ retriever deployment

@serve.deployment
class RetrieverDeployment:
    """One first stage (``ckray.pipelines.build_retriever``); queries that arrive together are
    searched in one call (Lucene searches a batch with its own threads). Searches run on the
    replica's event loop, as the reranker's forward passes do (see ``RerankerDeployment``)."""

    def __init__(self, name: str, factory: str, workdir: str, options: dict[str, Any]):
        self.name = name
        self.retriever = build_retriever(factory, workdir, **options)
        self.retriever.search({"warm-up": WARM_UP_QUERY}, 1)  # JVM / index / query tower loaded before traffic

    async def ready(self) -> bool:
        """Answers once the replica is constructed and warmed up (``GET /readyz``)."""
        return True

    async def search(self, query: str, k: int) -> dict[str, Any]:
        """``{"hits": [(doc_id, score)], "ms": search time, "batch": queries searched together}``."""
        return await self._search_batch((query, k))

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0)
    async def _search_batch(self, items: list[tuple[str, int]]) -> list[dict[str, Any]]:
        return self._search_many(items)

    def _search_many(self, items: list[tuple[str, int]]) -> list[dict[str, Any]]:
        by_depth: dict[int, list[int]] = {}
        for i, (_, k) in enumerate(items):
            by_depth.setdefault(k, []).append(i)
        out: list[dict[str, Any]] = [{}] * len(items)
        for k, idx in by_depth.items():
            t0 = time.perf_counter()
            run = self.retriever.search({str(i): items[i][0] for i in idx}, k)
            ms = 1000 * (time.perf_counter() - t0)
            for i in idx:
                out[i] = {"hits": run[str(i)], "ms": ms, "batch": len(idx)}
        return out


# ============================================================================ reranker deployment

def _pair_count(items: list[list[tuple[str, str]]]) -> int:
    return sum(len(pairs) for pairs in items)


@serve.deployment
class RerankerDeployment:
    """A ``score_texts`` checkpoint (the model and doc-text lookup of ``ckray.pipelines.build_reranker``);
    pairs of concurrent requests share forward passes (``@serve.batch`` counted in pairs)."""

    def __init__(self, name: str, workdir: str):
        import torch

        from ckray.device import default_device
        from ckray.pipelines import build_reranker

        self.name = name
        reranker = build_reranker(name, workdir)  # the offline reranker: its model and doc-text lookup
        self.device = default_device()
        # a reranker without a score_texts model (ck-qti: stored impacts) reranks by itself, no batching
        self.lookup = None if hasattr(reranker, "model") else reranker
        self.model = reranker.model.to(self.device).eval() if self.lookup is None else None
        self.doc_text = reranker.doc_text
        self.windows = reranker.windows() if self.lookup is None else None   # a long document's windows, as offline
        self._torch = torch
        self.settings = RerankBatching()
        self.reconfigure({})
        self._warm_up()

    def _warm_up(self) -> None:
        """One forward pass before traffic: weights paged in, kernels chosen (a lookup reranker needs none)."""
        if self.lookup is not None:
            return
        self._score([(WARM_UP_QUERY, WARM_UP_QUERY)])

    async def ready(self) -> bool:
        """Answers once the replica is constructed and warmed up (``GET /readyz``)."""
        return True

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Apply :class:`RerankBatching` settings (the deployment's ``user_config``)."""
        self.settings = RerankBatching(**(user_config or {}))
        self._score_batch.set_max_batch_size(self.settings.max_batch_pairs)
        self._score_batch.set_batch_wait_timeout_s(self.settings.batch_wait_timeout_s)
        if self.settings.torch_threads:
            self._torch.set_num_threads(self.settings.torch_threads)

    async def rerank(self, query: str, hits: Hits, depth: int) -> dict[str, Any]:
        """The top ``depth`` of ``hits`` rescored, the rest after them (``merge_scores``), with the
        forward time and size of the batch(es) these pairs were scored in."""
        from ckray.rerank import best_passages, merge_scores, rerank_pairs

        t_in = time.perf_counter()
        run = {"q": list(hits)}
        if self.lookup is not None:
            merged = self.lookup.rerank({"q": query}, run, depth)["q"]
            ms = 1000 * (time.perf_counter() - t_in)
            return {"hits": merged, "ms": ms, "replica_ms": ms, "queue_ms": 0.0,
                    "batch_pairs": min(depth, len(run["q"])), "batch_requests": 1}
        rows = rerank_pairs({"q": query}, run, self.doc_text, depth, windows=self.windows)
        pairs = [(r["query"], r["doc"]) for r in rows]
        step = self.settings.max_batch_pairs
        parts = await asyncio.gather(*(self._score_batch(pairs[i:i + step]) for i in range(0, len(pairs), step)))
        scores = [s for part in parts for s in part["scores"]]
        scored = best_passages({("q", r["doc_id"], r["passage"]): s for r, s in zip(rows, scores)})
        merged = merge_scores(run, scored, depth)["q"]
        return {"hits": merged, "ms": sum(p["ms"] for p in parts), "replica_ms": 1000 * (time.perf_counter() - t_in),
                "queue_ms": max((1000 * (p["start"] - t_in) for p in parts), default=0.0),
                "batch_pairs": max((p["pairs"] for p in parts), default=0),
                "batch_requests": max((p["requests"] for p in parts), default=0)}

    @serve.batch(max_batch_size=1024, batch_wait_timeout_s=0.0, batch_size_fn=_pair_count)
    async def _score_batch(self, requests: list[list[tuple[str, str]]]) -> list[dict[str, Any]]:
        # The forward passes run on this event loop on purpose: Serve forms the next batch as soon
        # as its wait window closes and queues it behind the running one, so with the loop free
        # (model in a thread) batches stay as small as the window; with the loop busy, every request
        # that arrives during a pass is in the next batch (Serve's health checks use another loop).
        t0 = time.perf_counter()
        flat = [pair for pairs in requests for pair in pairs]
        scores = self._score(flat)
        ms = 1000 * (time.perf_counter() - t0)
        out, start = [], 0
        for pairs in requests:
            out.append({"scores": scores[start:start + len(pairs)], "ms": ms, "start": t0, "pairs": len(flat),
                        "requests": len(requests)})
            start += len(pairs)
        return out

    def _score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """Scores in input order; forward passes of ``forward_batch_size`` pairs of similar length."""
        torch = self._torch
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
        scores = [0.0] * len(pairs)
        size = self.settings.forward_batch_size
        autocast = self.device.type == "cuda" and self.settings.bf16_on_gpu
        with torch.inference_mode(), torch.autocast(device_type=self.device.type, dtype=torch.bfloat16,
                                                    enabled=autocast):
            for i in range(0, len(order), size):
                idx = order[i:i + size]
                s = self.model.score_texts([pairs[j][0] for j in idx], [pairs[j][1] for j in idx])
                for j, v in zip(idx, torch.as_tensor(s).float().tolist()):
                    scores[j] = v
        return scores


# ============================================================================ HTTP API

class SearchRequest(BaseModel):
    """Body of ``POST /search``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    query: str = Field(..., max_length=MAX_QUERY_CHARS, description="free-text query (not empty)")
    k: int = Field(10, ge=1, le=MAX_K, description="results to return")
    retrievers: list[str] = Field(default_factory=lambda: ["bm25"], min_length=1, max_length=MAX_RETRIEVERS,
                                  description="first stages; several are fused by reciprocal rank")
    reranker: str | None = Field(None, description="a reranker name (GET /healthz lists them); none: no reranking")
    rerank_depth: int | None = Field(None, ge=1, le=MAX_RERANK_DEPTH,
                                     description="first-stage documents the reranker rescores (default 100)")
    interpolate: bool = Field(False, description="add the first stage's score back: z(rerank) + w·z(first), "
                                                 "w tuned offline on dev queries (W/fusion; one retriever only)")

    @field_validator("query")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("query is empty or whitespace")
        return v

    @field_validator("retrievers")
    @classmethod
    def _distinct(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("retrievers must be distinct")
        return v


class Hit(BaseModel):
    rank: int
    doc_id: str
    score: float
    title: str


class SearchResponse(BaseModel):
    query: str
    retrievers: list[str]
    reranker: str | None
    k: int
    rerank_depth: int | None
    interpolation_weight: float | None = None
    results: list[Hit]
    timings_ms: dict[str, float] = Field(description="wall time per stage as seen by the ingress, "
                                                     "plus the retrievers' and reranker's own compute")
    batch: dict[str, int] = Field(description="how many queries / pairs / requests shared this request's passes")


class Document(BaseModel):
    doc_id: str
    title: str
    text: str


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` gets 413 (by Content-Length, or while
    reading a body without one); smaller bodies are passed on unchanged."""

    def __init__(self, app: Any, max_bytes: int = MAX_BODY_BYTES):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await self._reject(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._reject(scope, receive, send)
        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Any, send: Any) -> None:
        response = JSONResponse({"detail": f"request body over {self.max_bytes} bytes"}, status_code=413)
        await response(scope, receive, send)


api = FastAPI(title="ckray search", version=__version__, docs_url=None,
              description="First-stage retrieval (BM25, CK-QTI, CLEAR; several fused by reciprocal rank) "
                          "and neural reranking (CEDR, QDS-Transformer, CK) over one document collection.")
api.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)
# /docs renders offline: Swagger UI's assets come from the swagger-ui-bundle package, not a CDN
api.mount(DOCS_ASSETS, StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="docs-assets")


@api.get("/docs", include_in_schema=False)
async def _swagger_ui(request: Request) -> HTMLResponse:
    root = request.scope.get("root_path", "").rstrip("/")
    return get_swagger_ui_html(openapi_url=f"{root}{api.openapi_url}", title=f"{api.title} – API",
                               swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
                               swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon-32x32.png")


@api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    reasons = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
    return JSONResponse({"detail": reasons, "errors": _jsonable(exc.errors())}, status_code=422)


@api.exception_handler(Exception)
async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("%s %s failed", request.method, request.url.path)
    return JSONResponse({"detail": f"internal error: {type(exc).__name__}: {exc}"[:2000]}, status_code=500)


def _jsonable(errors: Sequence[dict]) -> list[dict]:
    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        v = v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
        return v[:200] + "…" if isinstance(v, str) and len(v) > 200 else v

    return [{k: plain(v) for k, v in e.items() if k not in ("ctx", "url")} for e in errors]


@serve.deployment
@serve.ingress(api)
class SearchAPI:
    """The HTTP ingress: validates requests, calls retriever and reranker deployments through their
    handles, fuses, attaches titles and timings."""

    def __init__(self, workdir: str, default_pipeline: str, retrievers: dict[str, DeploymentHandle],
                 rerankers: dict[str, DeploymentHandle], unavailable: dict[str, dict[str, str]],
                 default_k: int = 10,
                 rerank_depth: int = 100, rrf_k: int = RRF_K):
        from ckray.data.shards import DocStore

        self.docs = DocStore(workdir)
        self.retrievers, self.rerankers, self.unavailable = retrievers, rerankers, unavailable
        self.default_first, self.default_reranker = parse_pipeline(default_pipeline)
        self.default_interpolate = is_interpolated(default_pipeline)
        self.workdir = workdir
        self.default_pipeline, self.default_k = default_pipeline, default_k
        self.rerank_depth, self.rrf_k = rerank_depth, rrf_k

    @api.post("/search", response_model=SearchResponse, summary="search with any retrievers and reranker")
    async def search(self, body: SearchRequest) -> SearchResponse:
        return await self._search(body.query, body.k, body.retrievers, body.reranker, body.rerank_depth,
                                  body.interpolate)

    @api.get("/search", response_model=SearchResponse, summary="search with the default pipeline")
    async def search_default(self, q: str = Query(..., max_length=MAX_QUERY_CHARS, description="query"),
                             k: int | None = Query(None, ge=1, le=MAX_K, description="results (default 10)")
                             ) -> SearchResponse:
        if not q.strip():
            raise HTTPException(422, "q: query is empty or whitespace")
        return await self._search(q, k or self.default_k, [self.default_first], self.default_reranker, None,
                                  self.default_interpolate)

    @api.get("/documents/{doc_id:path}", response_model=Document, summary="one document's title and text")
    async def document(self, doc_id: str) -> Document:
        if doc_id not in self.docs:
            raise HTTPException(404, f"unknown document id {doc_id!r}")
        title, text = self.docs.get(doc_id)
        return Document(doc_id=doc_id, title=title, text=text)

    @api.get("/healthz", summary="liveness and what this deployment serves (readiness: /readyz)")
    async def healthz(self) -> dict[str, Any]:
        return {"status": "ok", "version": __version__, "documents": len(self.docs),
                "default_pipeline": self.default_pipeline, "retrievers": sorted(self.retrievers),
                "rerankers": sorted(self.rerankers), "unavailable": self.unavailable,
                "limits": {"k": MAX_K, "rerank_depth": MAX_RERANK_DEPTH, "body_bytes": MAX_BODY_BYTES,
                           "query_chars": MAX_QUERY_CHARS}}

    @api.get("/readyz", summary="readiness: 200 once every deployed retriever and reranker answers, else 503")
    async def readyz(self) -> JSONResponse:
        """Asks each deployed retriever and reranker (``ready``, answered by a constructed, warmed-up
        replica) with a short timeout; 503 lists those still starting. Wait for 200 before sending traffic."""
        deployments = {**{f"retriever {n}": h for n, h in self.retrievers.items()},
                       **{f"reranker {n}": h for n, h in self.rerankers.items()}}

        async def answers(handle: DeploymentHandle) -> bool:
            response = handle.ready.remote()
            try:
                return await asyncio.wait_for(response, READY_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a timeout, a replica starting or failing: not ready
                response.cancel()
                return False

        results = await asyncio.gather(*(answers(h) for h in deployments.values()))
        waiting = sorted(name for name, ok in zip(deployments, results) if not ok)
        body = {"status": "starting" if waiting else "ready", "waiting_for": waiting, "deployments": sorted(deployments)}
        return JSONResponse(body, status_code=503 if waiting else 200,
                            headers={"Retry-After": "2"} if waiting else None)

    # ------------------------------------------------------------------ the pipeline
    def _check(self, kind: str, name: str, deployed: dict[str, DeploymentHandle]) -> None:
        if name in deployed:
            return
        if name in self.unavailable.get(kind + "s", {}):
            raise HTTPException(400, f"{kind} {name!r} is not available here: {self.unavailable[kind + 's'][name]}")
        if name in (registry.first_stages() if kind == "retriever" else registry.rerankers()):
            raise HTTPException(400, f"{kind} {name!r} is not deployed in this application; available: "
                                     f"{', '.join(sorted(deployed)) or 'none'}")
        raise HTTPException(400, f"unknown {kind} {name!r}; available: {', '.join(sorted(deployed)) or 'none'}")

    def _interpolation_weight(self, retrievers: list[str], reranker: str | None) -> float:
        """The w of ``<first>+<reranker>`` tuned offline (``ckray.fusion``); 400 when it cannot apply."""
        from ckray.errors import MissingArtifactError
        from ckray.fusion import load_interpolation

        if reranker is None or len(retrievers) != 1:
            raise HTTPException(400, "interpolate needs exactly one retriever and a reranker")
        try:
            return load_interpolation(self.workdir, retrievers[0], reranker).weight
        except MissingArtifactError as e:
            raise HTTPException(400, f"interpolate: {e}") from None

    async def _search(self, query: str, k: int, retrievers: list[str], reranker: str | None,
                      rerank_depth: int | None, interpolate: bool = False) -> SearchResponse:
        t_start = time.perf_counter()
        for name in retrievers:
            self._check("retriever", name, self.retrievers)
        if reranker is not None:
            self._check("reranker", reranker, self.rerankers)
        weight = self._interpolation_weight(retrievers, reranker) if interpolate else None
        depth = (rerank_depth or self.rerank_depth) if reranker else None
        n = max(k, depth or 0)  # as Pipeline.run: the first stage feeds the reranker's depth
        timings: dict[str, float] = {}
        batch: dict[str, int] = {}

        async def retrieve(name: str) -> Hits:
            t0 = time.perf_counter()
            out = await self._call(f"retriever {name!r}", self.retrievers[name].search, query, n)
            timings[f"retrieve.{name}"] = 1000 * (time.perf_counter() - t0)
            timings[f"retrieve.{name}.search"] = out["ms"]
            batch[f"retrieve.{name}.queries"] = out["batch"]
            return out["hits"]

        t0 = time.perf_counter()
        lists = await asyncio.gather(*(retrieve(name) for name in retrievers))
        timings["retrieve"] = 1000 * (time.perf_counter() - t0)
        hits = lists[0]
        if len(lists) > 1:
            t0 = time.perf_counter()
            hits = reciprocal_rank_fusion(lists, n, self.rrf_k)
            timings["fusion"] = 1000 * (time.perf_counter() - t0)
        if reranker is not None:
            t0 = time.perf_counter()
            out = await self._call(f"reranker {reranker!r}", self.rerankers[reranker].rerank, query, hits, depth)
            timings["rerank"] = 1000 * (time.perf_counter() - t0)
            timings["rerank.forward"] = out["ms"]
            timings["rerank.replica"], timings["rerank.queue"] = out["replica_ms"], out["queue_ms"]
            batch["rerank.pairs"], batch["rerank.requests"] = out["batch_pairs"], out["batch_requests"]
            if weight is not None:
                from ckray.fusion import interpolate as add_first_stage

                hits = add_first_stage({"q": hits}, {"q": out["hits"]}, depth, weight)["q"]
            else:
                hits = out["hits"]
        results = [Hit(rank=i + 1, doc_id=d, score=s, title=self.docs.get(d)[0]) for i, (d, s) in enumerate(hits[:k])]
        timings["total"] = 1000 * (time.perf_counter() - t_start)
        return SearchResponse(query=query, retrievers=retrievers, reranker=reranker, k=k, rerank_depth=depth,
                              interpolation_weight=weight, results=results, timings_ms=timings, batch=batch)

    async def _call(self, what: str, method: Any, *args: Any) -> Any:
        """``await method.remote(*args)``, tried again when the replica died or is restarting
        (Serve starts a new one and routes the retry there) or its queue is full; 503 with
        ``Retry-After`` when it stays unavailable."""
        from ray.exceptions import RayActorError
        from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

        retryable = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, BackPressureError)
        for attempt in range(ATTEMPTS):
            try:
                return await method.remote(*args)
            except retryable as e:
                log.warning("%s failed (%s), attempt %d of %d", what, type(e).__name__, attempt + 1, ATTEMPTS)
                if attempt == ATTEMPTS - 1:
                    raise HTTPException(503, f"{what} is unavailable right now ({type(e).__name__}); retry shortly",
                                        headers={"Retry-After": "1"})
                await asyncio.sleep(0.25 * 2 ** attempt)


# ============================================================================ application builder

def build_app(args: AppArgs | dict[str, Any]) -> serve.Application:
    """The Serve application (``import_path: ckray.serve:build_app`` in serve_config.yaml).

    Deploys every requested first stage and reranker whose artifacts exist under ``args.workdir``
    (every registered first stage / reranker when not listed, ablations such as ``ck-qti-unpruned`` left
    out); the rest are reported as unavailable (GET /healthz, and 400 with the reason when a request
    names one). The default pipeline must be deployable. A relative ``workdir`` is taken from the
    current directory.
    """
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    workdir = str(Path(args.workdir).expanduser().resolve())
    specs = [RetrieverSpec(name=s) if isinstance(s, str) else s
             for s in (args.retrievers or list(registry.first_stages()))]
    reranker_names = (args.rerankers if args.rerankers is not None
                      else [r for r in registry.rerankers() if served_by_default(r)])
    unavailable: dict[str, dict[str, str]] = {"retrievers": {}, "rerankers": {}}
    retrievers, rerankers = {}, {}
    for spec in specs:
        if (reason := retriever_missing(spec, workdir)) is not None:
            unavailable["retrievers"][spec.name] = reason
            continue
        name = retriever_deployment_name(spec.name)
        retrievers[spec.name] = RetrieverDeployment.options(
            name=name, **deployment_options("retriever", name, args.deployments)).bind(
            spec.name, spec.factory, workdir, spec.options)
    for reranker in reranker_names:
        if (reason := reranker_missing(reranker, workdir)) is not None:
            unavailable["rerankers"][reranker] = reason
            continue
        name = reranker_deployment_name(reranker)
        rerankers[reranker] = RerankerDeployment.options(
            name=name, user_config=asdict(args.batching),
            **deployment_options("reranker", name, args.deployments)).bind(reranker, workdir)
    first, reranker = parse_pipeline(args.default_pipeline)
    for kind, name, deployed in (("retriever", first, retrievers), ("reranker", reranker, rerankers)):
        if name is not None and name not in deployed:
            reason = unavailable[kind + "s"].get(name, "not in the deployed list")
            raise ConfigError(f"default_pipeline {args.default_pipeline!r}: {kind} {name!r} cannot be served "
                              f"from {workdir}: {reason}")
    if is_interpolated(args.default_pipeline):
        from ckray.fusion import load_interpolation

        load_interpolation(workdir, first, reranker)  # a clear error now, not at the first request
    for kind, reasons in unavailable.items():
        for name, reason in reasons.items():
            log.info("not deploying %s %s: %s", kind[:-1], name, reason)
    return SearchAPI.options(name=INGRESS, **deployment_options("ingress", INGRESS, args.deployments)).bind(
        workdir, args.default_pipeline, retrievers, rerankers, unavailable,
        default_k=args.default_k, rerank_depth=args.rerank_depth, rrf_k=args.rrf_k)
