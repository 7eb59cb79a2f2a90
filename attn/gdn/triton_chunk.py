"""Triton chunked (WY) gated delta rule for prefill: three kernels, fla's pipeline.

Chunks of `C = 64` tokens never cross a sequence boundary (`B` rows of T tokens, or the packed
sequences of `cu_seqlens`); a chunk table built in XLA (`_chunk_tables`) gives every chunk slot its
first token and length (0 for the unused slots of the static varlen bound). Per chunk and value
head, with `G` the chunk-local cumulative sum of g and `L_ij = exp(G_i − G_j)` for `j <= i`:

1. `_intra_kernel`, grid `(chunks, Nv)`: `G` (stored, float32); the strictly lower
   `A = (β K Kᵀ) ⊙ L` as 4 × 4 blocks of 16 (10 dots); `T = (I + A)⁻¹` by forward substitution on
   the four diagonal 16 × 16 blocks and block back-substitution for the six below (fla's
   `solve_tril` scheme, kept in registers); the WY pair `W = T (β K ⊙ exp(G))` `[C, H]` and
   `U = T (β V)` `[C, Hv]`, stored.
2. `_state_kernel`, grid `(Ns, Nv, cdiv(Hv, BLOCK_HV))`: the sequential part. One program walks
   its sequence's chunks with a `[H, BLOCK_HV]` float32 state tile in registers: it stores the
   state entering each chunk, `V_new = U − W S` (stored), then
   `S ← exp(G_C) S + (K ⊙ exp(G_C − G))ᵀ V_new`; the last state is the final state.
3. `_output_kernel`, grid `(chunks, Nv, cdiv(Hv, BLOCK_HV))`, parallel over chunks:
   `O = (Q ⊙ exp(G)) S_in + ((Q Kᵀ) ⊙ L) V_new`.

q and k are l2-normalised (optional) and q scaled inside the kernels that read them, so nothing
is precomputed in XLA. Value head h reads key head `h // (Nv // Nk)`. Arithmetic is float32.
Intermediates (W, U, V_new and the per-chunk states) are float32 when q, k and v are float32 (dots
at IEEE precision: the interpreter tests match the reference to ~1e-6), else in v's dtype with
TF32 dots, as fla keeps them in the input dtype.

Supports: any B, T, Nk | Nv, H and Hv (padded to powers of two >= 16 and masked), initial and
final states `[Ns, Nv, H, Hv]` float32, varlen with empty sequences. Not supported: chunk sizes
other than 64, gradients.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from attn._harness import triton_call
from attn.gdn.reference import L2NORM_EPS

CHUNK = 64
_SUB = 16  # rows of the blocks the (I + A)⁻¹ solve works on; CHUNK == 4 * _SUB


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration: value features per program of the state and output kernels, warps."""

    block_hv_state: int = 32
    block_hv_out: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_hv_state", "block_hv_out"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"{self.num_warps=} must be a power of two >= 1")
        if self.num_stages < 1:
            raise ValueError(f"{self.num_stages=} must be >= 1")


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _load_keys(k_ptr, tok, valid, kh, offs_h, mask_h, EPS: tl.constexpr, L2NORM: tl.constexpr,
               NK: tl.constexpr, H: tl.constexpr):
    """`[rows, BLOCK_H]` float32 keys of key head kh at tokens `tok` (zero rows where not valid)."""
    k = tl.load(k_ptr + (tok * NK + kh)[:, None] * H + offs_h[None, :],
                mask=valid[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
    if L2NORM:
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=1) + EPS)[:, None]
    return k


