"""What the built-in networks' image stems (``training.image_stems``) cost, as the torch-free specs
count it: the stem's sizes, its parameters, and the image records a network is built from.

Torch-free: the driver's parameter arithmetic (``training.model_shape``) reads it.
"""

from __future__ import annotations

from common.features.images import Images

IMAGES = Images.name  # the images kind's manifest section
STEM_CHANNELS = 8  # the stem's first convolution's output channels
MLP_STEM_WIDTH = 16  # an image's features beside the tabular ones in the MLP (its constructor's default)


def image_records(feature_spec: dict, section: str) -> list[dict]:
    """The network's image arguments from the manifest's image records (``section``: the images
    kind's manifest section): name, channels, size, mean, std, as plain values (model.json keeps them)."""
    return [{"name": r["name"], "channels": int(r["channels"]), "size": [int(s) for s in r["size"]],
             "mean": [float(m) for m in r["mean"]], "std": [float(s) for s in r["std"]]}
            for r in feature_spec.get(section, [])]


def stem_parameters(channels: int, width: int) -> int:
    """The parameters of one ``ImageStem(channels, ..., width)``: its two convolutions' weights and biases."""
    return channels * STEM_CHANNELS * 9 + STEM_CHANNELS + STEM_CHANNELS * width * 9 + width


__all__ = ["IMAGES", "MLP_STEM_WIDTH", "STEM_CHANNELS", "image_records", "stem_parameters"]
