"""The README's multi-line recipes run exactly as written, each in namespaces of its own (see
``conftest.run_isolated``): a user's terminal on a fresh machine, with nothing shared with this test
session's Ray."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ckray.data.sample import DEMO_SAMPLE, generate_sample

ROOT = Path(__file__).resolve().parents[1]


def readme_recipe(name: str) -> str:
    """The ```bash block that follows ``<!-- recipe: NAME -->`` in README.md."""
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"<!-- recipe: {re.escape(name)} -->\s*```bash\n(.*?)```", text, re.S)
    assert m, f"README.md has no ```bash block after <!-- recipe: {name} -->"
    return m.group(1)


def checkout_copy(dest: Path) -> Path:
    """The repository's tracked files (what a fresh clone has) at ``dest``, with this .venv linked in."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    return dest


def test_job_submit_recipe_is_in_the_readme():
    recipe = readme_recipe("ray job submit")
    lines = [line.split("#")[0].strip() for line in recipe.splitlines()]
    assert lines[0] == "source .venv/bin/activate"  # the head's jobs run this environment's `python`
    assert "export RAY_AUTH_MODE=token" in lines
    assert any(line.startswith("ray start --head") for line in lines) and lines[-1] == "ray stop"
    assert any(line.startswith("ray job logs") for line in lines)


@pytest.mark.slow
def test_ray_job_submit_recipe_as_written(tmp_path, isolated):
    """README's `ray job submit` recipe, line for line, from a copy of the checkout after `make demo`'s
    sample data exists: a fresh head with token auth, prepare and evaluate submitted with
    `--working-dir .` and absolute data/work paths, the job's log read back, the head stopped."""
    repo = checkout_copy(tmp_path / "repo")
    generate_sample(repo / "work" / "demo" / "sample-data", DEMO_SAMPLE)  # what `make demo` leaves there
    p = isolated("set -euo pipefail\n" + readme_recipe("ray job submit"), cwd=repo, timeout=900)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-5000:]
    assert out.count("succeeded") >= 2, out[-5000:]
    metrics = json.loads((repo / "work" / "jobs" / "metrics" / "bm25-test.json").read_text())
    assert 0.3 < metrics["nDCG@10"] <= 1.0
    assert "nDCG@10" in out.split("ray job logs")[-1]   # the job's own output, read back by `ray job logs`
    assert "Stopped all" in out                         # `ray stop` found the head it started