@triton.jit
def _load_rows(k_ptr, v_ptr, g_ptr, beta_ptr, start, n, s, head, kh, offs_h, mask_h, offs_v,
               mask_v, EPS: tl.constexpr, L2NORM: tl.constexpr, NK: tl.constexpr,
               NV: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, SUB: tl.constexpr):
    """Rows `s·SUB ..` of a chunk: keys `[SUB, BLOCK_H]`, values `[SUB, BLOCK_HV]`, g, beta."""
    r = s * SUB + tl.arange(0, SUB)
    valid = r < n
    tok = (start + r).to(tl.int64)
    k = _load_keys(k_ptr, tok, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    v = tl.load(v_ptr + (tok * NV + head)[:, None] * HV + offs_v[None, :],
                mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    g = tl.load(g_ptr + tok * NV + head, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + tok * NV + head, mask=valid, other=0.0).to(tl.float32)
    return k, v, g, beta, tok, valid


@triton.jit
def _block(ki, bi, gi, kj, gj, IEEE: tl.constexpr):
    """Below-diagonal block `(β_i K_i K_jᵀ) ⊙ exp(G_i − G_j)`, `[SUB, SUB]` (every i after j)."""
    return _dot(ki * bi[:, None], tl.trans(kj), IEEE) * tl.exp(gi[:, None] - gj[None, :])


@triton.jit
def _diag_block(ki, bi, gi, SUB: tl.constexpr, IEEE: tl.constexpr):
    """Strictly lower part of a diagonal block; the mask comes before the exp (no overflow)."""
    r = tl.arange(0, SUB)
    lower = r[:, None] > r[None, :]
    decay = tl.exp(tl.where(lower, gi[:, None] - gi[None, :], float("-inf")))
    return tl.where(lower, _dot(ki * bi[:, None], tl.trans(ki), IEEE) * decay, 0.0)


@triton.jit
def _store_rows(ptr, tok, valid, head, offs, mask, x, NV: tl.constexpr, D: tl.constexpr):
    tl.store(ptr + (tok * NV + head)[:, None] * D + offs[None, :], x.to(ptr.dtype.element_ty),
             mask=valid[:, None] & mask[None, :])


@triton.jit
def _intra_kernel(
    k_ptr,  # [N_TOK, NK, H]
    v_ptr,  # [N_TOK, NV, HV]
    g_ptr,  # [N_TOK, NV]
    beta_ptr,  # [N_TOK, NV]
    cstart_ptr,  # [NC] int32 first token of each chunk
    clen_ptr,  # [NC] int32 tokens of each chunk (0: an unused slot)
    gcum_ptr,  # [N_TOK, NV] float32, out
    w_ptr,  # [N_TOK, NV, H], out
    u_ptr,  # [N_TOK, NV, HV], out
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    IEEE: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
):
    ci = tl.program_id(0)
    head = tl.program_id(1)
    kh = head // (NV // NK)
    start = tl.load(cstart_ptr + ci)
    n = tl.load(clen_ptr + ci)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_v = offs_v < HV

    k0, v0, g0, b0, t0, m0 = _load_rows(k_ptr, v_ptr, g_ptr, beta_ptr, start, n, 0, head, kh,
                                        offs_h, mask_h, offs_v, mask_v, EPS, L2NORM, NK, NV, H,
                                        HV, SUB)
    k1, v1, g1, b1, t1, m1 = _load_rows(k_ptr, v_ptr, g_ptr, beta_ptr, start, n, 1, head, kh,
                                        offs_h, mask_h, offs_v, mask_v, EPS, L2NORM, NK, NV, H,
                                        HV, SUB)
    k2, v2, g2, b2, t2, m2 = _load_rows(k_ptr, v_ptr, g_ptr, beta_ptr, start, n, 2, head, kh,
                                        offs_h, mask_h, offs_v, mask_v, EPS, L2NORM, NK, NV, H,
                                        HV, SUB)
    k3, v3, g3, b3, t3, m3 = _load_rows(k_ptr, v_ptr, g_ptr, beta_ptr, start, n, 3, head, kh,
                                        offs_h, mask_h, offs_v, mask_v, EPS, L2NORM, NK, NV, H,
                                        HV, SUB)
    # Chunk-local cumulative log-decay G, [SUB] per block (padding rows add g = 0).
    last = tl.arange(0, SUB) == SUB - 1
    g0 = tl.cumsum(g0, axis=0)
    g1 = tl.cumsum(g1, axis=0) + tl.sum(tl.where(last, g0, 0.0), axis=0)
    g2 = tl.cumsum(g2, axis=0) + tl.sum(tl.where(last, g1, 0.0), axis=0)
    g3 = tl.cumsum(g3, axis=0) + tl.sum(tl.where(last, g2, 0.0), axis=0)
    tl.store(gcum_ptr + t0 * NV + head, g0, mask=m0)
    tl.store(gcum_ptr + t1 * NV + head, g1, mask=m1)
    tl.store(gcum_ptr + t2 * NV + head, g2, mask=m2)
    tl.store(gcum_ptr + t3 * NV + head, g3, mask=m3)

    # A = StrictLower((β K Kᵀ) ⊙ L) in 4 × 4 blocks; a00..a33 on the diagonal, a_ij below.
    a00 = _diag_block(k0, b0, g0, SUB, IEEE)
    a11 = _diag_block(k1, b1, g1, SUB, IEEE)
    a22 = _diag_block(k2, b2, g2, SUB, IEEE)
    a33 = _diag_block(k3, b3, g3, SUB, IEEE)
    a10 = _block(k1, b1, g1, k0, g0, IEEE)
    a20 = _block(k2, b2, g2, k0, g0, IEEE)
    a21 = _block(k2, b2, g2, k1, g1, IEEE)
    a30 = _block(k3, b3, g3, k0, g0, IEEE)
    a31 = _block(k3, b3, g3, k1, g1, IEEE)
    a32 = _block(k3, b3, g3, k2, g2, IEEE)

    # Diagonal blocks of T: (I + a_ii)⁻¹ by forward substitution, one row at a time:
    # d[r] = e_r − Σ_{s<r} a[r, s] d[s] (row r of a is zero from column r on).
    r = tl.arange(0, SUB)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    d0 = eye
    d1 = eye
    d2 = eye
    d3 = eye
    for i in range(1, SUB):
        row = r[:, None] == i  # [SUB, 1]
        d0 = tl.where(row, d0 - tl.sum(tl.sum(tl.where(row, a00, 0.0), axis=0)[:, None] * d0,
                                       axis=0)[None, :], d0)
        d1 = tl.where(row, d1 - tl.sum(tl.sum(tl.where(row, a11, 0.0), axis=0)[:, None] * d1,
                                       axis=0)[None, :], d1)
        d2 = tl.where(row, d2 - tl.sum(tl.sum(tl.where(row, a22, 0.0), axis=0)[:, None] * d2,
                                       axis=0)[None, :], d2)
        d3 = tl.where(row, d3 - tl.sum(tl.sum(tl.where(row, a33, 0.0), axis=0)[:, None] * d3,
                                       axis=0)[None, :], d3)
    # Blocks below: T_ij = −d_i Σ_{j<=m<i} a_im T_mj, with T_jj = d_j.
    t10 = -_dot(d1, _dot(a10, d0, IEEE), IEEE)
    t21 = -_dot(d2, _dot(a21, d1, IEEE), IEEE)
    t32 = -_dot(d3, _dot(a32, d2, IEEE), IEEE)
    t20 = -_dot(d2, _dot(a20, d0, IEEE) + _dot(a21, t10, IEEE), IEEE)
    t31 = -_dot(d3, _dot(a31, d1, IEEE) + _dot(a32, t21, IEEE), IEEE)
    t30 = -_dot(d3, _dot(a30, d0, IEEE) + _dot(a31, t10, IEEE) + _dot(a32, t20, IEEE), IEEE)

    # W = T (β K ⊙ exp(G)), U = T (β V), block row by block row.
    rk0 = k0 * (b0 * tl.exp(g0))[:, None]
    rk1 = k1 * (b1 * tl.exp(g1))[:, None]
    rk2 = k2 * (b2 * tl.exp(g2))[:, None]
    rk3 = k3 * (b3 * tl.exp(g3))[:, None]
    rv0 = v0 * b0[:, None]
    rv1 = v1 * b1[:, None]
    rv2 = v2 * b2[:, None]
    rv3 = v3 * b3[:, None]
    _store_rows(w_ptr, t0, m0, head, offs_h, mask_h, _dot(d0, rk0, IEEE), NV, H)
    _store_rows(u_ptr, t0, m0, head, offs_v, mask_v, _dot(d0, rv0, IEEE), NV, HV)
    _store_rows(w_ptr, t1, m1, head, offs_h, mask_h,
                _dot(t10, rk0, IEEE) + _dot(d1, rk1, IEEE), NV, H)
    _store_rows(u_ptr, t1, m1, head, offs_v, mask_v,
                _dot(t10, rv0, IEEE) + _dot(d1, rv1, IEEE), NV, HV)
    _store_rows(w_ptr, t2, m2, head, offs_h, mask_h,
                _dot(t20, rk0, IEEE) + _dot(t21, rk1, IEEE) + _dot(d2, rk2, IEEE), NV, H)
    _store_rows(u_ptr, t2, m2, head, offs_v, mask_v,
                _dot(t20, rv0, IEEE) + _dot(t21, rv1, IEEE) + _dot(d2, rv2, IEEE), NV, HV)
    _store_rows(w_ptr, t3, m3, head, offs_h, mask_h,
                _dot(t30, rk0, IEEE) + _dot(t31, rk1, IEEE) + _dot(t32, rk2, IEEE)
                + _dot(d3, rk3, IEEE), NV, H)
    _store_rows(u_ptr, t3, m3, head, offs_v, mask_v,
                _dot(t30, rv0, IEEE) + _dot(t31, rv1, IEEE) + _dot(t32, rv2, IEEE)
                + _dot(d3, rv3, IEEE), NV, HV)


@triton.jit
def _state_kernel(
    k_ptr,  # [N_TOK, NK, H]
    w_ptr,  # [N_TOK, NV, H]
    u_ptr,  # [N_TOK, NV, HV]
    gcum_ptr,  # [N_TOK, NV] float32
    cstart_ptr,  # [NC] int32
    clen_ptr,  # [NC] int32
    sfirst_ptr,  # [NS] int32 first chunk of each sequence
    scount_ptr,  # [NS] int32 chunks of each sequence
    h0_ptr,  # [NS, NV, H, HV] float32 (a dummy unless HAS_INIT)
    hbuf_ptr,  # [NC, NV, H, HV] state entering each chunk, out
    vnew_ptr,  # [N_TOK, NV, HV] V_new = U − W S, out
    final_ptr,  # [NS, NV, H, HV] float32, out
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_INIT: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    kh = head // (NV // NK)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.program_id(2) * BLOCK_HV + tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_v = offs_v < HV
    tile = offs_h[:, None] * HV + offs_v[None, :]  # [BLOCK_H, BLOCK_HV]
    mask = mask_h[:, None] & mask_v[None, :]
    state_row = (seq.to(tl.int64) * NV + head) * (H * HV)
    if HAS_INIT:
        s = tl.load(h0_ptr + state_row + tile, mask=mask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK_H, BLOCK_HV), tl.float32)

    r = tl.arange(0, BT)
    first = tl.load(sfirst_ptr + seq)
    count = tl.load(scount_ptr + seq)
    for c in range(0, count):
        ci = first + c
        start = tl.load(cstart_ptr + ci)
        n = tl.load(clen_ptr + ci)
        tl.store(hbuf_ptr + (ci.to(tl.int64) * NV + head) * (H * HV) + tile,
                 s.to(hbuf_ptr.dtype.element_ty), mask=mask)
        valid = r < n
        tok = (start + r).to(tl.int64)
        w = tl.load(w_ptr + (tok * NV + head)[:, None] * H + offs_h[None, :],  # [BT, BLOCK_H]
                    mask=valid[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
        u = tl.load(u_ptr + (tok * NV + head)[:, None] * HV + offs_v[None, :],  # [BT, BLOCK_HV]
                    mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        v_new = u - _dot(w, s, IEEE)  # [BT, BLOCK_HV]
        _store_rows(vnew_ptr, tok, valid, head, offs_v, mask_v, v_new, NV, HV)
        if not IEEE:
            v_new = v_new.to(vnew_ptr.dtype.element_ty).to(tl.float32)  # what the output reads
        gc = tl.load(gcum_ptr + tok * NV + head, mask=valid, other=0.0)  # [BT]
        g_last = tl.load(gcum_ptr + (start + n - 1).to(tl.int64) * NV + head)
        k = _load_keys(k_ptr, tok, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)  # [BT, BLOCK_H]
        k = k * tl.exp(g_last - gc)[:, None]
        s = s * tl.exp(g_last) + _dot(tl.trans(k), v_new, IEEE)
    tl.store(final_ptr + state_row + tile, s, mask=mask)


@triton.jit
def _output_kernel(
    q_ptr,  # [N_TOK, NK, H]
    k_ptr,  # [N_TOK, NK, H]
    gcum_ptr,  # [N_TOK, NV] float32
    hbuf_ptr,  # [NC, NV, H, HV]
    vnew_ptr,  # [N_TOK, NV, HV]
    cstart_ptr,  # [NC] int32
    clen_ptr,  # [NC] int32
    o_ptr,  # [N_TOK, NV, HV], out
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    IEEE: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
):
    ci = tl.program_id(0)
    head = tl.program_id(1)
    kh = head // (NV // NK)
    start = tl.load(cstart_ptr + ci)
    n = tl.load(clen_ptr + ci)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.program_id(2) * BLOCK_HV + tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_v = offs_v < HV
    r = tl.arange(0, BT)
    valid = r < n
    tok = (start + r).to(tl.int64)

    q = _load_keys(q_ptr, tok, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H) * SCALE
    k = _load_keys(k_ptr, tok, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)  # [BT, BLOCK_H]
    gc = tl.load(gcum_ptr + tok * NV + head, mask=valid, other=0.0)  # [BT]
    s = tl.load(  # [BLOCK_H, BLOCK_HV], the state entering the chunk
        hbuf_ptr + (ci.to(tl.int64) * NV + head) * (H * HV) + offs_h[:, None] * HV
        + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    v_new = tl.load(vnew_ptr + (tok * NV + head)[:, None] * HV + offs_v[None, :],
                    mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    causal = r[:, None] >= r[None, :]
    decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT]
    scores = tl.where(causal, _dot(q, tl.trans(k), IEEE) * decay, 0.0)
    o = _dot(q * tl.exp(gc)[:, None], s, IEEE) + _dot(scores, v_new, IEEE)  # [BT, BLOCK_HV]
    _store_rows(o_ptr, tok, valid, head, offs_v, mask_v, o, NV, HV)


def _chunk_tables(b: int, t: int, cu_seqlens):
    """Chunk slots of C tokens that never cross a sequence.

    Returns:
      `(chunk_start [Nc], chunk_len [Nc], seq_first_chunk [Ns], seq_chunks [Ns])` int32; unused
      slots (varlen's static bound `Nc = (T + Ns (C − 1)) // C`) have length 0.
    """
    c = CHUNK
    if cu_seqlens is None:
        per_row = -(-t // c)
        j = np.arange(b * per_row)
        local = j % per_row
        tables = ((j // per_row) * t + local * c, np.minimum(t - local * c, c),
                  np.arange(b) * per_row, np.full(b, per_row))
        return tuple(jnp.asarray(x, jnp.int32) for x in tables)
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    count = (cu[1:] - cu[:-1] + c - 1) // c
    end = jnp.cumsum(count)
    first = end - count
    j = jnp.arange(max((t + n * (c - 1)) // c, 1), dtype=jnp.int32)
    seq_raw = jnp.searchsorted(end, j, side="right")
    used = seq_raw < n
    seq = jnp.minimum(seq_raw, n - 1)
    start = cu[seq] + (j - first[seq]) * c
    length = jnp.where(used, jnp.clip(cu[seq + 1] - start, 0, c), 0)
    return (jnp.where(used, start, 0).astype(jnp.int32), length.astype(jnp.int32),
            first.astype(jnp.int32), count.astype(jnp.int32))


def gdn_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=False,
                cu_seqlens=None, config: Config | None = None):
    """Chunked gated delta rule (C = 64) through the kernels; inputs validated by the api.

    Args:
      q, k: `[B, T, Nk, H]`; v `[B, T, Nv, Hv]`; g, beta `[B, T, Nv]`.
      scale: query scale, None for `H ** -0.5`.
      initial_state: `[Ns, Nv, H, Hv]` (cast to float32), or None for zeros.
      use_qk_l2norm: l2-normalise q and k over H in the kernels (eps 1e-6).
      cu_seqlens: `[Ns + 1]` packed-sequence boundaries (`B == 1`), or None (`Ns = B`).
      config: launch configuration; None for `Config()`.

    Returns:
      `(o [B, T, Nv, Hv] in q.dtype, final_state [Ns, Nv, H, Hv] float32)`.
    """
    bsz, t, nk, h = q.shape
    nv, hv = v.shape[2:]
    n_tok = bsz * t
    n_seq = bsz if cu_seqlens is None else cu_seqlens.shape[0] - 1
    config = Config() if config is None else config
    scale = h**-0.5 if scale is None else scale
    ieee = all(x.dtype == jnp.float32 for x in (q, k, v))
    inter = jnp.float32 if ieee else v.dtype
    cstart, clen, sfirst, scount = _chunk_tables(bsz, t, cu_seqlens)
    n_chunks = cstart.shape[0]
    q2, k2 = q.reshape(n_tok, nk, h), k.reshape(n_tok, nk, h)
    v2 = v.reshape(n_tok, nv, hv)
    g2, beta2 = g.reshape(n_tok, nv), beta.reshape(n_tok, nv)
    block_h = max(16, triton.next_power_of_2(h))
    common = dict(EPS=L2NORM_EPS, L2NORM=bool(use_qk_l2norm), IEEE=ieee, NK=nk, NV=nv, H=h, HV=hv,
                  BLOCK_H=block_h)

    gcum, w, u = triton_call(
        k2, v2, g2, beta2, cstart, clen,
        kernel=_intra_kernel,
        out_shape=(jax.ShapeDtypeStruct((n_tok, nv), jnp.float32),
                   jax.ShapeDtypeStruct((n_tok, nv, h), inter),
                   jax.ShapeDtypeStruct((n_tok, nv, hv), inter)),
        grid=(n_chunks, nv),
        num_warps=config.num_warps,
        num_stages=1,
        SUB=_SUB, BLOCK_HV=max(16, triton.next_power_of_2(hv)), **common,
    )
    has_init = initial_state is not None
    h0 = initial_state.astype(jnp.float32) if has_init else jnp.zeros((1,), jnp.float32)
    bv = min(config.block_hv_state, max(16, triton.next_power_of_2(hv)))
    hbuf, v_new, final = triton_call(
        k2, w, u, gcum, cstart, clen, sfirst, scount, h0,
        kernel=_state_kernel,
        out_shape=(jax.ShapeDtypeStruct((n_chunks, nv, h, hv), inter),
                   jax.ShapeDtypeStruct((n_tok, nv, hv), inter),
                   jax.ShapeDtypeStruct((n_seq, nv, h, hv), jnp.float32)),
        grid=(n_seq, nv, triton.cdiv(hv, bv)),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        HAS_INIT=has_init, BT=CHUNK, BLOCK_HV=bv, **common,
    )
    bv = min(config.block_hv_out, max(16, triton.next_power_of_2(hv)))
    o = triton_call(
        q2, k2, gcum, hbuf, v_new, cstart, clen,
        kernel=_output_kernel,
        out_shape=jax.ShapeDtypeStruct((n_tok, nv, hv), q.dtype),
        grid=(n_chunks, nv, triton.cdiv(hv, bv)),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        SCALE=float(scale), BT=CHUNK, BLOCK_HV=bv, **common,
    )
    return o.reshape(bsz, t, nv, hv), final
