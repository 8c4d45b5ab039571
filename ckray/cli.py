"""What every ``jobs/*.py`` entry point shares: logging, common flags, friendly errors."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import logging
import os
import re
import sys
from typing import Callable

from ckray.errors import CkrayError, ConfigError

# OS errors a job ends with exit 2 and the path, like a CkrayError: the work directory's file system is
# full or read-only, or the job may not write there.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout)
    for noisy in ("faiss.loader", "urllib3", "filelock", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``--help`` of every job: the description (the job's docstring) as written, and each option's
    default after its help, except a default of None (a required flag, or one whose real default the
    help text itself gives, e.g. a training flag whose default depends on the model) and a help that
    says its default itself ("(default: none)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def base_parser(description: str, data: bool = True, workdir: bool = True) -> argparse.ArgumentParser:
    """A job's parser with the flags every job has: ``--data`` (unless ``data=False``), ``--workdir``
    (unless ``workdir=False``), ``--address``, ``--log-level``."""
    p = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    if data:
        p.add_argument("--data", required=True, help="collection directory (BEIR or MS MARCO layout)")
    if workdir:
        p.add_argument("--workdir", required=True, help="work directory holding every artifact")
    p.add_argument("--address", default=None, help="Ray address (default: $RAY_ADDRESS, else a local Ray)")
    p.add_argument("--log-level", default="INFO", type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="logging level")
    return p


def option_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Each parsed option's destination → its flag, where the flag is the destination's name
    (``rerank_depth`` → ``--rerank-depth``; the convention :func:`dataclass_from_args` relies on)."""
    usage = set(re.findall(r"--[\w-]+", parser.format_usage()))
    flags = {dest: "--" + dest.replace("_", "-") for dest in vars(args)}
    return {dest: flag for dest, flag in flags.items() if flag in usage}


def dataclass_from_args(cls, args: argparse.Namespace, **overrides):
    """Fill a dataclass config from parsed flags with the same field names (dashes → underscores)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def run_job(main: Callable[[argparse.Namespace], int | None], parser: argparse.ArgumentParser,
            argv: list[str] | None = None) -> None:
    """Parse flags, set up logging and Ray, run ``main``; a CkrayError ends with its message, exit 2, and
    so does an OS error of :data:`STORAGE_ERRNOS` (full or read-only file system), naming its path. A
    ConfigError about a config field whose name is one of the job's options (``ConfigError.invalid``,
    e.g. ``EvaluateConfig.k``) names the option's flag instead (``--k``)."""
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if getattr(args, "address", None):
        os.environ["RAY_ADDRESS"] = args.address
    try:
        code = main(args)
    except CkrayError as e:
        if isinstance(e, ConfigError):
            e = e.for_flags(option_flags(parser, args))
        logging.getLogger("ckray").error("%s", e)
        sys.exit(2)
    except OSError as e:
        if e.errno not in STORAGE_ERRNOS:
            raise
        logging.getLogger("ckray").error("cannot write %s: %s", e.filename or "the work directory", e.strerror)
        sys.exit(2)
    sys.exit(code or 0)
