"""Elastic attention: per-request router over KV heads, mode mapping, elastic prefill."""

from attn.elastic.api import ctx_q_pool, derive_head_mask_type, elastic_prefill_attention
from attn.elastic.router import AttentionRouter, load_hf_state

__all__ = [
    "AttentionRouter",
    "ctx_q_pool",
    "derive_head_mask_type",
    "elastic_prefill_attention",
    "load_hf_state",
]
