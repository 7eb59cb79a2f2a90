"""Head-major paged KV: page pools, per-head block tables, the KV write and a dense gather.

Layout (DESIGN.md, conventions): `k: [K, num_pages, P, H]`, `v: [K, num_pages, P, Hv]`. Every KV
head has its own pool of `num_pages` pages over its own slice of memory, so page id `p` of head 0
and page id `p` of head 1 are different memory; ids may (and with full pools must) collide across
heads. Page 0 of every head is the reserved null page: never handed out, never written, and the
target of every unallocated (-1) table entry on a read. Token `s` of batch row `b` lives, for head
`k`, at `pages[k, table[b, k, s // P], s % P]`.

FP8 pools store `float8_e4m3fn` pages plus float32 scales `[K, num_pages, P // sub_block]` (see
`kv/fp8.py` for the quantiser and the choice `sub_block = 16`). A write re-quantises every touched
sub-block (read-modify-write, `fp8.quantize_tokens`).

Not here: allocation and recycling (`kv/allocator.py`), MLA latent pages (`kv/mla.py`), GDN slot
pools (`kv/slots.py`), attention itself (`attn/`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from kv import _validate as v_
from kv import fp8

NULL_PAGE = 0
UNALLOCATED = -1


@struct.dataclass
class PagePool:
    """One attention layer's KV pages, head-major, optionally FP8 with per-sub-block scales.

    Attributes:
      k: `[K, num_pages, P, H]` key pages (bf16 / f16 / f32, or `float8_e4m3fn`).
      v: `[K, num_pages, P, Hv]` value pages, same dtype as `k`.
      k_scale: `[K, num_pages, P // sub_block]` float32 dequantisation scales of `k`; None unless
        the pool is FP8.
      v_scale: the same for `v`.

    Page 0 of every head is null. The pool holds no allocation state; pair it with a
    `PageAllocator` and `BlockTables`. Writers may donate it (`jit(..., donate_argnums=...)`).
    """

    k: Float[Array, "K num_pages P H"]
    v: Float[Array, "K num_pages P Hv"]
    k_scale: Float[Array, "K num_pages C"] | None = None
    v_scale: Float[Array, "K num_pages C"] | None = None

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[0]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def head_dim(self) -> int:
        return self.k.shape[3]

    @property
    def value_head_dim(self) -> int:
        return self.v.shape[3]

    @property
    def is_fp8(self) -> bool:
        return self.k_scale is not None

    @property
    def sub_block(self) -> int | None:
        """Tokens per scale (FP8 pools), else None."""
        return None if self.k_scale is None else self.page_size // self.k_scale.shape[-1]


@struct.dataclass
class BlockTables:
    """Per-head block tables of a batch, with the bookkeeping the allocator needs.

    Attributes:
      table: `[B, K, max_pages]` int32; `table[b, k, j]` is head `k`'s physical page holding
        tokens `[j * P, (j + 1) * P)` of row `b`, or -1 (`UNALLOCATED`) when that logical page
        was never allocated or was released by `recycle`. Valid ids are `1 .. num_pages - 1`.
      extent: `[B, K]` int32, the logical pages allocated so far: the next `alloc` fills logical
        page `extent[b, k]`; every entry at or beyond it is -1.
      cursor: `[B, K]` int32 recycle cursor; logical pages `[ceil(sinks / P), cursor)` have been
        released (monotone; 0 until the first release).
      page_size: `P`, static.

    A uniform (head-shared) table is this table with identical rows per head.
    """

    table: Int[Array, "B K max_pages"]
    extent: Int[Array, "B K"]
    cursor: Int[Array, "B K"]
    page_size: int = struct.field(pytree_node=False)

    @property
    def batch_size(self) -> int:
        return self.table.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.table.shape[1]

    @property
    def max_pages(self) -> int:
        return self.table.shape[2]

    def pages_per_row(self) -> Int[Array, "B K"]:
        """Pages each row holds per head (entries != -1)."""
        return jnp.sum(self.table != UNALLOCATED, axis=-1, dtype=jnp.int32)


def create_page_pool(
    *,
    num_kv_heads: int,
    num_pages: int,
    page_size: int,
    head_dim: int,
    value_head_dim: int | None = None,
    dtype=jnp.bfloat16,
    sub_block: int | None = None,
) -> PagePool:
    """A zero-filled page pool (FP8 when `dtype` is `float8_e4m3fn`).

    Args:
      num_kv_heads: `K`.
      num_pages: pages per head, null page 0 included (so `num_pages - 1` are allocatable).
      page_size: `P` tokens per page.
      head_dim: `H`.
      value_head_dim: `Hv`; default `H`.
      dtype: page dtype: a float dtype, or `jnp.float8_e4m3fn` for an FP8 pool with scales.
      sub_block: FP8 only: tokens per scale; must divide `P`. Default `min(fp8.DEFAULT_SUB_BLOCK,
        P)`.

    Returns:
      `PagePool`; FP8 scales start at 1.0 (so the zero pages dequantise to 0).

    Raises:
      TypeError: non-int sizes or a non-float dtype.
      ValueError: non-positive sizes, fewer than 2 pages, `sub_block` not dividing `P` or given
        for a non-FP8 pool, or `num_pages * P` slots beyond int32.
    """
    num_kv_heads = v_.check_positive_int("num_kv_heads", num_kv_heads)
    num_pages = v_.check_positive_int("num_pages", num_pages, minimum=2)
    page_size = v_.check_positive_int("page_size", page_size)
    head_dim = v_.check_positive_int("head_dim", head_dim)
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    value_head_dim = v_.check_positive_int("value_head_dim", value_head_dim)
    dtype = v_.check_float_dtype("dtype", dtype)
    v_.check_int32_slots("num_pages * page_size", num_pages * page_size)
    is_fp8 = dtype == fp8.FP8_DTYPE
    if not is_fp8 and sub_block is not None:
        raise ValueError(f"{sub_block=} is only meaningful for a float8_e4m3fn pool; {dtype=}")
    if is_fp8:
        if sub_block is None:
            sub_block = min(fp8.DEFAULT_SUB_BLOCK, page_size)
        sub_block = v_.check_positive_int("sub_block", sub_block)
        if page_size % sub_block:
            raise ValueError(f"{sub_block=} must divide {page_size=}")
    elif dtype.itemsize == 1:
        raise TypeError(f"{dtype=}: the only 8-bit page dtype is float8_e4m3fn")
    k = jnp.zeros((num_kv_heads, num_pages, page_size, head_dim), dtype)
    v = jnp.zeros((num_kv_heads, num_pages, page_size, value_head_dim), dtype)
    if not is_fp8:
        return PagePool(k=k, v=v)
    scales = jnp.ones((num_kv_heads, num_pages, page_size // sub_block), jnp.float32)
    return PagePool(k=k, v=v, k_scale=scales, v_scale=scales)


def create_block_tables(
    *, batch_size: int, num_kv_heads: int, max_pages: int, page_size: int
) -> BlockTables:
    """Empty per-head block tables (every entry -1, extents and cursors 0).

    Args:
      batch_size: `B` batch rows (static; padding rows simply own no pages).
      num_kv_heads: `K`.
      max_pages: logical pages per row and head, `ceil(max_len / P)`; streaming heads use the
        same width (released entries read -1).
      page_size: `P`.

    Raises:
      TypeError / ValueError: non-int or non-positive sizes.
    """
    batch_size = v_.check_positive_int("batch_size", batch_size)
    num_kv_heads = v_.check_positive_int("num_kv_heads", num_kv_heads)
    max_pages = v_.check_positive_int("max_pages", max_pages)
    page_size = v_.check_positive_int("page_size", page_size)
    zeros = jnp.zeros((batch_size, num_kv_heads), jnp.int32)
    return BlockTables(
        table=jnp.full((batch_size, num_kv_heads, max_pages), UNALLOCATED, jnp.int32),
        extent=zeros, cursor=zeros, page_size=page_size)


def _check_pool_tables(pool: PagePool, tables: BlockTables) -> None:
    v_.check_instance("pool", pool, PagePool)
    v_.check_instance("tables", tables, BlockTables)
    if tables.num_kv_heads != pool.num_kv_heads:
        raise ValueError(f"tables have K={tables.num_kv_heads} heads but the pool has "
                         f"K={pool.num_kv_heads}")
    if tables.page_size != pool.page_size:
        raise ValueError(f"tables.page_size={tables.page_size} must equal the pool's "
                         f"P={pool.page_size}")


def _safe_page(page: Array, valid: Array, num_pages: int, fill: int) -> tuple[Array, Array]:
    """`(page where valid and inside [1, num_pages) else fill, that mask)`: no -1 survives."""
    ok = valid & (page >= 1) & (page < num_pages)
    return jnp.where(ok, page, fill), ok


def token_pages(
    tables: BlockTables, offsets: Int[Array, "B"], num_new: Int[Array, "B"], num_tokens: int,  # noqa: F821
    num_pages: int,
) -> tuple[Int[Array, "B T K"], Int[Array, "B T"], Int[Array, "B T K"]]:
    """Physical page and in-page slot of new token `t` of row `b` (position `offsets[b] + t`).

    Returns:
      `(page [B, T, K], slot [B, T], valid [B, T, K])`: `valid` is False for padding tokens
      (`t >= num_new[b]`), negative positions, positions beyond the table, and tokens whose page is
      unallocated (-1) or out of range; there `page` is 0 (the null page, safe to gather).
    """
    batch, num_kv, max_pages = tables.table.shape
    size = tables.page_size
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    pos = offsets[:, None] + t[None, :]  # [B, T]
    valid = (t[None, :] < num_new[:, None]) & (pos >= 0) & (pos < max_pages * size)
    logical = jnp.where(valid, pos // size, 0)  # [B, T]
    slot = jnp.where(valid, pos % size, 0)
    bb = jnp.arange(batch, dtype=jnp.int32)[:, None, None]
    kk = jnp.arange(num_kv, dtype=jnp.int32)[None, None, :]
    page = tables.table[bb, kk, logical[:, :, None]]  # [B, T, K]
    page, ok = _safe_page(page, valid[:, :, None], num_pages, NULL_PAGE)
    return page, slot, ok


def write_kv(
    pool: PagePool,
    tables: BlockTables,
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K Hv"],
    offsets: Int[Array, "B"],  # noqa: F821
    num_new: Int[Array, "B"],  # noqa: F821
    *,
    implementation: str = "auto",
) -> PagePool:
    """Scatter new tokens' keys and values into their pages, by position.

    Token `t` of row `b` sits at position `offsets[b] + t` and is written for `t < num_new[b]`
    (the rest of the `T` axis is padding). For head `k` it goes to
    `pages[k, table[b, k, pos // P], pos % P]`. Tokens whose table entry is -1 (unallocated or
    recycled), the null page 0 or any id outside the pool (`>= num_pages`, other negatives), or
    whose position is beyond the table, are dropped: the scatter index becomes `num_pages` with
    `mode="drop"` (FP8: the id -1), so nothing is written, not even the null page, and nothing
    outside the pool. In the checked mode (`attn.debug_checks`) ids outside `[-1, num_pages)`
    fail at run time instead.

    FP8 pools: each touched sub-block is re-quantised (read-modify-write,
    `fp8.quantize_tokens`): its valid old tokens (those before the first slot this call writes)
    are dequantised, the scale is recomputed over old and new tokens, all are quantised again
    (clip to ±448 first), and the slots after the written ones are zeroed. Writes are therefore
    appends: rewriting a position in the middle of a sub-block drops the tokens after it.

    Args:
      pool: the layer's pages. Donate it when jitting for an in-place update.
      tables: per-head block tables; the pages for every written position must be allocated.
      k: `[B, T, K, H]` new keys (any float dtype; cast to the pool dtype).
      v: `[B, T, K, Hv]` new values.
      offsets: `[B]` int, position of token 0 of each row (the row's cache length before).
      num_new: `[B]` int, real new tokens per row (0 for a padding row).
      implementation: FP8 pools only: `fp8.quantize_tokens`' backend (`"auto"`: the Triton
        read-modify-write kernel on a GPU). bf16 pools are always an XLA scatter.

    Returns:
      The updated `PagePool`.

    Raises:
      TypeError: wrong pytree types or dtypes.
      ValueError: shapes inconsistent with the pool or the tables.
    """
    _check_pool_tables(pool, tables)
    v_.check_rank("k", k, 4, "B T K H")
    v_.check_rank("v", v, 4, "B T K Hv")
    v_.check_floating("k", k)
    v_.check_floating("v", v)
    batch, num_tokens = k.shape[:2]
    v_.check_shape("k", k, (tables.batch_size, num_tokens, pool.num_kv_heads, pool.head_dim),
                   "B T K H")
    v_.check_shape("v", v, (batch, num_tokens, pool.num_kv_heads, pool.value_head_dim),
                   "B T K Hv")
    offsets = v_.as_int_array("offsets", offsets, (batch,), "B")
    num_new = v_.as_int_array("num_new", num_new, (batch,), "B")

    v_.check_table_ids("tables.table", tables.table, pool.num_pages)
    page, slot, ok = token_pages(tables, offsets, num_new, num_tokens, pool.num_pages)
    num_kv = pool.num_kv_heads
    if pool.is_fp8:
        flat = batch * num_tokens
        page_ids = jnp.where(ok, page, UNALLOCATED).reshape(flat, num_kv)
        slots = slot.reshape(flat)
        k_pages, k_scale = fp8.quantize_tokens(
            pool.k, pool.k_scale, k.reshape(flat, num_kv, -1), page_ids, slots,
            implementation=implementation)
        v_pages, v_scale = fp8.quantize_tokens(
            pool.v, pool.v_scale, v.reshape(flat, num_kv, -1), page_ids, slots,
            implementation=implementation)
        return pool.replace(k=k_pages, v=v_pages, k_scale=k_scale, v_scale=v_scale)
    pid = jnp.where(ok, page, pool.num_pages)  # out of bounds: dropped
    kk = jnp.broadcast_to(jnp.arange(num_kv, dtype=jnp.int32), pid.shape)  # [B, T, K]
    sl = jnp.broadcast_to(slot[:, :, None], pid.shape)
    return pool.replace(
        k=pool.k.at[kk, pid, sl].set(k.astype(pool.k.dtype), mode="drop"),
        v=pool.v.at[kk, pid, sl].set(v.astype(pool.v.dtype), mode="drop"))


def gather_kv(
    pool: PagePool, tables: BlockTables, dtype=None
) -> tuple[Float[Array, "B S K H"], Float[Array, "B S K Hv"]]:
    """Dense `[B, S, K, H]` view of every row's cache, `S = max_pages * P` (dequantised if FP8).

    A reference reader for tests and pure-jnp attention: unallocated / released entries (-1), and
    ids outside the pool, read the null page 0, so positions a row does not hold come back as
    whatever page 0 holds (zeros unless something wrote it; writes through this module never
    do). Callers mask by length and window as attention does.

    Args:
      pool: the layer's pages.
      tables: per-head block tables.
      dtype: output dtype; default the pool's dtype, float32 for FP8 pools.

    Returns:
      `(k [B, S, K, H], v [B, S, K, Hv])`.

    Raises:
      TypeError: wrong pytree types or a non-float `dtype`.
      ValueError: tables inconsistent with the pool.
    """
    _check_pool_tables(pool, tables)
    if dtype is None:
        dtype = jnp.float32 if pool.is_fp8 else pool.k.dtype
    dtype = v_.check_float_dtype("dtype", dtype)
    batch, num_kv, max_pages = tables.table.shape
    page, _ = _safe_page(tables.table, jnp.bool_(True), pool.num_pages, NULL_PAGE)
    kk = jnp.arange(num_kv, dtype=jnp.int32)[None, :, None]

    def dense(pages, scales):
        x = pages[kk, page]  # [B, K, max_pages, P, H]
        if scales is not None:
            x = fp8.dequantize(x, scales[kk, page], dtype)
        x = x.astype(dtype).transpose(0, 2, 3, 1, 4)  # [B, max_pages, P, K, H]
        return x.reshape(batch, max_pages * pool.page_size, num_kv, x.shape[-1])

    return dense(pool.k, pool.k_scale), dense(pool.v, pool.v_scale)


def page_bytes(pool: PagePool) -> int:
    """Bytes one page of one head occupies: keys, values and (FP8) both scale rows."""
    size = pool.page_size * (pool.head_dim * pool.k.dtype.itemsize
                             + pool.value_head_dim * pool.v.dtype.itemsize)
    if pool.is_fp8:
        size += 4 * (pool.k_scale.shape[-1] + pool.v_scale.shape[-1])
    return int(size)
