"""Triton XAttention estimate: antidiagonal strided scores, causal softmax per reduced row and
block sums in one kernel; the threshold selection (`reference.find_blocks`) stays in XLA.

One program owns `BLOCK_R` reduced query rows (`BLOCK_R * stride / block_size` query tiles) of one
query head of one request. Reduced scores are `A[m, c] = Σ_{i<st} q[m·st + st-1-i] · k[c·st + i]`:
`st` tensor-core dots of `[BLOCK_R, H] x [H, BLOCK_C]`, the query rows gathered at stride `st`. A
first pass over the causally visible reduced columns (`c <= m + ceil((kv_len - q_len) / st)`,
`c < ceil(kv_len / st)`) finds each row's max and sum (online, base 2); the second recomputes the
scores, normalises them and sums the probabilities into `(block_size / st)^2` tiles, written once
each to `block_sums [B, N, Tb, Sb]` (zeroed first: blocks past the diagonal keep 0). Columns past
a program's last visible one are never visited. Work: twice the estimate GEMM of the causal part.

Supports: any group size, `H` up to 256, bf16 / f16 / f32, strides and block sizes that are powers
of two with `block_size / stride` reduced rows per tile. Not differentiable (a mask estimate).
Not supported (NotImplementedError): head dims over 256.
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
from attn.block_sparse.reference import _cdiv, _lengths, diagonal_blocks
from attn.xattention import reference

LOG2E = math.log2(math.e)
_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """`block_r` reduced query rows x `block_c` reduced key columns per step (each raised to the
    `block_size / stride` reduced rows of one tile when that is larger)."""

    block_r: int = 16
    block_c: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        _checks.check_launch_config(self, tiles=("block_r", "block_c"))


@triton.jit
def _scores(q_base, k_base, m, cols, q_len, kv_len,
            ST: tl.constexpr, N: tl.constexpr, K: tl.constexpr, H: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
            PRECISION: tl.constexpr):
    """`[BLOCK_R, BLOCK_C]` f32 antidiagonal sums for reduced rows `m` and columns `cols`."""
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = (offs_h < H)[None, :]
    a = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for i in range(ST):
        q_tok = m * ST + (ST - 1 - i)  # [BLOCK_R]
        k_tok = cols * ST + i  # [BLOCK_C]
        q = tl.load(q_base + q_tok[:, None] * (N * H) + offs_h[None, :],
                    mask=(q_tok < q_len)[:, None] & mask_h, other=0.0)
        k = tl.load(k_base + k_tok[:, None] * (K * H) + offs_h[None, :],
                    mask=(k_tok < kv_len)[:, None] & mask_h, other=0.0)
        a = tl.dot(q, tl.trans(k), a, input_precision=PRECISION)
    return a


@triton.jit
def _block_sums_kernel(
    q_ptr,  # [B, T, N, H]
    k_ptr,  # [B, S, K, H]
    q_len_ptr,  # [B] int32
    kv_len_ptr,  # [B] int32
    shift_ptr,  # [B] int32 ceil((kv_len - q_len) / st)
    rows_ptr,  # [B] int32 ceil(q_len / st): reduced rows of real queries
    cols_ptr,  # [B] int32 ceil(kv_len / st): reduced columns of real keys
    sums_ptr,  # [B, N, TB, SB] f32, zeroed
    SCALE_LOG2: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    ST: tl.constexpr,
    R: tl.constexpr,  # reduced rows (and columns) per block: block_size // stride
    TB: tl.constexpr,
    SB: tl.constexpr,
    NUM_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PRECISION: tl.constexpr,
):
    N: tl.constexpr = K * G
    QB: tl.constexpr = BLOCK_R // R  # query tiles per program
    CB: tl.constexpr = BLOCK_C // R  # key blocks per step
    pid = tl.program_id(0)
    n = pid % N
    b = (pid // N) % B
    mt = NUM_M - 1 - pid // (N * B)
    kh = n // G

    q_len = tl.minimum(tl.maximum(tl.load(q_len_ptr + b), 0), T)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), S)
    shift = tl.load(shift_ptr + b)
    valid_rows = tl.load(rows_ptr + b)
    valid_cols = tl.load(cols_ptr + b)
    m = mt * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] query-local reduced rows
    row_ok = m < valid_rows
    hi = tl.minimum(mt * BLOCK_R + BLOCK_R + shift, valid_cols)  # columns any row may see
    end = (tl.maximum(hi, 0) + BLOCK_C - 1) // BLOCK_C * BLOCK_C
    q_base = q_ptr + b.to(tl.int64) * (T * N * H) + n * H
    k_base = k_ptr + b.to(tl.int64) * (S * K * H) + kh * H
    offs_c = tl.arange(0, BLOCK_C)

    mx = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    for c0 in range(0, end, BLOCK_C):  # pass 1: row max and sum
        cols = c0 + offs_c
        a = _scores(q_base, k_base, m, cols, q_len, kv_len, ST, N, K, H, BLOCK_R, BLOCK_C,
                    BLOCK_H, PRECISION)
        vis = (cols[None, :] <= m[:, None] + shift) & (cols < valid_cols)[None, :] & row_ok[:, None]
        a = tl.where(vis, a * SCALE_LOG2, float("-inf"))
        m_new = tl.maximum(mx, tl.max(a, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(mx - m_use) + tl.sum(tl.exp2(a - m_use[:, None]), 1)
        mx = m_new

    m_use = tl.where(mx == float("-inf"), 0.0, mx)
    inv_l = tl.where(l > 0.0, 1.0 / tl.where(l > 0.0, l, 1.0), 0.0)
    q_blocks = mt * QB + tl.arange(0, QB)  # [QB]
    out_rows = ((b * N + n) * TB + q_blocks).to(tl.int64) * SB  # [QB]
    for c0 in range(0, end, BLOCK_C):  # pass 2: probabilities summed per (q tile, key block)
        cols = c0 + offs_c
        a = _scores(q_base, k_base, m, cols, q_len, kv_len, ST, N, K, H, BLOCK_R, BLOCK_C,
                    BLOCK_H, PRECISION)
        vis = (cols[None, :] <= m[:, None] + shift) & (cols < valid_cols)[None, :] & row_ok[:, None]
        p = tl.where(vis, tl.exp2(a * SCALE_LOG2 - m_use[:, None]) * inv_l[:, None], 0.0)
        per_tile = tl.sum(tl.reshape(p, [QB, R, BLOCK_C]), 1)  # [QB, BLOCK_C]
        sums = tl.sum(tl.reshape(per_tile, [QB, CB, R]), 2)  # [QB, CB]
        k_blocks = c0 // R + tl.arange(0, CB)  # [CB]
        tl.store(sums_ptr + out_rows[:, None] + k_blocks[None, :], sums,
                 mask=(q_blocks < TB)[:, None] & (k_blocks < SB)[None, :])


def check_supported(q) -> None:
    """Raise NotImplementedError for what the kernel does not do (the API then uses XLA)."""
    if q.shape[-1] > _MAX_HEAD_DIM:
        raise NotImplementedError(f"head dim H={q.shape[-1]} over {_MAX_HEAD_DIM} is not "
                                  f"supported by the Triton XAttention estimate")


@functools.partial(jax.jit, static_argnames=("block_size", "stride", "config"))
def block_sums(q, k, norm, q_lengths, kv_lengths, *, block_size, stride, config):
    """`[B, N, Tb, Sb]` f32 block masses, as `reference.xattn_estimate`'s first output."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    q_len, kv_len = _lengths(q_lengths, t, b), _lengths(kv_lengths, s, b)
    r = block_size // stride
    block_r, block_c = max(config.block_r, r), max(config.block_c, r)
    tb, sb = _cdiv(t, block_size), _cdiv(s, block_size)
    num_m = triton.cdiv(tb * r, block_r)
    scale_log2 = LOG2E / math.sqrt(h) / stride
    # norm may be traced: fold it into q (scores are linear in q).
    q = (q.astype(jnp.float32) / norm).astype(q.dtype)
    return triton_call(
        q, k, q_len, kv_len, _cdiv(kv_len - q_len, stride), _cdiv(q_len, stride),
        _cdiv(kv_len, stride),
        kernel=_block_sums_kernel,
        out_shape=jax.ShapeDtypeStruct((b, n, tb, sb), jnp.float32),
        grid=(num_m * b * n,),
        zeroed_outputs=(0,),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        SCALE_LOG2=scale_log2, B=b, T=t, S=s, K=kh, G=n // kh, H=h, ST=stride, R=r, TB=tb,
        SB=sb, NUM_M=num_m, BLOCK_R=block_r, BLOCK_C=block_c,
        BLOCK_H=max(16, triton.next_power_of_2(h)),
        PRECISION="ieee" if q.dtype == jnp.float32 else "tf32",
    )


