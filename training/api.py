"""The public training API: ``train``, ``load_model``, and the ``shardtrain train`` command handler.

    from training import train, load_train_config
    result = train(load_train_config("conf/train.yaml", ["launch.num_proc=2"]), spark=spark)
    print(result.summary())

Driver-only orchestration: read and check the manifest (``plan.build_plan``), hold the model
path's writer lock and a reader lease on the dataset for the whole run, refuse an existing
output, launch the ranks, turn their results into a ``TrainResult`` or one typed error.

The writer lock (``common.writer_lock.output_lock``) is the driver's, from before the run directory
or any checkpoint is touched until the ranks have returned. The publish itself happens on rank 0,
which on Horovod and TorchDistributor is another process (a Spark task's, maybe on another
host): a lock cannot move between processes (locally it is an ``flock`` of the driver's), so the
driver passes its record in the plan (``RankPlan.writer_lock``) and rank 0 publishes under it
(``common.writer_lock.writing_under``: the lock must still hold that token; the holder releases it).
In-process, the driver is rank 0 and its ``output_lock`` is simply re-entrant. If the driver dies
its lock goes with it (flock) while orphaned ranks may still run: their publish then finds the
token gone and refuses, so a model is only published while its run's driver holds the lock.

The reader lease (``common.leases``): a shard job will not overwrite the dataset meanwhile.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field

from common.commit_marker import KIND_MODEL
from common.config import with_absolute_paths
from common.errors import ConfigError, OutputExistsError
from common.leases import reader_lease
from common.output_guard import check_disjoint, check_replaceable
from common.publish import replaced_copy
from common.storage import resolve
from common.writer_lock import output_lock
from training.checkpoint import check_checkpoint_root
from training.config import TrainConfig, load_train_config
from training.launchers import backend_for, coordinates_run, launch, launch_run_id, launcher_for, needs_spark
from training.plan import RankPlan, build_plan
from training.run_record import SUMMARY, record_restart
from training.split_layout import check_manifest_unchanged
from training.tasks import all_metrics
from training.user_code import UserCode

log = logging.getLogger("shardtrain.train")


@dataclass
class TrainResult:
    model_uri: str
    run_dir: str
    metrics: list[dict]  # per epoch: train_loss, val_loss, the task's val_* and baseline_* (training.tasks), ...
    steps_per_rank: list[int]
    steps_per_epoch: int
    skipped_rows_per_epoch: int
    world_size: int
    seconds: float
    ranks: list[dict] = field(repr=False, default_factory=list)  # each rank's own report
    reference: dict | None = field(repr=False, default=None)  # rank 0's final predictions on val rows
    resumed_from: str | None = None
    checkpoint_problems: list[str] = field(default_factory=list)
    stopped_early: bool = False  # on_epoch ended the run before train.epochs (a sweep's pruner)

    @property
    def final(self) -> dict:
        return self.metrics[-1] if self.metrics else {}

    @property
    def baseline(self) -> dict:
        return {k: v for k, v in self.final.items() if k.startswith("baseline_")}

    def summary(self) -> str:
        if self.ranks and self.ranks[0].get("rank", 0) != 0:  # a torchrun rank other than 0
            return (f"rank {self.ranks[0]['rank']} of {self.world_size}: {self.steps_per_rank[0]} steps "
                    f"({self.steps_per_epoch}/epoch) in {self.seconds:.1f}s; rank 0 publishes {self.model_uri}")
        final = self.final
        lines = [f"trained {len(self.metrics)} epoch(s) on {self.world_size} rank(s), "
                 f"{self.steps_per_epoch} steps/epoch on every rank, in {self.seconds:.1f}s"]
        for metric in all_metrics():
            if metric.key in final:
                lines.append(f"validation {metric.name}: {final[metric.key]:.4f} (trivial baseline "
                             f"{final[metric.baseline_key]:.4f}; {metric.better} is better)")
        if "train_loss" in final:
            lines.append(f"train loss: {self.metrics[0]['train_loss']:.4f} (epoch 1) -> {final['train_loss']:.4f}")
        if self.resumed_from:
            lines.append(f"resumed from {self.resumed_from}")
        if self.stopped_early:
            lines.append(f"stopped early, after epoch {len(self.metrics)}, as the driver asked")
        lines += [f"model:   {self.model_uri}", f"metrics: {self.run_dir}/metrics.jsonl (summary: {self.run_dir}/summary.json)"]
        return "\n".join(lines)


def train(cfg: TrainConfig, spark=None, *, model=None, loss=None, metrics=None, finalize=None, on_step=None,
          on_epoch=None) -> TrainResult:
    """Train ``cfg`` from its published dataset. ``spark``: the session whose executors run the
    ranks (default: the active one, or one built from ``cfg.spark``). ``model``, ``loss``,
    ``metrics``, ``finalize``: your own code in the managed loop, defined anywhere (a notebook cell
    too), shipped to the ranks by value (the contract: ``training.user_code``); ``model`` replaces
    ``model.name`` and is called with ``model.kwargs``. ``on_step(step)`` is called
    after every optimizer step in in-process mode (tests use it to simulate a crash).
    ``on_epoch(record) -> bool`` is called here, on the driver, with each epoch's record (its
    validation metrics included) as rank 0 ends the epoch, on every launcher; True ends the run at
    that epoch boundary: its checkpoint is written, the model published (a sweep's pruner)."""
    started = time.perf_counter()
    cfg = with_absolute_paths(cfg)  # a config built in code, too, names the same places on every rank
    code = UserCode.of(model=model, loss=loss, metrics=metrics, finalize=finalize)
    cfg = _with_user_code(cfg, code)
    plan = build_plan(cfg)  # reads and checks the manifest: nothing launched yet, nothing written
    plan = dataclasses.replace(plan, user_code=code)
    if not needs_spark(cfg.launch):  # Spark ranks: checked once the session says what a task gets
        _check_model_fits(plan, None)
    shared_id = launch_run_id(cfg.launch)  # a launcher outside Spark: one id for all its processes
    if shared_id is not None:
        plan = dataclasses.replace(plan, run_id=shared_id)
        finished = _published_by_this_run(plan, started)
        if finished is not None:
            return finished
    if not coordinates_run(cfg.launch):  # a rank other than 0 of a launcher outside Spark: rank 0 drives the run
        return _peer_result(plan, launch(plan)[0], time.perf_counter() - started)
    # Both held to the end. The model path's writer lock, before the run directory or a
    # checkpoint is touched: a second run on this model path fails now (exit 1, naming this one)
    # instead of sharing them. The reader lease: a shard job will not overwrite the dataset.
    with output_lock(plan.model_path) as lock, reader_lease(plan.dataset_uri):
        # Rank 0 publishes under this lock, in whatever process it runs (common.writer_lock.writing_under).
        plan = dataclasses.replace(plan, writer_lock=lock)
        # The plan was read before the lease was taken: the dataset must still be that one.
        check_manifest_unchanged(plan.dataset_uri, plan.fingerprint)
        return _train_leased(cfg, plan, spark, on_step, on_epoch, started)


def _train_leased(cfg: TrainConfig, plan: RankPlan, spark, on_step, on_epoch, started: float) -> TrainResult:
    _check_output(cfg)
    log.info("dataset %s: %d train rows -> %d rank(s) x %d steps/epoch x %d epoch(s) (%d rows skipped per epoch)",
             plan.dataset_uri, plan.train.rows, plan.world_size, plan.steps_per_epoch, cfg.train.epochs,
             plan.skipped_rows_per_epoch)
    if needs_spark(cfg.launch):
        spark = spark or _session(cfg)
        launch_cfg = backend_for(cfg.launch, spark)  # an unset backend on Connect: torch
        if launch_cfg is not cfg.launch:
            plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, launch=launch_cfg))
        _check_model_fits(plan, spark)
    ranks = launch(plan, spark, on_step=on_step, on_epoch=on_epoch,
                   on_restart=lambda n, why: record_restart(plan.run_dir, n, cfg.launch.max_restarts, why))
    result = _result(plan, ranks, time.perf_counter() - started)
    _write_summary(result)
    return result


