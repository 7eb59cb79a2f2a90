"""XAttention: antidiagonal block-importance estimate and threshold block selection."""

from attn.xattention.api import find_blocks, xattn_estimate

__all__ = ["find_blocks", "xattn_estimate"]
