"""``shardtrain run``: shard, then train on the result, in one Spark application.

The one place (with ``demo``) that uses both stages; it sits above ``pipelines`` and ``training``,
which never import each other. Its config tree is ``{shard: <shard config>, train: <train config>}``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from common.config import load_config, require, setting
from pipelines.shard_config import ShardConfig
from training.api import TrainResult, check_outputs, session_for, train
from training.config import TrainConfig


@dataclass
class RunConfig:
    """Shard then train in one Spark application (the one session is built from shard.spark)."""

    shard: ShardConfig = setting("the shard job's config; its `spark` section builds the one session")
    train: TrainConfig = setting("the train job's config; `data.path` defaults to `shard.output.path`",
                                 default_factory=TrainConfig)

    def __post_init__(self):
        if self.train.data.path is None:
            self.train.data.path = self.shard.output.path
        require(self.train.data.path == self.shard.output.path, "train.data.path",
                f"must be the shard output ({self.shard.output.path}) or unset, got {self.train.data.path}")


def load_run_config(path=None, overrides=None, defaults: dict | None = None) -> RunConfig:
    return load_config(RunConfig, path, overrides, defaults)


@dataclass
class RunResult:
    dataset_uri: str
    shard_skipped: bool
    train: TrainResult

    def summary(self) -> str:
        note = " (already published; reused)" if self.shard_skipped else ""
        return f"dataset: {self.dataset_uri}{note}\n{self.train.summary()}"


def run(cfg: RunConfig, spark=None) -> RunResult:
    """Shard, then train on the result, in one Spark application (built from ``cfg.shard.spark``)."""
    from common.spark import get_or_create_session
    from common.storage import check_uri
    from pipelines.shard_job import run_shard_job
    from shardtrain.teacher import teacher_scorer

    for uri in [*cfg.shard.uris, cfg.train.output.model_path]:
        check_uri(uri)  # a bad URI or missing credentials fails before Spark starts
    # Training's outputs must not touch the dataset about to be written or the raw sources.
    inputs = {"the shard output (shard.output.path)": cfg.shard.output.path,
              **{f"shard source {name!r} (shard.sources.{name}.path)": src.path
                 for name, src in cfg.shard.sources.items()}}
    if cfg.shard.teacher is not None:
        inputs["the teacher model (shard.teacher.model)"] = cfg.shard.teacher.model
    check_outputs(cfg.train, inputs)
    spark = spark or get_or_create_session(session_for(cfg.shard.spark, cfg.train.launch))
    shard = run_shard_job(spark, cfg.shard, teacher_scorer())  # runs shard.teacher, when set
    train_cfg = copy.deepcopy(cfg.train)
    train_cfg.data.path = shard.uri
    result = train(train_cfg, spark=spark)
    return RunResult(dataset_uri=shard.uri, shard_skipped=shard.skipped, train=result)


def handle_run(args) -> int:
    result = run(load_run_config(args.config, args.overrides))
    print(result.summary())
    return 0


__all__ = ["RunConfig", "RunResult", "handle_run", "load_run_config", "run"]
