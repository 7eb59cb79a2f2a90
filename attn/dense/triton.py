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

Non-finite values: in a masked tile a non-finite value is zeroed before the `P V` product and the
weights of the visible keys that carry one are set to NaN, so it reaches exactly the rows that see
it (a 0 weight would still make `0 * NaN` in the others); `l` sums the weights before that, so
the lse stays the scores'. A NaN key is masked out of the scores. Whole tiles need no such step
(every row sees every key), so the check costs nothing on them. Registers (default tiles,
sm_90a: 255, no spills at H 64 / 128 / 256 with power-of-two groups, 4 bytes at G = 5): the value
check runs first in a masked step, before the score tile is live, and the output row offsets are
rebuilt from `pos` after the key loops rather than kept live through them. The backward
(`attn/dense/_flash_bwd.py`: FlashAttention-2, a dQ kernel and a dK / dV kernel, the same tile
split) keeps the same rule.

Supports: causal and non-causal, `q_offset` `[B]` (chunked prefill over a cached prefix), window
and sinks per KV head (`window <= 0`: full), `kv_lengths`, any group size, `H` / `Hv` up to 256
(padded to a power of two and masked), bf16 / f16 (f32 with IEEE dots, for tests). A row with no
visible key gives output 0 and lse -inf, and zero gradients.
Logit soft-capping (`softcap`: `softcap * tanh(s / softcap)` of the scaled scores, before the
mask; compiled, the tanh is the GPU's `tanh.approx.f32`) in the forward; the backward kernels do
not soft-cap, so such a call's gradient is the reference's (`backward_supports`, applied by
`attn._op`).
Not supported (`supports` says why, and `implementation="auto"` falls back to XLA): segment ids
(packed varlen), shapes whose per-batch element offsets overflow int32.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn import _checks, _harness
from attn._harness import triton_call
from attn.dense._flash_bwd import backward as _backward
from attn.dense._flash_tiles import (
    _drop_nonfinite,
    _key_tiles,
    _load,
    _masked_softmax_step,
    _shapes,
    _visible,
    _whole_softmax_step,
    wide_rows,
    wide_rows_query_tile,
)

LOG2E = math.log2(math.e)
_INT32_MAX = 2**31 - 1
_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration of the forward (`block_m` rows x `block_n` keys per step) and of the
    two backward kernels: dQ (`dq_block_m` rows a program, `dq_block_n` keys a step) and dK / dV
    (`dkv_block_n` keys a program, `dkv_block_m` rows a step)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    dkv_block_m: int = 64
    dkv_block_n: int = 128
    dq_block_m: int = 128
    dq_block_n: int = 64
    bwd_num_warps: int = 8
    bwd_num_stages: int = 3
    # The unmasked key loop as `tl.range(..., warp_specialize=True)`: Triton's Hopper pass splits
    # it into producer (loads) and consumer (dots, softmax) warp groups. Applies with >= 8 warps
    # only (Triton 3.6 does not compile it with 4). `warp_specialize_masked`: the masked loops too.
    warp_specialize: bool = True
    warp_specialize_masked: bool = False

    def __post_init__(self):
        _checks.check_launch_config(
            self, tiles=("block_m", "block_n", "dkv_block_m", "dkv_block_n", "dq_block_m",
                          "dq_block_n"),
            warps=("num_warps", "bwd_num_warps"), stages=("num_stages", "bwd_num_stages"))


def default_config(head_dim: int, value_head_dim: int | None = None, itemsize: int = 2) -> Config:
    """Tiles for Hopper bf16 at H <= 128: forward 128 rows x 128 keys, 8 warps, 3 stages, the
    unmasked key loop warp-specialised (H100, causal N32/K8 H128 S16K: 4.09 ms, 0.91x cuDNN;
    128 x 64 tiles unspecialised 4.53 ms). Backward: dQ 128 rows x 64 keys a step, dK / dV 128
    keys x 64 rows a step, 8 warps, 3 stages (causal N32/K8 H128 S8K: 3.58 ms, 538 TFLOP/s of
    the 7 matmuls a score tile it runs; 4 warps spill). Wide rows (over 256 bytes, `itemsize`
    the inputs' element size: H > 128 in bf16 / f16, H > 64 in float32) take 32-key tiles and 2
    stages, unspecialised, so the K/V stages fit in shared memory (at H128 float32 the 16-bit
    tiles need 289-448 KiB of the H100's 227).
    Wide rows over 512 bytes (float32 at H256) take 64-row forward tiles. float32 at H <= 64
    takes 2 forward stages: with float32 scores the 128 x 128 forward needs 256 KiB in 3 at H64
    (`python -m experiments.tools.hopper_fit` compiles the launches for sm_90 and prints their
    shared memory).
    `python -m experiments.tools.sweep flash_prefill` (`flash_prefill_bwd`) times alternatives."""
    if wide_rows(head_dim, value_head_dim, itemsize):
        block_m = wide_rows_query_tile(head_dim, value_head_dim, itemsize)
        return Config(block_m=block_m, block_n=32, num_warps=8, num_stages=2, dkv_block_m=32,
                      dkv_block_n=32, dq_block_m=32, dq_block_n=32, bwd_num_stages=2,
                      warp_specialize=False)
    if itemsize > 2:
        return Config(num_stages=2)
    return Config()


@triton.jit
def _tanh(x, FAST: tl.constexpr):
    """tanh of an f32 tile. `FAST`: the GPU's `tanh.approx.f32` (one special-function
    instruction, relative error about 2^-11, as FlashAttention soft-caps); else
    `1 - 2 / (exp(2x) + 1)`, an exp and a division (the interpreter runs no inline PTX)."""
    if FAST:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


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
    CAP: tl.constexpr = 0.0,
    FAST_TANH: tl.constexpr = False,
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
        if MASKED:  # the value check first, while the score tile is not live yet
            v = _load(v_ptrs, in_kv, mask_hv, MASKED, BLOCK_HV != HV)
            v, key_bad = _drop_nonfinite(v)
        k = _load(k_ptrs, in_kv, mask_h, MASKED, BLOCK_H != H)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] f32
        if CAP > 0:  # soft-capping, in unscaled units: CAP * tanh(qk / CAP), CAP = softcap / scale
            qk = CAP * _tanh(qk * (1.0 / CAP), FAST_TANH)
        if MASKED:
            visible = _visible(cols[None, :], pos[:, None], kv_len, win, sinks, CAUSAL)
            p, alpha, m_new = _masked_softmax_step(qk, m, visible, SCALE_LOG2)
        else:
            p, alpha, m_new = _whole_softmax_step(qk, m, SCALE_LOG2)
            v = _load(v_ptrs, in_kv, mask_hv, MASKED, BLOCK_HV != HV)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:  # NaN weights make the rows that see a non-finite value NaN
            p = tl.where(visible & key_bad[None, :], float("nan"), p)
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
    CAP: tl.constexpr = 0.0,  # softcap / scale; 0: no soft-capping
    FAST_TANH: tl.constexpr = False,  # the GPU's tanh instruction (compiled only)
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
                           PRECISION, WS_MASKED, CAP, FAST_TANH)
    acc, l, m = _fwd_visit(acc, l, m, q, k_base, v_base, pos, main_lo, full_lo, kv_len, win,
                           sinks, SCALE_LOG2, K, H, HV, CAUSAL, True, BLOCK_N, BLOCK_H, BLOCK_HV,
                           PRECISION, WS_MASKED, CAP, FAST_TANH)
    acc, l, m = _fwd_visit(acc, l, m, q, k_base, v_base, pos, full_lo, full_hi, kv_len, win,
                           sinks, SCALE_LOG2, K, H, HV, CAUSAL, False, BLOCK_N, BLOCK_H, BLOCK_HV,
                           PRECISION, WARP_SPECIALIZE, CAP, FAST_TANH)
    acc, l, m = _fwd_visit(acc, l, m, q, k_base, v_base, pos, full_hi, end, kv_len, win, sinks,
                           SCALE_LOG2, K, H, HV, CAUSAL, True, BLOCK_N, BLOCK_H, BLOCK_HV,
                           PRECISION, WS_MASKED, CAP, FAST_TANH)

    empty = l == 0.0
    safe_l = tl.where(empty, 1.0, l)
    out = acc / safe_l[:, None]
    lse = tl.where(empty, float("-inf"), (m + tl.log2(safe_l)) * 0.6931471805599453)
    # The output rows from `pos` (live through the key loops anyway) rather than `q_rows` held
    # through them: `tok = pos - q_off`, and `rows % G` from the tile start.
    tok = pos - q_off
    q_rows = (b.to(tl.int64) * (T * N) + tok * N + kh * G
              + ((mt * BLOCK_M) % G + tl.arange(0, BLOCK_M)) % G)
    tl.store(o_ptr + q_rows[:, None] * HV + offs_hv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_hv < HV)[None, :])
    tl.store(lse_ptr + q_rows, lse, mask=row_ok)


