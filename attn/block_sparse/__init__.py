"""Block-sparse prefill attention with per-head modes (0 full, 1 block mask, -1 streaming)."""

from attn.block_sparse.api import (
    block_sparse_attention,
    convert_blockmask_row_reverse,
    effective_block_mask,
    replace_ones_with_count,
)

__all__ = [
    "block_sparse_attention",
    "convert_blockmask_row_reverse",
    "effective_block_mask",
    "replace_ones_with_count",
]
