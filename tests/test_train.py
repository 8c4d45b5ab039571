"""The shared training loop (ckray.training): Ray Train + DeepSpeed ZeRO-2 on 2 CPU workers, with a toy
bag-of-hashed-words ranker on synthetic triples where relevance must be *learned* (queries and their
relevant documents use different words of the same topic, so an untrained model ranks at random)."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from ckray.data.examples import DevSet
from ckray.errors import ConfigError, MissingArtifactError
from ckray.eval import ndcg_at_10
from ckray.models.checkpoint import load_model
from ckray.training import (METRIC, STATE_FILE, RankerTask, TrainConfig, add_train_args, config_from_args,
                            fit, lr_factor, lr_schedule, verify_checkpoint)

# Workers unpickle the task and model classes; this test module is not importable there, so its
# classes travel by value.
import ray.cloudpickle

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TOPICS, QWORDS, DWORDS, NOISE = 12, 6, 12, 40
BUCKETS = 2048


# ---------------------------------------------------------------------------------------------
# The toy model and task
# ---------------------------------------------------------------------------------------------

@dataclass
class ToyConfig:
    buckets: int = BUCKETS
    dim: int = 32
    max_words: int = 24


def hash_words(texts, buckets: int, max_words: int) -> torch.Tensor:
    """Stable word hashing (crc32: ``hash()`` differs between processes); id 0 is padding."""
    ids = torch.zeros(len(texts), max_words, dtype=torch.long)
    for i, text in enumerate(texts):
        words = str(text).split()[:max_words]
        ids[i, :len(words)] = torch.tensor([1 + zlib.crc32(w.encode()) % (buckets - 1) for w in words],
                                           dtype=torch.long)
    return ids


class ToyRanker(torch.nn.Module):
    """score(q, d) = <mean word embedding of q, W mean word embedding of d> * scale."""

    def __init__(self, config: ToyConfig):
        super().__init__()
        self.config = config
        self.emb = torch.nn.Embedding(config.buckets, config.dim, padding_idx=0)
        with torch.no_grad():   # small initial scores: the untrained loss is ln 2
            self.emb.weight.mul_(0.1)
        self.proj = torch.nn.Linear(config.dim, config.dim)
        self.register_buffer("scale", torch.tensor(2.0))   # a buffer must survive consolidation

    def encode(self, ids: torch.Tensor) -> torch.Tensor:
        mask = (ids > 0).unsqueeze(-1).float()
        return (self.emb(ids) * mask).sum(1) / mask.sum(1).clamp(min=1)

    def forward(self, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return (self.encode(q) * self.proj(self.encode(d))).sum(-1) * self.scale

    def score_texts(self, queries, docs) -> torch.Tensor:
        c = self.config
        device = self.emb.weight.device
        return self(hash_words(queries, c.buckets, c.max_words).to(device),
                    hash_words(docs, c.buckets, c.max_words).to(device))


class ToyTask(RankerTask):
    name = "toy"

    def __init__(self, crash_at_step: int = 0, crash_marker: str = ""):
        self.crash_at_step, self.crash_marker = crash_at_step, crash_marker
        self.micro_batches = 0

    def build_model(self) -> ToyRanker:
        return ToyRanker(ToyConfig())

    def collate(self, rows):
        c = ToyConfig()
        return {"q": hash_words(rows["query"], c.buckets, c.max_words),
                "pos": hash_words(rows["pos_text"], c.buckets, c.max_words),
                "neg": hash_words(rows["neg_text"], c.buckets, c.max_words)}

    def loss(self, model, batch):
        self.micro_batches += 1
        if self.crash_at_step and self.micro_batches == self.crash_at_step and not os.path.exists(self.crash_marker):
            Path(self.crash_marker).write_text("crashed once")
            os._exit(1)   # a lost worker process, not a Python exception
        pos, neg = model(batch["q"], batch["pos"]), model(batch["q"], batch["neg"])
        return torch.nn.functional.cross_entropy(torch.stack([pos, neg], 1),
                                                 torch.zeros(len(pos), dtype=torch.long))


# ---------------------------------------------------------------------------------------------
# Synthetic data: topic t has query words qt_* and document words dt_*
# ---------------------------------------------------------------------------------------------

def _query(rng: random.Random, t: int) -> str:
    return " ".join(f"q{t}_{rng.randrange(QWORDS)}" for _ in range(3))


def _doc(rng: random.Random, t: int) -> str:
    words = [f"d{t}_{rng.randrange(DWORDS)}" for _ in range(6)] + [f"n_{rng.randrange(NOISE)}" for _ in range(4)]
    rng.shuffle(words)
    return " ".join(words)


def make_triples(n: int, seed: int = 0) -> pa.Table:
    rng = random.Random(seed)
    rows = {c: [] for c in ("query_id", "query", "pos_id", "pos_text", "pos_bm25", "neg_id", "neg_text", "neg_bm25")}
    for i in range(n):
        t = rng.randrange(TOPICS)
        other = (t + rng.randrange(1, TOPICS)) % TOPICS
        for k, v in (("query_id", f"q{i}"), ("query", _query(rng, t)), ("pos_id", f"p{i}"),
                     ("pos_text", _doc(rng, t)), ("pos_bm25", rng.random()), ("neg_id", f"n{i}"),
                     ("neg_text", _doc(rng, other)), ("neg_bm25", rng.random())):
            rows[k].append(v)
    return pa.table(rows)


def make_dev(n_queries: int = 24, n_candidates: int = 20, seed: int = 1) -> DevSet:
    rng = random.Random(seed)
    queries, candidates, doc_text, qrels = {}, {}, {}, {}
    for i in range(n_queries):
        t = i % TOPICS
        qid = f"dq{i}"
        queries[qid] = _query(rng, t)
        cands = []
        for j in range(n_candidates):
            topic = t if j < 2 else (t + 1 + rng.randrange(TOPICS - 1)) % TOPICS
            did = f"{qid}_d{j}"
            doc_text[did] = _doc(rng, topic)
            cands.append((did, rng.random()))
        rng.shuffle(cands)
        candidates[qid] = cands
        qrels[qid] = {f"{qid}_d0": 1, f"{qid}_d1": 1}
    return DevSet(queries, candidates, doc_text, qrels)


def rerank_ndcg(model: torch.nn.Module, dev: DevSet) -> float:
    run = {}
    with torch.no_grad():
        for qid, q in dev.queries.items():
            dids = [d for d, _ in dev.candidates[qid]]
            scores = model.score_texts([q] * len(dids), [dev.doc_text[d] for d in dids]).tolist()
            run[qid] = sorted(zip(dids, scores), key=lambda x: (-x[1], x[0]))
    return ndcg_at_10(run, dev.qrels)


STEPS = 30   # first run; the resumed run goes on to 2 * STEPS


def _config(tmp: Path, **kw) -> TrainConfig:
    base = dict(workers=2, zero_stage=2, batch_size=16, lr=0.05, weight_decay=0.0, warmup_steps=3,
                max_steps=STEPS, eval_every=10, log_every=10, seed=7, max_failures=0,
                output_dir=str(tmp / "out"), storage_dir=str(tmp / "storage"))
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def trained(ray_session, tmp_path_factory):
    """One 30-step run, then a second fit() on the same storage with max_steps 60 (a resume) in
    which a worker process dies at step 45, after the step-40 checkpoint (FailureConfig restart)."""
    tmp = tmp_path_factory.mktemp("train")
    triples, dev = make_triples(1200), make_dev()
    first = fit(ToyTask(), triples, dev, _config(tmp))
    first_out = tmp / "first_out"
    shutil.copytree(first.best_checkpoint, first_out)
    crashing = ToyTask(crash_at_step=15, crash_marker=str(tmp / "crashed"))  # 15th micro-batch of this run
    second = fit(crashing, triples, dev, _config(tmp, max_steps=2 * STEPS, max_failures=1))
    return {"tmp": tmp, "dev": dev, "triples": triples, "first": first, "first_out": first_out,
            "second": second}


# ---------------------------------------------------------------------------------------------
# End-to-end (Ray Train, 2 CPU workers, DeepSpeed ZeRO-2)
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_loss_falls_and_dev_ndcg_rises(trained):
    first = trained["first"]
    evals = [h for h in first.history if "loss" in h]
    assert [h["step"] for h in first.history] == [0, 10, 20, 30]
    assert first.steps == STEPS and first.start_step == 0
    assert first.examples_seen == STEPS * 16 * 2
    # pairwise softmax loss starts at ln 2 = 0.693 for an untrained model
    assert evals[0]["loss"] < 0.70
    assert evals[-1]["loss"] < 0.5 * evals[0]["loss"], evals
    untrained = first.history[0][METRIC]
    assert untrained < 0.6, first.history          # random ranking of 2 relevant among 20
    assert first.best_metric > untrained + 0.25, first.history
    assert first.best_metric == max(h[METRIC] for h in evals)
    assert all(h["examples_per_s"] > 0 and h["lr"] >= 0 for h in evals)


@pytest.mark.slow
def test_consolidated_model_loads_and_scores_like_the_trained_one(trained):
    first = trained["first"]
    out = trained["first_out"]
    meta = json.loads((out / "config.json").read_text())
    assert meta["step"] == first.best_step and meta[METRIC] == pytest.approx(first.best_metric)
    model = load_model(out)
    assert isinstance(model.config, ToyConfig) and float(model.scale) == 2.0
    # the plain-weights model reranks the dev set exactly as the trained model did during training
    assert rerank_ndcg(model, trained["dev"]) == pytest.approx(first.best_metric, abs=1e-9)


@pytest.mark.slow
def test_resume_continues_at_the_right_step(trained):
    first, second = trained["first"], trained["second"]
    assert second.start_step == STEPS
    assert second.steps == 2 * STEPS
    assert second.examples_seen == 2 * STEPS * 16 * 2
    steps = [h["step"] for h in second.history]
    assert steps == [0, 10, 20, 30, 40, 50, 60]      # the first run's history is kept, no step repeated
    assert second.history[:4] == first.history
    # training went on from the checkpoint (not from scratch): the loss stays at its low level
    assert second.history[4]["loss"] < 0.5 * first.history[1]["loss"]
    assert second.best_metric >= first.best_metric - 1e-9
    assert load_model(second.best_checkpoint) is not None
    # the LR schedule is restored with the rest of the state (also after the crash at step 45): every
    # step has the learning rate of its own run's schedule, the resumed steps those of an uninterrupted
    # 2 * STEPS-step run, not of a schedule restarted at step STEPS
    for h in first.history[1:]:
        assert h["lr"] == pytest.approx(0.05 * lr_factor(h["step"], 3, STEPS)), h
    for h in second.history[len(first.history):]:
        assert h["lr"] == pytest.approx(0.05 * lr_factor(h["step"], 3, 2 * STEPS)), h


@pytest.mark.slow
def test_finished_run_is_not_trained_again(trained):
    tmp = trained["tmp"]
    again = fit(ToyTask(), trained["triples"], trained["dev"], _config(tmp, max_steps=2 * STEPS))
    assert again.start_step == again.steps == 2 * STEPS and again.attempts == []
    assert again.best_metric == pytest.approx(trained["second"].best_metric)
    assert again.history == trained["second"].history


@pytest.mark.slow
def test_finished_run_with_other_model_settings_names_the_checkpoint(trained):
    class WiderToyTask(ToyTask):
        def build_model(self) -> ToyRanker:
            return ToyRanker(ToyConfig(dim=48))

    with pytest.raises(ConfigError, match=r"checkpoint .*checkpoint_.* does not fit ToyRanker: .*emb.weight.*--no-resume"):
        fit(WiderToyTask(), trained["triples"], trained["dev"], _config(trained["tmp"], max_steps=2 * STEPS))


@pytest.mark.slow
def test_weight_ensemble_saves_the_mix_of_the_initial_and_the_chosen_weights(trained):
    """WiSE-FT (Eq. 1): a finished run consolidated again with α = 0.25 holds 0.75 · the seeded
    initial model + 0.25 · the chosen step, and records α; the fine-tuned checkpoint is untouched."""
    tmp, second = trained["tmp"], trained["second"]
    wise = fit(ToyTask(), trained["triples"], trained["dev"],
               _config(tmp, max_steps=2 * STEPS, weight_ensemble=0.25, output_dir=str(tmp / "wise")))
    assert wise.start_step == wise.steps == 2 * STEPS      # nothing trained again
    tuned = load_model(second.best_checkpoint).state_dict()
    torch.manual_seed(7)                                    # _config's seed: the run's step-0 model
    start = ToyTask().build_model().state_dict()
    mixed = load_model(tmp / "wise").state_dict()
    assert not torch.allclose(start["emb.weight"], tuned["emb.weight"])
    for name in tuned:
        assert torch.allclose(mixed[name], 0.75 * start[name] + 0.25 * tuned[name], atol=1e-6), name
    meta = json.loads((tmp / "wise" / "config.json").read_text())
    assert meta["weight_ensemble"]["alpha"] == 0.25
    assert meta["weight_ensemble"][f"fine_tuned_{METRIC}"] == pytest.approx(second.best_metric)
    # the mix is validated on dev like every step was: the figure its checkpoint records is its own
    assert meta[METRIC] == meta["weight_ensemble"][METRIC] == pytest.approx(
        rerank_ndcg(load_model(tmp / "wise"), trained["dev"]), abs=1e-9)
    assert meta[METRIC] != pytest.approx(second.best_metric, abs=1e-6)


@pytest.mark.slow
def test_init_from_starts_a_new_run_at_the_saved_weights(trained, tmp_path, caplog):
    first = trained["first"]
    # a learning rate 1,000× too high: the 5 steps wreck the saved model, which must then be named
    tuned = fit(ToyTask(), trained["triples"], trained["dev"],
                _config(tmp_path, workers=1, max_steps=5, eval_every=5, lr=50.0, warmup_steps=0,
                        init_from=str(trained["first_out"])))
    assert tuned.start_step == 0 and tuned.steps == 5
    # step 0 (before any update) is the saved model: its dev score, not the untrained one's
    assert tuned.history[0]["step"] == 0
    assert tuned.history[0][METRIC] == pytest.approx(first.best_metric, abs=1e-9)
    assert first.history[0][METRIC] < first.best_metric - 0.25
    assert tuned.best_metric < tuned.history[0][METRIC]
    assert "no trained step beat the starting weights" in caplog.text
    assert f"the --init-from checkpoint {trained['first_out']} is the better model" in caplog.text


def test_init_from_a_missing_or_unfitting_checkpoint_is_refused_before_training(tmp_path):
    from ckray.models.checkpoint import save_model

    class WiderToyTask(ToyTask):
        def build_model(self) -> ToyRanker:
            return ToyRanker(ToyConfig(dim=48))

    triples, dev = make_triples(40), make_dev(2, 3)
    with pytest.raises(MissingArtifactError, match=f"no checkpoint at {tmp_path / 'nowhere'}"):
        fit(ToyTask(), triples, dev, _config(tmp_path, init_from=str(tmp_path / "nowhere")))
    save_model(ToyRanker(ToyConfig()), tmp_path / "toy")
    with pytest.raises(ConfigError, match=r"--init-from .*toy does not fit.*emb.weight is \(2048, 32\) there, "
                                          r"\(2048, 48\) here"):
        fit(WiderToyTask(), triples, dev, _config(tmp_path, init_from=str(tmp_path / "toy")))


@pytest.mark.slow
def test_half_written_checkpoint_gives_a_clear_error(trained, tmp_path):
    storage = tmp_path / "storage"
    shutil.copytree(trained["tmp"] / "storage", storage)
    run = storage / "toy"
    latest = max((p for p in run.glob("checkpoint_*") if p.is_dir()), key=lambda p: p.name)
    state = verify_checkpoint(latest)
    assert state["step"] == 2 * STEPS and state["world_size"] == 2 and state["zero_stage"] == 2
    config = _config(tmp_path, max_steps=3 * STEPS, storage_dir=str(storage))

    victim = next(p for p in (latest / "deepspeed").iterdir() if "optim_states" in p.name)
    victim.write_bytes(victim.read_bytes()[:100])                   # truncated
    with pytest.raises(MissingArtifactError, match="incomplete.*optim_states.*--no-resume"):
        fit(ToyTask(), trained["triples"], trained["dev"], config)
    victim.unlink()                                                  # missing
    with pytest.raises(MissingArtifactError, match="incomplete.*is missing"):
        fit(ToyTask(), trained["triples"], trained["dev"], config)
    (latest / STATE_FILE).unlink()                                   # never finished
    with pytest.raises(MissingArtifactError, match="half-written"):
        fit(ToyTask(), trained["triples"], trained["dev"], config)


@pytest.mark.slow
def test_resume_with_other_worker_count_is_refused(trained, tmp_path):
    storage = tmp_path / "storage"
    shutil.copytree(trained["tmp"] / "storage", storage)
    config = _config(tmp_path, workers=1, max_steps=3 * STEPS, storage_dir=str(storage))
    with pytest.raises(ConfigError, match="2 workers.*--workers 2"):
        fit(ToyTask(), trained["triples"], trained["dev"], config)


@pytest.mark.slow
def test_lost_worker_restarts_from_last_checkpoint(trained):
    """The worker that died at step 45 was replaced and training went on from the latest
    checkpoint Ray had registered (step 40, or step 30 when the step-40 report was still in the dead
    worker's queue): one restart, the history holds every validation exactly once."""
    second = trained["second"]
    assert (trained["tmp"] / "crashed").read_text() == "crashed once"
    assert second.restarts == 1
    assert second.attempts[0] == STEPS and second.attempts[1] in (STEPS, STEPS + 10)
    assert [h["step"] for h in second.history] == [0, 10, 20, 30, 40, 50, 60]


# ---------------------------------------------------------------------------------------------
# Unit tests (no Ray)
# ---------------------------------------------------------------------------------------------

def test_lr_schedule_warms_up_then_decays_linearly():
    f = [lr_factor(s, warmup_steps=4, schedule_steps=12) for s in range(12)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and f[11] == pytest.approx(1 / 8)
    assert all(a > b for a, b in zip(f[4:], f[5:]))
    assert lr_factor(0, 0, 10) == 1.0 and lr_factor(10, 0, 10) == 0.0


def _learning_rates(cfg: TrainConfig, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = lr_schedule(optimizer, cfg)
    rates = []
    for _ in range(steps):
        rates.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    return rates


def test_a_longer_schedule_stops_training_partway_down_its_decay():
    """--max-steps 10 --schedule-steps 20 trains the first half of the 20-step schedule: the learning
    rates of those steps of --max-steps 20, ending half-way down rather than near zero."""
    half = _learning_rates(TrainConfig(max_steps=10, schedule_steps=20, warmup_steps=2), 10)
    full = _learning_rates(TrainConfig(max_steps=20, warmup_steps=2), 20)
    assert half == pytest.approx(full[:10])
    assert half[-1] == pytest.approx(11 / 18)
    assert _learning_rates(TrainConfig(max_steps=10, warmup_steps=2), 10)[-1] == pytest.approx(1 / 8)
    assert TrainConfig(max_steps=1000, schedule_steps=2000).schedule_steps == 2000
    assert TrainConfig(max_steps=1000).schedule_steps == 0     # 0: the schedule ends at max_steps
    with pytest.raises(ConfigError, match="schedule_steps must be 0 .* or at least the steps to train \\(1000\\), got 500"):
        TrainConfig(max_steps=1000, schedule_steps=500)


def test_zero2_engine_step_gives_the_plain_steps_weights(monkeypatch):
    """build_engine + train_micro_batch, the step every worker runs, in this process (world size 1,
    gloo): ZeRO-2's partitioned optimizer path moves the weights as ZeRO-0's plain step does, and
    training lowers the loss. bench/train_step_device.py times the same functions on a GPU."""
    import torch.distributed as dist

    from ckray.training.loop import build_engine, precision_context, train_micro_batch

    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", LOCAL_RANK="0",
                           WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        table = make_triples(64)
        rows = [{c: np.asarray(table.column(c).to_pylist()[i:i + 16]) for c in table.column_names}
                for i in range(0, 64, 16)]
        task, cfg = ToyTask(), TrainConfig(batch_size=16, lr=0.05, weight_decay=0.0, max_steps=8)
        weights, losses = {}, {}
        for stage in (0, 2):
            torch.manual_seed(0)
            engine = build_engine(task, task.build_model(), cfg, world=1, zero_stage=stage)
            assert engine.zero_optimization_stage() == stage
            autocast = precision_context("fp32", engine.device)
            losses[stage] = [float(train_micro_batch(engine, task, rows[i % 4], autocast)) for i in range(8)]
            weights[stage] = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        assert losses[0][-1] < losses[0][0] - 0.05
        assert losses[2] == pytest.approx(losses[0], abs=1e-5)
        for name, value in weights[0].items():
            torch.testing.assert_close(weights[2][name], value, atol=1e-5, rtol=1e-4)
    finally:
        dist.destroy_process_group()


def test_bf16_on_a_cpu_without_native_bf16_warns_that_it_is_emulated(tmp_path):
    import warnings

    import torch

    from ckray.device import cpu_has_native_bf16
    from ckray.training.loop import precision_context

    cpu = torch.device("cpu")
    emulated, native, arm = (tmp_path / n for n in ("amd", "intel", "arm"))
    emulated.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    native.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16\n")
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert [cpu_has_native_bf16(p) for p in (emulated, native, arm, tmp_path / "none")] == [False, True, None, None]
    with pytest.warns(UserWarning, match="emulated"):
        context = precision_context("bf16", cpu, cpuinfo=str(emulated))
    assert isinstance(context, torch.autocast)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for precision, cpuinfo in (("bf16", native), ("bf16", arm), ("fp32", emulated), ("auto", emulated)):
            precision_context(precision, cpu, cpuinfo=str(cpuinfo))


def test_one_worker_runs_deepspeed_without_partitioning():
    from ckray.training.loop import _deepspeed_config

    assert _deepspeed_config(TrainConfig(zero_stage=2), world=1)["zero_optimization"]["stage"] == 0
    assert _deepspeed_config(TrainConfig(zero_stage=0), world=1, zero_stage=2)["zero_optimization"]["stage"] == 2
    ds = _deepspeed_config(TrainConfig(zero_stage=2, batch_size=4, grad_accum=3, grad_clip=0.5), world=2)
    assert ds["zero_optimization"]["stage"] == 2
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"], ds["gradient_clipping"]) == (24, 3, 0.5)


def test_flags_map_onto_train_config():
    parser = add_train_args(argparse.ArgumentParser())
    args = parser.parse_args(["--workers", "4", "--use-gpu", "--zero-stage", "3", "--batch-size", "32",
                              "--lr", "3e-5", "--max-steps", "500", "--eval-every", "50",
                              "--grad-accum", "2", "--precision", "bf16", "--no-resume"])
    c = config_from_args(args, output_dir="W/checkpoints/x", lr=1e-3, warmup_steps=10)
    assert (c.workers, c.use_gpu, c.zero_stage, c.batch_size, c.max_steps, c.eval_every, c.grad_accum,
            c.precision, c.resume) == (4, True, 3, 32, 500, 50, 2, "bf16", False)
    assert c.lr == 3e-5                         # the flag wins over the job's default
    assert c.warmup_steps == 10 and c.output_dir == "W/checkpoints/x"   # job defaults where no flag
    d = config_from_args(parser.parse_args([]))
    assert d == TrainConfig()


@pytest.mark.parametrize("bad", [dict(zero_stage=4), dict(precision="fp16"), dict(workers=0), dict(weight_ensemble=1.5),
                                 dict(max_steps=0), dict(grad_accum=0)])
def test_invalid_config_is_refused(bad):
    with pytest.raises(ConfigError, match="TrainConfig"):
        TrainConfig(**bad).validate()


def test_an_invalid_field_names_its_flag_when_built_from_flags():
    with pytest.raises(ConfigError, match=r"^TrainConfig\.max_steps must be >= 1, got 0$"):
        TrainConfig(max_steps=0)   # refused as it is made, not first in fit
    parser = add_train_args(argparse.ArgumentParser())
    with pytest.raises(ConfigError, match=r"^--max-steps must be >= 1, got 0$"):
        config_from_args(parser.parse_args(["--max-steps", "0"]))
    with pytest.raises(ConfigError, match=r"^--cpus-per-worker must be >= 1, got 0$"):
        config_from_args(parser.parse_args(["--cpus-per-worker", "0"]))
    with pytest.raises(ConfigError, match=r"^--lr must be > 0, got -1.0$"):   # a job's own default is named too
        config_from_args(parser.parse_args([]), lr=-1.0)


def test_bad_inputs_are_refused_before_training(tmp_path):
    dev = make_dev(2, 3)
    with pytest.raises(ConfigError, match="lack columns.*neg_text"):
        fit(ToyTask(), make_triples(10).drop(["neg_text"]), dev, _config(tmp_path))
    with pytest.raises(ConfigError, match="fewer than workers x batch_size = 32"):
        fit(ToyTask(), make_triples(10), dev, _config(tmp_path))
    broken = make_dev(2, 3)
    broken.doc_text.pop(next(iter(broken.doc_text)))
    with pytest.raises(ConfigError, match="no entry in doc_text"):
        fit(ToyTask(), make_triples(10), broken, _config(tmp_path))

    class ManyForwardsToyTask(ToyTask):  # e.g. CK-QTI's impact dev scoring
        dev_scoring_forwards_per_chunk_fixed = False

    with pytest.raises(ConfigError, match="ZeRO-3 .* cannot pair across workers; use --zero-stage 2"):
        fit(ManyForwardsToyTask(), make_triples(40), dev, _config(tmp_path, zero_stage=3))


def test_worker_errors_of_ours_are_surfaced_from_rays_wrappers():
    from ray.exceptions import RayTaskError
    from ray.train import WorkerGroupError

    from ckray.training.loop import _find_ckray_error

    original = ConfigError("worker 1 got no full batch of 8 triples")
    wrapped = RayTaskError("train_fn", "Traceback ...", original).as_instanceof_cause()
    found = _find_ckray_error(WorkerGroupError("worker 1 failed", {1: wrapped}))
    assert type(found) is ConfigError and str(found) == str(original)
    assert _find_ckray_error(WorkerGroupError("boom", {0: RuntimeError("x")})) is None


def test_half_written_training_checkpoint_is_named(tmp_path):
    with pytest.raises(MissingArtifactError, match=f"half-written: {STATE_FILE} is missing"):
        verify_checkpoint(tmp_path)
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 3, "files": {"deepspeed/x.pt": 10}}))
    with pytest.raises(MissingArtifactError, match="incomplete: deepspeed/x.pt is missing"):
        verify_checkpoint(tmp_path)