def _with_user_code(cfg: TrainConfig, code: UserCode | None) -> TrainConfig:
    """``cfg`` with model.name naming the model given in code; refused where code cannot go."""
    if code is None:
        return cfg
    launcher = launcher_for(cfg.launch)
    if launcher.no_driver_code:
        raise ConfigError(f"launch.backend={launcher.name} {launcher.no_driver_code}; give the model as model.name: "
                          "\"package.module:factory\" (and its loss and metrics as its methods), or use another backend")
    if cfg.train.pipeline.stages > 1 and ({"loss", "metrics"} & set(code.names)):
        raise ConfigError("train.pipeline.stages > 1 gives the last stage the outputs and the label only, not the "
                          "batch a loss(outputs, batch) or metrics(outputs, batch) given to train() reads; set "
                          "train.pipeline.stages=1")
    if "model" not in code.names:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=code.names["model"]))


def load_model(uri: str, program: bool = False, registry_uri: str | None = None, trust_code: bool = False):
    """A published model (see training.export.load_model): ``.predict(frame)`` on raw feature
    columns, refusing the rows the shard job's row rules refuse (``errors="raise"``, or
    ``errors="mark"``: see ``common.model_artifact.LoadedModel.predict``). ``program=True`` runs
    the TorchScript program, where the model holds one (``output.torchscript``). ``trust_code``: a
    model trained from code given to ``train(model=...)`` runs that code to rebuild, only if True. ``uri``
    may be ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS`` (in ``registry_uri``, or MLflow's
    default registry)."""
    from training.export import load_model as _load

    return _load(uri, program, registry_uri, trust_code)


