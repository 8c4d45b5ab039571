"""cluster.yaml against Ray's own schema, and real local autoscaling on the fake multi-node provider."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from ckray.cluster import (
    DEFAULT_CLUSTER_YAML,
    FAKE_HEAD_NODE_TYPE,
    INFER_RESOURCE,
    TRAIN_RESOURCE,
    _cluster_pids,
    _is_zombie,
    _stop_cluster,
    load_cluster_config,
    local_autoscaling_head,
    local_fake_config,
    validate_cluster_config,
)
from ckray.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = ROOT / "cluster.yaml"


@pytest.fixture(scope="module")
def cluster_cfg() -> dict:
    return load_cluster_config(CLUSTER_YAML)


def _worker_types(cfg: dict) -> dict:
    return {k: v for k, v in cfg["available_node_types"].items() if k != cfg["head_node_type"]}


def _type_with(cfg: dict, resource: str) -> tuple[str, dict]:
    found = [(k, v) for k, v in _worker_types(cfg).items() if resource in v.get("resources", {})]
    assert len(found) == 1, f"exactly one worker type should advertise {resource}: {found}"
    return found[0]


# --------------------------------------------------------------------------- cluster.yaml


def test_default_path_is_the_repo_cluster_yaml():
    assert DEFAULT_CLUSTER_YAML == CLUSTER_YAML and CLUSTER_YAML.exists()


def test_cluster_yaml_passes_rays_schema_and_validation(cluster_cfg):
    prepared = validate_cluster_config(cluster_cfg, where=str(CLUSTER_YAML))
    # the AWS defaults merged in the way `ray up` does; our commands survived it
    assert prepared["provider"]["type"] == "aws"
    assert prepared["head_node_type"] in prepared["available_node_types"]
    assert prepared["head_setup_commands"] == cluster_cfg["setup_commands"] + cluster_cfg["head_setup_commands"]
    assert prepared["auth"]["ssh_user"] == "ubuntu" and "head_node" not in prepared
    # Cross-check of ckray's preparation (public API only) against Ray's own, which `ray up` runs: the
    # same config, and Ray's validation accepts it. Only this test reaches into Ray's private module.
    from ray.autoscaler._private.util import prepare_config, validate_config
    assert prepared == prepare_config(copy.deepcopy(cluster_cfg))
    validate_config(prepared)


def test_cluster_yaml_node_types(cluster_cfg):
    head = cluster_cfg["available_node_types"][cluster_cfg["head_node_type"]]
    head_res = head.get("resources", {})
    assert head_res.get("GPU", 0) == 0, "the head is a CPU node"
    assert TRAIN_RESOURCE not in head_res and INFER_RESOURCE not in head_res, \
        "no training/inference worker may land on the head"
    assert head.get("max_workers", 0) == 0

    train_name, train = _type_with(cluster_cfg, TRAIN_RESOURCE)
    infer_name, infer = _type_with(cluster_cfg, INFER_RESOURCE)
    assert train_name != infer_name
    # One unit of the custom resource per GPU: a worker asks for {"GPU": 1, "ckray_*": 1}.
    assert train["resources"]["GPU"] >= 4 and train["resources"][TRAIN_RESOURCE] == train["resources"]["GPU"]
    assert infer["resources"]["GPU"] >= 1 and infer["resources"][INFER_RESOURCE] == infer["resources"]["GPU"]
    assert train["node_config"]["InstanceType"].startswith(("g5.", "g6.", "p4", "p5"))
    assert infer["node_config"]["InstanceType"].startswith(("g5.", "g6.", "g4dn."))
    for spec in (train, infer):
        assert spec["min_workers"] == 0 and 1 <= spec["max_workers"] <= cluster_cfg["max_workers"]
    assert 0 < cluster_cfg["idle_timeout_minutes"] <= 30


def test_cluster_yaml_installs_the_project(cluster_cfg):
    cmds = cluster_cfg["setup_commands"]
    torch_at = next(i for i, c in enumerate(cmds) if "install" in c and "torch" in c)
    project_at = next(i for i, c in enumerate(cmds) if "pip install -e" in c and "[gpu]" in c)
    assert torch_at < project_at, "torch must be installed before the project"
    assert "." in cluster_cfg["file_mounts"].values(), "the project directory is mounted"
    assert any("~/ckray" in c for c in cmds), "the project is installed from its mount"


# --------------------------------------------------------------------------- broken configs


def _broken(cfg: dict, edit) -> dict:
    cfg = copy.deepcopy(cfg)
    edit(cfg)
    return cfg


BROKEN = {
    "missing head_node_type": (lambda c: c.pop("head_node_type"), "head_node_type is required"),
    "head_node_type of the wrong type": (lambda c: c.update(head_node_type=3),
                                         "head_node_type: 3 is not of type 'string'"),
    "head_node_type naming no node type": (lambda c: c.update(head_node_type="ray.head.gpu"),
                                           "'ray.head.gpu' is not one of available_node_types"),
    "fractional GPU count": (
        lambda c: c["available_node_types"]["ray.worker.train_gpu"]["resources"].update(GPU=0.5),
        "available_node_types.ray.worker.train_gpu.resources.GPU: 0.5 is not of type 'integer'"),
    "misspelt top-level field": (lambda c: c.update(idle_timeout_minute=5),
                                 "'idle_timeout_minute' was unexpected"),
    "missing provider": (lambda c: c.pop("provider"), "'provider' is a required property"),
    "min_workers above max_workers": (
        lambda c: c["available_node_types"]["ray.worker.infer_gpu"].update(min_workers=9),
        "ray.worker.infer_gpu: min_workers (9) > max_workers (8)"),
    "global max_workers below the sum of min_workers": (  # checked as Ray's autoscaler checks it
        lambda c: (c["available_node_types"]["ray.worker.train_gpu"].update(min_workers=3),
                   c.update(max_workers=2)),
        "max_workers` is smaller than the sum of `min_workers`"),
    "unknown provider type": (lambda c: c["provider"].update(type="ec2"),
                              "Unsupported node provider: ec2"),
    "an on-premise provider": (lambda c: c["provider"].update(type="local"),
                               "provider.type: 'local' clusters are not autoscaled cloud clusters"),
    "a docker image without a container name": (lambda c: c["docker"].pop("container_name"),
                                                "docker: container_name and an image"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_config_is_rejected_with_a_clear_message(cluster_cfg, case):
    edit, expected = BROKEN[case]
    with pytest.raises(ConfigError) as err:
        validate_cluster_config(_broken(cluster_cfg, edit), where="cluster.yaml")
    assert str(err.value).startswith("cluster.yaml: ")
    assert expected in str(err.value)


def test_load_cluster_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_cluster_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="YAML mapping"):
        load_cluster_config(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("cluster_name: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_cluster_config(tmp_path / "bad.yaml")


# --------------------------------------------------------------------------- local twin


def test_local_fake_config_keeps_the_worker_types(cluster_cfg):
    local = local_fake_config(CLUSTER_YAML, cpus_per_node=2)
    assert local["provider"]["type"] == "fake_multinode"
    assert local["provider"]["disable_launch_config_check"] is True
    assert local["provider"]["disable_node_updaters"] is True
    assert local["provider"]["use_node_id_as_ip"] is True
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_TYPE as RAYS
    assert local["head_node_type"] == FAKE_HEAD_NODE_TYPE == RAYS
    assert local["idle_timeout_minutes"] == cluster_cfg["idle_timeout_minutes"]
    assert local["max_workers"] == cluster_cfg["max_workers"]

    cloud_workers = _worker_types(cluster_cfg)
    local_workers = _worker_types(local)
    assert set(local_workers) == set(cloud_workers)
    for name, cloud in cloud_workers.items():
        got = local_workers[name]
        assert got["min_workers"] == cloud["min_workers"]
        assert got["max_workers"] == cloud["max_workers"]
        assert "GPU" not in got["resources"], "this machine has no GPU"
        assert 1 <= got["resources"]["CPU"] <= 2
        for res in (TRAIN_RESOURCE, INFER_RESOURCE):
            assert got["resources"].get(res) == cloud["resources"].get(res), "custom resources kept"
        assert got["node_config"] == {}
    head = local["available_node_types"][FAKE_HEAD_NODE_TYPE]
    assert head["max_workers"] == 0 and TRAIN_RESOURCE not in head["resources"]

    from ray.autoscaler._private.util import validate_config
    validate_config(local)  # cross-check: Ray's own validation (private; tests only) accepts it too


def test_local_fake_config_overrides(cluster_cfg):
    local = local_fake_config(cluster_cfg, cpus_per_node=1, head_cpus=3, idle_timeout_minutes=0.25,
                              max_workers_per_type=1, object_store_memory=300 * 1024**2)
    assert local["idle_timeout_minutes"] == 0.25
    assert all(t["max_workers"] == 1 and t["resources"]["CPU"] == 1
               for t in _worker_types(local).values())
    assert local["max_workers"] == 2
    assert local["available_node_types"][FAKE_HEAD_NODE_TYPE]["resources"]["CPU"] == 3
    assert all(t["resources"]["object_store_memory"] == 300 * 1024**2
               for t in local["available_node_types"].values())


def test_local_fake_config_rejects_a_broken_cluster_yaml(cluster_cfg):
    with pytest.raises(ConfigError, match="head_node_type"):
        local_fake_config(_broken(cluster_cfg, lambda c: c.pop("head_node_type")))


def test_local_head_needs_a_fake_provider(cluster_cfg):
    with pytest.raises(ConfigError, match="fake_multinode"):
        with local_autoscaling_head(cluster_cfg):
            pass


def test_teardown_finds_the_clusters_processes_and_only_them(tmp_path):
    """What local_autoscaling_head stops: its process group, processes tagged with its marker
    (they inherited the head's environment), processes naming its temp dir; nothing else."""
    marker, temp_dir = "ckr-test-marker", str(tmp_path / "ckr-x")
    sleep = [sys.executable, "-c", "import time; time.sleep(120)"]
    procs = {
        "leader": subprocess.Popen(sleep, start_new_session=True),
        "tagged": subprocess.Popen(sleep, start_new_session=True,
                                   env={**os.environ, "CKRAY_LOCAL_CLUSTER": marker}),
        "by_path": subprocess.Popen([*sleep, f"--temp-dir={temp_dir}"], start_new_session=True),
        "stranger": subprocess.Popen([*sleep, f"--temp-dir={temp_dir}2"], start_new_session=True,
                                     env={**os.environ, "CKRAY_LOCAL_CLUSTER": marker + "2"}),
    }
    try:
        found = set(_cluster_pids(procs["leader"].pid, marker, temp_dir))
        assert found == {procs[k].pid for k in ("leader", "tagged", "by_path")}
        _stop_cluster(procs["leader"], marker, temp_dir, grace_s=2)
        for k in ("tagged", "by_path"):
            procs[k].wait(timeout=10)
        assert procs["leader"].poll() is not None
        assert procs["stranger"].poll() is None, "another cluster's process was killed"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


@pytest.mark.slow
def test_local_head_leaves_no_current_cluster_and_no_process_behind():
    """A head a test (or ckray) starts never becomes the machine's "current cluster" (the address a
    later `ray.init()` / `serve run` without an address would retry once it is dead), and stopping it
    leaves none of its processes."""
    from ckray.cluster import local_head

    default_file = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    before = default_file.read_text() if default_file.exists() else None
    with local_head(1) as head:
        assert head.processes()
        assert not default_file.exists() or default_file.read_text() == before
        own = head.temp_dir / "ray_current_cluster"  # `ray start` writes its address in its own temp dir
        deadline = time.monotonic() + 60
        while not own.exists():
            assert time.monotonic() < deadline, f"{own} never written"
            time.sleep(0.5)
        assert own.read_text().strip() == head.gcs_address
        assert not default_file.exists() or default_file.read_text() == before
        pids = head.processes()
    assert not default_file.exists() or default_file.read_text() == before
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)]


