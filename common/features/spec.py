"""``FeatureSpec``: a dataset's or a model's fitted features, one instance of each registered kind.

Built from the manifest's (or model.json's) ``features`` record, the statistics and vocabularies
the shard job fitted on the train split. Serving reproduces training through it: ``transform``
gives the arrays a network receives from raw rows (pandas or Arrow, whole columns at once), with
the values a row-by-row conversion gives, to the bit (tests/scoring/test_transform_columns.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from common.errors import DatasetError
from common.features.base import FILE_TEXTS, FILES, FeatureKind
from common.features.registry import KINDS
from common.features.v1 import KIND, by_kind, listed
from common.rows import MAX_CATEGORY_BYTES

NULL_SHARE = "null_share"  # a feature record's share of nulls on train (common.dataset's module doc)


class FeatureSpec:
    """Fitted preprocessing: statistics and vocabularies, from the train split only.

    ``kinds``: one instance of every registered kind (``common.features.KINDS``), in their order,
    each holding its features (possibly none). ``max_category_bytes``: the longest category (UTF-8
    bytes) the shard job took, its features.max_category_bytes (a published model records it:
    ``LoadedModel``); where unknown, the ceiling no shard job goes beyond
    (``common.rows.MAX_CATEGORY_BYTES``). A longer category is refused by the row rules
    (``too_long``) rather than scored as unseen."""

    def __init__(self, spec: list[dict] | dict, max_category_bytes: int | None = None):
        # The ordered list of records, each naming its kind; a dict by kind is the version-1 form.
        self.spec = listed(spec) if isinstance(spec, dict) else spec
        self.max_category_bytes = MAX_CATEGORY_BYTES if max_category_bytes is None else int(max_category_bytes)
        known = {kind.name for kind in KINDS}
        unknown = [(r.get("name"), r.get(KIND)) for r in self.spec if r.get(KIND) not in known]
        if unknown:
            raise DatasetError(f"feature {unknown[0][0]!r} is of kind {unknown[0][1]!r}; this shardtrain knows "
                               f"the kinds {sorted(known)}")
        grouped = by_kind(self.spec)
        self.kinds: list[FeatureKind] = [kind(grouped[kind.name], self.max_category_bytes) for kind in KINDS]
        self._owner = {name: kind for kind in self.kinds for name in kind.names}
        # Each feature's share of nulls on train, where the spec records one (not before it was).
        self.null_shares = {r["name"]: float(r[NULL_SHARE]) for kind in self.kinds for r in kind.records
                            if NULL_SHARE in r}

    @property
    def columns(self) -> list[str]:
        """Every feature's raw column, in stored order."""
        return [r["name"] for r in self.spec]

    def by_kind(self) -> dict[str, list[dict]]:
        """The records as ``{kind name: [records]}``: what a model's factory receives (``common.features.v1``)."""
        return by_kind(self.spec)

    def kind_of(self, name: str) -> FeatureKind:
        """The kind instance that holds feature ``name``."""
        return self._owner[name]

    def of(self, kind: type) -> FeatureKind:
        """This spec's instance of the registered kind ``kind`` (tests; a kind's own callers)."""
        return next(k for k in self.kinds if type(k) is kind)

    @property
    def encoding(self) -> dict:
        """The spec without what describes the train data rather than how a value is encoded (the
        null shares): two specs encode every row alike exactly when these are equal, whether or
        not they were written before null shares were recorded."""
        return [{k: v for k, v in f.items() if k != NULL_SHARE} for f in self.spec]

    def stored_columns(self) -> list[dict]:
        """The stored column of each feature, in the spec's order."""
        by_name = {c["name"]: c for kind in self.kinds for c in kind.stored_columns()}
        return [by_name[name] for name in self.columns]

    def teacher_features(self) -> list[dict]:
        """What a teacher record lists as the raw columns it reads: each feature's contract
        (its name, kind and what else its kind says a reader must match, e.g. an array's shape)."""
        return [{**kind.contract(r), KIND: kind.name} for kind in self.kinds for r in kind.records]

    def inputs(self) -> dict:
        """model.json's ``inputs``: each kind's raw columns as the network takes them."""
        return {kind.name: kind.input_entry() for kind in self.kinds}

    def transform(self, frame: Any) -> dict[str, np.ndarray]:
        """Raw rows (pandas DataFrame or pyarrow Table) -> the arrays training saw: every kind's
        batch entries (``batch_keys``); a missing column raises DatasetError naming it."""
        self.require_columns(frame)
        n = len(frame) if not hasattr(frame, "num_rows") else frame.num_rows
        out: dict[str, np.ndarray] = {}
        for kind in self.kinds:
            out.update(kind.batch(frame, n))
        return out

    def batch_layout(self) -> list:
        """Every kind's batch entries and the stored columns they come from (``BatchEntry``)."""
        return [entry for kind in self.kinds for entry in kind.batch_layout()]

    def batch_keys(self) -> list[str]:
        return [key for kind in self.kinds for key in kind.batch_keys()]

    def probe(self, rows: int = 2) -> dict[str, np.ndarray]:
        """``rows`` rows of every batch entry: zeros, and in the last row each lookup's largest index."""
        out: dict[str, np.ndarray] = {}
        for kind in self.kinds:
            out.update(kind.probe(rows))
        return out

    def summary(self) -> str:
        """One line: each kind's count or shapes (``inspect``; model.json's field checks)."""
        return ", ".join(kind.summary_part() for kind in self.kinds if kind.names or kind.batch_keys())

    def require_columns(self, frame: Any) -> None:
        """Every feature column is in ``frame`` (pandas or Arrow), else a DatasetError naming them."""
        names = list(frame.column_names if hasattr(frame, "column_names") else frame.columns)
        missing = [c for c in self.columns if c not in names]
        if missing:
            raise DatasetError(f"input is missing feature column(s) {missing}; it has {names}")

    # --- the kinds' side files (common.features.base.FILES) ----------------------------------------

    def file_texts(self) -> dict[str, str]:
        """{path: text} of the side files the records carry while the shard job runs."""
        return {path: text for r in self.spec for path, text in (r.get(FILE_TEXTS) or {}).items()}

    def published(self) -> list[dict]:
        """The records as the manifest holds them: without their side files' text."""
        return [{k: v for k, v in r.items() if k != FILE_TEXTS} for r in self.spec]

    def attach(self, root) -> None:
        """Read the side files listed by the records from ``root`` (a dataset's or model's
        Location) into the kinds (``attached``); each is checked against its recorded sha256
        first, so a changed one is refused, named."""
        from common.file_digest import verify_digest

        texts = {}
        for r in self.spec:
            for entry in r.get(FILES) or []:
                verify_digest(root.join(entry["path"]), entry["sha256"])
                texts[entry["path"]] = root.read_text(entry["path"])  # small; a registry's copy is temporary
        for kind in self.kinds:
            kind.attached = texts

    def stored_values(self, name: str, values: Any) -> Any:
        """One feature's typed values as the shard writer stores them (its kind decides)."""
        return self._owner[name].stored_values(name, values)
