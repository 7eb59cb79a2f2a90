"""The threshold selection of the Triton XAttention estimate (`attn/xattention/triton.py`):
`reference.find_blocks`'s rule in one Triton program per (request, head, query tile) row, found by
bisection on the masses' float bits instead of a sort (`_select_kernel` states the argument).
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn._harness import triton_call


@triton.jit
def _select_kernel(
    sums_ptr,  # [B * N * TB, SB] f32 block masses
    diag_ptr,  # [B, TB] int32 diagonal block of each query tile
    tau_ptr,  # [1] f32 threshold
    out_ptr,  # [B * N * TB, SB] int8 selected
    NTB: tl.constexpr,  # N * TB rows per request
    TB: tl.constexpr,
    SB: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """`reference.find_blocks` for one row, without a sort. The rule: the candidates (neither
    forced nor padding) ranked by mass descending, index ascending; the first whose preceding
    mass (after the forced blocks') is below the requirement are kept.

    Masses are >= 0, so their float bits order as the masses. With `M(u)` the mass of the
    candidates whose bits exceed `u`, the first block of a mass class `u` has `forced + M(u)`
    before it, so some of the class is kept iff that is below the requirement, which holds for
    every `u` from some `u*` on (M is non-increasing): 31 bisection steps, each a masked row sum,
    find `u*`. Every candidate above `u*` is kept: for its class `u > u*` (c blocks of mass m)
    the condition holds at `u - 1`, and `M(u - 1) = M(u) + c·m` bounds its last block's
    preceding mass. Of the class at `u*`, the first `t` by index with `forced + M(u*) + t·m`
    below the requirement are kept.
    """
    row = tl.program_id(0)
    d = tl.load(diag_ptr + (row // NTB) * TB + row % TB)
    j = tl.arange(0, BLOCK_S)
    x = tl.load(sums_ptr + row.to(tl.int64) * SB + j, mask=j < SB, other=0.0)
    forced = (j == 0) | (j == d)
    required = tl.load(tau_ptr) * tl.sum(x, 0)
    forced_mass = tl.sum(tl.where(forced, x, 0.0), 0)
    last = forced | (j >= SB)  # ranked after every candidate, carrying no mass
    other = tl.where(last, 0.0, x)
    bits = other.to(tl.int32, bitcast=True)  # masses >= 0: bits order as values
    # The kept-class condition fails at lo (or lo = -1) and holds at hi: the bits of +inf, above
    # every finite mass (no candidate above it, as above 0x7FFFFFFF), which keeps hi - lo and
    # the compares in int32.
    lo = tl.full([], -1, tl.int32)
    hi = tl.full([], 0x7F800000, tl.int32)
    for _ in tl.static_range(31):
        mid = lo + (hi - lo) // 2
        fits = forced_mass + tl.sum(tl.where(bits > mid, other, 0.0), 0) < required
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid)
    tie = (bits == hi) & ~last
    m = tl.max(tl.where(tie, other, 0.0), 0)
    t = tl.cumsum(tie.to(tl.int32), 0) - 1  # rank among the class by index
    above = forced_mass + tl.sum(tl.where(bits > hi, other, 0.0), 0)
    keep = forced | (~last & (bits > hi)) | (tie & (above + t.to(tl.float32) * m < required))
    tl.store(out_ptr + row.to(tl.int64) * SB + j, (keep & (j <= d)).to(tl.int8), mask=j < SB)


def select_blocks_kernel(block_sums, diagonal, threshold, *, num_warps=None):
    """`reference.find_blocks` in one Triton program per (request, head, query tile) row (see
    `_select_kernel`). The same rule; the row total and the masses above the cut are float32
    sums in the kernel's order, so a block whose preceding mass sits within rounding of the
    requirement may go the other way (bit for bit the reference's mask where the sums are exact,
    e.g. integer masses). H100, N32, 512 / 1024 key blocks (S64K / S128K at block 128): 0.195 /
    0.516 ms on 4 warps, against 0.469 / 1.937 for XLA sorting once and ~0.53 / 2.4 for the
    reference's two sorts (an in-register sort of packed 64-bit keys, tried first, took 0.269 /
    1.418). Each bisection step is a row sum, which across warps goes through shared memory and a
    barrier: one warp (512 blocks) / two (1024) take 0.084 / 0.357 ms with the bisection in int32
    (4 warps 0.201 / 0.526, 8 warps 0.375 / 0.782 before it). `num_warps` overrides that
    choice."""
    if num_warps is not None and (num_warps < 1 or num_warps & (num_warps - 1)):
        raise ValueError(f"num_warps={num_warps} must be a power of two >= 1")
    b, n, tb, sb = block_sums.shape
    tau = jnp.reshape(jnp.asarray(threshold, jnp.float32), (1,))
    out = triton_call(
        block_sums.astype(jnp.float32).reshape(b * n * tb, sb), diagonal.astype(jnp.int32), tau,
        kernel=_select_kernel,
        out_shape=jax.ShapeDtypeStruct((b * n * tb, sb), jnp.int8),
        grid=(b * n * tb,),
        num_warps=num_warps or (1 if sb <= 512 else 2),
        num_stages=1,
        NTB=n * tb, TB=tb, SB=sb, BLOCK_S=max(16, triton.next_power_of_2(sb)),
    )
    return out.reshape(b, n, tb, sb).astype(bool)
