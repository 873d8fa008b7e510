"""The training job's config tree.

One dataclass per section, each validating itself in ``__post_init__`` with a message that names
the key to change. Section and key names are a public contract (scheduled jobs and notebooks use
them): add keys, never rename them. Load with ``load_train_config``.

This module must stay free of torch and horovod: the driver imports it before anything launches.
"""

from __future__ import annotations

import importlib.util
import posixpath
from dataclasses import dataclass, field
from typing import Any, Literal

from common.config import load_config, require, storage_path
from common.config import SparkConfig
from common.tasks import TASK_NAMES
from training.launchers import BACKENDS, launcher_for, launcher_named
from training.limits import MAX_BATCH_ROWS, MAX_PREFETCH, MAX_RANKS, MAX_READER_THREADS, MAX_WIDTH
from training.model_specs import MODELS, identity
from training.strategies import check_strategy, picked_by
from training.strategies.periodic import SyncConfig
from training.strategies.pipeline import PipelineConfig

PARALLEL = picked_by("train.parallel")  # train.parallel's choices: the strategies it names


@dataclass
class DataConfig:
    path: str | None = storage_path(default=None)  # dataset URI; in a run config it defaults to shard.output.path
    train_split: str = "train"
    val_split: str | None = "val"  # null: no validation
    # Rows shuffled together in memory (per rank), on top of a per-epoch row-group order.
    shuffle_buffer_rows: int = 65_536
    # petastorm reader threads. 1 keeps the row order a pure function of the seed, which exact
    # resume needs; more threads decode row groups in parallel but in arrival order.
    reader_workers: int = 1
    # Row groups decoded ahead of the training step (bounds the loader's memory).
    prefetch_row_groups: int = 4
    # first_read: each rank checks every shard file it reads against the manifest's sha256 the
    # first time it opens it in a run (a damaged file fails with exit 2, naming it). never: no check.
    verify: Literal["first_read", "never"] = "first_read"
    # petastorm (needs pyarrow 14) or arrow (plain pyarrow, any version); both yield the same
    # batches for the same seed. null: petastorm where it is installed, else arrow.
    reader: Literal["petastorm", "arrow"] | None = None

    def __post_init__(self):
        if self.reader is None:
            self.reader = "petastorm" if installed("petastorm") else "arrow"
        require(self.path is None or bool(self.path), "path", "must not be empty")
        require(bool(self.train_split), "train_split", "must name a split")
        require(1 <= self.shuffle_buffer_rows <= MAX_BATCH_ROWS, "shuffle_buffer_rows",
                f"must be in [1, {MAX_BATCH_ROWS:,}], got {self.shuffle_buffer_rows}")
        require(1 <= self.reader_workers <= MAX_READER_THREADS, "reader_workers",
                f"must be in [1, {MAX_READER_THREADS}], got {self.reader_workers}")
        require(1 <= self.prefetch_row_groups <= MAX_PREFETCH, "prefetch_row_groups",
                f"must be in [1, {MAX_PREFETCH}], got {self.prefetch_row_groups}")


