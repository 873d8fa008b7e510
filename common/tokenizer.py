"""Tokenizers for text features: training one on a train split's sample, loading one from its
JSON, and turning strings into token ids with the feature's truncation.

A tokenizer is a Hugging Face ``tokenizers`` tokenizer kept as its JSON text (``tokenizer.json``):
the text is what the shard job stores beside the manifest, hashes, ships to executors and what a
model carries, so every stage encodes with the same bytes. Every tokenizer declares two special
tokens the models rely on: ``PAD`` (what a batch is padded with, masked out) and ``UNK`` (a piece
outside the vocabulary). A tokenizer given as a file keeps its own; its pad token is the one its
padding settings name, else ``[PAD]``, ``<pad>`` or ``<PAD>``.

Determinism: ``tokenizers`` 0.22 trains WordPiece and Unigram vocabularies that may differ between
processes on ties (equally frequent merges or pieces are ranked in Rust's per-process hash order,
huggingface/tokenizers#1794); one thread does not fix it. Given the same tokenizer JSON, encoding
is exact, so a re-run with ``tokenizer.file`` (the published one, for instance) gives the same
shard bytes. Nothing here imports Spark; ``tokenizers`` is imported where it is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any, Iterable, Iterator

import numpy as np

from common.errors import DatasetError

PAD = "[PAD]"
UNK = "[UNK]"
SPECIAL_TOKENS = (PAD, UNK)
TOKENIZER_TYPES = ("wordpiece", "bpe", "unigram")
# Pad tokens a tokenizer file may declare, in the order they are looked for (after its padding settings).
PAD_CANDIDATES = (PAD, "<pad>", "<PAD>")
ENCODE_BATCH_ROWS = 4096  # strings per encode_batch call: bounds the Encoding objects held at once


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """``TOKENIZERS_PARALLELISM=false`` while training (what the library reads on each call), the
    caller's environment restored afterwards."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def train_tokenizer(texts: Iterable[str], kind: str, vocab_size: int, lowercase: bool) -> str:
    """A tokenizer of ``kind`` (wordpiece | bpe | unigram) trained on ``texts``, as its JSON text:
    NFC (then lowercase) normalization, whitespace and punctuation pre-tokenization, [PAD] = 0,
    [UNK] = 1."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    if kind == "wordpiece":
        model = models.WordPiece(unk_token=UNK)
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                            show_progress=False)
    elif kind == "bpe":
        model = models.BPE(unk_token=UNK)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False)
    elif kind == "unigram":
        model = models.Unigram()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), unk_token=UNK,
                                          show_progress=False)
    else:
        raise ValueError(f"unknown tokenizer type {kind!r}; expected one of {TOKENIZER_TYPES}")
    tokenizer = Tokenizer(model)
    steps = [normalizers.NFC()] + ([normalizers.Lowercase()] if lowercase else [])
    tokenizer.normalizer = normalizers.Sequence(steps)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with _one_thread():
        tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer.to_str()


class TextEncoder:
    """One tokenizer (its JSON text) with a feature's truncation: strings -> token id lists.

    ``truncate``: ``head`` keeps a row's first ``max_tokens`` tokens, ``tail`` its last, and
    ``quarantine`` none of a longer row (the row rules refuse it first: ``too_many_tokens``)."""

    def __init__(self, tokenizer_json: str, max_tokens: int, truncate: str, where: str = "the tokenizer"):
        from tokenizers import Tokenizer

        try:
            self.tokenizer = Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # noqa: BLE001 - the library raises Exception for any bad JSON
            raise DatasetError(f"{where} is not a tokenizers JSON file: {str(exc).splitlines()[0][:200]}") from None
        # Our truncation and padding, never the file's own.
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.max_tokens = int(max_tokens)
        self.truncate = truncate
        self.pad_id = pad_id(self.tokenizer, where)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, untruncated (no special tokens added)."""
        out: list[list[int]] = []
        for start in range(0, len(texts), ENCODE_BATCH_ROWS):
            out += [e.ids for e in self.tokenizer.encode_batch(texts[start:start + ENCODE_BATCH_ROWS],
                                                                add_special_tokens=False)]
        return out

    def lengths(self, texts: list[str]) -> np.ndarray:
        """Each text's token count before truncation."""
        return np.array([len(ids) for ids in self.token_ids(texts)], dtype=np.int64)

    def truncated(self, ids: list[int]) -> list[int]:
        if len(ids) <= self.max_tokens:
            return ids
        return ids[-self.max_tokens:] if self.truncate == "tail" else ids[:self.max_tokens]

    def encode_arrow(self, texts: list[str]) -> Any:
        """Texts (no None) as an Arrow ``list<int32>`` array of their truncated token ids."""
        import pyarrow as pa

        return pa.array([self.truncated(ids) for ids in self.token_ids(texts)], type=pa.list_(pa.int32()))


def pad_id(tokenizer: Any, where: str) -> int:
    """The tokenizer's pad token id: its padding settings' one, else the first of PAD_CANDIDATES in
    its vocabulary; a DatasetError naming ``where`` when it has none."""
    padding = tokenizer.padding
    if padding and padding.get("pad_id") is not None and padding.get("pad_token"):
        found = tokenizer.token_to_id(padding["pad_token"])
        if found is not None:
            return int(found)
    for token in PAD_CANDIDATES:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return int(found)
    raise DatasetError(f"{where} declares no pad token (none of {list(PAD_CANDIDATES)} is in its vocabulary, "
                       "and it sets no padding); add one, or let the shard job train the tokenizer")


def length_statistics(lengths: np.ndarray, max_tokens: int) -> dict:
    """What the manifest records of token counts: rows, mean, percentiles, the longest, and the
    share of rows longer than ``max_tokens``."""
    if not len(lengths):
        return {"rows": 0}
    p = np.percentile(lengths, [50, 90, 95, 99]).tolist()
    return {"rows": int(len(lengths)), "mean": round(float(lengths.mean()), 3),
            "p50": p[0], "p90": p[1], "p95": p[2], "p99": p[3], "max": int(lengths.max()),
            "truncated_share": round(float((lengths > max_tokens).mean()), 6)}
