"""Zero-shot evaluation over several collections, BEIR-style: trained checkpoints applied to
collections they never saw, one table (a row per pipeline, a column per collection, the mean).

For each collection (``BenchmarkConfig.data``), in a work directory of its own under
``workdir_root``:

1. prepare it (``ckray.data.prepare.prepare_collection``: shards and BM25 index; idempotent);
2. link the checkpoints the pipelines need from ``checkpoints`` (a training work directory's
   ``W/checkpoints``) into ``<workdir>/checkpoints``;
3. build each first stage's index from them (the rankers' index stages, ``ckray.api.build_index``:
   CK-QTI's impact index with the collection's own IDF and mean length, CLEAR's dense index); a
   collection without training queries takes CLEAR's λ_test, each ``first+reranker``'s ``w`` and
   CK-QTI's top-k and β from the checkpoints' ``deploy.json`` (``ckray.deploy``), tuned where the
   models were trained; a collection with training queries tunes them on their dev split;
4. evaluate every pipeline on its ``split`` (``ckray.evaluation``; never tuned on it).

Then ``benchmark.md``, ``benchmark.json`` and ``benchmark.png`` (matplotlib) in ``workdir_root``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ckray.errors import ConfigError, MissingArtifactError
from ckray.fusion import DEFAULT_WEIGHT_RULE, HYBRID_NORMALIZATIONS, WEIGHT_RULES, check_weight_rule
from ckray.options import option
from ckray.rerank import DEFAULT_RERANK_PASSAGES
from ckray.windows import DEFAULT_WINDOW_CHOICE, WINDOW_CHOICES, check_window_choice

log = logging.getLogger(__name__)

RESULT_FILES = ("benchmark.md", "benchmark.json", "benchmark.png")


@dataclass
class BenchmarkConfig:
    """data: collection directories (each a column); checkpoints: the directory holding the trained
    checkpoints (``W/checkpoints`` of the training work directory); workdir_root: one work directory
    per collection under it, and the table. ``index_options``: per ranker, its index job's options
    (``{"ck-qti": {"top_k": 64}}``); ``lam`` / ``fusion_weight`` override the tuned or carried values."""

    data: list[str] = option(help="collection directory (repeatable: a column each)", flag="--data", metavar="DIR",
                             repeatable=True, default_factory=list)
    checkpoints: str | None = option(None, "directory of the trained checkpoints (a training W/checkpoints)")
    workdir_root: str = option("benchmark", "one work directory per collection under it, and the table")
    pipelines: list[str] = option(help="pipeline name (repeatable), e.g. bm25, ck-qti, clear, bm25+ck-qti "
                                       "(default: bm25)", flag="--pipeline", metavar="PIPELINE", repeatable=True,
                                  default_factory=lambda: ["bm25"])
    split: str = option("test", "qrels split evaluated in every collection")
    measure: str = option("nDCG@10", "measure of the table")
    k: int = option(1000, "results kept per query")
    rerank_depth: int = option(100, "first-stage results a reranker rescores")
    rerank_passages: int = option(DEFAULT_RERANK_PASSAGES, "windows of a long document a cross-encoder reranker "
                                  "reads (jobs/evaluate.py --rerank-passages): 0 every one, 1 the first")
    rerank_window_choice: str = option(DEFAULT_WINDOW_CHOICE, "which windows of a longer document a cross-encoder "
                                       "reads (jobs/evaluate.py --rerank-window-choice): query or first",
                                       choices=WINDOW_CHOICES)
    shards: int = option(4, "corpus shards per collection")
    index_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    lam: float | None = option(None, "CLEAR's λ_test instead of the carried one", flag="--lambda")
    hybrid_normalization: str | None = option(None, "scores CLEAR's λ_test is tuned on and applies to (default: "
                                                    "the dense index job's: what the checkpoint was trained for; a "
                                                    "carried λ of another one needs --lambda)",
                                              choices=HYBRID_NORMALIZATIONS)
    fusion_weight: float | None = option(None, "w of every first+reranker instead of the carried one")
    weight_rule: str = option(DEFAULT_WEIGHT_RULE, "how w is chosen on the training collection's dev queries "
                                                 "(jobs/evaluate.py --weight-rule)", choices=WEIGHT_RULES)

    def __post_init__(self) -> None:
        if not self.data:
            raise ConfigError.invalid("BenchmarkConfig", "data", "must name at least one collection")
        if not self.checkpoints:
            raise ConfigError.invalid("BenchmarkConfig", "checkpoints", "must name where the trained checkpoints "
                                      "are: --checkpoints DIR or --from-workdir W")
        if not self.pipelines:
            raise ConfigError.invalid("BenchmarkConfig", "pipelines", "must name at least one pipeline")
        check_weight_rule("BenchmarkConfig", self.weight_rule)
        check_window_choice("BenchmarkConfig", self.rerank_window_choice, "rerank_window_choice")
        for name in ("k", "rerank_depth", "shards"):
            if getattr(self, name) < 1:
                raise ConfigError.invalid("BenchmarkConfig", name, f"must be >= 1, got {getattr(self, name)}")
        from ckray.pipelines import parse_pipeline

        for name in self.pipelines:
            parse_pipeline(name)  # an unknown stage is an error before any work
        missing = [d for d in self.data if not Path(d).is_dir()]
        if missing:
            raise ConfigError.invalid("BenchmarkConfig", "data", f"no collection directory at {', '.join(missing)}")

    def collection_names(self) -> list[str]:
        """A column name per collection: its directory's name (``-2``, ``-3`` … for repeated names)."""
        names: list[str] = []
        for d in self.data:
            base = Path(d).resolve().name
            names.append(base if base not in names else f"{base}-{sum(n.startswith(base) for n in names) + 1}")
        return names


