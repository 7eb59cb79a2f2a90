"""Dense softmax attention: the specification every other attention variant is tested against.

Two steps, each short enough to check by eye:

1. `mask_from_positions` decides which keys each query sees, from absolute token positions:
   causality (`kv_pos <= q_pos`), a sliding window with attention sinks per KV head, segment ids
   (varlen packing) and key validity (padding). `visible_mask` and `varlen_positions` build the
   positions for the two layouts (dense with a query offset; packed with `cu_seqlens`).
2. `masked_attention` applies any such boolean mask: scores in float32, softmax, values.

A query row that sees no key gives output exactly 0 and log-sum-exp -inf, with finite gradients
(the double-`where` trick: nothing that is later discarded is ever `log(0)` or `-inf - -inf`).
"Sees no key" is read off the mask alone: a NaN in a visible query, key or value makes that row
NaN (as every kernel does), it never turns the row into a masked one; a non-finite value makes
NaN exactly the rows that see it (rows of the same call that do not see it stay finite).
Keys no query sees and queries that see no key may hold garbage (NaN padding, unowned pages);
they are zeroed before use, so `0 * NaN` never reaches an output or a gradient.

Shapes (DESIGN.md letters): q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, Hv]`, `G = N // K`;
query head `n` uses KV head `n // G`. Inputs are assumed valid; `api.py` validates them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

_HIGHEST = jax.lax.Precision.HIGHEST  # an oracle must not run its float32 matmuls in TF32


def _per_head(x, num_kv_heads: int) -> Int[Array, " K"]:
    """A python int or a `[K]` array as a `[K]` int32 array."""
    return jnp.broadcast_to(jnp.asarray(x, jnp.int32), (num_kv_heads,))


def mask_from_positions(
    q_pos: Int[Array, "B T"],
    kv_pos: Int[Array, "B S"],
    *,
    num_kv_heads: int,
    causal: bool = True,
    window: int | Int[Array, " K"] | None = None,
    sinks: int | Int[Array, " K"] = 0,
    q_segment_ids: Int[Array, "B T"] | None = None,
    kv_segment_ids: Int[Array, "B S"] | None = None,
    kv_valid: Bool[Array, "B S"] | None = None,
) -> Bool[Array, "B T K S"]:
    """Which key each query sees, per KV head, from absolute positions.

    Key `s` is visible to query `t` (KV head `k`) iff all of:
      - causal: `kv_pos <= q_pos` (when `causal`);
      - window: `q_pos - window[k] < kv_pos` or `kv_pos < sinks[k]` (when `window` is given and
        `window[k] > 0`; `window[k] <= 0` means the full causal range for that head);
      - segments: `q_segment_ids == kv_segment_ids` (when given);
      - validity: `kv_valid` (when given).

    Args:
      q_pos: `[B, T]` absolute position of each query.
      kv_pos: `[B, S]` absolute position of each key.
      num_kv_heads: `K`.
      causal: apply the causal rule.
      window: None, an int, or `[K]` int32: the number of most recent positions visible,
        the query's own included. Meant for causal masks (`api.py` refuses it otherwise).
      sinks: an int or `[K]` int32: keys at positions `< sinks` stay visible despite the window.
        Ignored without a window.
      q_segment_ids, kv_segment_ids: `[B, T]`, `[B, S]` integer ids; a query sees only keys with
        its own id. Give both or neither.
      kv_valid: `[B, S]`; False keys are seen by nobody.

    Returns:
      `[B, T, K, S]` boolean mask.
    """
    qp = q_pos[:, :, None, None]  # [B, T, 1, 1]
    kp = kv_pos[:, None, None, :]  # [B, 1, 1, S]
    mask = kp <= qp if causal else jnp.ones_like(kp <= qp)  # [B, T, 1, S]
    if window is not None:
        w = _per_head(window, num_kv_heads)[:, None]  # [K, 1]
        sink = _per_head(sinks, num_kv_heads)[:, None]  # [K, 1]
        mask = mask & ((w <= 0) | (qp - kp < w) | (kp < sink))  # [B, T, K, S]
    if q_segment_ids is not None:
        mask = mask & (q_segment_ids[:, :, None, None] == kv_segment_ids[:, None, None, :])
    if kv_valid is not None:
        mask = mask & kv_valid[:, None, None, :]
    batch, q_len = q_pos.shape
    return jnp.broadcast_to(mask, (batch, q_len, num_kv_heads, kv_pos.shape[1]))


def visible_mask(batch, q_len, kv_len, num_kv_heads, *, causal=True, q_offset=0, window=None,
                 sinks=0, q_segment_ids=None, kv_segment_ids=None, kv_lengths=None):
    """Specification of `attn.dense.visible_mask`: query `t` at position `q_offset + t`, key `s`
    at `s`, through `mask_from_positions`; `kv_lengths` hides keys `s >= kv_lengths[b]`."""
    offset = jnp.asarray(q_offset, jnp.int32).reshape(-1, 1)  # [B or 1, 1]
    q_pos = jnp.broadcast_to(offset + jnp.arange(q_len, dtype=jnp.int32), (batch, q_len))
    kv_pos = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
    kv_valid = None if kv_lengths is None else kv_pos < jnp.asarray(kv_lengths)[:, None]
    return mask_from_positions(
        q_pos, kv_pos, num_kv_heads=num_kv_heads, causal=causal, window=window, sinks=sinks,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, kv_valid=kv_valid)


def masked_attention(q, k, v, mask, *, scale=None, softcap=None):
    """Specification of `attn.dense.masked_attention`: scores in float32 (soft-capped as
    `softcap * tanh(s / softcap)` when `softcap` is given), the mask, softmax, values. `mask` is
    `[B, T, M, S]` with `M` one of `N`, `K` or 1."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    heads = mask.shape[2]
    mk, mg = (num_kv_heads, group) if heads == num_heads else (heads, 1)
    m = mask.reshape(batch, q_len, mk, mg, kv_len).transpose(0, 2, 3, 1, 4)  # [B, K|1, G|1, T, S]

    row_sees = jnp.any(m, axis=-1)  # [B, K|1, G|1, T]
    key_seen = jnp.any(m, axis=(2, 3)).transpose(0, 2, 1)[..., None]  # [B, S, K|1, 1]
    qg = q.astype(jnp.float32).reshape(batch, q_len, num_kv_heads, group, head_dim)
    qg = jnp.where(row_sees.transpose(0, 3, 1, 2)[..., None], qg, 0.0)  # [B, T, K, G, H]
    kf = jnp.where(key_seen, k.astype(jnp.float32), 0.0)
    # A non-finite value taints exactly the rows that see it: zeroed before the PV einsum (where
    # a 0 weight would still make 0 * NaN for the rows that do not see it), then NaN put back.
    vf = v.astype(jnp.float32)
    v_ok = jnp.isfinite(vf)
    vf = jnp.where(key_seen & v_ok, vf, 0.0)
    bad_key = ~jnp.all(v_ok, axis=-1).transpose(0, 2, 1)[:, :, None, None, :]  # [B, K, 1, 1, S]
    tainted = jnp.any(m & bad_key, axis=-1)  # [B, K, G|1, T]

    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, kf, precision=_HIGHEST) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(m, s, -jnp.inf)
    sees = row_sees  # [B, K|1, G|1, T], from the mask: a NaN score is not an empty row
    row_max = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))  # shift only: no grad
    row_max = jnp.where(sees[..., None], row_max, 0.0)  # -inf for rows that see nothing
    p = jnp.exp(s - row_max)  # [B, K, G, T, S]; exactly 0 where masked
    denom = jnp.sum(p, axis=-1)  # [B, K, G, T]
    safe = jnp.where(sees, denom, 1.0)
    out = jnp.einsum("BKGTS,BSKH->BKGTH", p, vf, precision=_HIGHEST) / safe[..., None]
    out = jnp.where(sees[..., None], out, 0.0)
    out = jnp.where(tainted[..., None], jnp.nan, out)
    lse = jnp.where(sees, row_max[..., 0] + jnp.log(safe), -jnp.inf)

    out = out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, v.shape[-1])
    lse = lse.transpose(0, 3, 1, 2).reshape(batch, q_len, num_heads)
    return out.astype(q.dtype), lse


