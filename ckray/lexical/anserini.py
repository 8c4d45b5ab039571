"""Run an Anserini command-line class (e.g. ``IndexCollection``) inside a JVM set up by
:mod:`ckray.lexical.jvm`. Used as ``python -m ckray.lexical.anserini IndexCollection -input …`` so
indexing runs in its own process (its heap is freed when it ends)."""

from __future__ import annotations

import subprocess
import sys

from ckray.errors import CkrayError


def run_anserini(main_class: str, args: list[str]) -> None:
    """Run ``io.anserini.index.<main_class>.main(args)`` in a subprocess; raise with its output on failure."""
    cmd = [sys.executable, "-m", "ckray.lexical.anserini", main_class, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CkrayError(f"Anserini {main_class} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _main(argv: list[str]) -> None:
    from ckray.lexical.jvm import ensure_jvm

    ensure_jvm()
    from jnius import autoclass

    autoclass(f"io.anserini.index.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    _main(sys.argv[1:])
