"""The training job's config tree.

One dataclass per section, each validating itself in ``__post_init__`` with a message that names
the key to change. Section and key names are a public contract (scheduled jobs and notebooks use
them): add keys, never rename them. Load with ``load_train_config``.

This module must stay free of torch and horovod: the driver imports it before anything launches.
"""

from __future__ import annotations

import importlib.util
import posixpath
from dataclasses import dataclass
from typing import Any, Literal

from common.config import load_config, require, setting, storage_path
from common.config import SparkConfig
from common.tasks import TASK_NAMES
from training.image_loading import AugmentConfig
from training.launchers import BACKENDS, launcher_for, launcher_named
from training.limits import MAX_BATCH_ROWS, MAX_PREFETCH, MAX_RANKS, MAX_READER_THREADS, MAX_WIDTH
from training.model_specs import MODELS, identity
from training.strategies import check_strategy, picked_by
from training.strategies.periodic import SyncConfig
from training.strategies.pipeline import PipelineConfig

PARALLEL = picked_by("train.parallel")  # train.parallel's choices: the strategies it names


@dataclass
class BatchingConfig:
    """How a batch's variable-length entries (a text feature's token ids) are shaped."""

    pad_multiple: int = setting(
        "a batch's token ids are padded to its longest row, rounded up to a multiple of this (8 suits tensor "
        "cores on a GPU); the mask marks the padding", default=1)

    def __post_init__(self):
        require(1 <= self.pad_multiple <= 1024, "pad_multiple", f"must be in [1, 1024], got {self.pad_multiple}")


@dataclass
class DataConfig:
    path: str | None = storage_path(
        "URI of a dataset published by `shardtrain shard`; required (in `run`, `sweep` and `distill` it defaults "
        "to the dataset the command shards)", default=None)
    train_split: str = setting("the split trained on", default="train")
    val_split: str | None = setting("the split validated on at every epoch end; null: no validation", default="val")
    shuffle_buffer_rows: int = setting(
        "rows shuffled together in memory per rank, on top of a per-epoch row-group order; a rank holds about "
        "three buffers (one being built, one ready, one trained on), reused from epoch to epoch and between "
        "training and validation, so this bounds loader memory with `prefetch_row_groups`", default=65_536)
    # 1 keeps the row order a pure function of the seed, which exact resume needs; more threads
    # decode row groups in parallel but in arrival order.
    shuffle_buffer_bytes: int = setting(
        "bytes of stored rows (as read, before decoding: an image feature's encoded bytes) a shuffle buffer holds "
        "at most, measured on each row group's mean row: a buffer ends at `shuffle_buffer_rows` or here, whichever "
        "comes first (but holds at least one batch); the arrow reader's row groups read ahead are capped by it too",
        default=256 << 20)
    reader_workers: int = setting(
        "petastorm reader threads; 1 keeps the data order a pure function of the seed (exact resume)", default=1)
    decode_workers: int = setting(
        "threads decoding (and augmenting) encoded features, image columns, per rank, between the shuffle buffer "
        "and the batch (training/image_loading.py); the order and the augmentation do not depend on it",
        default=2)
    augment: dict[str, AugmentConfig | None] = setting(
        "per image column, its augmentation on the train split (`{random_resized_crop: {scale: [0.5, 1.0]}, flip: "
        "true, color_jitter: 0.2}`) or null; validation, scoring and predict never augment", default_factory=dict)
    prefetch_row_groups: int = setting("row groups decoded ahead of the training step (bounds loader memory)",
                                       default=4)
    verify: Literal["first_read", "never"] = setting(
        "`first_read`: each rank checks every shard file it reads against the manifest's sha256 the first time "
        "it opens it in a run (a damaged file is exit 2, naming it); `never`: no check", default="first_read")
    reader: Literal["petastorm", "arrow"] | None = setting(
        "`petastorm` (needs pyarrow 14) or `arrow` (plain pyarrow, any version): the same batches for the same "
        "seed, epoch and rank; null: petastorm where it is installed, else arrow", default=None)
    batching: BatchingConfig = setting("how batches of text features are padded", default_factory=BatchingConfig)

    def __post_init__(self):
        if self.reader is None:
            self.reader = "petastorm" if installed("petastorm") else "arrow"
        require(self.path is None or bool(self.path), "path", "must not be empty")
        require(bool(self.train_split), "train_split", "must name a split")
        require(1 <= self.shuffle_buffer_rows <= MAX_BATCH_ROWS, "shuffle_buffer_rows",
                f"must be in [1, {MAX_BATCH_ROWS:,}], got {self.shuffle_buffer_rows}")
        require(1 <= self.reader_workers <= MAX_READER_THREADS, "reader_workers",
                f"must be in [1, {MAX_READER_THREADS}], got {self.reader_workers}")
        require(1 <= self.shuffle_buffer_bytes, "shuffle_buffer_bytes",
                f"must be a positive number of bytes, got {self.shuffle_buffer_bytes}")
        require(1 <= self.decode_workers <= MAX_READER_THREADS, "decode_workers",
                f"must be in [1, {MAX_READER_THREADS}], got {self.decode_workers}")
        require(1 <= self.prefetch_row_groups <= MAX_PREFETCH, "prefetch_row_groups",
                f"must be in [1, {MAX_PREFETCH}], got {self.prefetch_row_groups}")