def needed_checkpoints(pipelines: list[str]) -> dict[str, list[str]]:
    """``{checkpoint name under W/checkpoints: [pipelines needing it]}``: the index of each first stage
    other than BM25 (its ranker's own checkpoint) and each reranker's checkpoint."""
    from ckray import rankers
    from ckray.pipelines import parse_pipeline

    owner = {fs: spec for spec in rankers.specs().values() for fs in spec.first_stages}
    need: dict[str, list[str]] = {}
    for name in pipelines:
        first, reranker = parse_pipeline(name)
        if owner[first].index is not None:
            need.setdefault(owner[first].name, []).append(name)
        if reranker is not None:
            need.setdefault(rankers.rerankers()[reranker], []).append(name)
    return need


def link_checkpoints(checkpoints: str | os.PathLike, workdir: str | os.PathLike, names: list[str]) -> None:
    """``<workdir>/checkpoints/<name>`` → ``<checkpoints>/<name>`` (a symbolic link; a link to elsewhere
    is replaced). A missing checkpoint, or a directory of another model in its place, is an error."""
    source_root, target_root = Path(checkpoints).resolve(), Path(workdir) / "checkpoints"
    for name in names:
        source, target = source_root / name, target_root / name
        if not (source / "config.json").exists():
            raise MissingArtifactError(f"no checkpoint {name!r} at {source}: train it first "
                                       f"(a pipeline needs it), or point --checkpoints elsewhere")
        if target.resolve() == source:
            continue
        if target.is_symlink():
            target.unlink()
        elif target.exists():
            raise ConfigError(f"{target} is a checkpoint of its own, not a link to {source}; "
                              f"use another --workdir-root or remove it")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source, target_is_directory=True)


def build_indexes(data: str, workdir: str | os.PathLike, pipelines: list[str],
                  index_options: dict[str, dict[str, Any]]) -> dict[str, dict]:
    """Each index the pipelines' first stages need (their rankers' index stages), from the linked
    checkpoints; returns each job's summary."""
    from ckray import api, rankers
    from ckray.pipelines import parse_pipeline

    owner = {fs: spec for spec in rankers.specs().values() for fs in spec.first_stages}
    summaries = {}
    for name in pipelines:
        spec = owner[parse_pipeline(name)[0]]
        if spec.index is None or spec.name in summaries:
            continue
        checkpoint = Path(workdir) / "checkpoints" / spec.name
        summaries[spec.name] = api.build_index(spec.name, data, workdir, checkpoint=str(checkpoint),
                                               **index_options.get(spec.name, {}))
    return summaries


