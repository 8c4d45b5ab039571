"""Deployment settings that travel with a checkpoint: ``<checkpoint>/deploy.json``.

What is tuned on the held-out (dev) training queries of the collection a model was trained on —
CLEAR's λ_test, the interpolation weight ``w`` of each ``first+reranker`` (per first stage), CK-QTI's
impact top-k and β — is written here as well as in the work directory, stamped with the checkpoint's
digest (``ckray.models.checkpoint.checkpoint_digest``)::

    {"checkpoint_sha256": "…",
     "settings": {"lambda": {"value": 0.05, "tuned_on": {…}},
                  "fusion": {"bm25": {"weight": 0.8, "depth": 100, "tuned_on": {…}}},
                  "impact": {"top_k": 256, "explicit_weight": 0.5, "tuned_on": {…}}}}

A collection with no training queries (a BEIR test set) uses them instead of tuning: the index jobs
and ``ckray.evaluation`` copy the carried value into the work directory (``W/dense/hybrid.json``,
``W/fusion/…``) with a ``source`` naming this file, so evaluation, its stamps and Serve read one place.
A file whose digest is not the checkpoint's (the model was retrained) is ignored, with a warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ckray.errors import ConfigError

log = logging.getLogger(__name__)

DEPLOY_FILE = "deploy.json"


def deploy_path(checkpoint: str | os.PathLike) -> Path:
    return Path(checkpoint) / DEPLOY_FILE


def read_deploy(checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The settings saved for this checkpoint (``{}`` when none, or when saved for another model)."""
    from ckray.data.shards import read_json
    from ckray.models.checkpoint import checkpoint_digest

    path = deploy_path(checkpoint)
    if not path.exists():
        return {}
    record = read_json(path)
    if record.get("checkpoint_sha256") != checkpoint_digest(checkpoint):
        log.warning("%s was tuned for another model (checkpoint digest differs): ignored", path)
        return {}
    return dict(record.get("settings") or {})


def save_deploy_setting(checkpoint: str | os.PathLike, name: str, value: Any) -> Path:
    """Set ``settings[name]`` in the checkpoint's deploy.json (settings of an older model are dropped)."""
    from ckray.data.shards import write_json_atomic
    from ckray.models.checkpoint import checkpoint_digest

    settings = read_deploy(checkpoint)
    settings[name] = value
    return write_json_atomic({"checkpoint_sha256": checkpoint_digest(checkpoint), "settings": settings},
                             deploy_path(checkpoint))


def carried_lambda(checkpoint: str | os.PathLike) -> dict | None:
    """CLEAR's λ_test saved with ``checkpoint`` (``{"value", "tuned_on"}``), or None."""
    return read_deploy(checkpoint).get("lambda")


def carried_fusion_weight(checkpoint: str | os.PathLike, first: str) -> dict | None:
    """The ``w`` of ``first+<this reranker>`` saved with ``checkpoint`` (``{"weight", "depth", …}``);
    None when none was saved. A weight saved for other first stages only is a ConfigError naming them:
    a weight tuned over one first stage's scores means nothing over another's."""
    saved = read_deploy(checkpoint).get("fusion") or {}
    if not saved:
        return None
    if first not in saved:
        raise ConfigError(f"{deploy_path(checkpoint)} has an interpolation weight tuned for first stage(s) "
                          f"{', '.join(sorted(saved))}, not for {first!r}: tune {first}+reranker on a collection "
                          f"with training queries, or pass --fusion-weight")
    return dict(saved[first])


def save_fusion_weight(checkpoint: str | os.PathLike, first: str, record: dict) -> Path:
    """Save ``record`` (weight, depth, tuned_on) as the ``w`` of ``first+<this reranker>``."""
    fusion = dict(read_deploy(checkpoint).get("fusion") or {})
    fusion[first] = record
    return save_deploy_setting(checkpoint, "fusion", fusion)


def source_of(checkpoint: str | os.PathLike) -> str:
    """How a carried setting's ``source`` names this file."""
    return str(deploy_path(Path(checkpoint).resolve()))
