"""One exception type per user-facing failure family. Messages name the file/field and what to do."""

from __future__ import annotations

from typing import Mapping


class CkrayError(Exception):
    """Base class of every error ckray raises on purpose."""


class CollectionError(CkrayError):
    """A collection file is malformed (names the file and line)."""


class DuplicateDocumentError(CollectionError):
    """A document id occurs twice in a corpus (``doc_id`` says which)."""

    def __init__(self, message: str, doc_id: str) -> None:
        super().__init__(message)
        self.doc_id = doc_id


class ConfigError(CkrayError):
    """A configuration value or command-line flag is invalid (names the field).

    An error about one field of a config dataclass (:meth:`invalid`) keeps the field and what is wrong
    with it, so the layer that built the config from command-line flags can name the flag instead
    (:meth:`for_flags`): ``TrainConfig.max_steps must be >= 1, got 0`` → ``--max-steps must be >= 1, got 0``."""

    def __init__(self, message: str, *, field: str | None = None, problem: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.problem = problem

    @classmethod
    def invalid(cls, owner: str, field: str, problem: str) -> ConfigError:
        """``<owner>.<field> <problem>``, e.g. ``invalid("TrainConfig", "lr", "must be > 0, got 0.0")``."""
        return cls(f"{owner}.{field} {problem}", field=field, problem=problem)

    @classmethod
    def check_fields(cls, owner: str, checks: Mapping[str, tuple[bool, str]]) -> None:
        """Raise :meth:`invalid` for the first field of ``checks`` (field → (is it valid, the problem
        when it is not)) that is not valid; a config's ``__post_init__`` in one table."""
        for field, (valid, problem) in checks.items():
            if not valid:
                raise cls.invalid(owner, field, problem)

    def for_flags(self, flags: Mapping[str, str]) -> ConfigError:
        """This error naming the command-line flag of its field (``flags``: field → flag), when it has one."""
        if self.field is None or self.problem is None or self.field not in flags:
            return self
        return ConfigError(f"{flags[self.field]} {self.problem}", field=self.field, problem=self.problem)


class MissingArtifactError(CkrayError):
    """An artifact a job needs (index, checkpoint, shards) is absent or half-written."""
