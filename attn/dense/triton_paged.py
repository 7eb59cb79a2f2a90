"""Triton chunked prefill over a paged cache: a query chunk attends its row's cached prefix and
itself, reading K/V straight from head-major pages through per-head block tables.

The structure is that of the dense flash forward (`attn/dense/triton.py`, whose key-range helpers
it reuses): one program owns `BLOCK_M` folded rows of one KV head of one batch row, a row being a
(query token, query head of that KV head's group) pair, so each K/V tile is read once for the
whole group. It walks the key tiles some row sees — the sink tiles, the window's lower edge, the
tiles every row sees whole, the causal diagonal — with an online softmax in base 2, fp32
accumulators. Key tiles are `BLOCK_N` positions aligned to `BLOCK_N`; when the page size `P` is a
multiple of `BLOCK_N` (`Config.page_tiles`, the default) a tile lies in one page, so each step
reads one table entry and loads K / V (and the tile's fp8 scales) as contiguous blocks. Otherwise
(`BLOCK_N > P`, or `page_tiles=False`) a tile is gathered token by token through the table (a tile
may span pages). No dense copy of the cache is ever made. A page id outside `[0, NUM_PAGES)` (-1,
or garbage) is an absent page: its tokens are masked (so are keys past `kv_lengths`, clamped to
`[0, MAX_PAGES * P]`: no table entry past the row is read), with their loads masked too, so no
load leaves the pool and NaN in unowned pages never reaches an output. In a masked tile (rows
see different keys) a non-finite value is zeroed before the PV product and the rows that see it
are set to NaN at the end, so it reaches exactly those rows, as in the reference. FP8 pages are
dequantised in the kernel, tile by tile
(`fp8.astype(f32) * scale` per token, then q's dtype for the tensor cores).

Window and sinks are per (batch row, KV head), so a per-request policy (streaming heads of one
request, full heads of another) runs in one launch; tiles outside every row's sink + window are
never visited.

Supports: any group size, `H` / `Hv` up to 256 (padded and masked), bf16 / f16 / f32 queries with
pages of q's dtype, or fp8-e4m3 pages with fp32 sub-block scales. The kernel is forward only;
the public op takes its gradient from the XLA reference (`attn._op`, `attn._grad`).
Not supported (`supports` says why; `"auto"` then runs XLA): head dims over 256, float pages in
another dtype than q, one fp8 pool with one float pool.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn import _checks
from attn._harness import triton_call
from attn.dense._flash_tiles import (
    _key_tiles,
    _masked_softmax_step,
    _visible,
    wide_rows,
    wide_rows_query_tile,
)

LOG2E = math.log2(math.e)
_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration: `block_m` folded rows x `block_n` keys per step. `num_stages` is the
    pipeline depth of the page-tile path, `gather_num_stages` that of the token-gather path (its
    per-token index registers stay live across stages)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    gather_num_stages: int = 2
    # Where a key tile lies in one page (P % block_n == 0), read its page id once and load K / V
    # as contiguous [block_n, H] blocks; False (or smaller pages) gathers token by token.
    page_tiles: bool = True
    # The unmasked key loop warp-specialised (Triton's Hopper pass; >= 8 warps), as the dense
    # kernel's `Config.warp_specialize` (H100, 2K chunk over 32K, P64: 2.532 ms, 2.536 without).
    warp_specialize: bool = True

    def __post_init__(self):
        _checks.check_launch_config(self, tiles=("block_m", "block_n"),
                                    stages=("num_stages", "gather_num_stages"))

    def uses_page_tiles(self, page_size: int) -> bool:
        """Whether pages of `page_size` tokens take the page-tile path under this config."""
        return self.page_tiles and page_size % self.block_n == 0


def default_config(head_dim: int, value_head_dim: int | None = None, itemsize: int = 2) -> Config:
    """The dense forward's Hopper tiles (128 rows x 64 keys, 8 warps, 3 stages) for page tiles
    (ptxas for sm_90a at H = 128, P = 64: 215 registers, no spills, 128 KiB shared), 2 stages
    on the gather path (pages under 64 tokens). Wide rows (`dense._flash_tiles.wide_rows`:
    H > 128 in 16-bit types, H > 64 in float32, the wider of q's and the pages' elements) take
    32-key tiles and 2 stages so the K/V stages fit in shared memory (64-row tiles over 512 bytes:
    float32 at H256). `python -m
    experiments.tools.sweep paged_prefill` times alternatives (`python -m experiments.bench
    prefill --rows paged_prefill`: this one)."""
    if wide_rows(head_dim, value_head_dim, itemsize):
        block_m = wide_rows_query_tile(head_dim, value_head_dim, itemsize)
        return Config(block_m=block_m, block_n=32, num_warps=8, num_stages=2)
    return Config()


def config_for(q, v_pages) -> Config:
    """`default_config` at `q [B, T, N, H]` and `v_pages [K, pages, P, Hv]`: their head dims and
    the wider of their element sizes."""
    itemsize = max(jnp.dtype(q.dtype).itemsize, jnp.dtype(v_pages.dtype).itemsize)
    return default_config(q.shape[-1], v_pages.shape[-1], itemsize)


@triton.jit
def _paged_visit(
    acc,  # [BLOCK_M, BLOCK_HV] f32
    l,  # [BLOCK_M] f32
    m,  # [BLOCK_M] f32 (base-2 scaled scores)
    bad,  # [BLOCK_M] int32: 1 where the row saw a non-finite value (masked tiles)
    q,  # [BLOCK_M, BLOCK_H]
    k_ptr,  # [K, NUM_PAGES, P, H]
    v_ptr,  # [K, NUM_PAGES, P, HV]
    k_scale_ptr,  # [K, NUM_PAGES, P // SUB] f32 (FP8 only)
    v_scale_ptr,
    table_row,  # -> block_tables[b, kh, 0]
    kh,
    pos,  # [BLOCK_M] absolute query positions
    lo,  # first key (multiple of BLOCK_N)
    hi,  # end key (multiple of BLOCK_N)
    kv_len,
    win,
    sinks,
    SCALE_LOG2: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    P: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    SUB: tl.constexpr,
    FP8: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGE_TILES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr = False,
):
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_hv = offs_hv < HV
    # Page tiles: element offsets inside one contiguous [BLOCK_N, H] block, the same every tile
    # (int32; the tile's int64 base is a scalar), so a step costs one table read and one add.
    k_offs = offs_n[:, None] * H + offs_h[None, :]  # [BLOCK_N, BLOCK_H]
    v_offs = offs_n[:, None] * HV + offs_hv[None, :]  # [BLOCK_N, BLOCK_HV]
    if PAGE_TILES:
        # Each step reads the next tile's page id, a step ahead: the K / V block addresses then
        # hang on a loop-carried scalar, not on a load in flight, and the software pipeliner
        # issues them stages ahead. Entries below hi <= MAX_PAGES * P exist; -1: the null page.
        next_page = tl.load(table_row + lo // P, mask=lo < hi, other=-1)
    for start in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start = tl.multiple_of(start, BLOCK_N)
        cols = start + offs_n  # [BLOCK_N] key positions
        in_kv = cols < kv_len
        if PAGE_TILES:  # the tile lies in one page (P % BLOCK_N == 0): one id, one block
            page = next_page
            next_page = tl.load(table_row + (start + BLOCK_N) // P, mask=start + BLOCK_N < hi,
                                other=-1)
            page_ok = (page >= 0) & (page < NUM_PAGES)  # else absent: loads masked below
            first = (kh * NUM_PAGES + tl.where(page_ok, page, 0)).to(tl.int64) * P + start % P
            ok = in_kv & page_ok  # [BLOCK_N]
            # The unmasked range lies below kv_len: only the page itself can drop out.
            row_ok = ok[:, None] if MASKED else page_ok
            k_mask = row_ok & mask_h[None, :] if BLOCK_H != H else row_ok
            v_mask = row_ok & mask_hv[None, :] if BLOCK_HV != HV else row_ok
            k = tl.load(k_ptr + first * H + k_offs, mask=k_mask, other=0.0)  # [BLOCK_N, BLOCK_H]
            v = tl.load(v_ptr + first * HV + v_offs, mask=v_mask, other=0.0)  # [BLOCK_N, BLOCK_HV]
            if FP8:  # the tile's sub-block scales: [K, NUM_PAGES, P // SUB], P % SUB == 0
                srow = (first + offs_n) // SUB
                ks = tl.load(k_scale_ptr + srow, mask=ok, other=0.0)
                vs = tl.load(v_scale_ptr + srow, mask=ok, other=0.0)
        else:  # gathered token by token: a tile may span pages
            page = tl.load(table_row + cols // P, mask=in_kv, other=-1)
            present = (page >= 0) & (page < NUM_PAGES)
            ok = in_kv & present  # -1 or out of the pool: absent, masked
            page_row = kh * NUM_PAGES + tl.where(present, page, 0)  # [BLOCK_N] of [K * pages]
            tok = page_row.to(tl.int64) * P + cols % P  # [BLOCK_N] token rows of [K * pages * P]
            k = tl.load(k_ptr + tok[:, None] * H + offs_h[None, :],  # [BLOCK_N, BLOCK_H]
                        mask=ok[:, None] & mask_h[None, :], other=0.0)
            v = tl.load(v_ptr + tok[:, None] * HV + offs_hv[None, :],  # [BLOCK_N, BLOCK_HV]
                        mask=ok[:, None] & mask_hv[None, :], other=0.0)
            if FP8:
                srow = tok // SUB
                ks = tl.load(k_scale_ptr + srow, mask=ok, other=0.0)
                vs = tl.load(v_scale_ptr + srow, mask=ok, other=0.0)
        if FP8:
            k = (k.to(tl.float32) * ks[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * vs[:, None]).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] f32
        if MASKED:
            visible = ok[None, :] & _visible(cols[None, :], pos[:, None], kv_len, win, sinks, True)
            p, alpha, m_new = _masked_softmax_step(qk, m, visible, SCALE_LOG2)
            # Rows of a masked tile see different keys: a non-finite value must reach exactly
            # the rows that see it (a 0 weight would still make 0 * NaN in the others), so it is
            # zeroed here and the rows that see it are marked NaN at the end, as the reference.
            v_bad = ~(tl.abs(v.to(tl.float32)) < float("inf"))  # [BLOCK_N, BLOCK_HV]
            col_bad = tl.max(v_bad.to(tl.int32), 1)  # [BLOCK_N]
            bad = tl.maximum(bad, tl.max((visible & (col_bad > 0)[None, :]).to(tl.int32), 1))
            v = tl.where(v_bad, 0.0, v)
        elif PAGE_TILES:
            # Every row sees the whole tile unless its page is absent (K, V loaded as 0): such a
            # tile leaves m alone and gets p = 2^(s - inf) = 0. Per-row terms, no select per
            # score, so the scale folds into the exponent's FMA as in the dense kernel.
            m_new = tl.where(page_ok, tl.maximum(m, tl.max(qk, 1) * SCALE_LOG2), m)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # -1 pages only, so far
            p = tl.exp2(qk * SCALE_LOG2 - (m_use + tl.where(page_ok, 0.0, float("inf")))[:, None])
            alpha = tl.exp2(m - m_use)
        else:  # every row sees the tile's positions; only unallocated pages drop out
            p, alpha, m_new = _masked_softmax_step(qk, m, ok[None, :], SCALE_LOG2)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m = m_new
    return acc, l, m, bad


@triton.jit
def _paged_prefill_kernel(
    q_ptr,  # [B, T, N, H]
    k_ptr,  # [K, NUM_PAGES, P, H]
    v_ptr,  # [K, NUM_PAGES, P, HV]
    table_ptr,  # [B, K, MAX_PAGES] int32
    offset_ptr,  # [B] int32
    len_ptr,  # [B] int32
    window_ptr,  # [B, K] int32, <= 0: full
    sink_ptr,  # [B, K] int32
    k_scale_ptr,  # [K, NUM_PAGES, P // SUB] f32 (unused unless FP8)
    v_scale_ptr,
    o_ptr,  # [B, T, N, HV]
    lse_ptr,  # [B, T, N] f32
    SCALE_LOG2: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    P: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    MAX_PAGES: tl.constexpr,
    SUB: tl.constexpr,
    FP8: tl.constexpr,
    NUM_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGE_TILES: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
):
    # Heads vary fastest; the last query tiles (most keys under the causal mask) start first.
    pid = tl.program_id(0)
    kh = pid % K
    b = (pid // K) % B
    mt = NUM_M - 1 - pid // (K * B)
    N: tl.constexpr = K * G

    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] folded (token, group head) rows
    row_ok = rows < T * G
    tok = rows // G
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)

    q_off = tl.maximum(tl.load(offset_ptr + b), 0)
    kv_len = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), MAX_PAGES * P)
    pos = q_off + tok  # [BLOCK_M]
    q_lo = q_off + (mt * BLOCK_M) // G
    q_hi = q_off + tl.minimum((mt * BLOCK_M + BLOCK_M - 1) // G, T - 1)
    sinks = tl.maximum(tl.load(sink_ptr + b * K + kh), 0)
    win, sink_end, main_lo, full_lo, full_hi, end = _key_tiles(
        q_lo, q_hi, kv_len, tl.load(window_ptr + b * K + kh), sinks, True, BLOCK_N)

    q_rows = b.to(tl.int64) * (T * N) + tok * N + kh * G + rows % G  # [BLOCK_M] of [B * T * N]
    q = tl.load(q_ptr + q_rows[:, None] * H + offs_h[None, :],  # [BLOCK_M, BLOCK_H]
                mask=row_ok[:, None] & (offs_h < H)[None, :], other=0.0)
    table_row = table_ptr + (b * K + kh) * MAX_PAGES

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_HV], tl.float32)
    bad = tl.zeros([BLOCK_M], tl.int32)
    # The sink tiles, the window's lower edge, the tiles every row sees whole, the diagonal.
    acc, l, m, bad = _paged_visit(
        acc, l, m, bad, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row, kh, pos,
        0, sink_end, kv_len, win, sinks, SCALE_LOG2, H, HV, P, NUM_PAGES, SUB, FP8, True,
        BLOCK_N, BLOCK_H, BLOCK_HV, PRECISION, PAGE_TILES)
    acc, l, m, bad = _paged_visit(
        acc, l, m, bad, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row, kh, pos,
        main_lo, full_lo, kv_len, win, sinks, SCALE_LOG2, H, HV, P, NUM_PAGES, SUB, FP8, True,
        BLOCK_N, BLOCK_H, BLOCK_HV, PRECISION, PAGE_TILES)
    acc, l, m, bad = _paged_visit(
        acc, l, m, bad, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row, kh, pos,
        full_lo, full_hi, kv_len, win, sinks, SCALE_LOG2, H, HV, P, NUM_PAGES, SUB, FP8, False,
        BLOCK_N, BLOCK_H, BLOCK_HV, PRECISION, PAGE_TILES, WARP_SPECIALIZE)
    acc, l, m, bad = _paged_visit(
        acc, l, m, bad, q, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row, kh, pos,
        full_hi, end, kv_len, win, sinks, SCALE_LOG2, H, HV, P, NUM_PAGES, SUB, FP8, True,
        BLOCK_N, BLOCK_H, BLOCK_HV, PRECISION, PAGE_TILES)

    empty = l == 0.0
    safe_l = tl.where(empty, 1.0, l)
    out = tl.where(bad[:, None] > 0, float("nan"), acc / safe_l[:, None])
    lse = tl.where(empty, float("-inf"), (m + tl.log2(safe_l)) * 0.6931471805599453)
    tl.store(o_ptr + q_rows[:, None] * HV + offs_hv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_hv < HV)[None, :])
    tl.store(lse_ptr + q_rows, lse, mask=row_ok)


def supports(args: dict, config=None) -> list[str]:
    """Why this kernel cannot run `attn.dense.paged_prefill_attention`'s validated `args`."""
    del config
    q, k_pages, v_pages = args["q"], args["k_pages"], args["v_pages"]
    h, hv = q.shape[-1], v_pages.shape[-1]
    reasons = []
    if max(h, hv) > _MAX_HEAD_DIM:
        reasons.append(f"head dims H={h}, Hv={hv} over {_MAX_HEAD_DIM}")
    fp8 = args["k_scales"] is not None
    if (args["v_scales"] is not None) != fp8 or k_pages.dtype != v_pages.dtype:
        reasons.append(f"k_pages {k_pages.dtype} / v_pages {v_pages.dtype}: both pools fp8 or "
                       f"both float")
    elif not fp8 and jnp.dtype(k_pages.dtype) != jnp.dtype(q.dtype):
        reasons.append(f"pages of {k_pages.dtype} with q of {q.dtype}: float pages must be in "
                       f"q's dtype (or fp8)")
    return reasons


