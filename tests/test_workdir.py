"""The work directory's layout lives in ckray.workdir; every module's path helper agrees with it, and the
README documents it."""

from __future__ import annotations

import re
from pathlib import Path

from ckray.workdir import WorkDir

ROOT = Path(__file__).resolve().parents[1]


def test_module_path_helpers_are_the_layouts_paths(tmp_path):
    from ckray.data.docstore import store_dir
    from ckray.data.negatives import negatives_path, positives_path
    from ckray.data.shards import shards_dir
    from ckray.evaluation import metrics_path, run_path
    from ckray.fusion import fusion_path
    from ckray.lexical.bm25 import bm25_index_dir
    from ckray.pipelines import checkpoint_dir
    from ckray.rankers.ck_qti.impact import impact_index_dir
    from ckray.rankers.clear.layout import index_dir

    w = WorkDir(tmp_path)
    assert shards_dir(tmp_path) == w.shards == tmp_path / "shards"
    assert store_dir(tmp_path, {"any": "fingerprint"}).parent == w.docstore
    assert bm25_index_dir(tmp_path) == w.bm25_index
    assert negatives_path(tmp_path, "dev") == w.negatives("dev") == tmp_path / "negatives" / "dev.parquet"
    assert positives_path(tmp_path, "dev") == w.positives("dev")
    assert checkpoint_dir(tmp_path, "bm25>cedr-knrm".split(">")[1]) == w.checkpoint("cedr-knrm")
    assert run_path(tmp_path, "bm25", "test") == w.run("bm25", "test") == tmp_path / "runs" / "bm25-test.trec"
    assert metrics_path(tmp_path, "bm25", "test") == w.metrics("bm25", "test")
    assert fusion_path(tmp_path, "bm25", "qds") == w.fusion("bm25", "qds") == tmp_path / "fusion" / "bm25+qds.json"
    assert impact_index_dir(tmp_path).is_relative_to(w.ranker_dir("impact"))
    assert index_dir(tmp_path).is_relative_to(w.ranker_dir("dense"))


def test_training_runs_go_where_the_layout_says(tmp_path):
    from ckray.stages import parse_stage_args
    from ckray.train_job import training_config

    args = parse_stage_args("train:ck-qti", ["--data", "D", "--workdir", str(tmp_path)])
    config = training_config(args, "ck-qti")
    assert Path(config.output_dir) == WorkDir(tmp_path).checkpoint("ck-qti")
    assert Path(config.storage_dir) == WorkDir(tmp_path.resolve()).train_runs and config.run_name == "ck-qti"


def test_the_readme_documents_every_top_level_entry_of_the_layout():
    readme = (ROOT / "README.md").read_text()
    w = WorkDir("W")
    entries = [w.shards, w.docstore, w.bm25_index, w.negatives_dir, w.checkpoints, w.train_runs, w.fusion_dir,
               w.run("p", "s").parent, w.metrics("p", "s").parent, w.report, w.summary, w.sample_data]
    missing = [str(p) for p in entries if not re.search(r"\b" + re.escape(str(p)), readme)]
    assert missing == []
