"""Reference multi-head latent attention (MLA, DeepSeek-V2 / V3): materialised, absorbed, paged.

MLA caches one latent head per token, `[c_kv ‖ k_pe]` (`L + R` values: the RMS-normed
compressed KV `c_kv` and the rotated rope key `k_pe` shared by all heads). Each query head n owns
up-projections `w_uk[n]: [Dn, L]` (latent -> no-rope key) and `w_uv[n]: [Hv, L]` (latent ->
value). Two equal ways to attend:

* materialised (prefill): `k[n] = [w_uk[n] c ‖ k_pe]`, `v[n] = w_uv[n] c`; multi-head attention.
* absorbed (decode): `q_lat[n] = w_uk[n]ᵀ q_nope[n]`; one latent KV head, key = all `L + R` dims,
  value = the first `L` dims (`c_kv`); `o[n] = w_uv[n] o_lat[n]`.

The score scale is an argument here (the public ops default it); DeepSeek's is
`(Dn + R) ** -0.5 · mscale²`, never `(L + R) ** -0.5`.

Letters: `Dn` = qk_nope_head_dim, `R` = qk_rope_head_dim, `Hv` = v_head_dim, `L` = kv_lora_rank.
Single-letter einsum strings write `h` for `Dn` and `v` for `Hv`. Math in float32 inside; outputs in
the query's dtype, log-sum-exp float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from attn.dense import reference as dense_reference
from attn.merge import reference as merge_reference
from attn.paged_decode.reference import page_present
from kv import fp8

_HIGHEST = jax.lax.Precision.HIGHEST  # an oracle must not run its float32 matmuls in TF32


def split_kv_b(
    kv_b_weight: Float[Array, "NDnHv L"], num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[Float[Array, "N Dn L"], Float[Array, "N Hv L"]]:
    """Split HF's `kv_b_proj.weight` into the per-head up-projections.

    HF computes `kv = c_kv @ kv_b_proj.weight.T`, viewed as `[N, Dn + Hv]` per token, then splits
    each head's row into `[k_nope (Dn) | v (Hv)]`. So the weight is `[N * (Dn + Hv), L]` with rows
    head-major: rows `n*(Dn+Hv) : n*(Dn+Hv)+Dn` are head n's `w_uk`, the next `Hv` rows its `w_uv`.

    Args:
      kv_b_weight: `[N * (Dn + Hv), L]` as stored in the checkpoint (torch `Linear` layout).
      num_heads: `N`.
      qk_nope_head_dim: `Dn`.
      v_head_dim: `Hv`.

    Returns:
      `(w_uk [N, Dn, L], w_uv [N, Hv, L])` with `k_nope[n] = w_uk[n] @ c_kv` and
      `v[n] = w_uv[n] @ c_kv`.
    """
    w = kv_b_weight.reshape(num_heads, qk_nope_head_dim + v_head_dim, kv_b_weight.shape[-1])
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def absorb_query(
    q_nope: Float[Array, "*B N Dn"], w_uk: Float[Array, "N Dn L"]
) -> Float[Array, "*B N L"]:
    """Absorb `w_uk` into the query: `q_lat[n] = w_uk[n]ᵀ q_nope[n]`, float32."""
    return jnp.einsum("...nh,nhl->...nl", q_nope.astype(jnp.float32), w_uk.astype(jnp.float32),
                      precision=_HIGHEST)


def expand_output(
    o_lat: Float[Array, "*B N L"], w_uv: Float[Array, "N Hv L"]
) -> Float[Array, "*B N Hv"]:
    """Up-project the latent attention output: `o[n] = w_uv[n] o_lat[n]`, float32."""
    return jnp.einsum("...nl,nvl->...nv", o_lat.astype(jnp.float32), w_uv.astype(jnp.float32),
                      precision=_HIGHEST)


def mla_naive_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale, causal=True, q_offset=0,
                        kv_lengths=None):
    """Specification of `attn.mla.mla_naive_attention` (arguments and results as there):
    up-project every key and value, then dense multi-head attention over `Dn + R` dims."""
    f32 = jnp.float32
    b, s, _ = c_kv.shape
    n, r = q_nope.shape[2], k_pe.shape[-1]
    k_nope = jnp.einsum("bsl,nhl->bsnh", c_kv.astype(f32), w_uk.astype(f32), precision=_HIGHEST)
    v = jnp.einsum("bsl,nvl->bsnv", c_kv.astype(f32), w_uv.astype(f32), precision=_HIGHEST)
    k_rope = jnp.broadcast_to(k_pe.astype(f32)[:, :, None, :], (b, s, n, r))
    q = jnp.concatenate([q_nope.astype(f32), q_pe.astype(f32)], axis=-1)  # [B, T, N, Dn + R]
    k = jnp.concatenate([k_nope, k_rope], axis=-1)  # [B, S, N, Dn + R]
    out, lse = dense_reference.attention(
        q, k, v, causal=causal, scale=scale, q_offset=q_offset, kv_lengths=kv_lengths
    )
    return out.astype(q_nope.dtype), lse.astype(f32)


def mla_absorbed_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, *, scale, causal=True,
                           q_offset=0, kv_lengths=None):
    """Specification of `attn.mla.mla_absorbed_attention`: attend over the latent
    `[c_kv ‖ k_pe]` with one KV head (MQA). Equal to `mla_naive_attention`:
    `q_lat·c + q_pe·k_pe = q_nope·(w_uk c) + q_pe·k_pe`, and `w_uv (Σ p c) = Σ p (w_uv c)`."""
    f32 = jnp.float32
    q_lat = absorb_query(q_nope, w_uk)  # [B, T, N, L]
    q = jnp.concatenate([q_lat, q_pe.astype(f32)], axis=-1)  # [B, T, N, L + R]
    latent = jnp.concatenate([c_kv.astype(f32), k_pe.astype(f32)], axis=-1)[:, :, None]
    value = c_kv.astype(f32)[:, :, None]  # [B, S, 1, L]: the first L dims of the latent
    o_lat, lse = dense_reference.attention(
        q, latent, value, causal=causal, scale=scale, q_offset=q_offset, kv_lengths=kv_lengths
    )
    return expand_output(o_lat, w_uv).astype(q_nope.dtype), lse.astype(f32)


def gather_latent(
    latent_pages: Float[Array, "num_pages P LR"],
    block_tables: Int[Array, "B max_pages"],
    latent_scales: Float[Array, "num_pages P_sub"] | None = None,
) -> Float[Array, "B S LR"]:
    """Gather each row's latent tokens, `S = max_pages · P`, float32 (fp8 pages dequantised).

    Token s of row b is `latent_pages[block_tables[b, s // P], s % P]`; entries outside
    `[0, num_pages)` (-1 = unallocated, or garbage) read the null page 0. Nothing is masked here:
    tokens past a row's length, or on absent pages, are whatever those pages hold.
    """
    num_pages, p, lr = latent_pages.shape
    b, max_pages = block_tables.shape
    # Never a wrapped (-1) or clamped (>= num_pages) index: absent pages read the null page.
    table = jnp.where(page_present(block_tables, num_pages), block_tables, 0)
    if latent_scales is None:
        latent = latent_pages[table].astype(jnp.float32)  # [B, max_pages, P, L + R]
    else:  # token t of a page uses scale t // sub_block
        latent = fp8.dequantize(latent_pages[table], latent_scales[table], jnp.float32, axis=-2)
    return latent.reshape(b, max_pages * p, lr)


def split_of_token(lengths: Int[Array, " B"], page_size: int, num_pages_per_row: int,
                   num_splits: int) -> Int[Array, "B S"]:
    """Split index of every token slot: page-aligned, balanced per row by its length.

    Row b uses `n_b = cdiv(lengths[b], P)` pages; split j covers its pages
    `[j·c_b, (j + 1)·c_b)` with `c_b = cdiv(n_b, num_splits)`. Trailing splits may be empty.
    """
    s = num_pages_per_row * page_size
    used = jnp.clip(lengths, 0, s)  # tokens past the table do not exist
    used_pages = (used + page_size - 1) // page_size  # [B]
    pages_per_split = jnp.maximum((used_pages + num_splits - 1) // num_splits, 1)  # [B]
    page = jnp.arange(s, dtype=jnp.int32) // page_size  # [S]
    return page[None, :] // pages_per_split[:, None]  # [B, S]


def mla_paged_decode_partials(q_lat, q_pe, latent_pages, block_tables, kv_lengths, *, kv_lora_rank,
                              scale, latent_scales=None, num_splits=1):
    """Specification of `attn.mla.mla_paged_decode_partials`: one latent-attention partial per
    split (`split_of_token`), each normalised within its split."""
    f32 = jnp.float32
    lr = latent_pages.shape[-1]
    p, max_pages = latent_pages.shape[1], block_tables.shape[1]
    latent = gather_latent(latent_pages, block_tables, latent_scales)  # [B, S, L + R]
    pos = jnp.arange(max_pages * p, dtype=jnp.int32)
    present = jnp.repeat(page_present(block_tables, latent_pages.shape[0]), p, axis=1)  # [B, S]
    valid = (pos[None, :] < kv_lengths[:, None]) & present  # [B, S]
    # Zero what is not ours before any product: NaN in unowned pages must not reach values or grads.
    latent = jnp.where(valid[..., None], latent, 0.0)
    c, k_pe = latent[..., :kv_lora_rank], latent[..., kv_lora_rank:lr]
    scores = scale * (
        jnp.einsum("bnl,bsl->bns", q_lat.astype(f32), c, precision=_HIGHEST)
        + jnp.einsum("bnr,bsr->bns", q_pe.astype(f32), k_pe, precision=_HIGHEST)
    )  # [B, N, S]
    split = split_of_token(kv_lengths, p, max_pages, num_splits)  # [B, S]
    mask = valid[:, None, :] & (split[:, None, :] == jnp.arange(num_splits)[None, :, None])
    scores = jnp.where(mask[:, None], scores[:, :, None, :], -jnp.inf)  # [B, N, J, S]
    # Empty splits from the mask alone: a NaN score makes NaN, never an empty split.
    sees = jnp.any(mask, axis=-1)[:, None]  # [B, 1, J]
    m = jnp.max(scores, axis=-1)
    m_safe = jnp.where(sees, m, 0.0)
    w = jnp.exp(scores - m_safe[..., None])  # exactly 0 where masked
    denom = jnp.sum(w, axis=-1)
    safe = jnp.where(sees, denom, 1.0)
    o = jnp.einsum("bnjs,bsl->bnjl", w, c, precision=_HIGHEST) / safe[..., None]
    o = jnp.where(sees[..., None], o, 0.0)
    lse = jnp.where(sees, m_safe + jnp.log(safe), -jnp.inf)
    return o, lse


def mla_paged_decode(q_lat, q_pe, latent_pages, block_tables, kv_lengths, *, kv_lora_rank, scale,
                     latent_scales=None, num_splits=1):
    """Specification of `attn.mla.mla_paged_decode`: the split-KV partials merged by
    log-sum-exp."""
    o, lse = mla_paged_decode_partials(
        q_lat, q_pe, latent_pages, block_tables, kv_lengths, kv_lora_rank=kv_lora_rank, scale=scale,
        latent_scales=latent_scales, num_splits=num_splits,
    )
    out, lse = merge_reference.merge_partials(o, lse)
    return out.astype(q_lat.dtype), lse