@dataclass
class ModelConfig:
    """Every built-in model's keys (training.model_specs: each spec says which are its own) and
    what the model expects of the dataset."""

    name: str = "mlp"  # "mlp", "ft_transformer" (training.model_specs.MODELS) or "package.module:factory"
    hidden: list[int] = field(default_factory=lambda: [128, 64])  # mlp only
    # ft_transformer only: transformer blocks, token width (a multiple of heads), attention heads.
    layers: int = 4
    d_model: int = 32
    heads: int = 4
    dropout: float = 0.0
    embedding_dim: int | None = None  # null: min(16, (vocabulary size + 1) // 2)
    # Extra keyword arguments for a "module:factory" model (or overrides for the MLP).
    kwargs: dict[str, Any] = field(default_factory=dict)
    # What the model expects of the dataset; checked against the manifest before launch (null: anything).
    task: Literal[TASK_NAMES] | None = None
    num_classes: int | None = None
    features: list[str] | None = None

    def __post_init__(self):
        built_in = ", ".join(f"'{name}'" for name in MODELS)
        require(self.name in MODELS or (":" in self.name and all(self.name.split(":", 1))), "name",
                f"must be {built_in} or 'module:factory', got {self.name!r}")
        require(1 <= self.layers <= 1024, "layers", f"must be in [1, 1024], got {self.layers}")
        require(1 <= self.heads <= MAX_WIDTH, "heads", f"must be in [1, {MAX_WIDTH:,}], got {self.heads}")
        require(1 <= self.d_model <= MAX_WIDTH and self.d_model % self.heads == 0, "d_model",
                f"must be a multiple of model.heads={self.heads} in [1, {MAX_WIDTH:,}], got {self.d_model}")
        require(all(isinstance(h, int) and 0 < h <= MAX_WIDTH for h in self.hidden), "hidden",
                f"must be a list of positive integers of at most {MAX_WIDTH:,}, got {self.hidden}")
        require(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        require(self.embedding_dim is None or 1 <= self.embedding_dim <= MAX_WIDTH, "embedding_dim",
                f"must be in [1, {MAX_WIDTH:,}], got {self.embedding_dim}")

    def identity(self) -> dict:
        """The keys that shape this model, what a checkpoint must match to resume: without the
        other models' keys, so an MLP's checkpoints from before ft_transformer still resume."""
        return identity(self)


@dataclass
class DistillConfig:
    """Knowledge distillation from the teacher's soft targets the dataset stores (its ``teacher``
    column, written by a shard job with ``teacher``). Loss per batch:
    alpha * T^2 * KL(teacher probabilities at T || student softmax(logits / T)) + (1 - alpha) * cross-entropy;
    regression: alpha * MSE(student, teacher's value) + (1 - alpha) * MSE(student, label)."""

    alpha: float = 0.5  # weight of the teacher term; 0 trains on the labels alone (the plain loss)
    # T; null: the temperature the dataset's soft targets were computed at (teacher.temperature in
    # its manifest). Another value is refused: the stored probabilities are at that temperature.
    temperature: float | None = None

    def __post_init__(self):
        require(0 <= self.alpha <= 1, "alpha", f"must be in [0, 1], got {self.alpha}")
        require(self.temperature is None or 0 < self.temperature < float("inf"), "temperature",
                f"must be > 0 (or null: the dataset's teacher temperature), got {self.temperature}")


@dataclass
class TrainLoopConfig:
    epochs: int = 5
    batch_size: int = 256  # per rank, per micro-batch
    lr: float = 1e-3
    lr_scale: Literal["linear", "none"] = "linear"  # linear: lr x data-parallel replicas (not x grad_accum)
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    optimizer: Literal["adamw", "sgd"] = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    grad_accum: int = 1
    clip_norm: float | None = None
    seed: int = 0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    log_every_steps: int = 50
    # ddp: every rank holds the whole model. fsdp (launch.backend=torch only): parameters,
    # gradients and optimizer state sharded across ranks (FSDP2), for models larger than one device.
    parallel: Literal[PARALLEL] = "ddp"
    # Layers in stages on consecutive ranks (launch.backend=torch); stages: 1 is off
    # (training.strategies.pipeline).
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    # fp16 only: consecutive non-finite losses tolerated (the scaler skips those steps) before
    # training stops, because the loss scale cannot recover from a diverged model.
    max_skipped_steps: int = 20
    # Learn from the dataset's teacher column too (see DistillConfig); null: the labels only.
    distill: DistillConfig | None = None
    # How often the replicas agree: every step (default), or in rounds (local SGD, DiLoCo):
    # training.strategies.periodic.
    sync: SyncConfig = field(default_factory=SyncConfig)

    def __post_init__(self):
        require(self.epochs >= 1, "epochs", f"must be >= 1, got {self.epochs}")
        require(1 <= self.batch_size <= MAX_BATCH_ROWS, "batch_size",
                f"must be in [1, {MAX_BATCH_ROWS:,}], got {self.batch_size}")
        require(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        require(self.grad_accum >= 1, "grad_accum", f"must be >= 1, got {self.grad_accum}")
        require(self.clip_norm is None or self.clip_norm > 0, "clip_norm", "must be > 0 (or null for no clipping)")
        require(self.log_every_steps >= 1, "log_every_steps", "must be >= 1")
        require(self.max_skipped_steps >= 1, "max_skipped_steps", "must be >= 1")


@dataclass
class LaunchConfig:
    num_proc: int = 2
    # GPUs each rank needs from Spark (spark.task.resource.gpu.amount); 0 = use what Spark assigns.
    gpus_per_proc: int = 0
    mode: Literal["spark", "in_process"] = "spark"
    # in_process only: auto = cuda:0 when CUDA is available. Spark ranks use the GPU Spark assigned.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    start_timeout: int = 120  # seconds for all ranks to get a Spark task slot and register
    verbose: int = 0  # horovod.spark.run verbosity (0-2)
    # Environment variables for every rank (e.g. OMP_NUM_THREADS).
    env: dict[str, str] = field(default_factory=dict)
    # A rank that makes no progress for this long (no step inside an epoch; no sign of life at all
    # during start-up and validation) stops the launch, naming it: a stopped rank never hangs the job.
    stall_timeout_s: int = 600
    # Relaunches after a rank's process died, stalled or lost its connection; the ranks resume from
    # the newest complete checkpoint (checkpoint.resume=auto). Config and data errors never retry.
    max_restarts: int = 2
    # horovod (horovod.spark.run) or torch (pyspark's TorchDistributor + torch.distributed), or
    # torch_tasks (torch.distributed ranks inside the barrier tasks' own Python workers: no torchrun,
    # torch stays imported for the session's next launch; training/launchers/torch_tasks.py), or
    # torchrun: no Spark, every rank a process torchrun (or Kubernetes, ...) started running
    # `shardtrain train` (training/launchers/torchrun.py; launch.device picks its GPU or the CPU).
    # The choices are training.launchers.LAUNCHERS' (launch.mode=in_process picks that one).
    # null: horovod where horovod.torch is installed, else torch (resolved here, on the driver).
    backend: Literal[BACKENDS] | None = None
    # Horovod elastic (horovod.spark.run_elastic): when a rank dies, the others go on without a
    # relaunch, at the smaller world size (at least min_num_proc; null: num_proc - 1), repeating
    # the interrupted epoch with its rows divided into equal steps for that size (training.elastic).
    elastic: bool = False
    min_num_proc: int | None = None

    def __post_init__(self):
        if self.backend is None:
            self.backend = "horovod" if installed("horovod.torch") else "torch"
            self.backend_auto = True  # not a field: training.launchers.backend_for may pick torch on Connect
        require(1 <= self.num_proc <= MAX_RANKS, "num_proc", f"must be in [1, {MAX_RANKS}], got {self.num_proc}")
        require(self.gpus_per_proc >= 0, "gpus_per_proc", "must be >= 0")
        require(self.start_timeout >= 1, "start_timeout", "must be >= 1")
        require(self.stall_timeout_s >= 5, "stall_timeout_s", f"must be >= 5 seconds, got {self.stall_timeout_s}")
        require(self.max_restarts >= 0, "max_restarts", f"must be >= 0, got {self.max_restarts}")
        launcher = launcher_for(self)
        launcher.check(self)
        if self.elastic:
            elastic = [name for name in BACKENDS if launcher_named(name).elastic]
            require(launcher.elastic, "elastic", f"needs launch.backend={' or '.join(elastic)} and launch.mode=spark")
            if self.min_num_proc is None:
                self.min_num_proc = max(1, self.num_proc - 1)
        require(self.min_num_proc is None or 1 <= self.min_num_proc <= self.num_proc, "min_num_proc",
                f"must be between 1 and launch.num_proc={self.num_proc}, got {self.min_num_proc}")


@dataclass
class CheckpointConfig:
    path: str | None = storage_path(default=None)  # null: <output.run_dir>/checkpoints
    every_steps: int | None = None
    every_epochs: int | None = 1
    keep: int = 2
    resume: Literal["auto", "never"] = "auto"

    def __post_init__(self):
        require(self.every_steps is None or self.every_steps >= 1, "every_steps", "must be >= 1 (or null)")
        require(self.every_epochs is None or self.every_epochs >= 1, "every_epochs", "must be >= 1 (or null)")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")


@dataclass
class TrainOutputConfig:
    model_path: str = storage_path(default="artifacts/model")
    mode: Literal["error", "overwrite"] = "error"
    # Metrics (metrics.jsonl), the resolved config and checkpoints; null: <model_path>.run
    run_dir: str | None = storage_path(default=None)

    def __post_init__(self):
        require(bool(self.model_path), "model_path", "must not be empty")

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or f"{self.model_path.rstrip('/')}.run"


@dataclass
class MlflowConfig:
    """Where rank 0 records the finished run (training.tracking); any failure there only warns."""

    # null: MLflow's own default (MLFLOW_TRACKING_URI; on Databricks, the workspace's server).
    tracking_uri: str | None = None
    experiment: str | None = None  # null: MLflow's default experiment (MLFLOW_EXPERIMENT_NAME/_ID, else Default)
    run_name: str | None = None  # null: MLflow makes one up
    # Seconds rank 0 waits for all of tracking (every MLflow call and upload) before it warns and
    # goes on: a server that accepts connections and never answers costs at most this.
    timeout_s: float = 60.0
    # A new version of this registered model gets the run's pyfunc model (training.mlflow_model):
    # a plain name (workspace registry) or catalog.schema.name (Unity Catalog); null: logged, not registered.
    registered_model: str | None = None
    registry_uri: str | None = None  # null: MLflow's default (MLFLOW_REGISTRY_URI, else the tracking URI)
    alias: str | None = None  # moved to the new version (models:/NAME@ALIAS); needs registered_model
    # Tags on the run, beside shardtrain's own (a sweep sets mlflow.parentRunId: its trials are child runs).
    tags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        for key in ("tracking_uri", "experiment", "run_name", "registered_model", "registry_uri", "alias"):
            value = getattr(self, key)
            require(value is None or bool(value.strip()), key, "must not be empty (null: MLflow's default)")
        require(self.timeout_s > 0, "timeout_s", f"must be > 0 seconds, got {self.timeout_s:g}")
        require(self.alias is None or self.registered_model is not None, "alias",
                "needs tracking.mlflow.registered_model: an alias names a version of a registered model")
        require(self.alias is None or not self.alias.strip().isdigit() and "@" not in self.alias
                and "/" not in self.alias, "alias", f"must be a name (not a number, no '@' or '/'), got {self.alias!r}")


@dataclass
class TrackingConfig:
    mlflow: MlflowConfig | None = None  # null: no tracking; {} tracks with MLflow's defaults


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: TrainOutputConfig = field(default_factory=TrainOutputConfig)
    spark: SparkConfig = field(default_factory=SparkConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def __post_init__(self):
        require(self.data.val_split != self.data.train_split, "data.val_split",
                "must differ from data.train_split")
        check_strategy(self, launcher_for(self.launch))

    @property
    def checkpoint_path(self) -> str:
        return self.checkpoint.path or posixpath.join(self.output.resolved_run_dir, "checkpoints")


def installed(module: str) -> bool:
    """Whether ``module`` can be found, without importing it (``horovod.torch`` imports only the
    small ``horovod`` package to look; ``shardtrain doctor`` does the full import)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def load_train_config(path=None, overrides=None, defaults: dict | None = None) -> TrainConfig:
    cfg = load_config(TrainConfig, path, overrides, defaults)
    require(cfg.data.path is not None, "data.path", "is required: the URI of a dataset published by `shardtrain shard`")
    return cfg


__all__ = [
    "CheckpointConfig", "DataConfig", "DistillConfig", "LaunchConfig", "MlflowConfig", "ModelConfig", "TrackingConfig",
    "TrainConfig", "TrainLoopConfig", "TrainOutputConfig", "installed", "load_train_config",
]
