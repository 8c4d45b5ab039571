"""Reranker + first-stage interpolation (ckray.fusion) and the ``first+reranker`` pipeline names."""

import dataclasses
import json
import math
from dataclasses import dataclass

import pytest
import torch

from ckray.errors import ConfigError, MissingArtifactError
from ckray.eval import paired_difference
from ckray.fusion import (DEFAULT_WEIGHT_RULE, FusedRetriever, InterpolationConfig, above_rest, grid_search, interpolate, judged_queries,
                          linear_fusion, load_interpolation, reciprocal_rank_fusion, save_interpolation, tune_weight)
from ckray.pipelines import is_interpolated, parse_pipeline

FIRST = {"q": [("a", 30.0), ("b", 20.0), ("c", 10.0), ("tail1", 5.0), ("tail2", 4.0)]}
# the reranker prefers c, then b, then a
RERANKED = {"q": [("c", 0.9), ("b", 0.5), ("a", 0.1), ("tail1", -10.0), ("tail2", -11.0)]}


def order(run):
    return [d for d, _ in run["q"]]


def test_zero_weight_is_the_reranker_and_a_large_weight_the_first_stage():
    assert order(interpolate(FIRST, RERANKED, depth=3, weight=0.0)) == ["c", "b", "a", "tail1", "tail2"]
    assert order(interpolate(FIRST, RERANKED, depth=3, weight=50.0)) == ["a", "b", "c", "tail1", "tail2"]


def test_formula_is_z_rerank_plus_w_z_first():
    run = interpolate(FIRST, RERANKED, depth=3, weight=0.5)
    scores = dict(run["q"])
    # z over the top 3: first (30, 20, 10) → (1.2247, 0, -1.2247); rerank (0.1, 0.5, 0.9) for a, b, c
    z = 1.224744871391589
    assert scores["a"] == pytest.approx(-z + 0.5 * z)
    assert scores["b"] == pytest.approx(0.0)
    assert scores["c"] == pytest.approx(z - 0.5 * z)
    assert scores["tail1"] < min(scores["a"], scores["b"], scores["c"]) and scores["tail2"] < scores["tail1"]


def test_score_scale_of_either_stage_does_not_matter():
    scaled = {"q": [(d, 1000.0 * s + 7.0) for d, s in RERANKED["q"]]}
    got, want = interpolate(FIRST, scaled, 3, 0.7)["q"], interpolate(FIRST, RERANKED, 3, 0.7)["q"]
    assert [d for d, _ in got] == [d for d, _ in want]
    assert [s for _, s in got] == pytest.approx([s for _, s in want])


def test_missing_reranked_document_is_named():
    with pytest.raises(KeyError, match="'c'"):
        interpolate(FIRST, {"q": [("a", 1.0), ("b", 0.0)]}, depth=3, weight=1.0)


def test_tuning_picks_a_weight_that_ranks_the_relevant_document_first():
    # relevant: b. Reranker alone puts c first, first stage alone puts a first; the sum puts b first.
    first = {"q": [("a", 3.0), ("b", 2.9), ("c", 0.0)]}
    reranked = {"q": [("a", 0.0), ("b", 0.9), ("c", 1.0)]}
    tuned = tune_weight(first, reranked, {"q": {"b": 1}}, depth=3, grid=[0.0, 1.0, 100.0])
    assert tuned.weight == 1.0
    assert tuned.table["1.0"] == pytest.approx(1.0) and tuned.table["0.0"] < 1.0 and tuned.table["100.0"] < 1.0
    with pytest.raises(ConfigError, match="relevant judgment"):
        tune_weight(first, reranked, {"other": {"b": 1}}, depth=3)


