"""One exception type per user-facing failure family. Messages name the file/field and what to do."""


class CkrayError(Exception):
    """Base class of every error ckray raises on purpose."""


class CollectionError(CkrayError):
    """A collection file is malformed (names the file and line)."""


class ConfigError(CkrayError):
    """A configuration value or command-line flag is invalid (names the field)."""


class MissingArtifactError(CkrayError):
    """An artifact a job needs (index, checkpoint, shards) is absent or half-written."""
