"""Triton backward of the causal depthwise conv1d prefill (`attn.conv1d.triton_prefill`).

With `a[t] = bias + Σ_j w_j · tap_j(t)` (tap `j` reads the input `W - 1 - j` steps back, or the
initial state before the sequence start), `y = act(a)` and the final state the last `W - 1`
entries of `concat(state, x)`, the cotangents `dy` and `dfinal` give

    g[t]        = dy[t] · act'(a[t])                (a recomputed from x: never stored)
    dx[u]       = Σ_j w_j · g[u + W - 1 - j]        (taps inside u's sequence; anti-causal)
                  + dfinal[m] where u is entry m of its sequence's final state
    dweight[j]  = Σ_t g[t] · tap_j(t),   dbias = Σ_t g[t]
    dstate[e]   = Σ_{j <= e} w_j · g[e - j]  (first W - 1 tokens) + dfinal[e - L] (e >= L)

Two kernels:

* `_conv_bwd_kernel`, a 1-D grid of `cdiv(tokens, CHUNK_T) x cdiv(C, BLOCK_C)` programs, channel
  blocks fastest. A program owns `CHUNK_T` consecutive tokens (of the flattened `B · T`, or the
  packed row) x `BLOCK_C` channels and walks them in steps of `BLOCK_T` rows. A step loads its
  `BLOCK_T` rows of x and dy (all loads first, then the math), recomputes `a` and `g` row by row
  from a register window that carries the previous step's last `W - 1` rows of x and of g,
  accumulates `g · tap_j` and `g` into `W + 1` float32 vectors, and stores dx of the rows `W - 1`
  behind (the last ones whose `g` window is complete). After the last step, `W - 1` rows of the
  next chunk complete the chunk's last dx rows (their `g` does not enter the sums). Each x and dy
  row is read once from memory (the next chunk's `W - 1` halo rows twice), dx written once. Steps
  whose rows all lie `W - 1` past their sequence start run a select-free copy of the row loop;
  the others mask the taps before the start (a select: NaN before a start stays out) and read
  the initial state there. With `cu_seqlens` a program finds the first sequence start past its
  chunk's halo by binary search in `cu_seqlens` and moves it forward as the steps pass it (no
  per-token sequence array, no XLA work before the launch); a masked step finds each row's
  sequence by binary search. Per program the `W + 1` sums go to a float32 partials buffer
  `[chunks, W + 1, C]` that XLA reduces (deterministic; `chunks x (W + 1) x C x 4` bytes, 10 MB
  at T32K C8192 W4 and chunks of 512).
* `_conv_bwd_edges_kernel`, grid `(Ns, cdiv(C, BLOCK_C))`: the state's gradient (recomputing `g`
  of the sequence's first `W - 1` tokens) and `dfinal` added into dx of its last `W - 1` tokens
  (dx aliased in place; dx of the main kernel rounded to x's dtype first, as the reference's
  cotangent of x is the rounded conv part plus the final state's).

Numerics: products and sums float32, in the forward's tap order; dx in x's dtype, dweight /
dbias / dstate summed in float32 and returned in the dtypes of weight / bias / state.
`Config(fast_silu=True)` (the default for bf16 / f16 inputs) takes SiLU's derivative
`σ(a)(1 + a(1 - σ(a)))` from one `tanh.approx.f32` (`σ(a) = (1 + tanh(a/2)) / 2`, so
`act'(a) = (1 + th)/2 + a (1 - th²)/4`); its absolute error in `act'` is about `(1 + |a|) 2^-12`.
float32 inputs and the edges kernel keep the exact sigmoid.

Supports what the forward does: any C, W >= 2, bias or none, SiLU or none, an initial state or
zeros, varlen via `cu_seqlens` (empty sequences, sequences shorter than W - 1). Not supported:
second derivatives.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from attn._harness import on_gpu, triton_call


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration: rows per step, tokens per program, channels per program, warps,
    the next step's loads, and the SiLU derivative's form.

    The default, 16 rows x 512 tokens x 512 channels over 8 warps with the next step's rows
    prefetched, is the fastest of an H100 sweep at B1 T32K C8192 W4 bf16 SiLU with a state:
    0.601 ms (256 channels over 4 warps: 0.624 ms, over 2 warps at 128 channels: 0.624 ms; 512
    channels over 4 warps: 0.642 ms). The per-thread work, and so the registers, are those of
    256 channels over 4 warps.
    """

    block_t: int = 16
    chunk_t: int = 512
    block_c: int = 512
    num_warps: int = 8
    # Load step k + 1's rows before step k's math (more registers, loads in flight longer).
    prefetch: bool = True
    # SiLU's derivative through one `tanh.approx.f32` (bf16 / f16 inputs; float32 keeps the
    # exact sigmoid); `False` for the exact form.
    fast_silu: bool = True

    def __post_init__(self):
        if self.block_t < 1 or self.block_t & (self.block_t - 1):
            raise ValueError(f"{self.block_t=} must be a power of two")
        if self.chunk_t < self.block_t or self.chunk_t % self.block_t:
            raise ValueError(f"{self.chunk_t=} must be a multiple of {self.block_t=}")
        if self.block_c < 16 or self.block_c & (self.block_c - 1):
            raise ValueError(f"{self.block_c=} must be a power of two >= 16")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"{self.num_warps=} must be a power of two >= 1")


