"""Reference XAttention block-importance estimate and threshold block selection.

XAttention (arXiv 2503.16428; mit-han-lab/x-attention `xattn_estimate`, `select_mode="inverse"`)
scores each `block_size × block_size` tile of the causal attention matrix cheaply:

1. Antidiagonal strided scores. With stride `st`, reduced row `m` and reduced column `n`,
   `A[m, n] = Σ_{i<st} q[m·st + st-1-i] · k[n·st + i]`: the antidiagonal sum of each `st × st`
   tile of `QKᵀ`. As one matmul: `q_r[m] = concat_i q[m·st + st-1-i]`, `k_r[n] = concat_i
   k[n·st + i]` along features, `A = q_r k_rᵀ` (einsum `BMKGX,BNKX->BKGMN`, `X = st·H`).
2. Softmax of `A / sqrt(H) / st / norm` over each reduced row under the causal rule in reduced
   coordinates (`n <= m + ceil((kv_len - q_len) / st)`, `n < ceil(kv_len / st)`); reduced rows past
   the queries get zero mass. Probabilities summed into `(bs/st) × (bs/st)` tiles give
   `block_sums [B, N, Tb, Sb]`; each reduced row of a real query adds mass 1 to its tile row.
3. `find_blocks`: per (request, head, query tile `r`), keep key block 0 (sink) and the diagonal
   `d(r)`, then the other blocks in descending mass while the mass kept *before* adding a block is
   `< threshold · row total` (the smallest prefix reaching the threshold, including the block that
   crosses it). Then clip to `j <= d(r)` (block causal) and drop tiles past `ceil(q_len / bs)` and
   blocks past `ceil(kv_len / bs)`.

Geometry is that of `attn.block_sparse`: queries are the last `q_len` of `kv_len` keys, query tiles
are query-local, key blocks absolute, `d(r)` from `attn.block_sparse.reference.diagonal_blocks`.
For `q_len == kv_len` (or a block-aligned difference) this equals the original; there the
original's `k_block_num - q_block_num` offset is in chunk-padded blocks and mis-places queries.

Differences from the original, on purpose: all math in float32 (the original stores scores and
probabilities in the input dtype and sorts in float64, so near-ties may break differently); GQA
reads KV head `n // G` instead of expanding K; chunking (`chunk_size`) bounds memory only and never
changes the result. In the original, when sink and diagonal coincide (`d(r) = 0`) one extra block
can be kept; the causal clip removes it, so the results agree.
"""

import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from attn.block_sparse.reference import _cdiv, _lengths, diagonal_blocks

DEFAULT_THRESHOLD = 0.9  # tau, the paper's (and FlashDecoding's) block-selection mass