# --- command handler (shardtrain train) ---------------------------------------------------------

def handle_train(args) -> int:
    """``args.config`` (a YAML path) and ``args.overrides`` (key=value strings)."""
    result = train(load_train_config(args.config, args.overrides))
    print(result.summary())
    return 0


# --- internals ---------------------------------------------------------------------------------

def _check_output(cfg: TrainConfig) -> None:
    check_outputs(cfg, {"the training dataset (data.path)": cfg.data.path})


def check_outputs(cfg: TrainConfig, inputs: dict[str, str]) -> None:
    """Before anything runs: no output (model, run directory, checkpoints) equal to, inside or
    containing an input; the run directory and checkpoints not inside the model directory (a
    publish replaces it whole); what is at model_path may be replaced, and checkpoint.path holds
    no other kind of output (exit 2 otherwise)."""
    model = cfg.output.model_path
    outputs = {"output.model_path": model, "output.run_dir": cfg.output.resolved_run_dir,
               "checkpoint.path": cfg.checkpoint_path}
    for key, uri in outputs.items():
        check_disjoint(uri, key, inputs)
    for key in ("output.run_dir", "checkpoint.path"):
        check_disjoint(outputs[key], key, {"output.model_path, which a publish replaces whole,": model})
    if cfg.tracking.mlflow is not None:
        from training.tracking import local_store_path

        # The next overwrite of the model would delete the tracking database kept inside it.
        store = local_store_path(cfg.tracking.mlflow.tracking_uri)
        if store:
            check_disjoint(store, "tracking.mlflow.tracking_uri", {"output.model_path, which a publish replaces whole,":
                                                                   model})
    # A model an interrupted overwrite moved aside is there too: its next publish restores it.
    if cfg.output.mode == "error" and (resolve(model).exists() or replaced_copy(model) is not None):
        raise OutputExistsError(f"{model} already exists; set output.mode=overwrite to replace it")
    check_replaceable(model, KIND_MODEL)
    check_checkpoint_root(cfg.checkpoint_path)


def _check_model_fits(plan: RankPlan, spark) -> None:
    """Exit 2 before any rank starts where the model's training state cannot fit the memory a rank
    gets (training.model_shape); ``spark``: the session the ranks run in, None without Spark."""
    from training.model_shape import EXECUTOR_SETTINGS, check_model_fits, rank_memory

    master, settings = None, {}
    if spark is not None:
        from common.spark import spark_setting

        master = spark_setting(spark, "spark.master", "")
        settings = {key: spark_setting(spark, key) for key in EXECUTOR_SETTINGS}
    check_model_fits(plan.config, plan.feature_spec, plan.label_spec.to_record(),
                     rank_memory(plan.config.launch, master, settings))


def task_slots(spark) -> tuple[str, int, int] | None:
    """(master, spark.task.cpus, concurrent tasks) of ``spark``'s application in local mode; None
    on a cluster, whose executors cannot be counted up front. A launch of ``launch.num_proc``
    Spark ranks needs that many slots at once."""
    from training.launchers.capacity import task_slots as slots

    return slots(spark)


def _session(cfg: TrainConfig):
    from common.spark import get_or_create_session

    return get_or_create_session(session_for(cfg.spark, cfg.launch))


