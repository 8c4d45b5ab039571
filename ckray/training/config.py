"""What a training run is asked to do: :class:`TrainConfig` and its validation.

Imports neither torch nor Ray, so a job's ``--help`` and its flag errors come before any heavy import.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckray.errors import ConfigError
from ckray.options import option, parse_resources

PRECISIONS = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    """Everything :func:`fit` needs besides the task and the data. ``step`` = one optimizer step.
    Each field declared with :func:`~ckray.options.option` is a flag of every training job
    (``ckray.training.flags``)."""

    workers: int = option(2, "Ray Train workers (one model replica each)")
    use_gpu: bool = option(False, "one GPU per worker")
    zero_stage: int = option(2, "DeepSpeed ZeRO stage (0 with a single worker)", choices=(0, 1, 2, 3))
    # bf16 = autocast mixed precision
    precision: str = option("auto", "auto: bf16 autocast on a GPU, fp32 on CPU", choices=PRECISIONS)
    batch_size: int = option(8, "training triples per worker and micro-batch")
    grad_accum: int = option(1, "micro-batches per optimizer step")
    lr: float = option(1e-4, "peak learning rate (AdamW, linear warm-up and decay)")
    weight_decay: float = option(0.01, "AdamW weight decay (none on biases and norms)")
    warmup_steps: int = option(0, "linear warm-up steps")
    max_steps: int = option(1000, "optimizer steps in all (a finished run is not trained again)")
    schedule_steps: int = option(0, "step at which the linear decay reaches zero (0: --max-steps); larger than "
                                    "--max-steps, training stops partway down that longer schedule")
    eval_every: int = option(100, "validate on dev every N steps (0: only at the end)")
    seed: int = option(42, "random seed (model initialisation, data order)")
    max_failures: int = option(2, "worker-group restarts from the latest checkpoint (-1: forever)")
    grad_clip: float = option(1.0, "gradient norm clipping (0: none)")
    output_dir: str = option("", "where the best checkpoint is written")  # default checkpoints/<task.name>
    storage_dir: str = option("", "Ray Train storage: run state and DeepSpeed checkpoints")  # default ./ray_train
    resume: bool = option(True, "resume the run directory when it exists (--no-resume: delete it and start over)")
    run_name: str = option("", "run directory under --storage-dir (resumed when it exists)")  # default task.name
    log_every: int = option(10, "progress line every N steps")
    keep_checkpoints: int = option(2, "best-by-dev checkpoints kept (the latest is kept as well)")
    eval_batch_size: int = option(64, "(query, document) pairs per scoring call in validation")
    eval_at_start: bool = option(True, "validate the untrained model too (step 0)")
    shuffle_buffer: int = 4096       # rows in the per-epoch local shuffle buffer (0: no shuffle)
    cpus_per_worker: int = option(1, "CPUs reserved per worker (= its torch threads)")
    # only nodes that advertise these resources (cluster.yaml's training node type) take the workers,
    # and the autoscaler launches such nodes
    resources_per_worker: dict[str, float] = option(
        help="extra Ray resources per worker, e.g. ckray_train=1 or '{\"ckray_train\": 1}' (default: none)",
        default_factory=dict, parse=parse_resources, metavar="JSON|K=V[,K=V]")
    init_from: str = option("", "start from this saved checkpoint's weights (a W/checkpoints/<name> directory of "
                                "the same model) to fine-tune it further (default: the model's own initialisation)",
                            metavar="CKPT")
    weight_ensemble: float = option(1.0, "WiSE-FT's α: save (1 − α) · the initial weights + α · the step chosen on dev "
                                         "(1: the fine-tuned weights alone; 0.5: the paper's robust mix for "
                                         "collections the model never saw)", metavar="ALPHA")

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
            ("schedule_steps", self.schedule_steps == 0 or self.schedule_steps >= self.max_steps,
             f"must be 0 (the decay ends at the last step) or at least the steps to train ({self.max_steps})"),
            ("eval_every", self.eval_every >= 0, "must be >= 0 (0: validate only at the end)"),
            ("max_failures", self.max_failures >= -1, "must be >= -1 (-1: retry forever)"),
            ("grad_clip", self.grad_clip >= 0, "must be >= 0 (0: no clipping)"),
            ("log_every", self.log_every >= 1, "must be >= 1"),
            ("keep_checkpoints", self.keep_checkpoints >= 1, "must be >= 1"),
            ("eval_batch_size", self.eval_batch_size >= 1, "must be >= 1"),
            ("weight_ensemble", 0.0 <= self.weight_ensemble <= 1.0, "must be in [0, 1] (1: the fine-tuned weights)"),
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
