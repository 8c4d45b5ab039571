"""Step-0 ranking of the cross-encoder rerankers: warm-started heads vs the papers' random heads.

Dev split = SciFact *training* queries held back by ``ckray.data.examples.is_dev_query`` (the training
jobs' ``--dev-fraction 0.15``, seed 0); SciFact test is never read. Each of the first ``--queries`` dev
queries has its BM25 top ``--depth`` (the work directory's BM25 run of the training queries) rescored by

* ``bm25``: the first stage itself (the order being reranked);
* ``minilm-biencoder``: the zero-shot MiniLM bi-encoder (sentence-transformers' all-MiniLM-L6-v2: mean
  of the token vectors, cosine; query and document encoded apart, documents at 256 word pieces);
* ``cedr-{knrm,pacrr,drmm}`` and ``vanilla-bert``, warm (``head_init="warm"``) and random (the paper's
  initialisation, torch seed 0), at the settings of record (MiniLM, 256 tokens × 2 segments), and
  ``cedr-knrm-all-layers/warm``, CEDR-KNRM's warm head over every layer (``knrm_warm_layers="all"``). The
  ``cedr-knrm-probe/warm``, its head fitted to ``--knrm-probe-triples`` training triples
  (``knrm_warm_layers="probe"``). The encoder is the same pretrained MiniLM in all ten models, so one
  encoder pass serves every head (``CEDRRanker.score_encoding``);
* ``qds`` warm and random, at its settings of record (MiniLM, 512 tokens, window 128): one encoder
  pass, the [CLS] vectors scored by each head; ``qds-pooled/warm``: the pooled head's step-0 score
  (γ · cos of the mean query and document vectors, ``head="pooled"``) from the same pass, and with
  ``--pooled-patterns`` under the ablation patterns too (how much the query's global attention to the
  document costs the cosine); ``qds-maxsim/warm``: the MaxSim head's step-0 score (γ · ColBERT's MaxSim,
  ``head="maxsim"``) from the same pass, and ``qds-maxsim-idf/warm``, the same MaxSim averaged with the
  weights of ``query_weights="idf"``: each query word piece's IDF in the work directory's corpus.

The heads that need data to start warm (vanilla BERT, QDS, CEDR-KNRM's probe head: the pairwise probe)
are fitted on (query, judged relevant, BM25 non-relevant from the top ``--depth``) triples of *non-dev*
training queries, one per query, as the training jobs do with their first triples: the first
``--probe-triples`` of them, the first ``--knrm-probe-triples`` for CEDR-KNRM.

    python bench/rerank_warm_start.py --workdir W [--data DIR] [--queries 50] [--depth 30] [--probe-triples 32] [--knrm-probe-triples 256] [--pooled-patterns qds,longformer-qa,local]

``W``: a work directory prepared on SciFact (``jobs/prepare.py``). Prints nDCG@10 per model, with the
paired difference from the bi-encoder over the same queries and its standard error (``vs_biencoder`` in
the JSON: a model is level with the bi-encoder when the difference is within about two of its standard
errors), and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ckray.data.collections import read_queries_and_qrels  # noqa: E402
from ckray.data.docstore import DocStore  # noqa: E402
from ckray.data.examples import is_dev_query  # noqa: E402
from ckray.data.negatives import read_negatives  # noqa: E402
from ckray.eval import paired_difference, per_query_values  # noqa: E402
from ckray.rankers.cedr.model import KNRM_PROBE_TRIPLES  # noqa: E402

CEDR_SETTINGS = dict(max_length=256, max_segments=2)        # the CEDR runs of record (docs/results.md)
QDS_SETTINGS = dict(max_length=512, window=128, pattern="qds")  # the QDS run of record
BASELINE = "minilm-biencoder"   # what every step-0 score is compared with, query by query


def load_dev(data: Path, workdir: str, n_queries: int, depth: int, n_probe: int, seed: int = 0):
    """Dev queries, their BM25 candidates and texts, their qrels; probe triples from non-dev queries."""
    queries, qrels = read_queries_and_qrels(data)
    train = {q: r for q, r in qrels["train"].items() if q in queries and any(v > 0 for v in r.values())}
    dev_q = [q for q in sorted(train) if is_dev_query(q, 0.15, 0)][:n_queries]
    rest = [q for q in sorted(train) if not is_dev_query(q, 0.15, 0)]
    random.Random(seed).shuffle(rest)
    run = read_negatives(workdir, "train", dev_q + rest[: 4 * n_probe], depth)
    store = DocStore(workdir)
    rng = random.Random(seed)
    probe: list[tuple[str, str, str]] = []
    for q in rest[: 4 * n_probe]:
        pos = [d for d, r in train[q].items() if r > 0]
        neg = [d for d, _ in run.get(q, []) if train[q].get(d, 0) <= 0]
        if pos and neg and len(probe) < n_probe:
            probe.append((queries[q], store.text(rng.choice(pos)), store.text(rng.choice(neg))))
    pairs = [(q, d) for q in dev_q for d, _ in run.get(q, [])]
    texts = {d: store.text(d) for _, d in pairs}
    bm25 = {q: list(run.get(q, [])) for q in dev_q}
    return {q: queries[q] for q in dev_q}, pairs, texts, {q: train[q] for q in dev_q}, bm25, probe


def per_query_ndcg(pairs: list[tuple[str, str]], scores: torch.Tensor, qrels) -> list[float]:
    """nDCG@10 of each dev query (in ``sorted(qrels)`` order) when its candidates are ordered by ``scores``."""
    run: dict[str, list[tuple[str, float]]] = {}
    for (q, d), s in zip(pairs, scores.tolist()):
        run.setdefault(q, []).append((d, float(s)))
    return per_query_values(run, qrels)


def biencoder_scores(queries, pairs, texts, batch_size: int) -> torch.Tensor:
    """Zero-shot MiniLM: cosine of the mean-pooled token vectors, query and document encoded apart."""
    from ckray.models.encoders import load_encoder, load_tokenizer, mean_pool

    tok, enc = load_tokenizer(), load_encoder().eval()

    @torch.no_grad()
    def embed(texts_: list[str], max_length: int) -> torch.Tensor:
        out = []
        for i in range(0, len(texts_), batch_size):
            b = tok(texts_[i:i + batch_size], padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt")
            out.append(F.normalize(mean_pool(enc(**b).last_hidden_state, b["attention_mask"]), dim=-1))
        return torch.cat(out)

    qids = sorted(queries)
    q_vec = dict(zip(qids, embed([queries[q] for q in qids], 64)))
    doc_ids = sorted({d for _, d in pairs})
    d_vec = dict(zip(doc_ids, embed([texts[d] for d in doc_ids], 256)))
    return torch.stack([q_vec[q] @ d_vec[d] for q, d in pairs])


def cedr_scores(queries, pairs, texts, probe, knrm_probe, batch_size: int) -> dict[str, torch.Tensor]:
    """Every CEDR variant, warm and random, over one shared encoding of each batch; the vanilla head
    fitted to the triples ``probe``, CEDR-KNRM's probe head to ``knrm_probe``."""
    from ckray.rankers.cedr.model import VARIANTS, CEDRConfig, CEDRRanker

    models = {}
    for init in ("warm", "random"):
        for v in VARIANTS:
            torch.manual_seed(0)
            name = ("vanilla-bert" if v == "vanilla" else f"cedr-{v}") + f"/{init}"
            models[name] = CEDRRanker(CEDRConfig(variant=v, head_init=init, **CEDR_SETTINGS)).eval()
    torch.manual_seed(0)
    models["cedr-knrm-all-layers/warm"] = CEDRRanker(CEDRConfig(variant="knrm", head_init="warm",
                                                                knrm_warm_layers="all", **CEDR_SETTINGS)).eval()
    torch.manual_seed(0)
    models["cedr-knrm-probe/warm"] = CEDRRanker(CEDRConfig(variant="knrm", head_init="warm",
                                                           knrm_warm_layers="probe", **CEDR_SETTINGS)).eval()
    models["vanilla-bert/warm"].warm_start_head(*map(list, zip(*probe)))
    models["cedr-knrm-probe/warm"].warm_start_head(*map(list, zip(*knrm_probe)), batch_size=batch_size)
    first = next(iter(models.values()))
    out: dict[str, list[torch.Tensor]] = {name: [] for name in models}
    with torch.no_grad():
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i:i + batch_size]
            e = first.encode(first.tokenize_pairs([queries[q] for q, _ in chunk], [texts[d] for _, d in chunk]))
            for name, m in models.items():
                out[name].append(m.score_encoding(e))
    return {name: torch.cat(s) for name, s in out.items()}