@triton.jit
def _dsilu(a, FAST: tl.constexpr, HW_TANH: tl.constexpr):
    """`d/da (a σ(a)) = σ(a) + a σ(a)(1 - σ(a))`; with `FAST` through `th = tanh(a / 2)`:
    `(1 + th) / 2 + a (1 - th²) / 4` (one `tanh.approx.f32` on the GPU; the interpreter has no
    inline asm and takes `th = 2 σ(a) - 1`)."""
    if FAST:
        if HW_TANH:
            th = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [a * 0.5],
                                           dtype=tl.float32, is_pure=True, pack=1)
        else:
            th = 2.0 * tl.sigmoid(a) - 1.0
        d = 0.5 + 0.5 * th + (0.25 * a) * (1.0 - th * th)
    else:
        s = tl.sigmoid(a)
        d = s + a * (s * (1.0 - s))
    return d


@triton.jit
def _count_le(ptr, v, N: tl.constexpr, LOG: tl.constexpr):
    """How many of the ascending `ptr[0 .. N - 1]` are <= v (a scalar); `LOG` = bit length of
    N. Branch-free binary search: LOG dependent scalar loads."""
    cnt = 0
    for k in tl.static_range(LOG):
        probe = cnt + (1 << (LOG - 1 - k))
        val = tl.load(ptr + probe - 1, mask=probe <= N, other=0)
        cnt = tl.where((probe <= N) & (val <= v), probe, cnt)
    return cnt


@triton.jit
def _pos_in_seq(tok, cu_ptr, T_ROW: tl.constexpr, VARLEN: tl.constexpr, NS: tl.constexpr,
                LOG_NS: tl.constexpr):
    """`(position of token tok inside its sequence, the sequence)`, scalars (the reference's
    `min(searchsorted(cu[1:], tok, "right"), Ns - 1)`: empty sequences own no token)."""
    if VARLEN:
        seq = tl.minimum(_count_le(cu_ptr + 1, tok, NS, LOG_NS), NS - 1)
        start = tl.load(cu_ptr + seq)
    else:
        seq = tok // T_ROW
        start = seq * T_ROW
    return tok - start, seq


@triton.jit
def _step_masked(s, idx, nxt, cu_ptr, N_TOK: tl.constexpr, T_ROW: tl.constexpr,
                 W: tl.constexpr, VARLEN: tl.constexpr, NS: tl.constexpr, ROWS: tl.constexpr):
    """Whether a tap of rows `s .. s + ROWS - 1` reaches before its sequence start (a start in
    `(s - (W - 1), last row]`). VARLEN: `nxt = cu[idx]`, the first start past `s - (W - 1)`
    of the previous step, moves forward (a load per start passed); returns it with the flag."""
    last = tl.minimum(s + ROWS, N_TOK) - 1
    if VARLEN:
        while (nxt <= s - (W - 1)) & (idx < NS):
            idx += 1
            nxt = tl.load(cu_ptr + idx)
        masked = nxt <= last
    else:
        masked = last // T_ROW * T_ROW > s - (W - 1)
    return masked, idx, nxt


