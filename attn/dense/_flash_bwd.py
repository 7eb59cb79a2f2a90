"""Triton flash backward of the dense kernel (`attn/dense/triton.py`), FlashAttention-2,
recomputing the probabilities from the forward's lse.

`delta = rowsum(dO * O) - dlse` in XLA, then two kernels: dQ (the forward's programs and key
tiles: `BLOCK_M` folded rows of one KV head walk their key tiles) and dK / dV (one program per key
tile of a KV head, walking the folded query rows that see it, so the heads of a group sum without
atomics). Both split their range into masked tiles (rows see the tile only partly) and whole
tiles (no mask), as the forward does. In a masked tile `dS` is selected by the mask rather than
multiplied by `P = 0`, and dQ zeroes non-finite keys before `dS K`, so a NaN key or value that a
row does not see reaches none of its gradients (the whole tiles need neither: every row sees every
key there). A row that sees nothing has lse -inf, P = 0 and zero gradients.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn._harness import triton_call
from attn.dense._flash_tiles import _key_tiles, _load, _shapes, _visible


@triton.jit
def _dq_visit(
    dq,  # [BLOCK_M, BLOCK_H] f32
    q,  # [BLOCK_M, BLOCK_H]
    do,  # [BLOCK_M, BLOCK_HV]
    lse2,  # [BLOCK_M] base-2 log-sum-exp of the scaled scores; +inf for rows that see nothing
    delta,  # [BLOCK_M] f32
    k_base,
    v_base,
    pos,
    lo,
    hi,
    kv_len,
    win,
    sinks,
    SCALE_LOG2: tl.constexpr,
    K: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    for start in range(lo, hi, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        cols = start + offs_n  # [BLOCK_N]
        in_kv = cols < kv_len
        k = _load(k_base + cols[:, None] * (K * H) + offs_h[None, :],  # [BLOCK_N, BLOCK_H]
                  in_kv, offs_h < H, MASKED, BLOCK_H != H)
        v = _load(v_base + cols[:, None] * (K * HV) + offs_hv[None, :],  # [BLOCK_N, BLOCK_HV]
                  in_kv, offs_hv < HV, MASKED, BLOCK_HV != HV)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        p = tl.exp2(qk * SCALE_LOG2 - lse2[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
        if MASKED:  # selected, not multiplied: P = 0 times a NaN key / value would leak
            visible = _visible(cols[None, :], pos[:, None], kv_len, win, sinks, CAUSAL)
            ds = tl.where(visible, ds, 0.0)
            k = tl.where(tl.abs(k.to(tl.float32)) < float("inf"), k, 0.0)  # dS = 0 times it
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq


@triton.jit
def _flash_bwd_dq_kernel(
    q_ptr,  # [B, T, N, H]
    k_ptr,  # [B, S, K, H]
    v_ptr,  # [B, S, K, HV]
    do_ptr,  # [B, T, N, HV]
    lse_ptr,  # [B, T, N] f32
    delta_ptr,  # [B, T, N] f32
    offset_ptr,  # [B] int32
    len_ptr,  # [B] int32
    window_ptr,  # [K] int32
    sink_ptr,  # [K] int32
    dq_ptr,  # [B, T, N, H]
    SCALE: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    CAUSAL: tl.constexpr,
    NUM_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kh = pid % K
    b = (pid // K) % B
    mt = NUM_M - 1 - pid // (K * B)
    N: tl.constexpr = K * G
    SCALE_LOG2: tl.constexpr = SCALE * 1.4426950408889634

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < T * G
    tok = rows // G
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    q_off = tl.load(offset_ptr + b)
    kv_len = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), S)
    pos = q_off + tok
    q_lo = q_off + (mt * BLOCK_M) // G
    q_hi = q_off + tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // G, T - 1)
    sinks = tl.maximum(tl.load(sink_ptr + kh), 0)
    win, sink_end, main_lo, full_lo, full_hi, end = _key_tiles(
        q_lo, q_hi, kv_len, tl.load(window_ptr + kh), sinks, CAUSAL, BLOCK_N)

    q_rows = b.to(tl.int64) * (T * N) + tok * N + kh * G + rows % G  # [BLOCK_M]
    mask_qh = row_ok[:, None] & (offs_h < H)[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * H + offs_h[None, :], mask=mask_qh, other=0.0)
    do = tl.load(do_ptr + q_rows[:, None] * HV + offs_hv[None, :],
                 mask=row_ok[:, None] & (offs_hv < HV)[None, :], other=0.0)
    lse = tl.load(lse_ptr + q_rows, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + q_rows, mask=row_ok, other=0.0)
    k_base = k_ptr + b.to(tl.int64) * (S * K * H) + kh * H
    v_base = v_ptr + b.to(tl.int64) * (S * K * HV) + kh * HV

    dq = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    dq = _dq_visit(dq, q, do, lse2, delta, k_base, v_base, pos, 0, sink_end, kv_len, win, sinks,
                   SCALE_LOG2, K, H, HV, CAUSAL, True, BLOCK_N, BLOCK_H, BLOCK_HV, PRECISION)
    dq = _dq_visit(dq, q, do, lse2, delta, k_base, v_base, pos, main_lo, full_lo, kv_len, win,
                   sinks, SCALE_LOG2, K, H, HV, CAUSAL, True, BLOCK_N, BLOCK_H, BLOCK_HV,
                   PRECISION)
    dq = _dq_visit(dq, q, do, lse2, delta, k_base, v_base, pos, full_lo, full_hi, kv_len, win,
                   sinks, SCALE_LOG2, K, H, HV, CAUSAL, False, BLOCK_N, BLOCK_H, BLOCK_HV,
                   PRECISION)
    dq = _dq_visit(dq, q, do, lse2, delta, k_base, v_base, pos, full_hi, end, kv_len, win, sinks,
                   SCALE_LOG2, K, H, HV, CAUSAL, True, BLOCK_N, BLOCK_H, BLOCK_HV, PRECISION)
    tl.store(dq_ptr + q_rows[:, None] * H + offs_h[None, :],
             (dq * SCALE).to(dq_ptr.dtype.element_ty), mask=mask_qh)


@triton.jit
def _dkdv_visit(
    dk,  # [BLOCK_N, BLOCK_H] f32
    dv,  # [BLOCK_N, BLOCK_HV] f32
    k,  # [BLOCK_N, BLOCK_H]
    v,  # [BLOCK_N, BLOCK_HV]
    cols,  # [BLOCK_N] key positions
    q_base,  # -> q[b, 0, 0, 0]
    do_base,  # -> do[b, 0, 0, 0]
    lse_base,  # -> lse[b, 0, 0]
    delta_base,  # -> delta[b, 0, 0]
    q_off,
    kh,
    lo,  # first folded row (multiple of BLOCK_M)
    hi,  # end row (multiple of BLOCK_M)
    kv_len,
    win,
    sinks,
    SCALE_LOG2: tl.constexpr,
    T: tl.constexpr,
    N: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    CAUSAL: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    for start in range(lo, hi, BLOCK_M):
        start = tl.multiple_of(start, BLOCK_M)
        rows = start + offs_m  # [BLOCK_M] folded rows
        row_ok = rows < T * G
        tok = rows // G
        q_rows = tok * N + kh * G + rows % G  # [BLOCK_M] rows of this batch's [T * N]
        q = _load(q_base + q_rows[:, None] * H + offs_h[None, :],  # [BLOCK_M, BLOCK_H]
                  row_ok, offs_h < H, MASKED, BLOCK_H != H)
        do = _load(do_base + q_rows[:, None] * HV + offs_hv[None, :],  # [BLOCK_M, BLOCK_HV]
                   row_ok, offs_hv < HV, MASKED, BLOCK_HV != HV)
        lse = tl.load(lse_base + q_rows, mask=row_ok, other=float("-inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        delta = tl.load(delta_base + q_rows, mask=row_ok, other=0.0)
        qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
        p_t = tl.exp2(qk_t * SCALE_LOG2 - lse2[None, :])
        if MASKED:
            pos = q_off + tok
            visible = _visible(cols[:, None], pos[None, :], kv_len, win, sinks, CAUSAL)
            visible = visible & row_ok[None, :]  # padding rows past T: a NaN key would leak
            p_t = tl.where(visible, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])
        if MASKED:  # P = 0 times a NaN value in dP would leak into dK
            ds_t = tl.where(visible, ds_t, 0.0)
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_kernel(
    q_ptr,  # [B, T, N, H]
    k_ptr,  # [B, S, K, H]
    v_ptr,  # [B, S, K, HV]
    do_ptr,  # [B, T, N, HV]
    lse_ptr,  # [B, T, N] f32
    delta_ptr,  # [B, T, N] f32
    offset_ptr,  # [B] int32
    len_ptr,  # [B] int32
    window_ptr,  # [K] int32
    sink_ptr,  # [K] int32
    dk_ptr,  # [B, S, K, H]
    dv_ptr,  # [B, S, K, HV]
    SCALE: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Key tiles in order: under a causal mask the first ones are seen by the most rows.
    pid = tl.program_id(0)
    kh = pid % K
    b = (pid // K) % B
    nt = pid // (K * B)
    N: tl.constexpr = K * G
    SCALE_LOG2: tl.constexpr = SCALE * 1.4426950408889634

    n_lo = nt * BLOCK_N
    cols = n_lo + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    q_off = tl.load(offset_ptr + b)
    kv_len = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), S)
    window = tl.load(window_ptr + kh)
    sinks = tl.maximum(tl.load(sink_ptr + kh), 0)
    has_win = window > 0
    win = tl.where(has_win, window, 1 << 30)

    # Tokens that see some key of the tile: [t_lo, t_hi]; that see all of it: [t_a, t_b].
    n_last = tl.minimum(n_lo + BLOCK_N, kv_len) - 1
    if CAUSAL:
        t_lo = tl.maximum(n_lo - q_off, 0)
        t_a = tl.maximum(n_lo + BLOCK_N - 1 - q_off, 0)
    else:
        t_lo = 0
        t_a = 0
    t_hi = tl.where(has_win & (n_lo >= sinks), tl.minimum(n_last + window - 1 - q_off, T - 1),
                    T - 1)
    t_hi = tl.where(n_lo < kv_len, t_hi, -1)
    t_b = tl.where(has_win & (n_lo + BLOCK_N > sinks),
                   tl.minimum(n_lo + window - 1 - q_off, T - 1), T - 1)
    t_b = tl.where(n_lo + BLOCK_N <= kv_len, t_b, -1)
    row_lo = t_lo * G
    row_hi = tl.maximum((t_hi + 1) * G, row_lo)
    m_lo = row_lo // BLOCK_M * BLOCK_M
    m_end = tl.cdiv(row_hi, BLOCK_M) * BLOCK_M
    f_lo = tl.minimum(tl.maximum(tl.cdiv(t_a * G, BLOCK_M) * BLOCK_M, m_lo), m_end)
    f_hi = tl.maximum((t_b + 1) * G, 0) // BLOCK_M * BLOCK_M
    f_hi = tl.minimum(tl.maximum(f_hi, f_lo), m_end)

    key_ok = cols < kv_len
    k_rows = b.to(tl.int64) * (S * K) + cols * K + kh  # [BLOCK_N] rows of [B * S * K]
    k = tl.load(k_ptr + k_rows[:, None] * H + offs_h[None, :],  # [BLOCK_N, BLOCK_H]
                mask=key_ok[:, None] & (offs_h < H)[None, :], other=0.0)
    v = tl.load(v_ptr + k_rows[:, None] * HV + offs_hv[None, :],  # [BLOCK_N, BLOCK_HV]
                mask=key_ok[:, None] & (offs_hv < HV)[None, :], other=0.0)
    q_base = q_ptr + b.to(tl.int64) * (T * N * H)
    do_base = do_ptr + b.to(tl.int64) * (T * N * HV)
    lse_base = lse_ptr + b.to(tl.int64) * (T * N)
    delta_base = delta_ptr + b.to(tl.int64) * (T * N)

    dk = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_HV], tl.float32)
    # Rows above the tile's diagonal / window edge, rows that see it whole, rows below.
    dk, dv = _dkdv_visit(dk, dv, k, v, cols, q_base, do_base, lse_base, delta_base, q_off, kh,
                         m_lo, f_lo, kv_len, win, sinks, SCALE_LOG2, T, N, G, H, HV, CAUSAL,
                         True, BLOCK_M, BLOCK_H, BLOCK_HV, PRECISION)
    dk, dv = _dkdv_visit(dk, dv, k, v, cols, q_base, do_base, lse_base, delta_base, q_off, kh,
                         f_lo, f_hi, kv_len, win, sinks, SCALE_LOG2, T, N, G, H, HV, CAUSAL,
                         False, BLOCK_M, BLOCK_H, BLOCK_HV, PRECISION)
    dk, dv = _dkdv_visit(dk, dv, k, v, cols, q_base, do_base, lse_base, delta_base, q_off, kh,
                         f_hi, m_end, kv_len, win, sinks, SCALE_LOG2, T, N, G, H, HV, CAUSAL,
                         True, BLOCK_M, BLOCK_H, BLOCK_HV, PRECISION)
    in_s = cols < S
    tl.store(dk_ptr + k_rows[:, None] * H + offs_h[None, :], (dk * SCALE).to(
        dk_ptr.dtype.element_ty), mask=in_s[:, None] & (offs_h < H)[None, :])
    tl.store(dv_ptr + k_rows[:, None] * HV + offs_hv[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=in_s[:, None] & (offs_hv < HV)[None, :])


def backward(q, k, v, out, lse, d_out, d_lse, q_offset, window, sinks, kv_lengths, *, causal,
              scale, config):
    """dQ, dK, dV. `d_lse` enters through `delta` (d lse / d score = p, as d out does).

    Deterministic: each gradient row is summed by one program in a fixed order (no atomics)."""
    dims = _shapes(q, k, v)
    b, t, _, _ = q.shape
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    args = (q, k, v, d_out.astype(q.dtype), lse, delta, q_offset, kv_lengths, window, sinks)
    launch = dict(num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages, SCALE=scale,
                  CAUSAL=causal, **dims)
    num_m = triton.cdiv(t * dims["G"], config.dq_block_m)
    dq = triton_call(*args, kernel=_flash_bwd_dq_kernel,
                     out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                     grid=(num_m * b * dims["K"],), NUM_M=num_m, BLOCK_M=config.dq_block_m,
                     BLOCK_N=config.dq_block_n, **launch)
    num_n = triton.cdiv(dims["S"], config.dkv_block_n)
    dk, dv = triton_call(*args, kernel=_flash_bwd_dkdv_kernel,
                         out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype),
                                    jax.ShapeDtypeStruct(v.shape, v.dtype)),
                         grid=(num_n * b * dims["K"],), BLOCK_M=config.dkv_block_m,
                         BLOCK_N=config.dkv_block_n, **launch)
    return dq, dk, dv
