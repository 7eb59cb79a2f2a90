"""Causal depthwise conv1d (Gated DeltaNet's short conv): prefill, decode step, slot pools."""

from attn.conv1d.api import (
    causal_conv1d,
    causal_conv1d_prefill_pool,
    causal_conv1d_update,
    causal_conv1d_update_pool,
)

__all__ = [
    "causal_conv1d",
    "causal_conv1d_prefill_pool",
    "causal_conv1d_update",
    "causal_conv1d_update_pool",
]