@functools.partial(jax.jit, static_argnames=("block_size", "stride", "config"))
def _estimate(q, k, threshold, norm, q_lengths, kv_lengths, *, block_size, stride, config):
    b, t = q.shape[:2]
    s = k.shape[1]
    q_len, kv_len = _lengths(q_lengths, t, b), _lengths(kv_lengths, s, b)
    sums = block_sums(q, k, norm, q_len, kv_len, block_size=block_size, stride=stride,
                      config=config)
    tb, sb = sums.shape[2:]
    mask = reference.find_blocks(sums, diagonal_blocks(tb, q_len, kv_len, block_size), threshold)
    r = jnp.arange(tb, dtype=jnp.int32)[:, None]
    j = jnp.arange(sb, dtype=jnp.int32)
    in_range = ((r < _cdiv(q_len, block_size)[:, None, None])
                & (j < _cdiv(kv_len, block_size)[:, None, None]))
    return sums, mask & in_range[:, None]


def xattn_estimate(q, k, *, block_size=128, stride=16, threshold=0.9, norm=1.0, q_lengths=None,
                   kv_lengths=None, config: Config | None = None):
    """XAttention estimate through the kernel; arguments as `attn.xattention.xattn_estimate`
    (validated there; `chunk_size` does not apply: the kernel needs no chunking).

    Returns:
      `(block_sums [B, N, Tb, Sb] float32, block_mask [B, N, Tb, Sb] bool)`.

    Raises:
      NotImplementedError: see `check_supported`.
    """
    check_supported(q)
    return _estimate(q, k, jnp.float32(threshold), jnp.float32(norm), q_lengths, kv_lengths,
                     block_size=block_size, stride=stride, config=config or Config())
