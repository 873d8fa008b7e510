"""Which device a scoring worker runs the model on (scoring.predict.scoring_device): the GPU Spark
assigned to its task, found by training's own rule (common.devices), CUDA_VISIBLE_DEVICES
renumbering included. Pure decisions (no GPU is needed to check them): the inputs are what a
worker reads from its TaskContext, torch and its environment."""

from __future__ import annotations

import pytest

from common.devices import resolve_device
from scoring.predict import scoring_device


@pytest.mark.parametrize("addresses, visible, device", [
    (["0"], None, "cuda:0"),
    (["3"], None, "cuda:3"),  # no renumbering: Spark's address is CUDA's index
    (["3"], "2,3", "cuda:1"),  # YARN / Kubernetes: CUDA sees physical GPUs 2 and 3 as 0 and 1
    (["2"], "2,3", "cuda:0"),
    (["5"], " 4 , 5 ", "cuda:1"),
    (["7"], "7", "cuda:0"),
    (["6"], "1", "cuda:0"),  # the only visible device is the task's, whatever its physical id
])
def test_a_task_runs_on_the_gpu_spark_assigned_it(addresses, visible, device):
    found, why = scoring_device(addresses, True, visible)
    assert found == device
    assert addresses[0] in why  # the log line names the Spark address it came from


@pytest.mark.parametrize("addresses, visible", [(["3"], "2,3"), (["1"], None), (["0", "1"], "1,0"), (["4"], "4")])
def test_scoring_and_training_pick_the_same_gpu_for_a_task(addresses, visible):
    """A host's GPU numbering means one thing for both stages: a worker never lands on a GPU that
    Spark gave another task (the wrong-index bug the shared rule fixed for training)."""
    assert scoring_device(addresses, True, visible) == resolve_device(addresses, True, visible)


def test_without_cuda_the_worker_scores_on_the_cpu_and_says_why():
    device, why = scoring_device(["1"], False, "0,1")
    assert device == "cpu" and "CUDA is not available" in why
    assert scoring_device([], False, None)[0] == "cpu"


def test_a_task_assigned_no_gpu_uses_cudas_current_device():
    """Local mode on a GPU host (no spark.task.resource.gpu.amount): CUDA's current device, as
    scoring did before it shared training's rule (a training rank takes the CPU there)."""
    assert scoring_device([], True, "2,3")[0] == "cuda"
    assert resolve_device([], True, "2,3")[0] == "cpu"
