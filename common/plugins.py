"""User code named in a config as ``package.module:function`` (a shard transform, a model factory)."""

from __future__ import annotations

import importlib
from typing import Callable

from common.errors import ConfigError


def load_callable(spec: str, key: str) -> Callable:
    """Import ``module:function`` and return it; a ConfigError names ``key`` and what went wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{key} {spec!r} must be 'module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{key} {spec!r}: cannot import {module_name!r} ({exc})") from None
    func = getattr(module, attr, None)
    if not callable(func):
        raise ConfigError(f"{key} {spec!r}: {module_name} has no callable {attr!r}")
    return func


__all__ = ["load_callable"]
