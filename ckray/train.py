"""The training loop's public names, from :mod:`ckray.training` (one module per job: config, flags, task,
loop, checkpointing, dev), where new code imports them from."""

from ckray.training.checkpointing import ATTEMPTS_DIR, DS_TAG, STATE_FILE, consolidate, verify_checkpoint
from ckray.training.config import PRECISIONS, TrainConfig
from ckray.training.flags import TRAIN_FLAGS, add_train_args, config_from_args, parse_resources
from ckray.training.loop import (TRAIN_DATASET, _effective_zero_stage, _seed_everything, fit, lr_factor,
                                 weight_decay_groups)
from ckray.training.task import METRIC, TRIPLE_COLUMNS, RankerTask, TrainResult

__all__ = ["ATTEMPTS_DIR", "DS_TAG", "METRIC", "PRECISIONS", "STATE_FILE", "TRAIN_DATASET", "TRAIN_FLAGS",
           "TRIPLE_COLUMNS", "RankerTask", "TrainConfig", "TrainResult", "add_train_args", "config_from_args",
           "consolidate", "fit", "lr_factor", "parse_resources", "verify_checkpoint", "weight_decay_groups"]
# _effective_zero_stage and _seed_everything: bench/train_overhead.py builds its plain-PyTorch baseline with them
