"""Gated DeltaNet: gates, recurrent and chunked (WY) gated delta rule, decode, slot pools."""

from attn.gdn.api import (
    gdn_chunked,
    gdn_decode_pool,
    gdn_decode_step,
    gdn_gating,
    gdn_prefill_pool,
    gdn_recurrent,
    l2norm,
)

__all__ = [
    "gdn_chunked",
    "gdn_decode_pool",
    "gdn_decode_step",
    "gdn_gating",
    "gdn_prefill_pool",
    "gdn_recurrent",
    "l2norm",
]
