"""Typed configuration trees: YAML from conf/ -> key.sub=value overrides -> typed dataclasses.

This module owns the loading order and every config error a user can see. It knows nothing
about what the keys mean; each job declares its tree as dataclasses (see shard_config.py and
training/config.py) and validates its own values in ``__post_init__``.

Order, always the same: read the YAML file, apply command-line overrides in the order given,
reject unknown keys (suggesting the closest valid one), check types (naming the key and the
expected type), then each dataclass validates itself once; last, every storage path in the tree
is made absolute (see ``storage_path``).

Storage paths: a job's config declares the keys that name a place it reads or writes with
``storage_path()``. ``from_dict`` (so ``load_config``, and every config built from plain data)
makes each relative local path absolute from this process's working directory, once, on the
driver (``common.storage.absolute_uri``; URIs with a scheme and absolute paths stay as written).
The config is what travels to executors and ranks, whose working directory is another (a Spark
Connect session's Python workers run in its artifact directory; a cluster's executors, in theirs):
there ``artifacts/model`` would name another place, or nothing. Loading a saved config again
gives the same values, so fingerprints over it hold.

Help text: each field declares what it means to users in its metadata (``setting``, ``storage_path``),
so the configuration reference is generated from the dataclasses and cannot drift from them
(common/config_keys.py lists a tree's keys with their types, defaults and help).

YAML (a file, an override's value) is loaded by ``parse_yaml``: safe tags only, UTF-8, no key
twice in a mapping, and aliases bounded by the nodes they add, counted before anything is built,
so no input can exhaust memory before the checks above refuse it. Numbers must be finite.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import difflib
import hashlib
import json
import math
import types
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from common.errors import ConfigError

T = TypeVar("T")

# The field metadata key that marks a storage path (``storage_path``).
STORAGE_PATH = "shardtrain.storage_path"
# The field metadata key holding a key's help text (``setting``): what the configuration reference
# shows for it (common/config_keys.py lists the keys; the docs site renders them).
HELP = "shardtrain.help"


def setting(help: str, **kwargs) -> Any:
    """A config field with its help text: ``num_shards: int = setting("shard files per split", default=8)``
    (``default_factory=`` for a list or a mapping; neither: a required key). The text is what the
    configuration reference shows for the key, so it is written for users: what the key does, its
    values, what null means where null is allowed. Comments beside a field keep saying *why* the code
    does what it does."""
    return field(metadata={HELP: help}, **kwargs)


# Linux's limits on what exec() takes (a longer one fails with E2BIG, "Argument list too long"):
# one argument, and the arguments and environment together. A session this package creates passes
# each spark.conf setting as one ``--conf key=value`` argument of spark-submit, which passes it on
# to the JVM's command line; the total leaves room for the environment and Spark's own arguments.
MAX_ARGUMENT_BYTES = 128 * 1024 - 1
MAX_CONF_BYTES = 1024 * 1024


@dataclass
class SparkConfig:
    """The ``spark`` section every job config has: how to build a session when none is active."""

    master: str = setting((
        "the Spark master of a session this job creates; ignored under spark-submit (its `--master` wins), "
        "when a session exists (notebooks), and over Spark Connect (`spark.conf` key `spark.remote: "
        "sc://host:port`, or the `SPARK_REMOTE` environment variable)"), default="local[2]")
    app_name: str = setting("the Spark application's name", default="shardtrain")
    conf: dict[str, Any] = setting((
        "settings passed to the SparkSession builder (`spark.driver.memory: 2g`); ignored when a session "
        "already exists. Each `key=value` at most 131,071 bytes and 1 MiB in all (it goes on the JVM's "
        "command line)"), default_factory=dict)

    def __post_init__(self):
        # Checked here, not when the JVM starts: there it is a traceback from deep in pyspark.
        total = 0
        for key, value in self.conf.items():
            size = len(f"{key}={value}".encode("utf-8", "surrogateescape"))
            total += size + len("--conf ")
            require(size <= MAX_ARGUMENT_BYTES, f"conf.{key}",
                    f"is {size:,} bytes, too long for the command line that starts Spark's JVM (at most "
                    f"{MAX_ARGUMENT_BYTES:,} bytes per setting); put a long value in a file Spark reads instead")
            require(total <= MAX_CONF_BYTES, f"conf.{key}",
                    f"brings spark.conf to {total:,} bytes, too long for the command line that starts Spark's JVM "
                    f"(at most {MAX_CONF_BYTES:,} bytes in all); put long values in a file Spark reads instead")


# Nodes that YAML aliases may add to a document once expanded. A config repeats a block now and
# then; a "billion laughs" document (9 levels of 10 aliases) expands to 10^9 nodes, which every
# later step (merge, copy, type check) would build in memory before anything could refuse it.
MAX_ALIAS_EXPANSION = 10_000


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that repeats a key (YAML says keys are unique;
    PyYAML keeps the last, so a typo'd second ``lr:`` would silently win)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base`: keys written beside it override the merged ones, by design
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: the base class says what is wrong with it
            if first is not None:
                raise ConfigError(f"duplicate key {key!r} at line {line} (first at line {first}): a key may appear "
                                  "once per section; remove one")
            seen[key] = line
        return super().construct_mapping(node, deep)


def parse_yaml(text: str, source: str) -> Any:
    """One YAML document, loaded safely: no Python objects, no duplicate keys, and aliases adding
    at most MAX_ALIAS_EXPANSION nodes. ConfigError naming ``source`` otherwise."""
    loader = _ConfigLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_alias_expansion(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"malformed YAML in {source}{where}: {problem}") from None
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: the YAML is nested too deeply to be a config") from None
    finally:
        loader.dispose()


def _check_alias_expansion(root: yaml.Node, source: str) -> None:
    """Count the nodes the document has once its aliases are expanded, from the composed graph
    (where an alias is the anchored node itself, shared), without expanding anything."""
    sizes: dict[int, int] = {}  # id(node) -> nodes in its expansion
    visiting: set[int] = set()

    def children(node):
        if isinstance(node, yaml.SequenceNode):
            return node.value
        if isinstance(node, yaml.MappingNode):
            return [n for pair in node.value for n in pair]
        return []

    def expanded(node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in visiting:
            raise ConfigError(f"the YAML alias at line {node.start_mark.line + 1} refers to a node that contains "
                              "it; a config cannot be recursive")
        visiting.add(id(node))
        total = 1 + sum(expanded(child) for child in children(node))
        visiting.discard(id(node))
        sizes[id(node)] = total
        if total - len(sizes) > MAX_ALIAS_EXPANSION:
            raise ConfigError(f"its YAML aliases expand to more than {MAX_ALIAS_EXPANSION:,} extra nodes (an alias "
                              "bomb?); write the repeated values out, or use fewer aliases")
        return total

    expanded(root)


def read_yaml(path: str | Path) -> dict:
    """Read one YAML mapping; every failure names the file (and line, for syntax errors)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line}); save it as "
                          "UTF-8") from None
    data = parse_yaml(text, str(path))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b.c=value`` -> (["a", "b", "c"], value); the value is parsed as YAML (1, true, [1,2])."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    try:
        value = parse_yaml(raw, f"override {text[:80]!r}") if raw.strip() else ""
    except ConfigError as exc:
        if not str(exc).startswith("malformed YAML"):
            raise  # an alias bomb or a duplicate key is refused, not taken as text
        value = raw  # an unparseable value is taken as the literal string
    return key.split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for i, part in enumerate(path[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                dotted = ".".join(path[: i + 1])
                raise ConfigError(f"override {text!r}: {dotted} is a value, not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: list[str] | None = None,
                defaults: dict | None = None) -> T:
    """Build ``cls`` from (defaults, then) the YAML file, then overrides. Raises ConfigError."""
    data = _deep_copy(defaults or {})
    if path is not None:
        data = deep_merge(data, read_yaml(path))
    data = apply_overrides(data, overrides or [])
    source = str(path) if path is not None else "<defaults>"
    try:
        return from_dict(cls, data)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def storage_path(help: str = "", **kwargs) -> Any:
    """A config field naming a place a job reads or writes (a local path or a URI), declared as
    ``path: str = storage_path("help")`` or ``path: str | None = storage_path("help", default=None)``:
    the loader makes it absolute (see the module docstring), and ``storage_paths`` lists it."""
    return field(metadata={STORAGE_PATH: True, **({HELP: help} if help else {})}, **kwargs)


def storage_paths(cfg: Any) -> dict[str, str]:
    """Every storage path set in the config tree ``cfg``, by its dotted key (``output.path``,
    ``sources.raw.path``): what a check of where a job's files are names."""
    return {key: getattr(owner, name) for key, owner, name in _storage_fields(cfg, "")}


def absolute_storage_paths(cfg: T) -> T:
    """``cfg`` with every relative local storage path made absolute, in place (and returned)."""
    from common.storage import absolute_uri

    for _, owner, name in list(_storage_fields(cfg, "")):
        setattr(owner, name, absolute_uri(getattr(owner, name)))
    return cfg


def with_absolute_paths(cfg: T) -> T:
    """A copy of ``cfg`` with its storage paths absolute: what a job's entry point works on, so a
    config built in code (a notebook's ``TrainConfig(...)``, which never passed through
    ``from_dict``) names the same places on every process as a loaded one. The caller's object is
    left as it was."""
    import copy

    return absolute_storage_paths(copy.deepcopy(cfg))


def _storage_fields(cfg: Any, prefix: str):
    """(dotted key, the dataclass holding it, field name) of each storage path set under ``cfg``."""
    if dataclasses.is_dataclass(cfg):
        for f in dataclasses.fields(cfg):
            value, key = getattr(cfg, f.name), _join(prefix, f.name)
            if f.metadata.get(STORAGE_PATH):
                if isinstance(value, str):
                    yield key, cfg, f.name
            else:
                yield from _storage_fields(value, key)
    elif isinstance(cfg, dict):
        for name, value in cfg.items():
            yield from _storage_fields(value, _join(prefix, str(name)))


def from_dict(cls: type[T], data: Any, prefix: str = "") -> T:
    """Build the dataclass ``cls`` from plain data, checking keys and types recursively, then make
    its storage paths absolute (``absolute_storage_paths``)."""
    return absolute_storage_paths(_build(cls, data, prefix))


def _build(cls: type[T], data: Any, prefix: str = "") -> T:
    """``from_dict`` without the storage paths' last step (for the sections inside a tree)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {_describe(data)}")
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.5)
        hint = f"; did you mean {_join(prefix, close[0])!r}?" if close else f"; valid keys: {', '.join(sorted(fields))}"
        raise ConfigError(f"unknown key {_join(prefix, key)!r}{hint}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, _join(prefix, name))
    missing = [name for name, f in fields.items() if name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"missing required key {_join(prefix, missing[0])!r}")
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        # __post_init__ messages name the key relative to their own section.
        msg = str(exc)
        raise ConfigError(f"{prefix}.{msg}" if prefix and not msg.startswith(prefix) else msg) from None


def to_dict(cfg: Any) -> Any:
    """The resolved config as plain data (what gets saved beside every output)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    return cfg


def config_fingerprint(cfg: Any) -> str:
    """12 hex digits of the sha256 of the resolved config: in a job's first log line, it says
    which config ran. The config saved beside an output, loaded again, has the same fingerprint."""
    text = json.dumps(to_dict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]


def deep_merge(base: dict, update: dict) -> dict:
    out = _deep_copy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = _deep_copy(value)
    return out


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [arg for arg in args if arg is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error (e.g. a section's validation) says more
            return _coerce(options[0], value, key)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError:
                pass  # try the next alternative; the message below names them all
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {_describe(value)}")
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {_describe(value)}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {_describe(value)}")
        _, val_tp = get_args(tp) or (str, Any)
        return {str(k): _coerce(val_tp, v, f"{key}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if isinstance(value, float) or abs(value) < 2 ** 1023 else math.inf
            if not math.isfinite(number):
                # No config number means anything at inf or NaN (a rate, a weight, a fill value),
                # and NaN passes every range check (all its comparisons are false).
                raise ConfigError(f"{key} must be a finite number, got {str(value)[:40]}")
            return number
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)  # `app_name=2024` from a command line is still a name
    else:
        raise TypeError(f"unsupported config type {tp!r} for {key}")
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {_describe(value)}")


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in get_args(tp) if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(map(str, get_args(tp)))
    if origin in (list, tuple):
        return "a list"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{value!r} ({type(value).__name__})"


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def require(condition: bool, key: str, message: str) -> None:
    """For ``__post_init__``: ``require(self.num_shards > 0, "num_shards", "must be >= 1")``."""
    if not condition:
        raise ConfigError(f"{key} {message}")


def dump_yaml(cfg: Any) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


__all__ = [
    "MAX_ALIAS_EXPANSION", "SparkConfig", "absolute_storage_paths", "apply_overrides", "config_fingerprint",
    "HELP", "deep_merge", "dump_yaml", "from_dict", "load_config", "parse_override", "parse_yaml", "read_yaml", "require",
    "setting", "storage_path", "storage_paths", "to_dict", "with_absolute_paths",
]
