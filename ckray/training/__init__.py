"""The one training loop of every ckray ranker: Ray Train ``TorchTrainer`` + DeepSpeed.

A model plugs in through a :class:`RankerTask` (build the model, collate a batch of triples, compute
the loss, score (query, document) pairs for validation); :func:`fit` does the rest::

    result = fit(MyTask(...), triples, dev, TrainConfig(workers=2, max_steps=2000, eval_every=200,
                                                       output_dir="W/checkpoints/my-model",
                                                       storage_dir="W/train"))
    model = load_model(result.best_checkpoint)

One job per module:

* :mod:`~ckray.training.config`: :class:`TrainConfig` and its validation (no torch, no Ray);
* :mod:`~ckray.training.flags`: the command line, one flag per ``TrainConfig`` field (no torch, no Ray);
* :mod:`~ckray.training.task`: :class:`RankerTask` (how a model plugs in) and :class:`TrainResult`;
* :mod:`~ckray.training.loop`: :func:`fit` on the driver and the loop every worker runs (micro-batches,
  DeepSpeed, autocast); what happens inside is described there;
* :mod:`~ckray.training.checkpointing`: saving, restoring and checking checkpoints, the resume checks,
  consolidation of the best checkpoint into plain weights;
* :mod:`~ckray.training.dev`: validation on the dev set (nDCG@10), sharded over the workers.

The names below are importable from this package; each is loaded with its module on first use, so
``ckray.training.config`` and ``ckray.training.flags`` stay free of torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {   # public name -> the module defining it
    "PRECISIONS": "config", "TrainConfig": "config",
    "TRAIN_FLAGS": "flags", "add_train_args": "flags", "config_from_args": "flags", "parse_resources": "flags",
    "METRIC": "task", "TRIPLE_COLUMNS": "task", "RankerTask": "task", "TrainResult": "task",
    "TRAIN_DATASET": "loop", "fit": "loop", "lr_factor": "loop", "lr_schedule": "loop",
    "weight_decay_groups": "loop",
    "ATTEMPTS_DIR": "checkpointing", "DS_TAG": "checkpointing", "STATE_FILE": "checkpointing",
    "consolidate": "checkpointing", "verify_checkpoint": "checkpointing",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
