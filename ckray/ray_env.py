"""Connecting to Ray: the cluster a job was submitted to, or a local one started in-process."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

RUNTIME_ENV_VARS = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")}

# Ray Train's PlacementGroupCleaner asks the State API every second whether the training controller is
# alive; a local Ray started without its dashboard has no State API, so each check logs this warning.
PLACEMENT_GROUP_CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
STATE_API_UNAVAILABLE = "Failed to query Ray Train Controller actor state"


class _DropStateApiWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(STATE_API_UNAVAILABLE)


def quiet_local_workers() -> None:
    """``worker_process_setup_hook`` of the local Ray: drop the cleaner's once-a-second "State API may be
    temporarily unavailable" warning, which would bury the training progress lines. The local Ray ends
    with the driver process, placement groups included, so the cleaner has nothing to clean; its other
    messages still pass."""
    logging.getLogger(PLACEMENT_GROUP_CLEANER_LOGGER).addFilter(_DropStateApiWarnings())


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to ``address`` / ``$RAY_ADDRESS`` (set by ``ray job submit``) when given, else start a
    local Ray in this process. Idempotent."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=True)
        log.info("connected to Ray at %s", address)
    else:
        cpus = num_cpus or max(4, os.cpu_count() or 1)
        env = {"env_vars": dict(RUNTIME_ENV_VARS), "worker_process_setup_hook": f"{__name__}.quiet_local_workers"}
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, runtime_env=env)
        log.info("started a local Ray with %d logical CPUs", cpus)