@triton.jit
def _load_rows(ptr, s, lim, offs_c, mask_c, C: tl.constexpr, ROWS: tl.constexpr):
    """Rows `s .. s + ROWS - 1` of `ptr [N_TOK, C]` (0 from row `lim` on), a tuple."""
    base = ptr + s.to(tl.int64) * C + offs_c  # [BLOCK_C]; rows at compile-time offsets
    rows = ()
    for i in tl.static_range(ROWS):
        rows = rows + (tl.load(base + i * C, mask=mask_c & (s + i < lim), other=0.0),)
    return rows


@triton.jit
def _bwd_step(xc, gc, xn, dyn, dws, db, s, lo, masked, ws, bias, offs_c, mask_c, cu_ptr,
              state_ptr, dx_ptr, N_TOK: tl.constexpr, T_ROW: tl.constexpr, C: tl.constexpr,
              W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
              VARLEN: tl.constexpr, NS: tl.constexpr, LOG_NS: tl.constexpr,
              SILU: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr, ACC: tl.constexpr,
              FAST_SILU: tl.constexpr, HW_TANH: tl.constexpr):
    """Rows `s .. s + ROWS - 1` (x `xn`, dy `dyn`): their `g` (and, with `ACC`, their terms of
    the sums), then dx of rows `s - (W - 1) .. s + ROWS - W` (those `>= lo`); `masked` from
    `_step_masked`. `xc` / `gc`: x / g of the `W - 1` rows before `s`; returns the new carries
    and sums."""
    xs = xc + xn  # rows s - (W - 1) .. s + ROWS - 1; xs[t + j] is tap j of row s + t
    if masked:
        gs, dws, db = _bwd_rows(xs, dyn, gc, dws, db, s, lo, ws, bias, mask_c, offs_c, cu_ptr,
                                state_ptr, dx_ptr, N_TOK, T_ROW, C, W, HAS_BIAS, HAS_STATE,
                                VARLEN, NS, LOG_NS, SILU, ROWS, BLOCK_C, ACC, True, FAST_SILU,
                                HW_TANH)
    else:
        gs, dws, db = _bwd_rows(xs, dyn, gc, dws, db, s, lo, ws, bias, mask_c, offs_c, cu_ptr,
                                state_ptr, dx_ptr, N_TOK, T_ROW, C, W, HAS_BIAS, HAS_STATE,
                                VARLEN, NS, LOG_NS, SILU, ROWS, BLOCK_C, ACC, False, FAST_SILU,
                                HW_TANH)
    xc = ()
    gc = ()
    for i in tl.static_range(W - 1):
        xc = xc + (xs[ROWS + i],)
        gc = gc + (gs[ROWS + i],)
    return xc, gc, dws, db


