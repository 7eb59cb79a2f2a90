"""Tile helpers shared by the Triton flash kernels: the dense forward and backward
(`attn/dense/triton.py`, `attn/dense/_flash_bwd.py`), the paged prefill
(`attn/dense/triton_paged.py`) and the block-sparse kernel (`attn/block_sparse/triton.py`).

Key positions `c` and query positions `p` are absolute; a key is visible when it is below the
row's length, inside the window or a sink, and (causal) not after the query. Tiles that every row
of a program sees whole skip the mask; `_key_tiles` splits a program's key range accordingly.
Non-finite values are handled only in the masked tiles (`_drop_nonfinite`): in a whole tile every
row sees every key, so a NaN there reaches every row of the tile, as it should.
"""

import jax.numpy as jnp
import triton
import triton.language as tl


@triton.jit
def _load(ptrs, rows_ok, cols_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A 2-D tile, masked only where it has to be (unmasked loads vectorise and pipeline best)."""
    if MASK_ROWS:
        x = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
    elif MASK_COLS:
        x = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _visible(c, p, kv_len, win, sinks, CAUSAL: tl.constexpr):
    """Key positions `c` visible to query positions `p` (broadcast against each other)."""
    vis = (c < kv_len) & ((c > p - win) | (c < sinks))
    if CAUSAL:
        vis = vis & (c <= p)
    return vis


@triton.jit
def _masked_softmax_step(qk, m, visible, SCALE_LOG2: tl.constexpr):
    """One online-softmax step over a tile some rows see only partly: `(p, alpha, m_new)`, with
    `p = 2^(s - m_new)` of the scaled scores `s` (-inf where not `visible`), `alpha` the rescale
    of the old sums, `m_new` the running max. A row that has seen nothing yet keeps p = 0 and
    alpha = 1 (its max stays -inf)."""
    s = tl.where(visible, qk * SCALE_LOG2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
    return tl.exp2(s - m_use[:, None]), tl.exp2(m - m_use), m_new


@triton.jit
def _whole_softmax_step(qk, m, SCALE_LOG2: tl.constexpr):
    """`_masked_softmax_step` for a tile every row sees whole: no mask, and the scale folds into
    the exponent's FMA."""
    m_new = tl.maximum(m, tl.max(qk, 1) * SCALE_LOG2)
    return tl.exp2(qk * SCALE_LOG2 - m_new[:, None]), tl.exp2(m - m_new), m_new


@triton.jit
def _key_tiles(q_lo, q_hi, kv_len, window, sinks, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key ranges (multiples of BLOCK_N) of a query tile at positions `[q_lo, q_hi]`.

    Returns `win, sink_end, main_lo, full_lo, full_hi, end`: masked `[0, sink_end)` (sinks),
    masked `[main_lo, full_lo)` (window edge), unmasked `[full_lo, full_hi)`, masked
    `[full_hi, end)` (diagonal and length tail). `win` is the window, or 2^30 for none.
    """
    if CAUSAL:
        kv_end = tl.maximum(tl.minimum(q_hi + 1, kv_len), 0)
        full_hi = tl.maximum(tl.minimum(q_lo + 1, kv_len), 0) // BLOCK_N * BLOCK_N
    else:
        kv_end = kv_len
        full_hi = kv_len // BLOCK_N * BLOCK_N
    end = tl.cdiv(kv_end, BLOCK_N) * BLOCK_N
    has_win = window > 0  # the wrapper gives non-causal calls no window
    win = tl.where(has_win, window, 1 << 30)
    sink_end = tl.where(has_win, tl.cdiv(tl.minimum(sinks, kv_end), BLOCK_N) * BLOCK_N, 0)
    win_lo = tl.where(has_win, tl.maximum(q_lo - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    main_lo = tl.minimum(tl.maximum(win_lo, sink_end), end)
    full_lo = tl.where(has_win, tl.cdiv(tl.maximum(q_hi - window + 1, 0), BLOCK_N) * BLOCK_N, 0)
    full_lo = tl.minimum(tl.maximum(full_lo, main_lo), end)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), end)
    return win, sink_end, main_lo, full_lo, full_hi, end


@triton.jit
def _drop_nonfinite(v):
    """Zero the non-finite entries of a value tile `v` `[BLOCK_N, BLOCK_HV]` of a masked tile,
    where a 0 weight would still make `0 * NaN` in the rows that do not see the key. Returns
    `(v, key_bad)`: `key_bad` `[BLOCK_N]` marks the keys whose value is not finite. The caller
    makes the weights of the visible bad keys NaN (so the `P V` product makes exactly the rows
    that see such a value NaN, as in the reference) and runs this before the score tile exists:
    the `[BLOCK_N, BLOCK_HV]` check is dead by then and only `key_bad` stays live."""
    v_bad = ~(tl.abs(v.to(tl.float32)) < float("inf"))  # [BLOCK_N, BLOCK_HV]
    key_bad = tl.max(v_bad.to(tl.int32), 1) > 0  # [BLOCK_N]
    return tl.where(v_bad, 0.0, v), key_bad


def wide_rows(head_dim: int, value_head_dim: int | None = None, itemsize: int = 2) -> bool:
    """Whether a Q / K / V row is over 256 bytes (`itemsize`: the element size), where the Hopper
    tiles of 128 keys and 3 stages no longer fit in shared memory."""
    return max(head_dim, value_head_dim or head_dim) * itemsize > 256


def wide_rows_query_tile(head_dim: int, value_head_dim: int | None = None,
                         itemsize: int = 2) -> int:
    """Query rows a forward program of the wide-rows tiles owns: 128, or 64 where a row is over
    512 bytes (float32 at H256: 128 rows with two stages of 32 keys need 240 KiB)."""
    return 64 if max(head_dim, value_head_dim or head_dim) * itemsize > 512 else 128


def _shapes(q, k, v):
    """The launch constants of the dense kernels for q `[B, T, N, H]`, k `[B, S, K, H]`,
    v `[B, S, K, Hv]`."""
    b, t, n, h = q.shape
    s, kh, hv = k.shape[1], k.shape[2], v.shape[-1]
    return dict(B=b, T=t, S=s, K=kh, G=n // kh, H=h, HV=hv,
                BLOCK_H=max(16, triton.next_power_of_2(h)),
                BLOCK_HV=max(16, triton.next_power_of_2(hv)),
                PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")
