"""The ``shardtrain sweep`` config: the ``sweep`` section (space, trials, seed, retries, objective,
pruner, enqueued trials, the study's storage and name), the ``output`` section (the sweep
directory and the best model's path), and the checks that tie them to the ``train`` and ``shard``
sections, all before anything runs (exit 2, naming the key).

Config only: it reads no dataset, opens no study and starts nothing (shardtrain.sweep runs it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from common.config import load_config, require, setting, storage_path
from pipelines.shard_config import ShardConfig
from shardtrain.sweep_space import check_fixed, check_space, parse_space
from training.config import TrainConfig, TrainOutputConfig
from training.tasks import validation_metrics

METRICS = validation_metrics()  # every task's, with its direction: val_loss, val_accuracy, val_mae


@dataclass
class ObjectiveConfig:
    metric: str = setting(
        "the per-epoch validation metric a trial is judged by, its last epoch's value the trial's; one the "
        "label's task reports: " + ", ".join(f"`{name}`" for name in METRICS), default="val_loss")
    direction: Literal["minimize", "maximize"] | None = setting(
        "null: the metric's own (" + ", ".join(f"`{name}`: {way}" for name, way in METRICS.items()) + ")",
        default=None)

    def __post_init__(self):
        require(self.metric in METRICS, "metric", f"must be one of {', '.join(METRICS)} (a validation metric every "
                f"epoch reports), got {self.metric!r}")
        if self.direction is None:
            self.direction = METRICS[self.metric]


@dataclass
class PrunerConfig:
    """Which trials end early, from each one's objective at every epoch end (Optuna's pruners)."""

    type: Literal["none", "median", "successive_halving", "hyperband"] = setting(
        "Optuna's pruner, fed the objective at every epoch end; a pruned trial stops at that boundary with its "
        "checkpoint written and its model published, as any run", default="median")
    startup_trials: int = setting("`median`: trials that finish before any is pruned", default=2)
    warmup_epochs: int = setting("`median`: epochs every trial runs before it may be pruned", default=0)
    min_epochs: int = setting("`successive_halving`, `hyperband`: the first rung (Optuna's min_resource)", default=1)
    reduction_factor: int = setting(
        "`successive_halving`, `hyperband`: 1 in this many trials goes on at each rung", default=3)

    def __post_init__(self):
        require(self.startup_trials >= 0, "startup_trials", f"must be >= 0, got {self.startup_trials}")
        require(self.warmup_epochs >= 0, "warmup_epochs", f"must be >= 0, got {self.warmup_epochs}")
        require(self.min_epochs >= 1, "min_epochs", f"must be >= 1, got {self.min_epochs}")
        require(self.reduction_factor >= 2, "reduction_factor", f"must be >= 2, got {self.reduction_factor}")


@dataclass
class SweepSection:
    # Any, not ParamSpec: an override `sweep.space.train.lr={...}` nests the key at its dots, which
    # parse_space joins back (shardtrain.sweep_space).
    space: dict[str, Any] = setting(
        "`train.*` / `model.*` key -> `{type: float, low, high, log, step}`, `{type: int, ...}` or "
        "`{type: categorical, choices: [...]}` (lists allowed: `model.hidden`); an unknown key, an empty range, "
        "`log` with a bound at or below 0, or a value the training config refuses is exit 2 naming the key")
    trials: int = setting("trials in the study, finished ones of earlier runs of this sweep included", default=8)
    parallel_trials: int = setting(
        "trials training at once, each a launch of `launch.num_proc` ranks: `parallel_trials x num_proc` must fit "
        "the application's task slots; more than 1 needs `launch.mode=spark` and `launch.backend=torch_tasks` or "
        "`torch`", default=1)
    seed: int = setting(
        "the sampler's (TPE): trial N draws from a stream seeded by (seed, N), so a resumed sweep draws what an "
        "uninterrupted one would", default=0)
    retries: int = setting(
        "a rerun runs a trial that failed for a reason that may pass (exit-1 class: a full disk, a lost worker) "
        "again, as a new trial with its values, at most this many times; a trial refused as bad config (exit-2 "
        "class) is never run again", default=1)
    objective: ObjectiveConfig = setting("what a trial is judged by", default_factory=ObjectiveConfig)
    pruner: PrunerConfig = setting("which trials end early", default_factory=PrunerConfig)
    enqueue: list[dict[str, Any]] = setting(
        "values for the study's first trials (`- {train.lr: 0.01}`), before drawn ones", default_factory=list)
    storage: str | None = storage_path(
        "an Optuna RDB URL (`postgresql://...`, `sqlite:///...`) or a journal file on a local path or volume; a "
        "journal on object storage is exit 2; null: `output.path/study.journal`", default=None)
    study_name: str | None = setting("null: `shardtrain-sweep-<study fingerprint>`", default=None)

    def __post_init__(self):
        self.space = parse_space(self.space)
        require(1 <= self.trials <= 100_000, "trials", f"must be in [1, 100000], got {self.trials}")
        require(0 <= self.retries <= 100, "retries", f"must be in [0, 100], got {self.retries}")
        require(1 <= self.parallel_trials <= 1024, "parallel_trials",
                f"must be in [1, 1024], got {self.parallel_trials}")
        require(self.storage is None or bool(self.storage.strip()), "storage", "must not be empty (null: a journal "
                "file beside the sweep)")
        for i, params in enumerate(self.enqueue):
            check_fixed(params, self.space, f"enqueue[{i}]")


@dataclass
class SweepOutputConfig:
    path: str = storage_path(
        "the sweep directory: `trials/NNNN` (each trial's model, run directory and checkpoints), `sweep.html`, "
        "`sweep.json`, the study's journal; it belongs to one study (another is exit 2)")
    model_path: str = storage_path("the best trial's model, published at the end")
    mode: Literal["error", "overwrite"] = setting(
        "of `model_path`: `error` refuses anything there but this study's best model, which is always replaced",
        default="error")

    def __post_init__(self):
        require(bool(self.path), "path", "must not be empty")
        require(bool(self.model_path), "model_path", "must not be empty")


@dataclass
class SweepConfig:
    sweep: SweepSection = setting("the study: its space, trials, objective and pruner")
    output: SweepOutputConfig = setting("where the trials and the best model go")
    train: TrainConfig = setting(
        "every trial's train config before its draw; its `output.model_path`, `output.run_dir` and "
        "`checkpoint.path` stay unset (each trial's are under `output.path/trials/NNNN`)", default_factory=TrainConfig)
    shard: ShardConfig | None = setting(
        "a shard config run first, as in `shardtrain run`; null: `train.data.path` names a published dataset",
        default=None)

    def __post_init__(self):
        if self.shard is not None:
            if self.train.data.path is None:
                self.train.data.path = self.shard.output.path
            require(self.train.data.path == self.shard.output.path, "train.data.path",
                    f"must be the shard output ({self.shard.output.path}) or unset, got {self.train.data.path}")
        require(self.train.data.path is not None, "train.data.path",
                "is required without a shard section: the URI of a dataset published by `shardtrain shard`")
        placed = {"train.output.model_path": self.train.output.model_path != TrainOutputConfig().model_path,
                  "train.output.run_dir": self.train.output.run_dir is not None,
                  "train.checkpoint.path": self.train.checkpoint.path is not None}
        for key, is_set in placed.items():
            require(not is_set, key, "must be unset: the sweep puts each trial's model, run directory and checkpoints "
                    "under output.path/trials/NNNN, and the best model at output.model_path")
        require(self.train.data.val_split is not None, "train.data.val_split",
                f"must name a split: the objective ({self.sweep.objective.metric}) and the pruner read validation")
        # Parallel trials are threads of the driver, each launching its ranks.
        launch, parallel = self.train.launch, self.sweep.parallel_trials
        require(parallel == 1 or launch.mode == "spark", "sweep.parallel_trials",
                f"is {parallel} with train.launch.mode=in_process: the trials would train in threads of one process, "
                "where torch's tracer (the model's TorchScript export) is not thread-safe and fails them; set "
                "sweep.parallel_trials=1, or train.launch.mode=spark")
        require(parallel == 1 or launch.backend != "horovod", "sweep.parallel_trials",
                f"is {parallel} with train.launch.backend=horovod: Horovod-on-Spark launches only from the driver's "
                "main thread (it installs signal handlers); set train.launch.backend=torch_tasks (or torch: "
                "TorchDistributor), or sweep.parallel_trials=1")
        check_space(self.sweep.space, self.train)


def load_sweep_config(path=None, overrides=None, defaults: dict | None = None) -> SweepConfig:
    return load_config(SweepConfig, path, overrides, defaults)


__all__ = ["ObjectiveConfig", "PrunerConfig", "SweepConfig", "SweepOutputConfig", "SweepSection", "load_sweep_config"]
