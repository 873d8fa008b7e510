"""Pipeline parallelism (``train.pipeline.stages`` > 1, launch.backend=torch): the model's blocks
cut into consecutive stages on consecutive ranks, each batch split into micro-batches that flow
through them under a ``torch.distributed.pipelining`` schedule (GPipe, 1F1B, interleaved 1F1B).

The ranks form a data-parallel x pipeline mesh, pipeline inner: ranks ``d*S .. d*S+S-1`` are
replica ``d``'s stages, so one pipeline's point-to-point traffic stays among neighbouring ranks
(one host, when ranks are placed in order). The loader shards rows by the replica
(``dp_rank``/``dp_size``): every stage of a replica reads the same batches. A stage's gradients
are averaged with the same stage's on the other replicas in one allreduce after the schedule, not
by a wrapper hooked into backward: the schedules run several forwards before their backwards,
which DDP's reducer does not follow. ``nn.parallel.DistributedDataParallel`` on stage modules
crashes at the second step or, with ``static_graph=True``, trains wrong weights (issue 23), and
the composable ``replicate()`` (DDP's reducer too) was wrong here by 7e-2 after one AdamW step
on every stage that runs forwards ahead (GPipe; 1F1B's first stage), torch 2.13, Gloo.

Stages are built by hand from the model (``pipeline_stage``, ``training.models``), never traced,
and keep the whole model's parameter names; the parameters of other ranks' stages are emptied
here, so a rank holds only its own. Checkpoints and exports gather the stages into the plain
model's state dicts on rank 0, so a run saved on stages resumes in one process or under DDP, and
one saved there resumes on stages.

What the loop guarantees holds across stages: the loss, computed on the last stage only, is summed
over the pipeline so every rank returns it (logs, the non-finite check, the epoch's mean); the
clip norm is the norm over all stages; fp16's found-inf is agreed by every rank before any steps.
Gradient accumulation calls the schedule once per accumulated batch with ``scale_grads=False`` and
each micro-batch's loss divided by all micro-batches of the optimizer step (the schedule's own
scaling would divide the earlier calls' gradients again: wrong by 3e-2 in issue 23's check).
Validation runs the stages forward only, one batch at a time (its last batch is partial, which a
schedule's fixed micro-batch shapes cannot take). Each epoch's record (metrics.jsonl) carries the
measured bubble per stage: the share of its training-step time spent blocked in the schedule's
point-to-point waits.

This module owns ``train.pipeline`` (``PipelineConfig``) and the refusals of its combinations; torch
is imported by the methods a rank runs (the driver imports this module for them).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Literal

from common.config import require, setting
from common.errors import ConfigError
from training.limits import MAX_BATCH_ROWS, MAX_RANKS
from training.model_specs import model_spec, offering, spec_of
from training.model_specs.base import EXAMPLE, PIPELINE
from training.strategies.base import Strategy, initialise_optimizer_state

log = logging.getLogger("shardtrain.train")

_HEADER = 8  # dtype, ndim, then up to 6 dimensions


@dataclass
class PipelineConfig:
    """Pipeline parallelism: the model's layers cut into ``stages`` consecutive parts on consecutive
    ranks, each batch split into ``microbatches`` that flow through them; ``launch.num_proc /
    stages`` data-parallel replicas of that pipeline."""

    stages: int = setting(
        "pipeline parallelism (`launch.backend=torch`, `train.parallel=ddp`): the model's layers cut into this "
        "many stages on consecutive ranks (1: off); `launch.num_proc` must be a multiple of it, and "
        "`num_proc / stages` replicas of the pipeline read different rows. Built-in MLP: stage boundaries fall "
        "between its Linear layers; `ft_transformer`: between its blocks. Checkpoints and the published model "
        "are the plain model's, so a run resumes across stages, DDP and one process", default=1)
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = setting(
        "`gpipe`: all forwards, then all backwards; `1f1b`: one forward, one backward in turn (needs "
        "`microbatches >= stages`); `interleaved_1f1b`: 1f1b over `stages_per_rank` (>= 2) smaller stages per "
        "rank, a smaller bubble (needs `microbatches` a multiple of `stages`)", default="1f1b")
    microbatches: int = setting("micro-batches each batch is cut into; must divide `train.batch_size`", default=8)
    stages_per_rank: int = setting("`interleaved_1f1b` only: smaller stages per rank, a smaller bubble", default=1)
    split: Literal["auto", "even"] | list[list[str]] = setting(
        "where the stages are cut: `auto` balances them by a short timing pass of each block on rank 0; `even`: "
        "equal block counts; or one list of block module names per stage, all of them in order, e.g. "
        "`[[blocks.0], [blocks.1, blocks.2, blocks.3]]` (MLP blocks: `body.0`, `body.2`, ...)", default="auto")

    def __post_init__(self):
        require(1 <= self.stages <= MAX_RANKS, "stages", f"must be in [1, {MAX_RANKS}], got {self.stages}")
        require(1 <= self.microbatches <= MAX_BATCH_ROWS, "microbatches",
                f"must be in [1, {MAX_BATCH_ROWS:,}], got {self.microbatches}")
        interleaved = self.schedule == "interleaved_1f1b"
        require(self.stages_per_rank >= 2 if interleaved else self.stages_per_rank == 1, "stages_per_rank",
                f"must be >= 2 with schedule=interleaved_1f1b (got {self.stages_per_rank})" if interleaved else
                f"must be 1 with schedule={self.schedule} (got {self.stages_per_rank}); more stages per rank need "
                "schedule=interleaved_1f1b")
        parts = self.stages * self.stages_per_rank
        require(not isinstance(self.split, list) or self.stages == 1 or
                (len(self.split) == parts and all(self.split)), "split",
                f"must be 'auto', 'even' or {parts} non-empty lists of module names (one per stage: stages x "
                f"stages_per_rank), got {self.split}")
        if self.stages > 1 and self.schedule != "gpipe":
            # Too few micro-batches and 1F1B has no steady state: torch refuses fewer than the
            # stages; the interleaved schedule needs whole rounds of `stages` micro-batches.
            require(self.microbatches >= self.stages and (not interleaved or self.microbatches % self.stages == 0),
                    "microbatches", f"must be {'a multiple of' if interleaved else 'at least'} stages={self.stages} "
                    f"with schedule={self.schedule}, got {self.microbatches}; raise it, or use schedule=gpipe")


class PipelineParallel(Strategy):
    name, key, ranks = "pipeline", "train.pipeline.stages", ("torch",)

    # --- what the driver reads (see training.strategies.base) ---------------------------------------

    @classmethod
    def picked(cls, train) -> bool:
        return train.pipeline.stages > 1

    @classmethod
    def ranks_per_replica(cls, train) -> int:
        return train.pipeline.stages  # a replica is one whole pipeline

    @classmethod
    def model_shards(cls, cfg) -> int:
        return cfg.train.pipeline.stages

    @classmethod
    def check(cls, cfg, launcher) -> None:
        train, launch = cfg.train, cfg.launch
        stages = train.pipeline.stages
        _check_step(train)
        if launcher.ranks not in cls.ranks and not launcher.one_process:
            raise ConfigError(f"train.pipeline.stages={stages} needs launch.backend=torch (got launch.backend="
                              f"{launch.backend}: Horovod has no point-to-point sends between stages); set "
                              "launch.backend=torch or train.pipeline.stages=1")
        if train.parallel != "ddp":
            # Each stage is replicated across the data-parallel ranks; FSDP2 units inside stages are
            # wrong with some schedules unless built for it, and are not built here.
            raise ConfigError(f"train.parallel={train.parallel} with train.pipeline.stages={stages} is not built: "
                              "the stages are replicated across data-parallel ranks; set train.parallel=ddp or "
                              "train.pipeline.stages=1")
        if train.sync.mode != "every_step":
            raise ConfigError(f"train.sync.mode={train.sync.mode} with train.pipeline.stages={stages} is not built: "
                              "a pipeline's replicas average their gradients every step; set "
                              "train.sync.mode=every_step or train.pipeline.stages=1")
        if launch.num_proc % stages:
            raise ConfigError(f"launch.num_proc={launch.num_proc} is not a multiple of train.pipeline.stages="
                              f"{stages}: every data-parallel replica is one whole pipeline; set launch.num_proc to a "
                              f"multiple of {stages}" + (" (with launch.mode=spark)" if launcher.one_process else ""))
        _check_blocks(train.pipeline, cfg.model)

    @classmethod
    def from_config(cls, config, group, precision) -> "PipelineParallel":
        t = config.train
        return cls(group, precision, t.pipeline, microbatch_rows=t.batch_size // t.pipeline.microbatches)

    def __init__(self, group, precision, pipeline, microbatch_rows: int = 16):
        super().__init__(group, precision)
        self.microbatch_rows = microbatch_rows  # what split: auto times each block on
        from torch.distributed.device_mesh import init_device_mesh

        self.settings = pipeline
        self.stages = pipeline.stages
        self.pp_rank, self._dp_rank = group.rank % self.stages, group.rank // self.stages
        self._dp_size = group.size // self.stages
        mesh = init_device_mesh(self.device.type, (self._dp_size, self.stages), mesh_dim_names=("dp", "pp"))
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.pipeline_ranks = [self._dp_rank * self.stages + s for s in range(self.stages)]  # global ranks
        self.parts = self.stages * pipeline.stages_per_rank  # stages of the model (virtual, when interleaved)
        # Interleaved: this rank holds stages pp_rank, pp_rank + S, ... (torch's loop placement).
        self.part_ids = [self.pp_rank + k * self.stages for k in range(pipeline.stages_per_rank)]
        self.holds_first, self.holds_last = 0 in self.part_ids, self.parts - 1 in self.part_ids
        self._objective = None
        self._loss_scale = 1.0
        # This epoch's seconds in training steps and, of those, blocked in point-to-point waits.
        self._step_seconds = self._p2p_wait_seconds = 0.0

    @property
    def dp_rank(self) -> int:
        return self._dp_rank

    @property
    def dp_size(self) -> int:
        return self._dp_size

    # --- building ----------------------------------------------------------------------------------

    def wrap(self, model):
        from torch.distributed.pipelining import PipelineStage

        if not spec_of(model).offers(model, PIPELINE):
            raise ConfigError(f"model {type(model).__name__} cannot be cut into pipeline stages (it has no "
                              "pipeline_blocks/pipeline_stage, see training.models); use model.name="
                              f"{' or '.join(offering(PIPELINE))}, or set train.pipeline.stages=1")
        blocks = model.pipeline_blocks()
        if blocks < self.parts:
            raise ConfigError(f"model {type(model).__name__} has {blocks} block(s), fewer than the {self.parts} "
                              "pipeline stage(s) (train.pipeline.stages x stages_per_rank); use fewer stages")
        bounds = self._bounds(model, blocks)
        if self.group.rank == 0:
            log.info("pipeline: %d blocks cut into stages %s (train.pipeline.split=%s)", blocks,
                     " ".join(f"[{a}, {b})" for a, b in bounds), self.settings.split)
        self.bounds = [bounds[i] for i in self.part_ids]
        self.inputs = model.pipeline_inputs()
        self.modules = [model.pipeline_stage(*bounds[i]) for i in self.part_ids]
        owned = {id(t) for m in self.modules for t in [*m.parameters(), *m.buffers()]}
        state = model.state_dict(keep_vars=True)
        self.owned_names = [name for name, t in state.items() if id(t) in owned]
        _empty_all_but(model, owned)
        for m in self.modules:
            _buffers_kept_through_first_call(m)
        stages = [PipelineStage(m, i, self.parts, self.device, group=self.pp_group)
                  for i, m in zip(self.part_ids, self.modules)]
        self.schedule = self._schedule(stages)
        return model

    def _bounds(self, model, blocks: int) -> list[tuple[int, int]]:
        """(start, stop) blocks of every stage of the model, by ``train.pipeline.split``."""
        split = self.settings.split
        if isinstance(split, list):
            return _named_bounds(model, split)
        if split == "auto" and spec_of(model).offers(model, EXAMPLE):
            # Rank 0 times, every rank cuts where it says: the replicas' stages must match.
            costs = self.group.broadcast_object(_block_seconds(model, self.microbatch_rows, self.device)
                                                if self.group.rank == 0 else None)
            return _balanced_bounds(costs, self.parts)
        return [(i * blocks // self.parts, (i + 1) * blocks // self.parts) for i in range(self.parts)]

    def _schedule(self, stages):
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        kind = self.settings.schedule
        options = dict(n_microbatches=self.settings.microbatches, loss_fn=self._loss, scale_grads=False)
        if kind == "interleaved_1f1b":
            return ScheduleInterleaved1F1B(stages, **options)
        return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](stages[0], **options)

    def broadcast_initial_state(self, model, optimizer) -> None:
        # Every rank built the same seeded model and loaded the same checkpoint: nothing to send.
        if not optimizer.state_dict()["state"]:
            initialise_optimizer_state(optimizer)

    # --- one optimizer step ------------------------------------------------------------------------

    def train_step(self, step_model, micro_batches, optimizer, objective, clip_norm, timer=None):
        import torch
        import torch.distributed as dist

        started = time.perf_counter()
        precision = self.precision
        self._objective = objective
        self._loss_scale = 1.0 / (self.settings.microbatches * len(micro_batches))
        loss = torch.zeros((), device=self.device)
        for batch in micro_batches:  # grad_accum batches, each cut into the pipeline's micro-batches
            inputs = tuple(batch[name] for name in self.inputs) if self.holds_first else ()
            losses: list[torch.Tensor] = []  # what _loss returned, per micro-batch (last stage only)
            with precision.autocast(), _timed_p2p_waits(self):
                self.schedule.step(*inputs, target=batch["label"] if self.holds_last else None, losses=losses,
                                   return_outputs=False)
            for value in losses:
                loss += value.detach().float()
        # _loss returned each loss already divided by the step's micro-batches: the sum is the
        # step's mean loss, times the fp16 loss scale (the same for all of them) to divide out.
        loss /= precision.scale(torch.ones((), device=self.device))
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage's is non-zero
        self._average_over_replicas()
        precision.unscale_(optimizer)
        precision.agree_on_overflow(optimizer, lambda found: dist.all_reduce(found, op=dist.ReduceOp.MAX))
        if clip_norm:
            self._clip(clip_norm)
        precision.step(optimizer)
        precision.update()
        optimizer.zero_grad()
        self._step_seconds += time.perf_counter() - started
        return loss

    def epoch_metrics(self) -> dict:
        """``pipeline_bubble_fraction``: per stage (list index), the epoch's seconds its rank
        waited in the schedule's point-to-point transfers (the stage idle, waiting for a
        neighbour's activations or gradients, or for it to take ours) over its seconds in training
        steps; replicas of a stage averaged. None where this torch's schedules cannot be timed.
        Every rank takes part in the gather; all get the same figures."""
        mine = (self.pp_rank, self._p2p_wait_seconds, self._step_seconds)
        self._p2p_wait_seconds = self._step_seconds = 0.0
        if _schedules_module() is None:
            return {"pipeline_bubble_fraction": None}
        waits, steps = [0.0] * self.stages, [0.0] * self.stages
        for stage, wait, seconds in self.group.allgather_object(mine):
            waits[stage] += wait
            steps[stage] += seconds
        return {"pipeline_bubble_fraction": [round(w / s, 4) if s else 0.0 for w, s in zip(waits, steps)]}

    def _average_over_replicas(self) -> None:
        """Each stage's gradients averaged with the same stage's on the other replicas, in one
        allreduce once the schedule is done (divided before the sum, as DDP does)."""
        if self._dp_size == 1:
            return
        import torch
        import torch.distributed as dist

        grads = [p.grad for m in self.modules for p in m.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]).div_(self._dp_size)
        dist.all_reduce(flat, group=self.dp_group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def _loss(self, output, target):
        """The schedule's loss_fn, on the last stage, per micro-batch (and once more while the
        schedule infers the shapes of its first step)."""
        return self.precision.scale(self._objective(output, {"label": target}) * self._loss_scale)

    def _clip(self, clip_norm: float) -> None:
        """``clip_grad_norm_`` with the norm over every stage's gradients (replicas hold equal ones)."""
        import torch
        import torch.distributed as dist

        grads = [p.grad for m in self.modules for p in m.parameters() if p.grad is not None]
        squares = torch.zeros((), device=self.device)
        for g in grads:
            squares += torch.linalg.vector_norm(g.float(), 2.0) ** 2
        dist.all_reduce(squares, group=self.pp_group)
        coefficient = torch.clamp(clip_norm / (squares.sqrt() + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coefficient.to(g.dtype))

    # --- validation --------------------------------------------------------------------------------

    def evaluate_forward(self, model, batch):
        """The stages forward, in order, activations passed on by point-to-point sends; the
        output on the rank holding the last stage, None on the others."""
        out = None
        for part in range(self.parts):
            owner = part % self.stages
            if owner != self.pp_rank:
                continue
            if part == 0:
                inputs = tuple(batch[name] for name in self.inputs)
            elif (part - 1) % self.stages == self.pp_rank:
                inputs = (out,)
            else:
                inputs = (self._receive((part - 1) % self.stages),)
            out = self.modules[self.part_ids.index(part)](*inputs)
            following = (part + 1) % self.stages
            if part < self.parts - 1 and following != self.pp_rank:
                self._send(out, following)
        return out if self.holds_last else None

    def _send(self, tensor, stage: int) -> None:
        import torch
        import torch.distributed as dist

        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _dtypes().index(tensor.dtype), tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        dst = self.pipeline_ranks[stage]
        dist.send(header.to(self.device), dst=dst)
        dist.send(tensor.contiguous(), dst=dst)

    def _receive(self, stage: int):
        import torch
        import torch.distributed as dist

        src = self.pipeline_ranks[stage]
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src)
        header = header.tolist()
        tensor = torch.empty(header[2:2 + header[1]], dtype=_dtypes()[header[0]], device=self.device)
        dist.recv(tensor, src=src)
        return tensor

    # --- state for checkpoints and export ----------------------------------------------------------

    def model_state_dict(self, model) -> dict:
        """The plain model's full state dict on rank 0 (each stage's part gathered there), in the
        model's own key order; an empty dict on the other ranks, which do not write."""
        state = model.state_dict()
        parts = self._gather({name: state[name].detach().cpu() for name in self.owned_names})
        if parts is None:
            return {}
        merged = {name: tensor for part in parts for name, tensor in part.items()}
        return {name: merged[name] for name in state}

    def optimizer_state_dict(self, model, optimizer) -> dict:
        """The optimizer's state dict as one process's would be (keyed by position among all the
        model's parameters) on rank 0; each position's state comes from the stage that owns it."""
        full = optimizer.state_dict()
        owned = self._owned_positions(model, optimizer)
        parts = self._gather({i: s for i, s in full["state"].items() if i in owned})
        if parts is None:
            return {}
        merged = {i: s for part in parts for i, s in part.items()}
        return {"state": {i: merged[i] for i in sorted(merged)}, "param_groups": full["param_groups"]}

    def load_state_dicts(self, model, optimizer, model_state: dict, optimizer_state: dict) -> None:
        import torch

        tensors = model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name in self.owned_names:
                tensors[name].copy_(model_state[name])
        owned = self._owned_positions(model, optimizer)
        optimizer.load_state_dict({"state": {i: s for i, s in optimizer_state["state"].items() if i in owned},
                                   "param_groups": optimizer_state["param_groups"]})

    def unsharded(self, model, build):
        state = self.model_state_dict(model)  # every rank takes part in the gather
        if self.group.rank != 0:
            return None
        plain = build()
        plain.load_state_dict(state)
        return plain

    def _owned_positions(self, model, optimizer) -> set[int]:
        owned = {id(t) for m in self.modules for t in m.parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return {i for i, p in enumerate(params) if id(p) in owned}

    def _gather(self, part: dict) -> list[dict] | None:
        """Every stage's ``part`` of replica 0, on rank 0 (None elsewhere); replicas hold equal
        weights, so the other replicas send nothing."""
        if self._dp_rank != 0:
            return None
        import torch.distributed as dist

        parts = [None] * self.stages if self.group.rank == 0 else None
        dist.gather_object(part, parts, dst=0, group=self.pp_group)
        return parts


def _check_step(train) -> None:
    """What a step on stages asks of the rest of ``train``."""
    micro = train.pipeline.microbatches
    require(train.batch_size % micro == 0, "train.pipeline.microbatches",
            f"must divide train.batch_size={train.batch_size} (got {micro}): every micro-batch has the same rows; "
            f"set train.batch_size to a multiple of {micro} or train.pipeline.microbatches to a divisor")
    require(train.distill is None, "train.distill", "is not built for train.pipeline.stages > 1 (the last stage "
            "gets only the label); remove train.distill or set train.pipeline.stages=1")


def _check_blocks(pipeline: PipelineConfig, model_cfg) -> None:
    """The model has a block for every stage, and an explicit split names them all (a built-in
    model's blocks, from its keys by its spec; a plug-in's are known once a rank builds it)."""
    spec = model_spec(model_cfg.name)
    spec.check_stages(model_cfg, pipeline.stages * pipeline.stages_per_rank)
    if isinstance(pipeline.split, list):
        names = spec.block_names(model_cfg)
        if names is not None:
            check_split(pipeline.split, names, model_cfg.name)


def check_split(split: list[list[str]], names: list[str] | None, model_name: str) -> None:
    """An explicit ``train.pipeline.split`` lists every block of the model once, in order (exit 2
    otherwise): on the driver for the built-in models, on the ranks for a plug-in."""
    if names is None or [name for stage in split for name in stage] != names:
        raise ConfigError(f"train.pipeline.split={split} must list every block of model {model_name} once, in order, "
                          f"cut into stages: its blocks are {names}; or set train.pipeline.split=auto")


def _named_bounds(model, split: list[list[str]]) -> list[tuple[int, int]]:
    """The (start, stop) blocks of an explicit split, which must list every block's name in order."""
    check_split(split, spec_of(model).pipeline_block_names(model), type(model).__name__)
    bounds, start = [], 0
    for stage in split:
        bounds.append((start, start + len(stage)))
        start += len(stage)
    return bounds


def _block_seconds(model, rows: int, device, repeats: int = 5) -> list[float]:
    """Each block's fastest forward + backward of ``rows`` made-up rows, in the order of the stages.
    Leaves the model, its gradients and the RNG (dropout, the next seeded draws) as they were."""
    import torch

    rng = torch.get_rng_state()
    buffers = _buffers(model)  # a BatchNorm's running statistics: the made-up rows must not move them
    blocks = model.pipeline_blocks()
    parts = [model.pipeline_stage(i, i + 1) for i in range(blocks)]
    seconds = [float("inf")] * blocks
    try:
        for _ in range(repeats):
            inputs = model.pipeline_example(rows, device)
            for i, part in enumerate(parts):
                inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in inputs)
                started = time.perf_counter()
                out = part(*inputs)
                out.float().sum().backward()
                seconds[i] = min(seconds[i], time.perf_counter() - started)
                inputs = (out,)
    finally:
        torch.set_rng_state(rng)
        for p in model.parameters():
            p.grad = None
        _restore_buffers(model, buffers)
    return seconds


