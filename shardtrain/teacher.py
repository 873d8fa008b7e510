"""The shard job's teacher scorer: scoring's Spark function, handed to ``pipelines`` (which never
imports ``scoring``) as a ``pipelines.teacher.TeacherScorer``.

``shardtrain shard``, ``run`` and ``distill`` pass ``teacher_scorer()`` to the shard job; from
Python, ``shard_dataset(cfg, teacher_scorer=teacher_scorer())``. Imports of scoring and training
are lazy: building the scorer costs nothing, so ``shardtrain --help`` stays fast.
"""

from __future__ import annotations

from common.dataset import TEACHER_COLUMN
from common.sql import quote_identifier, quote_string
from pipelines.teacher import TeacherScorer


def teacher_scorer() -> TeacherScorer:
    return TeacherScorer(describe=describe_teacher, score=score_teacher)


def describe_teacher(model_uri: str, trust_code: bool = False) -> dict:
    """A published model's identity (its model.json's sha256, which the commit marker records and
    which names every file's sha256) and contract (task, classes, the raw features it reads)."""
    from training.export import load_model

    # Verifies the files; a missing or damaged model is exit 2 here, as is one holding code not trusted.
    model = load_model(model_uri, trust_code=trust_code)
    label, spec = model.label, model.features
    return {"fingerprint": model.fingerprint, "task": label.task,
            **({"num_classes": int(label.num_classes)} if label.classification else {}),
            **({"classes": list(label.classes)} if label.classes is not None else {}),
            "features": spec.teacher_features()}


def score_teacher(rows, model_uri: str, temperature: float, fingerprint: str | None = None, trust_code: bool = False):
    """``rows`` plus the ``teacher`` column: probabilities at ``temperature`` or the value.

    ``fingerprint``: the one ``describe_teacher`` gave, which the manifest records; a model
    replaced at the URI since is refused (exit 2), so the soft targets always come from the model
    the manifest names.

    A row the teacher cannot score fails the job: the shard job's row rules are the teacher's
    (pipelines.teacher checks the teacher reads the dataset's features), so it cannot happen
    unless those rules and scoring's drift apart, and a null soft target must never be stored.
    """
    from scoring.predict import OUTPUT_COLUMNS, PREDICTION, PROBABILITIES, REASON, predict_frame

    # The shard job needs none of the raw columns named like score columns (it keeps its own typed copies).
    keep = [c for c in rows.columns if c not in OUTPUT_COLUMNS]
    scored = predict_frame(rows, model_uri, temperature=temperature, keep_columns=keep, fingerprint=fingerprint,
                           trust_code=trust_code)
    value = PROBABILITIES if PROBABILITIES in scored.columns else PREDICTION
    failure = quote_string(f"the teacher model {model_uri} cannot score a row the shard job kept: ")
    return scored.selectExpr(
        *[quote_identifier(c) for c in keep],
        f"CASE WHEN {REASON} IS NULL THEN {value} ELSE raise_error(concat({failure}, {REASON})) END AS {TEACHER_COLUMN}")


__all__ = ["describe_teacher", "score_teacher", "teacher_scorer"]
