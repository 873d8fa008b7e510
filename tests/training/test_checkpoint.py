"""The checkpoint manager: its save policy, atomic writes keeping the last ``keep``, and falling
back past a checkpoint that is incomplete (no marker) or corrupt (bytes changed)."""

import os

import pytest
import torch

from training.checkpoint import CheckpointManager


def _state(step):
    return lambda: {"model": {"w": torch.full((3,), float(step))}, "history": [{"epoch": 1, "loss": 0.5}]}


def test_policy():
    m = CheckpointManager("/unused", steps_per_epoch=10, every_steps=4, every_epochs=2)
    due = [s for s in range(1, 41) if m.should_save(s)]
    assert due == [4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    m = CheckpointManager("/unused", steps_per_epoch=10, every_steps=None, every_epochs=1)
    assert [s for s in range(1, 31) if m.should_save(s)] == [10, 20, 30]
    assert m.should_save(7, last=True)


@pytest.mark.parametrize("every_steps, every_epochs, due", [
    (None, 1, [7, 14]),  # epoch ends only
    (None, 2, [14]),
    (3, None, [3, 6, 9, 12, 15, 18]),  # multiples of 3 only, not the epoch ends 7 and 14
    (5, 2, [5, 10, 14, 15, 20]),  # the union: neither setting hides the other
])
def test_every_steps_and_every_epochs_are_independent(every_steps, every_epochs, due):
    m = CheckpointManager("/unused", steps_per_epoch=7, every_steps=every_steps, every_epochs=every_epochs)
    assert [s for s in range(1, 21) if m.should_save(s)] == due
    assert m.should_save(20, last=True) and m.should_save(19, last=True)  # the last step always saves


def test_keep_and_restore_latest(tmp_path):
    m = CheckpointManager(str(tmp_path / "ck"), steps_per_epoch=5, every_steps=1, keep=2)
    for step in range(1, 5):
        m.save(step, 0, _state(step))
    assert sorted(os.listdir(tmp_path / "ck")) == ["step-000000003", "step-000000004"]
    restored = m.restore_latest()
    assert restored.step == 4 and restored.state["step"] == 4 and not restored.problems
    assert torch.equal(restored.state["model"]["w"], torch.full((3,), 4.0))


def test_corrupt_and_incomplete_checkpoints_fall_back(tmp_path):
    m = CheckpointManager(str(tmp_path / "ck"), steps_per_epoch=5, every_steps=1, keep=3)
    for step in range(1, 4):
        m.save(step, 0, _state(step))
    with open(tmp_path / "ck/step-000000003/state.pt", "r+b") as fh:  # bit rot in the newest
        fh.seek(20)
        fh.write(b"garbage")
    os.remove(tmp_path / "ck/step-000000002/_COMMITTED")  # a save that never finished
    restored = m.restore_latest()
    assert restored.step == 1 and torch.equal(restored.state["model"]["w"], torch.ones(3))
    assert len(restored.problems) == 2
    assert "corrupt" in restored.problems[0] and "step-000000003" in restored.problems[0]
    assert "incomplete" in restored.problems[1]


def test_nothing_to_restore(tmp_path):
    assert CheckpointManager(str(tmp_path / "none"), steps_per_epoch=5).restore_latest() is None
