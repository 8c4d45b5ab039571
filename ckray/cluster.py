"""The Ray cluster: `cluster.yaml` (AWS autoscaler config) and a local autoscaling twin of it.

* `load_cluster_config(path)` / `validate_cluster_config(cfg)`: read a Ray autoscaler YAML, check it
  against Ray's own schema (`ray/autoscaler/ray-schema.json`) and fill in the provider's defaults
  as `ray up` does (`ray.autoscaler.sdk.fillout_defaults`, then the node-type defaults, see
  `prepare_cluster_config`), then check the result as Ray's autoscaler does (no cloud calls).
* `local_fake_config(cluster_yaml)`: the same worker node types (custom resources, min/max
  workers, idle timeout) on Ray's fake multi-node provider, which starts every "node" as a set of
  Ray processes on this machine. GPUs become 0 and CPUs are scaled down; the `ckray_*` custom
  resources stay, so jobs that ask for them scale the fake cluster exactly as the real one.
* `local_autoscaling_head(config)`: `RAY_FAKE_CLUSTER=1 ray start --head --block
  --autoscaling-config=...` on free ports, in its own process group, with its own temp dir and
  auth token; on exit everything it started (the fake worker nodes included) is stopped by
  process id. Never `ray stop`: that would stop every Ray on the machine.
* `local_head(num_cpus)`: the same for a plain one-node head (no worker types).
"""

from __future__ import annotations

import copy
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import yaml

from ckray.errors import ConfigError

# Custom resources the worker node types advertise (one unit per GPU); jobs request them so that
# the autoscaler starts the right node type, and so that nothing else lands on those nodes.
TRAIN_RESOURCE = "ckray_train"
INFER_RESOURCE = "ckray_infer"

DEFAULT_CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"

# The fake provider names the head node's type itself (its node tags); the local config's head
# type must carry the same name.
FAKE_HEAD_NODE_TYPE = "ray.head.default"

# Ray's fake multi-node provider, as every local config uses it.
_FAKE_PROVIDER: dict[str, Any] = {
    "type": "fake_multinode",
    "disable_launch_config_check": True,
    "disable_node_updaters": True,
    # All fake nodes share the machine's IP; the autoscaler must key nodes by id.
    "use_node_id_as_ip": True,
    # Launch `count` nodes when asked for `count` (default: one per round).
    "launch_multiple": True,
}

# Top-level fields the autoscaler process reads without filling defaults in. For the AWS/GCP
# providers `fillout_defaults` fills them from the provider's defaults.yaml; the fake provider's
# defaults file (example.yaml) is not shipped in the Ray wheel, so the local config spells
# every one of them out.
_AUTOSCALER_FIELDS: dict[str, Any] = {
    "upscaling_speed": 1.0,
    "docker": {},
    "auth": {},
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
}

_GIB = 1024**3


# --------------------------------------------------------------------------- config files


def load_cluster_config(path: str | os.PathLike = DEFAULT_CLUSTER_YAML) -> dict:
    """Read a Ray autoscaler YAML file into a dict (no validation; see validate_cluster_config)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the cluster config: {e}") from e
    try:
        cfg = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a cluster config is a YAML mapping, got {type(cfg).__name__}")
    return cfg


def _field_path(error) -> str:
    parts = [str(p) for p in error.absolute_path]
    return ".".join(parts) if parts else "<top level>"


def _schema_check(cfg: Mapping, where: str) -> None:
    """Ray's JSON schema (ray/autoscaler/ray-schema.json), with the failing field named."""
    import jsonschema
    import ray.autoscaler

    schema_path = Path(ray.autoscaler.__file__).with_name("ray-schema.json")
    schema = json.loads(schema_path.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)  # what jsonschema.validate uses
    errors = sorted(validator.iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"  {_field_path(e)}: {e.message}" for e in errors[:10]]
        more = f"\n  ... and {len(errors) - 10} more" if len(errors) > 10 else ""
        raise ConfigError(f"{where}: does not match Ray's cluster config schema:\n"
                          + "\n".join(lines) + more)


