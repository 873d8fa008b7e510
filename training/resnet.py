"""``model.name: resnet``: ResNet-18 and ResNet-34 (He et al., 2016, "Deep Residual Learning for
Image Recognition", the basic-block networks of its table 1) in plain torch, no torchvision (whose
wheels do not load on a CPU torch: docs/guides/images.md), over the dataset's one image column.

Shapes as in the paper, with ``model.width`` (64 there) the first stage's channels: a 7x7 stride-2
convolution to ``width`` channels, BatchNorm, ReLU and a 3x3 stride-2 max pool (the stem), four
stages of basic blocks (two 3x3 convolutions, each with BatchNorm, and the identity, or a 1x1
stride-2 convolution with BatchNorm where the shape changes) of ``width``, 2, 4 and 8 x ``width``
channels, the last three starting at stride 2; ``model.depth`` 18 has 2, 2, 2, 2 blocks a stage, 34
has 3, 4, 6, 3. Then global average pooling and one Linear. Any input size (the pooling takes what
the stages leave, down to 1 x 1) and any channel count (the stem's first convolution takes the
image's). The image arrives as uint8 [B, C, H, W] and is normalised inside by the manifest's
per-channel mean and std (``training.image_stems.Normalise``), on the device.

BatchNorm statistics are per rank: in training each rank normalises by its own batch's mean and
variance (no SyncBatchNorm: the Horovod and torch.distributed paths compute the same thing, and a
rank's batch is ``train.batch_size`` rows, so keep it at 16 or more for statistics worth having),
and each rank keeps its own running mean and variance; the gradients are averaged as usual, but
those running statistics are not, and the published model (and a checkpoint) carries rank 0's.
With pipeline stages, each stage's BatchNorms see that stage's micro-batches (of
``train.batch_size / train.pipeline.microbatches`` rows).

The stem and each stage are FSDP2's units; a pipeline stage holds whole residual stages (the stem
goes with the first, the pooling and the head with the last), so ``train.pipeline.stages`` is at
most 4. Imported on ranks only (it imports torch); its spec is ``training.model_specs.resnet``.
"""

from __future__ import annotations

from typing import Dict

import torch
from torch import nn

from training.image_stems import Conv2d, Normalise, example_images
from training.model_specs.resnet import BLOCKS_PER_STAGE


class ResNet(nn.Module):
    def __init__(self, num_numeric: int, vocab_sizes: list[int], array_names: list[str], array_widths: list[int],
                 out_dim: int, depth: int = 18, width: int = 64, regression: bool = False,
                 images: list[dict] | None = None):
        super().__init__()
        if len(images or []) != 1:  # the spec refused such a dataset on the driver already
            raise ValueError(f"resnet takes one image column, the dataset has {len(images or [])}")
        (image,) = images
        self.images = [dict(image)]
        self.image_name = image["name"]
        self.regression = regression
        self.normalise = Normalise(image["channels"], image["mean"], image["std"])
        self.stem = nn.Sequential(Conv2d(image["channels"], width, 7, stride=2, padding=3, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
        stages, channels = [], width
        for index, blocks in enumerate(BLOCKS_PER_STAGE[depth]):
            out = width << index
            stride = 1 if index == 0 else 2
            stages.append(nn.Sequential(*(_BasicBlock(channels if b == 0 else out, out, stride if b == 0 else 1)
                                          for b in range(blocks))))
            channels = out
        self.stages = nn.ModuleList(stages)
        self.head = nn.Linear(channels, out_dim)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        x = self.stem(self.normalise(batch[self.image_name], self.stem[0].weight.dtype))
        for stage in self.stages:
            x = stage(x)
        out = self.head(x.mean(dim=(2, 3)))
        return out.squeeze(1) if self.regression else out

    def fsdp_units(self) -> list[nn.Module]:
        """FSDP2's units (``training.strategies.fsdp``): the stem, each residual stage, the head."""
        return [self.stem, *self.stages, self.head]

    # --- pipeline stages (training.models' docstring): whole residual stages -----------------------

    def pipeline_inputs(self) -> list[str]:
        return [self.image_name]

    def pipeline_blocks(self) -> int:
        return len(self.stages)

    def pipeline_stage(self, start: int, stop: int) -> nn.Module:
        return _ResNetStage(self, start, stop)

    def pipeline_block_names(self) -> list[str]:
        return [f"stages.{i}" for i in range(len(self.stages))]

    def pipeline_example(self, rows: int, device=None) -> tuple[torch.Tensor, ...]:
        return tuple(example_images(self.images, rows, device))


class _BasicBlock(nn.Module):
    """relu(bn(conv3x3(relu(bn(conv3x3(x))))) + shortcut(x)); the shortcut is the identity, or a
    1x1 convolution with BatchNorm where the stride or the channels change."""

    def __init__(self, channels: int, out: int, stride: int):
        super().__init__()
        self.conv1 = Conv2d(channels, out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels != out:
            self.shortcut = nn.Sequential(Conv2d(channels, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


class _ResNetStage(nn.Module):
    """Residual stages ``start..stop-1`` of a ``ResNet`` under its own names (``stem.*``,
    ``stages.<i>.*``, ``head.*``), its modules shared, not copied."""

    def __init__(self, model: ResNet, start: int, stop: int):
        super().__init__()
        self.first, self.last = start == 0, stop == len(model.stages)
        self.regression = model.regression
        if self.first:
            self.normalise, self.stem = model.normalise, model.stem
        self.stages = nn.ModuleDict({str(i): model.stages[i] for i in range(start, stop)})
        if self.last:
            self.head = model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.stem(self.normalise(x, self.stem[0].weight.dtype))
        for stage in self.stages.values():
            x = stage(x)
        if not self.last:
            return x
        out = self.head(x.mean(dim=(2, 3)))
        return out.squeeze(1) if self.regression else out


__all__ = ["ResNet"]
