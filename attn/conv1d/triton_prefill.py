"""Triton causal depthwise conv1d prefill (state in, state out, packed sequences).

Three kernels:

* `_conv_prefill_kernel`, a 1-D grid of `cdiv(tokens, BLOCK_T) x cdiv(C, BLOCK_C)` programs,
  channel blocks fastest (the programs in flight read and write whole `C`-wide rows, contiguous
  memory). One program owns `BLOCK_T` consecutive tokens (of the flattened `B · T` rows, or the
  packed row with `cu_seqlens`) x `BLOCK_C` channels. It first issues every load it needs, each a
  1-D `[BLOCK_C]` row (the `W - 1` halo rows before the block, then its `BLOCK_T` rows: all
  independent, all in flight before the first store), then for each row computes
  `y[t] = sum_j w_j x[t - (W - 1 - j)]` from the rows held in registers (a tuple indexed at compile
  time) and stores it with `evict_first` (y does not push the input's halo rows out of L2). Each
  input row is loaded once per program (halo `(W - 1) / BLOCK_T`). A tap that reaches before its
  token's own sequence start reads zero (a select, so a NaN in the previous sequence stays out);
  blocks that hold no sequence start after their first halo row (nearly all) run a select-free
  copy of the row loop. Order of operations: taps j = 0..W-1 in float32, then the bias, then
  SiLU. Any W >= 2 (the tuple holds `BLOCK_T + W - 1` rows: registers grow with
  `BLOCK_T x BLOCK_C / num_warps`; ptxas for sm_90 spills from 64 x 512 over 4 warps).
* `_conv_state_fixup_kernel`, grid `(Ns, cdiv(C, BLOCK_C))`, only with an initial state:
  rewrites `y` of the first `W - 1` tokens of each sequence, whose taps reach into the state, so
  the main kernel reads no state (a run-time branch there for it measured ~1% slower on the
  H100).
* `_conv_final_state_kernel`, grid `(Ns, cdiv(C, BLOCK_C))`: the last `W - 1` raw inputs of
  `concat(state, x)` per sequence (part of the old state when a sequence is shorter than `W - 1`).

`Config()` (8 tokens x 512 channels over 4 warps, the tanh SiLU) moves 0.90 of the copy bandwidth
on an H100 at T32K C8192 W4 bf16 with SiLU and a state (benchmarks/prefill.md); ptxas for sm_90:
64 registers, no spills.

Numerics follow `attn.conv1d.reference.causal_conv1d`: the initial state is rounded to x's dtype
first (XLA, before the call), products and the sum over taps are float32 (taps reading x first,
in tap order, then those reading the state, then the bias: the first W - 1 tokens of a sequence
may differ from the reference in the last float32 bit), SiLU in float32, `y` and the final state
in x's dtype (the final state is raw inputs: bitwise equal).

`Config(fast_silu=True)` (the default; bf16 / f16 outputs): SiLU as `u + u tanh(u)`, `u = a / 2`,
through one `tanh.approx.f32` (ptxas for sm_90: 1 MUFU + 1 FMUL + 1 FFMA an element, against ~12
instructions and 2 MUFU for `a * sigmoid(a)`; the whole row loop from ~23 to ~13 instructions an
element at W4). Its error: `tanh.approx.f32`'s, about 2^-11 (PTX ISA), scaled by `|u|`: at most
~`|a| 2^-12` absolute, relative ~2^-11 for `a >= 0` (below bf16's 2^-9 rounding); for `a << 0`,
where `1 + tanh(u)` cancels, the absolute bound holds but not the relative one (y is then tiny).
The state fixup kernel keeps the exact SiLU, and so do float32 outputs: `Config(fast_silu=False)`
for the exact SiLU everywhere.

Supports: any C and W >= 2 (W padded to a power of two and masked in the state kernel), optional
bias and initial state, SiLU or none, any float dtype, varlen via `cu_seqlens` (zero-length
sequences included), gradients (`attn.conv1d._triton_bwd`). Not supported: channels-first
inputs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from attn._harness import on_gpu, triton_call
from attn.conv1d import _triton_bwd


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration: token rows and channels per program, warps per program, and the
    SiLU's form.

    The default, 8 x 512 over 4 warps with the tanh SiLU, is the fastest of an H100 sweep (T32K,
    C = 8192, W4, bf16, SiLU, state): 0.90 of the copy bandwidth, the kernel's loads and stores
    alone (`y = x` in the same order) 0.91.
    """

    block_t: int = 8
    block_c: int = 512
    num_warps: int = 4
    # SiLU through one `tanh.approx.f32` (bf16 / f16 outputs; float32 outputs keep the exact
    # form; error in the module docstring); `False` for the exact SiLU.
    fast_silu: bool = True

    def __post_init__(self):
        if self.block_t < 1 or self.block_t & (self.block_t - 1):
            raise ValueError(f"{self.block_t=} must be a power of two")
        if self.block_c < 16 or self.block_c & (self.block_c - 1):
            raise ValueError(f"{self.block_c=} must be a power of two >= 16")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"{self.num_warps=} must be a power of two >= 1")