@dataclass
class ModelConfig:
    """Every built-in model's keys (training.model_specs: each spec says which are its own) and
    what the model expects of the dataset."""

    name: str = setting(
        "`mlp`, `ft_transformer` (FT-Transformer: one token per numeric, categorical, array and image feature "
        "plus a CLS token, `model.layers` transformer blocks, a head on the CLS token), `resnet` (ResNet-18/34 "
        "over the dataset's one image column: `model.depth`, `model.width`), or `package.module:factory`, "
        "called with `(feature_spec, label_spec, **model.kwargs)`, plain dicts: the features by kind "
        "(`{\"numeric\": [records], \"categorical\": [...], \"arrays\": [...], \"images\": [...]}`, each record "
        "as the manifest holds it) and the manifest's `label` record. `mlp` and `ft_transformer` read each image "
        "column through a small convolutional stem (`model.kwargs.image_width`: the MLP's features per image, "
        "default 16)", default="mlp")
    hidden: list[int] = setting("`mlp`: the hidden layers' widths", default_factory=lambda: [128, 64])
    layers: int = setting("`ft_transformer`: transformer blocks", default=4)
    d_model: int = setting("`ft_transformer`: token width, a multiple of `model.heads`; its feed-forward is "
                           "2 x `d_model` (`model.kwargs.ffn_width`)", default=32)
    heads: int = setting("`ft_transformer`: attention heads", default=4)
    depth: int = setting("`resnet`: 18 or 34 (ResNet-18: 2, 2, 2, 2 basic blocks a stage; ResNet-34: 3, 4, 6, 3)",
                         default=18)
    width: int = setting("`resnet`: the first residual stage's channels (64 in the paper); the four stages have "
                         "1, 2, 4 and 8 x `model.width`", default=64)
    dropout: float = setting("dropout rate (`mlp` and `ft_transformer`)", default=0.0)
    embedding_dim: int | None = setting(
        "`mlp`: width of each categorical feature's embedding; null: min(16, (vocabulary size + 1) // 2)",
        default=None)
    kwargs: dict[str, Any] = setting("extra keyword arguments for a plug-in factory (or overrides for the MLP)",
                                     default_factory=dict)
    task: Literal[TASK_NAMES] | None = setting(
        "the label's task the model expects; checked against the manifest before launch (null: any)", default=None)
    num_classes: int | None = setting(
        "the classes the model expects; checked against the manifest before launch (null: any)", default=None)
    features: list[str] | None = setting(
        "the feature columns the model expects; checked against the manifest before launch (null: any)",
        default=None)

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
        require(self.depth in (18, 34), "depth", f"must be 18 or 34, got {self.depth}")
        require(1 <= self.width <= MAX_WIDTH // 8, "width", f"must be in [1, {MAX_WIDTH // 8:,}], got {self.width}")
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

    alpha: float = setting(
        "weight of the teacher term, in [0, 1]; 0 trains on the labels alone, bit for bit the plain loss",
        default=0.5)
    # Another value is refused: the stored probabilities are at that temperature.
    temperature: float | None = setting(
        "T of the loss; null: the temperature the dataset's soft targets were computed at (its "
        "`teacher.temperature`); another value is exit 2", default=None)

    def __post_init__(self):
        require(0 <= self.alpha <= 1, "alpha", f"must be in [0, 1], got {self.alpha}")
        require(self.temperature is None or 0 < self.temperature < float("inf"), "temperature",
                f"must be > 0 (or null: the dataset's teacher temperature), got {self.temperature}")


@dataclass
class TrainLoopConfig:
    epochs: int = setting("passes over the train split", default=5)
    batch_size: int = setting(
        "rows per rank per micro-batch; the global batch is batch_size x num_proc x grad_accum (with pipeline "
        "stages: x num_proc / stages)", default=256)
    lr: float = setting("learning rate (before `lr_scale`)", default=1e-3)
    lr_scale: Literal["linear", "none"] = setting(
        "`linear`: lr x data-parallel replicas (num_proc, or num_proc / `train.pipeline.stages`; not x "
        "grad_accum)", default="linear")
    schedule: Literal["constant", "cosine"] = setting("the learning-rate schedule after warm-up", default="constant")
    warmup_steps: int = setting("linear learning-rate warm-up steps", default=0)
    optimizer: Literal["adamw", "sgd"] = setting("the optimizer", default="adamw")
    weight_decay: float = setting("weight decay", default=0.0)
    momentum: float = setting("`sgd` only: momentum", default=0.9)
    grad_accum: int = setting("micro-batches per optimizer step (Horovod's `backward_passes_per_step`)", default=1)
    clip_norm: float | None = setting("gradient clipping norm (after unscaling, in fp16); null: none", default=None)
    seed: int = setting("model initialization and data order", default=0)
    precision: Literal["fp32", "bf16", "fp16"] = setting(
        "`bf16` (autocast) or `fp16` (autocast and a GradScaler, whose state is checkpointed)", default="fp32")
    log_every_steps: int = setting("rank 0 logs steps/s, samples/s, loss and ETA every this many steps", default=50)
    parallel: Literal[PARALLEL] = setting(
        "`ddp`: every rank holds the whole model; `fsdp` (`launch.backend=torch` only): FSDP2 shards "
        "parameters, gradients and optimizer state across ranks, for models larger than one device",
        default="ddp")
    pipeline: PipelineConfig = setting("layers in stages on consecutive ranks", default_factory=PipelineConfig)
    # The loss scale cannot recover from a diverged model.
    max_skipped_steps: int = setting(
        "fp16: consecutive overflow-skipped steps tolerated before training stops; skipped steps' losses are "
        "counted per epoch as `non_finite_losses` and left out of `train_loss`", default=20)
    distill: DistillConfig | None = setting(
        "learn from the dataset's teacher column too (a dataset sharded with a `teacher`); null: the labels only",
        default=None)
    sync: SyncConfig = setting(
        "how often the data-parallel replicas agree: every step, or in rounds (local SGD, DiLoCo)",
        default_factory=SyncConfig)

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
    num_proc: int = setting(
        "ranks (concurrent Spark tasks, or torchrun processes); at most the dataset's `output.num_shards`",
        default=2)
    gpus_per_proc: int = setting(
        "GPUs each rank needs from Spark (`spark.task.resource.gpu.amount`); each rank uses the address Spark "
        "assigned to its task; 0: what Spark assigns", default=0)
    mode: Literal["spark", "in_process"] = setting(
        "`in_process`: one rank in this process, no Spark or Horovod (debugging, notebooks, GPU benchmarks)",
        default="spark")
    device: Literal["auto", "cpu", "cuda"] = setting(
        "`in_process` and `torchrun`: `auto` takes CUDA where available (torchrun: GPU `LOCAL_RANK`); Spark "
        "ranks use the GPU Spark assigned", default="auto")
    start_timeout: int = setting(
        "seconds for all ranks to get a task slot and register; torchrun: for all ranks to meet at "
        "`MASTER_ADDR:MASTER_PORT`", default=120)
    verbose: int = setting("Horovod's `horovod.spark.run` verbosity, 0-2", default=0)
    env: dict[str, str] = setting(
        "environment variables for every rank (e.g. `OMP_NUM_THREADS`); part of the resolved config, so keep "
        "secrets out", default_factory=dict)
    # A stopped rank never hangs the job.
    stall_timeout_s: int = setting(
        "a rank with no progress for this long (no step inside an epoch, no batch inside a validation pass; no "
        "sign of life during start-up, checkpoint writes or publishing; still busy this long after publishing) "
        "stops the launch, naming it", default=600)
    max_restarts: int = setting(
        "relaunches after a rank's process died, stalled or lost its connection; ranks resume from the newest "
        "complete checkpoint (needs `checkpoint.resume=auto`). Config and data errors are never retried",
        default=2)
    # Resolved here, on the driver (training.launchers: one module per backend).
    backend: Literal[BACKENDS] | None = setting(
        "`horovod` (Horovod-on-Spark); `torch`: pyspark's TorchDistributor, one rank per barrier task, DDP on "
        "Gloo (CPU) or NCCL (GPU); `torch_tasks`: the same ranks inside the barrier tasks' own Python workers, "
        "no torchrun (a warm 2-rank launch in 1.8 s instead of 13.6 s); `torchrun`: no Spark, every rank a "
        "process torchrun (or Kubernetes, Databricks serverless GPU) started running `shardtrain train`. "
        "null: horovod where it is installed, else torch (torch on Spark Connect)", default=None)
    elastic: bool = setting(
        "Horovod only: when a rank dies the others go on at the smaller world size without a relaunch "
        "(`horovod.spark.run_elastic`), repeating the interrupted epoch with its rows divided into equal steps "
        "for the new size", default=False)
    min_num_proc: int | None = setting(
        "with `launch.elastic`: the fewest ranks training goes on with; null: num_proc - 1", default=None)

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
    path: str | None = storage_path("where checkpoints go; null: `<output.run_dir>/checkpoints`", default=None)
    every_steps: int | None = setting("rank 0 writes a checkpoint every this many steps; null: not by steps",
                                      default=None)
    every_epochs: int | None = setting(
        "rank 0 writes a checkpoint every this many epochs (and always at the end); null: not by epochs", default=1)
    keep: int = setting("complete checkpoints kept", default=2)
    resume: Literal["auto", "never"] = setting(
        "`auto`: continue from the newest complete checkpoint of this run; `never`: start over", default="auto")

    def __post_init__(self):
        require(self.every_steps is None or self.every_steps >= 1, "every_steps", "must be >= 1 (or null)")
        require(self.every_epochs is None or self.every_epochs >= 1, "every_epochs", "must be >= 1 (or null)")
        require(self.keep >= 1, "keep", f"must be >= 1, got {self.keep}")


@dataclass
class TrainOutputConfig:
    model_path: str = storage_path("the model's URI (published atomically)", default="artifacts/model")
    mode: Literal["error", "overwrite"] = setting(
        "`error` refuses an existing model at `model_path`; `overwrite` replaces it", default="error")
    run_dir: str | None = storage_path(
        "the run directory: `config.yaml`, `run.json`, `metrics.jsonl` (per epoch), `steps.jsonl` (per logged "
        "step), `restarts.jsonl`, `summary.json`, `report.html`, checkpoints; null: `<model_path>.run`",
        default=None)
    torchscript: Literal["auto", "always", "never"] = setting(
        "whether the published model also holds a TorchScript program (`model.torchscript.pt`; `load_model(uri, "
        "program=True)`, `score`'s `program: true`): `auto` where `torch.jit.script` takes the network, saying so "
        "where it does not; `always` refuses, before any step, a network it cannot script (exit 2); `never` writes "
        "none. `load_model`, `score` and MLflow rebuild the network from its weights either way (a plug-in from its "
        "importable factory)", default="auto")

    def __post_init__(self):
        require(bool(self.model_path), "model_path", "must not be empty")

    @property
    def resolved_run_dir(self) -> str:
        return self.run_dir or f"{self.model_path.rstrip('/')}.run"


@dataclass
class MlflowConfig:
    """Where rank 0 records the finished run (training.tracking); any failure there only warns."""

    tracking_uri: str | None = setting(
        "`http(s)://server`, `sqlite:///path.db`, `databricks`, ...; null: MLflow's default "
        "(`MLFLOW_TRACKING_URI`; on Databricks, the workspace's tracking server); a local store inside "
        "`output.model_path` is exit 2, as a publish replaces that directory whole", default=None)
    experiment: str | None = setting(
        "experiment name, created if missing (on Databricks a workspace path, `/Users/me/shardtrain`); null: "
        "MLflow's default experiment", default=None)
    run_name: str | None = setting("the MLflow run's name; null: MLflow names the run", default=None)
    # A server that accepts connections and never answers costs at most this.
    timeout_s: float = setting(
        "total seconds rank 0 waits for all MLflow calls and uploads; past it, one warning and training ends as "
        "it would have", default=60.0)
    registered_model: str | None = setting(
        "registers the run's pyfunc model as a new version of this model: a plain name (workspace registry) or "
        "`catalog.schema.name` (Unity Catalog, with `registry_uri: databricks-uc`); null: logged with the run, "
        "not registered", default=None)
    registry_uri: str | None = setting(
        "the model registry; null: MLflow's default (`MLFLOW_REGISTRY_URI`, else the tracking URI)", default=None)
    alias: str | None = setting(
        "moved to the new version, so `models:/NAME@ALIAS` names it; needs `registered_model`; a name, not a "
        "number", default=None)
    # A sweep sets mlflow.parentRunId: its trials are child runs.
    tags: dict[str, str] = setting("tags on the run, beside shardtrain's own", default_factory=dict)

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
    mlflow: MlflowConfig | None = setting(
        "rank 0 records the finished run in MLflow (needs `shardtrain[mlflow]`; a failure only warns); `{}` "
        "tracks with MLflow's defaults; null: no tracking", default=None)


@dataclass
class TrainConfig:
    data: DataConfig = setting("the published dataset trained on, and how ranks read it", default_factory=DataConfig)
    model: ModelConfig = setting("the network", default_factory=ModelConfig)
    train: TrainLoopConfig = setting("the optimization", default_factory=TrainLoopConfig)
    launch: LaunchConfig = setting("where and how the ranks run", default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = setting("when checkpoints are written and whether a run resumes from them",
                                           default_factory=CheckpointConfig)
    output: TrainOutputConfig = setting("the published model and the run directory",
                                        default_factory=TrainOutputConfig)
    spark: SparkConfig = setting("the session the ranks run on, when the job creates one", default_factory=SparkConfig)
    tracking: TrackingConfig = setting("experiment tracking", default_factory=TrackingConfig)

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