def _buffers(module) -> dict:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def _restore_buffers(module, saved: dict) -> None:
    # Through .data: no version bump of a buffer the call's autograd graph recorded (a BatchNorm's
    # running statistics, which its backward in training mode does not read).
    for name, b in module.named_buffers():
        b.data.copy_(saved[name])


def _buffers_kept_through_first_call(module) -> None:
    """torch.distributed.pipelining infers a stage's shapes by calling it once, in training mode, on
    uninitialised tensors (``torch.empty``) of its inputs' shapes, before the first micro-batch:
    a ResNet's BatchNorm running statistics took NaN from that. The stage's buffers are put back
    after that first call."""
    saved: dict = {}

    def before(mod, args):
        saved.update(_buffers(mod))

    def after(mod, args, out):
        _restore_buffers(mod, saved)
        handles[0].remove()
        handles[1].remove()

    handles = [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def _balanced_bounds(costs: list[float], parts: int) -> list[tuple[int, int]]:
    """Consecutive groups of ``costs`` (each non-empty), ``parts`` of them, with the smallest
    largest sum: the slowest stage sets the pipeline's pace."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest largest sum cutting the first i blocks into k groups; cut[k][i]: its last cut.
    best = [[float("inf")] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                worst = max(best[k - 1][j], prefix[i] - prefix[j])
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    bounds, stop = [], n
    for k in range(parts, 0, -1):
        bounds.append((cut[k][stop], stop))
        stop = cut[k][stop]
    return bounds[::-1]


def _schedules_module():
    """torch's schedules module where it has the private function every schedule waits for its
    sends and receives through (timed for the bubble fraction), else None: the fraction is then
    recorded as None rather than as a wrong 0."""
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return None
    return schedules if hasattr(schedules, "_wait_batch_p2p") else None


def _dtypes() -> list:
    """Activations sent between stages during validation carry their dtype as an index in this list."""
    import torch

    return [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@contextlib.contextmanager
def _timed_p2p_waits(strategy: PipelineParallel):
    """Adds the seconds the schedule spends in its point-to-point waits to the strategy's count."""
    schedules = _schedules_module()
    if schedules is None:
        yield
        return
    original = schedules._wait_batch_p2p

    def timed(work):
        started = time.perf_counter()
        try:
            return original(work)
        finally:
            strategy._p2p_wait_seconds += time.perf_counter() - started

    schedules._wait_batch_p2p = timed
    try:
        yield
    finally:
        schedules._wait_batch_p2p = original


def _empty_all_but(model, owned: set[int]) -> None:
    """Free the parameters and buffers of the stages other ranks hold: this rank never computes
    with them, and a checkpoint takes each from its owner."""
    import torch

    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if id(tensor) not in owned:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


__all__ = ["PipelineConfig", "PipelineParallel", "check_split"]
