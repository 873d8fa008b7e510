"""``model.name: resnet``, the built-in ResNet-18/34 (``training.resnet.ResNet``) over the
dataset's one image column: ``model.depth`` (18 or 34) and ``model.width`` (the first stage's
channels, 64 in the paper) are its own. Its parameter count and blocks (the four residual stages,
the units of pipeline stages and of FSDP) follow the constructor's own arithmetic, which
tests/training/test_model_shape.py checks against the built network. It takes image features
only, exactly one column of them. Torch-free."""

from __future__ import annotations

from common.errors import ConfigError, DatasetError
from training.model_specs.base import BLOCK_NAMES, EXAMPLE, FSDP_UNITS, PIPELINE, ModelSpec
from training.model_specs.image_inputs import IMAGES

BLOCKS_PER_STAGE = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3)}  # basic blocks in each of the four stages


class ResNetSpec(ModelSpec):
    network = "training.resnet:ResNet"
    keys = {"depth": int, "width": int}
    capabilities = frozenset({PIPELINE, BLOCK_NAMES, EXAMPLE, FSDP_UNITS})
    feature_kinds = (IMAGES,)

    def check_features(self, model_cfg, feature_spec: dict, where: str) -> None:
        images = [r["name"] for r in feature_spec.get(IMAGES, [])]
        if len(images) != 1:
            raise DatasetError(f"{where}: field 'features.images' holds {images}, but model.name=resnet takes exactly "
                               "one image column; shard the dataset with one `features.images` column, or use "
                               "model.name=mlp or ft_transformer (a stem per image column)")

    def parameters(self, model_cfg, data) -> int:
        args = self.keyword_arguments(model_cfg)
        width, channels = args["width"], data.image_channels[0] if data.image_channels else 3
        count = channels * width * 49 + 2 * width  # the stem: a 7x7 convolution, a BatchNorm
        have = width
        for index, blocks in enumerate(BLOCKS_PER_STAGE[args["depth"]]):
            out = width << index
            for block in range(blocks):
                inputs = have if block == 0 else out
                count += inputs * out * 9 + out * out * 9 + 4 * out  # two 3x3 convolutions, two BatchNorms
                if inputs != out or (block == 0 and index > 0):
                    count += inputs * out + 2 * out  # the 1x1 shortcut and its BatchNorm
            have = out
        return count + have * data.out + data.out

    def block_names(self, model_cfg) -> list[str]:
        return [f"stages.{i}" for i in range(4)]

    def size_keys(self, model_cfg) -> str:
        return f"model.depth={model_cfg.depth}, model.width={model_cfg.width}"

    def check_stages(self, model_cfg, parts: int) -> None:
        if parts > 4:  # a stage holds whole residual stages
            raise ConfigError(f"model.name=resnet has 4 residual stages, fewer than the {parts} pipeline stage(s) "
                              "(train.pipeline.stages x stages_per_rank): a pipeline stage holds whole residual "
                              "stages; use at most 4")


SPEC = ResNetSpec()

__all__ = ["BLOCKS_PER_STAGE", "ResNetSpec", "SPEC"]
