"""Edge-grid problems of the paged (and gathered) attention ops, and small float64 numpy references.

Shared by `test_paged_edges.py` (XLA == Triton == numpy, interpreted on CPU, compiled with
`-m gpu`) and `sanitize_paged_kernels.py` (the same kernels under `compute-sanitizer`).

One problem holds every edge in its rows (`ROWS`): lengths 0, P - 1, P, P + 1 and past the table;
a -1 hole inside the visible range, an id equal to `num_pages` inside it, a -1 hole outside a
window. Ids are drawn from `[1, OWNED)`, so pages `OWNED..num_pages - 1` and the null page 0 are
unowned: they hold NaN, and so does the last page, which a clamping gather of the id `num_pages`
would read. The numpy references implement the semantics from their definition (a key is visible
iff it lies below the length and inside the table, its page id is in `[0, num_pages)`, and the
window / sinks / causal rules keep it), one key at a time in float64, NaN propagating as numpy's
max, exp and sums propagate it; they never look at the library's code.
"""

from __future__ import annotations

import math

import numpy as np

P = 16  # page size
M = 3  # table columns: capacity M * P = 48 tokens
NUM_PAGES = 12
OWNED = 9  # ids are drawn from [1, OWNED); pages OWNED.. and 0 are unowned (NaN)
K = 2
G = 2
H = 16
HV = 16
T = 3  # prefill chunk
SCALE = 0.3

# (name, length, table columns as "a", "b", "c" for distinct owned pages, -1, or "out" for the id
# num_pages; window, sinks per head (window <= 0: full))
ROWS = [
    ("len0", 0, ["a", -1, -1], (0, 0), (0, 0)),
    ("lenP-1", P - 1, ["a", -1, -1], (0, 0), (0, 0)),
    ("lenP", P, ["a", -1, -1], (0, 6), (0, 2)),
    ("lenP+1", P + 1, ["a", "b", -1], (0, 5), (0, 2)),
    ("past-table", M * P + 5, ["a", "b", "c"], (20, 0), (0, 0)),
    ("hole-inside", 40, ["a", -1, "c"], (0, 0), (0, 0)),
    ("id=num_pages", 40, ["a", "out", "c"], (0, 12), (0, 3)),
    ("hole-outside-window", 40, [-1, "b", "c"], (10, 10), (0, 0)),
]
B = len(ROWS)


def tables(gen: np.random.Generator, num_kv: int = K) -> np.ndarray:
    """`[B, num_kv, M]` int32 per-head tables of `ROWS` (fresh page ids per head and row)."""
    out = np.full((B, num_kv, M), -1, np.int32)
    for r, (_, _, cols, _, _) in enumerate(ROWS):
        for k in range(num_kv):
            ids = dict(zip("abc", gen.choice(np.arange(1, OWNED), 3, replace=False)))
            ids["out"] = NUM_PAGES
            out[r, k] = [ids[c] if isinstance(c, str) else c for c in cols]
    return out


def lengths() -> np.ndarray:
    return np.array([row[1] for row in ROWS], np.int32)


def windows_sinks(num_kv: int = K) -> tuple[np.ndarray, np.ndarray]:
    """`[B, num_kv]` int32 windows and sinks."""
    w = np.array([row[3][:num_kv] for row in ROWS], np.int32)
    s = np.array([row[4][:num_kv] for row in ROWS], np.int32)
    return w, s


def poison_unowned(pages: np.ndarray, table: np.ndarray) -> np.ndarray:
    """NaN in every page of `pages [K, num_pages, ...]` no in-range table entry names."""
    pages = pages.copy()
    owned = np.zeros(pages.shape[:2], bool)
    for k in range(pages.shape[0]):
        ids = table[:, k].ravel()
        owned[k, ids[(ids >= 0) & (ids < pages.shape[1])]] = True
    pages[~owned] = np.nan
    return pages


