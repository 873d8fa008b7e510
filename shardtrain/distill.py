"""``shardtrain distill``: knowledge distillation end to end, in one Spark application.

1. shard the raw data (``shard``) and train the teacher on it (``teacher``: a train config);
2. shard the same rows again with the teacher's soft targets (``soft_targets``: where, and at which
   temperature; the shard job's ``teacher`` option, scored once by Spark);
3. train the student on that dataset with ``train.distill`` (``student``: a train config).
   With ``soft_targets.unlabeled: transfer`` its train split also keeps the rows without a label
   (the teacher's dataset quarantines them): a transfer set taught by the soft targets alone.

Both datasets come from the same shard config, so their splits hold the same rows: the teacher's
and the student's test metrics are comparable. Each stage is ``shardtrain run`` (shardtrain/run.py)
with its own config, so the modes (``skip_if_exists``, ``overwrite``) and checks are the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.config import from_dict, load_config, require, setting, storage_path, to_dict
from pipelines.shard_config import ShardConfig
from shardtrain.run import RunConfig, RunResult
from training.config import TrainConfig


@dataclass
class SoftTargetsConfig:
    path: str = storage_path(
        "the student's dataset: the shard config's rows plus the teacher column; must differ from "
        "`shard.output.path`")
    temperature: float = setting("of the stored probabilities; 1 for regression (it does not apply)", default=2.0)
    unlabeled: Literal["quarantine", "transfer"] = setting(
        "rows without a label in the student's dataset: quarantined (as in the teacher's), or kept in its train "
        "split as a transfer set that learns from the soft targets only (the teacher's dataset quarantines them: "
        "raise `shard.quality.max_bad_fraction` accordingly)", default="quarantine")

    def __post_init__(self):
        require(bool(self.path), "path", "must not be empty")
        require(0 < self.temperature < float("inf"), "temperature", f"must be > 0, got {self.temperature}")


@dataclass
class DistillRunConfig:
    shard: ShardConfig = setting(
        "raw data to the teacher's dataset (`shard.output.path`); its `teacher` section stays unset")
    teacher: TrainConfig = setting("the teacher's train config; `data.path`: `shard.output.path` (unset, or equal)")
    soft_targets: SoftTargetsConfig = setting("the student's dataset: the same rows with the teacher's soft targets")
    student: TrainConfig = setting(
        "the student's train config; `data.path`: `soft_targets.path` (unset, or equal); `train.distill` required")

    def __post_init__(self):
        require(self.shard.teacher is None, "shard.teacher",
                "must be unset: the distill command trains the teacher and sets it for the student's dataset")
        for key, train, path in (("teacher", self.teacher, self.shard.output.path),
                                 ("student", self.student, self.soft_targets.path)):
            if train.data.path is None:
                train.data.path = path
            require(train.data.path == path, f"{key}.data.path", f"must be {path} or unset, got {train.data.path}")
        require(self.soft_targets.path != self.shard.output.path, "soft_targets.path",
                "must differ from shard.output.path (the teacher's dataset)")
        require(self.student.train.distill is not None, "student.train.distill",
                "must be set (e.g. {alpha: 0.5}): the student learns from the teacher's soft targets")
        require(self.shard.label.classification or self.soft_targets.temperature == 1,
                "soft_targets.temperature", f"must be 1 for a {self.shard.label.task} label (a value has no "
                f"temperature), got {self.soft_targets.temperature:g}")
        self.student_shard()  # its own validation

    def student_shard(self) -> ShardConfig:
        """The shard config of the student's dataset: ``shard`` with the teacher's soft targets."""
        data = to_dict(self.shard)
        data["output"]["path"] = self.soft_targets.path
        data["teacher"] = {"model": self.teacher.output.model_path, "temperature": self.soft_targets.temperature}
        data["label"]["unlabeled"] = self.soft_targets.unlabeled
        return from_dict(ShardConfig, data, "shard")


def load_distill_config(path=None, overrides=None, defaults: dict | None = None) -> DistillRunConfig:
    return load_config(DistillRunConfig, path, overrides, defaults)


@dataclass
class DistillResult:
    teacher: RunResult
    student: RunResult

    def summary(self) -> str:
        return (f"== teacher ==\n{self.teacher.summary()}\n== student (distilled) ==\n{self.student.summary()}")


def distill(cfg: DistillRunConfig, spark=None) -> DistillResult:
    """Train the teacher, shard with its soft targets, train the student (one Spark application,
    built from ``cfg.shard.spark``). Every path is checked before anything runs."""
    from common.spark import get_or_create_session
    from shardtrain.run import run
    from training.api import session_for

    _check_paths(cfg)
    spark = spark or get_or_create_session(session_for(cfg.shard.spark, cfg.teacher.launch))
    teacher = run(RunConfig(shard=cfg.shard, train=cfg.teacher), spark)
    student = run(RunConfig(shard=cfg.student_shard(), train=cfg.student), spark)
    return DistillResult(teacher=teacher, student=student)


def _check_paths(cfg: DistillRunConfig) -> None:
    """No stage's output may be, contain or sit inside what another stage reads (exit 2, up front:
    not after the teacher has trained for an hour)."""
    from common.output_guard import check_disjoint, check_output_uri
    from common.storage import check_uri
    from training.api import check_outputs

    for uri in [*cfg.shard.uris, cfg.soft_targets.path, cfg.teacher.output.model_path, cfg.student.output.model_path]:
        check_uri(uri)
    sources = {f"shard source {name!r} (shard.sources.{name}.path)": src.path for name, src in cfg.shard.sources.items()}
    check_output_uri(cfg.soft_targets.path, "soft_targets.path")
    check_disjoint(cfg.soft_targets.path, "soft_targets.path",
                   {**sources, "the teacher's dataset (shard.output.path)": cfg.shard.output.path,
                    "the teacher model (teacher.output.model_path)": cfg.teacher.output.model_path})
    datasets = {"the teacher's dataset (shard.output.path)": cfg.shard.output.path,
                "the student's dataset (soft_targets.path)": cfg.soft_targets.path}
    check_outputs(cfg.teacher, {**sources, **datasets})
    check_outputs(cfg.student, {**sources, **datasets,
                                "the teacher model (teacher.output.model_path)": cfg.teacher.output.model_path,
                                "the teacher's run directory (teacher.output.run_dir)":
                                    cfg.teacher.output.resolved_run_dir})


def handle_distill(args) -> int:
    result = distill(load_distill_config(args.config, args.overrides))
    print(result.summary())
    return 0


__all__ = ["DistillResult", "DistillRunConfig", "SoftTargetsConfig", "distill", "handle_distill",
           "load_distill_config"]
