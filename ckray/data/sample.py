"""A small synthetic collection in BEIR layout, generated (not downloaded), for the demo and tests.

Each of ``n_topics`` topics owns a handful of invented "concept" words, each with two spellings
(a synonym pair). Documents mix their topic's concepts with shared filler words; a query names a
few concepts of one topic, sometimes with the *other* spelling than the relevant documents use, so
exact-match BM25 is good but not perfect and learned matching has something to add. Deterministic
for a given seed.

Two vocabularies: ``invented`` concept words (syllable strings, whose synonymy only training can
teach) and ``english`` ones (common English synonym pairs such as *car / automobile*, single word
pieces of the MiniLM vocabulary), whose synonymy a pretrained encoder already partly knows, as it does
on real collections; the main job's demo uses the latter (:data:`DEMO_SAMPLE`).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from ckray.errors import ConfigError

_CONSONANTS = "bcdfghklmnprstvz"

# Common English synonym pairs, each word one word piece of the bert-base-uncased / MiniLM vocabulary.
ENGLISH_SYNONYMS: tuple[tuple[str, str], ...] = tuple(tuple(pair.split()) for pair in (
    "car automobile|doctor physician|house home|big large|small little|fast quick|begin start|end finish|"
    "buy purchase|help assist|answer reply|road street|shop store|film movie|child kid|mother mom|"
    "father dad|rich wealthy|sick ill|smart clever|angry mad|happy glad|sad unhappy|hard difficult|"
    "easy simple|error mistake|gift present|job occupation|trip journey|rock stone|ocean sea|forest woods|"
    "hill slope|river stream|city town|boat ship|plane aircraft|bike bicycle|phone telephone|picture photo|"
    "song tune|speech talk|rule law|money cash|price cost|student pupil|teacher instructor|lawyer attorney|"
    "chef cook|soldier warrior|thief robber|friend pal|enemy foe|king monarch|gown dress|hat cap|"
    "shoe boot|couch sofa|rug carpet|cup mug|dish plate|pants trousers|garbage trash|autumn fall|"
    "vacation holiday|sweets candy|flat apartment|lift elevator|petrol gasoline|queue line|illness disease|"
    "medicine drug|wound injury|infant baby|elderly aged|middle center|exam test|sum total|method technique|"
    "goal aim|idea notion|fact truth|danger risk|power strength|storm tempest|fear terror"
).split("|"))
_VOWELS = "aeiou"


def _word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(syllables)) + rng.choice(_CONSONANTS)


@dataclass
class SampleConfig:
    n_topics: int = 60
    docs_per_topic: int = 6
    concepts_per_topic: int = 6
    filler_vocab: int = 400
    train_queries_per_topic: int = 2
    test_queries_per_topic: int = 1
    seed: int = 13
    vocabulary: str = "invented"   # "invented" | "english" (ENGLISH_SYNONYMS; n_topics × concepts_per_topic ≤ 86)

    def __post_init__(self) -> None:
        if self.vocabulary not in ("invented", "english"):
            raise ConfigError.invalid("SampleConfig", "vocabulary", f"must be 'invented' or 'english', "
                                      f"not {self.vocabulary!r}")
        needed = self.n_topics * self.concepts_per_topic
        if self.vocabulary == "english" and needed > len(ENGLISH_SYNONYMS):
            raise ConfigError.invalid("SampleConfig", "n_topics", f"n_topics × concepts_per_topic = {needed}; the "
                                      f"english vocabulary has {len(ENGLISH_SYNONYMS)} synonym pairs")


# The main job's collection: fewer, denser topics (each synonym pair occurs in more training triples)
# and English concept words (144 documents, 120 training and 60 test queries).
DEMO_SAMPLE = SampleConfig(n_topics=12, docs_per_topic=12, train_queries_per_topic=10, test_queries_per_topic=5,
                           vocabulary="english")


def generate_sample(out_dir: str | Path, config: SampleConfig = SampleConfig()) -> Path:
    """Write ``corpus.jsonl``, ``queries.jsonl``, ``qrels/{train,test}.tsv`` under ``out_dir``."""
    rng = random.Random(config.seed)
    out = Path(out_dir)
    (out / "qrels").mkdir(parents=True, exist_ok=True)
    used: set[str] = set()

    def fresh(syl: int) -> str:
        while True:
            w = _word(rng, syl)
            if w not in used:
                used.add(w)
                return w

    filler = [fresh(rng.choice((1, 2))) for _ in range(config.filler_vocab)]
    if config.vocabulary == "english":
        pairs = iter(rng.sample(ENGLISH_SYNONYMS, k=config.n_topics * config.concepts_per_topic))
        topics = [[next(pairs) for _ in range(config.concepts_per_topic)] for _ in range(config.n_topics)]
    else:
        topics = [[(fresh(3), fresh(3)) for _ in range(config.concepts_per_topic)] for _ in range(config.n_topics)]
    corpus, by_topic = [], []
    for t, concepts in enumerate(topics):
        ids = []
        for j in range(config.docs_per_topic):
            # each document covers a subset of its topic's concepts, in one spelling
            covered = rng.sample(range(len(concepts)), k=rng.randint(3, len(concepts)))
            spelling = j % 2
            words = []
            for _ in range(rng.randint(40, 160)):
                if rng.random() < 0.25:
                    words.append(concepts[rng.choice(covered)][spelling])
                else:
                    words.append(rng.choice(filler))
            doc_id = f"d{t:03d}{j:02d}"
            title = " ".join(concepts[c][spelling] for c in covered[:2]) + " " + rng.choice(filler)
            corpus.append({"_id": doc_id, "title": title, "text": " ".join(words) + "."})
            ids.append((doc_id, covered, spelling))
        by_topic.append(ids)
    queries, qrels = [], {"train": [], "test": []}
    qn = 0
    for t, concepts in enumerate(topics):
        for split, n in (("train", config.train_queries_per_topic), ("test", config.test_queries_per_topic)):
            for _ in range(n):
                picked = rng.sample(range(len(concepts)), k=2)
                spelling = rng.randint(0, 1)
                text = " ".join(concepts[c][spelling] for c in picked) + " " + rng.choice(filler)
                qid = f"q{qn:04d}"
                qn += 1
                queries.append({"_id": qid, "text": text})
                for doc_id, covered, _ in by_topic[t]:
                    if all(c in covered for c in picked):
                        qrels[split].append((qid, doc_id, 1))
                if not any(r[0] == qid for r in qrels[split]):
                    qrels[split].append((qid, by_topic[t][0][0], 1))
    with open(out / "corpus.jsonl", "w") as f:
        f.writelines(json.dumps(d) + "\n" for d in corpus)
    with open(out / "queries.jsonl", "w") as f:
        f.writelines(json.dumps(q) + "\n" for q in queries)
    for split, rows in qrels.items():
        with open(out / "qrels" / f"{split}.tsv", "w") as f:
            f.write("query-id\tcorpus-id\tscore\n")
            f.writelines(f"{q}\t{d}\t{r}\n" for q, d, r in rows)
    return out


def sample_workdir(root: str | Path, shards: int = 2, bm25: bool = True,
                   config: SampleConfig = SampleConfig()) -> tuple[Path, Path]:
    """A small work directory over the generated sample, for tests, benchmarks and serving demos:
    the collection in ``root/data`` (:func:`generate_sample`), its corpus in ``shards`` shards under
    ``root/w`` and, with ``bm25``, the BM25 index (no training negatives). Idempotent.
    Returns ``(data_dir, workdir)``."""
    from ckray.data.prepare import prepare_collection

    root = Path(root)
    data = generate_sample(root / "data", config)
    workdir = root / "w"
    prepare_collection(data, workdir, shards=shards, split=None, bm25=bm25)
    return data, workdir
