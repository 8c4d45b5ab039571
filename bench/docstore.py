"""DocStore memory and speed: the memory-mapped store against the in-memory one it replaced (every title and
text as a Python string, a dict from id to row), on generated corpora.

    python bench/docstore.py                         # 10 k and 100 k passages
    python bench/docstore.py --large                 # also 1 M
    python bench/docstore.py --sizes 10000 --lookups 2000 --workdir /tmp/ds-bench --keep

For each size N a corpus of N passages (``p<i>``, a title of ~6 and a text of ~``--words`` generated words)
is written as corpus shards (``ckray.data.shards.write_corpus_shards``: ``W/shards/part-*.parquet`` +
manifest, as ``jobs/prepare.py`` lays them out). Then, each in a fresh Python process:

- ``old``: the replaced store: ``load_corpus_table`` + ``to_pylist`` of every column + ``{id: row}``;
- ``new build``: ``DocStore(W)`` with no store on disk yet (builds ``W/docstore``, then opens it);
- ``new open``: ``DocStore(W)`` again (what every later process does: evaluate, each Serve replica).

Each opens its store, then does ``--lookups`` ``get`` calls of random ids. Reported: the open time (for
``new build``, the build), the growth of anonymous RSS (``RssAnon`` in ``/proc/self/status``: memory the
process owns; memory-mapped files are page cache and show in ``RssFile``) after the open and after the
lookups, ``RssFile`` after the lookups, and lookups/s. Ends with one JSON line of ratios:
``new_rss_growth_<a>_to_<b>`` / ``old_rss_growth_<a>_to_<b>`` (anonymous RSS growth after the lookups at
the largest N over the smallest; growths are floored at 1 MB so a near-zero one does not divide by zero),
``new_over_old_rss_at_<N>`` and ``new_over_old_lookups_at_<N>`` at the largest N.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED = 7
VOCAB = 20_000
MODES = ("old", "new build", "new open")


def doc_id(i: int) -> str:
    return f"p{i}"


def generate(workdir: Path, n: int, words: int, shard_docs: int) -> dict:
    """Write (or keep, when already there) the corpus shards of ``n`` generated passages; returns the manifest."""
    import pyarrow as pa

    from ckray.data.collections import CORPUS_SCHEMA
    from ckray.data.shards import MANIFEST, read_json, shards_dir, write_corpus_shards

    source = f"bench-docstore-n{n}-words{words}-shard{shard_docs}-seed{SEED}"
    manifest_path = shards_dir(workdir) / MANIFEST
    if manifest_path.exists() and read_json(manifest_path).get("input") == source:
        return read_json(manifest_path)
    rng = random.Random(SEED)
    syllables = ["".join(p) for p in zip(rng.choices("bcdfghklmnprstvz", k=VOCAB * 3), rng.choices("aeiou", k=VOCAB * 3))]
    vocab = [syllables[3 * i] + syllables[3 * i + 1] + syllables[3 * i + 2][: 1 + i % 2] for i in range(VOCAB)]

    def shard(start: int) -> pa.Table:
        ids = range(start, min(n, start + shard_docs))
        titles = [" ".join(rng.choices(vocab, k=rng.randint(3, 9))) for _ in ids]
        texts = [" ".join(rng.choices(vocab, k=rng.randint(words // 2, words * 3 // 2))) for _ in ids]
        return pa.table([[doc_id(i) for i in ids], titles, texts], schema=CORPUS_SCHEMA)

    return write_corpus_shards(workdir, (shard(s) for s in range(0, n, shard_docs)), source)


def rss_kb() -> dict[str, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssFile")))
    return {k: int(v.split()[0]) for k, v in fields.items()}


class OldDocStore:
    """The replaced store: the whole corpus as Python strings (kept here only to measure against)."""

    def __init__(self, workdir: Path):
        from ckray.data.shards import load_corpus_table

        table = load_corpus_table(workdir)
        self._ids = table.column("doc_id").to_pylist()
        self._index = {d: i for i, d in enumerate(self._ids)}
        self._titles = table.column("title").to_pylist()
        self._texts = table.column("text").to_pylist()

    def get(self, doc_id: str) -> tuple[str, str]:
        i = self._index[doc_id]
        return self._titles[i], self._texts[i]


def child(mode: str, workdir: Path, n: int, lookups: int) -> dict:
    """One measurement in this (fresh) process."""
    import gc

    import numpy  # noqa: F401  (imported before the baseline, as the store's own imports)
    import pyarrow.parquet  # noqa: F401

    from ckray.data.shards import DocStore

    rng = random.Random(SEED + 1)
    queries = [doc_id(rng.randrange(n)) for _ in range(lookups)]
    gc.collect()
    base = rss_kb()
    t0 = time.perf_counter()
    store = OldDocStore(workdir) if mode == "old" else DocStore(workdir)
    open_s = time.perf_counter() - t0
    gc.collect()
    opened = rss_kb()
    t0 = time.perf_counter()
    chars = sum(len(store.get(d)[1]) for d in queries)
    lookup_s = time.perf_counter() - t0
    gc.collect()
    after = rss_kb()
    return {"mode": mode, "n": n, "open_s": open_s, "anon_open_mb": (opened["RssAnon"] - base["RssAnon"]) / 1024,
            "anon_lookups_mb": (after["RssAnon"] - base["RssAnon"]) / 1024, "file_mb": after["RssFile"] / 1024,
            "lookups_per_s": lookups / lookup_s, "chars": chars}


def run_child(mode: str, workdir: Path, n: int, lookups: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", mode, "--workdir", str(workdir), "--sizes", str(n),
                          "--lookups", str(lookups)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000", help="corpus sizes N (passages), comma-separated")
    ap.add_argument("--large", action="store_true", help="also N = 1,000,000")
    ap.add_argument("--lookups", type=int, default=10_000, help="random get() calls per store")
    ap.add_argument("--words", type=int, default=60, help="mean words of a passage's text")
    ap.add_argument("--shard-docs", type=int, default=100_000, help="passages per corpus shard")
    ap.add_argument("--workdir", help="where the corpora go (one work directory per N; default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work directories")
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")] + ([1_000_000] if args.large else [])
    if args.child:
        print(json.dumps(child(args.child, Path(args.workdir), sizes[0], args.lookups)))
        return 0
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-docstore-"))
    results: dict[int, dict[str, dict]] = {}
    print(f"{'N':>9} {'store':<10} {'corpus MB':>9} {'open s':>8} {'anon MB open':>12} {'anon MB lookups':>15} "
          f"{'file MB':>8} {'lookups/s':>10}", flush=True)
    for n in sizes:
        w = root / f"n{n}"
        manifest = generate(w, n, args.words, args.shard_docs)
        corpus_mb = sum((w / "shards" / s["name"]).stat().st_size for s in manifest["shards"]) / 2**20
        shutil.rmtree(w / "docstore", ignore_errors=True)  # "new build" builds from scratch
        results[n] = {}
        for mode in MODES:
            r = results[n][mode] = run_child(mode, w, n, args.lookups)
            print(f"{n:>9} {mode:<10} {corpus_mb:>9.1f} {r['open_s']:>8.2f} {r['anon_open_mb']:>12.1f} "
                  f"{r['anon_lookups_mb']:>15.1f} {r['file_mb']:>8.1f} {r['lookups_per_s']:>10.0f}", flush=True)
        if len({r["chars"] for r in results[n].values()}) != 1:
            raise SystemExit(f"N={n}: the stores returned different texts for the same lookups")
        docstore_mb = sum(p.stat().st_size for p in (w / "docstore").rglob("*") if p.is_file()) / 2**20
        print(f"{n:>9} W/docstore on disk: {docstore_mb:.1f} MB (Parquet shards: {corpus_mb:.1f} MB)", flush=True)
    if not args.workdir and not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    small, large = min(sizes), max(sizes)

    def growth(n: int, mode: str) -> float:
        return max(1.0, results[n][mode]["anon_lookups_mb"])

    tag = {n: f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k" if n % 1000 == 0 else str(n)
           for n in sizes}
    ratios = {f"new_rss_growth_{tag[small]}_to_{tag[large]}": growth(large, "new open") / growth(small, "new open"),
              f"old_rss_growth_{tag[small]}_to_{tag[large]}": growth(large, "old") / growth(small, "old"),
              f"new_over_old_rss_at_{tag[large]}": growth(large, "new open") / growth(large, "old"),
              f"new_build_over_old_rss_at_{tag[large]}": growth(large, "new build") / growth(large, "old"),
              f"new_over_old_lookups_at_{tag[large]}":
                  results[large]["new open"]["lookups_per_s"] / results[large]["old"]["lookups_per_s"]}
    print(json.dumps({k: round(v, 4) for k, v in ratios.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
