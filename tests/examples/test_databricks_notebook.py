"""examples/databricks/shardtrain_notebook.py, run as Databricks runs it: its Python cells in
order, in one namespace, on a SparkSession named ``spark``, with ``dbutils.widgets`` and
``display`` as the only other things the notebook gets. Markdown and magic cells are skipped.

The same notebook, unchanged, runs on a classic session (a dedicated cluster, as on Databricks
Runtime 16+ ML: the torch backend chosen in its widget, and a shard config whose source is a
catalog table, ``sources.raw.table``) and on a Spark Connect one (standard access mode and
serverless; pyspark 4's local Connect server in a child process, tests/connect_process.py), where
the widget's ``auto`` trains with the torch backend. One run each: what the backends themselves do
(Horovod where ``auto`` finds it, torch on classic Spark) is tested in tests/training.
"""

from __future__ import annotations

import os
import sys

import pytest

from examples_env import EXAMPLES

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from connect_process import ConnectProcess, connect_available  # noqa: E402

NOTEBOOK = os.path.join(EXAMPLES, "databricks", "shardtrain_notebook.py")
HEADER = "# Databricks notebook source"
SEPARATOR = "\n\n# COMMAND ----------\n\n"
ROWS = 1000  # 800 train rows: one step of the default batch (256) on each of 2 ranks


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


def run_notebook(spark, values: dict[str, str]) -> dict:
    """The notebook's code cells in order on ``spark``, with ``values`` typed into its widgets; what
    it left behind (module-level: the Spark Connect process runs it too)."""
    dbutils = DBUtils(values)
    shown = []
    namespace = {"spark": spark, "dbutils": dbutils, "display": shown.append}
    ran = 0
    for number, cell in enumerate(notebook_cells(), start=1):
        if is_magic(cell):
            continue
        exec(compile(cell, f"{NOTEBOOK} (cell {number})", "exec"), namespace)
        ran += 1
    return {"ran": ran, "defaults": dbutils.widgets.defaults, "workdir": namespace["workdir"],
            "world_size": namespace["trained"].world_size, "backend": namespace["train_cfg"].launch.backend,
            "train_overrides": namespace["train_overrides"],
            "scores_shape": namespace["scores"].shape, "shown": [frame.toPandas() for frame in shown]}


@pytest.fixture(scope="module")
def connect():
    process = ConnectProcess([os.path.dirname(os.path.abspath(__file__))], via="env")  # SPARK_REMOTE=local[2]
    yield process
    process.close()


@pytest.mark.spark
@pytest.mark.ranks
@pytest.mark.parametrize("session,backend", [
    # torch: what DBR 16+ ML runs (no Horovod there); here, where Horovod is installed, the widget's
    # choice is what picks it. The pinned profile only: the Connect run carries the current one.
    pytest.param("classic", "torch"),
    # Spark Connect (standard access mode, serverless): auto is torch where Horovod is not installed.
    pytest.param("connect", "auto", marks=[pytest.mark.stack,
                                           pytest.mark.skipif(connect_available() is not None,
                                                              reason=connect_available() or "")]),
])
def test_the_notebook_runs_end_to_end(request, tmp_path, session, backend):
    from common.commit_marker import MARKER
    from training import load_model

    # What a user types into the widgets: a work folder, fewer rows and one epoch (kept small for
    # the test: one step of the default batch on each rank), the backend; num_proc stays at its
    # default of 2 ranks.
    values = {"workdir": str(tmp_path / "shardtrain"), "rows": str(ROWS), "epochs": "1", "backend": backend}
    if session == "classic":
        # A shard config whose source is a catalog table (sources.raw.table), as on Unity Catalog:
        # the notebook's last cell reads it as the shard job does.
        values["shard_config"] = _table_shard_config(request.getfixturevalue("spark"), tmp_path)
    if session == "connect":
        ran = request.getfixturevalue("connect").call("test_databricks_notebook:run_notebook", values=values)
    else:
        ran = run_notebook(request.getfixturevalue("spark"), values)
    assert ran["ran"] >= 5

    assert ran["defaults"]["num_proc"] == "2"
    model_dir = tmp_path / "shardtrain" / "model"
    assert (model_dir / MARKER).is_file(), "the model was not published"
    assert ran["world_size"] == 2
    assert ran["backend"] == "torch"
    # The widget's choice reaches the training config; auto leaves launch.backend to it.
    assert [o for o in ran["train_overrides"] if o.startswith("launch.backend=")] == \
        ([] if backend == "auto" else [f"launch.backend={backend}"])
    model = load_model(str(model_dir))
    assert model.task == "classification"

    assert ran["scores_shape"] == (8, 2), "class probabilities for the 8 sample rows"
    assert len(ran["shown"]) == 1, "the notebook displays one table"
    table = ran["shown"][0]
    assert list(table.columns) == ["id", "label", "predicted_class", "probability"]
    assert len(table) == 8
    assert table["predicted_class"].isin([0, 1]).all() and table["probability"].between(0.5, 1.0).all()


def _table_shard_config(spark, tmp_path) -> str:
    """Generated rows saved as a table in a database of the test's own (under ``tmp_path``); the
    path of a shard config that reads them with ``sources.raw.table``."""
    import uuid

    import yaml

    from pipelines import generate_dataset

    generated = generate_dataset(str(tmp_path / "raw"), rows=ROWS, array_shape=[8], spark=spark)
    database = f"shardtrain_notebook_{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE DATABASE {database} LOCATION 'file:{tmp_path / 'warehouse'}'")
    spark.read.parquet(generated.path).write.format("parquet").saveAsTable(f"{database}.raw")
    config = generated.shard_config("unused", output={"mode": "overwrite"})
    config["sources"] = {"raw": {"table": f"spark_catalog.{database}.raw"}}
    path = tmp_path / "shard.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_the_default_work_folder_is_the_volume_where_there_is_one(tmp_path):
    """The widget cell alone, with the work folder left empty: the volume when it is mounted; off
    Databricks (no /Volumes, no /dbfs) this machine's temporary folder, so the notebook still runs."""
    cell = notebook_cells()[1]
    assert 'dbutils.widgets.text("workdir", ""' in cell
    namespace = {"dbutils": DBUtils({})}
    exec(compile(cell, NOTEBOOK, "exec"), namespace)
    assert namespace["volume_path"] == "/Volumes/main/default/shardtrain"
    if os.path.isdir(namespace["volume_path"]):  # on Databricks, with the volume created
        assert namespace["workdir"] == "/Volumes/main/default/shardtrain/work"
    elif not os.path.isdir("/dbfs"):
        import tempfile

        assert namespace["workdir"] == os.path.join(tempfile.gettempdir(), "shardtrain")
    # Either way the same path resolves as the volume it is (common/storage.py).
    from common.storage import resolve

    assert resolve("dbfs:" + namespace["volume_path"] + "/work").path == namespace["volume_path"] + "/work"

