"""``model.name: mlp``, the built-in MLP (``training.models.TabularMLP``): embeddings for
categoricals, numeric features as they are, array features flattened, each image feature's
pooled stem features (``training.image_stems``; ``model.kwargs.image_width`` of them, 16 by
default), then ``model.hidden``'s layers. Its parameter count and pipeline blocks follow the
constructor's own arithmetic, which tests/training/test_model_shape.py checks against the built
network. Torch-free."""

from __future__ import annotations

from common.errors import ConfigError
from common.features.arrays import Arrays
from common.features.categorical import Categorical
from common.features.numeric import Numeric
from common.features.text import Text
from training.model_specs.base import BLOCK_NAMES, EXAMPLE, PIPELINE, ModelSpec
from training.model_specs.image_inputs import IMAGES, MLP_STEM_WIDTH, stem_parameters

TEXT_DIM = 16  # training.models.TEXT_DIM, copied: this module is torch-free (test_model_shape checks they agree)


class MLP(ModelSpec):
    network = "training.models:TabularMLP"
    keys = {"hidden": list, "dropout": float, "embedding_dim": None}
    capabilities = frozenset({PIPELINE, BLOCK_NAMES, EXAMPLE})
    feature_kinds = (Numeric.name, Categorical.name, Arrays.name, IMAGES, Text.name)

    def parameters(self, model_cfg, data) -> int:
        args = self.keyword_arguments(model_cfg)
        dims = [args["embedding_dim"] or min(16, (size + 1) // 2) for size in data.vocab_sizes]
        image_width = args.get("image_width") or MLP_STEM_WIDTH  # model.kwargs.image_width; the constructor's default
        count = sum(size * dim for size, dim in zip(data.vocab_sizes, dims))
        count += sum(stem_parameters(channels, image_width) for channels in data.image_channels)
        text_dim = args["embedding_dim"] or TEXT_DIM  # training.models.TEXT_DIM: mean-pooled token embeddings
        count += sum(data.text_vocab_sizes) * text_dim
        width = (data.numeric + sum(dims) + sum(data.array_widths) + len(data.image_channels) * image_width
                 + len(data.text_vocab_sizes) * text_dim)
        for size in [*args["hidden"], data.out]:
            count, width = count + width * size + size, size
        return count

    def block_names(self, model_cfg) -> list[str]:
        args = self.keyword_arguments(model_cfg)
        per_layer = 3 if args["dropout"] else 2  # Linear, ReLU (, Dropout)
        return [f"body.{i * per_layer}" for i in range(len(args["hidden"]) + 1)]

    def size_keys(self, model_cfg) -> str:
        return f"model.hidden={model_cfg.hidden}"

    def check_stages(self, model_cfg, parts: int) -> None:
        # Its blocks are the units a stage holds: the hidden layers plus the output layer.
        if len(model_cfg.hidden) + 1 < parts:
            raise ConfigError(f"model.hidden={model_cfg.hidden} gives {len(model_cfg.hidden) + 1} layer(s), fewer "
                              f"than the {parts} pipeline stage(s) (train.pipeline.stages x stages_per_rank); add "
                              "hidden layers or use fewer stages")


SPEC = MLP()

__all__ = ["MLP", "SPEC"]
