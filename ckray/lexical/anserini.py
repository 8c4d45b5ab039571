"""Run an Anserini command-line class (e.g. ``IndexCollection``) inside a JVM set up by
:mod:`ckray.lexical.jvm`. Used as ``python -m ckray.lexical.anserini IndexCollection -input …`` so
indexing runs in its own process (its heap is freed when it ends)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from ckray.errors import CkrayError


def run_anserini(main_class: str, args: list[str]) -> None:
    """Run ``io.anserini.index.<main_class>.main(args)`` in a subprocess; raise with the end of its output on
    failure. The output (Anserini logs progress as it indexes) goes to a temporary file, not to this process's
    memory, whatever the corpus's size."""
    cmd = [sys.executable, "-m", "ckray.lexical.anserini", main_class, *args]
    with tempfile.TemporaryFile() as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode
        if code != 0:
            out.seek(max(0, out.seek(0, os.SEEK_END) - 6000))
            tail = out.read().decode("utf-8", "replace")
            raise CkrayError(f"Anserini {main_class} failed (exit {code}):\n{tail}")


def _main(argv: list[str]) -> None:
    from ckray.lexical.jvm import ensure_jvm

    ensure_jvm()
    from jnius import autoclass

    autoclass(f"io.anserini.index.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    _main(sys.argv[1:])
