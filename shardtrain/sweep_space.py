"""A sweep's search space: which training keys Optuna draws, from what, and the training config of
one draw.

A space is a mapping of ``train.*`` / ``model.*`` keys of the training config (``train.lr``,
``model.hidden``, ``model.kwargs.width``) to a distribution: ``float`` (``low``, ``high``,
``log``, ``step``), ``int`` (``low``, ``high``, ``log``, ``step``) or ``categorical``
(``choices``). Everything a draw could be is checked before any trial runs: the key must name a
value of the training config, the range must hold values, a log range must be positive, and the
training config must accept the range's ends and every choice (exit 2, naming the key).

A space's keys contain dots, and a command-line override's key splits at every dot:
``sweep.space.train.lr={type: float, ...}`` arrives as ``{"train": {"lr": {...}}}``, and
``sweep.space.train.lr.high=0.1`` as ``{"train": {"lr": {"high": 0.1}}}``. ``parse_space`` joins
such nested keys back into the dotted key: a mapping with a ``type`` is a whole distribution (it
replaces the key's), any other mapping under a key the space has changes some of that key's fields.

Optuna's categorical choices are scalars; a choice that is a list or a mapping (``model.hidden:
[[64], [128, 64]]``) is stored as its JSON text and decoded when the config is built.

Driver-only, no Optuna import at module level: ``optuna`` is imported where a trial is drawn.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from common.config import from_dict, require, to_dict
from common.errors import ConfigError
from training.config import TrainConfig

SEARCHABLE = ("train", "model")  # the sections of the training config a sweep may draw


@dataclass
class ParamSpec:
    """One key's distribution."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False  # draw uniformly in log space; both bounds must be > 0
    step: float | None = None  # a grid of low, low + step, ... (not with log)
    choices: list[Any] | None = None  # categorical only

    def __post_init__(self):
        if self.type == "categorical":
            require(bool(self.choices), "choices", "must list at least one value for type: categorical")
            require(self.low is None and self.high is None and self.step is None and not self.log, "type",
                    "categorical takes choices only (no low, high, step or log)")
            return
        require(self.choices is None, "choices", f"applies to type: categorical only, not {self.type}")
        require(self.low is not None and self.high is not None, "low",
                f"and high are required for type: {self.type}")
        if self.type == "int":
            for key in ("low", "high", "step"):
                value = getattr(self, key)
                require(value is None or float(value).is_integer(), key,
                        f"must be an integer for type: int, got {value}")
        require(self.low < self.high, "high", f"must be above low: the range [{self.low:g}, {self.high:g}] is empty")
        require(not self.log or self.low > 0, "low", f"must be > 0 with log: true (a log range cannot reach "
                f"{self.low:g}); raise low or set log: false")
        require(self.step is None or self.step > 0, "step", f"must be > 0, got {self.step}")
        require(self.step is None or not self.log, "step", "cannot be combined with log: true")

    def values_to_check(self) -> list[Any]:
        """The values the training config must accept: the range's ends, or every choice."""
        if self.type == "categorical":
            return list(self.choices)
        if self.type == "int":
            return [int(self.low), int(self.high)]
        return [float(self.low), float(self.high)]


def parse_space(raw: dict[str, Any], where: str = "space") -> dict[str, ParamSpec]:
    """The space as written (dotted keys, or keys nested as an override leaves them: see the module
    docstring) -> dotted key -> ParamSpec. ConfigError naming ``<where>.<key>``."""
    flat: dict[str, Any] = {}

    def place(key: str, value: Any) -> None:
        if isinstance(value, dict) and not _is_distribution(value) and isinstance(flat.get(key), dict):
            flat[key] = {**flat[key], **value}  # `...train.lr.high=0.1`: a field of a key the space has
        elif _is_section(value):
            for sub, sub_value in value.items():
                place(f"{key}.{sub}", sub_value)
        else:
            flat[key] = value

    for key, value in raw.items():
        place(str(key), value)
    return {key: _param_spec(value, f"{where}.{key}") for key, value in flat.items()}


def _param_spec(value: Any, where: str) -> ParamSpec:
    if isinstance(value, ParamSpec):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a distribution ({{type: float, low: ..., high: ...}}, {{type: int, ...}} "
                          f"or {{type: categorical, choices: [...]}}), got {value!r}")
    try:
        return from_dict(ParamSpec, value)
    except ConfigError as exc:
        # Prefixed here, not through from_dict: the section's own prefix ("sweep.") goes in front of
        # this message, which must therefore start with the key ("missing required key ..." does not).
        raise ConfigError(f"{where}: {exc}") from None


def check_space(space: dict[str, ParamSpec], base: TrainConfig, where: str = "sweep.space") -> None:
    """Refuse (ConfigError, exit 2, naming the key) a space that cannot be drawn into ``base``."""
    require(bool(space), where, "is empty: name at least one train.* or model.* key to search")
    for key, spec in space.items():
        _check_key(key, where)
        for value in spec.values_to_check():
            try:
                trial_config(base, {key: value})
            except ConfigError as exc:
                raise ConfigError(f"{where}.{key}: the training config refuses {value!r}: {exc}") from None


