"""Multi-head latent attention (DeepSeek-V2 / V3): materialised, absorbed, paged latent decode."""

from attn.mla.api import (
    absorb_query,
    expand_output,
    mla_absorbed_attention,
    mla_naive_attention,
    mla_paged_decode,
    mla_paged_decode_partials,
    split_kv_b,
)

__all__ = [
    "absorb_query",
    "expand_output",
    "mla_absorbed_attention",
    "mla_naive_attention",
    "mla_paged_decode",
    "mla_paged_decode_partials",
    "split_kv_b",
]