@triton.jit
def _bwd_rows(xs, dyn, gc, dws, db, s, lo, ws, bias, mask_c, offs_c, cu_ptr, state_ptr, dx_ptr,
              N_TOK: tl.constexpr, T_ROW: tl.constexpr, C: tl.constexpr, W: tl.constexpr,
              HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, VARLEN: tl.constexpr,
              NS: tl.constexpr, LOG_NS: tl.constexpr, SILU: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_C: tl.constexpr, ACC: tl.constexpr, MASKED: tl.constexpr,
              FAST_SILU: tl.constexpr, HW_TANH: tl.constexpr):
    """Row by row: `g` of row `s + t` (and, with `ACC`, its terms of the sums), then dx of row
    `u = s + t - (W - 1)`, `Σ_j w_j g[u + W - 1 - j]`, stored when `lo <= u < N_TOK`. With
    `MASKED`, a tap before its row's sequence start reads the state (or 0) and gives no dx term.
    `gs` (returned) is the window of g from row `s - (W - 1)`, `gc` its first `W - 1` rows."""
    gs = gc
    if MASKED:  # position and sequence of every window row s - (W - 1) + i (scalars)
        pw = ()
        sw = ()
        for i in tl.static_range(W - 1 + ROWS):
            p, q = _pos_in_seq(s - (W - 1) + i, cu_ptr, T_ROW, VARLEN, NS, LOG_NS)
            pw = pw + (p,)
            sw = sw + (q,)
    for t in tl.static_range(ROWS):
        tok = s + t
        a = tl.zeros((BLOCK_C,), tl.float32)
        taps = ()
        for j in tl.static_range(W):
            xj = xs[t + j].to(tl.float32)
            if MASKED and (W - 1 - j) > 0:
                pos = pw[t + W - 1]
                if HAS_STATE:
                    sj = tl.load(state_ptr + sw[t + W - 1].to(tl.int64) * (C * (W - 1))
                                 + offs_c * (W - 1) + (pos + j),
                                 mask=mask_c & (pos < (W - 1 - j)) & (tok < N_TOK),
                                 other=0.0).to(tl.float32)
                    xj = tl.where(pos >= (W - 1 - j), xj, sj)
                else:
                    xj = tl.where(pos >= (W - 1 - j), xj, 0.0)
            taps = taps + (xj,)
            a += xj * ws[j]
        if HAS_BIAS:
            a += bias
        g = dyn[t].to(tl.float32)
        if SILU:
            g = g * _dsilu(a, FAST_SILU, HW_TANH)
        if ACC:
            new_dws = ()
            for j in tl.static_range(W):
                new_dws = new_dws + (dws[j] + g * taps[j],)
            dws = new_dws
            db += g
        gs = gs + (g,)
        u = tok - (W - 1)
        acc = tl.zeros((BLOCK_C,), tl.float32)
        for j in tl.static_range(W):
            gj = gs[t + W - 1 - j]  # g of row u + W - 1 - j
            if MASKED and (W - 1 - j) > 0:
                gj = tl.where(pw[t + W - 1 - j] >= (W - 1 - j), gj, 0.0)
            acc += gj * ws[j]
        tl.store(dx_ptr + u.to(tl.int64) * C + offs_c, acc.to(dx_ptr.dtype.element_ty),
                 mask=mask_c & (u >= lo) & (u < N_TOK), eviction_policy="evict_first")
    return gs, dws, db


