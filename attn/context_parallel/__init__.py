"""Context parallelism: the sequence sharded over a mesh axis: attention (ring and all-gather),
Gated DeltaNet (the chunk state passed along the ring) and its causal conv1d (halo rows passed
to the next device)."""

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
from attn.context_parallel.conv1d import ring_causal_conv1d, ring_causal_conv1d_local
from attn.context_parallel.gdn import ring_gdn_mixer, ring_gdn_mixer_local

__all__ = [
    "allgather_attention",
    "allgather_attention_local",
    "from_zigzag",
    "ring_attention",
    "ring_attention_local",
    "ring_causal_conv1d",
    "ring_causal_conv1d_local",
    "ring_gdn",
    "ring_gdn_local",
    "ring_gdn_mixer",
    "ring_gdn_mixer_local",
    "to_zigzag",
]
