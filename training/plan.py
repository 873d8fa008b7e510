"""Driver side: check that a dataset suits this training job, and resolve the job into plain values.

Nothing launches until ``build_plan`` has accepted the dataset. The manifest itself (commit
marker, format version, schema, splits) is validated by ``common.dataset.read_manifest``; this
module checks what the job asks of it: a label or features the model config does not match, too
few shards or rows for the ranks, ``train.distill`` without soft targets or with a teacher whose
features or classes differ from the dataset's -> DatasetError naming the manifest field (exit status 2).

The ``RankPlan`` it returns pins the dataset (the manifest's fingerprint and each shard file's
version, compared on every open, at each epoch start and before publishing:
``training.split_layout``), and it is all a rank gets: the typed ``TrainConfig``, strings, numbers,
lists and small frozen dataclasses, so it pickles to executors without dragging a SparkSession, a
file handle or torch along.

Driver-only; imports neither torch nor horovod.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import copy
import dataclasses
import logging
import uuid
from dataclasses import dataclass, field

from common.config import to_dict
from common.errors import ConfigError, DatasetError
from common.dataset import MANIFEST_NAME, TEACHER_COLUMN, LabelSpec, Manifest, read_manifest, teacher_differences
from training.columns import Columns, columns_for
from training.config import TrainConfig
from training.epoch_steps import skipped_rows_per_epoch, steps_per_epoch
from training.image_loading import check_augment
from training.model_specs import model_spec
from training.split_layout import SplitLayout
from training.strategies import ranks_per_replica

log = logging.getLogger("shardtrain.train")



if TYPE_CHECKING:
    from training.user_code import UserCode

@dataclass(frozen=True)
class RankPlan:
    config: TrainConfig  # resolved and validated (a copy); ranks read it typed: plan.config.train.seed
    dataset_uri: str
    fingerprint: str
    feature_spec: dict  # the features by kind (FeatureSpec.by_kind): what the built-in models and a plug-in factory read
    label_spec: LabelSpec
    columns: Columns
    train: SplitLayout
    val: SplitLayout | None
    world_size: int  # ranks
    steps_per_epoch: int  # computed from the data-parallel size, not the world size
    skipped_rows_per_epoch: int
    reference_rows: int = 32  # val rows rank 0 predicts at the end (load_model round trip)
    # The shard job's features.max_category_bytes (FeatureSpec's): model.json records it, so
    # serving refuses a longer category as the shard job did (common.rows, too_long).
    max_category_bytes: int | None = None
    # One per train() call, kept across relaunches (a launcher outside Spark gives its own: one per
    # launch); recorded with the published model (``provenance``).
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # The model path's writer lock as the driver took it (``common.writer_lock.output_lock``'s record):
    # rank 0 publishes under it (``writing_under``), from whichever process it runs in.
    writer_lock: dict | None = None
    # The model, loss and metrics given to train() in code (training.user_code), pickled on the driver.
    user_code: "UserCode | None" = None

    @property
    def task(self) -> str:
        return self.label_spec.task

    # What the config says, read from it (one copy of each value; the plan adds only what it resolved).

    @property
    def pipeline_stages(self) -> int:
        """Ranks that hold one replica together: rank r is stage r % pipeline_stages (1: no pipeline)."""
        return ranks_per_replica(self.config.train)

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the model that read different rows: the world size, divided by the ranks
        that hold one replica together (pipeline stages)."""
        return self.world_size // ranks_per_replica(self.config.train)

    @property
    def lr(self) -> float:
        """The learning rate the optimizer starts from: ``train.lr``, times the data-parallel size
        with ``train.lr_scale=linear`` (the rows one step trains on grow with the replicas only)."""
        t = self.config.train
        return t.lr * (self.data_parallel_size if t.lr_scale == "linear" else 1)

    @property
    def checkpoint_uri(self) -> str:
        return self.config.checkpoint_path

    @property
    def run_dir(self) -> str:
        return self.config.output.resolved_run_dir

    @property
    def model_path(self) -> str:
        return self.config.output.model_path

    @property
    def output_mode(self) -> str:
        return self.config.output.mode

    def provenance(self) -> dict:
        """What the published model records of the run that made it (model.json's ``run_id``,
        ``config`` and ``dataset``), and what proves that a model there is this very run's own
        (``training.export.published_by``): the run id alone does not, as a new launch may reuse it."""
        return {"run_id": self.run_id, "config": to_dict(self.config),
                "dataset": {"uri": self.dataset_uri, "fingerprint": self.fingerprint}}

    def for_world(self, world: int) -> "RankPlan":
        """This plan for ``world`` ranks: the split's rows divided into equal steps again (and the
        learning rate scaled again), as Horovod elastic needs after a rank left. Same run id."""
        t = self.config.train
        replicas = world // ranks_per_replica(t)
        return dataclasses.replace(
            self, world_size=world,
            steps_per_epoch=steps_per_epoch(self.train.rows, replicas, t.batch_size, t.grad_accum),
            skipped_rows_per_epoch=skipped_rows_per_epoch(self.train.rows, replicas, t.batch_size, t.grad_accum))