def test_grid_search_takes_the_best_weight_and_the_smaller_of_ties():
    # relevant: x. weight·a + b puts x first for every weight above 1 (a: 2 vs 1, b: 0 vs 1)
    cands = {"q": {"x": (2.0, 0.0), "y": (1.0, 1.0)}}
    best, table = grid_search(lambda w: linear_fusion(cands, w), {"q": {"x": 1}}, [3.0, 0.5, 2.0, 1.5])
    assert list(table) == [0.5, 1.5, 2.0, 3.0] and best == 1.5
    assert table[1.5] == table[2.0] == table[3.0] == pytest.approx(1.0) and table[0.5] < 1.0


def test_only_queries_with_a_relevant_judgment_tune_a_weight():
    qrels = {"a": {"d": 1}, "b": {"d": 0}, "c": {"d": 2}, "gone": {"d": 1}}
    assert judged_queries(qrels, {"a", "b", "c"}, "tune_lambda") == {"a": {"d": 1}, "c": {"d": 2}}
    with pytest.raises(ConfigError, match="tune_lambda: none of the 1 queries has a relevant judgment"):
        judged_queries(qrels, {"b"}, "tune_lambda")


def test_rest_follows_the_rescored_top_in_its_order_below_it():
    assert above_rest([("a", 0.5), ("b", 2.0)], [("c", 9.0), ("d", 8.0)]) == \
        [("b", 2.0), ("a", 0.5), ("c", -0.5), ("d", -1.5)]
    assert above_rest([], [("c", 9.0)]) == [("c", -1.0)]


def test_reciprocal_rank_fusion_and_the_fused_retriever():
    fused = reciprocal_rank_fusion([[("a", 3.0), ("b", 2.0)], [("b", 0.9), ("c", 0.1)]], k=3, rrf_k=1)
    assert fused == [("b", pytest.approx(1 / 3 + 1 / 2)), ("a", pytest.approx(1 / 2)), ("c", pytest.approx(1 / 3))]

    class Fixed:
        def __init__(self, hits):
            self.hits = hits

        def search(self, queries, k):
            return {q: self.hits[:k] for q in queries}

    retriever = FusedRetriever([Fixed([("a", 3.0), ("b", 2.0)]), Fixed([("b", 0.9), ("c", 0.1)])], rrf_k=1)
    assert retriever.search({"q": "text"}, k=2) == {"q": fused[:2]}
    with pytest.raises(ConfigError, match="at least one retriever"):
        FusedRetriever([])


def _ranks_as_run(ranks: dict[str, int]):
    """A run that puts each query's relevant document "r" at the given rank (1 = first)."""
    return {q: [(f"n{i}", 10.0 - i) for i in range(1, rank)] + [("r", 0.0)] for q, rank in ranks.items()}


def test_the_one_se_rule_takes_the_largest_weight_within_one_paired_standard_error_of_the_best():
    qrels = {f"q{i}": {"r": 1} for i in range(1, 7)}
    ranks = {0.0: {"q1": 1, "q2": 1, "q3": 1, "q4": 1, "q5": 1, "q6": 2},  # the best (0.9385), tied with 1.0
             1.0: {"q1": 2, "q2": 1, "q3": 1, "q4": 1, "q5": 1, "q6": 1},  # same mean: q1 loses what q6 gains
             2.0: {"q1": 3, "q2": 3, "q3": 3, "q4": 1, "q5": 1, "q6": 1}}  # 0.188 worse, SE of that 0.150
    fused = lambda w: _ranks_as_run(ranks[w])  # noqa: E731
    best, table = grid_search(fused, qrels, [2.0, 0.0, 1.0], rule="best")
    assert best == 0.0 and list(table) == [0.0, 1.0, 2.0]
    assert table[0.0] == pytest.approx(table[1.0]) and table[2.0] < table[0.0] - 0.15
    chosen, same_table = grid_search(fused, qrels, [2.0, 0.0, 1.0], rule="one-se")
    assert chosen == 1.0 and same_table == table
    # with 2.0 as good on q4–q6 but only a little worse on q1–q3, it is within one SE and taken
    ranks[2.0] = {"q1": 2, "q2": 1, "q3": 1, "q4": 1, "q5": 1, "q6": 2}
    assert grid_search(fused, qrels, [0.0, 1.0, 2.0], rule="one-se")[0] == 2.0
    with pytest.raises(ConfigError, match="unknown rule for choosing w: 'median'"):
        grid_search(fused, qrels, [0.0], name="w", rule="median")


