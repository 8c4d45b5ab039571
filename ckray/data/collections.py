"""Collection readers: BEIR layout, MS MARCO TSV, TREC qrels and runs → one representation.

A :class:`Collection` holds queries as a dict and qrels per split, and where its corpus file is; the
corpus itself is streamed, never held: :func:`load_collection` validates it in one pass that keeps one
line at a time (counts, and which judged documents occur), and ``jobs/prepare.py`` shards it with Ray
Data tasks that read byte ranges. ``Collection.corpus`` reads the whole corpus into an Arrow table
(``doc_id, title, text``) on request, for small collections only (tests, examples).

Every reader validates as it reads and raises :class:`CollectionError` naming the file and line:
malformed JSON, a missing ``_id``, a non-integer relevance. A duplicate doc id is found when the
corpus is prepared (from the document store's sorted id hashes, not a set of every id) and named
with both its lines. Qrels naming a document that is not in the corpus, or a query without a text,
are kept, counted (``Collection.stats``) and reported once (a warning), or refused with
``strict_qrels=True``; empty documents are kept and counted.

Layouts:
- BEIR: ``corpus.jsonl`` ({"_id", "title", "text"}), ``queries.jsonl`` ({"_id", "text"}),
  ``qrels/<split>.tsv`` (header ``query-id corpus-id score``).
- MS MARCO: ``collection.tsv`` (``pid<TAB>text``), ``queries.<split>.tsv`` (``qid<TAB>text``),
  ``qrels.<split>.tsv`` (TREC qrels: ``qid 0 pid rel``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import pyarrow as pa

from ckray.errors import CollectionError

log = logging.getLogger(__name__)

Qrels = dict[str, dict[str, int]]
Run = dict[str, list[tuple[str, float]]]

CORPUS_SCHEMA = pa.schema([("doc_id", pa.string()), ("title", pa.string()), ("text", pa.string())])


def doc_text(title: str | None, text: str | None) -> str:
    """The text every neural model reads for a document: title and body in one string."""
    return f"{title or ''} {text or ''}".strip()


@dataclass
class Collection:
    """A corpus, its queries and its relevance judgments, whatever the source format."""

    name: str
    queries: dict[str, str]
    qrels: dict[str, Qrels]
    source: Path | None = None
    stats: dict = field(default_factory=dict)
    loaded_corpus: pa.Table | None = field(default=None, repr=False)  # a corpus made in memory, or read once

    @property
    def corpus(self) -> pa.Table:
        """The whole corpus as one Arrow table, read from ``source`` on first access (and then held): for
        small collections (tests, examples). No job reads it; they stream the corpus file or its shards."""
        if self.loaded_corpus is None:
            if self.source is None:
                raise CollectionError(f"{self.name}: no corpus (neither loaded nor a source directory)")
            cfile, fmt = corpus_file(self.source)
            self.loaded_corpus = corpus_table(parse_corpus_lines(fmt, cfile, corpus_lines(cfile)), cfile)
        return self.loaded_corpus

    @property
    def splits(self) -> list[str]:
        return sorted(self.qrels)

    def split_queries(self, split: str) -> dict[str, str]:
        """The queries that have judgments in ``split`` (and a text)."""
        if split not in self.qrels:
            raise CollectionError(f"{self.name}: no qrels for split {split!r} (have: {', '.join(self.splits) or 'none'})")
        return {q: self.queries[q] for q in self.qrels[split] if q in self.queries}


# --------------------------------------------------------------------------- line readers

def _json_lines(path: Path, first_line: int = 1, lines: Iterable[str] | None = None) -> Iterator[tuple[int, dict]]:
    handle = None
    if lines is None:
        handle = open(path, encoding="utf-8")
        lines = handle
    try:
        for lineno, line in enumerate(lines, start=first_line):
            if not line.strip():
                continue
            try:
                obj = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                raise CollectionError(f"{path}:{lineno}: malformed JSON: {_json_problem(e)}") from None
            if not isinstance(obj, dict):
                raise CollectionError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            yield lineno, obj
    finally:
        if handle is not None:
            handle.close()


def _json_problem(e: json.JSONDecodeError) -> str:
    """What is wrong and where on the (one-line) document: json's messages for some errors already end in
    "at" ("Invalid control character at") → "Invalid control character at column 59"."""
    return f"{e.msg.removesuffix(' at')} at column {e.pos + 1}"


def _need_id(obj: dict, key: str, path: Path, lineno: int) -> str:
    value = obj.get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise CollectionError(f"{path}:{lineno}: missing {key!r} field")
    return str(value)


def parse_beir_corpus_lines(path: Path, lines: Iterable[str], first_line: int = 1) -> Iterator[tuple[str, str, str]]:
    """(doc_id, title, text) for each line of a BEIR ``corpus.jsonl`` (or a slice of it)."""
    for lineno, obj in _json_lines(path, first_line, lines):
        doc_id = _need_id(obj, "_id", path, lineno)
        title, text = obj.get("title") or "", obj.get("text") or ""
        if not isinstance(title, str) or not isinstance(text, str):
            raise CollectionError(f"{path}:{lineno}: 'title' and 'text' must be strings")
        yield doc_id, title, text


def _id_tab_text_lines(path: Path, lines: Iterable[str], id_name: str,
                       first_line: int = 1) -> Iterator[tuple[int, str, str]]:
    """(line number, id, text) of each non-empty ``<id>TAB<text>`` line; a line without a tab or an id is an
    error naming it."""
    for lineno, line in enumerate(lines, start=first_line):
        line = line.rstrip("\r\n")
        if not line:
            continue
        key, tab, text = line.partition("\t")
        if not tab or not key.strip():
            raise CollectionError(f"{path}:{lineno}: expected '{id_name}<TAB>text'")
        yield lineno, key.strip(), text


def parse_msmarco_corpus_lines(path: Path, lines: Iterable[str], first_line: int = 1) -> Iterator[tuple[str, str, str]]:
    """(doc_id, "", text) for each ``pid<TAB>text`` line of an MS MARCO ``collection.tsv``."""
    for _, pid, text in _id_tab_text_lines(path, lines, "pid", first_line):
        yield pid, "", text


def corpus_lines(path: Path, start: int = 0, end: int | None = None, first_line: int = 1) -> Iterator[str]:
    """The lines of bytes [``start``, ``end``) of a corpus file (``start`` on a line boundary, line
    ``first_line``), read and decoded one at a time, split at ``\\n`` only (as :func:`~ckray.data.prepare.split_file`
    counts lines); a line that is not UTF-8 is an error naming it."""
    with open(path, "rb") as f:
        f.seek(start)
        pos = start
        for lineno, raw in enumerate(f, start=first_line):
            if end is not None and pos >= end:
                return
            pos += len(raw)
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise CollectionError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start + 1})") from None


def corpus_table(rows: Iterable[tuple[str, str, str]], path: Path | None = None) -> pa.Table:
    """Arrow table from (doc_id, title, text) rows; duplicate doc ids are an error."""
    ids, titles, texts = [], [], []
    seen: set[str] = set()
    for doc_id, title, text in rows:
        if doc_id in seen:
            raise CollectionError(f"{path}: duplicate doc id {doc_id!r}")
        seen.add(doc_id)
        ids.append(doc_id)
        titles.append(title)
        texts.append(text)
    return pa.table([ids, titles, texts], schema=CORPUS_SCHEMA)


def read_beir_queries(path: Path) -> dict[str, str]:
    queries: dict[str, str] = {}
    for lineno, obj in _json_lines(path):
        qid = _need_id(obj, "_id", path, lineno)
        if qid in queries:
            raise CollectionError(f"{path}:{lineno}: duplicate query id {qid!r}")
        text = obj.get("text")
        if not isinstance(text, str):
            raise CollectionError(f"{path}:{lineno}: missing 'text' field for query {qid!r}")
        queries[qid] = text
    return queries


def read_tsv_queries(path: Path) -> dict[str, str]:
    queries: dict[str, str] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, qid, text in _id_tab_text_lines(path, f, "qid"):
            if qid in queries:
                raise CollectionError(f"{path}:{lineno}: duplicate query id {qid!r}")
            queries[qid] = text
    return queries


def _relevance(value: str, path: Path, lineno: int) -> int:
    try:
        return int(value)
    except ValueError:
        try:
            f = float(value)
        except ValueError:
            f = None
        if f is not None and f.is_integer():
            return int(f)
        raise CollectionError(f"{path}:{lineno}: relevance {value!r} is not an integer") from None


def read_beir_qrels(path: Path) -> Qrels:
    """BEIR qrels: TSV with a header ``query-id corpus-id score``."""
    qrels: Qrels = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            parts = line.rstrip("\n").split("\t")
            if lineno == 1 and parts[0].strip().lower() in ("query-id", "query_id", "qid"):
                continue
            if not line.strip():
                continue
            if len(parts) != 3:
                raise CollectionError(f"{path}:{lineno}: expected 3 tab-separated fields (query-id corpus-id score), got {len(parts)}")
            qid, did, rel = (p.strip() for p in parts)
            qrels.setdefault(qid, {})[did] = _relevance(rel, path, lineno)
    return qrels


def _whitespace_fields(path: Path, count: int, layout: str) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of each non-blank line of a whitespace-separated file with ``count`` fields
    a line; a line with another count is an error naming the file, the line and ``layout``."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != count:
                raise CollectionError(f"{path}:{lineno}: expected {count} fields ({layout}), got {len(parts)}")
            yield lineno, parts


def read_trec_qrels(path: Path) -> Qrels:
    """TREC qrels: ``qid iteration docid relevance`` separated by whitespace."""
    qrels: Qrels = {}
    for lineno, (qid, _, did, rel) in _whitespace_fields(path, 4, "qid iter docid rel"):
        qrels.setdefault(qid, {})[did] = _relevance(rel, path, lineno)
    return qrels


def trec_run_lines(path: Path) -> Iterator[tuple[str, str, float]]:
    """``(qid, docid, score)`` of each line of a TREC run (``qid Q0 docid rank score tag``), streamed;
    a malformed line is an error naming it."""
    for lineno, parts in _whitespace_fields(path, 6, "qid Q0 docid rank score tag"):
        try:
            score = float(parts[4])
        except ValueError:
            raise CollectionError(f"{path}:{lineno}: score {parts[4]!r} is not a number") from None
        yield parts[0], parts[2], score


def read_trec_run(path: Path) -> Run:
    """TREC run: ``qid Q0 docid rank score tag``; each query's list sorted by score descending."""
    run: Run = {}
    for qid, did, score in trec_run_lines(path):
        run.setdefault(qid, []).append((did, score))
    for docs in run.values():
        docs.sort(key=lambda x: -x[1])
    return run