@triton.jit
def _conv_prefill_kernel(
    x_ptr,  # [N_TOK, C] flattened tokens
    w_ptr,  # [C, W]
    bias_ptr,  # [C] (a dummy unless HAS_BIAS)
    seq_ptr,  # [N_TOK] int32 sequence of each token (a dummy unless VARLEN)
    cu_ptr,  # [Ns + 1] int32 sequence starts (a dummy unless VARLEN)
    y_ptr,  # [N_TOK, C]
    N_TOK: tl.constexpr,
    T_ROW: tl.constexpr,  # tokens per batch row without VARLEN
    C: tl.constexpr,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    VARLEN: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    FAST_SILU: tl.constexpr,  # SiLU through `tanh` (`_fast_silu`)
    HW_TANH: tl.constexpr,  # ... as `tanh.approx.f32` (compiled), else exact (interpreter)
    NC: tl.constexpr,  # channel blocks
):
    """`BLOCK_T` tokens x `BLOCK_C` channels, row by row from a register window (module
    docstring)."""
    tb = tl.program_id(0) // NC  # channel blocks fastest
    cb = tl.program_id(0) % NC
    t0 = tb * BLOCK_T
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    mask_c = offs_c < C
    # Every load first, so that all rows are in flight before the first store (the compiler does
    # not move a load above a store: it cannot tell that x and y do not alias).
    # One base address; rows at compile-time offsets from it (immediates, not a 64-bit pointer
    # per row).
    x_base = x_ptr + t0.to(tl.int64) * C + offs_c
    y_base = y_ptr + t0.to(tl.int64) * C + offs_c
    xs = ()  # rows t0 - (W - 1) .. t0 + BLOCK_T - 1, x's dtype; xs[t + j] is tap j of row t
    for i in tl.static_range(BLOCK_T + W - 1):
        tok = t0 + (i - (W - 1))
        xs = xs + (tl.load(x_base + (i - (W - 1)) * C,
                           mask=mask_c & (tok >= 0) & (tok < N_TOK), other=0.0),)
    pos = ()  # position of row t inside its own sequence (scalars)
    for t in tl.static_range(BLOCK_T):
        tok = t0 + t
        if VARLEN:
            seq = tl.load(seq_ptr + tok, mask=tok < N_TOK, other=0)
            start = tl.load(cu_ptr + seq, mask=tok < N_TOK, other=0)
        else:
            start = tok // T_ROW * T_ROW
        pos = pos + (tok - start,)
    ws = ()
    for j in tl.static_range(W):
        ws = ws + (tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0).to(tl.float32),)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_C,), tl.float32)  # unused
    # No sequence starts after the block's first halo row (the last row's sequence began at or
    # before it): no tap needs the zero fill, a select-free copy of the rows runs. Every block but
    # a row's first without VARLEN. Two copies of the code: more registers.
    last = tl.minimum(t0 + BLOCK_T, N_TOK) - 1
    if VARLEN:
        start_last = tl.load(cu_ptr + tl.load(seq_ptr + last))
    else:
        start_last = last // T_ROW * T_ROW
    if start_last <= t0 - (W - 1):
        _conv_rows_out(xs, pos, ws, bias, y_base, mask_c, N_TOK - t0, C, W, HAS_BIAS, SILU,
                       BLOCK_T, BLOCK_C, False, FAST_SILU, HW_TANH)
    else:
        _conv_rows_out(xs, pos, ws, bias, y_base, mask_c, N_TOK - t0, C, W, HAS_BIAS, SILU,
                       BLOCK_T, BLOCK_C, True, FAST_SILU, HW_TANH)


@triton.jit
def _conv_rows_out(xs, pos, ws, bias, y_base, mask_c, n_left, C: tl.constexpr, W: tl.constexpr,
                   HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_C: tl.constexpr, ZERO_FILL: tl.constexpr, FAST_SILU: tl.constexpr,
                   HW_TANH: tl.constexpr):
    """Rows `y[t0 + t]` of `_conv_prefill_kernel` from its register window `xs`; with
    `ZERO_FILL`, taps before their token's sequence start read 0."""
    for t in tl.static_range(BLOCK_T):
        acc = tl.zeros((BLOCK_C,), tl.float32)
        for j in tl.static_range(W):
            back = W - 1 - j
            xj = xs[t + j].to(tl.float32)
            if ZERO_FILL and back > 0:
                xj = tl.where(pos[t] >= back, xj, 0.0)
            acc += xj * ws[j]
        if HAS_BIAS:
            acc += bias
        if SILU:
            if FAST_SILU:
                acc = _fast_silu(acc, HW_TANH)
            else:
                acc = acc * tl.sigmoid(acc)
        tl.store(y_base + t * C, acc.to(y_base.dtype.element_ty), mask=mask_c & (t < n_left),
                 eviction_policy="evict_first")


