"""Pipeline parallelism (train.pipeline, training.strategies.pipeline) on real torch.distributed
ranks (Gloo, CPU, processes on 127.0.0.1), held to one process on the same rows:

- the strategy itself: 2 stages under each schedule, with gradient accumulation and clipping, and
  2 stages x 2 replicas, give the one-process losses at every step and its final weights (float
  sums in another order: a tolerance, no exactness); fp16 with an inf in stage 0's gradients
  skips the step on every stage;
- the rank loop: a run on 2 stages equals a one-process run; a checkpoint written on stages
  resumes in one process and under DDP, and one written in one process resumes on stages, each
  to the uninterrupted run's weights; the exported model is the same;
- the config refusals (exit 2, naming the key).

Stages launched by ``training.train`` on TorchDistributor (local[2]): test_pipeline_failures.py,
whose stopped-stage test checks its relaunched run end to end.

Spawning ranks and importing torch is most of a small case's seconds, so the 2-rank strategy
cases run one after another on the session's two ranks (``two_ranks``, shared with other files:
``two_stage_ranks``), then the staged rank-loop runs (``staged_runs``); each test reads and checks
its own case.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import pipeline_ranks
from common.errors import EXIT_USAGE, ConfigError
from resume_from import copy_checkpoint
from torch_ranks import run_calls, run_ranks, values

pytestmark = [pytest.mark.timeout(600), pytest.mark.ranks]

ROWS = 8  # per replica and accumulated batch: 4 micro-batches of 2


def _assert_close_states(got: dict, expected: dict, tol: float = 2e-6):
    assert list(got) == list(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(got[name].numpy(), value.numpy(), rtol=0, atol=tol, err_msg=name)


MLP_SPLIT = [["body.0"], ["body.2", "body.4", "body.6", "body.8"]]
ONE_F_ONE_B = {"stages": 2, "schedule": "1f1b", "microbatches": 4}
# test_two_stages_equal_one_process's cases: (pipeline, accum, kind), 4 steps with clipping.
EQUAL_ONE_PROCESS = {
    "gpipe": ({"stages": 2, "schedule": "gpipe", "microbatches": 4}, 1, "mlp"),
    "1f1b-grad_accum2": (ONE_F_ONE_B, 2, "mlp"),
    "interleaved_1f1b": ({"stages": 2, "schedule": "interleaved_1f1b", "microbatches": 4, "stages_per_rank": 2},
                         1, "mlp"),
    "ft_transformer-1f1b": (ONE_F_ONE_B, 1, "ft_transformer"),
    "ft_transformer-interleaved": ({"stages": 2, "schedule": "interleaved_1f1b", "microbatches": 4,
                                    "stages_per_rank": 2}, 1, "ft_transformer"),
}
# Every 2-rank strategy test's call, by name: (function, its arguments after the group); for
# steps_on_stages (pipeline, steps, accum, rows, clip_norm, precision, poison_step, kind). They all
# run in one launch (two_stage_ranks).
TWO_STAGE_CALLS = {
    **{name: (pipeline_ranks.steps_on_stages, (pipeline, 4, accum, ROWS, 0.5, "fp32", None, kind))
       for name, (pipeline, accum, kind) in EQUAL_ONE_PROCESS.items()},
    "split-named": (pipeline_ranks.steps_on_stages, ({"stages": 2, "microbatches": 4, "split": MLP_SPLIT}, 2, 1, ROWS)),
    "split-auto": (pipeline_ranks.steps_on_stages, ({"stages": 2, "microbatches": 4, "split": "auto"}, 2, 1, ROWS)),
    "fp16-overflow": (pipeline_ranks.steps_on_stages, (ONE_F_ONE_B, 3, 1, ROWS, None, "fp16", 1)),
    "bf16": (pipeline_ranks.steps_on_stages, (ONE_F_ONE_B, 4, 1, ROWS, None, "bf16")),
    "bubble": (pipeline_ranks.bubble_with_a_slow_first_stage, (0.05, 3)),
}


@pytest.fixture(scope="module")
def two_stage_ranks(two_ranks):
    """Every 2-rank strategy test's calls, on the session's two ranks: each test reads its own
    call's results (a call that failed fails only the test that reads it)."""
    names = list(TWO_STAGE_CALLS)
    outcomes = two_ranks.run_calls([TWO_STAGE_CALLS[name] for name in names])
    return dict(zip(names, outcomes))


