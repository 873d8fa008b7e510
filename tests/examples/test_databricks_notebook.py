"""examples/databricks/shardtrain_notebook.py, run as Databricks runs it: its Python cells in
order, in one namespace, on a SparkSession named ``spark``, with ``dbutils.widgets`` and
``display`` as the only other things the notebook gets. Markdown and magic cells are skipped.
"""

from __future__ import annotations

import os

import pytest

from examples_env import EXAMPLES

NOTEBOOK = os.path.join(EXAMPLES, "databricks", "shardtrain_notebook.py")
HEADER = "# Databricks notebook source"
SEPARATOR = "\n\n# COMMAND ----------\n\n"


def notebook_cells(path: str = NOTEBOOK) -> list[str]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert text.startswith(HEADER + "\n"), f"{path}: the first line must be {HEADER!r}"
    return text[len(HEADER) + 1:].split(SEPARATOR)


def is_magic(cell: str) -> bool:
    """Markdown (%md) and other magic cells: every line is a '# MAGIC' line."""
    lines = [line for line in cell.strip().splitlines() if line.strip()]
    return bool(lines) and all(line.startswith("# MAGIC") for line in lines)


class Widgets:
    """dbutils.widgets as a notebook sees it: each widget declares its default; ``get`` returns
    what the user typed into it (``values``) or else that default."""

    def __init__(self, values: dict[str, str]):
        self.values = dict(values)
        self.defaults: dict[str, str] = {}

    def text(self, name: str, defaultValue: str, label: str | None = None) -> None:
        self.defaults[name] = defaultValue

    def dropdown(self, name: str, defaultValue: str, choices: list[str], label: str | None = None) -> None:
        assert defaultValue in choices, f"widget {name}: default {defaultValue!r} is not one of {choices}"
        if name in self.values:
            assert self.values[name] in choices, f"widget {name}: {self.values[name]!r} is not one of {choices}"
        self.defaults[name] = defaultValue

    def get(self, name: str) -> str:
        if name not in self.defaults:
            raise ValueError(f"InputWidgetNotDefined: no widget named {name!r}")  # as dbutils does
        return self.values.get(name, self.defaults[name])


class DBUtils:
    def __init__(self, values: dict[str, str]):
        self.widgets = Widgets(values)


def test_the_notebook_format_is_databricks_source():
    cells = notebook_cells()
    assert len(cells) > 4
    assert is_magic(cells[0]) and "%md" in cells[0], "the first cell is the notebook's markdown title"
    for cell in cells:
        assert "# COMMAND" not in cell, "a cell separator must stand alone with a blank line on each side"
        compile(cell, NOTEBOOK, "exec")


@pytest.mark.spark
@pytest.mark.horovod
@pytest.mark.parametrize("backend", ["auto", "torch"])  # auto: Horovod here; torch: what DBR 16+ ML runs
def test_the_notebook_runs_end_to_end(spark, tmp_path, backend):
    from common.storage import MARKER
    from training import load_model

    # What a user types into the widgets: a work folder, fewer rows and one epoch (kept small for
    # the test), the backend; num_proc stays at its default of 2 ranks.
    dbutils = DBUtils({"workdir": str(tmp_path / "shardtrain"), "rows": "4000", "epochs": "1", "backend": backend})
    shown = []
    namespace = {"spark": spark, "dbutils": dbutils, "display": shown.append}
    ran = 0
    for number, cell in enumerate(notebook_cells(), start=1):
        if is_magic(cell):
            continue
        exec(compile(cell, f"{NOTEBOOK} (cell {number})", "exec"), namespace)
        ran += 1
    assert ran >= 5

    assert dbutils.widgets.defaults["num_proc"] == "2"
    model_dir = tmp_path / "shardtrain" / "model"
    assert (model_dir / MARKER).is_file(), "the model was not published"
    assert namespace["trained"].world_size == 2
    assert namespace["train_cfg"].launch.backend == ("torch" if backend == "torch" else "horovod")
    model = load_model(str(model_dir))
    assert model.task == "classification"

    assert namespace["scores"].shape == (8, 2), "class probabilities for the 8 sample rows"
    assert len(shown) == 1, "the notebook displays one table"
    table = shown[0].toPandas()
    assert list(table.columns) == ["id", "label", "predicted_class", "probability"]
    assert len(table) == 8
    assert table["predicted_class"].isin([0, 1]).all() and table["probability"].between(0.5, 1.0).all()

