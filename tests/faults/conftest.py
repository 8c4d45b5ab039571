"""Fixtures of the fault-injection suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from faultkit import assert_ok, evaluate_args, prepare_args, run_job


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> Path:
    from ckray.data.sample import generate_sample

    return generate_sample(tmp_path_factory.mktemp("fault-sample") / "data")


@pytest.fixture(scope="session")
def reference(sample_data, tmp_path_factory) -> Path:
    """A work directory made by jobs/prepare.py then jobs/evaluate.py, undisturbed (do not modify it)."""
    w = tmp_path_factory.mktemp("reference") / "w"
    assert_ok(run_job(prepare_args(sample_data, w)))
    assert_ok(run_job(evaluate_args(sample_data, w)))
    return w
