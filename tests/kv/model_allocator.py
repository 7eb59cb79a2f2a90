"""A small pure-Python model of the per-head page allocator, the oracle of the property tests.

It keeps Python lists (one LIFO free stack per head, one list of logical page entries per row and
head) and follows the documented policy of `kv/allocator.py` step by step. The streaming release is
computed by brute force from the conventions' visibility rule (a page goes iff none of its
positions is a sink or inside the window of any query at position >= length - 1), not from the
closed form the implementation uses.
"""

from __future__ import annotations

import numpy as np


class ModelAllocator:
    """Per-head free stacks + block tables, all-or-nothing operations returning `ok`."""

    def __init__(self, *, num_kv_heads: int, num_pages: int, batch_size: int, max_pages: int,
                 page_size: int):
        self.K, self.num_pages, self.B = num_kv_heads, num_pages, batch_size
        self.M, self.P = max_pages, page_size
        self.stacks = [list(range(num_pages - 1, 0, -1)) for _ in range(num_kv_heads)]
        self.rows = [[[] for _ in range(num_kv_heads)] for _ in range(batch_size)]
        self.cursor = np.zeros((batch_size, num_kv_heads), np.int64)
        # Longest length each row was recycled at since it was last freed: lengths are monotone
        # for a real request, the random sequences are not, so visibility is judged against this.
        self.high = np.zeros((batch_size,), np.int64)

    # Operations ---------------------------------------------------------------------------------

    def alloc_batch(self, n) -> bool:
        n = np.broadcast_to(np.asarray(n), (self.B, self.K))
        if (n < 0).any():
            return False
        for k in range(self.K):
            if n[:, k].sum() > len(self.stacks[k]):
                return False
        for b in range(self.B):
            for k in range(self.K):
                if len(self.rows[b][k]) + n[b, k] > self.M:
                    return False
        for k in range(self.K):
            for b in range(self.B):
                for _ in range(n[b, k]):
                    self.rows[b][k].append(self.stacks[k].pop())
        return True

    def alloc(self, row: int, n) -> bool:
        if not 0 <= row < self.B:
            return False
        full = np.zeros((self.B, self.K), np.int64)
        full[row] = np.broadcast_to(np.asarray(n), (self.K,))
        return self.alloc_batch(full)

    def free_batch(self, rows) -> bool:
        for k in range(self.K):
            for b in range(self.B):
                if rows[b]:
                    self.stacks[k].extend(p for p in self.rows[b][k] if p != -1)
        for b in range(self.B):
            if rows[b]:
                self.rows[b] = [[] for _ in range(self.K)]
                self.cursor[b] = 0
                self.high[b] = 0
        return True

    def free(self, row: int) -> bool:
        if not 0 <= row < self.B:
            return False
        return self.free_batch([b == row for b in range(self.B)])

    def releasable(self, b: int, k: int, length: int, window: int, sinks: int) -> list[int]:
        """Logical pages of (b, k) that no query at a position >= length - 1 can see."""
        if window <= 0:
            return []
        out = []
        for j, page in enumerate(self.rows[b][k]):
            if page == -1:
                continue
            positions = range(j * self.P, (j + 1) * self.P)
            # Visible to some q >= length - 1: a sink, or inside q's window for some such q.
            if not any(s < sinks or s > length - 1 - window for s in positions):
                out.append(j)
        return out

    def recycle(self, lengths, window, sinks) -> bool:
        window = np.broadcast_to(np.asarray(window), (self.B, self.K))
        sinks = np.broadcast_to(np.asarray(sinks), (self.B, self.K))
        self.high = np.maximum(self.high, lengths)
        for k in range(self.K):
            for b in range(self.B):
                for j in self.releasable(b, k, lengths[b], window[b, k], sinks[b, k]):
                    self.stacks[k].append(self.rows[b][k][j])
                    self.rows[b][k][j] = -1
                    self.cursor[b, k] = max(self.cursor[b, k], j + 1)
        return True

    def pages_needed(self, lengths) -> np.ndarray:
        need = np.zeros((self.B, self.K), np.int64)
        for b in range(self.B):
            for k in range(self.K):
                need[b, k] = max(-(-lengths[b] // self.P) - len(self.rows[b][k]), 0)
        return need

    # Views --------------------------------------------------------------------------------------

    def table(self) -> np.ndarray:
        out = np.full((self.B, self.K, self.M), -1, np.int64)
        for b in range(self.B):
            for k in range(self.K):
                out[b, k, :len(self.rows[b][k])] = self.rows[b][k]
        return out

    def extent(self) -> np.ndarray:
        return np.array([[len(r) for r in row] for row in self.rows], np.int64)

    def free_count(self) -> np.ndarray:
        return np.array([len(s) for s in self.stacks], np.int64)
