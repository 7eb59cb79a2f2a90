"""The engine's host side: slots, admission, preemption, and a NumPy mirror of the page accounting.

The scheduler holds every count: which request sits in which slot, how many of its tokens are
cached, and a mirror of every paged layer's page accounting (extent, recycle cursor, free pages
per head; `PageMirror`), so it knows before a step whether the pools can hold it; no device
value is read inside or before a step. The mirror applies the allocator's own rules: `alloc_batch`
grows a row to `ceil(length / P)` pages, and the recycle range is `kv.recycle_bounds_host`, the
host twin of the `kv.recycle_bounds` the step runs (one rule, tested equal in
`tests/kv/test_allocator.py`).

When the pools cannot hold a step, the most recently admitted request is preempted: its pages are
freed and its slots reset on the device (one jitted call), and it goes back to the front of the
queue with prompt + generated tokens as its new prompt, recomputed when pages free up. GDN state
needs no scheduling: every row owns its slot.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

import numpy as np

import kv
from models.engine.requests import Request


class PageMirror:
    """Host copy of the block tables' page accounting, per slot, paged layer and head.

    Attributes:
      extent, cursor, released: `[B, Lp, K]` int64 allocated logical pages, recycle cursor, and
        pages given back by recycling, per row.
      free_count: `[Lp, K]` int64 free pages per head.
    """

    def __init__(self, *, batch_slots: int, num_paged: int, num_kv_heads: int, num_pages: int,
                 page_size: int):
        shape = (batch_slots, num_paged, num_kv_heads)
        self.page_size, self.num_pages = page_size, num_pages
        self.extent = np.zeros(shape, np.int64)
        self.cursor = np.zeros(shape, np.int64)
        self.released = np.zeros(shape, np.int64)
        self.free_count = np.full(shape[1:], num_pages - 1, np.int64)

    def demand(self, row: int, new_len: int) -> np.ndarray:
        """Pages `[Lp, K]` the row must allocate to reach `new_len` tokens."""
        return np.maximum(-(-new_len // self.page_size) - self.extent[row], 0)

    def commit(self, row: int, new_len: int, window: np.ndarray, sinks: np.ndarray) -> None:
        """Mirror `alloc_batch` then `recycle` for one row growing to `new_len` tokens under its
        `[Lp, K]` window and sinks."""
        n = self.demand(row, new_len)
        self.extent[row] += n
        self.free_count -= n
        lo, hi = kv.recycle_bounds_host(self.extent[row], self.cursor[row], new_len, window,
                                        sinks, page_size=self.page_size)
        self.released[row] += hi - lo
        self.free_count += hi - lo
        self.cursor[row] = np.where(hi > lo, hi, self.cursor[row])

    def release(self, row: int) -> None:
        """Mirror `free_batch` for one row."""
        self.free_count += self.extent[row] - self.released[row]
        self.extent[row] = self.cursor[row] = self.released[row] = 0

    def held(self) -> np.ndarray:
        """Pages `[B, Lp, K]` each row holds."""
        return self.extent - self.released

    def check(self, tables: kv.BlockTables, allocator: kv.PageAllocator) -> None:
        """Check device block tables and allocator against the mirror, entry by entry (see
        `Engine.check_page_tables`).

        Raises:
          AssertionError: naming the first slot / layer / head that differs.
        """
        b, lp, k = self.extent.shape
        table = np.asarray(tables.table).reshape(b, lp, k, -1)
        extent = np.asarray(tables.extent).reshape(b, lp, k)
        cursor = np.asarray(tables.cursor).reshape(b, lp, k)
        owned = np.asarray(allocator.owned).reshape(lp, k, -1)
        free = np.asarray(allocator.free_count).reshape(lp, k)
        for name, dev, host in (("extent", extent, self.extent), ("cursor", cursor, self.cursor),
                                ("free_count", free, self.free_count)):
            if not np.array_equal(dev, host):
                where = tuple(int(i) for i in np.argwhere(dev != host)[0])
                raise AssertionError(f"{name} at {where}: device {dev[where]} != host mirror "
                                     f"{host[where]}")
        j = np.arange(table.shape[-1])
        held = ((j < self.extent[..., None])
                & ~((j >= (self.cursor - self.released)[..., None])
                    & (j < self.cursor[..., None])))  # [B, Lp, K, M]
        ok = np.where(held, (table >= 1) & (table < self.num_pages), table == kv.UNALLOCATED)
        if not ok.all():
            where = tuple(int(i) for i in np.argwhere(~ok)[0])
            raise AssertionError(f"table entry (slot, paged layer, head, page) {where} = "
                                 f"{table[where]}; held by the mirror: {bool(held[where])}")
        for layer in range(lp):
            for head in range(k):
                ids = table[:, layer, head][held[:, layer, head]]
                mine = np.zeros(self.num_pages, bool)
                mine[ids] = True
                if len(np.unique(ids)) != len(ids) or not np.array_equal(mine, owned[layer, head]):
                    raise AssertionError(f"paged layer {layer}, head {head}: held ids "
                                         f"{sorted(ids.tolist())} vs owned "
                                         f"{np.flatnonzero(owned[layer, head]).tolist()}")


class Scheduler:
    """Slots, the waiting queue, per-slot effective policies and the page mirror (host only).

    Args:
      batch_slots: `B`.
      num_layers: `L` (every model layer; policies are `[L, K]`).
      paged_layers: model indices of the paged layers.
      num_kv_heads: `K`.
      num_pages, page_size: of every paged layer's pool.
      free_rows: frees rows (a list of slot indices) on the device: their pages and slots.
      stats: the engine's counters; `"preemptions"` is counted here.

    Attributes:
      slots: the request in each slot, or None.
      waiting: queued requests, the next one first.
      finished: finished requests in finishing order.
      window, sinks: `[B, L, K]` int32 effective policy of each slot's request.
      mirror: the `PageMirror`.
    """

    def __init__(self, *, batch_slots: int, num_layers: int, paged_layers: tuple[int, ...],
                 num_kv_heads: int, num_pages: int, page_size: int,
                 free_rows: Callable[[list[int]], None], stats: dict):
        self.batch_slots = batch_slots
        self.paged_index = np.asarray(paged_layers)
        self.mirror = PageMirror(batch_slots=batch_slots, num_paged=len(paged_layers),
                                 num_kv_heads=num_kv_heads, num_pages=num_pages,
                                 page_size=page_size)
        self.window = np.zeros((batch_slots, num_layers, num_kv_heads), np.int32)
        self.sinks = np.zeros_like(self.window)
        self.slots: list[Request | None] = [None] * batch_slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.finished: list[Request] = []
        self._admitted = itertools.count()
        self._order = [0] * batch_slots  # admission order of the slot's request
        self._free_rows = free_rows
        self._stats = stats

    @property
    def idle(self) -> bool:
        return not self.waiting and all(s is None for s in self.slots)

    def set_policy(self, row: int, window: np.ndarray, sinks: np.ndarray) -> None:
        """The effective `[L, K]` policy of the slot's request from now on."""
        self.window[row], self.sinks[row] = window, sinks

    def commit(self, row: int, new_len: int) -> None:
        """Mirror the step that grew the row to `new_len` tokens."""
        self.mirror.commit(row, new_len, self.window[row][self.paged_index],
                           self.sinks[row][self.paged_index])

    def free(self, rows: list[int]) -> None:
        """Free the rows' pages and slots on the device and in the mirror."""
        if rows:
            self._free_rows(rows)
            for r in rows:
                self.mirror.release(r)

    def preempt(self, row: int) -> None:
        """Send the row's request back to the front of the queue, to be recomputed."""
        req = self.slots[row]
        req.preemptions += 1
        req.cached = 0
        req.decisions = None  # re-routed when its prompt is prefilled again
        self._stats["preemptions"] += 1
        self.slots[row] = None
        self.free([row])
        self.waiting.appendleft(req)

    def plan(self, work: Callable[[Request], int],
             effective: Callable[[Request], tuple[np.ndarray, np.ndarray]]) -> dict[int, int]:
        """Admit waiting requests, size this step's work per slot (`work(request)` tokens),
        preempt the latest admitted until the pools hold it.

        Returns:
          `{row: tokens}` of the active rows (empty when nothing runs).

        Raises:
          RuntimeError: a single request needs more pages than a head has.
        """
        for row in range(self.batch_slots):
            if self.slots[row] is None and self.waiting:
                req = self.waiting.popleft()
                self.slots[row] = req
                req.row = row
                self._order[row] = next(self._admitted)
                self.set_policy(row, *effective(req))
        while True:
            active = [r for r in range(self.batch_slots) if self.slots[r] is not None]
            if not active:
                return {}
            sizes = {r: work(self.slots[r]) for r in active}
            need = sum(self.mirror.demand(r, self.slots[r].cached + sizes[r]) for r in active)
            if np.all(need <= self.mirror.free_count):
                return sizes
            if len(active) == 1:
                raise RuntimeError(
                    f"KV pools too small: one request needs {need.max()} more pages in a head "
                    f"with {self.mirror.free_count.min()} free "
                    f"(num_pages={self.mirror.num_pages})")
            self.preempt(max(active, key=lambda r: self._order[r]))


__all__ = ["PageMirror", "Scheduler"]
