"""Periodic synchronisation (train.sync: local SGD, DiLoCo, DiLoCo with its average overlapping the
next round) on real Gloo ranks, in the strategy and through the whole rank loop: the replicas really
train apart between syncs and agree at every sync, a sync costs one collective, every=1 with plain
SGD is every-step data parallel, the overlap is deterministic, each epoch records its rounds and
the report shows them, and each refused combination names its key. A rank killed mid-run resuming
to an uninterrupted run's weights: test_failures.py's DiLoCo Gloo-rank resume test."""

import os
from types import SimpleNamespace

import pytest
import torch

from common.dataset import LabelSpec
from common.errors import EXIT_USAGE, ConfigError
from torch_ranks import values
from plugin_models import Wrap
from training.config import LaunchConfig, TrainConfig, TrainLoopConfig
from training.strategies.periodic import SyncConfig
from training.tasks import Objective

STEPS, BATCH = 12, 16
CLASSES_2 = LabelSpec(name="label", task="classification", num_classes=2)


def _config(**sync) -> TrainConfig:
    return TrainConfig(train=TrainLoopConfig(batch_size=BATCH, sync=SyncConfig(**sync)),
                       launch=LaunchConfig(backend="torch", num_proc=2))


def _replica_run(group, strategy_name: str, sync: dict, steps_per_epoch: int, seed: int = 0):
    """Train a small network on this rank's own data with the named strategy; returns the flat
    weights after every step, the figures of the epoch, and the strategy's collective count."""
    from training.launchers import launcher_for
    from training.precision import Precision
    from training.strategies import strategy_class, technique
    from training.strategies.periodic import flatten

    config = _config(**sync)
    cls = strategy_class(technique(config.train) if strategy_name == "periodic" else "ddp", launcher_for(config.launch))
    strategy = cls(group, Precision("fp32", "cpu"), config)
    torch.manual_seed(seed)
    model = Wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)))
    step_model = strategy.wrap(model)
    optimizer = strategy.optimizer(torch.optim.SGD(model.parameters(), lr=0.2), model, 1)
    strategy.broadcast_initial_state(model, optimizer)
    strategy.begin(SimpleNamespace(steps_per_epoch=steps_per_epoch), 0, model)
    data = torch.Generator().manual_seed(100 + group.rank)  # each replica its own rows
    weights = []
    for step in range(1, STEPS + 1):
        x = torch.randn(BATCH, 4, generator=data)
        batch = {"numeric": x, "label": (x[:, 0] + (group.rank - 0.5) * x[:, 1] > 0).long()}
        strategy.train_step(step_model, [batch], optimizer, Objective(CLASSES_2), None)
        strategy.after_step(step, model, optimizer)
        weights.append(flatten(model))
    figures = strategy.epoch_metrics() if strategy_name == "periodic" else {}
    return {"weights": weights, "figures": figures}


# Every run of _replica_run the tests below read, by name: (strategy, sync, steps_per_epoch). All run
# on the same 2 ranks, one after another (replica_runs); "again" runs are separate runs with
# the same seed, so comparing them still shows a run's weights depend on no timing.
REPLICA_RUNS = {
    "local_sgd every 4": ("periodic", {"mode": "local_sgd", "every": 4}, STEPS),
    "local_sgd every 1": ("periodic", {"mode": "local_sgd", "every": 1}, STEPS),
    "ddp": ("ddp", {}, STEPS),
    "warmup": ("periodic", {"mode": "local_sgd", "every": 4, "warmup_steps": 5}, STEPS),
    "diloco": ("periodic", {"mode": "diloco", "every": 3, "overlap": False}, 6),
    "diloco again": ("periodic", {"mode": "diloco", "every": 3, "overlap": False}, 6),
    "diloco overlap": ("periodic", {"mode": "diloco", "every": 3, "overlap": True}, 6),
    "diloco overlap again": ("periodic", {"mode": "diloco", "every": 3, "overlap": True}, 6),
    "no sync by step 4": ("periodic", {"mode": "local_sgd", "every": 1000}, 1000),
}


@pytest.fixture(scope="module")
def replica_runs(two_ranks):
    """Each named run's two ranks' results (a run that failed fails only the tests that read it),
    on the session's two ranks."""
    names = list(REPLICA_RUNS)
    outcomes = two_ranks.run_calls([(_replica_run, REPLICA_RUNS[name]) for name in names])
    return dict(zip(names, outcomes))


@pytest.mark.ranks
def test_local_sgd_replicas_train_apart_and_agree_at_each_sync_with_one_collective(replica_runs):
    a, b = values(replica_runs["local_sgd every 4"])
    for step in range(1, STEPS + 1):
        same = torch.equal(a["weights"][step - 1], b["weights"][step - 1])
        assert same == (step % 4 == 0), step  # apart between syncs (not every-step DDP), equal after each
    assert a["figures"]["sync_rounds"] == STEPS // 4 == a["figures"]["sync_collectives"]
    assert a["figures"]["sync_drift"] > 0
    assert a["figures"]["sync_bytes_per_sample"] == pytest.approx(4 * (4 * 8 + 8 + 8 * 2 + 2) * 3 / (STEPS * BATCH))


@pytest.mark.ranks
def test_local_sgd_every_step_with_plain_sgd_is_data_parallel(replica_runs):
    """every=1: averaging the weights after each plain SGD step is averaging the gradients (to float rounding)."""
    ours = values(replica_runs["local_sgd every 1"])[0]
    ddp = values(replica_runs["ddp"])[0]
    for step, (mine, theirs) in enumerate(zip(ours["weights"], ddp["weights"]), start=1):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=f"step {step}")
    assert ours["figures"]["sync_collectives"] == STEPS