def test_a_paired_difference_is_the_mean_of_per_query_differences_with_its_standard_error():
    mean, se = paired_difference([0.5, 0.7, 1.0], [0.5, 0.5, 0.5])   # differences 0, 0.2, 0.5
    assert mean == pytest.approx(0.7 / 3)
    assert se == pytest.approx(math.sqrt(((0 - 0.7 / 3) ** 2 + (0.2 - 0.7 / 3) ** 2 + (0.5 - 0.7 / 3) ** 2) / 2 / 3))
    assert paired_difference([0.3], [0.1]) == (pytest.approx(0.2), 0.0)
    assert paired_difference([0.4, 0.6], [0.4, 0.6]) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same queries, got 2 and 1"):
        paired_difference([0.1, 0.2], [0.1])


def test_tuned_weights_record_their_rule():
    first = {"q": [("a", 3.0), ("b", 2.9), ("c", 0.0)]}
    reranked = {"q": [("a", 0.0), ("b", 0.9), ("c", 1.0)]}
    assert tune_weight(first, reranked, {"q": {"b": 1}}, depth=3, grid=[0.0, 1.0]).rule == DEFAULT_WEIGHT_RULE == "one-se"
    assert tune_weight(first, reranked, {"q": {"b": 1}}, depth=3, grid=[0.0, 1.0], rule="best").rule == "best"


def test_weights_are_saved_per_pipeline_and_a_missing_one_names_the_file(tmp_path):
    with pytest.raises(MissingArtifactError, match=r"fusion/bm25\+cedr-knrm\.json"):
        load_interpolation(tmp_path, "bm25", "cedr-knrm")
    save_interpolation(tmp_path, "bm25", "cedr-knrm", InterpolationConfig(weight=0.4, depth=50, dev_queries=7))
    loaded = load_interpolation(tmp_path, "bm25", "cedr-knrm")
    assert (loaded.weight, loaded.depth, loaded.dev_queries) == (0.4, 50, 7)


def test_pipeline_names_with_plus():
    assert parse_pipeline("clear+cedr-knrm") == ("clear", "cedr-knrm")
    assert is_interpolated("bm25+qds") and not is_interpolated("bm25>qds")
    with pytest.raises(ConfigError, match="needs a reranker"):
        parse_pipeline("bm25+")
    with pytest.raises(ConfigError, match="unknown reranker"):
        parse_pipeline("bm25+nope")


@dataclass
class _TinyConfig:
    dim: int = 3


class _TinyModel(torch.nn.Module):
    def __init__(self, config: _TinyConfig):
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(config.dim, 1)