@triton.jit
def _fast_silu(a, HW_TANH: tl.constexpr):
    """`a * sigmoid(a)` as `u + u * tanh(u)`, `u = a / 2`: with `HW_TANH` one `tanh.approx.f32`
    (MUFU) and two FMA-pipe instructions instead of `exp`, a reciprocal and their fix-ups. The
    interpreter has no inline asm: there tanh is the exact `2 sigmoid(a) - 1` (the same algebra)."""
    u = a * 0.5
    if HW_TANH:
        th = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [u], dtype=tl.float32,
                                       is_pure=True, pack=1)
    else:
        th = 2.0 * tl.sigmoid(a) - 1.0
    return u + u * th


@triton.jit
def _conv_state_fixup_kernel(
    x_ptr,  # [N_TOK, C]
    w_ptr,  # [C, W]
    bias_ptr,  # [C] (a dummy unless HAS_BIAS)
    cu_ptr,  # [Ns + 1] int32
    state_ptr,  # [Ns, C, W - 1] in x's dtype
    y_in_ptr,  # [N_TOK, C], aliased to y_ptr
    y_ptr,  # [N_TOK, C]
    C: tl.constexpr,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """`y` of the first W - 1 tokens of sequence `program_id(0)`, initial state included, in the
    main kernel's order of operations (x taps, then state taps, then the bias)."""
    i = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    pos = tl.arange(0, BLOCK_W)  # [BLOCK_W] position inside the sequence
    mask_c = offs_c < C
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    mask_t = (pos < W - 1) & (start + pos < end)
    rows = (start + pos).to(tl.int64) * C
    acc = tl.zeros((BLOCK_W, BLOCK_C), tl.float32)
    for j in tl.static_range(W):
        back = W - 1 - j
        xj = tl.load(x_ptr + (rows - back * C)[:, None] + offs_c[None, :],
                     mask=(mask_t & (pos >= back))[:, None] & mask_c[None, :], other=0.0)
        wj = tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += xj.to(tl.float32) * wj[None, :]
    for j in tl.static_range(W - 1):
        back = W - 1 - j
        sj = tl.load(state_ptr + (i.to(tl.int64) * (C * (W - 1)) + pos + j)[:, None]
                     + offs_c[None, :] * (W - 1),
                     mask=(mask_t & (pos < back))[:, None] & mask_c[None, :], other=0.0)
        wj = tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += sj.to(tl.float32) * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + rows[:, None] + offs_c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _conv_final_state_kernel(
    x_ptr,  # [N_TOK, C]
    cu_ptr,  # [Ns + 1] int32
    state_ptr,  # [Ns, C, W - 1] (a dummy unless HAS_STATE)
    final_ptr,  # [Ns, C, W - 1]
    C: tl.constexpr,
    W: tl.constexpr,
    HAS_STATE: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    i = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    offs_m = tl.arange(0, BLOCK_W)  # state column m
    mask_c = offs_c < C
    mask_m = offs_m < W - 1
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    e = end - start + offs_m  # entry m is xe[L + m] of xe = concat(state, x)
    from_x = e >= W - 1
    tok = end - (W - 1) + offs_m  # [BLOCK_W]
    mask = mask_c[:, None] & mask_m[None, :]
    out = tl.load(  # [BLOCK_C, BLOCK_W]
        x_ptr + tok.to(tl.int64)[None, :] * C + offs_c[:, None],
        mask=mask & from_x[None, :], other=0.0,
    )
    base = i.to(tl.int64) * (C * (W - 1)) + offs_c[:, None] * (W - 1)  # [BLOCK_C, 1]
    if HAS_STATE:
        old = tl.load(state_ptr + base + e[None, :], mask=mask & (e < W - 1)[None, :], other=0.0)
        out = tl.where(from_x[None, :], out, old)
    tl.store(final_ptr + base + offs_m[None, :], out.to(final_ptr.dtype.element_ty), mask=mask)


def causal_conv1d(x, weight, bias=None, *, initial_state=None, activation=None, cu_seqlens=None,
                  config: Config | None = None, bwd_config: _triton_bwd.Config | None = None):
    """Causal conv1d prefill through the kernels; inputs validated by `attn.conv1d.api`.

    Differentiable: a custom VJP whose backward is `attn.conv1d._triton_bwd` (dx, dweight,
    dbias, d(initial_state), the final state's cotangent included; the pre-activation is
    recomputed, nothing but the inputs is kept).

    Args:
      x: `[B, T, C]` (`B == 1` with `cu_seqlens`).
      weight: `[C, W]`; tap `W - 1` multiplies the current token.
      bias: `[C]` or None.
      initial_state: `[Ns, C, W - 1]` (cast to x's dtype), or None for zeros.
      activation: `"silu"` or None.
      cu_seqlens: `[Ns + 1]` integer boundaries of the packed sequences, or None (`Ns = B`).
      config: launch configuration; None for `Config()`.
      bwd_config: the backward's launch configuration; None for `_triton_bwd.Config()`.

    Returns:
      `(y [B, T, C] in x.dtype, final_state [Ns, C, W - 1] in x.dtype)`.
    """

    @jax.custom_vjp
    def conv(x, weight, bias, h0, cu):
        return _forward(x, weight, bias, h0, cu, activation=activation, config=config)

    def fwd(x, weight, bias, h0, cu):
        return conv(x, weight, bias, h0, cu), (x, weight, bias, h0, cu)

    def bwd(residuals, cotangents):
        dy, dfinal = cotangents
        grads = _triton_bwd.backward(*residuals, dy, dfinal, activation=activation,
                                     config=bwd_config)
        return (*grads, None)

    conv.defvjp(fwd, bwd)
    return conv(x, weight, bias, initial_state, cu_seqlens)


def _forward(x, weight, bias, initial_state, cu_seqlens, *, activation, config):
    b, t, c = x.shape
    w = weight.shape[1]
    n_tok = b * t
    config = Config() if config is None else config
    if cu_seqlens is None:
        n_seq = b
        cu = jnp.asarray(np.arange(b + 1, dtype=np.int32) * t)
        seq = jnp.zeros((1,), jnp.int32)
    else:
        n_seq = cu_seqlens.shape[0] - 1
        cu = cu_seqlens.astype(jnp.int32)
        seq = jnp.minimum(jnp.searchsorted(cu[1:], jnp.arange(n_tok, dtype=jnp.int32),
                                           side="right"), n_seq - 1).astype(jnp.int32)
    has_state = initial_state is not None
    state = (initial_state.astype(x.dtype) if has_state else jnp.zeros((1,), x.dtype))
    xf = x.reshape(n_tok, c)
    block_c = min(config.block_c, max(16, triton.next_power_of_2(c)))
    block_t = min(config.block_t, triton.next_power_of_2(n_tok))
    bias_arg = jnp.zeros((1,), jnp.float32) if bias is None else bias
    nc = triton.cdiv(c, block_c)
    y = triton_call(
        xf, weight, bias_arg, seq, cu,
        kernel=_conv_prefill_kernel,
        out_shape=jax.ShapeDtypeStruct((n_tok, c), x.dtype),
        grid=(triton.cdiv(n_tok, block_t) * nc,),
        num_warps=config.num_warps,
        N_TOK=n_tok, T_ROW=t, C=c, W=w, HAS_BIAS=bias is not None, VARLEN=cu_seqlens is not None,
        SILU=activation == "silu", BLOCK_T=block_t, BLOCK_C=block_c,
        FAST_SILU=config.fast_silu and jnp.dtype(x.dtype) in (jnp.bfloat16, jnp.float16),
        HW_TANH=on_gpu(), NC=nc,
    )
    if has_state:
        y = triton_call(
            xf, weight, bias_arg, cu, state, y,
            kernel=_conv_state_fixup_kernel,
            out_shape=jax.ShapeDtypeStruct((n_tok, c), x.dtype),
            grid=(n_seq, triton.cdiv(c, block_c)),
            num_warps=config.num_warps,
            input_output_aliases={5: 0},
            C=c, W=w, HAS_BIAS=bias is not None, SILU=activation == "silu",
            BLOCK_W=max(2, triton.next_power_of_2(w - 1)), BLOCK_C=block_c,
        )
    final = triton_call(
        xf, cu, state,
        kernel=_conv_final_state_kernel,
        out_shape=jax.ShapeDtypeStruct((n_seq, c, w - 1), x.dtype),
        grid=(n_seq, triton.cdiv(c, block_c)),
        num_warps=config.num_warps,
        C=c, W=w, HAS_STATE=has_state, BLOCK_C=block_c, BLOCK_W=triton.next_power_of_2(w - 1),
    )
    return y.reshape(b, t, c), final
