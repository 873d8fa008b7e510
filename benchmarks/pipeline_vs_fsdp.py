"""Pipeline stages against FSDP2 (and DDP) at equal world size, side by side in one run.

Two torch.distributed ranks (Gloo, CPU, spawned on 127.0.0.1, one torch thread each) train the
built-in MLP (64 numeric inputs, ``--layers`` hidden layers of ``--width``, AdamW) on synthetic
rows, the same rows per optimizer step in every layout:

- ``pipeline``: 2 stages, one replica, batch ``--batch`` cut into ``--microbatches`` (1F1B, and GPipe);
- ``fsdp``: 2 ranks, ``--batch / 2`` rows each, parameters, gradients and Adam state sharded;
- ``ddp``: 2 ranks, ``--batch / 2`` rows each, everything replicated.

Printed per layout: samples/s (best of ``--rounds``, layouts interleaved), the training state
(parameters + gradients + Adam moments) each rank holds, its peak RSS, and for the pipeline the
bubble fraction its schedule implies, (stages - 1) / (microbatches + stages - 1): the share of a
step each stage waits, with equal stage times. Read the ratios, not the rates: the 2 cores are
shared.

    .venv/bin/python benchmarks/pipeline_vs_fsdp.py            # width 1024, 6 layers, batch 256
"""

from __future__ import annotations

import argparse
import os
import pickle
import resource
import socket
import sys
import tempfile
import time

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rank(rank: int, port: int, out: str, layout: str, args) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
                       "OMP_NUM_THREADS": "1"})
    import torch

    from training.distributed import TorchGroup
    from common.dataset import LabelSpec
    from training.tasks import Objective
    from training.models import TabularMLP
    from training.precision import Precision

    torch.set_num_threads(1)
    group = TorchGroup(torch.device("cpu"), "benchmark")
    precision = Precision("fp32", "cpu")
    if layout.startswith("pipeline"):
        from training.strategies.pipeline import PipelineConfig, PipelineParallel

        schedule = layout.split("-")[1]
        strategy = PipelineParallel(group, precision, PipelineConfig(stages=2, schedule=schedule,
                                                                     microbatches=args.microbatches))
        rows = args.batch
    else:
        from training.strategies.ddp import DistributedDataParallel
        from training.strategies.fsdp import FullyShardedDataParallel

        strategy = {"fsdp": FullyShardedDataParallel, "ddp": DistributedDataParallel}[layout](group, precision)
        rows = args.batch // 2
    torch.manual_seed(0)
    net = TabularMLP(num_numeric=64, vocab_sizes=[], array_names=[], array_widths=[], out_dim=2,
                     hidden=[args.width] * args.layers)
    step_model = strategy.wrap(net)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    strategy.broadcast_initial_state(net, optimizer)
    objective = Objective(LabelSpec(name="label", task="classification", num_classes=2))
    generator = torch.Generator().manual_seed(rank)
    batch = {"numeric": torch.randn(rows, 64, generator=generator), "categorical": torch.zeros(rows, 0, dtype=torch.long),
             "label": torch.randint(0, 2, (rows,), generator=generator)}
    for _ in range(args.warmup):
        strategy.train_step(step_model, [batch], optimizer, objective, None)
    group.dist.barrier()
    started = time.perf_counter()
    for _ in range(args.steps):
        strategy.train_step(step_model, [batch], optimizer, objective, None)
    group.dist.barrier()
    seconds = time.perf_counter() - started

    def local_bytes(tensor) -> int:
        tensor = getattr(tensor, "_local_tensor", tensor)  # FSDP2's DTensor: this rank's shard
        return tensor.numel() * tensor.element_size()

    # Parameters and, during a step, their gradients (zero_grad has freed them by now), and Adam's moments.
    held = 2 * sum(local_bytes(p) for p in net.parameters())
    held += sum(local_bytes(v) for state in optimizer.state.values() for v in state.values() if v.dim())
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as fh:
        pickle.dump({"samples_per_s": args.steps * args.batch / seconds, "state_mib": held / 2**20,
                     "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}, fh)
    group.shutdown()


def run(layout: str, args) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(port, out, layout, args), nprocs=2, start_method="spawn")
        results = []
        for rank in range(2):
            with open(os.path.join(out, f"{rank}.pkl"), "rb") as fh:
                results.append(pickle.load(fh))
        return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    layouts = ["pipeline-1f1b", "pipeline-gpipe", "fsdp", "ddp"]
    best: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for layout in layouts:
            results = run(layout, args)
            if layout not in best or results[0]["samples_per_s"] > best[layout][0]["samples_per_s"]:
                best[layout] = results
    params = 64 * args.width + args.width + (args.layers - 1) * (args.width ** 2 + args.width) + 2 * args.width + 2
    print(f"MLP 64-{args.width}x{args.layers}-2 ({params / 1e6:.1f}M parameters), {args.batch} rows per step, "
          f"2 ranks, {args.microbatches} micro-batches")
    bubble = 1 / (args.microbatches + 1)
    reference = best["fsdp"][0]["samples_per_s"]
    print("| layout | samples/s | vs FSDP | training state per rank (MiB) | peak RSS per rank (MiB) | bubble (schedule) |")
    print("|---|---|---|---|---|---|")
    for layout in layouts:
        r = best[layout]
        state = " / ".join(f"{x['state_mib']:.0f}" for x in r)
        rss = " / ".join(f"{x['peak_rss_mib']:.0f}" for x in r)
        shown = f"{bubble:.2f}" if layout.startswith("pipeline") else "-"
        print(f"| {layout} | {r[0]['samples_per_s']:.0f} | {r[0]['samples_per_s'] / reference:.2f} | {state} | {rss} | "
              f"{shown} |")


if __name__ == "__main__":
    main()
