"""A built-in model's shape as the driver knows it before any rank builds it: its parameters, and
whether their training state can fit the memory a rank gets; and the names of its pipeline blocks,
so that an explicit ``train.pipeline.split`` is checked before launch. Both come from the config
and the manifest's feature spec by the same arithmetic as the constructors (``training.models``),
which the tests check against the built models.

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
from typing import Callable

from common.features.categorical import RESERVED_INDICES
from common.errors import ConfigError
from common.tasks import label_task
from training.launchers import launcher_for
from training.strategies import model_shards

# The largest single machines sold (24 TiB of memory): no rank anywhere gets more.
LARGEST_HOST_BYTES = 24 << 40
_FP32 = 4
# What rank_memory reads of a Spark application.
EXECUTOR_SETTINGS = ("spark.executor.pyspark.memory", "spark.executor.cores", "spark.task.cpus")
_OPTIMIZER_STATE = {"adamw": 2 * _FP32, "sgd": _FP32}  # AdamW: two moments; SGD: the momentum buffer


def parameter_count(model_cfg, feature_spec: dict, label_spec: dict) -> int | None:
    """The built-in model's parameters for this dataset; None for a plug-in model."""
    model = _BUILT_IN.get(model_cfg.name)
    return None if model is None else model.parameters(_arguments(model_cfg), _Data.of(feature_spec, label_spec))


def block_names(model_cfg) -> list[str] | None:
    """The built-in model's pipeline blocks (``pipeline_block_names()``: what an explicit
    ``train.pipeline.split`` lists), in order; None for a plug-in model."""
    model = _BUILT_IN.get(model_cfg.name)
    return None if model is None else model.blocks(_arguments(model_cfg))


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
    raise ConfigError(f"{_BUILT_IN[cfg.model.name].size_keys(cfg.model)} makes a {cfg.model.name} of {params:,} "
                      f"parameters: its weights, gradients and {t.optimizer} state alone need {_size(need)} per rank, "
                      f"more than the {_size(have)} a rank gets ({source}); make the model smaller, or shard it over "
                      "more ranks (train.parallel=fsdp, train.pipeline.stages)")


# --- the built-in models, each by its constructor's arithmetic (training.models) ------------------

@dataclass(frozen=True)
class _Data:
    """What a built-in model's size takes from the dataset: its feature spec and label, counted."""

    numeric: int
    vocab_sizes: list[int]
    array_widths: list[int]
    out: int  # outputs: the classes, or 1 value

    @classmethod
    def of(cls, feature_spec: dict, label_spec: dict) -> "_Data":
        return cls(numeric=len(feature_spec.get("numeric", [])),
                   vocab_sizes=[int(c.get("num_embeddings", len(c["vocab"]) + RESERVED_INDICES))
                                for c in feature_spec.get("categorical", [])],
                   array_widths=[math.prod(a["shape"]) for a in feature_spec.get("arrays", [])],
                   out=label_task(label_spec["task"]).output_width(label_spec.get("num_classes")))


def _arguments(model_cfg) -> dict:
    """The model keys the arithmetic reads, with ``model.kwargs``' overrides (as the constructors take them)."""
    return {"hidden": model_cfg.hidden, "embedding_dim": model_cfg.embedding_dim, "dropout": model_cfg.dropout,
            "layers": model_cfg.layers, "d_model": model_cfg.d_model, "ffn_width": None, **model_cfg.kwargs}


def _mlp_parameters(args: dict, data: _Data) -> int:
    dims = [args["embedding_dim"] or min(16, (size + 1) // 2) for size in data.vocab_sizes]
    count = sum(size * dim for size, dim in zip(data.vocab_sizes, dims))
    width = data.numeric + sum(dims) + sum(data.array_widths)
    for size in [*args["hidden"], data.out]:
        count, width = count + width * size + size, size
    return count


def _mlp_blocks(args: dict) -> list[str]:
    per_layer = 3 if args["dropout"] else 2  # Linear, ReLU (, Dropout)
    return [f"body.{i * per_layer}" for i in range(len(args["hidden"]) + 1)]


def _ft_parameters(args: dict, data: _Data) -> int:
    d = args["d_model"]
    ffn = args["ffn_width"] or 2 * d
    tokenizer = d + 2 * data.numeric * d + sum(data.vocab_sizes) * d + sum(w * d + d for w in data.array_widths)
    block = 2 * 2 * d + 3 * d * d + (d * d + d) + (d * ffn + ffn) + (ffn * d + d)
    head = 2 * d + d * data.out + data.out
    return tokenizer + args["layers"] * block + head


def _ft_blocks(args: dict) -> list[str]:
    return [f"blocks.{i}" for i in range(args["layers"])]


@dataclass(frozen=True)
class _BuiltIn:
    parameters: Callable[[dict, _Data], int]
    blocks: Callable[[dict], list[str]]
    size_keys: Callable[[object], str]  # the keys that size it, as a refusal names them


# model.name -> its shape; a plug-in model is not here (its size is known once a rank builds it).
_BUILT_IN = {
    "mlp": _BuiltIn(_mlp_parameters, _mlp_blocks, lambda m: f"model.hidden={m.hidden}"),
    "ft_transformer": _BuiltIn(_ft_parameters, _ft_blocks,
                               lambda m: f"model.d_model={m.d_model}, model.layers={m.layers}"),
}


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


__all__ = ["EXECUTOR_SETTINGS", "LARGEST_HOST_BYTES", "block_names", "check_model_fits", "parameter_count",
           "rank_memory"]