def attention(q, k, v, *, causal=True, scale=None, q_offset=0, window=None, sinks=0,
              q_segment_ids=None, kv_segment_ids=None, kv_lengths=None, softcap=None):
    """Specification of `attn.dense.attention`: `masked_attention` under `visible_mask`."""
    mask = visible_mask(
        q.shape[0], q.shape[1], k.shape[1], k.shape[2], causal=causal, q_offset=q_offset,
        window=window, sinks=sinks, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        kv_lengths=kv_lengths)
    return masked_attention(q, k, v, mask, scale=scale, softcap=softcap)


def segment_ids_from_cu_seqlens(cu_seqlens: Int[Array, " B+1"], total: int) -> Int[Array, " T"]:
    """Segment id of each packed token: `b` in `[cu[b], cu[b+1])`, -1 outside `[cu[0], cu[B])`.

    Args:
      cu_seqlens: `[B + 1]` non-decreasing token offsets of the sequences.
      total: number of packed tokens `T` (static); tokens past `cu[B]` are padding.

    Returns:
      `[T]` int32.
    """
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    idx = jnp.arange(total, dtype=jnp.int32)
    seg = jnp.searchsorted(cu, idx, side="right").astype(jnp.int32) - 1  # last b with cu[b] <= idx
    return jnp.where(idx < cu[-1], seg, -1)


