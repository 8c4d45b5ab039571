"""The training flags of every training job, one per :class:`TrainConfig` field, and the config they make.

Like :mod:`ckray.training.config`, imports neither torch nor Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Mapping

from ckray.errors import ConfigError
from ckray.training.config import PRECISIONS, TrainConfig

_FLAGS: dict[str, str] = {  # TrainConfig field -> its "--flag VALUE"
    "workers": "--workers", "zero_stage": "--zero-stage", "precision": "--precision",
    "batch_size": "--batch-size", "grad_accum": "--grad-accum", "lr": "--lr",
    "weight_decay": "--weight-decay", "warmup_steps": "--warmup-steps", "max_steps": "--max-steps",
    "eval_every": "--eval-every", "seed": "--seed", "max_failures": "--max-failures",
    "grad_clip": "--grad-clip", "output_dir": "--output-dir", "storage_dir": "--storage-dir",
    "run_name": "--run-name", "log_every": "--log-every", "keep_checkpoints": "--keep-checkpoints",
    "eval_batch_size": "--eval-batch-size", "cpus_per_worker": "--cpus-per-worker",
    "init_from": "--init-from",
}
_HELP: dict[str, str] = {  # what each of _FLAGS sets, for --help
    "workers": "Ray Train workers (one model replica each)",
    "zero_stage": "DeepSpeed ZeRO stage (0 with a single worker)",
    "precision": "auto: bf16 autocast on a GPU, fp32 on CPU",
    "batch_size": "training triples per worker and micro-batch",
    "grad_accum": "micro-batches per optimizer step",
    "lr": "peak learning rate (AdamW, linear warm-up and decay)",
    "weight_decay": "AdamW weight decay (none on biases and norms)",
    "warmup_steps": "linear warm-up steps",
    "max_steps": "optimizer steps in all (a finished run is not trained again)",
    "eval_every": "validate on dev every N steps (0: only at the end)",
    "seed": "random seed (model initialisation, data order)",
    "max_failures": "worker-group restarts from the latest checkpoint (-1: forever)",
    "grad_clip": "gradient norm clipping (0: none)",
    "output_dir": "where the best checkpoint is written",
    "storage_dir": "Ray Train storage: run state and DeepSpeed checkpoints",
    "run_name": "run directory under --storage-dir (resumed when it exists)",
    "log_every": "progress line every N steps",
    "keep_checkpoints": "best-by-dev checkpoints kept (the latest is kept as well)",
    "eval_batch_size": "(query, document) pairs per scoring call in validation",
    "cpus_per_worker": "CPUs reserved per worker (= its torch threads)",
}
# every TrainConfig field's flag (add_train_args), e.g. for naming the flag of an invalid field
TRAIN_FLAGS: dict[str, str] = {**_FLAGS, "resources_per_worker": "--resources-per-worker", "use_gpu": "--use-gpu",
                               "eval_at_start": "--no-eval-at-start", "resume": "--no-resume"}


def add_train_args(parser: argparse.ArgumentParser,
                   defaults: Mapping[str, Any] | None = None) -> argparse.ArgumentParser:
    """Add the shared training flags (one per :class:`TrainConfig` field) to a job's parser.

    Every flag parses to None when not given, so the job's own choices (``config_from_args``'s
    ``defaults``) and then :class:`TrainConfig`'s apply. ``defaults`` (TrainConfig field → value,
    or a description such as ``"W/train"``) are the job's choices, shown in ``--help`` in place of
    TrainConfig's."""
    group = parser.add_argument_group("training (ckray.training)")
    base = TrainConfig()
    shown = {name: getattr(base, name) for name in _FLAGS} | dict(defaults or {})
    for name, flag in _FLAGS.items():
        value = shown[name]
        shown_value = value if isinstance(value, str) and value else repr(value)
        kwargs: dict[str, Any] = {"dest": f"train_{name}", "default": None, "type": type(getattr(base, name)),
                                  "metavar": name.upper(), "help": f"{_HELP.get(name, '')} (default: {shown_value})"}
        if name == "precision":
            kwargs.update(choices=PRECISIONS, metavar=None)
        if name == "zero_stage":
            kwargs.update(choices=(0, 1, 2, 3), metavar=None)
        if name == "init_from":
            kwargs.update(metavar="CKPT", help="start from this saved checkpoint's weights (a W/checkpoints/<name> "
                                               "directory of the same model) to fine-tune it further "
                                               "(default: the model's own initialisation)")
        group.add_argument(flag, **kwargs)
    group.add_argument("--resources-per-worker", dest="train_resources_per_worker", type=parse_resources,
                       default=None, metavar="JSON|K=V[,K=V]",
                       help='extra Ray resources per worker, e.g. ckray_train=1 or \'{"ckray_train": 1}\' '
                            "(default: none)")
    group.add_argument("--use-gpu", dest="train_use_gpu", action="store_true", default=None,
                       help="one GPU per worker (default: CPU)")
    group.add_argument("--no-eval-at-start", dest="train_eval_at_start", action="store_false", default=None,
                       help="skip validating the untrained model (default: validate it, step 0)")
    group.add_argument("--no-resume", dest="train_resume", action="store_false", default=None,
                       help="start over: delete the run directory instead of resuming from it (default: resume)")
    return parser


def parse_resources(text: str) -> dict[str, float]:
    """``'{"ckray_train": 1}'`` or ``ckray_train=1,other=0.5`` → ``{"ckray_train": 1.0, ...}``."""
    text = text.strip()
    try:
        if text.startswith("{"):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
        else:
            value = {}
            for item in filter(None, (s.strip() for s in text.split(","))):
                key, sep, amount = item.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{item!r} is not NAME=AMOUNT")
                value[key.strip()] = amount
        return {str(k): float(v) for k, v in value.items()}
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"resources {text!r}: {exc} (expected JSON like '{{\"ckray_train\": 1}}' or ckray_train=1)") from None


def config_from_args(args: argparse.Namespace, **defaults: Any) -> TrainConfig:
    """A :class:`TrainConfig` from parsed flags; ``defaults`` (a job's own choices, e.g.
    ``output_dir=W/checkpoints/ck-qti``, ``lr=3e-5``) apply where the flag was not given. An invalid
    value is refused naming its flag (``--max-steps must be >= 1, got 0``)."""
    values = dict(defaults)
    for f in dataclasses.fields(TrainConfig):
        value = getattr(args, f"train_{f.name}", None)
        if value is not None:
            values[f.name] = value
    try:
        return TrainConfig(**values)
    except ConfigError as exc:
        raise exc.for_flags(TRAIN_FLAGS) from None