def test_saved_weight_is_reused_until_the_reranker_its_windows_or_the_first_stage_index_changes(tmp_path, monkeypatch):
    import ckray.evaluation
    from ckray.lexical.bm25 import META, bm25_index_dir
    from ckray.models.checkpoint import save_model
    from ckray.pipelines import checkpoint_dir

    save_model(_TinyModel(_TinyConfig()), checkpoint_dir(tmp_path, "cedr-knrm"))
    bm25_meta = bm25_index_dir(tmp_path) / META
    bm25_meta.parent.mkdir(parents=True)
    bm25_meta.write_text(json.dumps({"shards": "first build"}))
    tunings = []

    def tune(workdir, pipeline, queries, qrels, depth, train_split, rule, passages, choice):  # the real one reranks
        tunings.append(depth)
        config = InterpolationConfig(weight=0.5, depth=depth, rule=rule, **ckray.evaluation.interpolation_stamps(
            workdir, "bm25", "cedr-knrm", passages, choice))
        save_interpolation(workdir, "bm25", "cedr-knrm", config)
        return config

    monkeypatch.setattr(ckray.evaluation, "tune_interpolation", tune)

    def ensure(depth=30, passages=1, choice="query"):
        return ckray.evaluation.ensure_interpolation(str(tmp_path), "bm25+cedr-knrm", {}, {"train": {}}, depth,
                                                     rerank_passages=passages, window_choice=choice)

    ensure(), ensure()
    assert tunings == [30]                       # tuned once, then reused
    bm25_meta.write_text(json.dumps({"shards": "rebuilt from other shards"}))
    ensure(), ensure()
    assert tunings == [30, 30]                   # the first stage's index changed
    save_model(_TinyModel(_TinyConfig(dim=4)), checkpoint_dir(tmp_path, "cedr-knrm"))
    ensure()
    assert tunings == [30, 30, 30]               # another reranker checkpoint
    ensure(depth=50)
    assert tunings == [30, 30, 30, 50]           # another depth
    assert load_interpolation(tmp_path, "bm25", "cedr-knrm").depth == 50
    stale = load_interpolation(tmp_path, "bm25", "cedr-knrm")
    save_interpolation(tmp_path, "bm25", "cedr-knrm", dataclasses.replace(stale, rule="best"))
    ensure(depth=50), ensure(depth=50)
    assert tunings == [30, 30, 30, 50, 50]       # chosen by another rule: tuned again, once
    ensure(depth=50, passages=0), ensure(depth=50, passages=0)
    assert tunings == [30, 30, 30, 50, 50, 50]   # the reranker reads every window of a long document: once more
    assert load_interpolation(tmp_path, "bm25", "cedr-knrm").reranker_passages == 0
    ensure(depth=50, passages=0, choice="first")
    assert len(tunings) == 6                     # every window is read: no choice to make, nothing to tune
    ensure(depth=50, passages=4), ensure(depth=50, passages=4, choice="query")
    assert len(tunings) == 7                     # four windows, those matching the query: once more
    ensure(depth=50, passages=4, choice="first")
    assert len(tunings) == 8                     # the first four instead
    assert load_interpolation(tmp_path, "bm25", "cedr-knrm").reranker_window_choice == "first"


def test_without_training_queries_the_weight_saved_with_the_checkpoint_is_used_for_its_first_stage_only(tmp_path):
    import ckray.evaluation
    from ckray.deploy import deploy_path, read_deploy, save_fusion_weight
    from ckray.models.checkpoint import save_model
    from ckray.pipelines import checkpoint_dir

    trained = save_model(_TinyModel(_TinyConfig()), tmp_path / "train" / "checkpoints" / "cedr-knrm")
    target = tmp_path / "target"
    checkpoint_dir(target, "cedr-knrm").parent.mkdir(parents=True)
    checkpoint_dir(target, "cedr-knrm").symlink_to(trained)
    no_train = {"test": {"q": {"d": 1}}}

    def ensure(pipeline, depth=30):
        return ckray.evaluation.ensure_interpolation(str(target), pipeline, {}, no_train, depth)

    with pytest.raises(MissingArtifactError, match="no training queries.*--fusion-weight"):
        ensure("bm25+cedr-knrm")
    save_fusion_weight(trained, "bm25", {"weight": 0.7, "depth": 30, "tuned_on": {"dev_queries": 12}})
    carried = ensure("bm25+cedr-knrm")
    assert carried.weight == 0.7 and carried.source == str(deploy_path(trained.resolve()))
    saved = load_interpolation(target, "bm25", "cedr-knrm")    # what evaluation, its stamp and Serve read
    assert (saved.weight, saved.source) == (0.7, carried.source)
    assert ckray.evaluation.interpolation_setting(str(target), "bm25", "cedr-knrm")["source"] == carried.source
    assert ckray.evaluation.interpolation_setting(str(target), "bm25", "cedr-knrm", 0.2) == {"value": 0.2,
                                                                                            "source": "flag"}
    with pytest.raises(ConfigError, match=r"tuned for first stage\(s\) bm25, not for 'clear'"):
        ensure("clear+cedr-knrm")
    # re-tuned where it was trained: the target reads the new weight, and says by which rule
    save_fusion_weight(trained, "bm25", {"weight": 1.9, "depth": 30, "rule": "one-se", "tuned_on": {"dev_queries": 12}})
    assert (ensure("bm25+cedr-knrm").weight, load_interpolation(target, "bm25", "cedr-knrm").rule) == (1.9, "one-se")
    assert ckray.evaluation.interpolation_setting(str(target), "bm25", "cedr-knrm")["rule"] == "one-se"
    # a retrained checkpoint: the saved weight was another model's and is not used
    save_model(_TinyModel(_TinyConfig(dim=4)), trained)
    assert read_deploy(trained) == {}
    with pytest.raises(MissingArtifactError):
        ensure("bm25+cedr-knrm")


