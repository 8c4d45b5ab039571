"""Command lines derived from typed options (ckray.options): each flag declared once, on a config field."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckray.errors import ConfigError
from ckray.options import add_options, flags_of, option, options_from_args

ROOT = Path(__file__).resolve().parents[1]
COMMON = {"-h", "--help", "--data", "--workdir", "--address", "--log-level"}


@dataclass
class Example:
    top_k: int = option(64, "terms kept per document")
    mode: str = option("fast", "how", choices=("fast", "exact"))
    gpu: bool = option(False, "use a GPU")
    pair: tuple = option((0, 0), "two numbers", parse=lambda t: tuple(int(x) for x in t.split(",")), metavar="A,B")
    internal: int = 7           # no help: set by code, not a flag

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ConfigError.invalid("Example", "top_k", f"must be >= 1, got {self.top_k}")


def parser_of(cls: type, **kwargs) -> argparse.ArgumentParser:
    return add_options(argparse.ArgumentParser(), cls, **kwargs)


def test_each_field_with_help_is_one_flag_of_its_type():
    p = parser_of(Example)
    assert flags_of(Example) == {"top_k": "--top-k", "mode": "--mode", "gpu": "--gpu", "pair": "--pair"}
    o = options_from_args(Example, p.parse_args(["--top-k", "5", "--mode", "exact", "--gpu", "--pair", "1,2"]))
    assert o == Example(top_k=5, mode="exact", gpu=True, pair=(1, 2), internal=7)
    assert options_from_args(Example, p.parse_args([])) == Example()
    assert options_from_args(Example, p.parse_args(["--no-gpu"])).gpu is False
    with pytest.raises(SystemExit):
        p.parse_args(["--mode", "slow"])          # choices are enforced by argparse
    with pytest.raises(SystemExit):
        p.parse_args(["--internal", "3"])         # not a flag


def test_an_invalid_value_names_its_flag_not_its_field():
    with pytest.raises(ConfigError, match=r"^--top-k must be >= 1, got 0$"):
        options_from_args(Example, parser_of(Example).parse_args(["--top-k", "0"]))


def test_unset_flags_parse_to_none_so_a_jobs_own_defaults_apply_and_help_shows_them():
    p = parser_of(Example, dest_prefix="x_", unset_is_none=True, defaults={"top_k": 32})
    assert p.parse_args([]).x_top_k is None
    assert "terms kept per document (default: 32)" in " ".join(p.format_help().split())
    # precedence: a given flag, then the job's default (overrides), then the dataclass's
    assert options_from_args(Example, p.parse_args([]), dest_prefix="x_", top_k=32).top_k == 32
    assert options_from_args(Example, p.parse_args(["--top-k", "9"]), dest_prefix="x_", top_k=32).top_k == 9
    assert options_from_args(Example, p.parse_args([]), dest_prefix="x_").top_k == 64


def _job_flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of a parser but the common ones (``--qti`` and ``--no-qti`` count once)."""
    strings = [s for a in parser._actions for s in a.option_strings if not s.startswith("--no-") or
               "--" + s[5:] not in a.option_strings]
    return [s for s in strings if s not in COMMON]


@pytest.mark.parametrize("model", ["ck-qti", "clear", "cedr-knrm", "qds"])
def test_every_training_job_flag_is_a_field_of_one_config(model):
    """A training job's flags are exactly the fields of TrainConfig, TrainingDataConfig and the ranker's
    options: none is written by hand, none is declared twice."""
    from ckray.data.examples import TrainingDataConfig
    from ckray.rankers import resolve
    from ckray.stages import stage_parser, training_stage
    from ckray.training import TrainConfig

    flags = _job_flags(stage_parser(f"train:{model}"))
    declared = [*flags_of(TrainConfig).values(), *flags_of(TrainingDataConfig).values(),
                *flags_of(resolve(training_stage(model).options)).values()]
    assert sorted(flags) == sorted(declared)
    assert len(set(declared)) == len(declared)


def test_clears_lambda_train_defaults_to_the_units_of_the_bm25_scale():
    from ckray.rankers.clear.options import CLEAROptions
    from ckray.stages import stage_parser
    from ckray.train_job import training_data_config

    p = stage_parser("train:clear")
    base = ["--data", "D", "--workdir", "W"]
    for extra, want in (([], 0.05), (["--bm25-scale", "query-max"], 0.5),
                        (["--bm25-scale", "query-max", "--lambda-train", "0.3"], 0.3)):
        args = p.parse_args(base + extra)
        assert options_from_args(CLEAROptions, args).lambda_train_for(training_data_config(args).bm25_scale) == want
    with pytest.raises(SystemExit):   # argparse names the choices
        p.parse_args(base + ["--bm25-scale", "max"])


