"""``launch.backend: torchrun``: ``shardtrain train`` run by torchrun, or by anything else that sets
torch.distributed's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``LOCAL_RANK``): a Kubernetes PyTorchJob, plain SSH, Databricks' serverless GPU API. No Spark:
each process is one rank, reads the shards from storage itself and runs the one rank loop
(``training.loop.run_rank``) on a ``TorchGroup`` with the strategy ``train.parallel`` picks, as
the TorchDistributor backend does, so the same config and seed train to the same weights.

Every process runs the whole ``shardtrain train`` command: each builds the same plan from the
manifest (equal steps per rank come from it, not from the reader); rank 0 alone is the run's
driver (``coordinates``: the model path's writer lock, the dataset's reader lease, the output
checks, the publish and ``summary.json``); the others only train. Restarts are the launcher's
(torchrun's ``--max-restarts``): a restarted process runs the command again and its ranks resume
from the newest complete checkpoint (``checkpoint.resume: auto``), as after a relaunch on Spark.
There is no supervisor: torchrun watches its processes. The run id (recorded with the published
model) is the launch's (``TORCHELASTIC_RUN_ID``), the same in every rank and restart: ranks
restarted after rank 0 published, or the finished command run again with the same
``--rdzv-id``, find their own run's model and finish without training again, in any
``output.mode`` (``training.api``); the run id alone does not make a model theirs: a launch
reusing it with another config or dataset is a new run (``training.export.published_by``).

The ranks meet in the store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's own, or rank 0's where no
agent runs one) before they start: all of them within ``launch.start_timeout`` seconds, or one
line naming the ranks that never arrived or the address that did not answer
(``training.distributed.rendezvous_store``). At the end every rank puts its record (result or
failure, with its own traceback) in that store, and rank 0 reads them all, so its
``TrainResult`` counts every rank's steps.

Imports torch only when a rank starts.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from common.errors import ConfigError
from training.launchers.base import Launcher
from training.launchers.rank_entry import exchange_results, run_rank_entry

log = logging.getLogger("shardtrain.train")

ENV_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
_RESULT_PREFIX = "shardtrain/torchrun/{attempt}/result"


@dataclass(frozen=True)
class TorchrunEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def torchrun_env(launch_cfg) -> TorchrunEnv:
    """This process's place in the job, from its environment; exit 2 naming ``launch.backend``
    where the environment is not a torch.distributed launcher's or disagrees with ``launch.num_proc``."""
    missing = [name for name in ENV_VARS if not os.environ.get(name)]
    if missing:
        raise ConfigError(
            f"launch.backend=torchrun runs each rank as a process a launcher started, but {', '.join(missing)} "
            "is not set: run `torchrun --nproc-per-node N -m shardtrain train ... launch.backend=torchrun` (or a "
            "launcher that sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and LOCAL_RANK), or set "
            "launch.backend=torch to start the ranks on Spark")
    try:
        values = {name: int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    except ValueError:
        raise ConfigError("launch.backend=torchrun: RANK, WORLD_SIZE, MASTER_PORT and LOCAL_RANK must be integers, got "
                          + ", ".join(f"{n}={os.environ.get(n)!r}" for n in ENV_VARS)) from None
    world = values["WORLD_SIZE"]
    if world != launch_cfg.num_proc:
        raise ConfigError(
            f"launch.backend=torchrun: the launcher started WORLD_SIZE={world} rank(s) but launch.num_proc="
            f"{launch_cfg.num_proc}; the plan (rows per rank, steps per epoch) is made for launch.num_proc, so set "
            f"launch.num_proc={world} or start {launch_cfg.num_proc} rank(s)")
    if not 0 <= values["RANK"] < world:
        raise ConfigError(f"launch.backend=torchrun: RANK={values['RANK']} is outside WORLD_SIZE={world}")
    if not 1 <= values["MASTER_PORT"] <= 65535:
        raise ConfigError(f"launch.backend=torchrun: MASTER_PORT={values['MASTER_PORT']} is not a TCP port; set it to "
                          "rank 0's rendezvous port, from 1 to 65535")
    return TorchrunEnv(rank=values["RANK"], world_size=world, local_rank=values["LOCAL_RANK"],
                       master_addr=os.environ["MASTER_ADDR"], master_port=values["MASTER_PORT"])


class TorchrunLauncher(Launcher):
    """``launch.backend=torchrun``: this process is one rank a launcher outside Spark started."""

    spark = False
    no_driver_code = ("starts every rank from the command line, with no driver to ship train(model=..., loss=..., "
                      "metrics=...) from")

    def ranks_on_this_host(self, launch_cfg) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE") or 1)  # torchrun's --nproc-per-node

    def coordinates(self, launch_cfg) -> bool:
        """Whether this process is the run's driver as well as a rank: rank 0."""
        return torchrun_env(launch_cfg).rank == 0

    def run_id(self, launch_cfg) -> str | None:
        """The launch's run id, the same in every rank and every restart: torchrun's
        ``TORCHELASTIC_RUN_ID`` (``--rdzv-id``; a fresh uuid per ``--standalone`` launch). None where
        the launcher sets none (each start is then a run of its own; set ``TORCHELASTIC_RUN_ID`` to the
        job's name so that a restarted job recognises what it published)."""
        value = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
        return f"torchrun-{value}" if value and value != "none" else None

    def launch(self, plan, spark, on_step=None, on_restart=None, on_epoch=None) -> list[dict]:
        return launch_torchrun(plan, plan.config.launch)


def launch_torchrun(plan, launch_cfg) -> list[dict]:
    """Run this process's rank; rank 0 returns every rank's record (rank 0 first), the others their own."""
    from training.distributed import TorchGroup, rendezvous_store

    env = torchrun_env(launch_cfg)
    os.environ.update({k: str(v) for k, v in launch_cfg.env.items()})
    # Every rank there within launch.start_timeout, or one line naming what is missing; before the
    # rank starts, so that no rank record (with a traceback) stands for a rank that never ran.
    store = rendezvous_store(env.rank, env.world_size, env.master_addr, env.master_port, launch_cfg.start_timeout)
    started = []

    def start_group(plan_):
        group = TorchGroup(*_device(launch_cfg, env.local_rank), store=store)
        started.append(group)
        return group

    # The store stays up until the records are exchanged: where no agent runs it, rank 0 hosts it
    # (``store``, held to the end of this function).
    result = run_rank_entry(plan, env.rank, start_group, _train)
    try:
        return _exchange_results(env, result, launch_cfg.start_timeout)
    finally:
        for group in started:
            group.shutdown()


def _device(launch_cfg, local_rank: int):
    """(device, why): GPU ``LOCAL_RANK`` where CUDA is available (``launch.device``: auto or cuda),
    else the CPU."""
    import torch

    wanted = launch_cfg.device
    if wanted != "cpu" and torch.cuda.is_available():
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ConfigError(f"launch.backend=torchrun: LOCAL_RANK={local_rank} but this machine has {count} GPU(s); "
                              "start at most one rank per GPU (--nproc-per-node) or set launch.device=cpu")
        device = torch.device(f"cuda:{local_rank}")
        torch.cuda.set_device(device)
        return device, f"torchrun LOCAL_RANK={local_rank}"
    if wanted == "cuda":
        raise ConfigError("launch.device=cuda but CUDA is not available in this rank's process (no GPU, or a CPU "
                          "build of torch); use launch.device=auto or cpu")
    return torch.device("cpu"), "launch.device=cpu" if wanted == "cpu" else "no CUDA in this process"


def _train(plan, group, reporter) -> dict:
    from training.loop import run_rank

    return run_rank(plan, group, hooks=reporter)


def _exchange_results(env: TorchrunEnv, result: dict, timeout: int) -> list[dict]:
    """Rank 0: every rank's result (keys per launch and restart, so a relaunch never reads the last
    one's); the other ranks: their own."""
    from training.distributed import attempt_key

    prefix = _RESULT_PREFIX.format(attempt=attempt_key())
    gathered = exchange_results(env.master_addr, env.master_port, env.world_size, env.rank, prefix, result, timeout)
    return [result] if gathered is None else gathered


__all__ = ["ENV_VARS", "TorchrunEnv", "TorchrunLauncher", "launch_torchrun", "torchrun_env"]
