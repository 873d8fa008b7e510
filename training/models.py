"""The built-in models' networks, built from the manifest's feature and label spec (their specs,
``training.model_specs``, say which keys and capabilities each has and build them).

Every model takes the batch dict the loader yields (``numeric`` float32 [B, n], ``categorical``
int64 [B, k], one float32 [B, *shape] per array feature, one uint8 [B, C, H, W] per image feature,
which its own stem normalises and reads: ``training.image_stems``) and returns logits [B, num_classes]
(classification) or values [B] (regression). A plug-in ``"package.module:factory"`` is called
as ``factory(feature_spec, label_spec, **kwargs)`` with the manifest's plain dicts (the label's
``LabelSpec.to_record()``: the manifest's own record) and must
return such a ``torch.nn.Module`` (TorchScript-able, for the exported serving program).
``training.model_specs.build_model`` builds either.

A model that can train in pipeline stages (``train.pipeline``, ``training.strategies.pipeline``)
says how to cut it: ``pipeline_inputs()`` (the batch keys its first stage takes, positionally),
``pipeline_blocks()`` (how many consecutive blocks a stage boundary may fall between) and
``pipeline_stage(start, stop)``: a module holding blocks ``start..stop-1`` under this model's own
parameter names (so a stage's state dict is a piece of the model's), whose forward takes the
previous stage's output (the first: the inputs) and returns the next one's input (the last: the
model's output). Chained, the stages compute exactly what ``forward`` does. Built by hand from the
model's own modules, never traced. Optional: ``pipeline_block_names()`` (each block's module name,
what an explicit ``train.pipeline.split`` lists) and ``pipeline_example(rows, device)`` (made-up
first-stage inputs, which ``split: auto`` times each block on). A model may also name the modules
FSDP2 shards one by one (``fsdp_units()``). A built-in model's spec declares which of these its
network has; the strategies ask the spec (``training.model_specs.spec_of``), never the network.

Imported on ranks only (it imports torch).
"""

from typing import Dict, List, Optional

import torch
from torch import nn

from common.features.arrays import Arrays
from common.features.categorical import RESERVED_INDICES, Categorical
from common.features.numeric import Numeric
from common.features.text import Text
from common.tasks import label_task
from training.image_stems import example_images, image_stems
from training.model_specs.image_inputs import IMAGES, MLP_STEM_WIDTH, image_records
from training.text_encoder import TextEmbeddings