def _forward(q, k, v, q_offset, window, sinks, kv_lengths, *, causal, scale, config, softcap=None):
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
        WS_MASKED=config.warp_specialize_masked and config.num_warps >= 8,
        CAP=0.0 if softcap is None else softcap / scale, FAST_TANH=_harness.on_gpu(), **dims,
    )


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


@functools.partial(jax.jit, static_argnames=("causal", "scale", "config", "softcap"))
def _attention(q, k, v, q_offset, window, sinks, kv_lengths, *, causal, scale, config, softcap):
    b, kh = q.shape[0], k.shape[2]
    q_offset = jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (b,))
    window = jnp.broadcast_to(jnp.asarray(window, jnp.int32), (kh,))
    sinks = jnp.broadcast_to(jnp.asarray(sinks, jnp.int32), (kh,))
    kv_lengths = jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32), (b,))
    if softcap is not None:  # forward only: the backward kernels do not soft-cap
        return _forward(q, k, v, q_offset, window, sinks, kv_lengths, causal=causal, scale=scale,
                        config=config, softcap=softcap)
    return _flash(q, k, v, q_offset, window, sinks, kv_lengths, causal, scale, config)


def supports(args: dict, config: Config | None = None) -> list[str]:
    """Why this kernel cannot run `attn.dense.attention`'s validated `args` (empty: it can)."""
    del config  # every launch config runs every shape
    q, k, v = args["q"], args["k"], args["v"]
    (_, t, n, h), (_, s, kh, _), hv = q.shape, k.shape, v.shape[-1]
    reasons = []
    if args["q_segment_ids"] is not None:
        reasons.append("segment ids (packed varlen)")
    if max(h, hv) > _MAX_HEAD_DIM:
        reasons.append(f"head dims H={h}, Hv={hv} over {_MAX_HEAD_DIM}")
    if max(t * n, s * kh) * max(h, hv) > _INT32_MAX:
        reasons.append(f"q {q.shape} / k {k.shape}: per-batch offsets overflow int32")
    return reasons