def nan_at(pages: np.ndarray, table: np.ndarray, row: int, head: int, pos: int) -> np.ndarray:
    """`pages` with the token at position `pos` of `row` (KV head `head`) set to NaN."""
    pages = pages.copy()
    pages[head, table[row, head, pos // P], pos % P] = np.nan
    return pages


def _attend(q: np.ndarray, keys: list[np.ndarray], values: list[np.ndarray]):
    """float64 softmax attention of one query over (at least one) explicit keys: (out, lse)."""
    k, v = np.stack(keys), np.stack(values)
    s = k @ q
    m = np.max(s)  # NaN if any score is
    p = np.exp(s - m)
    l = np.sum(p)
    return (p @ v) / l, m + np.log(l)


def _visible(s: int, q_pos: int, length: int, page_id: int, num_pages: int, window: int,
             sinks: int) -> bool:
    if s >= length or not 0 <= page_id < num_pages:
        return False
    if s > q_pos:
        return False
    return window <= 0 or s > q_pos - window or s < sinks


def np_paged_decode(q, k_pages, v_pages, table, lens, window, sinks, scale):
    """Numpy paged decode: `(out [B, N, Hv], lse [B, N])` float64."""
    b_, n, _ = q.shape
    num_kv, num_pages, p, _ = k_pages.shape
    g = n // num_kv
    out = np.zeros((b_, n, v_pages.shape[-1]))
    lse = np.zeros((b_, n))
    for b in range(b_):
        for h in range(n):
            kh = h // g
            keys, values = [], []
            for s in range(min(int(lens[b]), table.shape[2] * p)):
                pid = int(table[b, kh, s // p])
                if _visible(s, int(lens[b]) - 1, int(lens[b]), pid, num_pages,
                            int(window[b, kh]), int(sinks[b, kh])):
                    keys.append(k_pages[kh, pid, s % p].astype(np.float64) * scale)
                    values.append(v_pages[kh, pid, s % p].astype(np.float64))
            if not keys:
                out[b, h], lse[b, h] = 0.0, -math.inf
                continue
            out[b, h], lse[b, h] = _attend(q[b, h].astype(np.float64), keys, values)
    return out, lse


def np_paged_prefill(q, k_pages, v_pages, table, q_offset, kv_lens, window, sinks, scale):
    """Numpy chunked prefill over pages: `(out [B, T, N, Hv], lse [B, T, N])` float64."""
    b_, t_, n, _ = q.shape
    num_kv, num_pages, p, _ = k_pages.shape
    g = n // num_kv
    out = np.zeros((b_, t_, n, v_pages.shape[-1]))
    lse = np.full((b_, t_, n), -math.inf)
    for b in range(b_):
        for t in range(t_):
            q_pos = max(int(q_offset[b]), 0) + t
            for h in range(n):
                kh = h // g
                keys, values = [], []
                for s in range(min(int(kv_lens[b]), table.shape[2] * p)):
                    pid = int(table[b, kh, s // p])
                    if _visible(s, q_pos, int(kv_lens[b]), pid, num_pages, int(window[b, kh]),
                                int(sinks[b, kh])):
                        keys.append(k_pages[kh, pid, s % p].astype(np.float64) * scale)
                        values.append(v_pages[kh, pid, s % p].astype(np.float64))
                if keys:
                    out[b, t, h], lse[b, t, h] = _attend(q[b, t, h].astype(np.float64), keys,
                                                         values)
    return out, lse


def np_mla_decode(q_lat, q_pe, latent, table, lens, kv_lora_rank, scale):
    """Numpy absorbed MLA decode: `(o_lat [B, N, L], lse [B, N])` float64; `table [B, M]`."""
    b_, n, l = q_lat.shape
    num_pages, p, _ = latent.shape
    out = np.zeros((b_, n, l))
    lse = np.full((b_, n), -math.inf)
    for b in range(b_):
        keys, values = [], []
        for s in range(min(int(lens[b]), table.shape[1] * p)):
            pid = int(table[b, s // p])
            if _visible(s, int(lens[b]) - 1, int(lens[b]), pid, num_pages, 0, 0):
                keys.append(latent[pid, s % p].astype(np.float64) * scale)
                values.append(latent[pid, s % p, :kv_lora_rank].astype(np.float64))
        if not keys:
            continue
        for h in range(n):
            qh = np.concatenate([q_lat[b, h], q_pe[b, h]]).astype(np.float64)
            out[b, h], lse[b, h] = _attend(qh, keys, values)
    return out, lse


def np_block_sparse(q, k, v, modes, q_lens, kv_lens, block_size, sink_blocks, local_blocks,
                    scale):
    """Numpy block-sparse prefill with full (0) and streaming (-1) heads, lengths clamped to
    `[0, T]` / `[0, S]`: `(out [B, T, N, Hv], lse [B, T, N])` float64."""
    b_, t_, n, _ = q.shape
    s_, num_kv = k.shape[1], k.shape[2]
    g = n // num_kv
    out = np.zeros((b_, t_, n, v.shape[-1]))
    lse = np.full((b_, t_, n), -math.inf)
    for b in range(b_):
        ql = min(max(int(q_lens[b]), 0), t_)
        kl = min(max(int(kv_lens[b]), 0), s_)
        shift = -((ql - kl) // block_size)  # ceil((kl - ql) / bs), exact for negatives
        last = -((-kl) // block_size) - 1
        for t in range(ql):
            d = min(t // block_size + shift, last)
            pos = kl - ql + t
            for h in range(n):
                keys, values = [], []
                for s in range(kl):
                    j = s // block_size
                    if s > pos or j > d:
                        continue
                    if modes[b, h] == -1 and not (j > d - local_blocks or j < sink_blocks):
                        continue
                    keys.append(k[b, s, h // g].astype(np.float64) * scale)
                    values.append(v[b, s, h // g].astype(np.float64))
                if keys:
                    out[b, t, h], lse[b, t, h] = _attend(q[b, t, h].astype(np.float64), keys,
                                                         values)
    return out, lse


def assert_agree(name: str, actual, expected, *, atol: float = 1e-4, rtol: float = 1e-4):
    """Same NaN pattern, same -inf pattern, no +inf, finite values within tolerance."""
    a = np.asarray(actual, np.float64)
    e = np.asarray(expected, np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != {e.shape}"
    for what, fa, fe in (("NaN", np.isnan(a), np.isnan(e)),
                         ("-inf", np.isneginf(a), np.isneginf(e)),
                         ("+inf", np.isposinf(a), np.isposinf(e))):
        if (fa != fe).any():
            idx = tuple(int(i) for i in np.argwhere(fa != fe)[0])
            raise AssertionError(f"{name}: {what} pattern differs at {idx}: {a[idx]} vs {e[idx]}")
    finite = np.isfinite(e)
    np.testing.assert_allclose(a[finite], e[finite], atol=atol, rtol=rtol, err_msg=name)
