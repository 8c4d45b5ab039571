"""SIGKILL of the driver of the training, impact-index and dense-index jobs at a seeded random point,
then the same command again: the job resumes from what was finished (the latest training checkpoint,
the output shards with a valid done-marker) and its outputs equal those of an uninterrupted run (impact
weights to float rounding, ``faultkit.same_impact_shards``)."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest

from faultkit import (assert_ok, dense_args, impact_args, kill_job_at, run_job, same_but_digests, same_files,
                      same_impact_lines, same_impact_shards, same_weights, train_args)

pytestmark = pytest.mark.slow

SEED = 2025
TINY_BERT = {"vocab_size": 30522, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 128}


def _copy(prepared: Path, root: Path) -> Path:
    """A copy of a prepared work directory (shards, document store, BM25 index, negatives)."""
    w = root / "w"
    shutil.copytree(prepared, w)
    return w


@pytest.fixture(scope="module")
def trained(reference, sample_data, tmp_path_factory) -> Path:
    """The tiny CK-QTI trained undisturbed on a copy of the reference work directory."""
    w = _copy(reference, tmp_path_factory.mktemp("trained"))
    assert_ok(run_job(train_args(sample_data, w)))
    return w


def _kill_at_random_step(args: list[str], steps: dict, rng: random.Random, log: Path, max_delay: float) -> str:
    step = rng.choice(sorted(steps))
    return kill_job_at(args, steps[step], rng, log, max_delay=max_delay)


def test_train_killed_then_rerun_resumes_from_its_latest_checkpoint_and_equals_an_uninterrupted_run(
        sample_data, reference, trained, tmp_path):
    w = _copy(reference, tmp_path)
    rng = random.Random(SEED)
    # killed after its first (step 2) or second (step 4) checkpoint was reported
    steps = {"after step 2": lambda out: "step 2 dev_ndcg@10" in out,
             "after step 4": lambda out: "step 4 dev_ndcg@10" in out}
    out = _kill_at_random_step(train_args(sample_data, w), steps, rng, tmp_path / "killed.log", max_delay=1.0)
    assert "done:" not in out and not (w / "checkpoints" / "ck-qti").exists()
    again = run_job(train_args(sample_data, w))
    assert_ok(again)
    resumed = re.search(r"resumed from step (\d+)", again.stdout + again.stderr)
    assert resumed, "the rerun started over instead of resuming:\n" + again.stdout[-3000:]
    assert int(resumed.group(1)) in (2, 4)
    mine, undisturbed = (json.loads((d / "checkpoints" / "ck-qti" / "train_summary.json").read_text())
                         for d in (w, trained))
    assert mine["steps"] == undisturbed["steps"] == 6
    assert mine["best_step"] == undisturbed["best_step"]
    # the chosen checkpoint is whole (load_model checks its size and digest) and, the loop being
    # deterministic on one worker (seeded data order, RNG state in every checkpoint), the same weights
    from ckray.models.checkpoint import load_model

    load_model(w / "checkpoints" / "ck-qti")
    assert len(same_weights(w / "checkpoints" / "ck-qti", trained / "checkpoints" / "ck-qti")) > 10


@pytest.fixture(scope="module")
def ck_checkpoint(reference, tmp_path_factory, minilm_path) -> Path:
    """A tiny CK-QTI with the sample corpus's IDF, saved untrained: the impact job only needs a valid one."""
    import torch

    from ckray.data.collections import doc_text
    from ckray.data.shards import load_corpus_table
    from ckray.models.checkpoint import save_model
    from ckray.rankers.ck_qti.model import CKModel, small_config

    corpus = load_corpus_table(reference)
    torch.manual_seed(0)
    model = CKModel(small_config(vocab_size=30522, max_doc_len=128)).eval()
    model.set_idf_from_texts(doc_text(a, b) for a, b in zip(corpus["title"].to_pylist(), corpus["text"].to_pylist()))
    return save_model(model, tmp_path_factory.mktemp("ck") / "ck-qti")


def test_impact_index_killed_then_rerun_equals_an_uninterrupted_run(sample_data, reference, ck_checkpoint, tmp_path):
    checkpoint = ck_checkpoint
    undisturbed, w = _copy(reference, tmp_path / "u"), _copy(reference, tmp_path / "k")
    assert_ok(run_job(impact_args(sample_data, undisturbed, checkpoint)))
    rng = random.Random(SEED + 1)
    steps = {"scoring": lambda out: "impact scoring 3 of 3 corpus shard(s)" in out,
             "a shard written": lambda out: "shards done)" in out}
    _kill_at_random_step(impact_args(sample_data, w, checkpoint), steps, rng, tmp_path / "killed.log", max_delay=1.0)
    again = run_job(impact_args(sample_data, w, checkpoint))
    assert_ok(again)
    todo = re.search(r"impact scoring (\d) of 3 corpus shard\(s\)", again.stdout + again.stderr)
    assert todo, again.stdout[-3000:]
    names = same_impact_shards(undisturbed, w)   # documents, terms and weights; markers
    assert {"part-00000.parquet", "part-00002.parquet.done.json"} <= set(names)
    same_impact_lines(undisturbed, w)
    meta = "impact/index/ckray_impact.json"
    assert same_but_digests(json.loads((undisturbed / meta).read_text()), json.loads((w / meta).read_text()))
    assert not list(w.rglob(".*tmp*")), "a temporary file was left behind"


@pytest.fixture(scope="module")
def clear_checkpoint(tmp_path_factory, minilm_path) -> Path:
    """A tiny CLEAR (2-layer BERT of width 32), saved untrained: the dense job only needs a valid one."""
    import torch

    from ckray.models.checkpoint import save_model
    from ckray.rankers.clear.model import CLEAR, CLEARConfig

    torch.manual_seed(0)
    model = CLEAR(CLEARConfig(encoder=minilm_path, pretrained=False, bert_config=dict(TINY_BERT), doc_max_len=64))
    return save_model(model, tmp_path_factory.mktemp("clear") / "clear")


def test_dense_index_killed_then_rerun_equals_an_uninterrupted_run(sample_data, reference, clear_checkpoint,
                                                                    tmp_path):
    undisturbed, w = _copy(reference, tmp_path / "u"), _copy(reference, tmp_path / "k")
    assert_ok(run_job(dense_args(sample_data, undisturbed, clear_checkpoint)))
    rng = random.Random(SEED + 2)
    steps = {"embedding": lambda out: "embedding 3 of 3 corpus shard(s)" in out,
             "a shard written": lambda out: "shards done)" in out}
    _kill_at_random_step(dense_args(sample_data, w, clear_checkpoint), steps, rng, tmp_path / "killed.log",
                         max_delay=1.0)
    again = run_job(dense_args(sample_data, w, clear_checkpoint))
    assert_ok(again)
    assert re.search(r"embedding \d of 3 corpus shard\(s\)", again.stdout + again.stderr), again.stdout[-3000:]
    names = same_files(undisturbed, w, "dense/shards/*")
    assert {"part-00000.parquet", "part-00002.parquet.done.json"} <= {Path(n).name for n in names}
    assert json.loads((w / "dense" / "hybrid.json").read_text()) == \
        json.loads((undisturbed / "dense" / "hybrid.json").read_text())
    assert not list(w.rglob(".*tmp*")), "a temporary file was left behind"
