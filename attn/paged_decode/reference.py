"""Reference paged decode attention over head-major pages with per-head block tables.

One query token per batch row attends the keys of its sequence, read through per-KV-head block
tables: token `s` of row `b` for KV head `k` lives at `pages[k, table[b, k, s // P], s % P]`. The
query sits at position `kv_lengths[b] - 1` (the decode token is already in the cache). Key `s` is
visible to KV head `k` iff

    s < kv_lengths[b]  and  s < max_pages * P  and  0 <= table[b, k, s // P] < num_pages
    and (window[k] <= 0 or s > kv_lengths[b] - 1 - window[k]  or  s < sinks[k])

so tokens on unallocated (-1) pages, and on ids outside the pool (`>= num_pages`, or any other
negative id), are absent, whatever the window says; tokens past the table do not exist (a length
past `max_pages * P` keeps its query position, `kv_lengths[b] - 1`, for the window). Every such
entry is rewritten to the null page 0 before the gather, so no read leaves the pool, and the
tokens read there are masked. fp8 pages are dequantised with their block-wise scales (`kv.fp8`
layout) right after the gather.

The reference gathers the whole table, `[B, max_pages * P, K, H]`: it is the specification, not a
fast path. Math in float32; masked keys and values are zeroed before the einsums, so NaN in memory
that no visible key owns (poisoned or stale pages, the null page) never reaches the result or its
gradients. NaN in a visible key or value does: it comes out as NaN (a row is fully masked, 0 and
-inf, only when it sees no key, never because a score was NaN).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from attn.merge import reference as merge_reference

_HIGHEST = jax.lax.Precision.HIGHEST  # an oracle must not run its float32 matmuls in TF32


def per_head(value: int | Array | None, num_kv_heads: int) -> Int[Array, "*B K"]:
    """Window / sinks argument as a `[K]` int32 array, or `[B, K]` (per row and head) as given;
    `None` gives zeros (no window, no sinks)."""
    if value is None:
        value = 0
    value = jnp.asarray(value, jnp.int32)
    return value if value.ndim == 2 else jnp.broadcast_to(value, (num_kv_heads,))


def gather_pages(pages, block_tables, scales=None, *, dtype=None):
    """Specification of `attn.paged_decode.gather_pages`: every row's tokens through its per-head
    table into `[B, S = M * P, K, H]`; absent ids read the null page 0, fp8 pages are dequantised
    with `scales` (float32 output unless `dtype`). Tokens past a row's length and of absent pages
    come back as stored: mask them."""
    return _gather_head_major(pages, block_tables, scales, dtype).transpose(0, 2, 1, 3)


def page_present(block_tables: Int[Array, "..."], num_pages: int) -> Bool[Array, "..."]:
    """Table entries that name a page of the pool, `0 <= id < num_pages`; every other id (-1 for
    unallocated, or garbage) is an absent page: invisible and never read."""
    return (block_tables >= 0) & (block_tables < num_pages)


def _gather_head_major(pages, block_tables, scales, dtype) -> Float[Array, "B K S H"]:
    num_kv, num_pages, page, head_dim = pages.shape
    batch, _, max_pages = block_tables.shape
    # Absent ids -> the null page: never a wrapped (-1) or clamped (>= num_pages) index.
    ids = jnp.where(page_present(block_tables, num_pages), block_tables, 0)
    heads = jnp.arange(num_kv)[None, :, None]  # [1, K, 1]
    g = pages[heads, ids]  # [B, K, M, P, H]
    if scales is not None:
        s = scales[heads, ids]  # [B, K, M, C]
        s = jnp.repeat(s, page // scales.shape[-1], axis=-1)  # [B, K, M, P]
        g = g.astype(jnp.float32) * s[..., None]
        dtype = jnp.float32 if dtype is None else dtype
    g = g.reshape(batch, num_kv, max_pages * page, head_dim)
    return g if dtype is None else g.astype(dtype)


def visible_mask(
    block_tables: Int[Array, "B K M"],
    kv_lengths: Int[Array, " B"],
    page_size: int,
    window: int | Int[Array, "*B K"] | None = None,
    sinks: int | Int[Array, "*B K"] = 0,
    num_pages: int | None = None,
) -> Bool[Array, "B K S"]:
    """Which keys the decode query of each row sees, per KV head (see the module docstring);
    `window` / `sinks` per head `[K]` or per row and head `[B, K]`. With `num_pages`, ids at or
    past it are absent too (without it only negative ids are)."""
    batch, num_kv, max_pages = block_tables.shape
    window = jnp.broadcast_to(per_head(window, num_kv), (batch, num_kv))[:, :, None]  # [B, K, 1]
    sinks = jnp.broadcast_to(per_head(sinks, num_kv), (batch, num_kv))[:, :, None]
    s = jnp.arange(max_pages * page_size, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    q_pos = (kv_lengths.astype(jnp.int32) - 1)[:, None, None]  # [B, 1, 1]
    in_window = (window <= 0) | (s > q_pos - window)
    present = block_tables >= 0 if num_pages is None else page_present(block_tables, num_pages)
    owned = jnp.repeat(present, page_size, axis=-1)  # [B, K, S]
    return (s <= q_pos) & (in_window | (s < sinks)) & owned


def split_ids(lengths: Int[Array, " B"], num_keys: int, page_size: int,
              num_splits: int) -> Int[Array, "B S"]:
    """The split each key falls in: row `b` is cut into `num_splits` contiguous pieces of
    `ceil(ceil(lengths[b] / num_splits) / P) * P` keys (page aligned; the last ones may be short or
    empty)."""
    per_split = -(-lengths.astype(jnp.int32) // num_splits)
    per_split = jnp.maximum(-(-per_split // page_size) * page_size, page_size)  # [B]
    return jnp.arange(num_keys, dtype=jnp.int32)[None, :] // per_split[:, None]


def paged_decode_partials(q, k_pages, v_pages, block_tables, kv_lengths, *, num_splits, scale=None,
                          window=None, sinks=0, k_scales=None, v_scales=None):
    """Specification of `attn.paged_decode.paged_decode_partials` (arguments and results as
    there): per-split attention of the decode query, split rule `split_ids`."""
    batch, num_heads, head_dim = q.shape
    num_kv, num_pages, page, _ = k_pages.shape
    group = num_heads // num_kv
    scale = head_dim**-0.5 if scale is None else scale
    k = _gather_head_major(k_pages, block_tables, k_scales, jnp.float32)  # [B, K, S, H]
    v = _gather_head_major(v_pages, block_tables, v_scales, jnp.float32)  # [B, K, S, Hv]
    num_keys = k.shape[2]
    visible = visible_mask(block_tables, kv_lengths, page, window, sinks, num_pages)  # [B, K, S]
    k = jnp.where(visible[..., None], k, 0.0)
    v = jnp.where(visible[..., None], v, 0.0)
    splits = split_ids(kv_lengths, num_keys, page, num_splits)  # [B, S]
    in_split = splits[:, None, :] == jnp.arange(num_splits)[None, :, None]  # [B, J, S]
    mask = visible[:, :, None, None, :] & in_split[:, None, :, None, :]  # [B, K, J, 1, S]

    qg = q.astype(jnp.float32).reshape(batch, num_kv, group, head_dim)  # n = k * G + g
    scores = jnp.einsum("BKGH,BKSH->BKGS", qg, k, precision=_HIGHEST) * scale
    scores = jnp.where(mask, scores[:, :, None], -jnp.inf)  # [B, K, J, G, S]
    # "Sees nothing" comes from the mask alone: a NaN score must make NaN, not an empty row.
    sees = jnp.any(mask, axis=-1)  # [B, K, J, 1]
    m = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    m = jnp.where(sees[..., None], m, 0.0)
    p = jnp.exp(scores - m)  # exactly 0 where masked
    l = jnp.sum(p, axis=-1)  # [B, K, J, G]
    safe_l = jnp.where(sees, l, 1.0)
    o = jnp.einsum("BKJGS,BKSV->BKJGV", p, v, precision=_HIGHEST) / safe_l[..., None]
    lse = jnp.where(sees, m[..., 0] + jnp.log(safe_l), -jnp.inf)
    o = o.transpose(0, 1, 3, 2, 4).reshape(batch, num_heads, num_splits, -1)
    lse = lse.transpose(0, 1, 3, 2).reshape(batch, num_heads, num_splits)
    return o, lse


def paged_decode(q, k_pages, v_pages, block_tables, kv_lengths, *, scale=None, window=None,
                 sinks=0, k_scales=None, v_scales=None, num_splits=1):
    """Specification of `attn.paged_decode.paged_decode`: `paged_decode_partials` merged by
    log-sum-exp."""
    o, lse = paged_decode_partials(
        q, k_pages, v_pages, block_tables, kv_lengths, num_splits=num_splits, scale=scale,
        window=window, sinks=sinks, k_scales=k_scales, v_scales=v_scales)
    if num_splits == 1:
        out, lse = o[:, :, 0], lse[:, :, 0]
    else:
        out, lse = merge_reference.merge_partials(o, lse)
    return out.astype(q.dtype), lse
