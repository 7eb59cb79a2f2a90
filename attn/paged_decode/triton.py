"""Triton paged decode: one query token per sequence over head-major pages and per-head tables.

One program handles all `G` query heads of one KV head of one sequence, over one split of that
head's visible keys, so each K/V page is read from HBM once per (sequence, KV head). The visible
keys of a head are `[0, sink_end) ∪ [win_start, length)`: a streaming head walks only the
`BLOCK_N`-aligned tiles that hold its sink and window tokens, so its time shrinks with what it
reads, not just what it masks. When a tile lies in one page (`P % BLOCK_N == 0`) its page id is
read once and the tile loaded as one contiguous block; otherwise (small pages) keys are gathered
token by token through the block table. Bounds come from the table and the pool, never from
positions alone: the walk stops at `min(length, MAX_PAGES * P)` (no table entry past the row is
read; a longer length keeps its query position for the window), and a page id outside
`[0, NUM_PAGES)` (-1, or garbage) is an absent page: its tokens are masked and their K / V / scale
loads too, so no address outside the pool is formed into a load. FP8
pages are dequantised in the kernel: the K scale multiplies the score columns and the V scale the
probabilities, so the tiles go to the tensor cores unscaled.

Partial results `[B, N, splits, Hv]` and their log-sum-exp are merged by `attn.merge`.

Supports: GQA with any group size (queries padded to 16 rows for the tensor cores), page sizes
that are powers of two, any head dims (padded and masked), bf16 / f16 / f32 and fp8-e4m3 pages.
Not supported: several query tokens per sequence (speculative decoding).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn._harness import triton_call
from attn._op import device_facts

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration; tile sizes are data, chosen by `default_config`."""

    block_n: int = 64
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    # FP8 tiles widen to this dtype for the tensor cores. e4m3 -> f16 is one conversion
    # instruction on Hopper; e4m3 -> bf16 is not.
    fp8_compute: str = "float16"
    # When a tile lies inside one page (P % block_n == 0), read its page id once and load the
    # tile as one contiguous block; False gathers token by token (any page size).
    page_tiles: bool = True

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"{self.block_n=} must be a power of two >= 16")
        if self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")
        if self.fp8_compute not in ("float16", "bfloat16"):
            raise ValueError(f"{self.fp8_compute=} must be 'float16' or 'bfloat16'")


def row_bytes(k_pages, v_pages) -> int:
    """Bytes of the wider of a K and a V row in their pools (`default_config`'s `row_bytes`)."""
    return max(k_pages.shape[-1] * jnp.dtype(k_pages.dtype).itemsize,
               v_pages.shape[-1] * jnp.dtype(v_pages.dtype).itemsize)


