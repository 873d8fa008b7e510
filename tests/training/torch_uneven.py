"""The uneven two-rank dataset and the plain 2-epoch torch run (TorchDistributor, arrow reader) that
test_torch_backend.py and test_torchrun.py both hold other runs to: the same layout, settings and
seed in both files, so the session launches it once (tests/training/conftest.py: ``uneven_dataset``,
``uneven_torch_run``) instead of once per file."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))
# Files of uneven row groups (one empty), so the ranks' row ranges cut through files and row groups.
UNEVEN = {"train": [[700, 301], [13], [900, 111, 2], [0], [455]], "val": [[190], [77]]}
# What every 2-rank run of the two files sets; each run adds its epochs, reader and backend.
SETTINGS = ("launch.start_timeout=120", f"launch.env.PYTHONPATH={HERE}", "train.batch_size=32", "train.lr=0.005",
            "train.log_every_steps=10", "data.shuffle_buffer_rows=200", "model.hidden=[32]")
# The shared run: two epochs (the resume tests copy its epoch-1 checkpoint) on the arrow reader.
TORCH_RUN = ("train.epochs=2", "data.reader=arrow", "launch.backend=torch")


def torch_config(dataset, out, *extra: str):
    """A 2-rank config of ``dataset`` publishing at ``<out>/model``: SETTINGS, then ``extra``."""
    from train_configs import train_config

    return train_config(dataset, f"{out}/model", *SETTINGS, *extra, ranks=2)
