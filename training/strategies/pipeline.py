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

Rank-side only (imports torch).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.distributed as dist

from common.errors import ConfigError
from training.strategies import check_split
from training.strategies.base import Strategy, initialise_optimizer_state

log = logging.getLogger("shardtrain.train")

# Activations sent between stages during validation carry their dtype as an index in this list.
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 8  # dtype, ndim, then up to 6 dimensions


class PipelineParallel(Strategy):
    name = "pipeline"

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

        if not all(hasattr(model, name) for name in ("pipeline_inputs", "pipeline_blocks", "pipeline_stage")):
            raise ConfigError(f"model {type(model).__name__} cannot be cut into pipeline stages (it has no "
                              "pipeline_blocks/pipeline_stage, see training.models); use model.name=mlp or ft_transformer, or set "
                              "train.pipeline.stages=1")
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
        stages = [PipelineStage(m, i, self.parts, self.device, group=self.pp_group)
                  for i, m in zip(self.part_ids, self.modules)]
        self.schedule = self._schedule(stages)
        return model

    def _bounds(self, model, blocks: int) -> list[tuple[int, int]]:
        """(start, stop) blocks of every stage of the model, by ``train.pipeline.split``."""
        split = self.settings.split
        if isinstance(split, list):
            return _named_bounds(model, split)
        if split == "auto" and hasattr(model, "pipeline_example"):
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
        if not _P2P_TIMED:
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
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2:2 + tensor.dim()] = torch.tensor(tensor.shape)
        dst = self.pipeline_ranks[stage]
        dist.send(header.to(self.device), dst=dst)
        dist.send(tensor.contiguous(), dst=dst)

    def _receive(self, stage: int):
        src = self.pipeline_ranks[stage]
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src)
        header = header.tolist()
        tensor = torch.empty(header[2:2 + header[1]], dtype=_DTYPES[header[0]], device=self.device)
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
        parts = [None] * self.stages if self.group.rank == 0 else None
        dist.gather_object(part, parts, dst=0, group=self.pp_group)
        return parts


def _named_bounds(model, split: list[list[str]]) -> list[tuple[int, int]]:
    """The (start, stop) blocks of an explicit split, which must list every block's name in order."""
    check_split(split, model.pipeline_block_names() if hasattr(model, "pipeline_block_names") else None,
                type(model).__name__)
    bounds, start = [], 0
    for stage in split:
        bounds.append((start, start + len(stage)))
        start += len(stage)
    return bounds


def _block_seconds(model, rows: int, device, repeats: int = 5) -> list[float]:
    """Each block's fastest forward + backward of ``rows`` made-up rows, in the order of the stages.
    Leaves the model, its gradients and the RNG (dropout, the next seeded draws) as they were."""
    rng = torch.get_rng_state()
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
    return seconds


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
    try:
        from torch.distributed.pipelining import schedules
    except ImportError:
        return None
    return schedules if hasattr(schedules, "_wait_batch_p2p") else None


# Every schedule waits for its sends and receives through this private torch function; where a
# torch lacks it, the bubble fraction is recorded as None rather than as a wrong 0.
_P2P_TIMED = _schedules_module() is not None


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
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if id(tensor) not in owned:
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


__all__ = ["PipelineParallel"]
