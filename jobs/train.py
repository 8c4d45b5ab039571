"""Train any registered ranker on the shared Ray Train + DeepSpeed loop (a plug-in's training job).

    python jobs/train.py --ranker NAME --data DIR --workdir W [its flags]
    CKRAY_RANKERS=my_package python jobs/train.py --ranker my-ranker --data DIR --workdir W

The same stage as the ranker's own job (jobs/train_ck.py is `--ranker ck-qti`); `--ranker NAME --help`
lists its flags. Writes W/checkpoints/<name>.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a `ray job submit` working dir

from ckray.stages import main_for  # noqa: E402


def ranker_of(argv: list[str]) -> str:
    """The ``--ranker`` of ``argv`` (exits with the usage when it is missing or unknown)."""
    from ckray.rankers import trainable

    p = argparse.ArgumentParser(description=__doc__, add_help=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranker", required=True, choices=list(trainable()), help="a registered ranker that trains")
    known, _ = p.parse_known_args(argv)
    return known.ranker


if __name__ == "__main__":
    argv = sys.argv[1:]
    ranker = ranker_of(argv)
    rest = [a for i, a in enumerate(argv) if a != "--ranker" and (i == 0 or argv[i - 1] != "--ranker")
            and not a.startswith("--ranker=")]
    main_for(f"train:{ranker}", __doc__, rest)