def default_config(batch: int, num_kv_heads: int, max_len: int, *, fp8: bool = False,
                   row_bytes: int = 256) -> Config:
    """Tiles measured best on the H100 (`python -m experiments.tools.sweep paged_decode`), the
    same for every group size
    (queries pad to 16 rows): bf16 128-token tiles with 4 warps; fp8 64-token tiles with 2 warps
    (half the bytes per tile, so fewer threads keep the loads in flight); splits so that about
    4 programs per SM are in flight. K / V rows over 512 bytes (`row_bytes`: float32 pages at
    H256) take 64-token tiles: two stages of 128 need 280 KiB of shared memory.
    """
    programs = batch * num_kv_heads
    splits = max(1, min(32, -(-4 * device_facts().num_sms // programs), max(1, max_len // 1024)))
    if fp8:
        return Config(block_n=64, num_warps=2, num_splits=splits)
    return Config(block_n=128 if row_bytes <= 512 else 64, num_warps=4, num_splits=splits)


@triton.jit
def _paged_decode_kernel(
    q_ptr,  # [B, K, G, H]
    k_ptr,  # [K, NUM_PAGES, P, H]
    v_ptr,  # [K, NUM_PAGES, P, HV]
    table_ptr,  # [B, K, MAX_PAGES] int32
    len_ptr,  # [B] int32
    window_ptr,  # [B, K] int32, <= 0: full
    sink_ptr,  # [B, K] int32
    k_scale_ptr,  # [K, NUM_PAGES, P // SUB] f32 (unused unless FP8)
    v_scale_ptr,  # [K, NUM_PAGES, P // SUB] f32 (unused unless FP8)
    o_ptr,  # [B, K, G, SPLITS, HV] f32
    lse_ptr,  # [B, K, G, SPLITS] f32
    SCALE_LOG2: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    P: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    MAX_PAGES: tl.constexpr,
    SPLITS: tl.constexpr,
    SUB: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGE_TILES: tl.constexpr,
):
    b = tl.program_id(0)
    kh = tl.program_id(1)
    split = tl.program_id(2)

    length = tl.maximum(tl.load(len_ptr + b), 0)
    kv_end = tl.minimum(length, MAX_PAGES * P)  # keys past the table do not exist
    window = tl.load(window_ptr + b * K + kh)
    sinks = tl.load(sink_ptr + b * K + kh)
    # The window counts back from the query at length - 1, even where that lies past the table.
    win_start = tl.minimum(tl.where(window > 0, tl.maximum(length - window, 0), 0), kv_end)
    sink_end = tl.minimum(tl.maximum(sinks, 0), win_start)
    # Tiles of BLOCK_N positions, aligned to BLOCK_N: the sink tiles, then the window's from the
    # first tile past the sinks' (a tile holding both is visited once, as a sink tile).
    sink_tiles = tl.cdiv(sink_end, BLOCK_N)
    win_tile0 = tl.maximum(win_start // BLOCK_N, sink_tiles)
    tiles = sink_tiles + tl.maximum(tl.cdiv(kv_end, BLOCK_N) - win_tile0, 0)
    per_split = tl.cdiv(tiles, SPLITS)
    t_lo = split * per_split
    t_hi = tl.minimum(t_lo + per_split, tiles)

    offs_g = tl.arange(0, BLOCK_G)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < G
    mask_h = offs_h < H
    mask_hv = offs_hv < HV

    q_row = (b * K + kh) * G
    q = tl.load(  # [BLOCK_G, BLOCK_H]
        q_ptr + (q_row + offs_g)[:, None] * H + offs_h[None, :],
        mask=mask_g[:, None] & mask_h[None, :],
        other=0.0,
    )
    table_row = table_ptr + (b * K + kh) * MAX_PAGES

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_HV], tl.float32)
    for t in range(t_lo, t_hi):
        start = tl.where(t < sink_tiles, t, win_tile0 + t - sink_tiles) * BLOCK_N
        pos = start + offs_n  # [BLOCK_N] key positions
        valid = (pos < sink_end) | ((pos >= win_start) & (pos < kv_end))
        if PAGE_TILES:  # the tile lies in one page: one table entry, a contiguous block
            page = tl.load(table_row + start // P)  # start < kv_end <= MAX_PAGES * P
            present = (page >= 0) & (page < NUM_PAGES)
            valid = valid & present
            page = tl.where(present, page, 0)  # absent: the null page's address, loads masked
            row = (kh * NUM_PAGES + page).to(tl.int64) * P + start % P + offs_n
        else:
            page = tl.load(table_row + pos // P, mask=valid, other=-1)
            present = (page >= 0) & (page < NUM_PAGES)
            valid = valid & present
            page = tl.where(present, page, 0)
            row = (kh * NUM_PAGES + page).to(tl.int64) * P + pos % P  # [BLOCK_N] token rows
        k = tl.load(  # [BLOCK_N, BLOCK_H]
            k_ptr + row[:, None] * H + offs_h[None, :],
            mask=valid[:, None] & mask_h[None, :],
            other=0.0,
        )
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)  # [BLOCK_G, BLOCK_N]
        if FP8:
            srow = row // SUB  # [K, NUM_PAGES, P // SUB] scales: one per SUB token rows
            s = s * tl.load(k_scale_ptr + srow, mask=valid, other=0.0)[None, :]
        s = tl.where(valid[None, :], s * SCALE_LOG2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen nothing yet (e.g. a split starting on an absent page) keeps p = 0
        # and alpha = 1 instead of 2^(-inf - -inf) = NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(  # [BLOCK_N, BLOCK_HV]
            v_ptr + row[:, None] * HV + offs_hv[None, :],
            mask=valid[:, None] & mask_hv[None, :],
            other=0.0,
        )
        if FP8:
            p = p * tl.load(v_scale_ptr + srow, mask=valid, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m = m_new

    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    lse2 = m + tl.log2(tl.where(empty, 1.0, l))  # base-2 log-sum-exp of the scaled scores
    lse = tl.where(empty, float("-inf"), lse2 * 0.6931471805599453)
    o_row = (q_row + offs_g) * SPLITS + split  # [BLOCK_G]
    tl.store(o_ptr + o_row[:, None] * HV + offs_hv[None, :], out,
             mask=mask_g[:, None] & mask_hv[None, :])
    tl.store(lse_ptr + o_row, lse, mask=mask_g)


def paged_decode_partials(
    q, k_pages, v_pages, block_tables, lengths, *, scale, window, sinks,
    k_scales=None, v_scales=None, config: Config,
):
    """Partial results `(o [B, N, splits, Hv] f32, lse [B, N, splits] f32)`; inputs validated.

    `window` and `sinks` are `[K]` or `[B, K]` int32 (window <= 0: full head).
    """
    b, n, h = q.shape
    kh, num_pages, p, _ = k_pages.shape
    hv = v_pages.shape[-1]
    g = n // kh
    fp8 = k_scales is not None
    if not fp8:
        k_scales = v_scales = jnp.zeros((1,), jnp.float32)
    sub = p // k_scales.shape[-1] if fp8 else p
    compute = jnp.dtype(config.fp8_compute) if fp8 else k_pages.dtype
    precision = "ieee" if jnp.dtype(compute) == jnp.float32 else "tf32"
    splits = config.num_splits
    o, lse = triton_call(
        q.astype(compute).reshape(b, kh, g, h),
        k_pages,
        v_pages,
        block_tables.astype(jnp.int32),
        lengths.astype(jnp.int32),
        jnp.broadcast_to(window.astype(jnp.int32), (b, kh)),
        jnp.broadcast_to(sinks.astype(jnp.int32), (b, kh)),
        k_scales,
        v_scales,
        kernel=_paged_decode_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, kh, g, splits, hv), jnp.float32),
            jax.ShapeDtypeStruct((b, kh, g, splits), jnp.float32),
        ),
        grid=(b, kh, splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        SCALE_LOG2=float(scale) * LOG2E,
        K=kh,
        G=g,
        H=h,
        HV=hv,
        P=p,
        NUM_PAGES=num_pages,
        MAX_PAGES=block_tables.shape[-1],
        SPLITS=splits,
        SUB=sub,
        FP8=fp8,
        BLOCK_G=max(16, triton.next_power_of_2(g)),
        BLOCK_N=config.block_n,
        BLOCK_H=max(16, triton.next_power_of_2(h)),
        BLOCK_HV=max(16, triton.next_power_of_2(hv)),
        PRECISION=precision,
        PAGE_TILES=config.page_tiles and p % config.block_n == 0,
    )
    return o.reshape(b, n, splits, hv), lse.reshape(b, n, splits)


def paged_decode(q, k_pages, v_pages, block_tables, lengths, *, scale, window, sinks,
                 k_scales=None, v_scales=None, config: Config | None = None):
    """Paged decode through the kernel: `(out [B, N, Hv] q.dtype, lse [B, N] f32)`."""
    from attn.merge import triton as merge

    if config is None:
        config = default_config(q.shape[0], k_pages.shape[0],
                                block_tables.shape[-1] * k_pages.shape[2],
                                fp8=k_scales is not None, row_bytes=row_bytes(k_pages, v_pages))
    o, lse = paged_decode_partials(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                                   window=window, sinks=sinks, k_scales=k_scales,
                                   v_scales=v_scales, config=config)
    if config.num_splits == 1:
        return o[:, :, 0].astype(q.dtype), lse[:, :, 0]
    out, lse = merge.merge_partials(o, lse)
    return out.astype(q.dtype), lse