def build_plan(cfg: TrainConfig, manifest: Manifest | None = None) -> RankPlan:
    manifest = manifest or read_manifest(cfg.data.path)
    world = cfg.launch.num_proc
    replicas = world // ranks_per_replica(cfg.train)  # what rows are sharded by (pipeline stages share theirs)
    where = f"{manifest.root.uri}/{MANIFEST_NAME}"
    _check_spec(manifest, cfg, where)
    cfg = _resolve_distill(manifest, cfg, where)

    verify = cfg.data.verify == "first_read"
    train = SplitLayout.from_manifest(manifest, cfg.data.train_split, verify)
    shards = manifest.num_shards(cfg.data.train_split)
    if shards < replicas:
        raise DatasetError(f"{where}: field 'splits.{train.name}.files' lists {shards} shard(s), fewer than "
                           f"{_readers(cfg)}; re-shard with output.num_shards >= {replicas} or use fewer ranks")
    batch, accum = cfg.train.batch_size, cfg.train.grad_accum
    steps = steps_per_epoch(train.rows, replicas, batch, accum)
    if steps < 1:
        raise DatasetError(f"{where}: field 'splits.{train.name}.rows' is {train.rows}: too few for {replicas} "
                           f"data-parallel rank(s) x "
                           f"train.batch_size={batch} x train.grad_accum={accum}; lower the batch size or add data")

    val = None
    if cfg.data.val_split:
        val = SplitLayout.from_manifest(manifest, cfg.data.val_split, verify)
        if val.rows < replicas:
            raise DatasetError(f"{where}: field 'splits.{val.name}.rows' is {val.rows}: fewer than one row per "
                               f"data-parallel rank ({replicas}); set data.val_split=null to train without validation")

    return RankPlan(
        config=copy.deepcopy(cfg), dataset_uri=manifest.root.uri, fingerprint=manifest.fingerprint,
        feature_spec=manifest.features.by_kind(), label_spec=manifest.label,
        max_category_bytes=manifest.features.max_category_bytes,
        columns=columns_for(manifest, teacher=cfg.train.distill is not None,
                            pad_multiple=cfg.data.batching.pad_multiple),
        train=train, val=val, world_size=world, steps_per_epoch=steps,
        skipped_rows_per_epoch=skipped_rows_per_epoch(train.rows, replicas, batch, accum))


def _readers(cfg: TrainConfig) -> str:
    world, stages = cfg.launch.num_proc, ranks_per_replica(cfg.train)
    if stages == 1:
        return f"launch.num_proc={world} ranks"
    return f"the {world // stages} data-parallel replica(s) of launch.num_proc={world} / train.pipeline.stages={stages}"