def test_a_weight_carried_over_another_clear_model_than_the_target_index_was_built_with_is_an_error(tmp_path, caplog):
    """w is tuned over one first-stage model's scores: carried to a collection whose CLEAR index was built
    with another checkpoint, it is refused, naming both models; over the same model it is used."""
    import ckray.evaluation
    from ckray.deploy import save_fusion_weight
    from ckray.fusion import InterpolationConfig
    from ckray.models.checkpoint import save_model
    from ckray.pipelines import checkpoint_dir, first_stage_models

    def clear_index(workdir, digest):
        meta = workdir / "dense" / "index" / "meta.json"
        meta.parent.mkdir(parents=True, exist_ok=True)
        meta.write_text(json.dumps({"checkpoint_sha256": digest, "count": 3}))

    trained = save_model(_TinyModel(_TinyConfig()), tmp_path / "train" / "checkpoints" / "cedr-knrm")
    clear_index(tmp_path / "train", "a" * 64)
    assert first_stage_models(tmp_path / "train", "clear") == ["a" * 64] and first_stage_models(tmp_path / "train", "bm25") == []
    ckray.evaluation.save_with_checkpoint(str(tmp_path / "train"), "clear", "cedr-knrm",
                                          InterpolationConfig(weight=1.7, depth=30, table={}, dev_queries=12))
    target = tmp_path / "target"
    checkpoint_dir(target, "cedr-knrm").parent.mkdir(parents=True)
    checkpoint_dir(target, "cedr-knrm").symlink_to(trained)

    def ensure():
        return ckray.evaluation.ensure_interpolation(str(target), "clear+cedr-knrm", {}, {"test": {"q": {"d": 1}}}, 30)

    clear_index(target, "b" * 64)                       # the target's CLEAR index: another model
    with pytest.raises(ConfigError, match=r"tuned over the clear model\(s\) aaaaaaaaaaaa, but .* built with bbbbbbbbbbbb "
                                          r".*meta.json.*--fusion-weight"):
        ensure()
    clear_index(target, "a" * 64)                       # rebuilt with the model w was tuned over
    assert ensure().weight == 1.7
    # a weight saved before the model was recorded: used, with a warning that it cannot be checked
    save_fusion_weight(trained, "clear", {"weight": 0.9, "depth": 30, "tuned_on": {"dev_queries": 12}})
    clear_index(target, "b" * 64)
    with caplog.at_level("WARNING", logger="ckray.evaluation"):
        assert ensure().weight == 0.9
    assert "does not say which clear model" in caplog.text


