# Databricks notebook source
# MAGIC %md
# MAGIC # shardtrain on Databricks: shard, train, load, predict
# MAGIC
# MAGIC Runs on the notebook's own `spark` session (the `spark:` section of a config is then ignored), classic
# MAGIC (a dedicated cluster) or Spark Connect (standard access mode, serverless; training there needs
# MAGIC `backend` torch, which `auto` picks where Horovod is not installed, or torch_tasks: the same ranks
# MAGIC inside Spark's own Python workers, whose re-runs start in seconds):
# MAGIC
# MAGIC 1. raw data: a small generated dataset, or your own through a shard config (the `shard_config` widget),
# MAGIC 2. the shard job: balanced Parquet shards + manifest under `<workdir>/shards` (by default a Unity Catalog
# MAGIC    volume, `/Volumes/<catalog>/<schema>/<volume>/work`, which every compute type mounts),
# MAGIC 3. training on the cluster's executors (`num_proc` ranks; Horovod where installed, else TorchDistributor),
# MAGIC 4. the model at `<workdir>/model`, loaded back, predicting on a few raw rows.
# MAGIC
# MAGIC Install shardtrain on the cluster first (a cluster library, or `%pip install` of the wheel `make wheel`
# MAGIC builds; see the Databricks guide, docs/guides/databricks.md). On Databricks Runtime 16+ ML (no Horovod) it trains
# MAGIC with the torch backend and the arrow reader by itself.

# COMMAND ----------

# The paths and sizes, as widgets: set them at the top of the notebook, or pass them to a job run.
import os
import tempfile

dbutils.widgets.text("workdir", "", "Work folder (URI; empty: <volume>/work)")
dbutils.widgets.text("volume", "main.default.shardtrain", "Unity Catalog volume (catalog.schema.volume)")
dbutils.widgets.text("shard_config", "", "Shard config YAML (empty: generated data)")
dbutils.widgets.text("train_config", "", "Train config YAML (empty: defaults)")
dbutils.widgets.text("rows", "20000", "Rows to generate")
dbutils.widgets.text("num_proc", "2", "Training ranks (launch.num_proc)")
dbutils.widgets.text("epochs", "2", "Epochs")
dbutils.widgets.dropdown("backend", "auto", ["auto", "horovod", "torch", "torch_tasks"], "launch.backend")
dbutils.widgets.text("registered_model", "", "Register as (e.g. main.default.shardtrain_demo; empty: no)")
dbutils.widgets.text("alias", "champion", "Alias of the registered version")

workdir = dbutils.widgets.get("workdir").rstrip("/")
volume_path = "/Volumes/" + dbutils.widgets.get("volume").strip().replace(".", "/")
shard_config_path = dbutils.widgets.get("shard_config").strip()
train_config_path = dbutils.widgets.get("train_config").strip()
rows = int(dbutils.widgets.get("rows"))
num_proc = int(dbutils.widgets.get("num_proc"))
epochs = int(dbutils.widgets.get("epochs"))
backend = dbutils.widgets.get("backend")
registered_model = dbutils.widgets.get("registered_model").strip()
alias = dbutils.widgets.get("alias").strip()

if not workdir:
    if os.path.isdir(volume_path):  # the volume (CREATE VOLUME main.default.shardtrain): any compute type
        workdir = f"{volume_path}/work"
    elif os.path.isdir("/dbfs"):  # a dedicated cluster with the DBFS mount, and no such volume
        workdir = "dbfs:/tmp/shardtrain"
    else:  # neither (not on Databricks): this machine's temporary folder, for a local Spark
        workdir = os.path.join(tempfile.gettempdir(), "shardtrain")
print("work folder:", workdir)

raw_uri, shards_uri, model_uri = f"{workdir}/raw", f"{workdir}/shards", f"{workdir}/model"

# COMMAND ----------

# MAGIC %md
# MAGIC ## Raw data and the shard config
# MAGIC With no `shard_config`, a synthetic dataset (numeric and categorical columns with nulls, an 8-value
# MAGIC array, a learnable binary label) is generated at `<workdir>/raw`. With one, its `sources`, `features`,
# MAGIC `label` and `split` are used as they are; only `output.path` is set here.

# COMMAND ----------

from pipelines import generate_dataset
from pipelines.shard_config import load_shard_config

if shard_config_path:
    shard_cfg = load_shard_config(shard_config_path, [f"output.path={shards_uri}", "output.mode=overwrite"])
else:
    generated = generate_dataset(raw_uri, rows=rows, array_shape=[8], spark=spark, mode="overwrite")
    shard_cfg = load_shard_config(defaults=generated.shard_config(shards_uri, output={"mode": "overwrite"}))
print("sources:", {name: source.table or source.path for name, source in shard_cfg.sources.items()})

# COMMAND ----------

# MAGIC %md
# MAGIC ## Shard, then inspect

# COMMAND ----------

from pipelines import describe_dataset, shard_dataset

sharded = shard_dataset(shard_cfg, spark=spark)
print(describe_dataset(sharded.uri))

# COMMAND ----------

# MAGIC %md
# MAGIC ## Train
# MAGIC `num_proc` ranks run as Spark tasks on the executors: keep it at most the cluster's task slots
# MAGIC (workers x cores, or GPUs with `spark.task.resource.gpu.amount`).

# COMMAND ----------

from training import load_train_config, train

train_overrides = [f"data.path={sharded.uri}", f"output.model_path={model_uri}", "output.mode=overwrite",
                   f"launch.num_proc={num_proc}", f"train.epochs={epochs}",
                   "checkpoint.resume=never"]  # each run of the notebook trains from scratch
if backend != "auto":
    train_overrides.append(f"launch.backend={backend}")
if registered_model:
    # The run goes to the workspace's MLflow (this notebook's experiment); its pyfunc model becomes a new
    # version of registered_model (Unity Catalog: catalog.schema.name), and the alias moves to it:
    # then `models:/<registered_model>@<alias>` scores it (`shardtrain score`, mlflow.pyfunc.spark_udf).
    train_overrides += [f"tracking.mlflow.registered_model={registered_model}", f"tracking.mlflow.alias={alias}"]
if train_config_path:
    train_cfg = load_train_config(train_config_path, train_overrides)
else:
    train_cfg = load_train_config(None, train_overrides, defaults={"model": {"hidden": [64, 32]}})
trained = train(train_cfg, spark=spark)
print(trained.summary())

# COMMAND ----------

# MAGIC %md
# MAGIC ## Load the model and predict on raw rows
# MAGIC The model takes the raw feature columns (it applies the shard job's imputation, scaling and
# MAGIC vocabularies itself), so the rows come from the sources, through the config's `query` if it has one.

# COMMAND ----------

from common.sources import read_sources
from training import load_model

model = load_model(trained.model_uri)
read_sources(spark, shard_cfg.sources)  # each source (a path or a table) as a view named like it, as the shard job reads it
table = spark.sql(shard_cfg.query) if shard_cfg.query else spark.table(next(iter(shard_cfg.sources)))
sample = table.limit(8).toPandas()  # a handful of rows to look at; batch scoring belongs in a Spark job

scores = model.predict(sample)
shown = sample[[c for c in ("id", shard_cfg.label.column) if c and c in sample.columns]].copy()
if model.task == "classification":
    shown["predicted_class"] = scores.argmax(axis=1)
    shown["probability"] = scores.max(axis=1).round(4)
else:
    shown["predicted"] = scores.round(4)
predictions = spark.createDataFrame(shown)
display(predictions)