def validate_cluster_config(cfg: Mapping, *, where: str = "cluster config") -> dict:
    """Validate a Ray autoscaler config the way `ray up` does, without calling the cloud.

    1. Ray's JSON schema on the config as written (unknown fields, wrong types, ...).
    2. Multi-node-type essentials that the provider defaults would otherwise paper over:
       `provider.type`, `available_node_types`, `head_node_type` naming one of them, per-type
       `min_workers <= max_workers`.
    3. `prepare_cluster_config` (the provider's defaults.yaml merged in, node-type defaults filled)
       and `_check_prepared` on the result: what Ray's autoscaler checks before it starts.

    Returns the prepared config (defaults filled in). Raises ConfigError naming the field.
    """
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{where}: a cluster config is a mapping, got {type(cfg).__name__}")
    cfg = copy.deepcopy(dict(cfg))
    _schema_check(cfg, where)

    provider = cfg.get("provider")
    if not isinstance(provider, dict) or "type" not in provider:
        raise ConfigError(f"{where}: provider.type is required (e.g. aws, gcp)")
    node_types = cfg.get("available_node_types")
    if not node_types:
        raise ConfigError(f"{where}: available_node_types is required: the head node type and "
                          "the worker node types the autoscaler may launch")
    head = cfg.get("head_node_type")
    if head is None:
        raise ConfigError(f"{where}: head_node_type is required and must name one of "
                          f"available_node_types ({', '.join(node_types)})")
    if head not in node_types:
        raise ConfigError(f"{where}: head_node_type {head!r} is not one of available_node_types "
                          f"({', '.join(node_types)})")
    for name, spec in node_types.items():
        lo, hi = spec.get("min_workers", 0), spec.get("max_workers")
        if hi is not None and lo > hi:
            raise ConfigError(f"{where}: available_node_types.{name}: min_workers ({lo}) > "
                              f"max_workers ({hi})")

    prepared = prepare_cluster_config(cfg, where=where)
    _check_prepared(prepared, where)
    return prepared


def prepare_cluster_config(cfg: Mapping, *, where: str = "cluster config") -> dict:
    """The config with its defaults filled in, as `ray up` prepares a cloud provider's config.

    `ray.autoscaler.sdk.fillout_defaults` (Ray's public SDK) merges the provider's defaults.yaml
    under the config. The rest of what `ray up` does to such a config, done here:
      * `setup_commands` run before `head_setup_commands` and before `worker_setup_commands`
        (the two lists are prefixed with it);
      * every node type gets `min_workers` (default 0) and `max_workers` (default: the global
        `max_workers`; 0 for the head type).
    On-premise (`local`) and KubeRay configs are prepared by Ray in other ways and are refused.
    """
    from ray.autoscaler.sdk import fillout_defaults

    kind = cfg.get("provider", {}).get("type")
    if kind in ("local", "kuberay"):
        raise ConfigError(f"{where}: provider.type: {kind!r} clusters are not autoscaled cloud clusters; "
                          "ckray's cluster config is for a cloud provider (aws, gcp, azure, ...)")
    try:
        prepared = fillout_defaults(copy.deepcopy(dict(cfg)))
        for role in ("head", "worker"):
            prepared[f"{role}_setup_commands"] = (list(prepared["setup_commands"])
                                                  + list(prepared[f"{role}_setup_commands"]))
        for name, spec in prepared["available_node_types"].items():
            spec.setdefault("min_workers", 0)
            spec.setdefault("max_workers", 0 if name == prepared["head_node_type"] else prepared["max_workers"])
    except NotImplementedError as e:  # unknown provider type
        raise ConfigError(f"{where}: provider.type: {e}") from e
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"{where}: Ray could not fill in the provider defaults: {e!r}") from e
    docker = prepared.get("docker") or {}
    image = docker.get("image") or (docker.get("head_image", docker.get("image"))
                                    and docker.get("worker_image", docker.get("image")))
    if bool(docker.get("container_name")) != bool(image):
        raise ConfigError(f"{where}: docker: container_name and an image (image, or head_image and "
                          "worker_image) go together")
    return prepared


