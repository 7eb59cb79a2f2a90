"""`paged_attention` under tensor parallelism: a shard of a layer's KV heads splits its keys as
one device holding the whole layer would.

The Triton decode kernel's split count comes from a heuristic over the programs in flight
(batch x KV heads); a device holding `K / D` heads would pick another split count than one
device holding `K`, and the merge of a different number of partials rounds differently. The
shard's config carries the whole layer's split count instead (and only the Triton backend gets
one: the XLA path does not split).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import kv
from attn.paged_decode import triton as decode_kernel
from models.engine.cache import PagedKV, _whole_layer_decode_config

B, K_LAYER, SHARDS, H, PAGE, MAX_PAGES = 64, 8, 2, 16, 64, 64


def shard_cache(kv_shards: int, implementation: str) -> tuple[tuple, dict, PagedKV]:
    """One shard's decode inputs (`K_LAYER / kv_shards` heads, 4K-token tables, empty rows)."""
    k_local = K_LAYER // kv_shards
    pool = kv.create_page_pool(num_kv_heads=k_local, num_pages=4, page_size=PAGE, head_dim=H,
                               dtype=jnp.bfloat16)
    table = jnp.full((B, k_local, MAX_PAGES), -1, jnp.int32)
    zeros = jnp.zeros((B,), jnp.int32)
    heads = jnp.zeros((B, k_local), jnp.int32)
    cache = PagedKV(pool=pool, table=table, q_offset=zeros, kv_lengths=zeros, window=heads,
                    sinks=heads, decode=True, implementation=implementation, kv_shards=kv_shards)
    q = jnp.zeros((B, 2 * k_local, H), jnp.bfloat16)
    args = (q, pool.k, pool.v, table, zeros)
    kwargs = dict(scale=None, window=heads, sinks=heads, k_scales=None, v_scales=None)
    return args, kwargs, cache


def test_a_shard_splits_keys_as_the_whole_layer_does():
    args, kwargs, cache = shard_cache(SHARDS, "triton")
    whole = decode_kernel.default_config(B, K_LAYER, MAX_PAGES * PAGE).num_splits
    local = decode_kernel.default_config(B, K_LAYER // SHARDS, MAX_PAGES * PAGE).num_splits
    assert whole != local  # the shape makes the heuristic's choices differ
    assert _whole_layer_decode_config(args, kwargs, cache).num_splits == whole


@pytest.mark.parametrize("kv_shards, implementation", [(1, "triton"), (SHARDS, "xla")])
def test_no_config_where_the_op_decides_alone(kv_shards, implementation):
    args, kwargs, cache = shard_cache(kv_shards, implementation)
    assert _whole_layer_decode_config(args, kwargs, cache) is None