def write_trec_run(run: Run, path: Path, tag: str = "ckray") -> None:
    """Write a run atomically (``ckray.data.shards.atomic_target``): a write that fails midway (an error,
    a full or read-only file system) leaves the previous file as it was and no temporary file; an OS
    error becomes a CkrayError naming the path."""
    from ckray.data.shards import atomic_target

    with atomic_target(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for qid, docs in run.items():
            for rank, (did, score) in enumerate(docs, start=1):
                f.write(f"{qid} Q0 {did} {rank} {score:.6f} {tag}\n")


# --------------------------------------------------------------------------- whole collections

def detect_format(path: Path) -> str:
    """``beir`` or ``msmarco``; a path that is no collection directory is named, with what it lacks."""
    path = Path(path)
    if not path.exists():
        raise CollectionError(f"{path}: no such collection directory")
    if not path.is_dir():
        raise CollectionError(f"{path}: is a file, not a collection directory")
    if (path / "corpus.jsonl").exists():
        return "beir"
    if (path / "collection.tsv").exists():
        return "msmarco"
    raise CollectionError(f"{path}: not a collection directory (expected corpus.jsonl (BEIR) or collection.tsv (MS MARCO))")


def corpus_file(path: Path) -> tuple[Path, str]:
    fmt = detect_format(path)
    return (Path(path) / ("corpus.jsonl" if fmt == "beir" else "collection.tsv")), fmt


def parse_corpus_lines(fmt: str, path: Path, lines: Iterable[str], first_line: int = 1):
    parser = parse_beir_corpus_lines if fmt == "beir" else parse_msmarco_corpus_lines
    return parser(path, lines, first_line)


def read_queries_and_qrels(path: Path) -> tuple[dict[str, str], dict[str, Qrels]]:
    path = Path(path)
    fmt = detect_format(path)
    if fmt == "beir":
        queries = read_beir_queries(path / "queries.jsonl") if (path / "queries.jsonl").exists() else {}
        qrels = {p.stem: read_beir_qrels(p) for p in sorted((path / "qrels").glob("*.tsv"))}
    else:
        queries = {}
        for p in sorted(path.glob("queries.*.tsv")):
            for qid, text in read_tsv_queries(p).items():
                queries.setdefault(qid, text)
        qrels = {p.name[len("qrels."):-len(".tsv")]: read_trec_qrels(p) for p in sorted(path.glob("qrels.*.tsv"))}
    return queries, qrels


def queries_file(path: Path) -> str:
    """Where a collection directory's query texts are read from (for messages)."""
    path = Path(path)
    return str(path / "queries.jsonl") if detect_format(path) == "beir" else str(path / "queries.*.tsv")


def qrels_file(path: Path, split: str) -> str:
    """The qrels file of ``split`` in a collection directory (for messages)."""
    path = Path(path)
    return str(path / "qrels" / f"{split}.tsv") if detect_format(path) == "beir" else str(path / f"qrels.{split}.tsv")


def judged_queries(path: Path, queries: dict[str, str], qrels: dict[str, Qrels], split: str) -> dict[str, str]:
    """The queries judged in ``split`` that have a text (``read_queries_and_qrels(path)``'s). None at all (an
    empty queries file, or one without this split's queries) is an error naming both files: evaluated,
    the split would score 0 everywhere. Judged queries without a text are logged (they score 0)."""
    judged = qrels[split]
    found = {q: queries[q] for q in judged if q in queries}
    if not found:
        raise CollectionError(f"{queries_file(path)}: none of the {len(judged)} queries judged in split {split!r} "
                              f"({qrels_file(path, split)}) has a text here ({len(queries)} queries in all)")
    if len(found) < len(judged):
        missing = [q for q in judged if q not in queries]
        log.warning("%s: %d of the %d queries judged in split %r have no text (e.g. %s); they score 0",
                    queries_file(path), len(missing), len(judged), split, ", ".join(map(repr, missing[:3])))
    return found


def check_qrels(qrels: dict[str, Qrels], doc_ids: set[str], queries: dict[str, str], where: str,
                strict: bool = False) -> dict[str, int]:
    """Count judgments that name a document not in the corpus or a query without a text, and report them
    once (a warning with examples): kept, not an error (a judged document that is not in the corpus cannot
    be retrieved, as in any evaluation on a subset). ``strict``: refuse them instead."""
    counts = {"unknown_docs": 0, "unknown_queries": 0}
    examples: list[str] = []
    for split, qr in qrels.items():
        for qid, docs in qr.items():
            if qid not in queries:
                counts["unknown_queries"] += 1
                examples.append(f"{split}: query {qid!r}")
            for did in docs:
                if did not in doc_ids:
                    counts["unknown_docs"] += 1
                    examples.append(f"{split}: doc {did!r} (query {qid!r})")
    if counts["unknown_docs"] or counts["unknown_queries"]:
        msg = (f"{where}: qrels name {counts['unknown_docs']} document(s) not in the corpus and "
               f"{counts['unknown_queries']} query(ies) without a text, e.g. {'; '.join(examples[:3])}")
        if strict:
            raise CollectionError(msg)
        log.warning("%s; they are kept and counted", msg)
    return counts


def load_collection(path: str | Path, strict_qrels: bool = False, name: str | None = None) -> Collection:
    """Read a BEIR or MS MARCO directory's queries and qrels into a :class:`Collection`, and validate its
    corpus in one streaming pass (:func:`scan_corpus`: a malformed line is an error naming it; the stats
    count documents, empty documents, characters, and qrels naming unknown documents, ``strict_qrels``:
    see :func:`check_qrels`). Memory holds the queries, the qrels and the judged documents found, never
    the corpus's texts or all its ids."""
    path = Path(path)
    cfile, fmt = corpus_file(path)
    queries, qrels = read_queries_and_qrels(path)
    judged = {did for qr in qrels.values() for docs in qr.values() for did in docs}
    stats, found = scan_corpus(cfile, fmt, judged)
    stats.update(check_qrels(qrels, found, queries, str(path), strict_qrels))
    return Collection(name=name or path.name, queries=queries, qrels=qrels, source=path, stats=stats)


def scan_corpus(cfile: Path, fmt: str, judged: set[str]) -> tuple[dict, set[str]]:
    """One pass over a corpus file, a line at a time: every line parsed (a malformed one is an error
    naming ``file:line``); returns the stats (``documents``, ``empty_documents``, ``mean_chars`` of
    ``title + " " + text``) and the ids of ``judged`` that occur."""
    documents = empty = chars = 0
    found: set[str] = set()
    for doc_id, title, text in parse_corpus_lines(fmt, cfile, corpus_lines(cfile)):
        documents += 1
        chars += len(title) + 1 + len(text)
        if not title.strip() and not text.strip():
            empty += 1
        if doc_id in judged:
            found.add(doc_id)
    if empty:
        log.warning("%d empty document(s) kept in the corpus", empty)
    return {"documents": documents, "empty_documents": empty,
            "mean_chars": chars / documents if documents else 0.0}, found


def collection_stats(corpus: pa.Table) -> dict:
    import pyarrow.compute as pc

    lengths = pc.utf8_length(pc.binary_join_element_wise(corpus["title"], corpus["text"], " "))
    empty = pc.sum(pc.equal(pc.utf8_length(pc.utf8_trim_whitespace(
        pc.binary_join_element_wise(corpus["title"], corpus["text"], " "))), 0)).as_py() or 0
    if empty:
        log.warning("%d empty document(s) kept in the corpus", empty)
    return {"documents": corpus.num_rows, "empty_documents": int(empty),
            "mean_chars": float(pc.mean(lengths).as_py() or 0.0)}


def load_ir_dataset(dataset_id: str) -> Collection:
    """A collection from an ``ir_datasets`` id (needs the network or ir_datasets' local cache),
    e.g. ``beir/scifact/test`` or ``msmarco-passage/dev/small``."""
    import ir_datasets

    ds = ir_datasets.load(dataset_id)
    corpus = corpus_table(((d.doc_id, getattr(d, "title", "") or "", getattr(d, "text", "") or "")
                           for d in ds.docs_iter()), Path(dataset_id))
    queries = {q.query_id: q.text for q in ds.queries_iter()} if ds.has_queries() else {}
    qrels: dict[str, Qrels] = {}
    if ds.has_qrels():
        split = dataset_id.rsplit("/", 1)[-1]
        for qr in ds.qrels_iter():
            qrels.setdefault(split, {}).setdefault(qr.query_id, {})[qr.doc_id] = int(qr.relevance)
    return Collection(name=dataset_id, queries=queries, qrels=qrels, stats=collection_stats(corpus),
                      loaded_corpus=corpus)