@pytest.mark.parametrize("name", list(EQUAL_ONE_PROCESS))
def test_two_stages_equal_one_process(two_stage_ranks, name):
    pipeline, accum, kind = EQUAL_ONE_PROCESS[name]
    steps = 4
    ranks = values(two_stage_ranks[name])
    alone = pipeline_ranks.steps_in_one_process(steps, accum, ROWS, clip_norm=0.5, kind=kind)
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


@pytest.mark.parametrize("split", ["named", "auto"])
def test_where_the_stages_are_cut_follows_split_and_changes_no_result(two_stage_ranks, split):
    """An explicit split puts exactly the named blocks on each stage; auto (a timing pass on
    rank 0) cuts every block into one stage or the other, the same on every rank. Either way the
    stages compute what one process does."""
    ranks = values(two_stage_ranks[f"split-{split}"])
    (first,), (second,) = ranks[0]["bounds"], ranks[1]["bounds"]
    assert first[0] == 0 and first[1] == second[0] and second[1] == 5 and first[1] < second[1]
    if split != "auto":
        assert (first, second) == ((0, 1), (1, 5))
        assert [n for n in ranks[0]["owned"] if n.startswith("body.")] == ["body.0.weight", "body.0.bias"]
    alone = pipeline_ranks.steps_in_one_process(2, 1, ROWS)
    np.testing.assert_allclose(ranks[1]["losses"], alone["losses"], rtol=1e-6)
    _assert_close_states(ranks[0]["model"], alone["model"])


def test_an_explicit_split_must_name_every_block_in_order():
    from training.strategies.pipeline import _named_bounds

    net = pipeline_ranks.model("ft_transformer")
    assert _named_bounds(net, [["blocks.0", "blocks.1", "blocks.2"], ["blocks.3"]]) == [(0, 3), (3, 4)]
    with pytest.raises(ConfigError) as info:
        _named_bounds(net, [["blocks.0", "blocks.2"], ["blocks.1", "blocks.3"]])
    assert info.value.exit_code == EXIT_USAGE
    assert "train.pipeline.split=" in str(info.value) and "['blocks.0', 'blocks.1', 'blocks.2', 'blocks.3']" in str(info.value)


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


def test_fp16_an_overflow_on_stage_0_skips_the_step_on_every_stage(two_stage_ranks):
    ranks = values(two_stage_ranks["fp16-overflow"])
    # One zero-gradient step initialises the optimizer, then 3 steps of which step 1 is skipped
    # on both stages (stage 1's own gradients were finite): Adam counted 3 steps everywhere.
    assert [r["optimizer_steps"] for r in ranks] == [[3.0], [3.0]]
    # Both ranks lowered the loss scale once, from GradScaler's 65536.
    assert ranks[0]["scale"] == ranks[1]["scale"] == 32768.0


def test_the_bubble_fraction_is_measured_per_stage_and_names_the_stage_that_waits(two_stage_ranks):
    """Stage 0 sleeps in every forward: stage 1 idles waiting for its activations, which the
    measured bubble (point-to-point waits over step time) shows; every rank gets every stage's."""
    ranks = values(two_stage_ranks["bubble"])
    # The sleeps happened: 4 micro-batches x 3 steps, and one more while the schedule infers shapes.
    assert ranks[0]["slept"] >= 3 * 4 * 0.05
    assert ranks[1]["slept"] == 0
    bubble = ranks[0]["figures"]["pipeline_bubble_fraction"]
    assert ranks[1]["figures"]["pipeline_bubble_fraction"] == bubble
    assert len(bubble) == 2 and all(0 <= f < 1 for f in bubble)
    assert bubble[1] > bubble[0]


def test_bf16_on_two_stages_stays_close_to_one_process_in_bf16(two_stage_ranks):
    steps = 4
    ranks = values(two_stage_ranks["bf16"])
    alone = pipeline_ranks.steps_in_one_process(steps, 1, ROWS, precision="bf16")
    fp32 = pipeline_ranks.steps_in_one_process(steps, 1, ROWS)

    def farthest(a, b):
        return max(float((a[k] - b[k]).abs().max()) for k in b)

    # bf16 keeps 8 bits of mantissa and micro-batches round in another order: close, not equal
    # (1.3e-3 measured after 4 AdamW steps at lr 0.05); but the stages did compute in bf16: they
    # are far from fp32 (0.1 measured).
    np.testing.assert_allclose(ranks[1]["losses"], alone["losses"], rtol=1e-3)
    assert farthest(ranks[0]["model"], alone["model"]) < 5e-3
    assert farthest(ranks[0]["model"], fp32["model"]) > 10 * farthest(ranks[0]["model"], alone["model"])


# --- the refusals: exit 2 before anything launches, naming the key ----------------------------------