def _check_prepared(prepared: Mapping, where: str) -> None:
    """What Ray's autoscaler checks on a prepared config: its schema once more, the fields the
    provider defaults supply, the head type among the node types, and the global `max_workers`
    covering every type's `min_workers`."""
    _schema_check(prepared, where)
    if "cluster_synced_files" not in prepared:
        raise ConfigError(f"{where}: cluster_synced_files is missing after the provider defaults were "
                          "filled in: the Ray that filled them in is older than this one")
    node_types = prepared["available_node_types"]
    if prepared.get("head_node_type") not in node_types:
        raise ConfigError(f"{where}: head_node_type must be one of available_node_types "
                          f"({', '.join(node_types)})")
    total = sum(spec.get("min_workers", 0) for spec in node_types.values())
    if total > prepared["max_workers"]:
        raise ConfigError(f"{where}: max_workers: the global `max_workers` is smaller than the sum of "
                          f"`min_workers` of all the available node types ({prepared['max_workers']} < {total})")


# --------------------------------------------------------------------------- local twin


def local_fake_config(
    cluster_yaml: str | os.PathLike | Mapping = DEFAULT_CLUSTER_YAML,
    *,
    cpus_per_node: int = 2,
    head_cpus: int | None = None,
    object_store_memory: int = _GIB // 2,
    idle_timeout_minutes: float | None = None,
    max_workers_per_type: int | None = None,
) -> dict:
    """The cluster's node types on Ray's fake multi-node provider (nodes are local processes).

    Kept from `cluster_yaml`: the worker node types (names), their custom resources (the
    `ckray_*` ones), `min_workers`/`max_workers`, the global `max_workers`, `upscaling_speed`,
    `idle_timeout_minutes`. Changed so this machine can provide it:
      * `GPU` -> 0 (dropped), `CPU` -> min(CPU, cpus_per_node), `memory` dropped (each fake
        node reports the machine's memory), `object_store_memory` set per node;
      * the head type is renamed to `ray.head.default` (the name the fake provider gives its
        head) with `head_cpus` CPUs (default cpus_per_node) and no custom resources;
      * `idle_timeout_minutes` / per-type `max_workers` optionally overridden (tests: short);
      * cloud-only parts dropped (node_config, docker, file mounts, setup/start commands);
      * provider -> `fake_multinode` with node updaters and the launch-config check disabled,
        node ids used as IPs (all fake nodes share one IP) and multi-node launches honoured.
        `local_autoscaling_head` adds the GCS address.
    The result passes Ray's schema and the checks of `validate_cluster_config`.
    """
    if isinstance(cluster_yaml, Mapping):
        source = copy.deepcopy(dict(cluster_yaml))
        where = "cluster config"
    else:
        source = load_cluster_config(cluster_yaml)
        where = str(cluster_yaml)
    prepared = validate_cluster_config(source, where=where)
    if cpus_per_node < 1:
        raise ConfigError(f"cpus_per_node must be >= 1, got {cpus_per_node}")
    head_cpus = cpus_per_node if head_cpus is None else head_cpus

    head_name = prepared["head_node_type"]
    node_types: dict[str, dict] = {}
    for name, spec in prepared["available_node_types"].items():
        if name == head_name:
            continue
        if name == FAKE_HEAD_NODE_TYPE:
            raise ConfigError(f"{where}: the worker node type {name!r} clashes with the fake "
                              "provider's head node type; rename it")
        resources = dict(spec.get("resources") or {})
        resources.pop("GPU", None)
        resources.pop("memory", None)
        resources["CPU"] = max(1, min(int(resources.get("CPU", cpus_per_node)), cpus_per_node))
        resources["object_store_memory"] = int(object_store_memory)
        max_w = int(spec.get("max_workers", prepared["max_workers"]))
        if max_workers_per_type is not None:
            max_w = min(max_w, max_workers_per_type)
        min_w = min(int(spec.get("min_workers", 0)), max_w)
        node_types[name] = {
            "resources": resources,
            "node_config": {},
            "min_workers": min_w,
            "max_workers": max_w,
        }
        if spec.get("labels"):
            node_types[name]["labels"] = dict(spec["labels"])
    node_types[FAKE_HEAD_NODE_TYPE] = {
        "resources": {"CPU": int(head_cpus), "object_store_memory": int(object_store_memory)},
        "node_config": {},
        "min_workers": 0,
        "max_workers": 0,
    }

    max_workers = int(prepared["max_workers"])
    if max_workers_per_type is not None:
        max_workers = min(max_workers, sum(t["max_workers"] for n, t in node_types.items()
                                           if n != FAKE_HEAD_NODE_TYPE))
    idle = prepared.get("idle_timeout_minutes", 5) if idle_timeout_minutes is None \
        else idle_timeout_minutes

    cfg = copy.deepcopy(_AUTOSCALER_FIELDS)
    cfg.update({
        "cluster_name": f"{prepared['cluster_name']}-local",
        "max_workers": max_workers,
        "upscaling_speed": prepared.get("upscaling_speed", 1.0),
        "idle_timeout_minutes": idle,
        "provider": copy.deepcopy(_FAKE_PROVIDER),
        "head_node_type": FAKE_HEAD_NODE_TYPE,
        "available_node_types": node_types,
    })
    _check_prepared(cfg, "local fake config")
    return cfg