# --------------------------------------------------------------------------- training workers' resources


def test_training_workers_ask_for_the_training_node_resource(monkeypatch, tmp_path):
    """--resources-per-worker (JSON or NAME=AMOUNT) reaches Ray Train's ScalingConfig, next to the CPUs."""
    import argparse

    import ray.train.torch

    from ckray.training import TrainConfig, add_train_args, config_from_args
    from ckray.training.loop import _run_trainer

    parser = add_train_args(argparse.ArgumentParser())
    for flag in (f"{TRAIN_RESOURCE}=1", f'{{"{TRAIN_RESOURCE}": 1}}'):
        config = config_from_args(parser.parse_args(["--workers", "2", "--resources-per-worker", flag]))
        assert config.resources_per_worker == {TRAIN_RESOURCE: 1.0}
    assert config_from_args(parser.parse_args([])).resources_per_worker == {}
    for bad in ("ckray_train", "ckray_train=x", "[1]"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--resources-per-worker", bad])
    for bad in ({"CPU": 2}, {"GPU": 1}, {TRAIN_RESOURCE: -1}):
        with pytest.raises(ConfigError, match="resources_per_worker"):
            TrainConfig(resources_per_worker=bad).validate()

    seen = {}

    class Trainer:  # stands in for TorchTrainer: records what it was given
        def __init__(self, fn, *, scaling_config, **kwargs):
            seen["scaling"] = scaling_config

        def fit(self):
            return "fitted"

    monkeypatch.setattr(ray.train.torch, "TorchTrainer", Trainer)
    assert _run_trainer(None, None, None, config, str(tmp_path), "run", str(tmp_path / "run"), "id") == "fitted"
    assert seen["scaling"].num_workers == 2
    assert seen["scaling"].resources_per_worker == {"CPU": 1, TRAIN_RESOURCE: 1.0}


# --------------------------------------------------------------------------- real autoscaling

IDLE_TIMEOUT_MIN = 0.25  # 15 s
TRAIN_STEPS = 3


def _diagnostics(head) -> str:
    try:
        status = head.autoscaler_status(timeout=30)
    except Exception as e:  # noqa: BLE001 - best effort for a failure message
        status = f"(ray status failed: {e!r})"
    return f"\nautoscaler events: {head.autoscaler_events()}\n{status}"


@pytest.mark.slow
def test_local_autoscaling_adds_a_training_node_and_removes_it_when_idle(ray_session, tmp_path):
    """`ray job submit -- python jobs/train_ck.py --workers 2 --resources-per-worker ckray_train=1` to a
    head with cluster.yaml's node types (fake provider, 2 CPUs per node): the two Ray Train workers
    need `ckray_train`, which only the training node type has, so the autoscaler adds one such node;
    the job trains and writes its checkpoint; the node is removed after the idle timeout."""
    from ckray.data.sample import SampleConfig, generate_sample
    from ckray.data.prepare import prepare_collection

    t0 = time.time()
    # The data artifacts first, on the session's in-process Ray: the job then finds them up to date,
    # so its only demand on the autoscaling cluster is the training workers (no Ray Data tasks there
    # that could make the autoscaler pick some other node type for plain CPU demand).
    data = generate_sample(tmp_path / "data", SampleConfig(n_topics=12))
    w = tmp_path / "w"
    prepare_collection(data, w, split="train")
    t_prepared = time.time() - t0

    cfg = local_fake_config(CLUSTER_YAML, cpus_per_node=2, idle_timeout_minutes=IDLE_TIMEOUT_MIN,
                            max_workers_per_type=2)
    train_type, _ = _type_with(cfg, TRAIN_RESOURCE)
    with local_autoscaling_head(cfg, cwd=ROOT) as head:
        marker, temp_dir, leader = head.marker, head.temp_dir, head.pid
        t_ready = time.time() - t0
        alive = head.alive_nodes()
        assert [n["is_head_node"] for n in alive] == [True], "starts with the head only (min_workers: 0)"

        job_id = head.submit_job(
            [sys.executable, "jobs/train_ck.py", "--data", str(data), "--workdir", str(w),
             "--workers", "2", "--resources-per-worker", f"{TRAIN_RESOURCE}=1",
             "--max-steps", str(TRAIN_STEPS), "--eval-every", "0", "--batch-size", "2", "--layers", "1",
             "--max-doc-len", "128", "--max-dev-queries", "4", "--dev-depth", "5", "--log-every", "1"],
            f"ckray-autoscale-{uuid.uuid4().hex[:8]}")

        # Scale-up: the training workers need ckray_train, which only the training node type has.
        added: dict[str, dict] = {}
        status = None
        deadline = time.time() + 420
        while time.time() < deadline:
            for n in head.alive_nodes():
                if not n["is_head_node"]:
                    added[n["node_id"]] = n
            status = head.job_status(job_id)
            if status in ("SUCCEEDED", "FAILED", "STOPPED"):
                break
            time.sleep(1)
        # The node outlives the job by the idle timeout: one more look catches it in any case.
        added.update({n["node_id"]: n for n in head.alive_nodes() if not n["is_head_node"]})
        logs = head.job_logs(job_id)
        assert status == "SUCCEEDED", f"job {status}:\n{logs[-4000:]}{_diagnostics(head)}"
        t_job = time.time() - t0
        assert added, "the autoscaler added no node" + _diagnostics(head)
        for n in added.values():
            assert n["resources_total"].get(TRAIN_RESOURCE) == cfg["available_node_types"][train_type][
                "resources"][TRAIN_RESOURCE], f"only the training node type was needed: {n}"
            assert "GPU" not in n["resources_total"]
        assert any(e.startswith("Adding ") and e.endswith(f"node(s) of type {train_type}.")
                   for e in head.autoscaler_events()), head.autoscaler_events()

        # The job trained: its checkpoint and summary, with the per-worker resources it asked for.
        summary = json.loads((w / "checkpoints" / "ck-qti" / "train_summary.json").read_text())
        assert summary["steps"] == TRAIN_STEPS and summary["config"]["workers"] == 2
        assert summary["config"]["resources_per_worker"] == {TRAIN_RESOURCE: 1.0}
        assert (w / "checkpoints" / "ck-qti" / "model.safetensors").exists()
        assert f"step {TRAIN_STEPS}/{TRAIN_STEPS}" in logs, logs[-3000:]
        # ... and its Ray Train workers ran on the added training node(s), nowhere else.
        workers = [a for a in head.actors() if a.get("class_name") == "RayTrainWorker"]
        assert len(workers) == 2, workers
        assert {a["node_id"] for a in workers} <= set(added), f"workers ran off the new node: {workers}"

        # Scale-down: idle for idle_timeout_minutes -> terminated (the node turns DEAD in the GCS).
        deadline = time.time() + IDLE_TIMEOUT_MIN * 60 + 120
        while time.time() < deadline:
            if not [n for n in head.alive_nodes() if not n["is_head_node"]]:
                break
            time.sleep(1)
        else:
            pytest.fail("the idle node was not removed" + _diagnostics(head))
        t_removed = time.time() - t0
        states = {n["node_id"]: n["state"] for n in head.nodes()}
        assert all(states[i] == "DEAD" for i in added)
        # The monitor logs its "Removing ..." summary at the end of the update that terminated the
        # node, which can come a few seconds after the GCS marks the node dead: wait for it.
        removed_event = f"nodes of type {train_type} (idle)."
        deadline = time.time() + 60
        while not any(e.startswith("Removing ") and e.endswith(removed_event) for e in head.autoscaler_events()):
            assert time.time() < deadline, head.autoscaler_events()
            time.sleep(1)
        assert [n["is_head_node"] for n in head.alive_nodes()] == [True]

    # Teardown: nothing of this cluster survives (fake worker nodes, workers, job driver).
    assert _cluster_pids(leader, marker, str(temp_dir)) == []
    assert not temp_dir.exists()
    print(f"\ndata prepared {t_prepared:.0f}s, head ready {t_ready:.0f}s, job done (node added) {t_job:.0f}s, "
          f"node removed {t_removed:.0f}s, torn down {time.time() - t0:.0f}s")


# --------------------------------------------------------------------------- where each stage runs

def _wait_for_job(head, job_id: str, timeout_s: float = 600) -> str:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        status = head.job_status(job_id)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(1)
    return "TIMEOUT"


@pytest.mark.slow
def test_every_stage_runs_its_tasks_and_actors_on_worker_nodes(tmp_path, minilm_path):
    """A head that offers no CPUs (the coordinator of a large cluster): `ray job submit` of jobs/prepare.py
    (Ray Data shard tasks, BM25 negatives on a pool of search actors) and jobs/build_dense_index.py with
    `--resources-per-actor ckray_infer=1` (the encoder actors). Every task and actor that needs a CPU ran on a
    worker node the autoscaler added, the encoder actors on the inference node type; the jobs wrote their
    shards, negatives and index."""
    import torch

    from ckray.data.sample import SampleConfig, generate_sample
    from ckray.models.checkpoint import save_model
    from ckray.rankers.clear.model import CLEAR, CLEARConfig

    data = generate_sample(tmp_path / "data", SampleConfig(n_topics=12))
    w = tmp_path / "w"
    torch.manual_seed(0)
    checkpoint = save_model(CLEAR(CLEARConfig(encoder=minilm_path, pretrained=False, doc_max_len=64, bert_config=dict(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=128))), tmp_path / "clear")

    cfg = local_fake_config(CLUSTER_YAML, cpus_per_node=2, head_cpus=0, max_workers_per_type=1)
    infer_type, _ = _type_with(cfg, INFER_RESOURCE)
    with local_autoscaling_head(cfg, cwd=ROOT) as head:
        jobs = {
            "prepare": [sys.executable, "jobs/prepare.py", "--data", str(data), "--workdir", str(w), "--shards", "2",
                        "--threads", "1", "--negative-depth", "20"],
            "dense": [sys.executable, "jobs/build_dense_index.py", "--data", str(data), "--workdir", str(w),
                      "--checkpoint", str(checkpoint), "--resources-per-actor", f"{INFER_RESOURCE}=1"],
        }
        for name, entrypoint in jobs.items():
            job_id = head.submit_job(entrypoint, f"ckray-placement-{name}-{uuid.uuid4().hex[:8]}")
            status = _wait_for_job(head, job_id)
            assert status == "SUCCEEDED", f"{name}: {status}\n{head.job_logs(job_id)[-4000:]}{_diagnostics(head)}"
        nodes = {n["node_id"]: n for n in head.nodes()}
        head_ids = {i for i, n in nodes.items() if n["is_head_node"]}
        tasks = head.tasks()
        actors = head.actors()

    workers = {i for i, n in nodes.items() if not n["is_head_node"]}
    # tasks that ran (actor creation tasks carry no node: their actors below do) and actors that asked for resources
    ran = [(t["name"], t.get("node_id")) for t in tasks if t.get("required_resources")
           and t.get("type") in ("NORMAL_TASK", "ACTOR_TASK") and t.get("state") == "FINISHED"]
    placed = [(a["class_name"], a.get("node_id")) for a in actors if a.get("required_resources")]
    for wanted, among in (("write_piece", ran), ("SearchActor", placed), ("DocumentEncoder", placed)):
        assert any(wanted in name for name, _ in among), f"no {wanted} among {among}"
    off_workers = [(name, node) for name, node in ran + placed if node not in workers]
    assert not off_workers, f"ran off the worker nodes (head: {head_ids}): {off_workers}"
    encoders = {node for name, node in placed if "DocumentEncoder" in name}
    assert all(nodes[i]["resources_total"].get(INFER_RESOURCE) for i in encoders), \
        f"encoder actors off the {infer_type} nodes: {[nodes[i]['resources_total'] for i in encoders]}"
    # and the jobs did their work
    assert json.loads((w / "shards" / "_manifest.json").read_text())["documents"] > 0
    assert (w / "negatives" / "train.parquet").exists() and (w / "dense" / "index" / "index.faiss").exists()
