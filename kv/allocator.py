"""Per-head page allocators: functional `alloc`, `free` and streaming `recycle` over block tables.

Every KV head has its own free stack of page ids `1 .. num_pages - 1` (page 0, the null page, is
never on a stack): ids are per-head local ids, so the same id in two heads is different memory and
ids never need translating (seed 001, bugs #1 and #2). The state is a pytree and every operation is
a pure, jittable function `state -> (new state, ok)` with static shapes and no host sync. A call
that cannot be carried out in full (not enough free pages in some head, a row that would overflow
its table, a row index out of range, a page that is not owned or appears twice) returns `ok=False`
and the inputs unchanged: every operation is all-or-nothing.

Order: stacks are LIFO. `alloc_batch` pops for rows `0 .. B-1` in turn, each row's logical pages in
ascending order; `free_batch` / `recycle` push row by row, logical pages in ascending order. A fresh
stack pops `1, 2, 3, ...`. The order is part of the contract only so that tests can replay it.

Besides the stacks the allocator keeps `owned [K, num_pages]`: whether a page is handed out. It
costs one byte per page and makes a double free or an aliased page detectable on the device.

Sliding window / streaming release (`recycle`) uses the conventions' window: a query at position
`q` sees key `s` iff `q - window < s <= q` or `s < sinks`. `recycle` assumes that every query
below position `L - 1` of a row with `L` cached tokens has run (call it after the step's
attention; for a decode step also between the write and the attention, since its one query sits
at `L - 1`). Logical page `j` can then be released iff it holds no sink (`j >= ceil(sinks / P)`)
and its last token is out of the window of query `L - 1`: `(j + 1) * P <= L - window`. Only whole
pages are released; the page the window starts in, and every later one, stays. (The seed gates
the release on `L % P == 0`; we do not need to: the tail page is never among the released.)

Sharding: every array has the KV head axis (`free_stack`, `free_count`, `owned` on axis 0; block
tables on axis 1), so an allocator shards by KV head with its pool (see `kv/sharding.py`); the only
cross-head step is the all-or-nothing `ok` reduction.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Int

from kv import _validate as v_
from kv.pages import UNALLOCATED, BlockTables, PagePool, page_bytes


@struct.dataclass
class PageAllocator:
    """Per-KV-head free stacks of page ids.

    Attributes:
      free_stack: `[K, num_pages]` int32; `free_stack[k, :free_count[k]]` are head `k`'s free page
        ids, the top of the stack last. Entries at or above the count are stale and meaningless.
      free_count: `[K]` int32 free pages per head; at most `num_pages - 1` (page 0 never free).
      owned: `[K, num_pages]` bool, page handed out to some block table (`owned[:, 0]` is False).

    Invariant: for each head, the free ids and the owned ids partition `1 .. num_pages - 1`.
    """

    free_stack: Int[Array, "K num_pages"]
    free_count: Int[Array, "K"]  # noqa: F821
    owned: Bool[Array, "K num_pages"]

    @property
    def num_kv_heads(self) -> int:
        return self.free_stack.shape[0]

    @property
    def num_pages(self) -> int:
        return self.free_stack.shape[1]

    @property
    def capacity(self) -> int:
        """Allocatable pages per head: `num_pages - 1`."""
        return self.free_stack.shape[1] - 1


def create_allocator(*, num_kv_heads: int, num_pages: int) -> PageAllocator:
    """All pages `1 .. num_pages - 1` free in every head; the first pops return 1, 2, 3, ...

    Raises:
      TypeError / ValueError: non-int sizes, `num_kv_heads < 1` or `num_pages < 2`.
    """
    num_kv_heads = v_.check_positive_int("num_kv_heads", num_kv_heads)
    num_pages = v_.check_positive_int("num_pages", num_pages, minimum=2)
    # Stack bottom -> top: num_pages - 1, ..., 1; the last slot (never reached) holds 0.
    stack = jnp.concatenate([jnp.arange(num_pages - 1, 0, -1, dtype=jnp.int32),
                             jnp.zeros((1,), jnp.int32)])
    return PageAllocator(
        free_stack=jnp.broadcast_to(stack, (num_kv_heads, num_pages)),
        free_count=jnp.full((num_kv_heads,), num_pages - 1, jnp.int32),
        owned=jnp.zeros((num_kv_heads, num_pages), bool))


def _check(allocator: PageAllocator, tables: BlockTables) -> None:
    v_.check_instance("allocator", allocator, PageAllocator)
    v_.check_instance("tables", tables, BlockTables)
    if tables.num_kv_heads != allocator.num_kv_heads:
        raise ValueError(f"tables have K={tables.num_kv_heads} heads but the allocator has "
                         f"K={allocator.num_kv_heads}")


def exclusive_prefix_sum(x: Int[Array, "B ..."]) -> Int[Array, "B ..."]:
    """`out[b] = sum(x[:b])` along axis 0, as a triangular matmul (axis 0 is a batch axis, small).

    `jnp.cumsum` lowers to a quadratic reduce_window on CPU that is also slow to compile.
    """
    n = x.shape[0]
    before = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # [B, B]: b' < b
    return jnp.tensordot(before.astype(jnp.int32), x.astype(jnp.int32), axes=1)


def _scatter_rows(x, rows, cols, valid, values, *, add: bool = False):
    """`x[rows, cols] = values` (or `+=`) for the `valid` entries of a `[K, n]` array.

    Invalid entries go to a trash column appended for the call, not to an out-of-range column
    with `mode="drop"`: under `--xla_gpu_deterministic_ops=true` (jax 0.11.2, measured on an
    H100) a scalar scatter with two index dims linearises the index, so column `n` of row `k`
    lands in row `k + 1`.
    """
    n = x.shape[1]
    cols = jnp.where(valid & (cols >= 0) & (cols < n), cols, n)
    at = jnp.pad(x, ((0, 0), (0, 1))).at[rows, cols]
    out = at.add(values, mode="promise_in_bounds") if add else at.set(values,
                                                                      mode="promise_in_bounds")
    return out[:, :n]


def _select(ok, new, old):
    """`new` if `ok` else `old`, leaf by leaf (the all-or-nothing commit)."""
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)


def free_pages(allocator: PageAllocator) -> Int[Array, "K"]:  # noqa: F821
    """Free pages per head (`free_count`)."""
    return allocator.free_count


def pages_in_use(allocator: PageAllocator) -> Int[Array, "K"]:  # noqa: F821
    """Pages handed out per head: `capacity - free_count`."""
    return allocator.capacity - allocator.free_count


def pages_needed(tables: BlockTables, lengths: Int[Array, "B"]) -> Int[Array, "B K"]:  # noqa: F821
    """Pages each row and head must still allocate to hold `lengths[b]` tokens.

    `max(ceil(lengths / P) - extent, 0)`: the predicted cost of growing every row to `lengths`;
    `alloc_batch(allocator, tables, pages_needed(tables, lengths))` succeeds iff
    `can_alloc(...)` of the same request says so, and then takes exactly this many pages.
    """
    lengths = v_.as_int_array("lengths", lengths, (tables.batch_size,), "B")
    size = tables.page_size
    return jnp.maximum((lengths[:, None] + size - 1) // size - tables.extent, 0)


def can_alloc(allocator: PageAllocator, tables: BlockTables, n_pages: Int[Array, "B K"]):
    """Whether `alloc_batch` with `n_pages` would succeed: a jittable scalar bool."""
    _check(allocator, tables)
    n = v_.as_int_array("n_pages", n_pages, tables.extent.shape, "B K")
    return (jnp.all(n >= 0) & jnp.all(jnp.sum(n, axis=0) <= allocator.free_count)
            & jnp.all(tables.extent + n <= tables.max_pages))


def alloc_batch(
    allocator: PageAllocator, tables: BlockTables, n_pages: Int[Array, "B K"]
) -> tuple[PageAllocator, BlockTables, Bool[Array, ""]]:
    """Append `n_pages[b, k]` fresh pages to row `b`, head `k`, for every row at once.

    Row `b`, head `k` receives logical pages `extent[b, k] .. extent[b, k] + n_pages[b, k] - 1`.
    All-or-nothing over the whole batch: if any head lacks free pages for the total it is asked for,
    any row would exceed `max_pages`, or any count is negative, nothing changes and `ok` is False.

    Args:
      allocator: the per-head free stacks.
      tables: the batch's block tables.
      n_pages: `[B, K]` int, or anything broadcasting to it: `[K]` (every row), `[B, 1]` (every
        head) or a scalar. A bare `[B]` would broadcast as `[K]`; pass `n[:, None]`.

    Returns:
      `(allocator, tables, ok)`; `ok` is a scalar bool array.

    Raises:
      TypeError / ValueError: wrong types, or `n_pages` not broadcasting to `[B, K]`.
    """
    _check(allocator, tables)
    n = v_.as_int_array("n_pages", n_pages, tables.extent.shape, "B K")
    ok = can_alloc(allocator, tables, n)
    num_kv, num_pages = allocator.free_stack.shape
    kk = jnp.arange(num_kv, dtype=jnp.int32)[None, :, None]

    # Row b, head k takes pops number start[b, k] + i (i < n[b, k]) from the top of head k's stack.
    start = exclusive_prefix_sum(n)  # [B, K]
    rel = jnp.arange(tables.max_pages, dtype=jnp.int32) - tables.extent[..., None]  # [B, K, M]
    take = (rel >= 0) & (rel < n[..., None])
    depth = allocator.free_count[None, :, None] - 1 - (start[..., None] + rel)
    depth = jnp.where(take, jnp.clip(depth, 0, num_pages - 1), 0)
    page = allocator.free_stack[kk, depth]  # [B, K, M]
    new_tables = tables.replace(table=jnp.where(take, page, tables.table),
                                extent=tables.extent + n)
    owned = _scatter_rows(allocator.owned, kk, page, take, True)
    new_alloc = allocator.replace(free_count=allocator.free_count - jnp.sum(n, axis=0),
                                  owned=owned)
    new_alloc, new_tables = _select(ok, (new_alloc, new_tables), (allocator, tables))
    return new_alloc, new_tables, ok


def _row_mask(row, batch: int):
    """`[B]` one-hot of `row` (all False when out of range) and whether `row` is in range."""
    row = jnp.asarray(row)
    v_.check_integer("row", row)
    if row.ndim:
        raise ValueError(f"row must be a scalar batch index; got shape {row.shape}")
    mask = jnp.arange(batch, dtype=jnp.int32) == row
    return mask, (row >= 0) & (row < batch)


def alloc(
    allocator: PageAllocator, tables: BlockTables, row, n_pages
) -> tuple[PageAllocator, BlockTables, Bool[Array, ""]]:
    """Append `n_pages` pages per head to one row (one request); all-or-nothing.

    Args:
      allocator: the per-head free stacks.
      tables: the batch's block tables.
      row: scalar int batch row (may be traced); out of range gives `ok=False`.
      n_pages: int or `[K]` int, pages per head (0 for a head that needs none).

    Returns:
      `(allocator, tables, ok)`.

    Raises:
      TypeError / ValueError: wrong types or shapes.
    """
    _check(allocator, tables)
    mask, in_range = _row_mask(row, tables.batch_size)
    n = v_.as_int_array("n_pages", n_pages, (tables.num_kv_heads,), "K")
    n = jnp.where(mask[:, None], n[None, :], 0)
    new_alloc, new_tables, ok = alloc_batch(allocator, tables, n)
    ok = ok & in_range
    new_alloc, new_tables = _select(ok, (new_alloc, new_tables), (allocator, tables))
    return new_alloc, new_tables, ok


def _release(allocator: PageAllocator, table: Array, mask: Array):
    """Push the pages `table[mask]` back on their heads' stacks.

    Returns the new allocator and whether the release is valid: every page in range
    `[1, num_pages)`, owned, and listed once.
    """
    batch, num_kv, max_pages = table.shape
    num_pages = allocator.num_pages
    kk = jnp.arange(num_kv, dtype=jnp.int32)[None, :, None]
    in_range = (table >= 1) & (table < num_pages)
    # Owned count after the release: -1 somewhere means a page not owned or listed twice.
    # (-1 entries and garbage go to the trash column, never to an index.)
    left = _scatter_rows(allocator.owned.astype(jnp.int32), kk, table, mask & in_range, -1,
                         add=True)
    ok = jnp.all(~mask | in_range) & jnp.all(left >= 0)

    # Push order: row-major over (b, j) within each head. A stable sort moves the released
    # entries to the front in that order (a cumsum would lower to an O(n^2) reduce_window on CPU).
    m = mask.transpose(1, 0, 2).reshape(num_kv, batch * max_pages)
    pages = table.transpose(1, 0, 2).reshape(num_kv, batch * max_pages)
    order = jnp.argsort(~m, axis=1, stable=True)
    pushed = jnp.take_along_axis(pages, order, axis=1)
    count = jnp.sum(m, axis=1, dtype=jnp.int32)
    i = jnp.arange(batch * max_pages, dtype=jnp.int32)[None, :]
    k2 = jnp.arange(num_kv, dtype=jnp.int32)[:, None]
    stack = _scatter_rows(allocator.free_stack, k2, allocator.free_count[:, None] + i,
                          i < count[:, None], pushed)
    new = allocator.replace(
        free_stack=stack,
        free_count=allocator.free_count + count,
        owned=left > 0)
    return new, ok


def free_batch(
    allocator: PageAllocator, tables: BlockTables, rows: Bool[Array, "B"]  # noqa: F821
) -> tuple[PageAllocator, BlockTables, Bool[Array, ""]]:
    """Release every page of the rows marked in `rows` (finish / abort / preempt) and reset them.

    Freed rows get an all -1 table, extent 0 and cursor 0. Freeing a row that holds no page is a
    no-op that succeeds, so finishing twice is harmless. `ok` is False (and nothing changes) if a
    freed row lists a page that is out of range, not owned, or listed twice in one head (a
    corrupted table; a double free through two rows).

    Args:
      allocator: the per-head free stacks.
      tables: the batch's block tables.
      rows: `[B]` bool, rows to free.

    Returns:
      `(allocator, tables, ok)`.
    """
    _check(allocator, tables)
    rows = jnp.asarray(rows)
    v_.check_bool("rows", rows)
    v_.check_shape("rows", rows, (tables.batch_size,), "B")
    mask = rows[:, None, None] & (tables.table != UNALLOCATED)
    new_alloc, ok = _release(allocator, tables.table, mask)
    keep = ~rows[:, None]
    new_tables = tables.replace(
        table=jnp.where(rows[:, None, None], UNALLOCATED, tables.table),
        extent=jnp.where(keep, tables.extent, 0), cursor=jnp.where(keep, tables.cursor, 0))
    new_alloc, new_tables = _select(ok, (new_alloc, new_tables), (allocator, tables))
    return new_alloc, new_tables, ok


def free(
    allocator: PageAllocator, tables: BlockTables, row
) -> tuple[PageAllocator, BlockTables, Bool[Array, ""]]:
    """`free_batch` for one row (scalar int, may be traced); out of range gives `ok=False`."""
    _check(allocator, tables)
    mask, in_range = _row_mask(row, tables.batch_size)
    new_alloc, new_tables, ok = free_batch(allocator, tables, mask)
    ok = ok & in_range
    new_alloc, new_tables = _select(ok, (new_alloc, new_tables), (allocator, tables))
    return new_alloc, new_tables, ok


def _recycle_range(xp, extent, cursor, lengths, window, sinks, page_size: int):
    """The recycle rule in one place, for `jnp` (`recycle_bounds`) and `np` (the host twin).

    `lengths` broadcasts against `window` (`[B, 1]` on the device, a scalar per row on the host).
    """
    lo = xp.maximum((xp.maximum(sinks, 0) + page_size - 1) // page_size, cursor)
    hi = xp.minimum(xp.maximum(lengths - window, 0) // page_size, extent)
    hi = xp.where((window > 0) & (hi > lo), hi, lo)
    return lo, hi


def recycle_bounds(
    tables: BlockTables, lengths: Int[Array, "B"], window, sinks  # noqa: F821
) -> tuple[Int[Array, "B K"], Int[Array, "B K"]]:
    """Logical page range `[lo, hi)` per row and head that `recycle` would release now.

    `lo = max(ceil(sinks / P), cursor)`, `hi = min(max(lengths - window, 0) // P, extent)` for
    heads with `window > 0`; `hi = lo` (nothing) for full heads or when `hi < lo`.
    `recycle_bounds_host` is the same rule on NumPy arrays (a scheduler's host mirror).
    """
    batch, num_kv = tables.extent.shape
    lengths = v_.as_int_array("lengths", lengths, (batch,), "B")
    window = v_.as_int_array("window", window, (batch, num_kv), "B K")
    sinks = v_.as_int_array("sinks", sinks, (batch, num_kv), "B K")
    return _recycle_range(jnp, tables.extent, tables.cursor, lengths[:, None], window, sinks,
                          tables.page_size)


def recycle_bounds_host(
    extent: np.ndarray, cursor: np.ndarray, lengths, window: np.ndarray, sinks: np.ndarray, *,
    page_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """`recycle_bounds` on host NumPy arrays of any common shape (no device, no validation).

    A scheduler that mirrors the block tables on the host (`models.engine`) calls it with its
    copies of `extent` and `cursor`, so the mirror and `recycle` share one rule.

    Args:
      extent: allocated logical pages per head, any shape `S`.
      cursor: recycle cursor per head, shape `S`.
      lengths: tokens in the cache, broadcastable to `S` (e.g. a scalar for one row).
      window: `S`, window per head (`<= 0` full).
      sinks: `S`, sink tokens per head.
      page_size: `P`.

    Returns:
      `(lo, hi)` NumPy arrays of shape `S`; `hi == lo` where nothing is released.
    """
    return _recycle_range(np, np.asarray(extent), np.asarray(cursor), np.asarray(lengths),
                          np.asarray(window), np.asarray(sinks), page_size)


def recycle(
    allocator: PageAllocator,
    tables: BlockTables,
    lengths: Int[Array, "B"],  # noqa: F821
    *,
    window: Int[Array, "K"],  # noqa: F821
    sinks: Int[Array, "K"],  # noqa: F821
) -> tuple[PageAllocator, BlockTables, Bool[Array, ""]]:
    """Release the pages of sliding-window / streaming heads that no query can see any more.

    For a head with `window > 0`, logical pages `[lo, hi)` of `recycle_bounds` go back to that
    head's stack and their entries become -1; the cursor moves to `hi` (it never moves back, so a
    second call at the same length releases nothing). Sink pages `[0, ceil(sinks / P))` and every
    page from the one holding position `lengths - window` on stay. Heads with `window <= 0` (full)
    are untouched. Call it once the attention of every query below position `lengths - 1` has
    run, i.e. after the step (a chunked prefill must not recycle between its write and its
    attention); rows of length 0 release nothing.

    Args:
      allocator: the per-head free stacks.
      tables: the batch's block tables.
      lengths: `[B]` int, tokens in each row's cache.
      window: `[K]` or `[B, K]` int, window per head (per request for router-chosen modes);
        `<= 0` means a full head.
      sinks: `[K]` or `[B, K]` int, sink tokens per head.

    Returns:
      `(allocator, tables, ok)`; `ok` is False (nothing changes) only for a corrupted table.
    """
    _check(allocator, tables)
    lo, hi = recycle_bounds(tables, lengths, window, sinks)
    j = jnp.arange(tables.max_pages, dtype=jnp.int32)
    mask = (j >= lo[..., None]) & (j < hi[..., None]) & (tables.table != UNALLOCATED)
    new_alloc, ok = _release(allocator, tables.table, mask)
    new_tables = tables.replace(table=jnp.where(mask, UNALLOCATED, tables.table),
                                cursor=jnp.where(hi > lo, hi, tables.cursor))
    new_alloc, new_tables = _select(ok, (new_alloc, new_tables), (allocator, tables))
    return new_alloc, new_tables, ok


def kv_usage(pools: list[PagePool], allocators: list[PageAllocator]) -> dict:
    """Host-side accounting per layer and head (reads device arrays: not for a jitted step).

    Args:
      pools: one `PagePool` per attention layer.
      allocators: the matching allocators.

    Returns:
      dict with `pages` `[L, K]` and `bytes` `[L, K]` (numpy int64: pages in use and the bytes
      they occupy, keys + values + FP8 scales), `capacity_pages` `[L]`, `total_bytes` (int).
    """
    if len(pools) != len(allocators):
        raise ValueError(f"len(pools)={len(pools)} must equal len(allocators)={len(allocators)}")
    pages = np.stack([np.asarray(pages_in_use(a), np.int64) for a in allocators])
    per_page = np.asarray([page_bytes(p) for p in pools], np.int64)[:, None]
    used_bytes = pages * per_page
    return {"pages": pages, "bytes": used_bytes,
            "capacity_pages": np.asarray([a.capacity for a in allocators], np.int64),
            "total_bytes": int(used_bytes.sum())}
