"""``KINDS``: the registered feature kinds, in stored-column and row-rule order.

Adding a kind is its module and one entry here. The list is the one object every user of kinds
reads (they import it, never copy it), so a kind appended to it at run time takes part in
everything that reads features: manifests, row rules, serving, the loader (a test registers one
that way: tests/common/test_feature_kinds.py). The shard config's keys are made from it once, at
import (pipelines/shard_config.py).
"""

from __future__ import annotations

from common.features.arrays import Arrays
from common.features.base import FeatureKind
from common.features.categorical import Categorical
from common.features.images import Images
from common.features.numeric import Numeric
from common.features.text import Text

KINDS: list[type[FeatureKind]] = [Numeric, Categorical, Arrays, Images, Text]


def kind_named(name: str) -> type[FeatureKind]:
    """The registered kind called ``name`` (a manifest section); KeyError when there is none."""
    for kind in KINDS:
        if kind.name == name:
            return kind
    raise KeyError(name)
