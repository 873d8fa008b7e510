"""A training launch's fixed cost: ``train()`` of one short epoch on local[N] with the torch backend
against a bare ``TorchDistributor(num_processes=2, local_mode=False).run(fn)`` running the same model
for the same number of steps, side by side in one Spark session; and the same ``train()`` with
``launch.backend=torch_tasks`` (the ranks inside the barrier tasks' Python workers, no torchrun).

    .venv/bin/python benchmarks/launch_overhead.py [--rows 4000] [--repeats 3] [--profile]

Setup (not timed): ``--rows`` generated rows (conf/shard.yaml's columns) sharded by the shard job
into a small dataset; the step count is what ``train()`` plans for it (``steps_per_epoch``).

- ``bare``: ``fn`` initialises the gloo process group, builds the same model (``build_model`` of the
  same config and feature spec), wraps it in DDP, reads its rank's shard files with pyarrow (the
  rows themselves are not decoded: random tensors of the batch's shape feed the steps) and runs
  ``steps_per_epoch`` optimizer steps; what a user's hand-written launch does at the least.
- ``train``: ``training.train`` of the same config: driver checks, the manifest and the writer lock,
  the progress server, the ranks (group, verified shard reading, the steps, validation), the
  checkpoint, the published model, the run report.
- ``tasks``: the same ``train()`` with ``launch.backend=torch_tasks``.

Each line also says ``cpu_s``, the CPU seconds the launch cost this process and everything it started
(Spark's JVM, its Python workers, torchrun and the ranks), read from a cpuacct cgroup of its own
(run as root; null elsewhere).

The three run ``--repeats`` times, interleaved (bare first), after one warm-up launch each that is not
counted (the first launch of a session pays for Spark's barrier-task path and the Python workers).
Then ``tasks_in_a_row``: the torch_tasks ``train()`` ``--repeats`` times back to back (what a
notebook's or a sweep's next launch costs: its ranks run in the workers the previous one left, torch
already imported). Prints one JSON line per launch, then the medians, ``train_vs_bare`` (train's
median / bare's; 1.0 = no fixed cost of ours), ``tasks_vs_bare`` and ``tasks_in_a_row_vs_bare``.
``--profile`` also prints where a ``train()`` spends its driver time
(cProfile, cumulative, top functions) and the rank-side phases from the ranks' log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def spark_session(master: str):
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    conf = {"spark.sql.shuffle.partitions": 4, "spark.default.parallelism": 4, "spark.ui.enabled": False,
            "spark.driver.memory": "2g"}
    return get_or_create_session(SparkConfig(master=master, app_name="launch-overhead", conf=conf), log_level="ERROR")


def make_dataset(spark, work: Path, rows: int) -> str:
    from common.config import from_dict
    from pipelines.generate import generate_dataset
    from pipelines.shard_config import ShardConfig
    from pipelines.shard_job import run_shard_job

    raw = generate_dataset(spark, str(work / "raw"), rows, seed=3, array_shape=[8], mode="overwrite")
    cfg = from_dict(ShardConfig, raw.shard_config(str(work / "shards"), output={"num_shards": 2, "mode": "overwrite"}))
    run_shard_job(spark, cfg)
    return str(work / "shards")


def train_config(data: str, model_path: Path, batch_size: int, extra: list[str]):
    """A fresh model path per launch: the run directory beside it holds no checkpoint to resume (a
    second train() into the same path resumes at its last step and trains nothing)."""
    from training import load_train_config

    return load_train_config(None, [f"data.path={data}", "data.reader=arrow", "launch.backend=torch",
                                    "launch.mode=spark", "launch.num_proc=2", "train.epochs=1",
                                    f"train.batch_size={batch_size}", "model.hidden=[64, 64]",
                                    f"output.model_path={model_path}", "output.mode=overwrite", *extra])


def bare_fn(model_cfg, feature_spec, label_spec, steps: int, batch_size: int, files: list[str]):
    """One rank of the bare launch (runs in each torchrun process)."""
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from training.model_specs import build_model
    from training.models import mlp_arguments

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    mine = files[rank::world]
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in mine)
    model = DistributedDataParallel(build_model(model_cfg, feature_spec, label_spec))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    args = mlp_arguments(feature_spec, label_spec.to_record(), model_cfg.hidden)
    for _ in range(steps):
        batch = {"numeric": torch.randn(batch_size, args["num_numeric"]),
                 "categorical": torch.stack([torch.randint(0, v, (batch_size,)) for v in args["vocab_sizes"]], dim=1)
                 if args["vocab_sizes"] else torch.zeros(batch_size, 0, dtype=torch.long)}
        for name, width in zip(args["array_names"], args["array_widths"]):
            batch[name] = torch.randn(batch_size, width)
        target = torch.randint(0, args["out_dim"], (batch_size,))
        loss = torch.nn.functional.cross_entropy(model(batch), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    dist.barrier()
    dist.destroy_process_group()
    return {"rank": rank, "rows": rows, "steps": steps}


def time_bare(plan, cfg) -> float:
    from pyspark.ml.torch.distributor import TorchDistributor

    files = plan_files(plan)
    start = time.perf_counter()
    TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        bare_fn, cfg.model, plan.feature_spec, plan.label_spec, plan.steps_per_epoch, cfg.train.batch_size, files)
    return time.perf_counter() - start


def plan_files(plan) -> list[str]:
    from common.dataset import read_manifest

    manifest = read_manifest(plan.dataset_uri)
    return [manifest.root.join(e.path).path for e in manifest.files(plan.config.data.train_split)]


class TreeCpu:
    """CPU seconds of this process and everything it starts (Spark's JVM, its Python workers,
    torchrun, the ranks; processes that ended included): a cgroup v1 ``cpuacct`` group of its own,
    made at start where this process may (root); ``None`` elsewhere."""

    def __init__(self):
        self.path = None
        base = "/sys/fs/cgroup/cpuacct"
        try:
            path = os.path.join(base, f"launch-overhead-{os.getpid()}")
            os.mkdir(path)
            with open(os.path.join(path, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))
            self.path = path
        except OSError:
            pass

    def seconds(self) -> float | None:
        if self.path is None:
            return None
        with open(os.path.join(self.path, "cpuacct.usage")) as fh:
            return int(fh.read()) / 1e9

    def close(self) -> None:
        """Back to the parent group; the group itself goes once its last process has ended."""
        if self.path is None:
            return
        with open(os.path.join(os.path.dirname(self.path), "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
        try:
            os.rmdir(self.path)
        except OSError:
            pass  # a worker still exiting: the kernel keeps the empty group; nothing else uses it


def time_train(cfg, spark, model_path: Path, backend: str = "torch") -> tuple[float, object]:
    import dataclasses

    from training import train

    cfg = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, model_path=str(model_path)),
                              launch=dataclasses.replace(cfg.launch, backend=backend))
    start = time.perf_counter()
    result = train(cfg, spark=spark)
    return time.perf_counter() - start, result


def profile_train(cfg, spark, model_path: Path, top: int) -> None:
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    seconds, _ = time_train(cfg, spark, model_path)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(top)
    print(f"--- driver cProfile of one train() ({seconds:.2f} s), cumulative ---\n{text.getvalue()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--set", action="append", default=[], help="extra key=value for train()'s config")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    if args.profile:  # the driver's and the ranks' log lines, with their times, on stderr: the phases
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="launch-overhead-"))
    cpu_meter = TreeCpu()  # before the JVM starts, so that it and its children are counted
    spark = spark_session(args.master)
    try:
        from training.plan import build_plan

        data = make_dataset(spark, work, args.rows)
        cfg = train_config(data, work / "model-plan", args.batch_size, args.set)
        plan = build_plan(cfg)
        common = {"rows": args.rows, "master": args.master, "steps": plan.steps_per_epoch,
                  "batch_size": args.batch_size, "load_average": round(os.getloadavg()[0], 1)}
        time_bare(plan, cfg)  # warm-up launches, not counted
        time_train(cfg, spark, work / "model-warm-up")
        time_train(cfg, spark, work / "model-warm-up-tasks", "torch_tasks")
        times = {"bare": [], "train": [], "tasks": [], "tasks_in_a_row": []}

        def measure(what: str, i: int) -> None:
            """One launch of kind ``what``: its seconds into ``times``, one JSON line."""
            cpu = cpu_meter.seconds()
            if what == "bare":
                seconds, steps = time_bare(plan, cfg), plan.steps_per_epoch
            else:
                seconds, result = time_train(cfg, spark, work / f"model-{what}-{i}",
                                             "torch" if what == "train" else "torch_tasks")
                steps = result.steps_per_rank
            times[what].append(seconds)
            print(json.dumps({"what": what, "repeat": i, **common, "seconds": round(seconds, 2),
                              "cpu_s": None if cpu is None else round(cpu_meter.seconds() - cpu, 2),
                              "steps_per_rank": steps}), flush=True)

        for i in range(args.repeats):
            for what in ("bare", "train", "tasks"):
                measure(what, i)
        # What a notebook's or a sweep's next torch_tasks launch costs: the same launch back to back,
        # on workers that ran the previous one (interleaved above, TorchDistributor's tasks use them too).
        for i in range(args.repeats):
            measure("tasks_in_a_row", i)
        bare, trained, tasks, in_a_row = (statistics.median(times[k])
                                          for k in ("bare", "train", "tasks", "tasks_in_a_row"))
        if args.profile:
            profile_train(cfg, spark, work / "model-profiled", 45)
        common["load_average"] = round(os.getloadavg()[0], 1)
        print(json.dumps({"what": "medians", **common, "bare_s": round(bare, 2), "train_s": round(trained, 2),
                          "tasks_s": round(tasks, 2), "tasks_in_a_row_s": round(in_a_row, 2),
                          "train_vs_bare": round(trained / bare, 2), "tasks_vs_bare": round(tasks / bare, 2),
                          "tasks_in_a_row_vs_bare": round(in_a_row / bare, 2)}), flush=True)
    finally:
        spark.stop()
        cpu_meter.close()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