def backward_supports(args: dict) -> list[str]:
    """Why the backward kernels cannot differentiate `args` (the gradient is then the
    reference's)."""
    return ["soft-capping (no softcap backward)"] if args["softcap"] is not None else []


def attention(q, k, v, *, causal=True, scale=None, q_offset=0, window=None, sinks=0,
              kv_lengths=None, q_segment_ids=None, kv_segment_ids=None, softcap=None,
              config: Config | None = None):
    """Dense attention through the flash kernels; arguments as `attn.dense.attention` (validated
    there, and `supports` empty), plus `config` (default: `default_config`). Differentiable
    without `softcap`; with it, forward only (`backward_supports`).

    Returns:
      `(out [B, T, N, Hv] in q's dtype, lse [B, T, N] float32)`.
    """
    del q_segment_ids, kv_segment_ids  # refused by `supports`
    h, hv = q.shape[-1], v.shape[-1]
    scale = h**-0.5 if scale is None else scale
    if config is None:
        config = default_config(h, hv, jnp.dtype(q.dtype).itemsize)
    window = 0 if window is None or not causal else window
    kv_lengths = k.shape[1] if kv_lengths is None else kv_lengths
    return _attention(q, k, v, q_offset, window, sinks, kv_lengths,
                      causal=bool(causal), scale=float(scale), config=config,
                      softcap=None if softcap is None else float(softcap))
