"""Block-wise FP8 (e4m3) KV pages with one float32 scale per sub-block of tokens.

Layout (head-major, as every page pool): pages `[K, num_pages, P, H]` in `float8_e4m3fn` and scales
`[K, num_pages, P // sub_block]` float32, one scale per (head, page, sub-block of `sub_block`
consecutive tokens). Token `i` of a page uses scale `i // sub_block`. The stored scale is the
*dequantisation* scale: `value = fp8.astype(f32) * scale`.

Quantisation of one sub-block (amax over its tokens and features):

    s = max(amax, AMAX_FLOOR) * INV_FP8_MAX      (INV_FP8_MAX = float32(1 / 448))
    q = clip(x / s, -448, 448).astype(float8_e4m3fn)

The scale is a product with the float32 reciprocal, not a division by 448: compilers rewrite a
division by a constant into that product or not (XLA on the CPU does), and the Triton write
kernel (`kv.fp8_triton`) must give the same scales as this module.

The clip comes before the cast because casting anything above 464 to e4m3 gives NaN (and `x / s`
can round a hair above 448). `AMAX_FLOOR` keeps the scale a normal float32, so an all-zero
sub-block quantises to zeros with a finite scale instead of 0 / 0 = NaN; values that small (below
~5e-36, i.e. float32 subnormals) quantise to 0.

Round-trip error: e4m3 keeps 3 mantissa bits, so each value is within half an ulp, `|x| / 16`, of
its dequantised copy, plus `s / 1024` in e4m3's subnormal range; in short at most `amax / 16` of
its sub-block.

Why `DEFAULT_SUB_BLOCK = 16`: a scale costs 4 bytes per (head, sub-block), i.e.
`4 / (sub_block * H)` bytes per fp8 byte: at H = 128, 0.2% for 16 tokens, 0.1% for 32, 3% for a
per-token scale. Smaller sub-blocks track outlier tokens better (one outlier only coarsens the
grid of the tokens that share its scale) and make the decode-time read-modify-write (see
`quantize_tokens`) touch fewer tokens, with fewer double roundings per token. 16 tokens is the
smallest block that keeps the scale overhead negligible, and it divides every page size we use
(16, 32, 64, 128); the sub-block must divide the page size. `sub_block == P` gives one scale per
page and head; `sub_block == 1` is the per-token layout of FastDeploy's legacy block-wise FP8 cache.

Not supported: e5m2, per-feature scales, scales stored in bf16.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from attn import _checks
from attn._op import Backend, op

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0
# 448 * smallest normal float32: the smallest scale is then a normal float32 (no flush to zero).
AMAX_FLOOR = FP8_MAX * float(jnp.finfo(jnp.float32).tiny)
INV_FP8_MAX = float(np.float32(1.0 / FP8_MAX))  # exactly representable in float32
DEFAULT_SUB_BLOCK = 16


def _token_axis(x, axis: int) -> int:
    _checks.check_int("axis", axis)
    if x.ndim < 2 or not -x.ndim <= axis < x.ndim or axis % x.ndim == x.ndim - 1:
        raise ValueError(f"{axis=} must name a token axis before the feature (last) axis of an "
                         f"array of rank >= 2; got shape {x.shape}")
    return axis % x.ndim


def to_fp8(x: Float[Array, "..."], scale: Float[Array, "..."]) -> Array:
    """`clip(x / scale, -448, 448)` cast to e4m3 (`scale` broadcasts against `x`), in float32."""
    return jnp.clip(x.astype(jnp.float32) / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def scale_from_amax(amax: Float[Array, "..."]) -> Float[Array, "..."]:
    """Dequantisation scale `max(amax, AMAX_FLOOR) * float32(1 / 448)` (float32)."""
    return jnp.maximum(amax.astype(jnp.float32), AMAX_FLOOR) * jnp.float32(INV_FP8_MAX)


@functools.partial(jax.jit, static_argnames=("sub_block", "axis"))
def _quantize(x, sub_block: int, axis: int):
    n = x.shape[axis]
    blocked = x.reshape(x.shape[:axis] + (n // sub_block, sub_block) + x.shape[axis + 1:])
    reduce = (axis + 1, blocked.ndim - 1)  # the sub-block's tokens and the features
    amax = jnp.max(jnp.abs(blocked.astype(jnp.float32)), axis=reduce)
    scales = scale_from_amax(amax)  # x.shape[:-1] with the token axis n -> n // sub_block
    q = to_fp8(blocked, jnp.expand_dims(scales, reduce))
    return q.reshape(x.shape), scales


def quantize(
    x: Float[Array, "*A P H"], sub_block: int = DEFAULT_SUB_BLOCK, *, axis: int = -2
) -> tuple[Array, Float[Array, "*A C"]]:
    """Quantise to e4m3 with one scale per `sub_block` consecutive tokens.

    The amax of a sub-block is taken over its tokens and the last (feature) axis; every other axis
    keeps its own scales. For pages `[K, num_pages, P, H]` and `axis=-2` that is one scale per
    head, page and sub-block; for a dense `[B, S, K, H]` and `axis=1`, scales `[B, S // sb, K]`.

    Args:
      x: float array, e.g. pages `[K, num_pages, P, H]`.
      sub_block: tokens per scale; must divide `x.shape[axis]`.
      axis: the token axis; any axis before the last.

    Returns:
      `(q, scales)`: `q` like `x` in `float8_e4m3fn`; float32 `scales` shaped `x.shape[:-1]` with
      the token axis divided by `sub_block` (pages: `[K, num_pages, P // sub_block]`).

    Raises:
      TypeError: `x` is not floating point, or is already fp8; `sub_block` or `axis` not an int.
      ValueError: `sub_block` not positive or does not divide the token axis; `axis` invalid.
    """
    _checks.check_floating("x", x)
    if jnp.dtype(x.dtype).itemsize == 1:
        raise TypeError(f"x.dtype={x.dtype} is already an 8-bit float; dequantize it first")
    axis = _token_axis(x, axis)
    _checks.check_int("sub_block", sub_block)
    if sub_block <= 0 or x.shape[axis] % sub_block:
        raise ValueError(f"{sub_block=} must be positive and divide the token axis "
                         f"x.shape[{axis}]={x.shape[axis]}")
    return _quantize(x, sub_block, axis)


@functools.partial(jax.jit, static_argnames=("dtype", "axis"))
def _dequantize(q, scales, dtype, axis: int):
    sub_block = q.shape[axis] // scales.shape[axis]
    s = jnp.repeat(scales, sub_block, axis=axis)  # token-wise scales: q.shape[:-1]
    return (q.astype(jnp.float32) * s[..., None]).astype(dtype)


def dequantize(
    q: Array, scales: Float[Array, "*A C"], dtype=jnp.float32, *, axis: int = -2
) -> Float[Array, "*A P H"]:
    """Inverse of `quantize`: `q.astype(f32) * scale` of each token's sub-block, cast to `dtype`.

    Args:
      q: `float8_e4m3fn` array, e.g. pages `[K, num_pages, P, H]`.
      scales: float32, `q.shape[:-1]` with the token axis divided by the sub-block size (which is
        inferred from the ratio).
      dtype: output float dtype.
      axis: the token axis of `q`.

    Returns:
      Array shaped like `q` in `dtype`.

    Raises:
      TypeError: `q` is not e4m3, `scales` not float32, `dtype` not floating.
      ValueError: `scales` shape inconsistent with `q` or its sub-block not dividing the axis.
    """
    _checks.check_dtype("q", q, (FP8_DTYPE,))
    _checks.check_dtype("scales", scales, (jnp.float32,))
    _checks.check_float_dtype("dtype", dtype)
    axis = _token_axis(q, axis)
    n_sub = scales.shape[axis] if scales.ndim == q.ndim - 1 else 0
    expect = q.shape[:axis] + (n_sub,) + q.shape[axis + 1:-1]
    if scales.shape != expect or n_sub <= 0 or q.shape[axis] % n_sub:
        raise ValueError(f"scales.shape={scales.shape} must be q.shape[:-1]={q.shape[:-1]} with "
                         f"axis {axis} divided by the sub-block size")
    return _dequantize(q, scales, jnp.dtype(dtype), axis)


@jax.jit
def _quantize_tokens(pages, scales, x, page_ids, offsets):
    num_kv, num_pages, page, head_dim = pages.shape
    n_sub = scales.shape[-1]
    sub_block = page // n_sub
    num_blocks = num_kv * num_pages * n_sub
    in_page = (offsets >= 0) & (offsets < page)  # [T]
    # An id outside [0, num_pages) is no page of this head: not written (an id >= num_pages would
    # otherwise land in the next head's pool through the flat index below).
    valid = (page_ids >= 0) & (page_ids < num_pages) & in_page[:, None]  # [T, K]
    off = jnp.where(in_page, offsets, 0)[:, None]  # [T, 1]
    # Flat sub-block index (head, page, sub-block) -> row of the [K * num_pages * n_sub, ...] views.
    # Invalid ids never reach an index: reads go to the null page 0, writes past the end (dropped).
    head = jnp.arange(num_kv, dtype=jnp.int32)[None, :]  # [1, K]
    block = (head * num_pages + jnp.where(valid, page_ids, 0)) * n_sub + off // sub_block
    block_write = jnp.where(valid, block, num_blocks)  # [T, K]
    slot = jnp.broadcast_to(off % sub_block, valid.shape)  # [T, K]
    block_scales = scales.reshape(num_blocks)
    blocks = pages.reshape(num_blocks, sub_block, head_dim)

    # First slot written in each touched sub-block: slots from there on are not (yet) valid tokens.
    first = jnp.full((num_blocks,), sub_block, jnp.int32)
    first = first.at[block_write].min(slot, mode="drop")[block]  # [T, K]

    # Read: the valid old tokens of each touched sub-block, dequantised.
    old = blocks[block].astype(jnp.float32) * block_scales[block][..., None, None]  # [T, K, sb, H]
    keep = jnp.arange(sub_block, dtype=jnp.int32) < first[..., None]  # [T, K, sb]
    old = jnp.where(keep[..., None], old, 0.0)

    # New scale: amax over the old valid tokens and every token written to the sub-block
    # (scatter-max over the tokens that share it).
    amax = jnp.maximum(jnp.max(jnp.abs(old), axis=(-2, -1)),
                       jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1))  # [T, K]
    block_scales = block_scales.at[block_write].set(0.0, mode="drop")
    block_scales = block_scales.at[block_write].max(scale_from_amax(amax), mode="drop")
    s = jnp.where(valid, block_scales[block], 1.0)  # [T, K]

    # Modify-write: every token sharing a sub-block writes the same re-quantised old tokens (and
    # zeros from `first` on), so duplicate scatters agree; then the new tokens, one slot each.
    blocks = blocks.at[block_write].set(to_fp8(old, s[..., None, None]), mode="drop")
    tokens = blocks.reshape(num_blocks * sub_block, head_dim)
    tokens = tokens.at[block_write * sub_block + slot].set(to_fp8(x, s[..., None]), mode="drop")
    return tokens.reshape(pages.shape), block_scales.reshape(scales.shape)


# `quantize_tokens`' backends (`attn._op`): the Triton kernel on a GPU, the scatters elsewhere.
_QUANTIZE_TOKENS_BACKENDS = (
    Backend(name="triton", run="kv.fp8_triton:quantize_tokens"),
    Backend(name="xla", run=_quantize_tokens, platforms=("cpu", "gpu")),
)


@op(name="quantize_tokens", backends=_QUANTIZE_TOKENS_BACKENDS)
def quantize_tokens(
    pages: Array,
    scales: Float[Array, "K num_pages C"],
    x: Float[Array, "T K H"],
    page_ids: Int[Array, "T K"],
    offsets: Int[Array, " T"],
) -> tuple[Array, Float[Array, "K num_pages C"]]:
    """Append tokens to fp8 pages, re-quantising each touched sub-block (read-modify-write).

    Write strategy: every write re-quantises the whole sub-block it lands in. The sub-block's
    valid old tokens are dequantised, the scale is recomputed from their amax and the new tokens'
    amax, and old and new tokens are quantised again with it. This is exact for a per-group scale
    (the scale always covers every token of the sub-block) at the cost of reading and writing up to
    `sub_block * H` values per appended token, and of one extra rounding of the old tokens each
    time the scale grows (the scale never shrinks while a sub-block fills, so an append that does
    not raise the amax leaves the old bytes bitwise unchanged).

    Writes are appends: in every touched sub-block, the slots from the first slot written by this
    call on are taken to be empty (they are zeroed unless written now), so stale bytes of a
    recycled page never enter a scale, and fresh pages need no zeroing. Writing a whole sub-block
    in one call gives exactly `quantize` of it. Several tokens may land in the same sub-block (a
    prefill chunk), in any order; two tokens must not share a slot.

    Args:
      pages: `[K, num_pages, P, H]` `float8_e4m3fn` page pool.
      scales: `[K, num_pages, P // sub_block]` float32 scales.
      x: `[T, K, H]` new tokens (any float dtype).
      page_ids: `[T, K]` int32 physical page of each token in each head's pool (per-head block
        tables); an id outside `[0, num_pages)` (negative: padding) means "do not write" and
        touches nothing, page 0 and the other heads' pools included (every backend).
      offsets: `[T]` int32 slot of each token in its page (`position % P`); tokens with an offset
        outside `[0, P)` are not written.
      implementation: `"xla"` (scatters), `"triton"` (`kv.fp8_triton`: one program per touched
        sub-block, the pool aliased in place; same bits) or `"auto"` (Triton on a GPU).

    Returns:
      `(pages, scales)` updated; the caller may donate the inputs.

    Raises:
      TypeError: dtypes (pages e4m3, scales float32, x float, ids and offsets int32).
      ValueError: shapes inconsistent; an unknown implementation name.
    """
    _checks.check_dtype("pages", pages, (FP8_DTYPE,))
    _checks.check_dtype("scales", scales, (jnp.float32,))
    _checks.check_floating("x", x)
    _checks.check_dtype("page_ids", page_ids, (jnp.int32,))
    _checks.check_dtype("offsets", offsets, (jnp.int32,))
    if pages.ndim != 4:
        raise ValueError(f"pages must have shape [K, num_pages, P, H]; got shape {pages.shape}")
    num_kv, num_pages, page, head_dim = pages.shape
    if (scales.ndim != 3 or scales.shape[:2] != (num_kv, num_pages) or scales.shape[2] <= 0
            or page % scales.shape[2]):
        raise ValueError(f"scales.shape={scales.shape} must be [K={num_kv}, "
                         f"num_pages={num_pages}, P // sub_block] with sub_block dividing P={page}")
    if x.ndim != 3 or x.shape[1:] != (num_kv, head_dim):
        raise ValueError(f"x.shape={x.shape} must be [T, K={num_kv}, H={head_dim}]")
    if page_ids.shape != x.shape[:2]:
        raise ValueError(f"page_ids.shape={page_ids.shape} must be [T, K]={x.shape[:2]}")
    if offsets.shape != x.shape[:1]:
        raise ValueError(f"offsets.shape={offsets.shape} must be [T]={x.shape[:1]}")
    if num_kv * num_pages * page >= 2**31:
        raise ValueError(f"pages.shape={pages.shape} has {num_kv * num_pages * page} token rows, "
                         f"more than int32 indices address; use fewer pages per pool")
    # Ids are data (out of range: not written); the checked mode turns garbage into an error.
    _checks.check_table_ids("page_ids", page_ids, num_pages)
    return dict(pages=pages, scales=scales, x=x, page_ids=page_ids, offsets=offsets)