def session_for(spark_cfg, launch_cfg):
    """The spark section with what the ranks need added (the GPU amount per task)."""
    if not launch_cfg.gpus_per_proc or "spark.task.resource.gpu.amount" in spark_cfg.conf:
        return spark_cfg
    spark_cfg = copy.deepcopy(spark_cfg)
    spark_cfg.conf["spark.task.resource.gpu.amount"] = launch_cfg.gpus_per_proc
    return spark_cfg


def _write_summary(result: TrainResult) -> None:
    import json

    summary = {"model_uri": result.model_uri, "metrics": result.metrics, "steps_per_rank": result.steps_per_rank,
               "steps_per_epoch": result.steps_per_epoch, "skipped_rows_per_epoch": result.skipped_rows_per_epoch,
               "world_size": result.world_size, "seconds": round(result.seconds, 3),
               "resumed_from": result.resumed_from, "checkpoint_problems": result.checkpoint_problems,
               "stopped_early": result.stopped_early,
               "ranks": [{k: r.get(k) for k in ("rank", "steps", "device", "device_reason", "gpu_addresses",
                                                "epoch_stats")} for r in result.ranks]}
    resolve(result.run_dir).write_text(SUMMARY, json.dumps(summary, indent=2, sort_keys=True))


def _published_by_this_run(plan: RankPlan, started: float) -> TrainResult | None:
    """Where the model path holds the model this very run published (``training.export.published_by``:
    the same run id, config and dataset; a launcher outside Spark restarted its processes after
    rank 0's publish, or the finished command was run again): the run is finished, whatever
    output.mode says; every process, rank 0 and the others alike, returns that model's account
    without training again. None otherwise: a new run."""
    from training.export import published_by

    meta = published_by(plan.model_path, plan.provenance())
    if meta is None:
        return None
    log.warning("model at %s was already published by this run (run id %s, the same config and dataset): its "
                "processes were restarted or its command run again once it had finished; not training again",
                plan.model_path, plan.run_id)
    steps = plan.steps_per_epoch * len(meta.get("metrics", []))
    result = TrainResult(model_uri=plan.model_path, run_dir=plan.run_dir, metrics=meta.get("metrics", []),
                         steps_per_rank=[steps] * plan.world_size, steps_per_epoch=plan.steps_per_epoch,
                         skipped_rows_per_epoch=plan.skipped_rows_per_epoch, world_size=plan.world_size,
                         seconds=time.perf_counter() - started)
    if coordinates_run(plan.config.launch) and not resolve(plan.run_dir).join(SUMMARY).exists():
        _write_summary(result)  # the publish's attempt died before writing it
    return result


def _peer_result(plan: RankPlan, own: dict, seconds: float) -> TrainResult:
    """A rank's own account, where another process (rank 0) is the run's driver."""
    return TrainResult(model_uri=plan.model_path, run_dir=plan.run_dir, metrics=[], steps_per_rank=[own["steps"]],
                       steps_per_epoch=plan.steps_per_epoch, skipped_rows_per_epoch=plan.skipped_rows_per_epoch,
                       world_size=plan.world_size, seconds=seconds, ranks=[own],
                       resumed_from=own.get("resumed_from"), checkpoint_problems=own.get("checkpoint_problems", []))


def _result(plan: RankPlan, ranks: list[dict], seconds: float) -> TrainResult:
    ranks = sorted(ranks, key=lambda r: r["rank"])  # launch.elastic returns them in no fixed order
    main = ranks[0]
    final = plan.for_world(len(ranks))  # launch.elastic: the world size the run finished at
    return TrainResult(model_uri=main["model_uri"], run_dir=plan.run_dir, metrics=main["metrics"],
                       steps_per_rank=[r["steps"] for r in ranks], steps_per_epoch=final.steps_per_epoch,
                       skipped_rows_per_epoch=final.skipped_rows_per_epoch, world_size=final.world_size,
                       seconds=seconds, ranks=ranks, reference=main.get("reference"),
                       resumed_from=main.get("resumed_from"), checkpoint_problems=main.get("checkpoint_problems", []),
                       stopped_early=bool(main.get("stopped_early")))


__all__ = ["TrainResult", "check_outputs", "handle_train", "load_model", "load_train_config", "session_for", "task_slots",
           "train"]