def single_node_config(num_cpus: int = 4, object_store_memory: int = _GIB // 2) -> dict:
    """A fake multi-node config of just a head with `num_cpus` CPUs: a plain one-node local Ray,
    started and stopped by `local_autoscaling_head` like any other (see `local_head`)."""
    if num_cpus < 1:
        raise ConfigError(f"num_cpus must be >= 1, got {num_cpus}")
    cfg = copy.deepcopy(_AUTOSCALER_FIELDS)
    cfg.update({
        "cluster_name": "ckray-single-node",
        "max_workers": 0,
        "idle_timeout_minutes": 5,
        "provider": copy.deepcopy(_FAKE_PROVIDER),
        "head_node_type": FAKE_HEAD_NODE_TYPE,
        "available_node_types": {FAKE_HEAD_NODE_TYPE: {
            "resources": {"CPU": int(num_cpus), "object_store_memory": int(object_store_memory)},
            "node_config": {}, "min_workers": 0, "max_workers": 0}},
    })
    _schema_check(cfg, "single-node config")
    return cfg


# --------------------------------------------------------------------------- local head


def _free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together, so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass
class LocalHead:
    """A running local autoscaling head (see local_autoscaling_head)."""

    gcs_address: str                  # host:port, for `ray.init(address=...)` in a subprocess
    dashboard_url: str                # http://127.0.0.1:PORT, for `ray job submit --address`
    env: dict[str, str]               # environment for clients: auth token, no RAY_ADDRESS
    temp_dir: Path                    # Ray's --temp-dir (sessions, logs) of this cluster only
    config_path: Path                 # the autoscaling config the head runs with
    log_path: Path                    # stdout/stderr of `ray start --block`
    pid: int                          # `ray start --block`, leader of its own process group
    marker: str = field(repr=False, default="")  # env value that tags every process of it
    _token: str = field(repr=False, default="")

    def ray_cmd(self, *args: str) -> list[str]:
        """A `ray` CLI command line from this virtual environment."""
        return [str(Path(sys.executable).with_name("ray")), *args]

    def api(self, path: str, timeout: float = 10.0, attempts: int = 3):
        """GET a dashboard JSON endpoint (with this cluster's token); connection errors and
        5xx answers are retried (a busy 2-core machine makes the dashboard slow at times)."""
        req = urllib.request.Request(self.dashboard_url + path,
                                     headers={"Authorization": f"Bearer {self._token}"})
        for attempt in range(attempts):
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return json.loads(r.read().decode())
            except urllib.error.HTTPError as e:
                if e.code < 500 or attempt == attempts - 1:
                    raise
            except (urllib.error.URLError, OSError):
                if attempt == attempts - 1:
                    raise
            time.sleep(1.0)

    def nodes(self) -> list[dict]:
        """Every node the GCS knows (state API): node_id, state (ALIVE/DEAD), is_head_node,
        resources_total, labels, ..."""
        out = self.api("/api/v0/nodes?limit=1000&detail=1")
        return out["data"]["result"]["result"]

    def alive_nodes(self) -> list[dict]:
        return [n for n in self.nodes() if n.get("state") == "ALIVE"]

    def actors(self) -> list[dict]:
        """Every actor the GCS knows, finished ones included (state API): actor_id, class_name,
        state (ALIVE/DEAD/...), node_id, pid, ... E.g. where a job's Ray Train workers ran."""
        out = self.api("/api/v0/actors?limit=10000&detail=1")
        return out["data"]["result"]["result"]

    def tasks(self) -> list[dict]:
        """Every task the GCS still knows (state API): name, type (NORMAL_TASK, ACTOR_CREATION_TASK,
        ACTOR_TASK, DRIVER_TASK), node_id, required_resources, state, ... E.g. where a job's Ray Data tasks ran."""
        out = self.api("/api/v0/tasks?limit=10000&detail=1", timeout=30)
        return out["data"]["result"]["result"]

    def submit_job(self, entrypoint: list[str], submission_id: str, *, working_dir: str | None = None,
                   timeout_s: float = 120.0, attempts: int = 6) -> str:
        """`ray job submit --no-wait` of `entrypoint` (argv) to this cluster; returns the submission
        id. Without `working_dir` the job runs in the head's working directory (`cwd` of
        local_autoscaling_head). Retried while the head's job agent is still starting."""
        cmd = self.ray_cmd("job", "submit", f"--address={self.dashboard_url}",
                           f"--submission-id={submission_id}", "--no-wait",
                           *([f"--working-dir={working_dir}"] if working_dir else []),
                           "--", *entrypoint)   # the CLI quotes them (shlex.join)
        for attempt in range(attempts):
            r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)
            if r.returncode == 0:
                return submission_id
            if "No available agent" not in r.stdout + r.stderr or attempt == attempts - 1:
                raise RuntimeError(f"ray job submit failed ({r.returncode}):\n{r.stdout}{r.stderr}")
            time.sleep(5)
        raise AssertionError("unreachable")

    def job_status(self, submission_id: str) -> str:
        """PENDING / RUNNING / SUCCEEDED / FAILED / STOPPED of a submitted job."""
        return self.api(f"/api/jobs/{submission_id}")["status"]

    def job_logs(self, submission_id: str) -> str:
        return self.api(f"/api/jobs/{submission_id}/logs")["logs"]

    def autoscaler_events(self) -> list[str]:
        """The autoscaler's event summaries so far ("Adding 1 node(s) of type ...",
        "Removing 1 nodes of type ... (idle)."), from its log in this cluster's session dir."""
        events = []
        # `session_latest` is a link to the session dir: read each log once.
        for log in sorted({p.resolve() for p in self.temp_dir.glob("session_*/logs/monitor.log*")}):
            for line in log.read_text(errors="replace").splitlines():
                if ":event_summary:" in line:
                    events.append(line.split(":event_summary:", 1)[1].strip())
        return events

    def autoscaler_status(self, timeout: float = 60.0) -> str:
        """`ray status` of this cluster (the autoscaler's view), for logs and failure messages."""
        r = subprocess.run(self.ray_cmd("status", f"--address={self.gcs_address}"),
                           env=self.env, capture_output=True, text=True, timeout=timeout)
        return r.stdout + r.stderr

    def processes(self) -> list[int]:
        """Ids of every live process that belongs to this cluster."""
        return _cluster_pids(self.pid, self.marker, str(self.temp_dir))