@triton.jit
def _conv_bwd_kernel(
    x_ptr,  # [N_TOK, C] flattened tokens
    dy_ptr,  # [N_TOK, C]
    w_ptr,  # [C, W]
    bias_ptr,  # [C] (a dummy unless HAS_BIAS)
    cu_ptr,  # [Ns + 1] int32 sequence starts
    state_ptr,  # [Ns, C, W - 1] in x's dtype (a dummy unless HAS_STATE)
    dx_ptr,  # [N_TOK, C]
    part_ptr,  # [chunks, W + 1, C] float32: Σ g · tap_j (rows j < W), Σ g (row W)
    N_TOK: tl.constexpr,
    T_ROW: tl.constexpr,  # tokens per batch row without VARLEN
    C: tl.constexpr,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    VARLEN: tl.constexpr,
    NS: tl.constexpr,  # sequences
    LOG_NS: tl.constexpr,  # bit length of NS
    LOG_NS1: tl.constexpr,  # bit length of NS + 1
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    STEPS: tl.constexpr,  # CHUNK_T = BLOCK_T x STEPS tokens per program
    BLOCK_C: tl.constexpr,
    PREFETCH: tl.constexpr,  # load step k + 1's rows before step k's math
    FAST_SILU: tl.constexpr,
    HW_TANH: tl.constexpr,
    NC: tl.constexpr,  # channel blocks
):
    """`CHUNK_T` tokens x `BLOCK_C` channels in steps of `BLOCK_T` rows (module docstring)."""
    kb = tl.program_id(0) // NC  # channel blocks fastest
    cb = tl.program_id(0) % NC
    c0 = kb * (BLOCK_T * STEPS)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    mask_c = offs_c < C
    ws = ()
    for j in tl.static_range(W):
        ws = ws + (tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0).to(tl.float32),)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_C,), tl.float32)  # unused
    xc = ()  # x of rows c0 - (W - 1) .. c0 - 1
    gc = ()  # g of the same rows: they belong to the previous chunk, whose program stores them
    for i in tl.static_range(W - 1):
        tok = c0 - (W - 1) + i
        xc = xc + (tl.load(x_ptr + tok.to(tl.int64) * C + offs_c, mask=mask_c & (tok >= 0),
                           other=0.0),)
        gc = gc + (tl.zeros((BLOCK_C,), tl.float32),)
    dws = ()
    for _ in tl.static_range(W):
        dws = dws + (tl.zeros((BLOCK_C,), tl.float32),)
    db = tl.zeros((BLOCK_C,), tl.float32)
    c1 = c0 + BLOCK_T * STEPS
    lim = tl.minimum(c1 + (W - 1), N_TOK)  # the last step prefetches no more than the halo
    if VARLEN:  # the first sequence start past c0 - (W - 1)
        idx = _count_le(cu_ptr, c0 - (W - 1), NS + 1, LOG_NS1)
        nxt = tl.load(cu_ptr + idx)
    else:
        idx = 0
        nxt = 0
    xn = _load_rows(x_ptr, c0, lim, offs_c, mask_c, C, BLOCK_T)
    dyn = _load_rows(dy_ptr, c0, lim, offs_c, mask_c, C, BLOCK_T)
    for step in range(STEPS):
        s = c0 + step * BLOCK_T
        masked, idx, nxt = _step_masked(s, idx, nxt, cu_ptr, N_TOK, T_ROW, W, VARLEN, NS,
                                        BLOCK_T)
        if PREFETCH:  # the next step's rows in flight while this one computes
            xp = _load_rows(x_ptr, s + BLOCK_T, lim, offs_c, mask_c, C, BLOCK_T)
            dyp = _load_rows(dy_ptr, s + BLOCK_T, lim, offs_c, mask_c, C, BLOCK_T)
            xc, gc, dws, db = _bwd_step(
                xc, gc, xn, dyn, dws, db, s, c0, masked, ws, bias, offs_c, mask_c, cu_ptr,
                state_ptr, dx_ptr, N_TOK, T_ROW, C, W, HAS_BIAS, HAS_STATE, VARLEN, NS, LOG_NS,
                SILU, BLOCK_T, BLOCK_C, True, FAST_SILU, HW_TANH)
            xn = xp
            dyn = dyp
        else:
            xc, gc, dws, db = _bwd_step(
                xc, gc, xn, dyn, dws, db, s, c0, masked, ws, bias, offs_c, mask_c, cu_ptr,
                state_ptr, dx_ptr, N_TOK, T_ROW, C, W, HAS_BIAS, HAS_STATE, VARLEN, NS, LOG_NS,
                SILU, BLOCK_T, BLOCK_C, True, FAST_SILU, HW_TANH)
            xn = _load_rows(x_ptr, s + BLOCK_T, lim, offs_c, mask_c, C, BLOCK_T)
            dyn = _load_rows(dy_ptr, s + BLOCK_T, lim, offs_c, mask_c, C, BLOCK_T)
    # The next chunk's first W - 1 rows: their g completes dx of this chunk's last W - 1 rows.
    if BLOCK_T >= W - 1:
        xe = ()
        dye = ()
        for i in tl.static_range(W - 1):
            xe = xe + (xn[i],)
            dye = dye + (dyn[i],)
    else:
        xe = _load_rows(x_ptr, c1, lim, offs_c, mask_c, C, W - 1)
        dye = _load_rows(dy_ptr, c1, lim, offs_c, mask_c, C, W - 1)
    masked, idx, nxt = _step_masked(c1, idx, nxt, cu_ptr, N_TOK, T_ROW, W, VARLEN, NS, W - 1)
    xc, gc, dws, db = _bwd_step(
        xc, gc, xe, dye, dws, db, c1, c0, masked, ws, bias, offs_c, mask_c, cu_ptr, state_ptr,
        dx_ptr, N_TOK, T_ROW, C, W, HAS_BIAS, HAS_STATE, VARLEN, NS, LOG_NS, SILU, W - 1,
        BLOCK_C, False, FAST_SILU, HW_TANH)
    part = part_ptr + kb.to(tl.int64) * ((W + 1) * C) + offs_c  # [BLOCK_C]
    for j in tl.static_range(W):
        tl.store(part + j * C, dws[j], mask=mask_c)
    tl.store(part + W * C, db, mask=mask_c)