def check_fixed(params: dict[str, Any], space: dict[str, ParamSpec], where: str) -> None:
    """An enqueued trial's values: keys of the space, values the space can draw."""
    for key, value in params.items():
        if key not in space:
            close = difflib.get_close_matches(key, list(space), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the space has {', '.join(sorted(space))}"
            raise ConfigError(f"{where}: {key!r} is not a key of sweep.space{hint}")
        spec = space[key]
        if spec.type == "categorical":
            require(value in spec.choices, f"{where}.{key}", f"must be one of {spec.choices}, got {value!r}")
        else:
            require(isinstance(value, (int, float)) and not isinstance(value, bool)
                    and spec.low <= value <= spec.high, f"{where}.{key}",
                    f"must be a number in [{spec.low:g}, {spec.high:g}], got {value!r}")


def suggest(trial, space: dict[str, ParamSpec]) -> dict[str, Any]:
    """Draw (or, for a trial that has them, read back) every key's value through ``trial``."""
    params = {}
    for key, spec in space.items():
        if spec.type == "float":
            params[key] = trial.suggest_float(key, spec.low, spec.high, log=spec.log, step=spec.step)
        elif spec.type == "int":
            params[key] = trial.suggest_int(key, int(spec.low), int(spec.high), log=spec.log,
                                            step=int(spec.step or 1))
        else:
            encoded = [_encode(c) for c in spec.choices] if _needs_encoding(spec.choices) else spec.choices
            value = trial.suggest_categorical(key, encoded)
            params[key] = json.loads(value) if _needs_encoding(spec.choices) else value
    return params


def optuna_params(params: dict[str, Any], space: dict[str, ParamSpec]) -> dict[str, Any]:
    """``params`` as Optuna stores them (for ``enqueue_trial``): lists and mappings as JSON text."""
    return {k: _encode(v) if k in space and space[k].type == "categorical" and _needs_encoding(space[k].choices) else v
            for k, v in params.items()}


def decode_params(stored: dict[str, Any], space: dict[str, ParamSpec]) -> dict[str, Any]:
    """Parameters as Optuna stored them -> the values they stand for (lists and mappings decoded)."""
    return {k: json.loads(v) if k in space and space[k].type == "categorical" and _needs_encoding(space[k].choices)
            and isinstance(v, str) else v for k, v in stored.items()}


def trial_config(base: TrainConfig, params: dict[str, Any], **sections: dict) -> TrainConfig:
    """``base`` with ``params`` (dotted keys) set, and whole ``sections`` replaced (``output=...``);
    validated as any training config (ConfigError naming ``train.<key>``)."""
    data = to_dict(base)
    for key, value in params.items():
        *path, leaf = key.split(".")
        node = data
        for part in path:
            if not isinstance(node.get(part), dict):  # a null section (train.distill) gets its keys
                node[part] = {}
            node = node[part]
        node[leaf] = value
    for name, value in sections.items():
        data[name] = value
    return from_dict(TrainConfig, data, "train")


def _check_key(key: str, where: str) -> None:
    """``key`` must name a value inside the train or model section of the training config."""
    parts = key.split(".")
    if parts[0] not in SEARCHABLE or len(parts) < 2:
        raise ConfigError(f"{where}: key {key!r} cannot be searched: only keys of the train and model sections "
                          "(train.lr, model.hidden, ...) can; set other keys in the train section")
    tp: Any = TrainConfig
    for depth, part in enumerate(parts):
        section = _section(tp)
        if section is None:
            if _is_mapping(tp):
                return  # model.kwargs.width: any key of a free mapping
            raise ConfigError(f"{where}: key {key!r}: {'.'.join(parts[:depth])} is a value, not a section")
        names = [f.name for f in dataclasses.fields(section) if f.init]
        if part not in names:
            prefix = ".".join(parts[:depth])
            close = difflib.get_close_matches(part, names, n=1, cutoff=0.5)
            hint = (f"; did you mean {prefix + '.' + close[0]!r}?" if close
                    else f"; {prefix} has {', '.join(sorted(names))}")
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")
        tp = get_type_hints(section)[part]
    if _section(tp) is not None:
        raise ConfigError(f"{where}: key {key!r} is a section; name one of its keys")


def _section(tp: Any):
    """The dataclass ``tp`` is (or is an optional of), else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    if get_origin(tp) in (Union,) or type(tp).__name__ == "UnionType":
        options = [a for a in get_args(tp) if a is not type(None)]
        if len(options) == 1 and dataclasses.is_dataclass(options[0]):
            return options[0]
    return None


def _is_mapping(tp: Any) -> bool:
    return get_origin(tp) is dict or tp is dict


def _is_section(value: Any) -> bool:
    """Space keys nested at their dots: a mapping that holds a mapping (a distribution's fields never
    are one) or keys that are not a distribution's fields."""
    fields = {f.name for f in dataclasses.fields(ParamSpec)}
    return (isinstance(value, dict) and not _is_distribution(value)
            and (any(isinstance(v, dict) for v in value.values()) or not set(value) <= fields))


def _is_distribution(value: dict) -> bool:
    """A whole ParamSpec (its ``type`` named), not some of one's fields (an override of them)."""
    return isinstance(value.get("type"), str)


def _needs_encoding(choices: list[Any]) -> bool:
    return any(isinstance(c, (list, dict)) for c in choices)


def _encode(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


__all__ = ["ParamSpec", "check_fixed", "check_space", "decode_params", "optuna_params", "parse_space", "suggest",
           "trial_config"]