def _proc_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _cluster_pids(leader: int, marker: str, temp_dir: str) -> list[int]:
    """Live processes of one local cluster: the leader's process group, plus anything carrying the
    cluster's marker in its environment or its temp dir on its command line (Ray's workers run
    in process groups of their own, and the fake worker nodes are spawned by the autoscaler)."""
    me = os.getpid()
    found = []
    marker_b = f"CKRAY_LOCAL_CLUSTER={marker}".encode()
    temp_b = temp_dir.encode()
    for pid in _proc_pids():
        if pid == me or _is_zombie(pid):
            continue
        try:
            if os.getpgid(pid) == leader:
                found.append(pid)
                continue
        except ProcessLookupError:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read() + b"\0"
            if temp_b + b"/" in cmdline or temp_b + b"\0" in cmdline:
                found.append(pid)
                continue
            if marker:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker_b in f.read().split(b"\0"):
                        found.append(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return found


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True


def _stop_cluster(proc: subprocess.Popen, marker: str, temp_dir: str, grace_s: float) -> None:
    """SIGTERM the head's process group (`ray start --block` then stops the head's processes),
    wait up to `grace_s`, then SIGKILL whatever of this cluster is left: the fake worker nodes
    (started by the autoscaler), Ray workers (process groups of their own), job drivers."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.time() + grace_s
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    for _ in range(10):
        left = _cluster_pids(proc.pid, marker, temp_dir)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _head_args(config: Mapping) -> list[str]:
    """--num-cpus / --num-gpus / --resources / --object-store-memory of the head node type."""
    res = dict(config["available_node_types"][config["head_node_type"]].get("resources") or {})
    args = []
    if "CPU" in res:
        args.append(f"--num-cpus={int(res.pop('CPU'))}")
    args.append(f"--num-gpus={int(res.pop('GPU', 0))}")
    if "object_store_memory" in res:
        args.append(f"--object-store-memory={int(res.pop('object_store_memory'))}")
    res.pop("memory", None)
    if res:
        args.append(f"--resources={json.dumps(res)}")
    return args


@contextmanager
def local_autoscaling_head(
    config: Mapping,
    *,
    startup_timeout_s: float = 120.0,
    update_interval_s: int = 1,
    extra_env: Mapping[str, str] | None = None,
    keep_temp_dir: bool = False,
    stop_grace_s: float = 5.0,
    cwd: str | os.PathLike | None = None,
    startup_attempts: int = 2,
) -> Iterator[LocalHead]:
    """Start a local autoscaling Ray head for `config` (see local_fake_config) and stop it.

    `RAY_FAKE_CLUSTER=1 ray start --head --block --autoscaling-config=...` runs in a process
    group of its own, on free ports (GCS, dashboard, client server, agents), with a temp dir and
    an auth token of its own (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH), so clusters of other
    users on the machine are neither seen nor touched. The autoscaler ticks every
    `update_interval_s` seconds. Clients (`ray job submit`, `ray status`, a driver) run with
    `head.env` (which tags them as part of this cluster). On exit the process group is
    terminated, then every leftover process of this cluster (fake worker nodes, Ray workers,
    job drivers, clients started with `head.env`) is killed by id, and the temp dir is removed
    unless `keep_temp_dir`. If `ray start` exits during startup (a port taken meanwhile by
    another cluster), it is retried on fresh ports, `startup_attempts` times in all; a failed
    start raises with the tail of its log and keeps its temp dir for the logs.
    `cwd` (default: the current directory) is the head's working directory, which job
    entrypoints submitted without a working_dir run in, as with a `ray start` from a shell.
    """
    if config.get("provider", {}).get("type") != "fake_multinode":
        raise ConfigError("local_autoscaling_head needs a fake_multinode config "
                          "(see local_fake_config)")
    proc = head = None
    for attempt in range(startup_attempts):
        proc, head = _launch_head(config, update_interval_s=update_interval_s,
                                  extra_env=extra_env, cwd=cwd)
        try:
            _wait_ready(head, proc, startup_timeout_s)
            break
        except _HeadExited:
            # Most likely a port taken between picking it and binding it (other clusters on
            # this machine): clean up and try again on fresh ports.
            _stop_cluster(proc, head.marker, str(head.temp_dir), stop_grace_s)
            if attempt == startup_attempts - 1:
                raise
            shutil.rmtree(head.temp_dir, ignore_errors=True)
        except BaseException:
            _stop_cluster(proc, head.marker, str(head.temp_dir), stop_grace_s)
            raise
    try:
        yield head
    finally:
        _stop_cluster(proc, head.marker, str(head.temp_dir), stop_grace_s)
        if not keep_temp_dir:
            shutil.rmtree(head.temp_dir, ignore_errors=True)


@contextmanager
def local_head(num_cpus: int = 4, **kwargs: Any) -> Iterator[LocalHead]:
    """A one-node local Ray head (`single_node_config`), for `ray job submit` and `serve run`
    against a head as on a cluster. Like every `local_autoscaling_head`: free ports, a temp dir and
    token of its own (so it never becomes the machine's "current cluster" that a later
    `ray.init()` or `serve run` would try to reach once it is gone), and on exit every process of
    it stopped by id. `kwargs` go to `local_autoscaling_head`."""
    with local_autoscaling_head(single_node_config(num_cpus), **kwargs) as head:
        yield head


class _HeadExited(RuntimeError):
    """`ray start --head` exited during startup."""


def _launch_head(config: Mapping, *, update_interval_s: int, extra_env: Mapping[str, str] | None,
                 cwd: str | os.PathLike | None) -> tuple[subprocess.Popen, LocalHead]:
    from ray.util import get_node_ip_address

    temp_dir = Path(tempfile.mkdtemp(prefix="ckr-", dir="/tmp"))  # short: unix socket paths
    gcs_port, dash_port, client_port, agent_http, agent_grpc, rt_env, metrics = _free_ports(7)
    gcs_address = f"{get_node_ip_address()}:{gcs_port}"

    cfg = copy.deepcopy(dict(config))
    # Without it the fake provider starts its nodes against <node ip>:6379 (Ray's default
    # port), i.e. whichever cluster happens to listen there.
    cfg["provider"] = {**cfg["provider"], "gcs_address": gcs_address}
    config_path = temp_dir / "autoscaling.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    token = secrets.token_hex(32)
    token_path = temp_dir / "auth_token"
    token_path.write_text(token)
    token_path.chmod(0o600)
    marker = temp_dir.name

    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_API_SERVER_ADDRESS")}
    env.update({
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_path),
        "RAY_USAGE_STATS_ENABLED": "0",
        "CKRAY_LOCAL_CLUSTER": marker,
    })
    if extra_env:
        env.update(extra_env)
    head_env = {**env, "RAY_FAKE_CLUSTER": "1",
                "AUTOSCALER_UPDATE_INTERVAL_S": str(int(update_interval_s))}

    cmd = [
        str(Path(sys.executable).with_name("ray")), "start", "--head", "--block",
        f"--autoscaling-config={config_path}",
        f"--temp-dir={temp_dir}",
        f"--port={gcs_port}",
        f"--dashboard-port={dash_port}", "--dashboard-host=127.0.0.1", "--include-dashboard=true",
        f"--ray-client-server-port={client_port}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--runtime-env-agent-port={rt_env}",
        f"--metrics-export-port={metrics}",
        "--disable-usage-stats",
        *_head_args(cfg),
    ]
    log_path = temp_dir / "head.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=head_env,
                                start_new_session=True, cwd=str(cwd or os.getcwd()))
    head = LocalHead(gcs_address=gcs_address, dashboard_url=f"http://127.0.0.1:{dash_port}",
                     env=env, temp_dir=temp_dir, config_path=config_path,
                     log_path=log_path, pid=proc.pid, marker=marker, _token=token)
    return proc, head


def _wait_ready(head: LocalHead, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until the dashboard answers and lists the head node alive."""
    deadline = time.time() + timeout_s
    last = None
    while time.time() < deadline:
        if proc.poll() is not None:
            raise _HeadExited(f"`ray start --head` exited with {proc.returncode}:\n"
                               f"{_tail(head.log_path)}")
        try:
            if any(n.get("is_head_node") for n in head.alive_nodes()):
                return
        except (urllib.error.URLError, OSError, KeyError, ValueError) as e:
            last = e
        time.sleep(1.0)
    raise RuntimeError(f"local Ray head not ready after {timeout_s:.0f} s (last error: {last!r});"
                       f" logs in {head.temp_dir}:\n{_tail(head.log_path)}")


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
