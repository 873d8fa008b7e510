"""launch.backend=torch_tasks: torch.distributed ranks (Gloo, CPU) inside the barrier tasks' own Spark
Python workers (training/launchers/torch_tasks.py), on the suite's real local[2] session.

- The ranks train to the weights of the session's TorchDistributor run (``uneven_torch_run``, same
  config and seed), bit for bit, with equal steps on both ranks.
- A rank is its task's Python worker, not a process started for it: rank 0 stops itself just after
  its first committed checkpoint (``common.faults``, once); the test proves its pid is one of Spark's
  Python workers under this session, SIGKILLs it and proves it dead; the launch is relaunched once,
  resumes from that checkpoint and ends with the uninterrupted run's weights.
- Spark reuses the workers, and a launch leaves them as it found them: after the launches above, a
  plain barrier job on the same session finds torch already imported in both workers (no import
  again for the next launch) and none of the launch's environment variables.
- A plug-in model edited between two launches (a notebook's loop) is imported afresh by the second,
  whose ranks run in the workers the first left.
- A failing rank reports its own traceback: test_torch_backend.py, for both torch launchers.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from common.faults import FAULT_ENV, FAULT_ONCE_ENV
from spark_workers import python_workers
from stopped_rank import stopped_rank_killed
from torch_uneven import TORCH_RUN, torch_config
from training import train

pytestmark = [pytest.mark.timeout(600), pytest.mark.ranks, pytest.mark.spark,
              pytest.mark.stack]  # barrier mapInPandas, BarrierTaskContext and worker reuse are pyspark's
TASKS = tuple(o for o in TORCH_RUN if not o.startswith("launch.backend=")) + ("launch.backend=torch_tasks",)
PROBE = "SHARDTRAIN_TEST_TORCH_TASKS"


def _weights(result):
    from safetensors.numpy import load_file

    return load_file(os.path.join(result.model_uri, "model.safetensors"))


def _assert_same_weights(a, b):
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys() and wa
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
    assert {k: a.final[k] for k in ("train_loss", "val_loss", "val_accuracy")} == \
        {k: b.final[k] for k in ("train_loss", "val_loss", "val_accuracy")}


@pytest.fixture(scope="module")
def tasks_run(spark, uneven_dataset, tmp_path_factory):
    return train(torch_config(uneven_dataset, tmp_path_factory.mktemp("tasks-run"), *TASKS,
                              f"launch.env.{PROBE}=set-by-the-launch"), spark)


def test_torch_tasks_train_bit_identically_to_torch_distributor(tasks_run, uneven_torch_run):
    assert [r["rank"] for r in tasks_run.ranks] == [0, 1]
    assert tasks_run.steps_per_rank == uneven_torch_run.steps_per_rank == [2 * tasks_run.steps_per_epoch] * 2
    _assert_same_weights(tasks_run, uneven_torch_run)


def _spark_python_worker(pid: int) -> bool:
    """Whether ``pid`` is one of this session's Spark Python workers: forked from pyspark's daemon,
    which the session's JVM (a child of this process) started."""
    import psutil

    proc = psutil.Process(pid)
    chain = [proc, *proc.parents()]
    return ("pyspark.daemon" in " ".join(proc.cmdline()) and any("java" in p.name() for p in chain)
            and any(p.pid == os.getpid() for p in chain))


def test_a_killed_rank_worker_is_relaunched_and_resumes_to_the_uninterrupted_weights(
        spark, uneven_dataset, uneven_torch_run, tmp_path):
    once = tmp_path / "stopped.pid"

    def describe(proc):
        return {"worker": _spark_python_worker(proc.pid),
                "committed": sorted(p.name for p in (tmp_path / "model.run" / "checkpoints").glob("step-*"))}

    with stopped_rank_killed(once, describe, what="rank 0 (after its first checkpoint)") as seen:
        result = train(torch_config(uneven_dataset, tmp_path, *TASKS, "checkpoint.every_steps=20",
                                    f"launch.env.{FAULT_ENV}=commit:after-swap:stop",
                                    f"launch.env.{FAULT_ONCE_ENV}={once}", "launch.stall_timeout_s=120"), spark)
    # The kill happened: to a stopped Spark Python worker (the rank itself), after a committed checkpoint.
    assert "error" not in seen, seen.get("error")
    assert seen["worker"] and seen["dead"] and seen["committed"] == ["step-000000020"], seen
    restarts = [json.loads(line) for line in open(os.path.join(result.run_dir, "restarts.jsonl"))]
    assert len(restarts) == 1 and "a rank's Python worker died" in restarts[0]["reason"], restarts
    assert result.resumed_from and "/model.run/checkpoints/step-000000020" in result.resumed_from
    _assert_same_weights(result, uneven_torch_run)


def test_the_workers_are_reused_and_left_without_the_launch_environment(spark, tasks_run):
    # Only the launch's own variable is asked after: TorchDistributor's tasks leave RANK, MASTER_ADDR and
    # the like in the workers they ran in (pyspark's doing), which the restore rightly puts back.
    assert python_workers(spark, (PROBE,)) == [(True, "")] * 2


EDITED = '''from training.models import TabularMLP, mlp_arguments


def model(feature_spec, label_spec):
    return TabularMLP(**mlp_arguments(feature_spec, label_spec, [{width}]))
'''


def test_an_edited_plug_in_model_is_imported_afresh_by_the_next_launch(spark, uneven_dataset, tmp_path):
    """A notebook's loop: train with a plug-in model, edit its file, train again. The second launch's
    ranks run in the workers the first left (Spark reuses them), and must import the file as it is now."""
    from safetensors.numpy import load_file

    plugins = tmp_path / "plugins"
    plugins.mkdir()
    widths = []
    for run, width in enumerate((4, 6)):
        (plugins / "edited_model.py").write_text(EDITED.format(width=width))
        result = train(torch_config(uneven_dataset, tmp_path / f"run-{run}", *TASKS, "train.epochs=1",
                                    "model.name=edited_model:model", f"launch.env.PYTHONPATH={plugins}"), spark)
        weights = load_file(os.path.join(result.model_uri, "model.safetensors"))
        widths.append(weights["body.0.bias"].shape[0])  # the hidden layer's width
    assert widths == [4, 6]
    assert python_workers(spark) == [(True, "")] * 2  # the second launch ran in reused workers


def test_ranks_in_workers_without_shardtrain_are_one_line_saying_what_to_install(spark, uneven_dataset, tmp_path,
                                                                                executors_without_shardtrain):
    """Workers whose Python has no shardtrain (tests/conftest.py) cannot unpickle a rank's task: the
    launch ends in one line saying what to install or set, exit 2, never relaunched (a relaunch
    fails the same way), instead of the barrier stage's Java stack."""
    from common.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        train(torch_config(uneven_dataset, tmp_path, *TASKS, "launch.max_restarts=2"), spark)
    assert refused.value.exit_code == 2
    assert str(refused.value) == (
        "the 2 rank task(s) failed: the executors' Python cannot import shardtrain (No module named 'training'): "
        "install shardtrain on the executors (`make wheel` builds dist/shardtrain-<version>-py3-none-any.whl), or "
        "point PYSPARK_PYTHON (or spark.pyspark.python) at a Python that has it")
    assert not os.path.exists(tmp_path / "model")
