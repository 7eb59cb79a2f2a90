"""Context-parallel attention: the sequence sharded over a mesh axis (ring and all-gather)."""

from attn.context_parallel.api import (
    allgather_attention,
    allgather_attention_local,
    from_zigzag,
    ring_attention,
    ring_attention_local,
    to_zigzag,
)

__all__ = [
    "allgather_attention",
    "allgather_attention_local",
    "from_zigzag",
    "ring_attention",
    "ring_attention_local",
    "to_zigzag",
]