def test_evaluating_first_plus_and_first_greater_reranker_together_reranks_once(tmp_path, monkeypatch):
    import ckray.evaluation
    from ckray.data.sample import generate_sample

    pairs = []

    def pair(config, first, reranker, names):  # the real one: tests/test_pipeline.py (figures equal each alone)
        pairs.append((first, reranker, names))
        plain, plus = names
        return {plus: {"nDCG@10": 0.2}, plain: {"nDCG@10": 0.1}}

    monkeypatch.setattr(ckray.evaluation, "evaluate_reranker_pair", pair)
    data = str(generate_sample(tmp_path / "data"))
    names = ["bm25+cedr-knrm", "bm25>cedr-knrm"]
    results = ckray.evaluation.evaluate_pipelines(ckray.evaluation.EvaluateConfig(
        data=data, workdir=str(tmp_path / "w"), pipelines=names, split="test"))
    assert pairs == [("bm25", "cedr-knrm", ("bm25>cedr-knrm", "bm25+cedr-knrm"))]
    assert list(results) == names and results["bm25+cedr-knrm"] == {"nDCG@10": 0.2}
    # an alias pairs too, and its run keeps the name it was asked for (ck-qti-rerank = bm25>ck-qti)
    pairs.clear()
    names = ["ck-qti-rerank", "bm25+ck-qti"]
    results = ckray.evaluation.evaluate_pipelines(ckray.evaluation.EvaluateConfig(
        data=data, workdir=str(tmp_path / "w"), pipelines=names, split="test"))
    assert pairs == [("bm25", "ck-qti", ("ck-qti-rerank", "bm25+ck-qti"))]
    assert results == {"ck-qti-rerank": {"nDCG@10": 0.1}, "bm25+ck-qti": {"nDCG@10": 0.2}}


def test_an_unknown_weight_rule_is_refused_before_any_work():
    from ckray.benchmark import BenchmarkConfig
    from ckray.evaluation import EvaluateConfig

    assert EvaluateConfig(data="d", workdir="w").weight_rule == DEFAULT_WEIGHT_RULE
    with pytest.raises(ConfigError, match="weight_rule.*'argmax'"):
        EvaluateConfig(data="d", workdir="w", weight_rule="argmax")
    with pytest.raises(ConfigError, match="weight_rule.*'argmax'"):
        BenchmarkConfig(data=["d"], checkpoints="c", weight_rule="argmax")


def test_measurement_splits_hold_out_training_queries_and_report_the_named_split(tmp_path):
    """bench/'s query sets: dev = held-back *training* queries (absent without training qrels), the
    named split its judged queries; a split the collection lacks is an error naming the choices."""
    from ckray.data.collections import read_queries_and_qrels
    from ckray.fusion import dev_queries, measurement_splits

    (tmp_path / "qrels").mkdir()
    (tmp_path / "corpus.jsonl").write_text("".join(f'{{"_id": "d{i}", "title": "", "text": "w{i}"}}\n'
                                                   for i in range(4)))
    (tmp_path / "queries.jsonl").write_text("".join(f'{{"_id": "q{i}", "text": "w{i}"}}\n' for i in range(60)))
    header = "query-id\tcorpus-id\tscore\n"
    (tmp_path / "qrels" / "train.tsv").write_text(header + "".join(f"q{i}\td{i % 4}\t1\n" for i in range(50)))
    (tmp_path / "qrels" / "test.tsv").write_text(header + "".join(f"q{i}\td{i % 4}\t1\n" for i in range(50, 60)))
    splits = measurement_splits(tmp_path, "test")
    assert list(splits) == ["dev", "test"]
    dev_q, dev_qrels = splits["dev"]
    assert dev_q and set(dev_q) < {f"q{i}" for i in range(50)} and set(dev_qrels) == set(dev_q)
    assert set(dev_q) == set(dev_queries(*read_queries_and_qrels(tmp_path), max_queries=10**6)[0])
    assert set(splits["test"][0]) == {f"q{i}" for i in range(50, 60)}
    (tmp_path / "qrels" / "train.tsv").unlink()
    assert list(measurement_splits(tmp_path, "test")) == ["test"]
    with pytest.raises(ConfigError, match="'dev'.*\\['test'\\]"):
        measurement_splits(tmp_path, "dev")