def default_chunk_size(kv_len: int) -> int:
    """The original's chunk: `max(min(max(2048, P), 128·1024·2048 // P), 2048)`, P = next_pow2."""
    p = 1 << max(kv_len - 1, 0).bit_length()
    return max(min(max(2048, p), 128 * 1024 * 2048 // p), 2048)


def _pad_to(x, axis: int, multiple: int):
    pad = -x.shape[axis] % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def antidiagonal_scores(
    q: Float[Array, "B T N H"], k: Float[Array, "B S K H"], stride: int
) -> Float[Array, "B N M R"]:
    """`A[b, n, m, r] = Σ_i q[b, m·st + st-1-i, n] · k[b, r·st + i, n // G]` (float32, unscaled).

    T and S must be multiples of `stride` (`M = T / st`, `R = S / st`).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    qr = q.astype(jnp.float32).reshape(B, T // stride, stride, K, N // K, H)[:, :, ::-1]
    qr = qr.transpose(0, 1, 3, 4, 2, 5).reshape(B, T // stride, K, N // K, stride * H)
    kr = k.astype(jnp.float32).reshape(B, S // stride, stride, K, H)
    kr = kr.transpose(0, 1, 3, 2, 4).reshape(B, S // stride, K, stride * H)
    a = jnp.einsum("BMKGX,BRKX->BKGMR", qr, kr, precision=jax.lax.Precision.HIGHEST)
    return a.reshape(B, N, T // stride, S // stride)


def find_blocks(
    block_sums: Float[Array, "B N Tb Sb"],
    diagonal: Int[Array, "B Tb"],
    threshold: float,
) -> Bool[Array, "B N Tb Sb"]:
    """Threshold selection: sink + diagonal forced, then descending mass until `threshold`.

    Args:
      block_sums: `[B, N, Tb, Sb]` non-negative block masses.
      diagonal: `[B, Tb]` int32 diagonal key block of every query tile.
      threshold: fraction τ of each row's total mass to keep.

    Returns:
      `[B, N, Tb, Sb]` bool, clipped to `j <= diagonal` (block causal); no length trimming.
    """
    x = block_sums.astype(jnp.float32)
    j = jnp.arange(x.shape[-1], dtype=jnp.int32)
    d = diagonal[:, None, :, None]  # [B, 1, Tb, 1]
    forced = (j == 0) | (j == d)
    required = threshold * jnp.sum(x, axis=-1, keepdims=True)
    forced_mass = jnp.sum(jnp.where(forced, x, 0.0), axis=-1, keepdims=True)
    other = jnp.where(forced, 0.0, x)
    order = jnp.argsort(jnp.where(forced, jnp.inf, -other), axis=-1, stable=True)  # descending
    ranked = jnp.take_along_axis(other, order, axis=-1)
    before = forced_mass + jnp.cumsum(ranked, axis=-1) - ranked  # mass kept before this block
    keep_ranked = before < required
    keep = jnp.take_along_axis(keep_ranked, jnp.argsort(order, axis=-1), axis=-1)
    return (forced | keep) & (j <= d)


def xattn_estimate(q, k, *, block_size=128, stride=16, threshold=DEFAULT_THRESHOLD, norm=1.0,
                   chunk_size=None, q_lengths=None, kv_lengths=None):
    """Specification of `attn.xattention.xattn_estimate`: antidiagonal block masses per query
    chunk (`chunk_size` query tokens per step, memory only; default `default_chunk_size(S)`) and
    the threshold selection of `find_blocks`. Padding is zeroed, as the original pads."""
    B, T, N, H = q.shape
    S = k.shape[1]
    q_len, kv_len = _lengths(q_lengths, T, B), _lengths(kv_lengths, S, B)
    # Zero the padding (the original pads with zeros); this also keeps NaN padding out.
    q = jnp.where((jnp.arange(T) < q_len[:, None])[:, :, None, None], q, 0)
    k = jnp.where((jnp.arange(S) < kv_len[:, None])[:, :, None, None], k, 0)
    chunk = default_chunk_size(S) if chunk_size is None else chunk_size
    chunk = min(chunk, _cdiv(T, block_size) * block_size)  # no chunk larger than the queries
    q = _pad_to(q, 1, chunk)
    k = _pad_to(k, 1, block_size)
    Tb, Sb = _cdiv(T, block_size), _cdiv(S, block_size)
    rows, cols, per_block = chunk // stride, k.shape[1] // stride, block_size // stride
    num_chunks = q.shape[1] // chunk
    scale = 1.0 / math.sqrt(H) / stride / norm  # norm may be traced
    shift = _cdiv(kv_len - q_len, stride)[:, None, None, None]  # [B, 1, 1, 1]
    valid_rows = _cdiv(q_len, stride)[:, None, None, None]
    valid_cols = _cdiv(kv_len, stride)[:, None, None, None]
    n = jnp.arange(cols, dtype=jnp.int32)

    def chunk_sums(args):
        q_chunk, c = args  # [B, chunk, N, H], chunk index
        a = antidiagonal_scores(q_chunk, k, stride) * scale  # [B, N, rows, cols]
        m = c * rows + jnp.arange(rows, dtype=jnp.int32)[:, None]  # query-local reduced row
        visible = (n <= m + shift) & (n < valid_cols) & (m < valid_rows)
        a = jnp.where(visible, a, -jnp.inf)
        row_max = jnp.max(a, axis=-1, keepdims=True)
        p = jnp.where(visible, jnp.exp(a - jnp.where(jnp.isfinite(row_max), row_max, 0.0)), 0.0)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(denom > 0, denom, 1.0)
        p = p.reshape(B, N, rows // per_block, per_block, cols // per_block, per_block)
        return p.sum(axis=(3, 5))  # [B, N, chunk / bs, Sb_pad]

    q_chunks = jnp.moveaxis(q.reshape(B, num_chunks, chunk, N, H), 1, 0)
    sums = jax.lax.map(chunk_sums, (q_chunks, jnp.arange(num_chunks, dtype=jnp.int32)))
    sums = jnp.moveaxis(sums, 0, 2).reshape(B, N, num_chunks * (chunk // block_size), -1)
    sums = sums[:, :, :Tb, :Sb]

    diagonal = diagonal_blocks(Tb, q_len, kv_len, block_size)
    mask = find_blocks(sums, diagonal, threshold)
    r = jnp.arange(Tb, dtype=jnp.int32)[:, None]
    j = jnp.arange(Sb, dtype=jnp.int32)
    in_range = ((r < _cdiv(q_len, block_size)[:, None, None])
                & (j < _cdiv(kv_len, block_size)[:, None, None]))
    return sums, mask & in_range[:, None]


E4M3_MAX = 448.0


def quantize_e4m3(x, lengths, stride):
    """`x [B, L, heads, H]` rounded to e4m3 with one power-of-two scale per (request, head,
    `stride` consecutive tokens): returns `(x8 [B, L, heads, H] float8_e4m3fn, scale [B, heads,
    ceil(L / stride)] float32)`, `x ≈ x8 · scale`. A group's `amax / scale` lies in [224, 448)
    (an all-zero group gets scale 1); tokens at or past `lengths [B]` are read as 0 (they may
    hold NaN). Rounding to nearest even, as `cvt.rn.satfinite` on the GPU."""
    b, l, heads, h = x.shape
    keep = (jnp.arange(l)[None, :] < lengths[:, None])[:, :, None, None]
    x = jnp.where(keep, x.astype(jnp.float32), 0.0)
    groups = _pad_to(x, 1, stride).reshape(b, -1, stride, heads, h)
    amax = jnp.max(jnp.abs(groups), axis=(2, 4))  # [B, L / st, heads]
    # amax / 448 = m · 2^e with m in [1/2, 1); an all-zero group takes e = 0.
    _, exponent = jnp.frexp(jnp.where(amax > 0, amax, E4M3_MAX / 2) / E4M3_MAX)
    scale = jnp.ldexp(jnp.float32(1.0), exponent)  # 2^e: amax / scale in [224, 448)
    per_token = jnp.repeat(1.0 / scale, stride, axis=1)[:, :l, :, None]  # powers of two: exact
    x8 = jnp.clip(x * per_token, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)
    return x8, scale.transpose(0, 2, 1)


def dequantize_e4m3(x8, scale, stride):
    """`x8 · scale` in float32 (exact), the inverse layout of `quantize_e4m3`."""
    per_token = jnp.repeat(scale.transpose(0, 2, 1), stride, axis=1)[:, :x8.shape[1]]
    return x8.astype(jnp.float32) * per_token[..., None]
