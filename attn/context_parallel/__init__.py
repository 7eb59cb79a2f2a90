"""Context parallelism: the sequence sharded over a mesh axis: attention (ring and all-gather) and
Gated DeltaNet (the chunk state passed along the ring)."""

from attn.context_parallel.api import (
    allgather_attention,
    allgather_attention_local,
    from_zigzag,
    ring_attention,
    ring_attention_local,
    ring_gdn,
    ring_gdn_local,
    to_zigzag,
)

__all__ = [
    "allgather_attention",
    "allgather_attention_local",
    "from_zigzag",
    "ring_attention",
    "ring_attention_local",
    "ring_gdn",
    "ring_gdn_local",
    "to_zigzag",
]