def benchmark_collection(config: BenchmarkConfig, data: str, workdir: Path) -> dict[str, dict[str, float]]:
    """Prepare, link, index and evaluate one collection; ``{pipeline: metrics}``."""
    from ckray import api
    from ckray.data.prepare import prepare_collection

    log.info("benchmark: %s in %s", data, workdir)
    prepare_collection(data, workdir, shards=config.shards, split=None)
    link_checkpoints(config.checkpoints, workdir, list(needed_checkpoints(config.pipelines)))
    index_options = dict(config.index_options)
    if config.hybrid_normalization is not None:   # λ_test is tuned (first collection) on the scores it will apply to
        index_options["clear"] = {**index_options.get("clear", {}), "hybrid_normalization": config.hybrid_normalization}
    build_indexes(data, workdir, config.pipelines, index_options)
    return api.evaluate(config.pipelines, data, workdir, split=config.split, k=config.k,
                        rerank_depth=config.rerank_depth, lam=config.lam,
                        hybrid_normalization=config.hybrid_normalization, fusion_weight=config.fusion_weight,
                        weight_rule=config.weight_rule, rerank_passages=config.rerank_passages,
                        rerank_window_choice=config.rerank_window_choice)


def run_benchmark(config: BenchmarkConfig) -> dict:
    """Every collection, then the table files; returns the table (``benchmark.json``'s content)."""
    from ckray.ray_env import init_ray

    init_ray()
    root = Path(config.workdir_root)
    root.mkdir(parents=True, exist_ok=True)
    metrics = {}
    for data, name in zip(config.data, config.collection_names()):
        metrics[name] = benchmark_collection(config, data, root / name)
    table = benchmark_table(metrics, config.pipelines, config.measure)
    table["config"] = {k: v for k, v in asdict(config).items() if k != "index_options"} | {
        "index_options": config.index_options}
    table["settings"] = {name: _settings(root / name, config) for name in metrics}
    write_tables(table, root)
    return table


def _settings(workdir: Path, config: BenchmarkConfig) -> dict:
    """The deployment settings each pipeline ran with on a collection (``ckray.evaluation.settings_path``)."""
    from ckray.evaluation import settings_path

    out = {}
    for name in config.pipelines:
        path = settings_path(workdir, name, config.split)
        out[name] = json.loads(path.read_text())["settings"] if path.exists() else {}
    return out


def benchmark_table(metrics: dict[str, dict[str, dict[str, float]]], pipelines: list[str], measure: str) -> dict:
    """``{"measure", "collections", "pipelines", "rows": {pipeline: {collection: value, "mean": value}}}``; a measure
    no pipeline has is an error naming the ones there are."""
    collections = list(metrics)
    rows = {}
    for p in pipelines:
        values = {}
        for c in collections:
            got = metrics[c][p]
            if measure not in got:
                raise ConfigError(f"--measure {measure!r}: the evaluation has {', '.join(got)}")
            values[c] = float(got[measure])
        values["mean"] = sum(values.values()) / len(collections)
        rows[p] = values
    return {"measure": measure, "collections": collections, "pipelines": list(pipelines), "rows": rows}


def markdown_table(table: dict) -> str:
    """A row per pipeline, a column per collection and the mean; the best of each column in bold."""
    cols = table["collections"] + ["mean"]
    best = {c: max(r[c] for r in table["rows"].values()) for c in cols}
    lines = [f"| {table['measure']} | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for p in table["pipelines"]:
        row = table["rows"][p]
        cells = [f"**{row[c]:.3f}**" if row[c] == best[c] and len(table["rows"]) > 1 else f"{row[c]:.3f}"
                 for c in cols]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_tables(table: dict, root: Path) -> list[Path]:
    """``benchmark.md``, ``benchmark.json`` and ``benchmark.png`` (grouped bars) under ``root``."""
    from ckray.data.shards import write_json_atomic

    md, js, png = (root / f for f in RESULT_FILES)
    md.write_text(f"# Zero-shot {table['measure']}\n\n" + markdown_table(table))
    write_json_atomic(table, js)
    _chart(table, png)
    return [md, js, png]


def _chart(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = table["collections"] + ["mean"]
    rows = {p: table["rows"][p] for p in table["pipelines"]}  # the rows in the order asked (JSON sorts keys)
    width = 0.8 / max(1, len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cols) * max(1, len(rows)) / 2 + 2) + 2, 4))
    for i, (name, row) in enumerate(rows.items()):
        ax.bar([j + i * width for j in range(len(cols))], [row[c] for c in cols], width, label=name)
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(cols))], cols)
    ax.set_ylabel(table["measure"])
    ax.set_title(f"zero-shot {table['measure']}")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not over them
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