def qds_scores(queries, pairs, texts, probe, batch_size: int, pooled_patterns: list[str],
               workdir: str) -> dict[str, torch.Tensor]:
    """One QDS encoding of every pair: its [CLS] vectors scored by the random head and by the
    probe-fitted warm head, and the warm pooled and MaxSim heads' scores (MaxSim uniform and
    IDF-weighted by ``workdir``'s corpus); the pooled head also under each attention pattern of
    ``pooled_patterns`` other than "qds" (one more pass each)."""
    from ckray.data.statistics import cached_corpus_statistics
    from ckray.rankers.qds.model import (POOLED_SCALE, QDSConfig, QDSTransformer, collection_tokenisation,
                                         maxsim_similarity, pooled_similarity)

    idf = cached_corpus_statistics(workdir, collection_tokenisation(QDSConfig(**QDS_SETTINGS, head="maxsim",
                                                                              query_weights="idf"))).idf
    out: dict[str, torch.Tensor] = {}
    for pattern in dict.fromkeys(["qds", *pooled_patterns]):
        torch.manual_seed(0)
        model = QDSTransformer(QDSConfig(**{**QDS_SETTINGS, "pattern": pattern})).eval()
        cls, pooled, maxsim, maxsim_idf = [], [], [], []
        with torch.no_grad():
            for i in range(0, len(pairs), batch_size):
                chunk = pairs[i:i + batch_size]
                batch = model.build_batch([queries[q] for q, _ in chunk], [texts[d] for _, d in chunk])
                hidden = model.encode(batch)
                cls.append(hidden[:, 0].float())
                pooled.append(POOLED_SCALE * pooled_similarity(hidden, batch))
                maxsim.append(POOLED_SCALE * maxsim_similarity(hidden, batch))
                maxsim_idf.append(POOLED_SCALE * maxsim_similarity(hidden, batch, idf))
            out["qds-pooled/warm" if pattern == "qds" else f"qds-{pattern}-pooled/warm"] = torch.cat(pooled)
            if pattern == "qds":
                out["qds-maxsim/warm"] = torch.cat(maxsim)
                out["qds-maxsim-idf/warm"] = torch.cat(maxsim_idf)
                cls_vectors = torch.cat(cls)
                out["qds/random"] = model.score(cls_vectors).squeeze(-1)
                model.warm_start_head(*map(list, zip(*probe)), batch_size=batch_size)
                out["qds/warm"] = model.score(cls_vectors).squeeze(-1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", required=True, help="a work directory prepared on SciFact (jobs/prepare.py)")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "scifact"))
    ap.add_argument("--queries", type=int, default=50, help="dev queries (the first of the dev split, by id)")
    ap.add_argument("--depth", type=int, default=30, help="BM25 candidates reranked per query")
    ap.add_argument("--probe-triples", type=int, default=32, help="training triples the probe heads are fitted on")
    ap.add_argument("--knrm-probe-triples", type=int, default=KNRM_PROBE_TRIPLES,
                    help="training triples CEDR-KNRM's probe head is fitted on")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pooled-patterns", default="qds",
                    help="attention patterns the pooled QDS head is also scored under (comma-separated: qds, "
                         "longformer-qa, local); the [CLS] heads use qds")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: cedr, qds, biencoder")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))

    queries, pairs, texts, qrels, bm25, triples = load_dev(Path(args.data), args.workdir, args.queries, args.depth,
                                                           max(args.probe_triples, args.knrm_probe_triples))
    probe, knrm_probe = triples[: args.probe_triples], triples[: args.knrm_probe_triples]
    result: dict = {"bench": "rerank_warm_start", "dev_queries": len(queries), "depth": args.depth,
                    "pairs": len(pairs), "probe_triples": len(probe), "knrm_probe_triples": len(knrm_probe),
                    "ndcg@10": {}, "vs_biencoder": {}, "seconds": {}}
    per_query_scores = {"bm25": per_query_ndcg(pairs, torch.tensor([s for q in sorted(queries) for _, s in bm25[q]]),
                                               qrels)}
    parts = {"biencoder": lambda: {"minilm-biencoder": biencoder_scores(queries, pairs, texts, args.batch_size)},
             "cedr": lambda: cedr_scores(queries, pairs, texts, probe, knrm_probe, args.batch_size),
             "qds": lambda: qds_scores(queries, pairs, texts, probe, args.batch_size,
                                     list(filter(None, args.pooled_patterns.split(","))), args.workdir)}
    for part, run in parts.items():
        if part in skip:
            continue
        start = time.perf_counter()
        for name, scores in run().items():
            per_query_scores[name] = per_query_ndcg(pairs, scores, qrels)
        result["seconds"][part] = round(time.perf_counter() - start, 1)
        print(f"{part}: {result['seconds'][part]} s", file=sys.stderr)
    reference = per_query_scores.get(BASELINE)
    for name, values in per_query_scores.items():
        result["ndcg@10"][name] = round(sum(values) / len(values), 4)
        line = f"{name:28s} {result['ndcg@10'][name]:.4f}"
        if reference is not None and name != BASELINE:
            diff, se = paired_difference(values, reference)
            result["vs_biencoder"][name] = {"diff": round(diff, 4), "se": round(se, 4)}
            line += f"   {diff:+.4f} ± {se:.4f} against the bi-encoder"
        print(line)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
