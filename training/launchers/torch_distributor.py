"""The torch backend: pyspark's ``TorchDistributor`` runs one barrier Spark task per rank
(``local_mode=False``), each task one ``torchrun`` process, and every rank runs the same loop as on
Horovod (``training.loop.run_rank``) on a ``TorchGroup``, with the strategy ``train.parallel`` picks
(``training.strategies``: DDP or FSDP2).

TorchDistributor hands back only rank 0's return value, so every rank puts its record (its result,
or its failure with its own traceback) in the torch.distributed key-value store torchrun already
runs, and rank 0 returns all of them: the driver gets one record per rank, as from Horovod. The
store, not a collective, carries them because after a failure the collectives are broken.

``torch_rank_entry`` is what executors run: module-level, given only the plain ``RankPlan``,
importing torch when it runs; the sequence around the training is the shared
``training.launchers.rank_entry.run_rank_entry``. This module imports neither torch nor horovod
at import time.
"""

from __future__ import annotations

import logging
import os
import sys

from common.errors import LaunchError
from common.spark import spark_setting
from training.launchers.base import SparkLauncher
from training.launchers.capacity import barrier_slots_error, check_capacity
from training.launchers.rank_entry import exchange_results, run_rank_entry

log = logging.getLogger("shardtrain.train")

_RESULT_PREFIX = "shardtrain/result"


def launch_torch(plan, spark, launch_cfg) -> list[dict]:
    """``launch_cfg.num_proc`` torch.distributed ranks as barrier tasks of ``spark``'s application."""
    check_capacity(spark, launch_cfg.num_proc, launch_cfg.gpus_per_proc)
    from pyspark.ml.torch.distributor import TorchDistributor

    # TorchDistributor refuses use_gpu=True unless tasks are given GPUs; with it off it hides
    # every GPU from the ranks (CUDA_VISIBLE_DEVICES="").
    use_gpu = bool(launch_cfg.gpus_per_proc) or spark_setting(spark, "spark.task.resource.gpu.amount") is not None
    env = {"PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in launch_cfg.env.items()}}
    try:
        distributor = TorchDistributor(num_processes=launch_cfg.num_proc, local_mode=False, use_gpu=use_gpu)
        results = distributor.run(torch_rank_entry, plan, env, launch_cfg.start_timeout)
    except Exception as exc:  # noqa: BLE001 - mapped to one typed error with the cause in words
        from common.spark import executor_setup_error, explain_java_error

        setup = executor_setup_error(exc, f"TorchDistributor running {launch_cfg.num_proc} rank(s)")
        if setup is not None:
            raise setup from None
        text = explain_java_error(exc)
        slots = barrier_slots_error(text, "TorchDistributor", launch_cfg.num_proc)
        if slots:
            raise slots from exc
        # A barrier task that died (a rank's process killed, an executor lost) fails the whole stage.
        raise LaunchError(f"TorchDistributor failed running {launch_cfg.num_proc} rank(s): {text}; the ranks' own "
                          "output above says more", rank_lost=True) from exc
    if not isinstance(results, list) or len(results) != launch_cfg.num_proc:
        raise LaunchError(f"TorchDistributor returned {results!r} instead of {launch_cfg.num_proc} rank results")
    return results


def torch_rank_entry(plan, env: dict, result_timeout: int):
    """Runs in every torchrun process. Never raises: a failure becomes this rank's record."""
    os.environ.update(env)
    # PYTHONPATH in launch.env must reach this already-running interpreter too (plugin models).
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    rank = int(os.environ.get("RANK", "-1"))
    # Closing the group's connections at the end tells ranks still inside a collective that this
    # one is gone (rather than after the collective timeout).
    result = run_rank_entry(plan, rank, _start_group, _train, stop_group=lambda group: group.shutdown())
    return _exchange_results(rank, result, result_timeout)


def _start_group(plan):
    from training.distributed import TorchGroup, pick_device

    return TorchGroup(*pick_device(int(os.environ.get("RANK", "-1"))))


def _train(plan, group, reporter) -> dict:
    from training.loop import run_rank

    return run_rank(plan, group, hooks=reporter)


def _exchange_results(rank: int, result: dict, timeout: int):
    """Every rank's result to rank 0 through torchrun's store; rank 0 returns the list."""
    return exchange_results(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                            rank, _RESULT_PREFIX, result, timeout)


class TorchDistributorLauncher(SparkLauncher):
    """``launch.backend=torch``: torch.distributed ranks, one torchrun per barrier task."""

    def launch_ranks(self, plan, spark, launch_cfg) -> list[dict]:
        return launch_torch(plan, spark, launch_cfg)


__all__ = ["TorchDistributorLauncher", "launch_torch", "torch_rank_entry"]