def positions_from_cu_seqlens(cu_seqlens: Int[Array, " B+1"], total: int) -> Int[Array, " T"]:
    """Position of each packed token within its own sequence (0 for padding tokens).

    Args:
      cu_seqlens: `[B + 1]` non-decreasing token offsets of the sequences.
      total: number of packed tokens `T` (static).

    Returns:
      `[T]` int32; padding tokens get 0 so the result is always a safe gather index.
    """
    cu = jnp.asarray(cu_seqlens, jnp.int32)
    seg = segment_ids_from_cu_seqlens(cu, total)
    start = cu[jnp.maximum(seg, 0)]  # -1 must never reach a gather
    return jnp.where(seg >= 0, jnp.arange(total, dtype=jnp.int32) - start, 0)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, scale=None, window=None,
                     sinks=0):
    """Specification of `attn.dense.attention_varlen` through `mask_from_positions`: sequence `b`'s
    queries sit at the end of its keys (`len_k - len_q + j`), keys at `0..len_k-1`, so windows and
    sinks count within each sequence; padding tokens see nothing and are seen by nobody."""
    total_q, total_k = q.shape[0], k.shape[0]
    q_seg = segment_ids_from_cu_seqlens(cu_seqlens_q, total_q)  # [Tq]
    kv_seg = segment_ids_from_cu_seqlens(cu_seqlens_k, total_k)  # [Tk]
    shift = jnp.diff(jnp.asarray(cu_seqlens_k, jnp.int32)) - jnp.diff(
        jnp.asarray(cu_seqlens_q, jnp.int32))  # [B] len_k - len_q
    q_pos = positions_from_cu_seqlens(cu_seqlens_q, total_q) + shift[jnp.maximum(q_seg, 0)]
    kv_pos = positions_from_cu_seqlens(cu_seqlens_k, total_k)
    mask = mask_from_positions(
        q_pos[None], kv_pos[None], num_kv_heads=k.shape[1], causal=causal, window=window,
        sinks=sinks, q_segment_ids=q_seg[None], kv_segment_ids=kv_seg[None],
        kv_valid=(kv_seg >= 0)[None])  # [1, Tq, K, Tk]
    out, lse = masked_attention(q[None], k[None], v[None], mask, scale=scale)
    return out[0], lse[0]


def paged_prefill_attention(q, k_pages, v_pages, block_tables, q_offset, kv_lengths, *, scale=None,
                            window=None, sinks=0, k_scales=None, v_scales=None):
    """Specification of `attn.dense.paged_prefill_attention`: gather the pages, then causal
    `masked_attention` under `visible_mask` per row (`window` / `sinks` `[B, K]`), with absent
    pages (ids outside `[0, num_pages)`) masked. Negative offsets count from 0."""
    from attn.paged_decode.reference import gather_pages, page_present

    batch, q_len = q.shape[:2]
    num_kv, _, page, _ = k_pages.shape
    k = gather_pages(k_pages, block_tables, k_scales, dtype=jnp.float32)  # [B, S, K, H]
    v = gather_pages(v_pages, block_tables, v_scales, dtype=jnp.float32)  # [B, S, K, Hv]
    kv_len = k.shape[1]
    window = jnp.broadcast_to(jnp.asarray(0 if window is None else window, jnp.int32),
                              (batch, num_kv))
    sinks = jnp.broadcast_to(jnp.asarray(0 if sinks is None else sinks, jnp.int32),
                             (batch, num_kv))

    def row_mask(offset, length, w, sk):  # one row: [T, K, S]
        return visible_mask(1, q_len, kv_len, num_kv, q_offset=offset[None], window=w, sinks=sk,
                            kv_lengths=length[None])[0]

    # Traced offsets below 0 count from 0, as in the kernel (concrete ones are refused).
    offset = jnp.maximum(jnp.asarray(q_offset, jnp.int32), 0)
    mask = jax.vmap(row_mask)(offset, jnp.asarray(kv_lengths, jnp.int32), window,
                              sinks)  # [B, T, K, S]
    owned = jnp.repeat(page_present(block_tables, k_pages.shape[1]), page, axis=-1)  # [B, K, S]
    return masked_attention(q, k, v, mask & owned[:, None], scale=scale)
