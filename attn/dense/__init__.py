"""Dense softmax attention: GQA, causal, sliding window + sinks, offsets, packing, lengths."""

from attn.dense.api import (
    attention,
    attention_varlen,
    masked_attention,
    paged_prefill_attention,
    positions_from_cu_seqlens,
    segment_ids_from_cu_seqlens,
    visible_mask,
)

__all__ = [
    "attention",
    "attention_varlen",
    "masked_attention",
    "paged_prefill_attention",
    "positions_from_cu_seqlens",
    "segment_ids_from_cu_seqlens",
    "visible_mask",
]
