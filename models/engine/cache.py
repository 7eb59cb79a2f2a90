"""What an attention layer's attend sees in the engine: its paged KV after this step's write.

`model(ids, attend=...)` calls `attend(spec, qkv, state)` with this call's q, k and v; the
engine calls the same kind of object, `Engine(model, attend=...)`, as `attend(spec, qkv, cache)`
with `cache` a `PagedKV`: the layer's page pool with this step's k, v already written, its block
table and where every row's queries and keys sit. The attend returns `(o [B, T, N, Hv], cache)`.
`paged_attention` is the engine's own (paged prefill, paged decode); a custom attend can wrap
it (change the window, sinks or scale per layer), or read the row's keys and values through
`PagedKV.gather` and run any dense attention with `q_offset` / `kv_lengths`, or run a kernel of
its own on the pages. Under a mesh (`Engine(mesh=...)`) it sees this device's heads only.

Row `b`'s queries sit at positions `q_offset[b] .. q_offset[b] + T - 1`, of which the first
`kv_lengths[b] - q_offset[b]` are real (the rest is padding, its output unused); keys
`0 .. kv_lengths[b] - 1` are in the cache. Causality, the window and the sinks are the
attend's to apply (`window [B, K] <= 0` = full), as `paged_attention` does.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

import kv
from attn.dense import paged_prefill_attention
from attn.paged_decode import paged_decode
from models.layers.attention import QKV, AttendSpec


class PagedKV(NamedTuple):
    """One attention layer's paged KV in one engine step, as its attend sees it.

    Attributes:
      pool: `kv.PagePool` `[K, num_pages, P, H]` with this step's k, v written.
      table: `[B, K, M]` int32 block table of the layer (-1: no page).
      q_offset: `[B]` int32 position of each row's first query (its cached tokens before the
        step).
      kv_lengths: `[B]` int32 keys of each row after the step's write.
      window: `[B, K]` int32 the policy's window per row and KV head (`<= 0` full).
      sinks: `[B, K]` int32.
      decode: the `T = 1` decode step (static).
      implementation: the engine's attention backend (static).
      kv_shards: the heads here are one of this many equal shards of the layer's KV heads
        (inside the tensor-parallel `shard_map`; static).
    """

    pool: kv.PagePool
    table: Int[Array, "B K M"]
    q_offset: Int[Array, "B"]  # noqa: F821
    kv_lengths: Int[Array, "B"]  # noqa: F821
    window: Int[Array, "B K"]
    sinks: Int[Array, "B K"]
    decode: bool = False
    implementation: str = "auto"
    kv_shards: int = 1

    def gather(self, dtype=None) -> tuple[Float[Array, "B S K H"], Float[Array, "B S K Hv"]]:
        """Every row's keys and values in position order, `S = M * P` (`kv.gather_kv`: slots a
        row does not hold read the null page; mask them with `kv_lengths`)."""
        zeros = jnp.zeros(self.table.shape[:2], jnp.int32)  # gather_kv reads the table only
        tables = kv.BlockTables(table=self.table, extent=zeros, cursor=zeros,
                                page_size=self.pool.page_size)
        return kv.gather_kv(self.pool, tables, dtype)


def paged_attention(spec: AttendSpec, qkv: QKV, cache: PagedKV) -> tuple[Array, PagedKV]:
    """The engine's attention over a `PagedKV`: `paged_decode` in the decode step, else
    `paged_prefill_attention` (`q_offset`, `kv_lengths`, per-head window and sinks, FP8 scales).

    Returns:
      `(o [B, T, N, Hv], cache)` (the cache unchanged).
    """
    pool = cache.pool
    if cache.decode:
        args = (qkv.q[:, 0], pool.k, pool.v, cache.table, cache.kv_lengths)
        kwargs = dict(scale=spec.scale, window=cache.window, sinks=cache.sinks,
                      k_scales=pool.k_scale, v_scales=pool.v_scale)
        config = _whole_layer_decode_config(args, kwargs, cache)
        o, _ = paged_decode(*args, **kwargs, implementation=cache.implementation, config=config)
        return o[:, None], cache
    o, _ = paged_prefill_attention(
        qkv.q, pool.k, pool.v, cache.table, cache.q_offset, cache.kv_lengths, scale=spec.scale,
        window=cache.window, sinks=cache.sinks, k_scales=pool.k_scale, v_scales=pool.v_scale,
        implementation=cache.implementation)
    return o, cache


def _whole_layer_decode_config(args, kwargs, cache: PagedKV):
    """The Triton decode kernel's config for one shard of a layer's KV heads: the split count a
    single device picks for all of them, or None (the op's own choice).

    The split count changes the result by rounding, and the kernel's heuristic reads the head
    count: a device holding `K / D` heads would split its keys differently from one device
    holding all `K`, and the tensor-parallel engine's tokens would drift from the one-device
    engine's. With the whole layer's split count each device computes exactly its heads' share
    of the one-device result.
    """
    if cache.kv_shards == 1:
        return None
    backend, config = paged_decode.select(cache.implementation,
                                          paged_decode.validate(*args, **kwargs))
    if backend.name != "triton":
        return None
    from attn.paged_decode import triton as kernel

    q, pages, table = args[0], args[1], args[3]
    whole = kernel.default_config(q.shape[0], pages.shape[0] * cache.kv_shards,
                                  table.shape[-1] * pages.shape[2],
                                  fp8=kwargs["k_scales"] is not None)
    return dataclasses.replace(config, num_splits=whole.num_splits)


__all__ = ["PagedKV", "paged_attention"]
