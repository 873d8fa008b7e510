"""``KINDS``: the registered feature kinds, in stored-column and row-rule order."""

from __future__ import annotations

from common.features.arrays import Arrays
from common.features.base import FeatureKind
from common.features.categorical import Categorical
from common.features.numeric import Numeric

KINDS: tuple[type[FeatureKind], ...] = (Numeric, Categorical, Arrays)


def kind_named(name: str) -> type[FeatureKind]:
    """The registered kind called ``name`` (a manifest section); KeyError when there is none."""
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise KeyError(name)