@pytest.mark.ranks
def test_warmup_steps_average_gradients_then_rounds_begin(replica_runs):
    a, b = values(replica_runs["warmup"])
    for step in range(1, STEPS + 1):
        same = torch.equal(a["weights"][step - 1], b["weights"][step - 1])
        assert same == (step <= 5 or step % 4 == 0), step
    assert a["figures"]["sync_collectives"] == 5 + 2  # 5 warm-up gradient averages, then steps 8 and 12


@pytest.mark.ranks
@pytest.mark.parametrize("overlap", [False, True])
def test_diloco_agrees_at_epoch_ends_and_its_overlap_is_deterministic(replica_runs, overlap):
    name = "diloco overlap" if overlap else "diloco"
    first = values(replica_runs[name])
    again = values(replica_runs[f"{name} again"])
    for rank in range(2):
        for mine, theirs in zip(first[rank]["weights"], again[rank]["weights"]):
            assert torch.equal(mine, theirs)  # same seed, same weights, bit for bit: no timing in it
    a, b = first
    for step in range(1, STEPS + 1):
        same = torch.equal(a["weights"][step - 1], b["weights"][step - 1])
        # Without overlap every sync is a consensus; with it, only the epoch ends (every 6 steps) are.
        assert same == (step % (6 if overlap else 3) == 0), step
    assert a["figures"]["sync_rounds"] == STEPS // 3


@pytest.mark.ranks
def test_the_synced_weights_are_the_mean_of_the_replicas(replica_runs):
    """local SGD's consensus is the plain average of what the replicas had just before the sync."""
    a, b = values(replica_runs["local_sgd every 4"])
    c, d = values(replica_runs["no sync by step 4"])
    torch.testing.assert_close(a["weights"][3], (c["weights"][3] + d["weights"][3]) / 2, rtol=0, atol=1e-7)


@pytest.mark.parametrize("overrides, key", [
    ({"train.parallel": "fsdp", "train.sync.mode": "local_sgd", "launch.backend": "torch"}, "train.sync.mode=local_sgd needs train.parallel=ddp"),
    ({"train.sync.mode": "local_sgd", "train.sync.overlap": "true"}, "overlap applies to mode=diloco only"),
    ({"train.sync.mode": "diloco", "launch.elastic": "true", "launch.backend": "horovod"}, "launch.elastic does not combine"),
    ({"train.sync.mode": "local_sgd", "train.sync.every": "8", "checkpoint.every_steps": "12"},
     "checkpoint.every_steps must be a multiple of train.sync.every=8"),
    ({"train.sync.mode": "diloco", "train.sync.overlap": "true", "checkpoint.every_steps": "8"},
     "checkpoint.every_steps must be null with train.sync.overlap=true"),
    ({"train.sync.mode": "local_sgd", "train.pipeline.stages": "2", "launch.backend": "torch", "model.hidden": "[8, 8]"},
     "train.sync.mode=local_sgd with train.pipeline.stages=2 is not built"),
])
def test_refused_combinations_name_the_key(overrides, key):
    from training import load_train_config

    if overrides.get("launch.backend") == "horovod":
        pytest.importorskip("horovod.torch")
    with pytest.raises(ConfigError) as info:
        load_train_config(None, ["data.path=/nowhere", *(f"{k}={v}" for k, v in overrides.items())])
    assert key in str(info.value) and info.value.exit_code == EXIT_USAGE


@pytest.mark.ranks
def test_local_sgd_through_the_rank_loop_records_its_rounds_and_publishes_the_consensus(two_ranks, tmp_path):
    """A whole 2-epoch run through the rank loop (``training.loop.run_rank``, what a launcher's ranks
    run; the launcher adds nothing to it: test_torchrun's
    test_torchrun_trains_bit_identically_to_torch_distributor) on the session's two ranks: each
    epoch's record counts its rounds (multiples of every, plus the epoch's last step) and the
    replicas' drift; the published model is what both ranks ended with; the report shows the rounds."""
    from tabular_data import write_dataset
    from torch_ranks import run_loop
    from train_configs import train_config
    from training import load_model

    ds = write_dataset(str(tmp_path / "ds"), {"train": [[600], [420]], "val": [[100]]})
    cfg = train_config(ds, tmp_path / "model", "launch.backend=torch", "train.batch_size=16", "train.epochs=2",
                       "train.log_every_steps=10", "model.hidden=[16]", "train.sync.mode=local_sgd",
                       "train.sync.every=5", "data.reader=arrow", ranks=2)
    result = run_loop(cfg, two_ranks)
    per_epoch = result.steps_per_epoch
    assert result.steps_per_rank == [2 * per_epoch] * 2
    for epoch, record in enumerate(result.metrics):
        steps = range(epoch * per_epoch + 1, (epoch + 1) * per_epoch + 1)
        assert record["sync_rounds"] == sum(1 for s in steps if s % 5 == 0 or s % per_epoch == 0)
        assert record["sync_collectives"] == record["sync_rounds"] and record["sync_drift"] > 0
    model = load_model(result.model_uri)
    assert model.predict(ds.raw["val"]).shape[0] == len(ds.raw["val"])
    with open(os.path.join(f"{result.model_uri}.run", "report.html"), encoding="utf-8") as fh:
        report = fh.read()
    assert "sync rounds" in report and "drift at sync" in report  # the report shows what metrics.jsonl holds
