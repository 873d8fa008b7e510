"""The image part of the built-in networks: a small convolutional stem per image column, which turns
the column's uint8 [B, C, H, W] batch entry into a [B, width] feature vector (the MLP puts it
beside the tabular features, the FT-Transformer makes one token of it).

Normalisation happens here, on the device and in the step's precision: ``(x / 255 - mean) / std``
per channel, with the mean and std the shard job fitted on the train split (the manifest's image
record). So the loader moves uint8, a quarter of the bytes of float32, and the serving program
takes the same uint8 batch the ranks do.

The stem: 3x3 convolution (stride 2) to ``STEM_CHANNELS``, ReLU, 3x3 convolution (stride 2) to
``width``, ReLU, global average pooling. No normalisation layer: a BatchNorm's statistics would be
per rank (``training.resnet`` says what that means), and the stem is meant to be small beside the
tabular model. Any input size and channel count: the pooling makes its output width independent
of the image size. Its parameter count is ``training.model_specs.image_inputs.stem_parameters``.

Imported on ranks only (it imports torch).
"""

from __future__ import annotations

from typing import List

import torch
from torch import nn

from training.model_specs.image_inputs import STEM_CHANNELS


class Conv2d(nn.Conv2d):
    """``nn.Conv2d`` whose strided convolution of a 1 x 1 input runs at stride 1: the same output
    (one position, the same taps), but on torch 2.13's CPU bf16 autocast the weight gradient of a
    strided convolution of a 1 x 1 input came out NaN in 10 to 40 of 100 tries (oneDNN; a 3x3
    stride-2 convolution, threads 1 and 2), which a ResNet's last stage meets on small images."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (Not while tracing an export: the traced program's shapes are fixed, and serving takes no gradient.)
        if not torch.jit.is_tracing() and x.shape[-1] == 1 and x.shape[-2] == 1 and \
                (self.stride[0] != 1 or self.stride[1] != 1):
            return nn.functional.conv2d(x, self.weight, self.bias, 1, self.padding, self.dilation, self.groups)
        return self._conv_forward(x, self.weight, self.bias)


class ImageStem(nn.Module):
    """One image column's uint8 [B, C, H, W] -> float [B, width] (see the module docstring)."""

    def __init__(self, channels: int, mean: List[float], std: List[float], width: int):
        super().__init__()
        self.normalise = Normalise(channels, mean, std)
        self.conv1 = Conv2d(channels, STEM_CHANNELS, 3, stride=2, padding=1)
        self.conv2 = Conv2d(STEM_CHANNELS, width, 3, stride=2, padding=1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.normalise(images, self.conv1.weight.dtype)
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return x.mean(dim=(2, 3))


class Normalise(nn.Module):
    """uint8 images [B, C, H, W] -> ``(x / 255 - mean) / std`` per channel, in the dtype asked for
    (the first layer's weights': the step's precision under FSDP's mixed precision; autocast casts
    again where it runs). The statistics are buffers, not parameters: in the state dict (so a
    published model carries them) but never trained; kept as 1 / (255 std) and mean / std, so
    normalising is one multiply and one subtraction."""

    def __init__(self, channels: int, mean: List[float], std: List[float]):
        super().__init__()
        if len(mean) != channels or len(std) != channels:
            raise ValueError(f"an image of {channels} channel(s) needs {channels} mean and std values, "
                             f"got {len(mean)} and {len(std)}")
        shape = (1, channels, 1, 1)
        self.register_buffer("scale", torch.tensor([1.0 / (255.0 * s) for s in std]).reshape(shape))
        self.register_buffer("shift", torch.tensor([m / s for m, s in zip(mean, std)]).reshape(shape))

    def forward(self, images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (images.to(self.scale.dtype) * self.scale - self.shift).to(dtype)


def image_stems(images: list[dict], width: int) -> nn.ModuleList:
    """One ``ImageStem`` of ``width`` per image record (``image_inputs.image_records``), in order."""
    return nn.ModuleList(ImageStem(r["channels"], r["mean"], r["std"], width) for r in images)


def example_images(images: list[dict], rows: int, device=None) -> list[torch.Tensor]:
    """Made-up uint8 images of each record's shape, for timing pipeline blocks and probing."""
    return [torch.randint(0, 256, (rows, r["channels"], *r["size"]), dtype=torch.uint8, device=device)
            for r in images]


__all__ = ["Conv2d", "ImageStem", "Normalise", "example_images", "image_stems"]
