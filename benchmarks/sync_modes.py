"""Periodic synchronisation against every-step averaging (train.sync), in one run: the demo's
data and model (conf/run.yaml: generated rows, sharded by the product's shard job), 2 ranks, the
same seed and epochs for every mode; validation accuracy, samples/s, and what each mode sends.

    .venv/bin/python benchmarks/sync_modes.py [--rows 200000] [--epochs 3] [--every 8] \
        [--backend torch] [--modes every_step,local_sgd,diloco,diloco_overlap,diloco_overlap_plain]
        [--workdir /tmp/sync-modes]

One JSON line per mode, then a summary line with each mode's ratios to every_step:

* ``val_accuracy``: the last epoch's, on the validation split;
* ``samples_per_s``: training samples of all ranks per second of training (epochs after the first);
* ``sync_collectives`` and ``sync_bytes_per_sample``: what periodic modes send, per rank, from
  their epoch records (training.strategies.periodic); every_step's line gives the gradient bytes a
  step averages (parameters x 4 bytes) per sample instead, for comparison.

Then the same with network latency between the ranks, when this machine can make it: the ranks in
a network namespace of the benchmark's own whose loopback delays every packet (``tc qdisc ... netem
delay``). Where netem or namespaces are not available the line says why; no sleep stands in for it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "run.yaml")
MODES = {
    "every_step": [],
    "local_sgd": ["train.sync.mode=local_sgd"],
    "diloco": ["train.sync.mode=diloco"],
    "diloco_overlap": ["train.sync.mode=diloco", "train.sync.overlap=true"],
    # The same overlap with a plain-averaging outer step (lr 1, no momentum): one-round-late local SGD.
    "diloco_overlap_plain": ["train.sync.mode=diloco", "train.sync.overlap=true", "train.sync.outer.lr=1.0",
                             "train.sync.outer.momentum=0", "train.sync.outer.nesterov=false"],
}


def make_dataset(spark, workdir: str, rows: int) -> str:
    from pipelines import generate_dataset, shard_dataset
    from shardtrain.run import load_run_config

    cfg = load_run_config(CONF, [f"shard.sources.raw.path={workdir}/raw", f"shard.output.path={workdir}/shards"])
    generate_dataset(f"{workdir}/raw", rows, spark=spark, seed=0, array_shape=cfg.shard.features.arrays.get("image"),
                     mode="overwrite")
    shard_dataset(cfg.shard, spark=spark)
    return f"{workdir}/shards"


def train_mode(spark, data: str, workdir: str, mode: str, args) -> dict:
    from common.config import to_dict
    from shardtrain.run import load_run_config
    from training import load_train_config, train

    base = to_dict(load_run_config(CONF, [f"shard.output.path={data}"]).train)
    cfg = load_train_config(None, [
        f"data.path={data}", f"launch.backend={args.backend}", "launch.num_proc=2", "launch.start_timeout=120",
        f"train.epochs={args.epochs}", "train.precision=fp32", "train.log_every_steps=1000000",
        f"train.sync.every={args.every}", "checkpoint.every_epochs=null", "checkpoint.resume=never",
        f"output.model_path={workdir}/model-{mode}", "output.mode=overwrite", *MODES[mode]],
        defaults={k: base[k] for k in ("model", "train", "data") if k in base})
    result = train(cfg, spark=spark)
    later = result.metrics[1:] or result.metrics
    seconds = sum(m["seconds"] for m in later)
    samples = sum(m["samples"] for m in later)
    line = {"benchmark": "sync_modes", "mode": mode, "backend": args.backend, "ranks": 2, "every": args.every,
            "epochs": args.epochs, "val_accuracy": round(result.final["val_accuracy"], 4),
            "samples_per_s": round(samples / seconds, 1), "seconds": round(seconds, 2)}
    if mode == "every_step":
        from training import load_model

        params = sum(p.numel() for p in load_model(result.model_uri).module.parameters())
        batch = cfg.train.batch_size * cfg.train.grad_accum
        line.update(gradient_bytes_per_sample=round(params * 4 / batch, 3), collectives_per_step=1)
    else:
        line.update(sync_collectives=sum(m["sync_collectives"] for m in result.metrics),
                    sync_bytes_per_sample=round(sum(m["sync_bytes_per_sample"] for m in later) / len(later), 3),
                    sync_drift=round(later[-1]["sync_drift"], 5))
    return line


def with_latency(delay_ms: int, argv: list[str]) -> str | None:
    """This benchmark again, inside a network namespace of its own whose loopback delays every
    packet by ``delay_ms`` (so every rank-to-rank message pays it); None once it ran, else why not."""
    name = f"sync-bench-{os.getpid()}-{delay_ms}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot make a network namespace: {getattr(exc, 'stderr', '') or exc}".strip()
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True,
                       capture_output=True, text=True)
        done = subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", f"{delay_ms}ms"], capture_output=True, text=True)
        if done.returncode:
            return f"tc netem is not available on this kernel ({done.stderr.strip()})"
        subprocess.run(["ip", "netns", "exec", name, sys.executable, os.path.abspath(__file__), *argv,
                        "--no-latency", f"--label=delay_{delay_ms}ms"], check=True)
        return None
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--every", type=int, default=8)
    parser.add_argument("--backend", default="torch", choices=["torch", "horovod"])
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--delays", default="5,20", help="ms per packet for the latency runs")
    parser.add_argument("--no-latency", action="store_true", help="skip the runs with network latency")
    parser.add_argument("--label", default="loopback", help="(set by the latency runs)")
    argv = sys.argv[1:]
    args = parser.parse_args()
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    workdir = args.workdir or tempfile.mkdtemp(prefix="sync-modes-")
    spark = get_or_create_session(SparkConfig(master="local[2]", app_name="sync_modes",
                                              conf={"spark.sql.shuffle.partitions": "8"}))
    started = time.perf_counter()
    data = make_dataset(spark, workdir, args.rows)
    lines = {}
    for mode in args.modes.split(","):
        lines[mode] = {**train_mode(spark, data, workdir, mode, args), "network": args.label}
        print(json.dumps(lines[mode]), flush=True)
    reference = lines.get("every_step")
    if reference:
        print(json.dumps({"benchmark": "sync_modes_summary", "network": args.label, "reference": "every_step",
                          "rows": args.rows,
                          **{mode: {"accuracy_diff": round(line["val_accuracy"] - reference["val_accuracy"], 4),
                                    "samples_per_s_ratio": round(line["samples_per_s"] / reference["samples_per_s"], 3)}
                             for mode, line in lines.items() if mode != "every_step"},
                          "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    spark.stop()
    if args.no_latency:
        return
    for delay in (int(d) for d in args.delays.split(",") if d):
        why_not = with_latency(delay, argv)
        if why_not:
            print(json.dumps({"benchmark": "sync_modes_latency", "delay_ms": delay, "ran": False, "why_not": why_not,
                              "note": "not run: no sleep stands in for network latency"}), flush=True)
            break


if __name__ == "__main__":
    main()