def _launch(q, k_pages, v_pages, block_tables, q_offset, kv_lengths, window, sinks, k_scales,
            v_scales, *, scale, config):
    b, t, n, h = q.shape
    kh, num_pages, p, _ = k_pages.shape
    hv = v_pages.shape[-1]
    fp8 = k_scales is not None
    if not fp8:
        k_scales = v_scales = jnp.zeros((1,), jnp.float32)
    g = n // kh
    num_m = triton.cdiv(t * g, config.block_m)
    return triton_call(
        q, k_pages, v_pages, block_tables.astype(jnp.int32),
        jnp.broadcast_to(jnp.asarray(q_offset, jnp.int32), (b,)),
        jnp.broadcast_to(jnp.asarray(kv_lengths, jnp.int32), (b,)),
        jnp.broadcast_to(jnp.asarray(window, jnp.int32), (b, kh)),
        jnp.broadcast_to(jnp.asarray(sinks, jnp.int32), (b, kh)),
        k_scales, v_scales,
        kernel=_paged_prefill_kernel,
        out_shape=(jax.ShapeDtypeStruct((b, t, n, hv), q.dtype),
                   jax.ShapeDtypeStruct((b, t, n), jnp.float32)),
        grid=(num_m * b * kh,),
        num_warps=config.num_warps,
        num_stages=config.num_stages if config.uses_page_tiles(p) else config.gather_num_stages,
        SCALE_LOG2=scale * LOG2E, B=b, T=t, K=kh, G=g, H=h, HV=hv, P=p, NUM_PAGES=num_pages,
        MAX_PAGES=block_tables.shape[-1], SUB=p // k_scales.shape[-1] if fp8 else p, FP8=fp8,
        NUM_M=num_m, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_H=max(16, triton.next_power_of_2(h)), BLOCK_HV=max(16, triton.next_power_of_2(hv)),
        PRECISION="ieee" if q.dtype == jnp.float32 else "tf32",
        PAGE_TILES=config.uses_page_tiles(p),
        WARP_SPECIALIZE=config.warp_specialize and config.num_warps >= 8,
    )


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def _paged_prefill(q, k_pages, v_pages, block_tables, q_offset, kv_lengths, window, sinks,
                   k_scales, v_scales, *, scale, config):
    return _launch(q, k_pages, v_pages, block_tables, q_offset, kv_lengths, window, sinks,
                   k_scales, v_scales, scale=scale, config=config)


def paged_prefill_attention(q, k_pages, v_pages, block_tables, q_offset, kv_lengths, *,
                            scale=None, window=0, sinks=0, k_scales=None, v_scales=None,
                            config: Config | None = None):
    """Paged chunked prefill through the kernel (forward only); arguments as
    `attn.dense.paged_prefill_attention` (validated there, and `supports` empty): `q_offset`,
    `kv_lengths` int or `[B]`, `window`, `sinks` int, `[K]` or `[B, K]`, `scale` a float (default
    `H ** -0.5`); plus `config` (default: `default_config`). The public op differentiates it
    through the reference (`attn._op`).

    Returns:
      `(out [B, T, N, Hv] in q's dtype, lse [B, T, N] float32)`.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if config is None:
        config = config_for(q, v_pages)
    return _paged_prefill(q, k_pages, v_pages, block_tables, q_offset, kv_lengths, window, sinks,
                          k_scales, v_scales, scale=scale, config=config)
