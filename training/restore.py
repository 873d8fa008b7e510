"""Where a launch starts: the identity a run's checkpoints record (``run_identity``), the newest
good checkpoint of this run (``restore``: rank 0 finds and checks it, every rank gets it), and
this rank's own entry in a checkpoint's per-rank states (``saved_rank``, ``rng_state``).

A checkpoint written by another run (another dataset, batch, model, precision, ...) is refused
with a ConfigError naming the first key that differs: resuming it would train something else.
The checkpoint files themselves (save policy, markers, integrity) are ``training.checkpoint``'s.
"""

from __future__ import annotations

import json
import logging

import torch

from common.config import to_dict
from common.errors import ConfigError
from training.checkpoint import CheckpointManager
from training.plan import RankPlan

log = logging.getLogger("shardtrain.train")


def run_identity(plan: RankPlan) -> dict:
    """What a checkpoint must match to be resumed by this run (plain data, as checkpoints hold it)."""
    t = plan.config.train
    # The data-parallel size, not the world size: a pipeline's stages share their rows, so a run
    # on 2 stages and one in a single process train on the same rows in the same steps.
    return {"fingerprint": plan.fingerprint, "data_parallel_size": plan.data_parallel_size, "batch_size": t.batch_size,
            "grad_accum": t.grad_accum, "steps_per_epoch": plan.steps_per_epoch, "seed": t.seed,
            "model": json.dumps(plan.config.model.identity(), sort_keys=True), "precision": t.precision,
            **({"distill": to_dict(t.distill)} if t.distill is not None else {})}


def restore(plan: RankPlan, group, checkpoints: CheckpointManager, meta: dict) -> dict:
    """Rank 0 finds the newest good checkpoint and checks it belongs to this run; all ranks get it."""
    outcome = {"state": None, "uri": None, "step": 0, "problems": [], "error": None}
    if group.rank == 0 and plan.config.checkpoint.resume == "auto":
        found = checkpoints.restore_latest()
        if found:
            outcome.update(problems=found.problems)
            for problem in found.problems:
                log.warning("resume: %s", problem)
        if found and found.state:
            theirs = found.state.get("meta", {})
            # Written before pipeline stages: the world size was the data-parallel size.
            theirs = {"data_parallel_size": theirs.get("world_size"), **theirs}
            different = [k for k in meta if theirs.get(k) != meta[k]]
            if different:
                key = different[0]
                outcome["error"] = (f"checkpoint {found.uri} was written by a different run ({key}: {theirs.get(key)!r} "
                                    f"there, {meta[key]!r} now); set checkpoint.resume=never or a new checkpoint.path")
            else:
                outcome.update(state=found.state, uri=found.uri, step=found.step)
                log.info("resuming from %s (step %d)", found.uri, found.step)
    outcome = group.broadcast_object(outcome)
    if outcome["error"]:
        raise ConfigError(outcome["error"])
    return outcome


def saved_rank(saved: list[dict], group, dp_rank: int) -> dict:
    """This rank's entry of a checkpoint's per-rank states: its own where the checkpoint has one
    per rank of this world, else (a layout of other pipeline stages, same data-parallel size) the
    first of its data-parallel rank, whose loss sums are its replica's. Entries written before
    pipeline stages carry no dp_rank: each rank was its own replica."""
    if len(saved) == group.size:
        return saved[group.rank]
    return next(entry for i, entry in enumerate(saved) if entry.get("dp_rank", i) == dp_rank)


def rng_state(device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


__all__ = ["restore", "rng_state", "run_identity", "saved_rank"]
