"""``model.name: ft_transformer``, the built-in FT-Transformer (``training.models.FTTransformer``):
a token per feature (an image feature's from its convolutional stem, ``training.image_stems``),
``model.layers`` transformer blocks of ``model.d_model`` wide tokens and
``model.heads`` heads, the head on the CLS token. Its blocks are the units of pipeline stages and
of FSDP. Its parameter count and blocks follow the constructor's own arithmetic, which
tests/training/test_model_shape.py checks against the built network. Torch-free."""

from __future__ import annotations

from common.errors import ConfigError
from common.features.arrays import Arrays
from common.features.categorical import Categorical
from common.features.numeric import Numeric
from common.features.text import Text
from training.model_specs.base import BLOCK_NAMES, EXAMPLE, FSDP_UNITS, PIPELINE, ModelSpec
from training.model_specs.image_inputs import IMAGES, stem_parameters


class FTTransformer(ModelSpec):
    network = "training.models:FTTransformer"
    keys = {"layers": None, "d_model": None, "heads": None, "dropout": float}
    capabilities = frozenset({PIPELINE, BLOCK_NAMES, EXAMPLE, FSDP_UNITS})
    feature_kinds = (Numeric.name, Categorical.name, Arrays.name, IMAGES, Text.name)

    def parameters(self, model_cfg, data) -> int:
        args = self.keyword_arguments(model_cfg)
        d = args["d_model"]
        ffn = args.get("ffn_width") or 2 * d  # model.kwargs.ffn_width; the constructor's default
        tokenizer = d + 2 * data.numeric * d + sum(data.vocab_sizes) * d + sum(w * d + d for w in data.array_widths)
        tokenizer += sum(stem_parameters(channels, d) for channels in data.image_channels)
        tokenizer += (sum(data.text_vocab_sizes) + sum(data.text_max_tokens)) * d  # text tokens and positions
        block = 2 * 2 * d + 3 * d * d + (d * d + d) + (d * ffn + ffn) + (ffn * d + d)
        head = 2 * d + d * data.out + data.out
        return tokenizer + args["layers"] * block + head

    def block_names(self, model_cfg) -> list[str]:
        return [f"blocks.{i}" for i in range(self.keyword_arguments(model_cfg)["layers"])]

    def size_keys(self, model_cfg) -> str:
        return f"model.d_model={model_cfg.d_model}, model.layers={model_cfg.layers}"

    def check_stages(self, model_cfg, parts: int) -> None:
        if model_cfg.layers < parts:  # a stage holds whole transformer blocks
            raise ConfigError(f"model.layers={model_cfg.layers} is fewer than the {parts} pipeline stage(s) "
                              "(train.pipeline.stages x stages_per_rank): a stage holds whole blocks; raise "
                              "model.layers or use fewer stages")


SPEC = FTTransformer()

__all__ = ["FTTransformer", "SPEC"]
