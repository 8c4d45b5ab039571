"""Command lines derived from typed options: one dataclass per stage's options, each flag declared once.

A field ``max_doc_len: int = 4000`` with ``field(metadata={"help": ...})`` is the flag
``--max-doc-len`` (type ``int``, default 4000, shown in ``--help``); a ``bool`` field is an on/off pair
(``--qti/--no-qti``); ``metadata["choices"]`` limits the values; a field whose default is None says
its real default in its help. ::

    @dataclass(frozen=True)
    class MyOptions:
        top_k: int = option(64, "terms kept per document")

    add_options(parser, MyOptions, "index")          # --top-k (default: 64)
    options = options_from_args(MyOptions, args)     # MyOptions(top_k=...)

Imports neither torch nor Ray.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from ckray.errors import ConfigError


def option(default: Any, help: str, choices: tuple | None = None, flag: str | None = None) -> Any:
    """A dataclass field declaring one flag: its default, help and (optionally) its allowed values and a
    flag name other than ``--<field-name>``."""
    metadata = {"help": help, **({"choices": choices} if choices else {}), **({"flag": flag} if flag else {})}
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(f: dataclasses.Field) -> str:
    """The flag of a field: ``metadata["flag"]`` or ``--`` + its name with dashes."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _value_type(cls: type, f: dataclasses.Field) -> type:
    """The scalar type of a field (``int`` of ``int | None``)."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def add_options(parser: argparse.ArgumentParser, cls: type, title: str | None = None,
                defaults: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """Add one flag per field of the options dataclass ``cls`` (in an argument group ``title``);
    ``defaults`` replace fields' defaults (a job's own choices). Returns ``parser``."""
    group = parser.add_argument_group(title) if title else parser
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue  # not a flag (set by code)
        default = (defaults or {}).get(f.name, f.default)
        kind = _value_type(cls, f)
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": f.metadata["help"]}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = kind
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        group.add_argument(flag_of(f), **kwargs)
    return parser


def options_from_args(cls: type, args: argparse.Namespace, **overrides: Any) -> Any:
    """The options dataclass ``cls`` from parsed flags (fields without a flag keep their default); an
    invalid value (the dataclass's ``__post_init__`` raising ``ConfigError.invalid``) names its flag."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if "help" in f.metadata and hasattr(args, f.name)}
    try:
        return cls(**{**values, **overrides})
    except ConfigError as e:
        raise e.for_flags({f.name: flag_of(f) for f in dataclasses.fields(cls)}) from None


def namespace(*options: Any, **values: Any) -> argparse.Namespace:
    """A namespace holding the fields of ``options`` (dataclasses) and ``values``: what a stage's job
    parser would have produced, for the stage code that reads flags (``ckray.api``)."""
    out = argparse.Namespace()
    for o in options:
        if o is not None:
            vars(out).update({f.name: getattr(o, f.name) for f in dataclasses.fields(o)})
    vars(out).update(values)
    return out
