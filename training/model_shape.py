"""A built-in model's size as the driver knows it before any rank builds it: its parameters (from
the config and the manifest's feature spec by its spec's arithmetic, ``training.model_specs``,
the same as its constructor's, which the tests check against the built models), and whether their
training state can fit the memory a rank gets.

The memory check: a width inside the config's ceilings (``model.d_model=1048576``,
``model.hidden=[1048576, 1048576]``) can still ask for terabytes, which a rank would otherwise
find out minutes later as an allocation failure or the kernel's OOM kill, and a scheduler would
retry. Refused here: exit 2 naming the keys that size the model.

Counted: the built-in models' parameters times what each costs in training (fp32 weights
and gradients, and the optimizer's state), divided among the ranks that shard it (FSDP, pipeline
stages). Not counted: activations, the loader's buffers, the published copy. So the estimate is
a lower bound and a refusal is never a guess. A plug-in model's size is unknown until it is
built: not checked.

The memory a rank gets: the host's, shared by the ranks this host runs (in-process, torchrun,
local-mode Spark); on a Spark cluster, ``spark.executor.pyspark.memory`` per task where it is set
(Spark caps each Python worker at it), else the largest machine there is (``LARGEST_HOST_BYTES``):
the driver cannot see an executor's memory, and a cap it guessed would refuse models that fit.

Driver-only; imports neither torch nor Spark.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from common.features.arrays import Arrays
from common.features.categorical import RESERVED_INDICES, Categorical
from common.features.numeric import Numeric
from common.features.text import Text
from common.errors import ConfigError
from common.tasks import label_task
from training.launchers import launcher_for
from training.model_specs import model_spec
from training.model_specs.image_inputs import IMAGES, image_records
from training.strategies import model_shards

# The largest single machines sold (24 TiB of memory): no rank anywhere gets more.
LARGEST_HOST_BYTES = 24 << 40
_FP32 = 4
# What rank_memory reads of a Spark application.
EXECUTOR_SETTINGS = ("spark.executor.pyspark.memory", "spark.executor.cores", "spark.task.cpus")
_OPTIMIZER_STATE = {"adamw": 2 * _FP32, "sgd": _FP32}  # AdamW: two moments; SGD: the momentum buffer


def parameter_count(model_cfg, feature_spec: dict, label_spec: dict) -> int | None:
    """The built-in model's parameters for this dataset; None for a plug-in model."""
    return model_spec(model_cfg.name).parameters(model_cfg, _Data.of(feature_spec, label_spec))


def check_model_fits(cfg, feature_spec: dict, label_spec: dict, rank_memory: tuple[int, str]) -> None:
    """Exit 2 where the model's weights, gradients and optimizer state alone need more than
    ``rank_memory`` (bytes, and where that figure comes from) on one rank."""
    params = parameter_count(cfg.model, feature_spec, label_spec)
    if params is None:
        return
    t = cfg.train
    need = params * (2 * _FP32 + _OPTIMIZER_STATE[t.optimizer]) // max(1, model_shards(cfg))
    have, source = rank_memory
    if need <= have:
        return
    raise ConfigError(f"{model_spec(cfg.model.name).size_keys(cfg.model)} makes a {cfg.model.name} of {params:,} "
                      f"parameters: its weights, gradients and {t.optimizer} state alone need {_size(need)} per rank, "
                      f"more than the {_size(have)} a rank gets ({source}); make the model smaller, or shard it over "
                      "more ranks (train.parallel=fsdp, train.pipeline.stages)")


@dataclass(frozen=True)
class _Data:
    """What a built-in model's size takes from the dataset (its spec's ``parameters``): its feature
    spec and label, counted."""

    numeric: int
    vocab_sizes: list[int]
    array_widths: list[int]
    out: int  # outputs: the classes, or 1 value
    image_channels: tuple[int, ...] = ()  # each image feature's channels
    text_vocab_sizes: tuple[int, ...] = ()  # each text feature's tokenizer vocabulary
    text_max_tokens: tuple[int, ...] = ()  # and its max_tokens (the FT-Transformer's position rows)

    @classmethod
    def of(cls, feature_spec: dict, label_spec: dict) -> "_Data":
        return cls(numeric=len(feature_spec.get(Numeric.name, [])),
                   vocab_sizes=[int(c.get("num_embeddings", len(c["vocab"]) + RESERVED_INDICES))
                                for c in feature_spec.get(Categorical.name, [])],
                   array_widths=[math.prod(a["shape"]) for a in feature_spec.get(Arrays.name, [])],
                   out=label_task(label_spec["task"]).output_width(label_spec.get("num_classes")),
                   image_channels=tuple(r["channels"] for r in image_records(feature_spec, IMAGES)),
                   text_vocab_sizes=tuple(int(t["vocab_size"]) for t in feature_spec.get(Text.name, [])),
                   text_max_tokens=tuple(int(t["max_tokens"]) for t in feature_spec.get(Text.name, [])))


def rank_memory(launch_cfg, master: str | None, executor_settings: dict[str, str | None]) -> tuple[int, str]:
    """(bytes, where the figure comes from) that one rank can use at most: see the module docstring.
    ``master`` is the Spark master (None without Spark); ``executor_settings`` the application's
    ``EXECUTOR_SETTINGS``."""
    local = master is None or master == "local" or master.startswith("local[")
    if local:
        ranks = launcher_for(launch_cfg).ranks_on_this_host(launch_cfg)
        return _host_bytes() // max(1, ranks), f"this host's {_size(_host_bytes())} shared by {ranks} rank(s)"
    pyspark = executor_settings.get("spark.executor.pyspark.memory")
    if pyspark:
        cores = int(executor_settings.get("spark.executor.cores") or 1)
        per_task = int(executor_settings.get("spark.task.cpus") or 1)
        tasks = max(1, cores // per_task)
        return _spark_bytes(pyspark) // tasks, f"spark.executor.pyspark.memory={pyspark} shared by {tasks} task(s)"
    return LARGEST_HOST_BYTES, "no machine has more; set spark.executor.pyspark.memory for a tighter check"


def _host_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}


def _spark_bytes(text: str) -> int:
    """A Spark size setting (``4g``, ``512m``; a bare number is MiB, as Spark reads memory settings)."""
    value = str(text).strip().lower().removesuffix("b")
    if value and value[-1] in _UNITS:
        return int(float(value[:-1]) * _UNITS[value[-1]])
    return int(float(value) * _UNITS["m"])


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


__all__ = ["EXECUTOR_SETTINGS", "LARGEST_HOST_BYTES", "check_model_fits", "parameter_count", "rank_memory"]
