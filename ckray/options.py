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
import json
import dataclasses
import typing
from typing import Any, Callable, Collection

from ckray.errors import ConfigError


def option(default: Any = dataclasses.MISSING, help: str = "", choices: tuple | None = None,
           flag: str | None = None, *, default_factory: Any = dataclasses.MISSING,
           parse: Callable[[str], Any] | None = None, metavar: str | None = None, repeatable: bool = False) -> Any:
    """A dataclass field declaring one flag: its default (or ``default_factory``), help and, optionally,
    its allowed values, a flag name other than ``--<field-name>``, a parser of the flag's text other
    than the field's type (``parse``) and the value's name in ``--help`` (``metavar``). A ``repeatable``
    field is a list: each use of its flag adds one value (given none, the field keeps its default)."""
    metadata = {"help": help, **({"choices": choices} if choices else {}), **({"flag": flag} if flag else {}),
                **({"parse": parse} if parse else {}), **({"metavar": metavar} if metavar else {}),
                **({"repeatable": True} if repeatable else {})}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def flag_of(f: dataclasses.Field) -> str:
    """The flag of a field: ``metadata["flag"]`` or ``--`` + its name with dashes."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of ``cls`` that are flags (declared with :func:`option`; the others are set by code)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def flags_of(cls: type) -> dict[str, str]:
    """Field name → flag, for every flag of ``cls`` (what :meth:`ConfigError.for_flags` needs)."""
    return {f.name: flag_of(f) for f in flag_fields(cls)}


def _value_type(cls: type, f: dataclasses.Field) -> type:
    """The scalar type of a field (``int`` of ``int | None``)."""
    hint = typing.get_type_hints(cls)[f.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def add_options(parser: argparse.ArgumentParser, cls: type, title: str | None = None,
                defaults: dict[str, Any] | None = None, dest_prefix: str = "",
                unset_is_none: bool = False, only: Collection[str] | None = None) -> argparse.ArgumentParser:
    """Add one flag per field of the options dataclass ``cls`` (in an argument group ``title``);
    ``defaults`` replace fields' defaults (a job's own choices). Each flag's destination is
    ``dest_prefix`` + the field's name. With ``unset_is_none`` a flag not given parses to None (the
    default is only shown in ``--help``), so a later layer can tell "not given" from "given as the
    default" (:func:`options_from_args` skips the Nones). ``only``: just these fields' flags (a job that
    passes a few of another stage's options on). Returns ``parser``."""
    group = parser.add_argument_group(title) if title else parser
    for f in flag_fields(cls):
        if only is not None and f.name not in only:
            continue
        default = (defaults or {}).get(f.name, _default(f))
        kind = _value_type(cls, f)
        help_text = f.metadata["help"]
        if unset_is_none:
            shown = default if isinstance(default, str) and default else repr(default)
            if "(default:" not in help_text:   # a help that says its default itself keeps it
                help_text = f"{help_text} (default: {shown})"
            default = None
        kwargs: dict[str, Any] = {"dest": dest_prefix + f.name, "default": default, "help": help_text}
        if f.metadata.get("repeatable"):   # given none, None: the field's default applies (options_from_args)
            kwargs.update(action="append", default=None, type=f.metadata.get("parse", str),
                          metavar=f.metadata.get("metavar", f.name.upper()))
        elif kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = f.metadata.get("parse", kind)
            kwargs["metavar"] = f.metadata.get("metavar", f.name.upper())
            if "choices" in f.metadata:
                kwargs.update(choices=f.metadata["choices"], metavar=None)
        group.add_argument(flag_of(f), **kwargs)
    return parser


def options_from_args(cls: type, args: argparse.Namespace, dest_prefix: str = "", **overrides: Any) -> Any:
    """The options dataclass ``cls`` from parsed flags (destinations ``dest_prefix`` + field name) over
    ``overrides``' values, which apply where a flag parsed to None or is absent (a job's own defaults,
    with :func:`add_options`'s ``unset_is_none``); the dataclass's defaults fill the rest. An invalid
    value (``__post_init__`` raising ``ConfigError.invalid``) names its flag."""
    values = dict(overrides)
    for f in flag_fields(cls):
        value = getattr(args, dest_prefix + f.name, None)
        if value is not None:
            values[f.name] = value
    try:
        return cls(**values)
    except ConfigError as e:
        raise e.for_flags(flags_of(cls)) from None


def namespace(*options: Any, **values: Any) -> argparse.Namespace:
    """A namespace holding the fields of ``options`` (dataclasses) and ``values``: what a stage's job
    parser would have produced, for the stage code that reads flags (``ckray.api``)."""
    out = argparse.Namespace()
    for o in options:
        if o is not None:
            vars(out).update({f.name: getattr(o, f.name) for f in dataclasses.fields(o)})
    vars(out).update(values)
    return out


def parse_resources(text: str) -> dict[str, float]:
    """``'{"ckray_train": 1}'`` or ``ckray_train=1,other=0.5`` → ``{"ckray_train": 1.0, ...}`` (the
    ``--resources-per-worker`` and ``--resources-per-actor`` flags: custom Ray resources that only some node
    types of ``cluster.yaml`` advertise)."""
    text = text.strip()
    try:
        if text.startswith("{"):
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
        else:
            value = {}
            for item in filter(None, (s.strip() for s in text.split(","))):
                key, sep, amount = item.partition("=")
                if not sep or not key.strip():
                    raise ValueError(f"{item!r} is not NAME=AMOUNT")
                value[key.strip()] = amount
        return {str(k): float(v) for k, v in value.items()}
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(
            f"resources {text!r}: {exc} (expected JSON like '{{\"ckray_train\": 1}}' or ckray_train=1)") from None
