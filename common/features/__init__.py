"""Feature kinds: one module per kind of feature column, and ``KINDS``, the one list of them.

A kind (``common.features.base.FeatureKind``) owns everything about its columns that more than
one stage needs: its manifest records and their checks, stored columns, row rules, the serving
encoding on raw values, the batch entries a network receives, its MLflow signature columns and
its lines in ``inspect``. ``FeatureSpec`` (``common.features.spec``) holds a dataset's or a
model's features, one kind instance per registered kind, and is what every stage uses.

Adding a kind is one new module here and one entry in ``KINDS`` (``common.features.registry``). The order of ``KINDS`` is the
stored columns' order and the order of the row rules (a row gets the first reason it breaks).
"""

from __future__ import annotations

from common.features.base import FeatureKind
from common.features.registry import KINDS, kind_named
from common.features.spec import FeatureSpec

__all__ = ["KINDS", "FeatureKind", "FeatureSpec", "kind_named"]
