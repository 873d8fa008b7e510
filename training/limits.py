"""Fixed ceilings on counts that size an allocation or a set of threads or processes before any
data is seen: far above real use, low enough that a typo fails at config time, not as an
out-of-memory kill (hidden=[10000000000] would ask torch for a 40 GB-per-row weight).

One home for them, below the config tree (``training.config``) and the config sections that
strategies own (``training.strategies.pipeline``); imports nothing.
"""

MAX_WIDTH = 1 << 20  # units of one MLP layer, the embedding dimension
MAX_BATCH_ROWS = 1 << 24  # batch_size, shuffle_buffer_rows, a pipeline's micro-batches
MAX_READER_THREADS = 256  # reader_workers
MAX_PREFETCH = 1024  # prefetch_row_groups
MAX_RANKS = 4096  # num_proc, a pipeline's stages

__all__ = ["MAX_BATCH_ROWS", "MAX_PREFETCH", "MAX_RANKS", "MAX_READER_THREADS", "MAX_WIDTH"]
