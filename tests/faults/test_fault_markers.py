"""Faults between runs: a shard or a checkpoint's weights truncated or overwritten after it was marked
complete is detected (size always, sha256 when the file changed after its marker), never read as whole."""

import os
from pathlib import Path

import pyarrow as pa
import pytest

from ckray.data.shards import file_sha256, is_done, mark_done, marker_path, read_json, write_parquet_atomic
from ckray.errors import MissingArtifactError
from faultkit import flip_byte

META = {"input_sha256": "abc"}


@pytest.fixture
def shard(tmp_path) -> Path:
    table = pa.table({"doc_id": [f"d{i}" for i in range(200)], "title": ["t"] * 200,
                      "text": [f"text number {i} " * 5 for i in range(200)]})
    path = write_parquet_atomic(table, tmp_path / "part-00000.parquet")
    mark_done(path, META)
    return path


def test_marker_records_rows_size_and_digest(shard):
    recorded = read_json(marker_path(shard))
    assert recorded == {**META, "rows": 200, "bytes": shard.stat().st_size, "sha256": file_sha256(shard)}
    assert is_done(shard, META)
    assert not is_done(shard, {"input_sha256": "other"})


def test_truncated_shard_is_not_done(shard):
    size = shard.stat().st_size
    os.truncate(shard, size - 10)
    assert not is_done(shard, META)


def test_same_size_corruption_with_intact_footer_is_not_done(shard):
    import pyarrow.parquet as pq

    flip_byte(shard, shard.stat().st_size // 3)  # a data page: the footer (row count) still reads
    assert pq.read_metadata(shard).num_rows == 200
    assert not is_done(shard, META)


def test_identical_rewrite_is_still_done(shard):
    data = shard.read_bytes()
    shard.write_bytes(data)  # newer than its marker, same bytes: the digest says it is whole
    assert shard.stat().st_mtime_ns >= marker_path(shard).stat().st_mtime_ns
    assert is_done(shard, META)


def test_missing_or_unreadable_marker_is_not_done(shard):
    marker_path(shard).write_text("{not json")
    assert not is_done(shard, META)
    marker_path(shard).unlink()
    assert not is_done(shard, META)


# ----------------------------------------------------------------------------- checkpoints

@pytest.fixture
def checkpoint(tmp_path) -> Path:
    import torch

    from ckray.models.checkpoint import save_model
    from ckray.rankers.cedr.model import CEDRConfig, CEDRRanker

    tiny = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=64)
    torch.manual_seed(0)
    model = CEDRRanker(CEDRConfig(variant="knrm", random_init=tiny, max_length=64, max_query_len=8, max_segments=1))
    return save_model(model, tmp_path / "ckpt")


def test_intact_checkpoint_loads(checkpoint):
    from ckray.models.checkpoint import load_model

    assert load_model(checkpoint).config.variant == "knrm"
    assert not [p for p in checkpoint.parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_truncated_weights_are_refused_with_the_path(checkpoint):
    from ckray.models.checkpoint import WEIGHTS_FILE, load_model

    weights = checkpoint / WEIGHTS_FILE
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(MissingArtifactError, match=rf"{checkpoint}.*truncated or corrupted"):
        load_model(checkpoint)


def test_corrupted_weights_are_refused_with_the_path(checkpoint):
    from ckray.models.checkpoint import WEIGHTS_FILE, load_model

    weights = checkpoint / WEIGHTS_FILE
    flip_byte(weights, weights.stat().st_size - 100)  # tensor bytes: safetensors itself would load them
    with pytest.raises(MissingArtifactError, match=rf"{checkpoint}.*sha256"):
        load_model(checkpoint)


def test_weights_with_a_broken_header_are_refused_with_the_path(checkpoint):
    from ckray.models.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_model

    weights = checkpoint / WEIGHTS_FILE
    flip_byte(weights, 10)  # inside the JSON header
    payload = read_json(checkpoint / CONFIG_FILE)
    payload.update(weights_sha256=file_sha256(weights))  # even when the record was rewritten to match
    (checkpoint / CONFIG_FILE).write_text(__import__("json").dumps(payload))
    with pytest.raises(MissingArtifactError, match=rf"{checkpoint}.*unreadable"):
        load_model(checkpoint)


@pytest.mark.parametrize("user", ["ray reranking", "an index job's digest"])
def test_a_damaged_checkpoint_is_refused_on_the_driver_before_any_actor_loads_it(checkpoint, user):
    """Ray reranking and the index jobs (which record the checkpoint's digest first) check the weights on
    the driver: a Ray actor that failed to load them would die in its creation and Ray would report a
    dead actor with its traceback, not the one line naming the checkpoint."""
    from ckray.models.checkpoint import WEIGHTS_FILE, checkpoint_digest
    from ckray.rerank import rerank

    weights = checkpoint / WEIGHTS_FILE
    flip_byte(weights, weights.stat().st_size - 100)
    with pytest.raises(MissingArtifactError, match=rf"checkpoint {checkpoint}: .*sha256"):
        if user == "ray reranking":
            rerank(checkpoint, {"q": "a query"}, {"q": [("d", 1.0)]}, {"d": "a document"}, depth=1)
        else:
            checkpoint_digest(checkpoint)
