"""The training flags of every training job, one per :class:`TrainConfig` field declared with
:func:`~ckray.options.option`, and the config they make.

Like :mod:`ckray.training.config`, imports neither torch nor Ray.
"""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from ckray.options import add_options, flags_of, options_from_args
from ckray.training.config import TrainConfig, parse_resources

__all__ = ["TRAIN_FLAGS", "add_train_args", "config_from_args", "parse_resources"]

# every TrainConfig field's flag, e.g. for naming the flag of an invalid field
TRAIN_FLAGS: dict[str, str] = flags_of(TrainConfig)
DEST_PREFIX = "loop_"   # a flag's destination: loop_<field>


def add_train_args(parser: argparse.ArgumentParser,
                   defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """Add the shared training flags (one per :class:`TrainConfig` field) to a job's parser.

    Every flag parses to None when not given, so the job's own choices (``config_from_args``'s
    ``defaults``) and then :class:`TrainConfig`'s apply. ``defaults`` (TrainConfig field → value,
    or a description such as ``"W/train"``) are the job's choices, shown in ``--help`` in place of
    TrainConfig's."""
    return add_options(parser, TrainConfig, "training (ckray.training)", defaults=dict(defaults or {}),
                       dest_prefix=DEST_PREFIX, unset_is_none=True)


def config_from_args(args: argparse.Namespace, **defaults: Any) -> TrainConfig:
    """A :class:`TrainConfig` from parsed flags; ``defaults`` (a job's own choices, e.g.
    ``output_dir=W/checkpoints/ck-qti``, ``lr=3e-5``) apply where the flag was not given. An invalid
    value is refused naming its flag (``--max-steps must be >= 1, got 0``)."""
    return options_from_args(TrainConfig, args, dest_prefix=DEST_PREFIX, **defaults)
