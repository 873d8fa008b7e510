"""The built-in models' text inputs: each text feature's token ids (int64 [B, L], padded) and mask
(bool [B, L], True where a token is; ``common.features.base.MASK_SUFFIX``) as embeddings.

``TextEmbeddings`` holds one token embedding table per text feature (its tokenizer's vocabulary)
and, for the FT-Transformer, one learned position table per feature (its ``max_tokens`` rows):

* ``pooled``: each feature's mean over its unmasked token embeddings ([B, dim]; an empty row
  gives zeros), what the MLP concatenates beside its other inputs (fastText-like);
* ``sequences``: every feature's token embeddings plus positions, one after the other
  ([B, sum L, dim]) with their masks ([B, sum L]), what the FT-Transformer appends to its feature
  tokens and attends over with the padding masked out.

Imported on ranks only (it imports torch); TorchScript-able like the models that hold it.
"""

from typing import Dict, List, Tuple

import torch
from torch import nn

from common.features.base import MASK_SUFFIX


class TextEmbeddings(nn.Module):
    # Declared (this module has no `from __future__ import annotations`): TorchScript cannot infer
    # the type of an empty list (a model without text features).
    names: List[str]
    mask_names: List[str]

    def __init__(self, names: List[str], vocab_sizes: List[int], max_tokens: List[int], dim: int,
                 positions: bool):
        super().__init__()
        self.names = list(names)
        self.mask_names = [name + MASK_SUFFIX for name in names]
        self.dim = dim
        self.tokens = nn.ModuleList(nn.Embedding(size, dim) for size in vocab_sizes)
        self.positions = nn.ModuleList(nn.Embedding(length, dim) for length in max_tokens) if positions \
            else nn.ModuleList()

    def pooled(self, batch: Dict[str, torch.Tensor]) -> List[torch.Tensor]:
        out: List[torch.Tensor] = []
        for j, table in enumerate(self.tokens):
            mask = batch[self.mask_names[j]].unsqueeze(-1).to(table.weight.dtype)
            summed = (table(batch[self.names[j]]) * mask).sum(dim=1)
            out.append(summed / mask.sum(dim=1).clamp(min=1.0))
        return out

    def sequences(self, batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        embedded: List[torch.Tensor] = []
        masks: List[torch.Tensor] = []
        for j, table in enumerate(self.tokens):
            ids = batch[self.names[j]]
            embedded.append(table(ids))
            masks.append(batch[self.mask_names[j]])
        for j, table in enumerate(self.positions):
            # Positions past max_tokens are padding (a width rounded up to pad_multiple): masked, any row will do.
            where = torch.arange(embedded[j].shape[1], device=embedded[j].device).clamp(max=table.num_embeddings - 1)
            embedded[j] = embedded[j] + table(where).unsqueeze(0)
        return torch.cat(embedded, dim=1), torch.cat(masks, dim=1)


def text_parameters(vocab_sizes: List[int], max_tokens: List[int], dim: int, positions: bool) -> int:
    """``TextEmbeddings``' parameters (the model specs' arithmetic; torch-free callers copy it)."""
    return sum(vocab_sizes) * dim + (sum(max_tokens) * dim if positions else 0)


__all__ = ["TextEmbeddings", "text_parameters"]