def test_the_main_jobs_flags_are_the_fields_of_its_config():
    from ckray.full_pipeline import FullPipelineConfig

    spec = importlib.util.spec_from_file_location("pipeline_job", ROOT / "jobs" / "pipeline.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    p = job.parser()
    assert sorted(_job_flags(p)) == sorted(set(flags_of(FullPipelineConfig).values()) - {"--data"})  # --data: common
    args = p.parse_args(["--workdir", "W", "--models", "ck-qti, clear", "--max-steps", "3", "--use-gpu"])
    config = options_from_args(FullPipelineConfig, args, workdir=args.workdir)
    assert (config.workdir, config.models, config.max_steps, config.use_gpu, config.split) == \
        ("W", ["ck-qti", "clear"], 3, True, "test")
    assert options_from_args(FullPipelineConfig, p.parse_args(["--workdir", "W", "--models", ""]),
                             workdir="W").models == []
    with pytest.raises(ConfigError, match=r"^--shards must be >= 1, got 0$"):
        options_from_args(FullPipelineConfig, p.parse_args(["--workdir", "W", "--shards", "0"]), workdir="W")


def _load_job(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_job", ROOT / "jobs" / f"{name}.py")
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def test_the_prepare_jobs_flags_are_the_fields_of_its_options():
    from ckray.data.prepare import PrepareOptions

    p = _load_job("prepare").parser()
    assert sorted(_job_flags(p)) == sorted(flags_of(PrepareOptions).values())
    options = options_from_args(PrepareOptions, p.parse_args(["--data", "D", "--workdir", "W", "--no-negatives",
                                                              "--shards", "2"]))
    assert (options.negatives, options.shards, options.threads, options.strict_qrels) == (False, 2, 2, False)
    with pytest.raises(ConfigError, match=r"^--threads must be >= 1, got 0$"):
        options_from_args(PrepareOptions, p.parse_args(["--data", "D", "--workdir", "W", "--threads", "0"]))


def test_the_evaluate_jobs_flags_are_the_fields_of_its_config():
    from ckray.evaluation import EvaluateConfig

    p = _load_job("evaluate").parser()
    assert sorted(_job_flags(p)) == sorted(flags_of(EvaluateConfig).values())
    base = ["--data", "D", "--workdir", "W"]
    c = options_from_args(EvaluateConfig, p.parse_args(base + ["--pipeline", "bm25", "--pipeline", "clear",
                                                              "--lambda", "0.1", "--hybrid-normalization",
                                                              "none"]), data="D", workdir="W")
    assert (c.pipelines, c.lam, c.k, c.fusion_weight) == (["bm25", "clear"], 0.1, 1000, None)
    assert c.hybrid_normalization == "none"
    assert options_from_args(EvaluateConfig, p.parse_args(base), data="D", workdir="W").hybrid_normalization is None
    with pytest.raises(SystemExit):   # argparse names the choices
        p.parse_args(base + ["--hybrid-normalization", "z"])
    assert options_from_args(EvaluateConfig, p.parse_args(base), data="D", workdir="W").pipelines == ["bm25"]
    with pytest.raises(ConfigError, match=r"^--rerank-depth must be >= 1, got 0$"):
        options_from_args(EvaluateConfig, p.parse_args(base + ["--rerank-depth", "0"]), data="D", workdir="W")


@pytest.mark.parametrize("ranker, options", [("ck-qti", "ImpactIndexOptions"), ("clear", "DenseIndexOptions")])
def test_every_index_job_flag_is_a_field_of_its_options_or_the_actor_pools(ranker, options):
    from ckray.stages import ActorPoolOptions, stage_parser

    cls = getattr(importlib.import_module(f"ckray.rankers.{ranker.replace('-', '_')}.options"), options)
    flags = _job_flags(stage_parser(f"index:{ranker}"))
    declared = [*flags_of(cls).values(), *flags_of(ActorPoolOptions).values()]
    assert sorted(flags) == sorted(declared) and len(set(declared)) == len(declared)


def test_the_benchmark_jobs_flags_are_its_configs_fields_and_those_of_the_indexes_it_passes_on(tmp_path):
    from ckray.benchmark import BenchmarkConfig
    from ckray.rankers.ck_qti.options import ImpactIndexOptions
    from ckray.rankers.clear.options import DenseIndexOptions

    job = _load_job("benchmark")
    p = job.parser()
    impact, dense = flags_of(ImpactIndexOptions), flags_of(DenseIndexOptions)
    own = set(flags_of(BenchmarkConfig).values()) - {"--data"}   # --data: in COMMON
    assert sorted(_job_flags(p)) == sorted([*own, "--from-workdir", *(impact[name] for name in job.IMPACT_FLAGS),
                                            *(dense[name] for name in job.DENSE_FLAGS),
                                            *(impact[name] for name in job.BOTH_FLAGS)])
    args = p.parse_args(["--data", str(tmp_path), "--data", str(tmp_path), "--from-workdir", "T", "--top-k", "64",
                         "--doc-max-len", "512", "--lambda-rule", "one-se", "--passages", "4"])
    c = options_from_args(BenchmarkConfig, args, checkpoints="T/checkpoints")
    assert (c.data, c.checkpoints, c.pipelines, args.top_k) == ([str(tmp_path)] * 2, "T/checkpoints", ["bm25"], 64)
    assert (args.doc_max_len, args.lambda_rule, args.passages) == (512, "one-se", 4)
    with pytest.raises(ConfigError, match=r"^--data must name at least one collection$"):
        options_from_args(BenchmarkConfig, p.parse_args([]), checkpoints="T")
