"""Connecting to Ray: the cluster a job was submitted to, or a local one started in-process."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

RUNTIME_ENV_VARS = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")}


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to ``address`` / ``$RAY_ADDRESS`` (set by ``ray job submit``) when given, else start a
    local Ray in this process. Idempotent."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    env = {"env_vars": {k: v for k, v in RUNTIME_ENV_VARS.items()}}
    if address:
        ray.init(address=address, log_to_driver=True)
        log.info("connected to Ray at %s", address)
    else:
        cpus = num_cpus or max(4, os.cpu_count() or 1)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, runtime_env=env)
        log.info("started a local Ray with %d logical CPUs", cpus)