def _config(*extra):
    from training import load_train_config

    return load_train_config(None, ["data.path=/nonexistent", "launch.backend=torch", "launch.num_proc=2",
                                    "train.batch_size=16", "model.hidden=[16, 8]", "train.pipeline.stages=2", *extra])


@pytest.mark.parametrize("overrides,names", [
    (["launch.backend=horovod"], ["train.pipeline.stages=2 needs launch.backend=torch", "launch.backend=horovod"]),
    (["train.pipeline.microbatches=3"], ["train.pipeline.microbatches must divide train.batch_size=16"]),
    (["train.pipeline.microbatches=2", "train.pipeline.stages=4", "launch.num_proc=4"],
     ["train.pipeline.microbatches must be at least stages=4 with schedule=1f1b"]),
    (["train.pipeline.schedule=interleaved_1f1b", "train.pipeline.stages_per_rank=2", "model.hidden=[8, 8, 8]",
      "train.pipeline.microbatches=3", "train.batch_size=6"],
     ["train.pipeline.microbatches must be a multiple of stages=2 with schedule=interleaved_1f1b"]),
    (["train.pipeline.schedule=interleaved_1f1b"], ["train.pipeline.stages_per_rank must be >= 2"]),
    (["launch.num_proc=3"], ["launch.num_proc=3 is not a multiple of train.pipeline.stages=2"]),
    (["train.parallel=fsdp"], ["train.parallel=fsdp with train.pipeline.stages=2", "set train.parallel=ddp"]),
    (["model.hidden=[16]", "train.pipeline.stages=4", "launch.num_proc=4", "train.pipeline.microbatches=4"],
     ["model.hidden=[16] gives 2 layer(s), fewer than the 4 pipeline stage(s)"]),
    (["train.pipeline.split=[[body.0], [body.2], [body.4]]"],
     ["train.pipeline.split must be 'auto', 'even' or 2 non-empty lists of module names"]),
    # On the driver, not after the launch: the built-in model's blocks are known from its keys.
    (["model.hidden=[8, 8]", "train.pipeline.split=[[body.0], [body.4, body.2]]"],
     ["train.pipeline.split=[['body.0'], ['body.4', 'body.2']] must list every block of model mlp once, in order",
      "its blocks are ['body.0', 'body.2', 'body.4']"]),
], ids=["horovod", "batch-not-divisible", "too-few-microbatches-1f1b", "interleaved-rounds",
        "interleaved-one-stage-per-rank", "num_proc-not-multiple", "fsdp", "too-few-layers", "split-lists",
        "split-names"])
def test_combinations_that_cannot_run_are_refused_naming_the_key(overrides, names):
    with pytest.raises(ConfigError) as info:
        _config(*overrides)
    assert info.value.exit_code == EXIT_USAGE
    for name in names:
        assert name in str(info.value)


def test_one_stage_is_off_and_every_setting_of_it_is_accepted():
    from training.strategies import technique

    cfg = _config("train.pipeline.stages=1", "launch.num_proc=3", "train.pipeline.microbatches=5")
    assert technique(cfg.train) == "ddp"
    assert technique(_config().train) == "pipeline"


# --- the rank loop: whole runs, checkpoints across layouts, the exported model ------------------------

LAYOUT = {"train": [[160, 96], [256]], "val": [[70], [50]]}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    from tabular_data import write_dataset

    return write_dataset(str(tmp_path_factory.mktemp("pp") / "ds"), LAYOUT)


def _run_config(ds, out, *extra, layout="stages"):
    """SGD: a fresh optimizer's zero-gradient first step (multi-rank strategies start that way,
    one process does not) leaves it as if untouched, so one process is a fair reference."""
    from training import load_train_config

    launch = {"stages": ["launch.backend=torch", "launch.num_proc=2", "train.pipeline.stages=2",
                         "train.pipeline.microbatches=4"],
              "ddp": ["launch.backend=torch", "launch.num_proc=1"],
              "one process": ["launch.mode=in_process", "launch.num_proc=1", "launch.device=cpu"]}[layout]
    return load_train_config(None, [
        f"data.path={ds.uri}", f"output.model_path={out}/model", "train.batch_size=16", "train.lr=0.05",
        "train.optimizer=sgd", "train.log_every_steps=1", "train.epochs=2", "data.shuffle_buffer_rows=64",
        "data.reader=arrow", "model.hidden=[16, 8]", *launch, *extra])


def _train_ranks(cfg) -> dict:
    """A run's ranks through the rank loop; rank 0's result (steps, metrics, model)."""
    from training.plan import build_plan

    return _rank_0(run_calls(cfg.launch.num_proc, [(pipeline_ranks.train_rank, (build_plan(cfg),))])[0])


