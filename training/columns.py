"""Which stored columns make up a batch (``Columns``, from the manifest's feature and label spec)
and the conversion of Arrow tables of those columns into the batch's numpy arrays.

A batch holds each feature kind's entries (``FeatureSpec.batch_layout``: scalar columns stacked
side by side into one [n, k] entry, a list column as [n, *shape], or an encoded column, an image's
bytes, as an object array of its values, which the loader's decode stage decodes batch by batch), ``label`` (int64 or float32 [n];
a multilabel label's multi-hot float32 [n, num_classes]),
``teacher`` (the soft targets, when read) and ``_row`` int64 [n]. The conversion reads the Arrow
buffers directly, never through pandas or Python per row, and can permute the rows and reuse
memory (``empty``) on the way, so a shuffle buffer is converted once, already in batch order.
This module converts tables it is given: it opens no file and imports neither torch nor petastorm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.errors import DatasetError
from common.dataset import ROW_INDEX, TEACHER_COLUMN, Manifest
from common.features.base import MASK_SUFFIX, BatchEntry
from common.tasks import label_task


@dataclass(frozen=True)
class Columns:
    """Which stored columns make up a batch, and how (from the manifest's feature/label spec)."""

    features: tuple[BatchEntry, ...]  # the feature kinds' batch entries, in order
    label: str
    label_dtype: str  # its task's stored label dtype (common.tasks): "int64" (classes) or "float32"
    # The teacher's soft targets (a batch's ``teacher``): their shape per row, () for regression;
    # None: not read (the run does not distill).
    teacher: tuple[int, ...] | None = None
    label_shape: tuple[int, ...] = ()  # a multilabel label's list column: (num_classes,)
    pad_multiple: int = 1  # a ragged entry's width in a batch is a multiple of this (data.batching.pad_multiple)

    @property
    def stored(self) -> list[str]:
        teacher = [TEACHER_COLUMN] if self.teacher is not None else []
        return [*(c for entry in self.features for c in entry.columns), self.label, *teacher, ROW_INDEX]


def columns_for(manifest: Manifest, teacher: bool = False, pad_multiple: int = 1) -> Columns:
    """The batch columns; ``teacher``: with the soft targets (the manifest must record a teacher)."""
    features, label = manifest.features, manifest.label
    task = label_task(label.task)
    return Columns(features=tuple(features.batch_layout()), label=label.name, label_dtype=task.label_dtype,
                   teacher=manifest.teacher.shape if teacher else None, label_shape=task.label_shape(label.num_classes),
                   pad_multiple=pad_multiple)


# A ragged entry's row lengths in a shuffle buffer's arrays (``tables_to_arrays``); ``batch_of``
# turns them into the batch's mask.
LENGTHS_SUFFIX = "#lengths"


def batch_of(arrays: dict[str, np.ndarray], columns: Columns) -> dict[str, np.ndarray]:
    """Rows of a buffer's arrays (a slice) as the batch a network receives: each ragged entry cut
    (or padded) to the rows' longest, rounded up to ``pad_multiple``, as int64, with its mask
    under ``key + MASK_SUFFIX``; every other entry as it is."""
    out = dict(arrays)
    for entry in columns.features:
        if not entry.ragged:
            continue
        ids, lengths = out[entry.key], out.pop(entry.key + LENGTHS_SUFFIX)
        width = max(int(lengths.max()) if len(lengths) else 0, 1)
        width = -(-width // columns.pad_multiple) * columns.pad_multiple
        batch = np.full((len(ids), width), entry.pad, dtype=np.int64)
        keep = min(width, ids.shape[1])
        batch[:, :keep] = ids[:, :keep]
        out[entry.key] = batch
        out[entry.key + MASK_SUFFIX] = np.arange(width)[None, :] < lengths[:, None]
    return out


def table_to_arrays(table, columns: Columns) -> dict[str, np.ndarray]:
    """Arrow table of stored columns -> the batch arrays (columns stacked as the model wants them)."""
    return tables_to_arrays([table], columns)


def tables_to_arrays(tables: list, columns: Columns, lead: dict | None = None,
                     order: np.ndarray | None = None, empty=np.empty) -> dict[str, np.ndarray]:
    """The rows of ``lead`` (batch arrays: the rows a shuffle buffer carries over), then those of
    the Arrow ``tables``, as new batch arrays; in ``order`` (a permutation of those rows) if given.
    ``empty(shape, dtype)`` makes the arrays (``BufferMemory.empty`` reuses memory).

    The flat columns are stacked into [n, k] arrays, then gathered; array features, soft targets
    and scalars are gathered from the Arrow buffers (one copy when the rows are one row group's).
    """
    rows = (len(lead[ROW_INDEX]) if lead else 0) + sum(t.num_rows for t in tables)
    out: dict[str, np.ndarray] = {
        entry.key: _in_order(_stacked(tables, entry.columns, np.dtype(entry.dtype), lead and lead[entry.key], empty),
                             order, empty)
        for entry in columns.features if not entry.shape
    }
    for entry in columns.features:
        if entry.ragged:
            out[entry.key], out[entry.key + LENGTHS_SUFFIX] = _ragged(tables, entry, lead, order)
    lists = [(entry.key, entry.columns[0], entry.shape, np.dtype(entry.dtype)) for entry in columns.features
             if entry.shape and not entry.ragged and entry.decode is None]
    for entry in columns.features:  # still encoded: the stored values, decoded per batch (training.image_loading)
        if entry.decode is not None:
            parts = ([lead[entry.key]] if lead else []) + [_encoded_column(table, entry.columns[0]) for table in tables]
            out[entry.key] = _gathered(parts, (rows,), np.dtype(object), order, empty)
    scalars = [(ROW_INDEX, ROW_INDEX, np.int64)]
    if columns.label_shape:  # a multilabel label's multi-hot vector: a list column
        lists.append(("label", columns.label, columns.label_shape, np.dtype(columns.label_dtype)))
    else:
        scalars.insert(0, (columns.label, "label", np.dtype(columns.label_dtype)))
    if columns.teacher:  # class probabilities: a list column
        lists.append((TEACHER_COLUMN, TEACHER_COLUMN, columns.teacher, np.float32))
    elif columns.teacher is not None:  # a regression teacher's value
        scalars.append((TEACHER_COLUMN, TEACHER_COLUMN, np.float32))
    for key, name, shape, dtype in lists:
        parts = ([lead[key]] if lead else []) + [_list_column(table, name, shape) for table in tables]
        out[key] = _gathered(parts, (rows, *shape), dtype, order, empty)
    for name, key, dtype in scalars:
        parts = ([lead[key]] if lead else []) + [chunk.to_numpy() for table in tables
                                                 for chunk in _non_null(table, name).chunks]
        out[key] = _gathered(parts, (rows,), dtype, order, empty)
    return out


def _in_order(values: np.ndarray, order: np.ndarray | None, empty=np.empty) -> np.ndarray:
    if order is None:
        return values
    # np.take along axis 0 is 2-3x faster than fancy indexing for [n, k] arrays. mode="clip"
    # (``order`` is a permutation, nothing to clip): with the default "raise", numpy gathers into
    # a temporary array first and copies that into ``out``.
    return np.take(values, order, axis=0, out=empty(values.shape, values.dtype), mode="clip")


def _gathered(parts: list[np.ndarray], shape: tuple, dtype, order: np.ndarray | None, empty=np.empty) -> np.ndarray:
    """``parts`` (consecutive blocks of rows) as one new array of ``shape``, rows in ``order`` if
    given. One row group's part (the usual case) is gathered straight from its Arrow buffer;
    several are joined first (gathering part by part measured no cheaper)."""
    out = empty(shape, dtype)
    if order is None:
        pos = 0
        for part in parts:
            out[pos:pos + len(part)] = part  # casts to the target dtype on the way
            pos += len(part)
        return out
    if len(parts) == 1:
        source = parts[0].astype(dtype, copy=False)
    else:  # joined in memory from ``empty`` too; "unsafe": the cast astype makes
        source = np.concatenate(parts, out=empty(shape, dtype), casting="unsafe")
    np.take(source, order, axis=0, out=out, mode="clip")  # "clip": see _in_order
    return out


# Rows per block of the transposition in ``_stacked``: a [k, block] slab stays in cache while it
# is written out row-major (a whole-buffer transpose took 1.4-1.8x as long).
_BLOCK_ROWS = 16_384


def _stacked(tables: list, names, dtype, lead: np.ndarray | None = None, empty=np.empty) -> np.ndarray:
    """``lead`` ([m, len(names)], if given), then columns ``names`` of ``tables``, as one
    C-contiguous [m + n, len(names)] array.

    Each block of rows is filled column by column into a small [k, block] array (contiguous
    writes) and transposed into place: about 3x cheaper than writing each column into a strided
    slice of the [n, k] array, and the block stays in cache.
    """
    pos = len(lead) if lead is not None else 0
    out = empty((pos + sum(t.num_rows for t in tables), len(names)), dtype)
    if not names:
        return out
    if pos:
        out[:pos] = lead
    block = np.empty((len(names), _BLOCK_ROWS), dtype=dtype)
    for table in tables:
        columns = [_column_values(table, name) for name in names]
        rows = table.num_rows
        for start in range(0, rows, _BLOCK_ROWS):
            size = min(_BLOCK_ROWS, rows - start)
            for j, values in enumerate(columns):
                block[j, :size] = values[start:start + size]  # casts to the target dtype on the way
            out[pos + start:pos + start + size] = block[:, :size].T
        pos += rows
    return out


def _column_values(table, name: str) -> np.ndarray:
    """A flat column as numpy (zero-copy for one chunk of a primitive type without nulls)."""
    column = _non_null(table, name)
    if column.num_chunks == 1:
        return column.chunk(0).to_numpy()
    return np.concatenate([chunk.to_numpy() for chunk in column.chunks]) if column.num_chunks else np.empty(0)


def _non_null(table, name: str):
    column = table.column(name)
    if column.null_count:
        raise DatasetError(f"column {name!r} has {column.null_count} null value(s) in a stored shard; "
                           "the manifest contract says stored features are already imputed")
    return column


def _encoded_column(table, name: str) -> np.ndarray:
    """A binary column (encoded values) as an object array of its bytes."""
    return _non_null(table, name).to_numpy()


def _ragged(tables: list, entry: BatchEntry, lead: dict | None, order: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray]:
    """A ragged list column (``lead``'s rows, then the tables') as (int32 [rows, W] padded with
    ``entry.pad``, W the longest row here, and each row's length), in ``order`` if given. Stored
    as int32 in the buffer; ``batch_of`` widens a batch's rows to int64."""
    blocks = []
    if lead:
        blocks.append((lead[entry.key], lead[entry.key + LENGTHS_SUFFIX], None))
    for table in tables:
        array = table.column(entry.columns[0]).combine_chunks()
        if array.null_count:
            raise DatasetError(f"column {entry.columns[0]!r} has {array.null_count} null row(s) in a stored shard")
        offsets = array.offsets.to_numpy().astype(np.int64)
        values = array.flatten().to_numpy(zero_copy_only=False)  # respects the array's offset after slicing
        blocks.append((values, np.diff(offsets), offsets - offsets[0]))
    lengths = np.concatenate([b[1] for b in blocks]) if blocks else np.zeros(0, dtype=np.int64)
    if len(lengths) and lengths.max() > entry.shape[0]:
        raise DatasetError(f"column {entry.columns[0]!r}: a stored row holds {int(lengths.max())} values, more than "
                           f"the manifest's {entry.shape[0]}")
    out = np.full((len(lengths), max(int(lengths.max()) if len(lengths) else 0, 1)), entry.pad, dtype=np.int32)
    pos = 0
    for values, block_lengths, offsets in blocks:
        n = len(block_lengths)
        if offsets is None:  # lead rows: already padded
            out[pos:pos + n, :values.shape[1]] = values
        elif len(values):
            rows = np.repeat(np.arange(n), block_lengths)
            out[pos + rows, np.arange(len(values)) - offsets[:-1][rows]] = values
        pos += n
    if order is not None:
        out, lengths = out[order], lengths[order]
    return out, lengths.astype(np.int64)


def _list_column(table, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A list<float> column -> float32 [n, *shape] straight from the flat values buffer."""
    width = int(np.prod(shape))
    array = table.column(name).combine_chunks()
    n = len(array)
    if array.null_count:
        raise DatasetError(f"array column {name!r} has {array.null_count} null row(s) in a stored shard")
    flat = array.flatten()  # respects the array's offset after slicing/filtering
    if hasattr(array, "offsets"):
        offsets = array.offsets.to_numpy()
        if not np.array_equal(np.diff(offsets), np.full(n, width)):
            raise DatasetError(f"array column {name!r}: every row must hold {width} values (shape {list(shape)})")
    values = flat.to_numpy(zero_copy_only=False)
    if values.dtype != np.float32:
        values = values.astype(np.float32)
    return values.reshape((n, *shape))


__all__ = ["Columns", "batch_of", "columns_for", "table_to_arrays", "tables_to_arrays"]