def _check_spec(manifest: Manifest, cfg: TrainConfig, where: str) -> None:
    """What this training config asks of the dataset (the manifest itself was validated on read)."""
    label = manifest.label
    model = cfg.model
    if model.task is not None and model.task != label.task:
        raise DatasetError(f"{where}: field 'label.task' is {label.task!r} but model.task is {model.task!r}")
    if model.num_classes is not None and model.num_classes != label.num_classes:
        raise DatasetError(f"{where}: field 'label.num_classes' is {label.num_classes!r} but "
                           f"model.num_classes is {model.num_classes}")
    _check_feature_kinds(manifest, model, where)
    check_augment(cfg.data.augment, manifest.features.batch_layout())
    ragged = [entry.key for entry in manifest.features.batch_layout() if entry.ragged]
    if ragged and cfg.train.pipeline.stages > 1:
        # A stage's inputs have fixed shapes, and every micro-batch the same; token batches do not.
        raise ConfigError(f"train.pipeline.stages={cfg.train.pipeline.stages} cannot take the variable-length "
                          f"features {ragged}; set train.pipeline.stages=1 (DDP or FSDP train them)")
    if model.features is not None:
        absent = [name for name in model.features if name not in manifest.features.columns]
        if absent:
            raise DatasetError(f"{where}: field 'features' lacks {absent}, which model.features requires "
                               f"(the dataset has {manifest.features.columns})")


def _check_feature_kinds(manifest: Manifest, model, where: str) -> None:
    """The model takes every kind of feature the dataset holds (its spec's ``feature_kinds``; a
    plug-in's are its own business), else exit 2 naming model.name and the features it cannot take."""
    spec = model_spec(model.name)
    accepted = spec.feature_kinds
    if accepted is None:
        return
    refused = {kind.name: kind.names for kind in manifest.features.kinds if kind.names and kind.name not in accepted}
    if refused:
        raise DatasetError(f"{where}: field 'features' holds {refused}, which model.name={model.name!r} cannot take "
                           f"(it takes {', '.join(accepted)} features); choose a model that takes them, or leave "
                           "those columns out of the shard job's features")
    spec.check_features(model, manifest.features.by_kind(), where)


def _resolve_distill(manifest: Manifest, cfg: TrainConfig, where: str) -> TrainConfig:
    """With ``train.distill``: the dataset must store soft targets from a teacher that reads the
    same features and predicts the same classes as the student will; returns the config with the
    distillation temperature resolved from the manifest (a copy; ``cfg`` is left as it was)."""
    distill = cfg.train.distill
    transfer = manifest.label.transfer_rows
    if transfer and (distill is None or distill.alpha == 0):
        # They would train as rows whose loss is exactly zero: batches diluted, nothing learnt from them.
        raise DatasetError(f"{where}: field 'label.train_transfer_rows' is {transfer}: train rows without a label "
                           f"(a transfer set), which learn only from the teacher's soft targets, but "
                           f"{'train.distill is unset' if distill is None else 'train.distill.alpha is 0'}; set "
                           "train.distill.alpha (e.g. 0.5), or train on a dataset sharded with "
                           "label.unlabeled=quarantine")
    if distill is None:
        return cfg
    teacher = manifest.teacher
    if teacher is None:
        raise DatasetError(f"{where}: the dataset has no teacher soft targets (no field 'teacher', no "
                           f"{TEACHER_COLUMN!r} column), which train.distill needs; shard it with a teacher "
                           "(shard config `teacher: {model: URI, temperature: T}`, or `shardtrain distill`), or "
                           "remove train.distill")
    differences = teacher_differences(teacher, manifest.features.spec, manifest.label)
    if differences:
        raise DatasetError(f"{where}: the soft targets come from teacher {teacher.uri} whose "
                           f"{'; '.join(differences)}; distilling it into this dataset's model would teach the wrong "
                           "thing: shard again with a teacher trained on these features and classes")
    if distill.temperature is not None and distill.temperature != teacher.temperature:
        raise DatasetError(f"{where}: field 'teacher.temperature' is {teacher.temperature:g} (the soft targets are "
                           f"probabilities at that temperature) but train.distill.temperature is "
                           f"{distill.temperature:g}; set it to {teacher.temperature:g} or null, or shard again "
                           "at the temperature you want")
    cfg = copy.deepcopy(cfg)
    cfg.train.distill.temperature = teacher.temperature
    return cfg


__all__ = ["RankPlan", "build_plan"]
