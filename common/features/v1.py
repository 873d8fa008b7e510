"""The version-1 reader of a ``features`` record: a dataset manifest of ``format_version`` 1 and a
model.json of ``format_version`` 2 hold their features as a dict by kind,
``{kind name: [records]}`` (a teacher record's as ``{kind name: [names or {"name", "shape"}]}``);
since then a ``features`` record is one ordered list of records that each name their ``kind``.

``listed`` turns the dict-by-kind form into the list (in ``KINDS`` order, then each kind's own
order: the stored columns' order in those files, so nothing a reader derives from it changes);
``by_kind`` gives the dict-by-kind form back, which a plug-in model's factory receives
(``factory(feature_spec, label_spec)``, README) and the built-in models read their sizes from.
"""

from __future__ import annotations

from common.features.registry import KINDS

KIND = "kind"  # the key of a record that names its kind


def listed(by_kind: dict) -> list[dict]:
    """``{kind name: [records]}`` as the ordered list of records, each naming its kind (a name
    alone, as a version-1 teacher record lists it, becomes ``{"name": name}``)."""
    records = []
    for kind in KINDS:
        for entry in by_kind.get(kind.name) or []:
            entry = entry if isinstance(entry, dict) else {"name": entry}
            records.append({"name": entry.get("name"), KIND: kind.name, **entry})
    return records


def by_kind(records: list[dict]) -> dict[str, list[dict]]:
    """The ordered list as ``{kind name: [records without their kind]}``, every registered kind
    present (an empty list where there is none)."""
    return {kind.name: [{k: v for k, v in r.items() if k != KIND} for r in records if r.get(KIND) == kind.name]
            for kind in KINDS}
