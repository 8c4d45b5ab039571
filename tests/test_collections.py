"""Readers: BEIR, MS MARCO, TREC qrels and runs; every bad input named by file and line."""

import json

import pytest

from ckray.data.collections import (load_collection, read_beir_qrels, read_trec_qrels, read_trec_run,
                                    write_trec_run)
from ckray.errors import CollectionError


def write_beir(tmp_path, corpus_lines, queries=None, qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\n"):
    (tmp_path / "qrels").mkdir(exist_ok=True)
    (tmp_path / "corpus.jsonl").write_text("".join(l + "\n" for l in corpus_lines))
    queries = queries or [{"_id": "q1", "text": "alpha beta"}]
    (tmp_path / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (tmp_path / "qrels" / "test.tsv").write_text(qrels)
    return tmp_path


GOOD = [json.dumps({"_id": "d1", "title": "Alpha", "text": "alpha beta"}),
        json.dumps({"_id": "d2", "title": "", "text": "gamma"})]


def test_beir_reader_reads_corpus_queries_qrels(tmp_path):
    c = load_collection(write_beir(tmp_path, GOOD))
    assert c.loaded_corpus is None  # not read until asked for
    assert c.corpus.column("doc_id").to_pylist() == ["d1", "d2"]
    assert c.queries == {"q1": "alpha beta"}
    assert c.qrels == {"test": {"q1": {"d1": 1}}}
    assert c.split_queries("test") == {"q1": "alpha beta"}
    assert c.stats["documents"] == 2 and c.stats["empty_documents"] == 0


def test_malformed_json_line_is_named(tmp_path):
    write_beir(tmp_path, [GOOD[0], '{"_id": "d2", "text": ', GOOD[1]])
    with pytest.raises(CollectionError, match=r"corpus\.jsonl:2: malformed JSON: Expecting value at column 23$"):
        load_collection(tmp_path)
    # json's own message ends in "at" for some errors ("Invalid control character at"): said once
    write_beir(tmp_path, [GOOD[0], '{"_id": "d2", "text": "a\tb"}'])
    with pytest.raises(CollectionError, match=r"corpus\.jsonl:2: malformed JSON: Invalid control character at "
                                              r"column 25$"):
        load_collection(tmp_path)


def test_missing_id_is_named(tmp_path):
    write_beir(tmp_path, [GOOD[0], json.dumps({"title": "x", "text": "y"})])
    with pytest.raises(CollectionError, match=r"corpus\.jsonl:2: missing '_id'"):
        load_collection(tmp_path)


def test_duplicate_doc_id_is_refused_when_the_corpus_is_read_whole(tmp_path):
    # load_collection keeps no set of ids: prepare finds duplicates with both lines (test_prepare)
    c = load_collection(write_beir(tmp_path, [GOOD[0], GOOD[0]]))
    assert c.stats["documents"] == 2
    with pytest.raises(CollectionError, match=r"duplicate doc id 'd1'"):
        c.corpus


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    write_beir(tmp_path, GOOD)
    with open(tmp_path / "corpus.jsonl", "ab") as f:
        f.write(b'{"_id": "d3", "text": "caf\xe9"}\n')
    with pytest.raises(CollectionError, match=r"corpus\.jsonl:3: not UTF-8 \(invalid continuation byte at byte 27\)$"):
        load_collection(tmp_path)


LOAD_AND_REPORT_RSS = """
import resource, sys
from ckray.data.collections import load_collection
c = load_collection(sys.argv[1])
assert c.loaded_corpus is None, "the corpus was read whole"
print(c.stats["documents"], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def _peak_rss_loading(path) -> tuple[int, int]:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LOAD_AND_REPORT_RSS, str(path)], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), int(out[1])


def test_load_collection_streams_the_corpus_its_memory_does_not_grow_with_it(tmp_path):
    """Peak RSS of a process that loads a 60 MB corpus vs. a 2-document one: the difference is far below
    the corpus's bytes (an Arrow table of it alone would hold them all)."""
    big = tmp_path / "big"
    big.mkdir()
    body = " ".join(f"word{i % 997}" for i in range(200))  # ~1.6 KB a document
    write_beir(big, [json.dumps({"_id": f"d{i}", "title": f"t{i}", "text": body}) for i in range(40_000)],
               qrels="query-id\tcorpus-id\tscore\nq1\td7\t1\nq1\tnope\t1\n")
    corpus_bytes = (big / "corpus.jsonl").stat().st_size
    assert corpus_bytes > 60e6
    (tmp_path / "small").mkdir()
    small = write_beir(tmp_path / "small", GOOD)
    docs_big, rss_big = _peak_rss_loading(big)
    docs_small, rss_small = _peak_rss_loading(small)
    assert (docs_big, docs_small) == (40_000, 2)
    assert rss_big - rss_small < corpus_bytes / 6, (rss_big, rss_small, corpus_bytes)
    c = load_collection(big)
    mean_title = sum(len(f"t{i}") for i in range(40_000)) / 40_000
    assert c.stats["unknown_docs"] == 1 and c.stats["mean_chars"] == pytest.approx(mean_title + 1 + len(body))


def test_non_integer_relevance_is_named(tmp_path):
    write_beir(tmp_path, GOOD, qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\td2\thigh\n")
    with pytest.raises(CollectionError, match=r"test\.tsv:3: relevance 'high' is not an integer"):
        load_collection(tmp_path)


def test_unknown_docs_and_queries_are_counted_and_reported_once_or_refused_when_strict(tmp_path, caplog):
    write_beir(tmp_path, GOOD, qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq1\tnope\t1\nq9\td2\t1\n")
    with caplog.at_level("WARNING", logger="ckray.data.collections"):
        c = load_collection(tmp_path)
    assert c.stats["unknown_docs"] == 1 and c.stats["unknown_queries"] == 1
    assert c.qrels["test"] == {"q1": {"d1": 1, "nope": 1}, "q9": {"d2": 1}}  # kept
    reports = [r.getMessage() for r in caplog.records if "qrels name" in r.getMessage()]
    assert len(reports) == 1 and "1 document(s) not in the corpus and 1 query(ies) without a text" in reports[0]
    assert "doc 'nope' (query 'q1')" in reports[0] and "query 'q9'" in reports[0]
    with pytest.raises(CollectionError, match=r"qrels name 1 document\(s\) not in the corpus and 1 query"):
        load_collection(tmp_path, strict_qrels=True)


def test_empty_documents_are_kept_and_counted(tmp_path):
    c = load_collection(write_beir(tmp_path, GOOD + [json.dumps({"_id": "d3", "title": "", "text": ""})]))
    assert c.corpus.num_rows == 3
    assert c.stats["empty_documents"] == 1


def test_msmarco_layout(tmp_path):
    (tmp_path / "collection.tsv").write_text("0\tthe first passage\n1\tthe second passage\n")
    (tmp_path / "queries.dev.tsv").write_text("100\twhat is first\n")
    (tmp_path / "qrels.dev.tsv").write_text("100\t0\t0\t1\n")
    c = load_collection(tmp_path)
    assert c.corpus.column("text").to_pylist() == ["the first passage", "the second passage"]
    assert c.queries == {"100": "what is first"}
    assert c.qrels == {"dev": {"100": {"0": 1}}}


def test_msmarco_bad_line(tmp_path):
    (tmp_path / "collection.tsv").write_text("0\tok\nbroken line without tab\n")
    with pytest.raises(CollectionError, match=r"collection\.tsv:2: expected 'pid<TAB>text'"):
        load_collection(tmp_path)


def test_not_a_collection(tmp_path):
    with pytest.raises(CollectionError, match="not a collection directory"):
        load_collection(tmp_path)
    with pytest.raises(CollectionError, match=f"^{tmp_path / 'nope'}: no such collection directory$"):
        load_collection(tmp_path / "nope")
    (tmp_path / "file").write_text("")
    with pytest.raises(CollectionError, match=f"^{tmp_path / 'file'}: is a file, not a collection directory$"):
        load_collection(tmp_path / "file")


def test_judged_queries_of_a_split_must_have_texts(tmp_path, caplog):
    from ckray.data.collections import judged_queries, read_queries_and_qrels

    write_beir(tmp_path, GOOD, queries=[{"_id": "q1", "text": "alpha"}, {"_id": "q2", "text": "beta"}],
               qrels="query-id\tcorpus-id\tscore\nq1\td1\t1\nq3\td2\t1\n")
    with caplog.at_level("WARNING", logger="ckray.data.collections"):
        assert judged_queries(tmp_path, *read_queries_and_qrels(tmp_path), "test") == {"q1": "alpha"}
    assert "1 of the 2 queries judged in split 'test' have no text (e.g. 'q3'); they score 0" in caplog.text
    (tmp_path / "queries.jsonl").write_text("")
    with pytest.raises(CollectionError, match=rf"^{tmp_path / 'queries.jsonl'}: none of the 2 queries judged in "
                                              rf"split 'test' \({tmp_path / 'qrels' / 'test.tsv'}\) has a text "
                                              r"here \(0 queries in all\)$"):
        judged_queries(tmp_path, *read_queries_and_qrels(tmp_path), "test")


def test_trec_qrels_and_errors(tmp_path):
    p = tmp_path / "qrels.txt"
    p.write_text("q1 0 d1 2\nq1 0 d2 0\n")
    assert read_trec_qrels(p) == {"q1": {"d1": 2, "d2": 0}}
    p.write_text("q1 0 d1 2\nq1 0 d2\n")
    with pytest.raises(CollectionError, match=r"qrels\.txt:2: expected 4 fields"):
        read_trec_qrels(p)
    p.write_text("q1 0 d1 1.5\n")
    with pytest.raises(CollectionError, match=r"qrels\.txt:1: relevance '1.5' is not an integer"):
        read_trec_qrels(p)


def test_beir_qrels_wrong_field_count(tmp_path):
    p = tmp_path / "q.tsv"
    p.write_text("query-id\tcorpus-id\tscore\nq1\td1\n")
    with pytest.raises(CollectionError, match=r"q\.tsv:2: expected 3 tab-separated fields"):
        read_beir_qrels(p)


def test_trec_run_round_trip_sorted(tmp_path):
    run = {"q1": [("d2", 3.5), ("d1", 1.25)], "q2": [("d9", -0.5)]}
    write_trec_run(run, tmp_path / "r.trec")
    assert read_trec_run(tmp_path / "r.trec") == run
    (tmp_path / "bad.trec").write_text("q1 Q0 d1 1 notanumber tag\n")
    with pytest.raises(CollectionError, match=r"bad\.trec:1: score 'notanumber' is not a number"):
        read_trec_run(tmp_path / "bad.trec")


def test_scifact_loads(scifact_dir):
    c = load_collection(scifact_dir)
    assert c.corpus.num_rows == 5183
    assert len(c.qrels["test"]) == 300 and len(c.qrels["train"]) == 809