def _rank_0(outcomes) -> dict:
    results = values(outcomes)
    assert len({r["steps"] for r in results}) == 1  # equal steps on every rank
    return results[0]


def _step_losses(out) -> list[float]:
    with open(os.path.join(out, "model.run", "steps.jsonl")) as fh:
        return [json.loads(line)["loss"] for line in fh if line.strip()]


def _weights(out) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "model", "model.safetensors"))


@pytest.fixture(scope="module")
def one_process(dataset, tmp_path_factory):
    from training import train

    out = tmp_path_factory.mktemp("one")
    return out, train(_run_config(dataset, out, layout="one process"))


@pytest.fixture(scope="module")
def staged_runs(two_ranks, dataset, one_process, tmp_path_factory):
    """The rank loop on 2 stages, both runs on the session's two ranks: the whole 2-epoch run, and epoch 2
    resumed on stages from the one-process run's epoch-1 checkpoint. Each: (its output, its
    ranks' outcomes)."""
    from training.plan import build_plan

    alone_out, alone = one_process
    whole, resumed = tmp_path_factory.mktemp("staged"), tmp_path_factory.mktemp("staged-resumed")
    copy_checkpoint(alone.run_dir, alone.steps_per_epoch, resumed / "ck")
    plans = [build_plan(_run_config(dataset, whole)),
             build_plan(_run_config(dataset, resumed, f"checkpoint.path={resumed}/ck"))]
    outcomes = two_ranks.run_calls([(pipeline_ranks.train_rank, (plan,)) for plan in plans])
    return {"whole": (whole, outcomes[0]), "resumed": (resumed, outcomes[1])}


def test_a_run_on_two_stages_equals_one_process_and_publishes_the_same_model(dataset, one_process, staged_runs):
    from training import load_model

    alone_out, alone = one_process
    out, outcomes = staged_runs["whole"]
    staged = _rank_0(outcomes)
    assert staged["steps"] == 2 * alone.steps_per_epoch and staged["steps_per_epoch"] == alone.steps_per_epoch
    np.testing.assert_allclose(_step_losses(out), _step_losses(alone_out), rtol=1e-5)
    _assert_close_states(_weights(out), _weights(alone_out), tol=1e-5)
    for key in ("train_loss", "val_loss", "val_accuracy"):
        assert staged["metrics"][-1][key] == pytest.approx(alone.final[key], rel=1e-5)
    # metrics.jsonl records each epoch's measured bubble, one fraction per stage.
    with open(out / "model.run" / "metrics.jsonl") as fh:
        bubbles = [json.loads(line)["pipeline_bubble_fraction"] for line in fh if line.strip()]
    assert len(bubbles) == 2 and all(len(b) == 2 and all(0 <= f < 1 for f in b) for b in bubbles)
    assert "bubble per stage" in (out / "model.run" / "report.html").read_text()  # the report's epoch table
    # The published model is the plain model: load_model reads it and predicts as rank 0 did.
    model = load_model(str(out / "model"))
    probs = model.predict(dataset.raw["val"].iloc[staged["reference"]["rows"]])
    np.testing.assert_allclose(probs, np.array(staged["reference"]["predictions"]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("first,second", [("stages", "one process"), ("one process", "stages"), ("stages", "ddp")])
def test_a_checkpoint_resumes_across_layouts(dataset, one_process, staged_runs, tmp_path, first, second):
    """The checkpoint one layout's uninterrupted run wrote at the end of epoch 1 (what a run of
    that one epoch writes; see resume_from.py), resumed for epoch 2 in the other: the
    uninterrupted run's weights."""
    from training import train

    alone_out, alone = one_process
    if second == "stages":  # from the one-process run's checkpoint, in staged_runs' launch
        out, outcomes = staged_runs["resumed"]
        resumed = _rank_0(outcomes)
    else:
        whole, outcomes = staged_runs["whole"]
        _rank_0(outcomes)  # the staged run that wrote the checkpoint did finish
        copy_checkpoint(whole / "model.run", alone.steps_per_epoch, tmp_path / "ck")
        out = tmp_path / "second"
        cfg = _run_config(dataset, out, f"checkpoint.path={tmp_path}/ck", layout=second)
        resumed = train(cfg).ranks[0] if second == "one process" else _train_ranks(cfg)
    assert resumed["resumed_step"] == alone.steps_per_epoch
    assert resumed["resumed_from"].endswith(f"step-{alone.steps_per_epoch:09d}")
    _assert_close_states(_weights(out), _weights(alone_out), tol=1e-5)
