"""What a training run is asked to do: :class:`TrainConfig` and its validation.

Imports neither torch nor Ray, so a job's ``--help`` and its flag errors come before any heavy import.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ckray.errors import ConfigError

PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    """Everything :func:`fit` needs besides the task and the data. ``step`` = one optimizer step."""

    workers: int = 2
    use_gpu: bool = False
    zero_stage: int = 2
    precision: str = "auto"          # auto: bf16 on GPU, fp32 on CPU; bf16 = autocast mixed precision
    batch_size: int = 8              # per-worker micro-batch, in triples
    grad_accum: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.01
    warmup_steps: int = 0
    max_steps: int = 1000
    eval_every: int = 100            # 0: validate only at the end
    seed: int = 42
    max_failures: int = 2
    grad_clip: float = 1.0           # 0: no clipping
    output_dir: str = ""             # consolidated best model; default checkpoints/<task.name>
    storage_dir: str = ""            # Ray Train storage (run state, DeepSpeed checkpoints); default ./ray_train
    resume: bool = True
    run_name: str = ""               # run directory under storage_dir; default task.name
    log_every: int = 10              # progress line every N steps (rank 0)
    keep_checkpoints: int = 2        # best-by-dev checkpoints Ray keeps (the latest is kept as well)
    eval_batch_size: int = 64        # (query, doc) pairs per task.score call
    eval_at_start: bool = True       # also validate the untrained model (history entry at step 0)
    shuffle_buffer: int = 4096       # rows in the per-epoch local shuffle buffer (0: no shuffle)
    cpus_per_worker: int = 1         # logical CPUs reserved per worker = torch threads per worker
    # extra Ray resources each worker asks for, e.g. {"ckray_train": 1}: only nodes that advertise them
    # (cluster.yaml's training node type) take the workers, and the autoscaler launches such nodes
    resources_per_worker: dict[str, float] = field(default_factory=dict)
    # start from these weights (a W/checkpoints/<name> directory of the same model) instead of the
    # model's own initialisation: fine-tuning a trained checkpoint further with other data or settings
    init_from: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a :class:`ConfigError` naming the first invalid field (``ConfigError.invalid``: a job
        that built this config from its flags names the flag instead, see :func:`config_from_args`)."""
        resources = self.resources_per_worker
        checks = [
            ("workers", self.workers >= 1, "must be >= 1"),
            ("zero_stage", self.zero_stage in (0, 1, 2, 3), "must be 0, 1, 2 or 3"),
            ("precision", self.precision in PRECISIONS, f"must be one of {PRECISIONS}"),
            ("batch_size", self.batch_size >= 1, "must be >= 1"),
            ("grad_accum", self.grad_accum >= 1, "must be >= 1"),
            ("lr", self.lr > 0, "must be > 0"),
            ("weight_decay", self.weight_decay >= 0, "must be >= 0"),
            ("warmup_steps", 0 <= self.warmup_steps, "must be >= 0"),
            ("max_steps", self.max_steps >= 1, "must be >= 1"),
            ("eval_every", self.eval_every >= 0, "must be >= 0 (0: validate only at the end)"),
            ("max_failures", self.max_failures >= -1, "must be >= -1 (-1: retry forever)"),
            ("grad_clip", self.grad_clip >= 0, "must be >= 0 (0: no clipping)"),
            ("log_every", self.log_every >= 1, "must be >= 1"),
            ("keep_checkpoints", self.keep_checkpoints >= 1, "must be >= 1"),
            ("eval_batch_size", self.eval_batch_size >= 1, "must be >= 1"),
            ("shuffle_buffer", self.shuffle_buffer >= 0, "must be >= 0 (0: no shuffle)"),
            ("cpus_per_worker", self.cpus_per_worker >= 1, "must be >= 1"),
            ("resources_per_worker",
             isinstance(resources, dict) and all(isinstance(k, str) and isinstance(v, (int, float)) and v >= 0
                                                 for k, v in resources.items()),
             "must map resource names to amounts >= 0"),
            ("resources_per_worker", not {"CPU", "GPU"} & set(resources if isinstance(resources, dict) else {}),
             "must not name CPU or GPU: set CPUs with cpus_per_worker (--cpus-per-worker) and GPUs with "
             "use_gpu (--use-gpu)"),
        ]
        for name, ok, problem in checks:
            if not ok:
                raise ConfigError.invalid("TrainConfig", name, f"{problem}, got {getattr(self, name)!r}")
