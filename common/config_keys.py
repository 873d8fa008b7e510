"""The keys of a config tree as users write them, each with its type, default and help text: what
the configuration reference lists (the docs site renders it from here) and what the docs' tests
check (every key has help text; every key a page names exists).

It reads the dataclasses' fields and their metadata (``common.config.setting``, ``storage_path``)
only: it loads no config, checks no value and imports no job.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from common.config import HELP

# How a mapping of named sections is keyed in the reference (``sources.<name>.path``).
NAME = "<name>"


@dataclass(frozen=True)
class Key:
    key: str  # dotted, as an override names it: output.num_shards, sources.<name>.path
    parent: str  # the section it sits in ("" at the top)
    type: str  # as users write values: integer, `csv` | `json`, list of integers
    default: str  # as YAML: 8, null, [128, 64]; "required" where the key has none
    help: str  # "" where the field declares none
    section: bool = False  # a section of keys rather than a value
    open: bool = False  # a mapping whose keys are the user's (spark.conf, launch.env): anything below it
    choices: tuple = ()  # a Literal's values; () where any value of the type goes
    embedded: type | None = None  # the job config this section is a whole copy of (run's shard and train)


def config_keys(cls: type, embedded: tuple[type, ...] = (), prefix: str = "") -> list[Key]:
    """Every key of the config tree ``cls``, in declaration order, each section before its keys. A
    field whose type is in ``embedded`` (a whole job config inside another: ``run``'s ``shard``) is
    one section key, documented with its own job."""
    keys = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        tp = hints[f.name]
        inner = _without_none(tp)
        row = dict(key=key, parent=prefix, type=type_text(tp), default=default_text(f), help=f.metadata.get(HELP, ""))
        if dataclasses.is_dataclass(inner):
            keys.append(Key(**row, section=True, embedded=inner if inner in embedded else None))
            if inner not in embedded:
                keys += config_keys(inner, embedded, key)
        elif _named_sections(inner):
            keys.append(Key(**row, section=True))
            keys += config_keys(get_args(inner)[1], embedded, f"{key}.{NAME}")
        else:
            choices = _choices(inner)
            keys.append(Key(**row, open=get_origin(inner) is dict or inner is Any, choices=choices))
    return keys


def find_key(keys: list[Key], dotted: str) -> Key | None:
    """The key ``dotted`` names (``sources.raw.path`` is ``sources.<name>.path``; anything below an
    open mapping, ``spark.conf.spark.sql.shuffle.partitions``, is that mapping's), or None."""
    parts = dotted.split(".")
    for key in keys:
        want = key.key.split(".")
        if len(parts) < len(want) or not all(w == p or w == NAME for w, p in zip(want, parts)):
            continue
        if len(parts) == len(want) or key.open:
            return key
        if key.embedded is not None:
            return find_key(config_keys(key.embedded), ".".join(parts[len(want):]))
    return None


def type_text(tp: Any) -> str:
    """A field's type as users write its values."""
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        text = " | ".join(type_text(a) for a in args)
        return f"{text} | null" if len(args) < len(get_args(tp)) else text
    if origin is Literal:
        return " | ".join(f"`{_yaml(v)}`" for v in get_args(tp))
    if origin in (list, tuple):
        (item, *_) = get_args(tp) or (Any,)
        return f"list of {_plural(type_text(item))}"
    if origin is dict:
        _, value = get_args(tp) or (str, Any)
        if dataclasses.is_dataclass(value):
            return "sections, each under a name of yours"
        return "mapping" if value is Any else f"mapping of {_plural(type_text(value))}"
    if dataclasses.is_dataclass(tp):
        return "section"
    return {bool: "true | false", int: "integer", float: "number", str: "string", Any: "any"}.get(tp, str(tp))


def default_text(f: dataclasses.Field) -> str:
    """A field's default as YAML, or ``required``; a section's default is its keys' own."""
    if f.default is not dataclasses.MISSING:
        return _yaml(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "" if dataclasses.is_dataclass(value) else _yaml(value)
    return "required"


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and value == int(value) and abs(value) < 1e15:
        return f"{value:.1f}"
    return "''" if value == "" else str(value)


def _plural(text: str) -> str:
    if text.startswith("list of "):
        return "lists of " + text[len("list of "):]
    return {"integer": "integers", "number": "numbers", "string": "strings"}.get(text, text)


def _without_none(tp: Any) -> Any:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _named_sections(tp: Any) -> bool:
    """``dict[str, SomeSection]``: sections the user names (``sources.raw``)."""
    return get_origin(tp) is dict and dataclasses.is_dataclass(get_args(tp)[1])


def _choices(tp: Any) -> tuple:
    if get_origin(tp) is Literal:
        return get_args(tp)
    if get_origin(tp) in (Union, types.UnionType):
        literals = [a for a in get_args(tp) if get_origin(a) is Literal]
        if len(literals) == len([a for a in get_args(tp) if a is not type(None)]):
            return tuple(v for a in literals for v in get_args(a))
    return ()


__all__ = ["Key", "NAME", "config_keys", "default_text", "find_key", "type_text"]
