"""Fixtures of the fault-injection suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> Path:
    from ckray.data.sample import generate_sample

    return generate_sample(tmp_path_factory.mktemp("fault-sample") / "data")
