"""A training worker lost more times than ``max_failures`` allows: fit ends with a WorkersLostError naming
the latest checkpoint, and calling it again resumes from that checkpoint and finishes. The toy ranker,
its triples and the way a worker process dies (``os._exit`` inside the loss) are tests/test_train.py's."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

import ray.cloudpickle
from test_train import STEPS, ToyTask, _config, make_dev, make_triples

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

pytestmark = pytest.mark.slow


class CrashingTask(ToyTask):
    """Its worker process exits at the ``crash_at_step``-th micro-batch of every attempt until it has
    done so ``crashes`` times (counted by files in the ``crash_marker`` directory)."""

    def __init__(self, crash_at_step: int, crash_marker: str, crashes: int):
        super().__init__()
        self.crash_at, self.crash_dir, self.crashes = crash_at_step, Path(crash_marker), crashes

    def loss(self, model, batch):
        done = len(list(self.crash_dir.iterdir()))
        if self.micro_batches + 1 == self.crash_at and done < self.crashes:
            (self.crash_dir / f"crash-{done}").touch()
            os._exit(1)
        return super().loss(model, batch)


def test_worker_lost_beyond_max_failures_names_the_checkpoint_and_a_rerun_resumes_from_it(ray_session, tmp_path):
    from ckray.training import ATTEMPTS_DIR, fit, verify_checkpoint
    from ckray.training.checkpointing import WorkersLostError

    triples, dev = make_triples(600), make_dev()
    crashes = tmp_path / "crashes"
    crashes.mkdir()
    # one worker, a checkpoint every 10 steps; the worker dies at the 15th micro-batch of each attempt:
    # at step 15, then (restarted from step 10) at step 25. max_failures = 1 allows only the first.
    config = _config(tmp_path, workers=1, max_failures=1)
    task = CrashingTask(crash_at_step=15, crash_marker=str(crashes), crashes=2)
    with pytest.raises(WorkersLostError) as lost:
        fit(task, triples, dev, config)
    message = str(lost.value)
    assert sorted(p.name for p in crashes.iterdir()) == ["crash-0", "crash-1"]
    named = re.search(r"the latest checkpoint is (\S+) \(step (\d+)\); run the same command again to resume from it",
                      message)
    assert named, message
    assert f"training run {tmp_path / 'storage' / 'toy'}: a worker failed 2 time(s)" in message
    assert "max_failures = 1 (--max-failures)" in message
    checkpoint, step = Path(named.group(1)), int(named.group(2))
    # the restart resumed from the step-10 checkpoint and the error names the step-20 one (whole), even
    # where Ray had not registered them before the worker died (their reports are lost with it)
    starts = [json.loads(p.read_text())["start_step"] for p in sorted((checkpoint.parent / ATTEMPTS_DIR).rglob("*.json"))]
    assert starts == [0, 10]
    assert step == 20 and verify_checkpoint(checkpoint)["step"] == step
    assert not (tmp_path / "out").exists()   # nothing consolidated from the failed run

    again = fit(task, triples, dev, config)   # the same call, its crashes used up
    assert again.attempts == [step] and again.steps == STEPS
    assert [h["step"] for h in again.history] == [0, 10, 20, 30]
    assert again.best_checkpoint == tmp_path / "out" and (tmp_path / "out" / "model.safetensors").exists()
