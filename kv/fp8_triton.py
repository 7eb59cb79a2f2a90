"""Triton write of new tokens into fp8 pages: `fp8.quantize_tokens` as one read-modify-write kernel.

The XLA version re-quantises each touched sub-block through scatter-min / scatter-max and gathers
over the whole flattened pool, which XLA does not keep in place: on the H100 one decode token per
row (B64, K8, H128, a 2.2 GB pool) took 5.8 ms, 3.5x the fp8 decode it feeds. Here each touched
sub-block is read, re-quantised and written back by one program, in registers, and the pool is
aliased input -> output, so a donated pool is updated in place and a call moves only the touched
sub-blocks.

Grouping: a sub-block may receive several tokens in one call (a prefill chunk). The (token, head)
entries are sorted by flat sub-block index (`(head * num_pages + page) * C + slot // sub_block`;
entries with an id outside `[0, num_pages)` or an offset outside the page are not written and
sort last); one program per sorted entry, and only the first entry of each run of
equal indices (the group's leader) works: it reads up to `sub_block` entries from its position on,
which are exactly its group (two tokens never share a slot). So every sub-block is written by one
program and no two programs touch the same bytes.

Numerics are those of `fp8.quantize_tokens`: old tokens before the first slot written are
dequantised (`fp8 * scale` in float32), the new scale is `max(amax, AMAX_FLOOR) * float32(1 /
448)` over them and the new tokens, both are quantised with `clip(x / scale, -448, 448)` rounded
to nearest even (`div_rn`, then the saturating e4m3 conversion), and the slots from the first
written one on that receive no token are zeroed. The scales equal the XLA path's bit for bit; the
bytes too, except that XLA's float32 division is not correctly rounded (on the CPU a third of its
quotients are one ulp off) and `div_rn` is, so where the exact quotient is an e4m3 rounding tie
the two may round apart by one e4m3 step (measured: ~1 byte in 10^3 of random CPU tests, 1 in
1.7e7 in one of two H100 runs).

Supports: any sub-block size dividing the page (padded to a power of two), any head dim (padded),
any float input dtype. Not supported: e5m2 pages, gradients.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn._harness import triton_call
from kv.fp8 import AMAX_FLOOR, FP8_MAX, INV_FP8_MAX

_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_FP8_MAX = tl.constexpr(FP8_MAX)
_INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)


@triton.jit
def _quantize_tokens_kernel(
    pages_ptr,  # [K * num_pages * C, SUB, H] e4m3, read
    scales_ptr,  # [K * num_pages * C] float32, read
    x_ptr,  # [T * K, H] new tokens, entry e = t * K + k
    key_ptr,  # [E] int32: flat sub-block of each sorted entry, NUM_BLOCKS when not written
    entry_ptr,  # [E] int32: the entry (t * K + k) at each sorted position
    slot_ptr,  # [T] int32: slot of token t in its sub-block
    new_pages_ptr,  # aliased to pages_ptr
    new_scales_ptr,  # aliased to scales_ptr
    E: tl.constexpr,
    K: tl.constexpr,
    H: tl.constexpr,
    SUB: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    BLOCK_SUB: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    i = tl.program_id(0)
    block = tl.load(key_ptr + i)
    before = tl.load(key_ptr + i - 1, mask=i > 0, other=-1)
    leader = (block < NUM_BLOCKS) & (before != block)
    block = tl.where(leader, block, 0)  # never an address past the pool

    # The group: the entries from here on that land in the same sub-block (at most SUB of them).
    j = i + tl.arange(0, BLOCK_SUB)
    in_group = (j < E) & leader
    in_group = in_group & (tl.load(key_ptr + j, mask=in_group, other=-1) == block)
    entry = tl.load(entry_ptr + j, mask=in_group, other=0)
    slot = tl.load(slot_ptr + entry // K, mask=in_group, other=SUB)
    first = tl.min(slot, axis=0)  # slots from `first` on hold no valid old token

    rows = tl.arange(0, BLOCK_SUB)
    cols = tl.arange(0, BLOCK_H)
    in_h = cols < H
    tile = block.to(tl.int64) * (SUB * H) + rows[:, None] * H + cols[None, :]
    old_scale = tl.load(scales_ptr + block, mask=leader, other=1.0)
    valid_old = (rows < first)[:, None] & in_h[None, :]
    old = tl.load(pages_ptr + tile, mask=valid_old, other=0.0)
    old = tl.where(valid_old, old.to(tl.float32) * old_scale, 0.0)  # a stale NaN scale stays out
    new = tl.load(x_ptr + entry.to(tl.int64)[:, None] * H + cols[None, :],
                  mask=in_group[:, None] & in_h[None, :], other=0.0).to(tl.float32)

    amax = tl.maximum(tl.max(tl.max(tl.abs(old), axis=1), axis=0),
                      tl.max(tl.max(tl.abs(new), axis=1), axis=0))
    scale = tl.maximum(amax, _AMAX_FLOOR) * _INV_FP8_MAX
    fp8 = new_pages_ptr.dtype.element_ty
    old_q = tl.clamp(tl.math.div_rn(old, scale), -_FP8_MAX, _FP8_MAX).to(fp8)
    new_q = tl.clamp(tl.math.div_rn(new, scale), -_FP8_MAX, _FP8_MAX).to(fp8)

    # Rows that receive a new token are written by the second store only (disjoint addresses).
    hit = (slot[None, :] == rows[:, None]) & in_group[None, :]  # [row, group entry]
    written = tl.max(hit.to(tl.int32), axis=1) > 0
    keep = leader & (rows < SUB) & ~written
    tl.store(new_pages_ptr + tile, old_q, mask=keep[:, None] & in_h[None, :])
    dest = block.to(tl.int64) * (SUB * H) + slot[:, None] * H + cols[None, :]
    tl.store(new_pages_ptr + dest, new_q, mask=in_group[:, None] & in_h[None, :])
    tl.store(new_scales_ptr + block, scale, mask=leader)


@jax.jit
def quantize_tokens(pages, scales, x, page_ids, offsets):
    """`fp8.quantize_tokens` through the kernel; arguments validated there.

    Args:
      pages: `[K, num_pages, P, H]` e4m3 pool; aliased to the returned pages (donate it to update
        in place).
      scales: `[K, num_pages, P // sub_block]` float32; aliased likewise.
      x: `[T, K, H]` new tokens.
      page_ids: `[T, K]` int32; an id outside `[0, num_pages)` (-1: unallocated, or past the
        pool) is not written.
      offsets: `[T]` int32 slot of each token in its page; outside `[0, P)`: not written.

    Returns:
      `(pages, scales)`.
    """
    num_kv, num_pages, page, head_dim = pages.shape
    n_sub = scales.shape[-1]
    sub_block = page // n_sub
    num_blocks = num_kv * num_pages * n_sub
    tokens = x.shape[0]
    in_page = (offsets >= 0) & (offsets < page)
    valid = (page_ids >= 0) & (page_ids < num_pages) & in_page[:, None]  # [T, K]
    head = jnp.arange(num_kv, dtype=jnp.int32)[None, :]
    sub = jnp.where(in_page, offsets, 0)[:, None] // sub_block
    block = (head * num_pages + page_ids) * n_sub + sub
    key = jnp.where(valid, block, num_blocks).reshape(-1)  # [E], E = T * K
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    entries = tokens * num_kv
    return triton_call(
        pages,
        scales,
        x.reshape(entries, head_dim),
        key[order],
        order,
        jnp.where(in_page, offsets % sub_block, 0).astype(jnp.int32),
        kernel=_quantize_tokens_kernel,
        out_shape=(jax.ShapeDtypeStruct(pages.shape, pages.dtype),
                   jax.ShapeDtypeStruct(scales.shape, scales.dtype)),
        grid=(entries,),
        num_warps=4 if head_dim * sub_block >= 2048 else 2,
        input_output_aliases={0: 0, 1: 1},
        E=entries,
        K=num_kv,
        H=head_dim,
        SUB=sub_block,
        NUM_BLOCKS=num_blocks,
        BLOCK_SUB=triton.next_power_of_2(sub_block),
        BLOCK_H=triton.next_power_of_2(head_dim),
    )
