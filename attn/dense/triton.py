"""Triton flash prefill: FlashAttention-2 forward and backward with GQA folding, causal offsets,
window + sinks.

One program owns `BLOCK_M` rows of one KV head of one batch row, where a row is a (query token,
query head of that KV head's group) pair: the `G` query heads of a KV head are folded into the M
dimension (row `r` is token `r // G`, head `kh * G + r % G`), so every K/V tile is loaded once for
the whole group and the tensor cores see full tiles for any group size. The program walks its key
tiles with an online softmax in base 2 (the scale folded into one multiply), fp32 accumulators.

Key tiles visited by a program whose rows sit at positions `[q_lo, q_hi]` (causal: `q_offset + t`):
the sink tiles `[0, sinks)`, then `[q_lo - window + 1, min(q_hi + 1, kv_len))`. Only the tiles that
some row sees only partly run with a mask (window edge, causal diagonal, key-length tail, sinks);
the tiles every row sees whole run without one. A 4K window at 64K keys thus costs ~4K keys of work
per row, and causal prefill stops at the diagonal.

Backward (FlashAttention-2, recomputing from the saved lse): `delta = rowsum(dO * O) - dlse` in
XLA, then one kernel for dQ (same programs and key tiles as the forward) and one for dK / dV (one
program per key tile of a KV head, walking the folded query rows that see it, so the group's heads
sum without atomics). The same masked / unmasked tile split applies.

Supports: causal and non-causal, `q_offset` `[B]` (chunked prefill over a cached prefix), window
and sinks per KV head (`window <= 0`: full), `kv_lengths`, any group size, `H` / `Hv` up to 256
(padded to a power of two and masked), bf16 / f16 (f32 with IEEE dots, for tests). A row with no
visible key gives output 0 and lse -inf, and zero gradients.
Not supported (NotImplementedError, so `implementation="auto"` falls back to XLA): segment ids
(packed varlen), a scale <= 0, shapes whose per-batch element offsets overflow int32.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn import _checks
from attn._harness import triton_call

LOG2E = math.log2(math.e)
_INT32_MAX = 2**31 - 1
_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration of the forward (`block_m` rows x `block_n` keys per step) and of the
    two backward kernels (`bwd_*`: dQ walks `bwd_block_n` keys per step over `bwd_block_m` rows,
    dK / dV walks `bwd_block_m` rows per step over `bwd_block_n` keys)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    bwd_block_m: int = 64
    bwd_block_n: int = 64
    bwd_num_warps: int = 8
    bwd_num_stages: int = 2
    # The unmasked key loop as `tl.range(..., warp_specialize=True)`: Triton's Hopper pass splits
    # it into producer (loads) and consumer (dots, softmax) warp groups. Applies with >= 8 warps
    # only (Triton 3.6 does not compile it with 4). `warp_specialize_masked`: the masked loops too.
    warp_specialize: bool = True
    warp_specialize_masked: bool = False

    def __post_init__(self):
        _checks.check_launch_config(
            self, tiles=("block_m", "block_n", "bwd_block_m", "bwd_block_n"),
            warps=("num_warps", "bwd_num_warps"), stages=("num_stages", "bwd_num_stages"))


def default_config(head_dim: int, value_head_dim: int | None = None) -> Config:
    """Tiles for Hopper bf16 at H <= 128: forward 128 rows x 128 keys, 8 warps, 3 stages, the
    unmasked key loop warp-specialised. H100, causal N32/K8 H128 S16K (benchmarks/NOTES.md,
    session 4): 4.09 ms = 537 TFLOP/s = 0.91x cuDNN, against 4.53 ms for the former 128 x 64 tiles
    without warp specialisation (128 x 64 with it 4.43; 2 stages 4.9-5.7; 4 warps do not compile
    warp-specialised). Backward 64 x 64, 8 warps, 2 stages (4 warps spill in dK / dV). Wide heads
    (> 128) take 32-key tiles and 2 stages, unspecialised, so the K/V stages fit in shared memory.
    `python -m experiments.bench_prefill --sweep` / `--sweep-bwd` time alternatives."""
    width = max(head_dim, value_head_dim or head_dim)
    if width > 128:
        return Config(block_m=128, block_n=32, num_warps=8, num_stages=2, bwd_block_m=32,
                      bwd_block_n=32, warp_specialize=False)
    return Config()


@triton.jit
def _load(ptrs, rows_ok, cols_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A 2-D tile, masked only where it has to be (unmasked loads vectorise and pipeline best)."""
    if MASK_ROWS:
        x = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif MASK_COLS:
        x = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _visible(c, p, kv_len, win, sinks, CAUSAL: tl.constexpr):
    """Key positions `c` visible to query positions `p` (broadcast against each other)."""
    vis = (c < kv_len) & ((c > p - win) | (c < sinks))
    if CAUSAL:
        vis = vis & (c <= p)
    return vis