def test_a_run_directory_without_rays_record_resumes_only_when_it_holds_no_checkpoint(tmp_path):
    """No run directory, or one of a run stopped before its first checkpoint: a fresh run, as Ray starts
    one. A checkpoint of ours with no record of Ray's beside it: refused, naming the run."""
    from ckray.training.checkpointing import ATTEMPTS_DIR, _check_resumable

    run = tmp_path / "toy"
    config = _config(tmp_path)
    assert _check_resumable(str(run), config) is None
    (run / ATTEMPTS_DIR / "fit-1").mkdir(parents=True)
    (run / ATTEMPTS_DIR / "fit-1" / "1.json").write_text('{"start_step": 0}')
    assert _check_resumable(str(run), config) is None
    (run / "checkpoint_1" / "deepspeed").mkdir(parents=True)
    with pytest.raises(MissingArtifactError, match=f"cannot resume training run {run}: .*--no-resume"):
        _check_resumable(str(run), config)


def test_config_and_flags_import_neither_torch_nor_ray():
    """A job's --help and its flag errors come before torch and Ray are imported."""
    import subprocess

    code = ("import sys, ckray.training.flags, ckray.training.config, ckray.training.task; "
            "print(sorted(m for m in ('torch', 'ray', 'numpy', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_among_equal_dev_metrics_the_latest_kept_step_is_chosen():
    """A resumed run registers its checkpoints in another order than an uninterrupted one; the choice
    among equal dev metrics must not follow that order."""
    from types import SimpleNamespace

    from ckray.training.loop import best_checkpoint

    result = SimpleNamespace(best_checkpoints=[("c4", {METRIC: 0.5, "step": 4}), ("c2", {METRIC: 0.5, "step": 2}),
                                               ("c6", {METRIC: 0.4, "step": 6})])
    assert best_checkpoint(result) == "c4"
    result.best_checkpoints.reverse()
    assert best_checkpoint(result) == "c4"
    result.best_checkpoints.append(("c8", {METRIC: 0.5, "step": 8}))
    assert best_checkpoint(result) == "c8"
    result.best_checkpoints.append(("c3", {METRIC: 0.7, "step": 3}))
    assert best_checkpoint(result) == "c3"