class TabularMLP(nn.Module):
    """Embeddings for categoricals, numeric features as they are, array features flattened, each
    image feature through its own stem (``image_width`` pooled features)."""

    # Declared (and this module has no `from __future__ import annotations`, which would make it a
    # string TorchScript cannot read): TorchScript cannot infer the type of an empty list (no array
    # or image features).
    array_names: List[str]
    image_names: List[str]

    def __init__(self, num_numeric: int, vocab_sizes: list[int], array_names: list[str], array_widths: list[int],
                 out_dim: int, hidden: list[int], dropout: float = 0.0, embedding_dim: int | None = None,
                 regression: bool = False, images: list[dict] | None = None, image_width: int = MLP_STEM_WIDTH,
                 text_names: list[str] = (), text_vocab_sizes: list[int] = (), text_max_tokens: list[int] = ()):
        super().__init__()
        # The batch entries the feature kinds give (common.features): the network's inputs.
        self.numeric_key, self.categorical_key = Numeric.name, Categorical.name
        self.array_names, self.array_widths = list(array_names), list(array_widths)
        self.images = [dict(r) for r in images or []]
        self.image_names = [r["name"] for r in self.images]
        self.regression = regression
        self.num_numeric = num_numeric
        dims = [embedding_dim or min(16, (size + 1) // 2) for size in vocab_sizes]
        self.embeddings = nn.ModuleList(nn.Embedding(size, dim) for size, dim in zip(vocab_sizes, dims))
        self.image_stems = image_stems(self.images, image_width)
        # Text: each feature's mean-pooled token embeddings (training.text_encoder).
        self.text = TextEmbeddings(list(text_names), list(text_vocab_sizes), list(text_max_tokens),
                                   embedding_dim or TEXT_DIM, positions=False)
        width = (num_numeric + sum(dims) + sum(array_widths) + len(self.images) * image_width
                 + len(text_names) * self.text.dim)
        layers: list[nn.Module] = []
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = size
        layers.append(nn.Linear(width, out_dim))
        self.body = nn.Sequential(*layers)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [batch[self.numeric_key]]
        categorical = batch[self.categorical_key]
        for j, embedding in enumerate(self.embeddings):
            parts.append(embedding(categorical[:, j]))
        for name in self.array_names:
            value = batch[name]
            parts.append(value.reshape(value.shape[0], -1))
        for j, stem in enumerate(self.image_stems):
            parts.append(stem(batch[self.image_names[j]]))
        parts.extend(self.text.pooled(batch))
        out = self.body(torch.cat(parts, dim=1))
        if self.regression:
            return out.squeeze(1)
        return out

    # --- pipeline stages (see the module docstring) -------------------------------------------------

    def pipeline_inputs(self) -> list[str]:
        return [self.numeric_key, self.categorical_key, *self.array_names, *self.image_names]

    def pipeline_blocks(self) -> int:
        """One block per Linear with the activation and dropout after it: the input embeddings
        and concatenation go with the first, the regression squeeze with the last."""
        return len(self._block_starts())

    def pipeline_stage(self, start: int, stop: int) -> nn.Module:
        return _MLPStage(self, start, stop)

    def pipeline_block_names(self) -> list[str]:
        return [f"body.{i}" for i in self._block_starts()]

    def pipeline_example(self, rows: int, device=None) -> tuple[torch.Tensor, ...]:
        return (*_example_inputs(self.num_numeric, [e.num_embeddings for e in self.embeddings], self.array_widths,
                                 rows, device), *example_images(self.images, rows, device))

    def _block_starts(self) -> list[int]:
        return [i for i, layer in enumerate(self.body) if isinstance(layer, nn.Linear)]


class _MLPStage(nn.Module):
    """Blocks ``start..stop-1`` of a ``TabularMLP``: its own modules (shared, not copied) under its
    own names (``embeddings.0.weight``, ``body.2.weight``)."""

    def __init__(self, mlp: TabularMLP, start: int, stop: int):
        super().__init__()
        starts = mlp._block_starts() + [len(mlp.body)]
        self.first, self.last = start == 0, stop == len(starts) - 1
        self.arrays, self.regression = len(mlp.array_names), mlp.regression
        if self.first:
            self.embeddings = mlp.embeddings
            self.image_stems = mlp.image_stems
        # A ModuleDict keyed by the Sequential's own indices keeps the names body.<i>.*.
        self.body = nn.ModuleDict({str(i): mlp.body[i] for i in range(starts[start], starts[stop])})

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.first:
            # TabularMLP.forward's input part, on the batch's tensors in pipeline_inputs() order.
            numeric, categorical, *rest = inputs
            arrays, images = rest[:self.arrays], rest[self.arrays:]
            parts = [numeric] + [embedding(categorical[:, j]) for j, embedding in enumerate(self.embeddings)]
            parts += [value.reshape(value.shape[0], -1) for value in arrays]
            parts += [stem(value) for stem, value in zip(self.image_stems, images)]
            out = torch.cat(parts, dim=1)
        else:
            (out,) = inputs
        for layer in self.body.values():
            out = layer(out)
        return out.squeeze(1) if self.last and self.regression else out


class FTTransformer(nn.Module):
    """FT-Transformer (Gorishniy et al., 2021): a feature tokenizer turns every feature into one
    ``d_model`` token (a numeric value scales its own learned vector plus a bias, a category looks
    up its own embedding table, an array feature is flattened through its own Linear, an image
    feature goes through its own convolutional stem of ``d_model`` channels), a learned
    CLS token goes first, ``layers`` identical pre-norm transformer blocks (``heads``-head
    self-attention, then a feed-forward of ``ffn_width``, default 2 x d_model) mix the tokens, and
    the head reads the CLS token. The blocks are the units of pipeline stages and FSDP."""

    # Declared (and this module has no `from __future__ import annotations`, which would make it a
    # string TorchScript cannot read): TorchScript cannot infer the type of an empty list (no array
    # or image features).
    array_names: List[str]
    image_names: List[str]

    def __init__(self, num_numeric: int, vocab_sizes: list[int], array_names: list[str], array_widths: list[int],
                 out_dim: int, layers: int, d_model: int, heads: int, dropout: float = 0.0,
                 ffn_width: int | None = None, regression: bool = False, images: list[dict] | None = None,
                 text_names: list[str] = (), text_vocab_sizes: list[int] = (), text_max_tokens: list[int] = ()):
        super().__init__()
        # The batch entries the feature kinds give (common.features): the network's inputs.
        self.numeric_key, self.categorical_key = Numeric.name, Categorical.name
        self.array_names = list(array_names)
        self.images = [dict(r) for r in images or []]
        self.image_names = [r["name"] for r in self.images]
        self.regression = regression
        self.tokenizer = _FeatureTokenizer(num_numeric, vocab_sizes, array_widths, d_model, self.images)
        # Text: each feature's tokens (embedding + position) after the feature tokens, padding masked out.
        self.text = TextEmbeddings(list(text_names), list(text_vocab_sizes), list(text_max_tokens), d_model,
                                   positions=True)
        self.has_text = len(text_names) > 0
        self.blocks = nn.ModuleList(_TransformerBlock(d_model, heads, ffn_width or 2 * d_model, dropout)
                                    for _ in range(layers))
        self.head = _CLSHead(d_model, out_dim)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        arrays = [batch[name] for name in self.array_names]
        images = [batch[name] for name in self.image_names]
        tokens = self.tokenizer(batch[self.numeric_key], batch[self.categorical_key], arrays, images)
        mask: Optional[torch.Tensor] = None
        if self.has_text:
            text, text_mask = self.text.sequences(batch)
            mask = torch.cat([torch.ones(tokens.shape[0], tokens.shape[1], dtype=torch.bool, device=tokens.device),
                              text_mask], dim=1)
            tokens = torch.cat([tokens, text.to(tokens.dtype)], dim=1)
        for block in self.blocks:
            tokens = block(tokens, mask)
        out = self.head(tokens)
        if self.regression:
            return out.squeeze(1)
        return out

    def fsdp_units(self) -> list[nn.Module]:
        """FSDP2's units (``training.strategies.fsdp``): the tokenizer, each block, the head."""
        return [self.tokenizer, *self.blocks, self.head]

    # --- pipeline stages (see the module docstring): whole blocks; the tokenizer goes with the
    # first, the head (and the regression squeeze) with the last.

    def pipeline_inputs(self) -> list[str]:
        return [self.numeric_key, self.categorical_key, *self.array_names, *self.image_names]

    def pipeline_blocks(self) -> int:
        return len(self.blocks)

    def pipeline_stage(self, start: int, stop: int) -> nn.Module:
        return _FTStage(self, start, stop)

    def pipeline_block_names(self) -> list[str]:
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    def pipeline_example(self, rows: int, device=None) -> tuple[torch.Tensor, ...]:
        tokenizer = self.tokenizer
        return (*_example_inputs(tokenizer.numeric_weight.shape[0], [e.num_embeddings for e in tokenizer.embeddings],
                                 [a.in_features for a in tokenizer.arrays], rows, device),
                *example_images(self.images, rows, device))


class _FeatureTokenizer(nn.Module):
    """The batch's features as tokens [B, 1 + numeric + categorical + arrays + images, d_model], CLS first."""

    def __init__(self, num_numeric: int, vocab_sizes: list[int], array_widths: list[int], d_model: int,
                 images: list[dict] | None = None):
        super().__init__()
        bound = d_model ** -0.5
        self.cls = nn.Parameter(torch.empty(d_model).uniform_(-bound, bound))
        self.numeric_weight = nn.Parameter(torch.empty(num_numeric, d_model).uniform_(-bound, bound))
        self.numeric_bias = nn.Parameter(torch.empty(num_numeric, d_model).uniform_(-bound, bound))
        self.embeddings = nn.ModuleList(nn.Embedding(size, d_model) for size in vocab_sizes)
        self.arrays = nn.ModuleList(nn.Linear(width, d_model) for width in array_widths)
        self.image_stems = image_stems(images or [], d_model)

    def forward(self, numeric: torch.Tensor, categorical: torch.Tensor, arrays: List[torch.Tensor],
                images: List[torch.Tensor]) -> torch.Tensor:
        rows = numeric.shape[0]
        tokens = [self.cls.expand(rows, 1, -1), numeric.unsqueeze(-1) * self.numeric_weight + self.numeric_bias]
        for j, embedding in enumerate(self.embeddings):
            tokens.append(embedding(categorical[:, j]).unsqueeze(1))
        for j, linear in enumerate(self.arrays):
            tokens.append(linear(arrays[j].reshape(rows, -1)).unsqueeze(1))
        for j, stem in enumerate(self.image_stems):
            tokens.append(stem(images[j]).unsqueeze(1))
        return torch.cat(tokens, dim=1)


class _TransformerBlock(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + feed-forward(norm(x))."""

    def __init__(self, d_model: int, heads: int, ffn_width: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(d_model)
        # No bias: a key bias only shifts every score of a query alike, which softmax ignores; its
        # gradient is rounding noise that Adam would blow up into steps.
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.attention_out = nn.Linear(d_model, d_model)
        self.ffn_norm = nn.LayerNorm(d_model)
        self.ffn = nn.Sequential(nn.Linear(d_model, ffn_width), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(ffn_width, d_model))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``mask``: [B, T], True where a token may be attended to (padding is not); None: all."""
        rows, tokens, width = x.shape
        qkv = self.qkv(self.attention_norm(x)).reshape(rows, tokens, 3, self.heads, width // self.heads)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # [3, B, heads, T, head width]
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = q @ k.transpose(-2, -1) * (width // self.heads) ** -0.5
        if mask is not None:  # the CLS token is never masked, so no row's softmax is over nothing
            scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        mixed = (weights @ v).transpose(1, 2).reshape(rows, tokens, width)
        x = x + self.dropout(self.attention_out(mixed))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class _CLSHead(nn.Module):
    def __init__(self, d_model: int, out_dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.linear = nn.Linear(d_model, out_dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.relu(self.norm(tokens[:, 0])))


class _FTStage(nn.Module):
    """Blocks ``start..stop-1`` of an ``FTTransformer`` under its own names (``tokenizer.*``,
    ``blocks.<i>.*``, ``head.*``), its modules shared, not copied."""

    def __init__(self, model: FTTransformer, start: int, stop: int):
        super().__init__()
        self.first, self.last = start == 0, stop == len(model.blocks)
        self.regression = model.regression
        self.arrays = len(model.array_names)
        if self.first:
            self.tokenizer = model.tokenizer
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(start, stop)})
        if self.last:
            self.head = model.head

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if self.first:
            numeric, categorical, *rest = inputs
            out = self.tokenizer(numeric, categorical, list(rest[:self.arrays]), list(rest[self.arrays:]))
        else:
            (out,) = inputs
        for block in self.blocks.values():
            out = block(out)
        if not self.last:
            return out
        out = self.head(out)
        return out.squeeze(1) if self.regression else out


def _example_inputs(numeric: int, vocab_sizes: list[int], array_widths: list[int], rows: int,
                    device=None) -> tuple[torch.Tensor, ...]:
    """Made-up inputs of the first stage (``pipeline_inputs()`` order; arrays flat), for timing."""
    return (torch.randn(rows, numeric, device=device),
            torch.stack([torch.randint(0, size, (rows,), device=device) for size in vocab_sizes], dim=1)
            if vocab_sizes else torch.zeros(rows, 0, dtype=torch.int64, device=device),
            *(torch.randn(rows, width, device=device) for width in array_widths))


TEXT_DIM = 16  # the MLP's text embedding width where model.embedding_dim is unset (its spec's copy: model_specs/mlp.py)


def data_arguments(feature_spec: dict, label_spec: dict) -> dict:
    """A built-in model's constructor arguments that come from the manifest's feature and label spec
    (``images`` only where the dataset has image features: the models published before them rebuild
    from model.json as they were)."""
    arrays = feature_spec.get(Arrays.name, [])
    task = label_task(label_spec["task"])
    images = image_records(feature_spec, IMAGES)
    text = feature_spec.get(Text.name, [])
    extra = dict(text_names=[t["name"] for t in text], text_vocab_sizes=[int(t["vocab_size"]) for t in text],
                 text_max_tokens=[int(t["max_tokens"]) for t in text]) if text else {}
    return dict(
        **({"images": images} if images else {}), **extra,
        num_numeric=len(feature_spec.get(Numeric.name, [])),
        vocab_sizes=[int(c.get("num_embeddings", len(c["vocab"]) + RESERVED_INDICES))
                     for c in feature_spec.get(Categorical.name, [])],
        array_names=[a["name"] for a in arrays],
        array_widths=[int(torch.tensor(a["shape"]).prod()) for a in arrays],
        out_dim=task.output_width(label_spec.get("num_classes")), regression=not task.classes)


def mlp_arguments(feature_spec: dict, label_spec: dict, hidden: list[int], dropout: float = 0.0,
                  embedding_dim: int | None = None, **overrides) -> dict:
    """The MLP's constructor arguments, as plain values (stored in model.json, so it rebuilds)."""
    args = dict(data_arguments(feature_spec, label_spec), hidden=list(hidden), dropout=float(dropout),
                embedding_dim=embedding_dim)
    args.update(overrides)
    return args


__all__ = ["FTTransformer", "TabularMLP", "data_arguments", "mlp_arguments"]