@triton.jit
def _masked_softmax_step(qk, m, visible, SCALE_LOG2: tl.constexpr):
    """One online-softmax step over a tile some rows see only partly: `(p, alpha, m_new)`, with
    `p = 2^(s - m_new)` of the scaled scores `s` (-inf where not `visible`), `alpha` the rescale
    of the old sums, `m_new` the running max. A row that has seen nothing yet keeps p = 0 and
    alpha = 1 (its max stays -inf)."""
    s = tl.where(visible, qk * SCALE_LOG2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
    return tl.exp2(s - m_use[:, None]), tl.exp2(m - m_use), m_new


@triton.jit
def _whole_softmax_step(qk, m, SCALE_LOG2: tl.constexpr):
    """`_masked_softmax_step` for a tile every row sees whole: no mask, and the scale folds into
    the exponent's FMA."""
    m_new = tl.maximum(m, tl.max(qk, 1) * SCALE_LOG2)
    return tl.exp2(qk * SCALE_LOG2 - m_new[:, None]), tl.exp2(m - m_new), m_new


@triton.jit
def _key_tiles(q_lo, q_hi, kv_len, window, sinks, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges (multiples of BLOCK_N) of a query tile at positions `[q_lo, q_hi]`.

    Returns `win, sink_end, main_lo, full_lo, full_hi, end`: masked `[0, sink_end)` (sinks),
    masked `[main_lo, full_lo)` (window edge), unmasked `[full_lo, full_hi)`, masked
    `[full_hi, end)` (diagonal and length tail). `win` is the window, or 2^30 for none.
    """
    if CAUSAL:
        kv_end = tl.maximum(tl.minimum(q_hi + 1, kv_len), 0)
        full_hi = tl.maximum(tl.minimum(q_lo + 1, kv_len), 0) // BLOCK_N * BLOCK_N
    else:
        kv_end = kv_len
        full_hi = kv_len // BLOCK_N * BLOCK_N
    end = tl.cdiv(kv_end, BLOCK_N) * BLOCK_N
    has_win = window > 0  # the wrapper gives non-causal calls no window
    win = tl.where(has_win, window, 1 << 30)
    sink_end = tl.where(has_win, tl.cdiv(tl.minimum(sinks, kv_end), BLOCK_N) * BLOCK_N, 0)
    win_lo = tl.where(has_win, tl.maximum(q_lo - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    main_lo = tl.minimum(tl.maximum(win_lo, sink_end), end)
    full_lo = tl.where(has_win, tl.cdiv(tl.maximum(q_hi - window + 1, 0), BLOCK_N) * BLOCK_N, 0)
    full_lo = tl.minimum(tl.maximum(full_lo, main_lo), end)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return win, sink_end, main_lo, full_lo, full_hi, end


@triton.jit
def _fwd_visit(
    acc,  # [BLOCK_M, BLOCK_HV] f32
    l,  # [BLOCK_M] f32 running sum of 2^(s - m)
    m,  # [BLOCK_M] f32 running max (base-2 scaled scores)
    q,  # [BLOCK_M, BLOCK_H]
    k_base,  # -> k[b, 0, kh, 0]
    v_base,  # -> v[b, 0, kh, 0]
    pos,  # [BLOCK_M] int32 absolute query positions
    lo,  # first key of the range (multiple of BLOCK_N)
    hi,  # end of the range (multiple of BLOCK_N)
    kv_len,  # keys >= kv_len are invisible (and never read)
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
    WARP_SPECIALIZE: tl.constexpr = False,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_hv = offs_hv < HV
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start = tl.multiple_of(start, BLOCK_N)
        cols = start + offs_n  # [BLOCK_N] key positions
        k_ptrs = k_base + cols[:, None] * (K * H) + offs_h[None, :]  # [BLOCK_N, BLOCK_H]
        v_ptrs = v_base + cols[:, None] * (K * HV) + offs_hv[None, :]  # [BLOCK_N, BLOCK_HV]
        in_kv = cols < kv_len
        k = _load(k_ptrs, in_kv, mask_h, MASKED, BLOCK_H != H)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] f32
        if MASKED:
            visible = _visible(cols[None, :], pos[:, None], kv_len, win, sinks, CAUSAL)
            p, alpha, m_new = _masked_softmax_step(qk, m, visible, SCALE_LOG2)
        else:
            p, alpha, m_new = _whole_softmax_step(qk, m, SCALE_LOG2)
        v = _load(v_ptrs, in_kv, mask_hv, MASKED, BLOCK_HV != HV)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m = m_new
    return acc, l, m


@triton.jit
def _flash_fwd_kernel(
    q_ptr,  # [B, T, N, H]
    k_ptr,  # [B, S, K, H]
    v_ptr,  # [B, S, K, HV]
    offset_ptr,  # [B] int32
    len_ptr,  # [B] int32
    window_ptr,  # [K] int32, <= 0: full
    sink_ptr,  # [K] int32
    o_ptr,  # [B, T, N, HV]
    lse_ptr,  # [B, T, N] f32
    SCALE_LOG2: tl.constexpr,
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
    WARP_SPECIALIZE: tl.constexpr = False,
    WS_MASKED: tl.constexpr = False,
):
    # Heads vary fastest (programs in flight share K/V in L2); the last query tiles, which see
    # the most keys under a causal mask, start first so the short ones fill the tail.
    pid = tl.program_id(0)
    kh = pid % K
    b = (pid // K) % B
    mt = NUM_M - 1 - pid // (K * B)
    N: tl.constexpr = K * G

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] folded (token, group head) rows
    row_ok = rows < T * G
    tok = rows // G
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)

    q_off = tl.load(offset_ptr + b)
    kv_len = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), S)
    pos = q_off + tok  # [BLOCK_M]
    q_lo = q_off + (mt * BLOCK_M) // G
    q_hi = q_off + tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // G, T - 1)
    sinks = tl.maximum(tl.load(sink_ptr + kh), 0)
    win, sink_end, main_lo, full_lo, full_hi, end = _key_tiles(
        q_lo, q_hi, kv_len, tl.load(window_ptr + kh), sinks, CAUSAL, BLOCK_N)

    q_rows = b.to(tl.int64) * (T * N) + tok * N + kh * G + rows % G  # [BLOCK_M] of [B * T * N]
    q = tl.load(  # [BLOCK_M, BLOCK_H]
        q_ptr + q_rows[:, None] * H + offs_h[None, :],
        mask=row_ok[:, None] & (offs_h < H)[None, :],
        other=0.0,
    )
    k_base = k_ptr + b.to(tl.int64) * (S * K * H) + kh * H
    v_base = v_ptr + b.to(tl.int64) * (S * K * HV) + kh * HV

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_HV], tl.float32)
    # Sink tiles, the window's lower edge, the tiles every row sees whole, the causal diagonal.
    acc, l, m = _fwd_visit(acc, l, m, q, k_base, v_base, pos, 0, sink_end, kv_len, win, sinks,
                           SCALE_LOG2, K, H, HV, CAUSAL, True, BLOCK_N, BLOCK_H, BLOCK_HV,
                           PRECISION, WS_MASKED)
    acc, l, m = _fwd_visit(acc, l, m, q, k_base, v_base, pos, main_lo, full_lo, kv_len, win,
                           sinks, SCALE_LOG2, K, H, HV, CAUSAL, True, BLOCK_N, BLOCK_H, BLOCK_HV,
                           PRECISION, WS_MASKED)
    acc, l, m = _fwd_visit(acc, l, m, q, k_base, v_base, pos, full_lo, full_hi, kv_len, win,
                           sinks, SCALE_LOG2, K, H, HV, CAUSAL, False, BLOCK_N, BLOCK_H, BLOCK_HV,
                           PRECISION, WARP_SPECIALIZE)
    acc, l, m = _fwd_visit(acc, l, m, q, k_base, v_base, pos, full_hi, end, kv_len, win, sinks,
                           SCALE_LOG2, K, H, HV, CAUSAL, True, BLOCK_N, BLOCK_H, BLOCK_HV,
                           PRECISION, WS_MASKED)

    empty = l == 0.0
    safe_l = tl.where(empty, 1.0, l)
    out = acc / safe_l[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.log2(safe_l)) * 0.6931471805599453)
    tl.store(o_ptr + q_rows[:, None] * HV + offs_hv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_hv < HV)[None, :])
    tl.store(lse_ptr + q_rows, lse, mask=row_ok)


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
        if MASKED:
            p = tl.where(_visible(cols[None, :], pos[:, None], kv_len, win, sinks, CAUSAL), p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        ds = p * (dp - delta[:, None])
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
            p_t = tl.where(_visible(cols[:, None], pos[None, :], kv_len, win, sinks, CAUSAL),
                           p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
        ds_t = p_t * (dp_t - delta[None, :])
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


def _shapes(q, k, v):
    b, t, n, h = q.shape
    s, kh, hv = k.shape[1], k.shape[2], v.shape[-1]
    return dict(B=b, T=t, S=s, K=kh, G=n // kh, H=h, HV=hv,
                BLOCK_H=max(16, triton.next_power_of_2(h)),
                BLOCK_HV=max(16, triton.next_power_of_2(hv)),
                PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")


def _forward(q, k, v, q_offset, window, sinks, kv_lengths, *, causal, scale, config):
    """Launch the forward; integer arguments are int32 arrays (`[B]`, `[K]`, `[K]`, `[B]`)."""
    dims = _shapes(q, k, v)
    b, t, n, _ = q.shape
    num_m = triton.cdiv(t * dims["G"], config.block_m)
    return triton_call(
        q, k, v, q_offset, kv_lengths, window, sinks,
        kernel=_flash_fwd_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, t, n, dims["HV"]), q.dtype),
            jax.ShapeDtypeStruct((b, t, n), jnp.float32),
        ),
        grid=(num_m * b * dims["K"],),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        SCALE_LOG2=scale * LOG2E, CAUSAL=causal, NUM_M=num_m, BLOCK_M=config.block_m,
        BLOCK_N=config.block_n, WARP_SPECIALIZE=config.warp_specialize and config.num_warps >= 8,
        WS_MASKED=config.warp_specialize_masked and config.num_warps >= 8, **dims,
    )


def _backward(q, k, v, out, lse, d_out, d_lse, q_offset, window, sinks, kv_lengths, *, causal,
              scale, config):
    """dQ, dK, dV. `d_lse` enters through `delta` (d lse / d score = p, as d out does)."""
    dims = _shapes(q, k, v)
    b, t, _, _ = q.shape
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    args = (q, k, v, d_out.astype(q.dtype), lse, delta, q_offset, kv_lengths, window, sinks)
    num_m = triton.cdiv(t * dims["G"], config.bwd_block_m)
    launch = dict(num_warps=config.bwd_num_warps, num_stages=config.bwd_num_stages, SCALE=scale,
                  CAUSAL=causal, BLOCK_M=config.bwd_block_m, BLOCK_N=config.bwd_block_n, **dims)
    dq = triton_call(*args, kernel=_flash_bwd_dq_kernel,
                     out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
                     grid=(num_m * b * dims["K"],), NUM_M=num_m, **launch)
    num_n = triton.cdiv(dims["S"], config.bwd_block_n)
    dk, dv = triton_call(*args, kernel=_flash_bwd_dkdv_kernel,
                         out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype),
                                    jax.ShapeDtypeStruct(v.shape, v.dtype)),
                         grid=(num_n * b * dims["K"],), **launch)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _flash(q, k, v, q_offset, window, sinks, kv_lengths, causal, scale, config):
    return _forward(q, k, v, q_offset, window, sinks, kv_lengths, causal=causal, scale=scale,
                    config=config)


def _flash_fwd(q, k, v, q_offset, window, sinks, kv_lengths, causal, scale, config):
    out, lse = _forward(q, k, v, q_offset, window, sinks, kv_lengths, causal=causal, scale=scale,
                        config=config)
    return (out, lse), (q, k, v, out, lse, q_offset, window, sinks, kv_lengths)


def _flash_bwd(causal, scale, config, res, cotangents):
    q, k, v, out, lse, q_offset, window, sinks, kv_lengths = res
    d_out, d_lse = cotangents
    dq, dk, dv = _backward(q, k, v, out, lse, d_out, d_lse, q_offset, window, sinks, kv_lengths,
                           causal=causal, scale=scale, config=config)
    return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "config"))
def _attention(q, k, v, q_offset, window, sinks, kv_lengths, *, causal, scale, config):
    b, kh = q.shape[0], k.shape[2]
    q_offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (b,))
    window = jnp.broadcast_to(jnp.asarray(window, jnp.int32), (kh,))
    sinks = jnp.broadcast_to(jnp.asarray(sinks, jnp.int32), (kh,))
    kv_lengths = jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32), (b,))
    return _flash(q, k, v, q_offset, window, sinks, kv_lengths, causal, scale, config)


def attention(q, k, v, *, causal=True, scale=None, q_offset=0, window=None, sinks=0,
              q_segment_ids=None, kv_segment_ids=None, kv_lengths=None,
              config: Config | None = None):
    """Dense attention through the flash kernels (differentiable); arguments as
    `attn.dense.attention` (validated there), plus `config` (default: `default_config`).

    Returns:
      `(out [B, T, N, Hv] in q's dtype, lse [B, T, N] float32)`.

    Raises:
      NotImplementedError: segment ids, `scale <= 0`, head dims over 256, or per-batch offsets
        beyond int32 (the caller falls back to XLA).
    """
    if q_segment_ids is not None or kv_segment_ids is not None:
        raise NotImplementedError("segment ids (packed varlen) are not supported by the Triton "
                                  "dense kernel yet; use implementation='xla'")
    h, hv = q.shape[-1], v.shape[-1]
    if scale is None:
        scale = h**-0.5
    scale = float(scale)
    if not scale > 0:
        raise NotImplementedError(f"{scale=}: the Triton dense kernel needs a positive scale")
    if max(h, hv) > _MAX_HEAD_DIM:
        raise NotImplementedError(f"head dims H={h}, Hv={hv} over {_MAX_HEAD_DIM} are not "
                                  f"supported by the Triton dense kernel")
    (_, t, n, _), (_, s, kh, _) = q.shape, k.shape
    if max(t * n, s * kh) * max(h, hv) > _INT32_MAX:
        raise NotImplementedError(f"q {q.shape} / k {k.shape}: per-batch offsets overflow int32")
    if config is None:
        config = default_config(h, hv)
    if window is None or not causal:
        window = 0
    if kv_lengths is None:
        kv_lengths = s
    return _attention(q, k, v, q_offset, window, sinks, kv_lengths, causal=bool(causal),
                      scale=scale, config=config)
