"""Pipeline parallelism (train.pipeline, training.strategies.pipeline) on real torch.distributed
ranks (Gloo, CPU, spawned processes on 127.0.0.1), held to one process on the same rows:

- the strategy itself: 2 stages under each schedule, with gradient accumulation and clipping, and
  2 stages x 2 replicas, give the one-process losses at every step and its final weights (float
  sums in another order: a tolerance, no exactness); fp16 with an inf in stage 0's gradients
  skips the step on every stage;
- the rank loop: a run on 2 stages equals a one-process run; a checkpoint written on stages
  resumes in one process and under DDP, and one written in one process resumes on stages, each
  to the uninterrupted run's weights; the exported model is the same;
- the config refusals (exit 2, naming the key);
- one real run through ``training.train`` on TorchDistributor (local[2]).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import pipeline_ranks
from common.errors import EXIT_USAGE, ConfigError
from torch_ranks import run_ranks

pytestmark = pytest.mark.timeout(600)

ROWS = 8  # per replica and accumulated batch: 4 micro-batches of 2


def _assert_close_states(got: dict, expected: dict, tol: float = 2e-6):
    assert list(got) == list(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name].numpy(), value.numpy(), rtol=0, atol=tol, err_msg=name)


@pytest.mark.parametrize("pipeline,accum", [
    ({"stages": 2, "schedule": "gpipe", "microbatches": 4}, 1),
    ({"stages": 2, "schedule": "1f1b", "microbatches": 4}, 2),
    ({"stages": 2, "schedule": "interleaved_1f1b", "microbatches": 4, "stages_per_rank": 2}, 1),
], ids=["gpipe", "1f1b-grad_accum2", "interleaved_1f1b"])
def test_two_stages_equal_one_process(pipeline, accum):
    steps = 4
    ranks = run_ranks(2, pipeline_ranks.steps_on_stages, pipeline, steps, accum, ROWS, 0.5)
    alone = pipeline_ranks.steps_in_one_process(steps, accum, ROWS, clip_norm=0.5)
    # Every stage returns the loss the last stage computed: what logs and the non-finite check read.
    for rank in ranks:
        np.testing.assert_allclose(rank["losses"], alone["losses"], rtol=1e-6)
    _assert_close_states(ranks[0]["model"], alone["model"])
    assert ranks[1]["model"] == {}  # only rank 0, which writes checkpoints, gets the whole model
    # The optimizer state as one process's: keyed by position, every parameter's from its owner.
    mine, theirs = ranks[0]["optimizer"], alone["optimizer"]
    assert mine["state"].keys() == theirs["state"].keys()
    for i, state in theirs["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            np.testing.assert_allclose(mine["state"][i][key].numpy(), state[key].numpy(), atol=1e-6)


def test_two_stages_times_two_replicas_equal_one_process():
    """Ranks 0,1 are replica 0's stages, 2,3 replica 1's; each stage is replicated with replicate()."""
    steps = 3
    ranks = run_ranks(4, pipeline_ranks.steps_on_stages, {"stages": 2, "schedule": "1f1b", "microbatches": 4},
                      steps, 1, ROWS)
    assert [r["dp_rank"] for r in ranks] == [0, 0, 1, 1]
    alone = pipeline_ranks.steps_in_one_process(steps, 1, ROWS, replicas=2)
    _assert_close_states(ranks[0]["model"], alone["model"])
    # Each replica's loss is the mean over its own rows; their mean is the one process's.
    for step in range(steps):
        mean = (ranks[0]["losses"][step] + ranks[2]["losses"][step]) / 2
        assert mean == pytest.approx(alone["losses"][step], rel=1e-6)
        assert ranks[0]["losses"][step] == ranks[1]["losses"][step]


def test_fp16_an_overflow_on_stage_0_skips_the_step_on_every_stage():
    steps = 3
    ranks = run_ranks(2, pipeline_ranks.steps_on_stages, {"stages": 2, "schedule": "1f1b", "microbatches": 4},
                      steps, 1, ROWS, None, "fp16", 1)
    # One zero-gradient step initialises the optimizer, then 3 steps of which step 1 is skipped
    # on both stages (stage 1's own gradients were finite): Adam counted 3 steps everywhere.
    assert [r["optimizer_steps"] for r in ranks] == [[3.0], [3.0]]
    # Both ranks lowered the loss scale once, from GradScaler's 65536.
    assert ranks[0]["scale"] == ranks[1]["scale"] == 32768.0