@triton.jit
def _conv_bwd_edges_kernel(
    x_ptr,  # [N_TOK, C]
    dy_ptr,  # [N_TOK, C]
    w_ptr,  # [C, W]
    bias_ptr,  # [C] (a dummy unless HAS_BIAS)
    cu_ptr,  # [Ns + 1] int32
    state_ptr,  # [Ns, C, W - 1] in x's dtype (a dummy unless HAS_STATE)
    dfin_ptr,  # [Ns, C, W - 1] cotangent of the final state
    dx_in_ptr,  # [N_TOK, C], aliased to dx_ptr
    dx_ptr,  # [N_TOK, C]
    dstate_ptr,  # [Ns, C, W - 1] float32 (a dummy unless HAS_STATE)
    C: tl.constexpr,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_STATE: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Sequence `program_id(0)`: dstate from `g` of its first W - 1 tokens (recomputed, taps in
    the main kernel's order) and `dfinal`; `dfinal` added into dx of its last W - 1 tokens."""
    i = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    mask_c = offs_c < C
    start = tl.load(cu_ptr + i)
    end = tl.load(cu_ptr + i + 1)
    n = end - start
    sbase = i.to(tl.int64) * (C * (W - 1)) + offs_c * (W - 1)  # [BLOCK_C], state column 0
    if HAS_STATE:
        ws = ()
        for j in tl.static_range(W):
            ws = ws + (tl.load(w_ptr + offs_c * W + j, mask=mask_c, other=0.0).to(tl.float32),)
        gs = ()  # g of the tokens v = 0 .. W - 2 of the sequence (0 past its end)
        for v in tl.static_range(W - 1):
            live = mask_c & (v < n)
            tok = (start + v).to(tl.int64)
            a = tl.zeros((BLOCK_C,), tl.float32)
            for j in tl.static_range(W):
                if v >= (W - 1 - j):
                    xj = tl.load(x_ptr + (tok - (W - 1 - j)) * C + offs_c, mask=live, other=0.0)
                else:
                    xj = tl.load(state_ptr + sbase + (v + j), mask=live, other=0.0)
                a += xj.to(tl.float32) * ws[j]
            if HAS_BIAS:
                a += tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
            g = tl.load(dy_ptr + tok * C + offs_c, mask=live, other=0.0).to(tl.float32)
            if SILU:
                g = g * _dsilu(a, False, False)
            gs = gs + (g,)
        for e in tl.static_range(W - 1):
            d = tl.zeros((BLOCK_C,), tl.float32)
            for j in tl.static_range(e + 1):
                d += ws[j] * gs[e - j]
            # State entry e is entry e - n of the final state when the sequence is shorter.
            d += tl.load(dfin_ptr + sbase + (e - n), mask=mask_c & (e >= n),
                         other=0.0).to(tl.float32)
            tl.store(dstate_ptr + sbase + e, d, mask=mask_c)
    for m in tl.static_range(W - 1):
        tok = end - (W - 1) + m  # entry m of the final state, when it is a token (n + m >= W - 1)
        live = mask_c & (n + m >= W - 1)
        ptr = tok.to(tl.int64) * C + offs_c
        d = (tl.load(dx_in_ptr + ptr, mask=live, other=0.0).to(tl.float32)
             + tl.load(dfin_ptr + sbase + m, mask=live, other=0.0).to(tl.float32))
        tl.store(dx_ptr + ptr, d.to(dx_ptr.dtype.element_ty), mask=live)


def backward(x, weight, bias, initial_state, cu_seqlens, dy, dfinal, *, activation,
             config: Config | None = None):
    """Cotangents of `attn.conv1d.triton_prefill.causal_conv1d`'s inputs.

    Args:
      x, weight, bias, initial_state, cu_seqlens: the forward's inputs (`[B, T, C]`, `[C, W]`,
        `[C]` or None, `[Ns, C, W - 1]` or None, `[Ns + 1]` or None).
      dy: `[B, T, C]` cotangent of y.
      dfinal: `[Ns, C, W - 1]` cotangent of the final state.
      activation: `"silu"` or None.
      config: launch configuration; None for `Config()`.

    Returns:
      `(dx [B, T, C], dweight [C, W], dbias [C] or None, dinitial_state [Ns, C, W - 1] or None)`
      in the dtypes of the inputs.
    """
    b, t, c = x.shape
    w = weight.shape[1]
    n_tok = b * t
    config = Config() if config is None else config
    if cu_seqlens is None:
        n_seq = b
        cu = jnp.asarray(np.arange(b + 1, dtype=np.int32) * t)
    else:
        n_seq = cu_seqlens.shape[0] - 1
        cu = cu_seqlens.astype(jnp.int32)
    has_state = initial_state is not None
    state = initial_state.astype(x.dtype) if has_state else jnp.zeros((1,), x.dtype)
    xf = x.reshape(n_tok, c)
    dyf = dy.astype(x.dtype).reshape(n_tok, c)
    block_c = min(config.block_c, max(16, triton.next_power_of_2(c)))
    block_t = min(config.block_t, triton.next_power_of_2(n_tok))
    steps = min(config.chunk_t // config.block_t, triton.cdiv(n_tok, block_t))
    n_chunks = triton.cdiv(n_tok, block_t * steps)
    nc = triton.cdiv(c, block_c)
    bias_arg = jnp.zeros((1,), jnp.float32) if bias is None else bias
    silu = activation == "silu"
    dx, part = triton_call(
        xf, dyf, weight, bias_arg, cu, state,
        kernel=_conv_bwd_kernel,
        out_shape=(jax.ShapeDtypeStruct((n_tok, c), x.dtype),
                   jax.ShapeDtypeStruct((n_chunks, w + 1, c), jnp.float32)),
        grid=(n_chunks * nc,),
        num_warps=config.num_warps,
        N_TOK=n_tok, T_ROW=t, C=c, W=w, HAS_BIAS=bias is not None, HAS_STATE=has_state,
        VARLEN=cu_seqlens is not None, NS=n_seq, LOG_NS=n_seq.bit_length(),
        LOG_NS1=(n_seq + 1).bit_length(), SILU=silu, BLOCK_T=block_t, STEPS=steps,
        BLOCK_C=block_c, PREFETCH=config.prefetch,
        FAST_SILU=config.fast_silu and jnp.dtype(x.dtype) in (jnp.bfloat16, jnp.float16),
        HW_TANH=on_gpu(), NC=nc,
    )
    dx, dstate = triton_call(
        xf, dyf, weight, bias_arg, cu, state, dfinal.astype(x.dtype), dx,
        kernel=_conv_bwd_edges_kernel,
        out_shape=(jax.ShapeDtypeStruct((n_tok, c), x.dtype),
                   jax.ShapeDtypeStruct((n_seq, c, w - 1) if has_state else (1,), jnp.float32)),
        grid=(n_seq, nc),
        num_warps=config.num_warps,
        input_output_aliases={7: 0},
        C=c, W=w, HAS_BIAS=bias is not None, HAS_STATE=has_state, SILU=silu, BLOCK_C=block_c,
    )
    sums = jnp.sum(part, axis=0)  # [W + 1, C]
    dweight = sums[:w].T.astype(weight.dtype)
    dbias = None if bias is None else sums[w].astype(bias.dtype)
    dstate = dstate.astype(initial_state.dtype) if has_state else None
    return dx.reshape(b, t, c), dweight, dbias, dstate
