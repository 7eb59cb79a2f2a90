"""Triton XAttention estimate: antidiagonal strided scores, causal softmax per reduced row and
block sums in two kernels, then the threshold selection in a third (`select_blocks_kernel`: the
reference's `find_blocks` rule found by bisection, no sort). With `Config.mosaic` (what
`FP8_CONFIG` carries) the scores run in the Mosaic GPU kernel of `attn/xattention/mosaic.py`
where it applies, feeding the same block-sum kernel.

The scores are one GEMM on the reduced matrices, `A = q_r k_rᵀ` with `q_r [T/st, st·H]` (row `m`
is `concat_i q[m·st + st-1-i]`) and `k_r [S/st, st·H]` (row `c` is `concat_i k[c·st + i]`), so
`A[m, c] = Σ_{i<st} q[m·st + st-1-i] · k[c·st + i]`. It is tiled like a plain GEMM, not like flash
attention: one program per `[BLOCK_R, BLOCK_C]` tile of `A` (reduced rows x reduced key columns)
of one query head, the tiles listed in a static table that holds only the causally reachable
ones, so every program does the same work and causal skipping costs nothing. The program walks
the reduced feature axis `st·H` in `BLOCK_K` slices (a slice is part of one stride's `H`
features, or several whole strides), the q rows gathered at token stride `st`, one tensor-core
dot per slice. Row tiles are anchored at the last valid reduced row of the request, so the
table stays nearly tight with the lengths unknown until run time: row tile `i` (from the end)
reaches at most `ceil(S/st) - i·BLOCK_R + 1` columns (the `+ 1` when both `q_len` and
`kv_len - q_len` are off the stride grid); a listed tile a request does not reach exits at once.

A program cannot finish a row's softmax (it sees one column tile), so instead of a second GEMM
pass it stores, per reduced row `m` and key block `j` of its tile, the base-2 log-sum-exp of the
row's scaled scores over the block's visible columns (`-inf` when none): a `[B, N, Tb·R, Sb]`
f32 scratch with `R = block_size / st`, and the same over the whole tile, `[B, N, Tb·R, NT]` for
NT column tiles. The second kernel (a few query tiles per program) combines the tiles' into
each row's log-sum-exp and writes `block_sums[b, n, r, j] = Σ_{m in tile r} 2^(lse_block[m, j] -
lse_row[m])`, every entry (0 past the diagonal). Work: one pass of the causal reduced GEMM (a
second softmax pass would recompute it) plus a write and one read of the scratch (`R`x the size
of `block_sums`: 64 MiB at S = 32K, N = 32, st 16; its row pass reads the `block_c / R`x smaller
tile values, not the scratch again); the scratch is bounded by `Config.scratch_bytes`, beyond
which the (request, head) pairs run in several launches.

Visibility in reduced coordinates (as the reference): column `c` of row `m` counts iff
`c <= m + ceil((kv_len - q_len) / st)` and `c < ceil(kv_len / st)`; rows `m >= ceil(q_len / st)`
get no mass; queries past `q_len` and keys past `kv_len` read as 0 (never loaded). `norm` is a
run-time value folded into the score scale, `log2(e) / sqrt(H) / st / norm`.

`Config.fp8` (off by default) runs the GEMM on the e4m3 tensor cores (Hopper: twice bf16's rate).
`reference.quantize_e4m3` (XLA; the kernel path runs it as one Triton pass before the score kernel,
`quantize_e4m3_kernel`, bit-equal: q and k read once, written once in e4m3) rounds q and k to e4m3
with one power-of-two scale per (head, group of `st` consecutive tokens), so per (head, reduced
row) for q and per (KV head, reduced column) for k, `amax / scale` in [224, 448); tokens past the
lengths become 0. The e4m3 arrays keep the `[B, T, N, H]` / `[B, S, K, H]` layouts, so the kernel's
gathers are unchanged and both dot operands are K-major (the features contiguous; `tl.trans(k)` is
a view), which the fp8 wgmma needs for its shared-memory B operand (compiled for sm_90a: q and k
tiles cp.async'd into 128-byte-swizzled shared memory, `wgmma m64n128k32 e4m3.e4m3` with B a
transposed view, no copy; 121 registers, no spills, 96 KiB at 128 x 128 x 128, 3 stages, so two
programs per SM as bf16; `test_score_kernel_compiles_for_sm90`). The dot is `tl.dot(q8, k8ᵀ)` with
f32 accumulation (Triton's default on sm_90: the tensor cores' fast fp8 accumulation, no
promotion); the two scales multiply the f32 scores before the softmax; everything after is the bf16
path's. Products of e4m3 values and power-of-two scales are exact in f32, so the result is the bf16
kernel's on the dequantised `q̂, k̂` up to summation order (what the CPU tests check, as Triton
3.6's interpreter widens fp8 dot operands to f16, exactly). Rounding error: an element moves by at
most `2^-4` of itself plus `2^-10` of its scale (subnormals), so a score `Σ q_i k_i` by at most
about `2^-3 Σ|q_i k_i|`; with independent rounding errors the typical move is ~`0.04 sqrt(Σ q_i²
k_i²)`.

Supports: any group size, `H` up to 256 (padded to a power of two and masked), bf16 / f16 / f32
(f32 with IEEE dots, for tests), power-of-two block sizes and strides (as the API requires).
Not differentiable (a mask estimate). Not supported (`supports` lists it, so
`implementation="auto"` runs XLA): head dims over 256; fp8 with `stride · H < 32`.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from attn import _checks
from attn._harness import triton_call
from attn.block_sparse.reference import _cdiv, _lengths, diagonal_blocks
from attn.xattention import mosaic as mosaic_scores
from attn.xattention import reference
from attn.xattention.reference import dequantize_e4m3, quantize_e4m3  # noqa: F401 (tests)
from attn.xattention.triton_select import select_blocks_kernel

LOG2E = math.log2(math.e)
_MAX_HEAD_DIM = 256
_MAX_GRID_Y = 65535  # CUDA's limit on the (request, head) grid axis
# Block-sum programs: reduced rows (at least one query tile's R) and scratch entries a step.
# H100 S64K N32: 16 rows x 64 blocks on 2 warps 0.091 ms, 64 x 64 on 4 warps 0.29.
_FIXUP_ROWS = 16
_FIXUP_ELEMENTS = 1024
_FIXUP_WARPS = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration of the score kernel.

    Each program computes one `block_r x block_c` tile of reduced scores (reduced query rows x
    reduced key columns; `block_c` is raised to `block_size / stride` when that is larger) with
    a K loop of `block_k`-feature slices of the `stride·H` reduced features (`block_k` is capped
    at `stride·H`), `num_stages` slices in flight. Defaults for Hopper bf16 at H = 128, stride
    16: 128 x 128 tiles (64 FLOP per byte of q/k tile traffic; the operands are re-read from L2
    per tile as in any GEMM), 64-feature slices, 8 warps (two warpgroups of 64 rows), 3 stages:
    ptxas for sm_90a gives 119 registers, no spills, 96 KiB of shared memory, so two programs
    fit an SM. Not timed on a GPU yet; `tests/attn/test_xattention_triton.py: SWEEP` lists the
    shapes to sweep (all compile without spills). `scratch_bytes` bounds the per-(row, key
    block) scratch of one launch; more (request, head) pairs than fit run in further launches.
    `fp8` quantises q and k to e4m3 and runs the GEMM on the fp8 tensor cores (see the module
    docstring); it needs `block_k >= 32`, and `block_k = 128` makes each token's slice one
    128-byte row (the sweep's `fp8-*` configurations; not timed yet).
    """

    block_r: int = 128
    block_c: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    scratch_bytes: int = 1 << 30
    # q and k rounded to e4m3 (`quantize_e4m3`), the GEMM on the fp8 tensor cores.
    fp8: bool = False
    # The K loop warp-specialised (Triton's Hopper pass; >= 8 warps). Off until timed.
    warp_specialize: bool = False
    # The threshold selection in XLA (`reference.find_blocks`, two sorts) instead of the
    # kernel (`select_blocks_kernel`: the same rule, float32 sums in the kernel's order).
    select_xla: bool = False
    # With fp8: the scores in the Mosaic GPU kernel of this configuration
    # (`attn/xattention/mosaic.py`: TMA loads, persistent programs) where it
    # applies (a Hopper GPU, full lengths, H = 128, block / stride = 8, aligned T and S);
    # `xattn_estimate` runs the Triton score kernel elsewhere. The quantisation, block sums and
    # selection stay Triton's.
    mosaic: mosaic_scores.Config | None = None

    def __post_init__(self):
        _checks.check_launch_config(self, tiles=("block_r", "block_c", "block_k"))
        if self.scratch_bytes <= 0:
            raise ValueError(f"scratch_bytes={self.scratch_bytes} must be positive")
        if self.fp8 and self.block_k < 32:  # an fp8 MMA reduces over 32 elements
            raise ValueError(f"block_k={self.block_k} must be >= 32 with fp8")
        if self.mosaic is not None and not self.fp8:
            raise ValueError("mosaic needs fp8=True (the Mosaic kernel is the e4m3 GEMM)")


@triton.jit
def _reduced_gemm(q_ptrs, k_ptrs, q_tok, k_tok, xs, xh, row_ok, q_len, kv_len, N, K, H, ST,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
                  WARP_SPECIALIZE: tl.constexpr):
    """`[BLOCK_R, BLOCK_C]` f32 antidiagonal scores: the K loop over `BLOCK_K`-feature slices of
    the `ST · BLOCK_H` reduced features."""
    acc = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    for x0 in tl.range(0, ST * BLOCK_H, BLOCK_K, warp_specialize=WARP_SPECIALIZE):
        i0 = x0 // BLOCK_H
        if BLOCK_K < BLOCK_H:  # the hint keeps the slice's loads vectorised
            h0 = tl.multiple_of(x0 % BLOCK_H, BLOCK_K)
        else:
            h0 = 0
        q_mask = ((q_tok - i0)[:, None] - xs[None, :] < q_len) & row_ok[:, None]
        k_mask = (k_tok + i0)[:, None] + xs[None, :] < kv_len
        if BLOCK_H != H:
            q_mask = q_mask & (h0 + xh < H)[None, :]
            k_mask = k_mask & (h0 + xh < H)[None, :]
        q = tl.load(q_ptrs + (h0 - i0 * (N * H)), mask=q_mask, other=0.0)  # [BLOCK_R, BLOCK_K]
        k = tl.load(k_ptrs + (h0 + i0 * (K * H)), mask=k_mask, other=0.0)  # [BLOCK_C, BLOCK_K]
        acc = tl.dot(q, tl.trans(k), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _tile_lse_kernel(
    q_ptr,  # [B, T, N, H]
    k_ptr,  # [B, S, K, H]
    q_len_ptr,  # [B] int32
    kv_len_ptr,  # [B] int32
    shift_ptr,  # [B] int32 ceil((kv_len - q_len) / st)
    rows_ptr,  # [B] int32 ceil(q_len / st): reduced rows of real queries
    cols_ptr,  # [B] int32 ceil(kv_len / st): reduced columns of real keys
    tiles_ptr,  # [num_tiles, 2] int32 (row tile counted from the last valid row, column tile)
    scale_ptr,  # [1] f32 log2(e) / sqrt(H) / st / norm
    q_scale_ptr,  # [B, N, MQ] f32 e4m3 scale per reduced row (FP8; else unused)
    k_scale_ptr,  # [B, K, MCP] f32 e4m3 scale per reduced column, padded with 1 (FP8)
    bn0_ptr,  # [1] int32 first flat (request, head) pair of this launch
    lse_ptr,  # [BN, RT, SB] f32 scratch: log2-sum-exp2 per (reduced row, key block)
    tile_lse_ptr,  # [BN, RT, NT] f32 the same per (reduced row, column tile)
    T: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    ST: tl.constexpr,
    R: tl.constexpr,  # reduced rows (and columns) per block: block_size // stride
    RT: tl.constexpr,  # scratch rows: Tb * R
    SB: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PRECISION: tl.constexpr,
    FP8: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    NT: tl.constexpr,  # column tiles
):
    N: tl.constexpr = K * G
    CB: tl.constexpr = BLOCK_C // R  # key blocks per tile
    tile = tl.program_id(0)
    bn_local = tl.program_id(1)
    bn = tl.load(bn0_ptr) + bn_local
    b = bn // N
    n = bn % N
    kh = n // G

    q_len = tl.minimum(tl.maximum(tl.load(q_len_ptr + b), 0), T)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), S)
    shift = tl.load(shift_ptr + b)
    valid_rows = tl.load(rows_ptr + b)
    valid_cols = tl.load(cols_ptr + b)
    top = valid_rows - 1 - tl.load(tiles_ptr + 2 * tile) * BLOCK_R  # last reduced row of the tile
    c0 = tl.load(tiles_ptr + 2 * tile + 1) * BLOCK_C
    # The table covers any lengths; this request may see less (or nothing) of the tile.
    if (top >= 0) & (c0 <= tl.minimum(top + shift, valid_cols - 1)):
        m = top - (BLOCK_R - 1) + tl.arange(0, BLOCK_R)  # [BLOCK_R] reduced rows, some < 0
        cols = c0 + tl.arange(0, BLOCK_C)  # [BLOCK_C] reduced columns
        row_ok = m >= 0
        offs_x = tl.arange(0, BLOCK_K)
        if BLOCK_K > BLOCK_H:  # a slice joins BLOCK_K // BLOCK_H whole strides
            xs = offs_x // BLOCK_H
        else:  # a slice is part of one stride's features
            xs = tl.zeros([BLOCK_K], tl.int32)
        xh = offs_x % BLOCK_H
        # Slice x0 holds strides i = x0 // BLOCK_H + xs, features x0 % BLOCK_H + xh: q token
        # m·st + st-1-i (row base below, minus i tokens), k token c·st + i.
        q_tok = m * ST + (ST - 1)  # [BLOCK_R] q token of stride 0
        k_tok = cols * ST  # [BLOCK_C] k token of stride 0
        q_ptrs = (q_ptr + b.to(tl.int64) * (T * N * H) + n * H
                  + q_tok[:, None] * (N * H) + (xh - xs * (N * H))[None, :])  # [BLOCK_R, BLOCK_K]
        k_ptrs = (k_ptr + b.to(tl.int64) * (S * K * H) + kh * H
                  + k_tok[:, None] * (K * H) + (xh + xs * (K * H))[None, :])  # [BLOCK_C, BLOCK_K]
        acc = _reduced_gemm(q_ptrs, k_ptrs, q_tok, k_tok, xs, xh, row_ok, q_len, kv_len, N, K, H,
                            ST, BLOCK_R, BLOCK_C, BLOCK_K, BLOCK_H, PRECISION, WARP_SPECIALIZE)

        vis = ((cols[None, :] <= m[:, None] + shift) & (cols < valid_cols)[None, :]
               & row_ok[:, None])
        if FP8:  # the e4m3 scales of the tile's rows and columns
            MQ: tl.constexpr = (T + ST - 1) // ST
            MCP: tl.constexpr = ((S + ST - 1) // ST + BLOCK_C - 1) // BLOCK_C * BLOCK_C
            qs = tl.load(q_scale_ptr + bn * MQ + m, mask=row_ok, other=0.0)
            # Padded to whole column tiles and unmasked: aligned vector loads (masked scalar
            # ones took ptxas from 114 to 173 registers at 128 x 128 x 128).
            ks = tl.load(k_scale_ptr + (b * K + kh) * MCP + cols)
            acc = acc * (qs * tl.load(scale_ptr))[:, None] * ks[None, :]
        else:
            acc = acc * tl.load(scale_ptr)
        a = tl.where(vis, acc, float("-inf"))  # [BLOCK_R, BLOCK_C] base 2
        mx = tl.max(a, 1)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        p = tl.exp2(a - mx[:, None])
        blk = tl.sum(tl.reshape(p, [BLOCK_R, CB, R]), 2)  # [BLOCK_R, CB]
        blocks = c0 // R + tl.arange(0, CB)  # [CB] key blocks
        out = lse_ptr + (bn_local.to(tl.int64) * RT + m[:, None]) * SB + blocks[None, :]
        lse = tl.where(blk > 0.0, mx[:, None] + tl.log2(tl.where(blk > 0.0, blk, 1.0)),
                       float("-inf"))
        tl.store(out, lse, mask=row_ok[:, None] & (blocks < SB)[None, :])
        # The row's log-sum-exp over the whole tile (the row has a visible column here: else
        # the tile is not its to write), so the second kernel's row pass reads NT values, not SB.
        row = tl.sum(blk, 1)
        tl.store(tile_lse_ptr + (bn_local.to(tl.int64) * RT + m) * NT + c0 // BLOCK_C,
                 tl.where(row > 0.0, mx + tl.log2(tl.where(row > 0.0, row, 1.0)), float("-inf")),
                 mask=row_ok)


@triton.jit
def _block_sums_kernel(
    lse_ptr,  # [BN, RT, SB] f32 scratch of `_tile_lse_kernel`
    tile_lse_ptr,  # [BN, RT, NT] f32 its per-tile row log-sum-exps
    shift_ptr,  # [B] int32
    rows_ptr,  # [B] int32
    cols_ptr,  # [B] int32
    bn0_ptr,  # [1] int32
    sums_ptr,  # [BN, TB, SB] f32
    N: tl.constexpr,
    R: tl.constexpr,
    RT: tl.constexpr,  # scratch rows (the Mosaic scores: padded to its row tiles)
    TB: tl.constexpr,
    SB: tl.constexpr,
    QB: tl.constexpr,  # query tiles per program
    BLOCK_J: tl.constexpr,
    NT: tl.constexpr,  # column tiles of the score kernel
    BLOCK_NT: tl.constexpr,  # of them per step
    TILE_COLS: tl.constexpr,  # reduced columns per column tile
    TILE_ROW_STRIDE: tl.constexpr,  # tile_lse [BN, RT, NT] (Triton scores): NT, 1;
    TILE_STRIDE: tl.constexpr,  # [BN, NT, RT] (Mosaic scores): 1, RT
):
    """One program per `QB` query tiles of one (request, head) pair: each row's log-sum-exp from
    its tiles', then the block masses up to the program's causal reach (zeros past it, nothing
    loaded)."""
    bn_local = tl.program_id(1)
    b = (tl.load(bn0_ptr) + bn_local) // N
    shift = tl.load(shift_ptr + b)
    valid_rows = tl.load(rows_ptr + b)
    valid_cols = tl.load(cols_ptr + b)
    q_blocks = tl.program_id(0) * QB + tl.arange(0, QB)  # [QB]
    m = tl.program_id(0) * (QB * R) + tl.arange(0, QB * R)  # [QB * R] reduced rows
    row_ok = m < valid_rows
    rows = lse_ptr + (bn_local.to(tl.int64) * RT + m[:, None]) * SB  # [QB * R, 1]
    offs_j = tl.arange(0, BLOCK_J)

    mx = tl.full([QB * R], float("-inf"), tl.float32)
    l = tl.zeros([QB * R], tl.float32)
    tiles = (tile_lse_ptr + bn_local.to(tl.int64) * (RT * NT)
             + m[:, None] * TILE_ROW_STRIDE)  # [QB * R, 1]
    for t0 in range(0, NT, BLOCK_NT):  # each row's log2-sum-exp2 over its visible tiles
        t = t0 + tl.arange(0, BLOCK_NT)
        # Tile t holds a visible column of row m iff its first column does.
        c = t * TILE_COLS
        vis = ((c[None, :] <= m[:, None] + shift) & (c < valid_cols)[None, :] & (t < NT)[None, :]
               & row_ok[:, None])
        x = tl.load(tiles + t[None, :] * TILE_STRIDE, mask=vis,
                    other=float("-inf"))  # [QB * R, BLOCK_NT]
        m_new = tl.maximum(mx, tl.max(x, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(mx - m_use) + tl.sum(tl.exp2(x - m_use[:, None]), 1)
        mx = m_new
    row_lse = tl.where(l > 0.0, mx + tl.log2(tl.where(l > 0.0, l, 1.0)), 0.0)

    out = sums_ptr + (bn_local.to(tl.int64) * TB + q_blocks[:, None]) * SB  # [QB, 1]
    # Key blocks past the last row's reach hold no mass (`//` truncates: a negative reach only
    # errs high, and the loop below masks every entry anyway).
    last = tl.minimum(tl.program_id(0) * (QB * R) + QB * R - 1, valid_rows - 1)
    reach = tl.minimum(tl.maximum(tl.minimum((last + shift) // R + 1, (valid_cols + R - 1) // R),
                                  0), SB)
    end = (reach + BLOCK_J - 1) // BLOCK_J * BLOCK_J
    for j0 in range(end, SB, BLOCK_J):
        j = j0 + offs_j
        tl.store(out + j[None, :], tl.zeros([QB, BLOCK_J], tl.float32),
                 mask=(q_blocks < TB)[:, None] & (j < SB)[None, :])
    for j0 in range(0, end, BLOCK_J):  # probabilities summed over each tile's rows
        j = j0 + offs_j
        vis = (((j * R)[None, :] <= m[:, None] + shift) & (j * R < valid_cols)[None, :]
               & row_ok[:, None])
        x = tl.load(rows + j[None, :], mask=vis, other=float("-inf"))
        p = tl.where(vis, tl.exp2(x - row_lse[:, None]), 0.0)
        sums = tl.sum(tl.reshape(p, [QB, R, BLOCK_J]), 1)  # [QB, BLOCK_J]
        tl.store(out + j[None, :], sums, mask=(q_blocks < TB)[:, None] & (j < SB)[None, :])


# What `xattn_estimate(..., fp8=True)` runs: the Mosaic GPU score kernel where it applies (a
# Hopper GPU, full lengths, aligned shapes; the whole estimate on the H100 at S64K / S128K N32
# 1.463 / 5.205 ms against 1.732 / 6.365 with the Triton score kernel, benchmarks/prefill.json),
# else the Triton one with 128-feature slices (one 128-byte e4m3 row per token) and 128 x 256
# score tiles (2.058 / 7.05 ms against 2.074 / 7.38 at 128 x 128).
FP8_CONFIG = Config(fp8=True, block_k=128, block_c=256, mosaic=mosaic_scores.Config())


def supports(args: dict, config: Config) -> list[str]:
    """Why the kernels cannot run `attn.xattention.xattn_estimate`'s validated `args` with
    `config` (the Mosaic score kernel's own limits only make it fall back to the Triton one)."""
    h, stride = args["q"].shape[-1], args["stride"]
    reasons = []
    if h > _MAX_HEAD_DIM:
        reasons.append(f"head dim H={h} over {_MAX_HEAD_DIM}")
    if config.fp8 != args["fp8"]:
        reasons.append(f"config.fp8={config.fp8} with fp8={args['fp8']}: the config's rounding "
                       f"must be the call's")
    if config.fp8 and stride * max(16, triton.next_power_of_2(h)) < 32:
        reasons.append(f"fp8 with stride * H = {stride} * {h}: an fp8 MMA reduces over 32")
    return reasons


@triton.jit
def _quantize_kernel(
    x_ptr,  # [B, L, NH, H] bf16 / f16 / f32
    len_ptr,  # [B] int32 valid tokens
    x8_ptr,  # [B, L, NH, H] e4m3
    scale_ptr,  # [B, NH, MP] f32 (groups past the tokens: 1)
    L: tl.constexpr,
    NH: tl.constexpr,
    H: tl.constexpr,
    ST: tl.constexpr,
    MP: tl.constexpr,
    BLOCK_N: tl.constexpr,  # heads per program
    BLOCK_H: tl.constexpr,
    NHB: tl.constexpr,  # head blocks
):
    """One group of ST tokens x BLOCK_N heads per program: one read, one e4m3 write. Programs
    head blocks fastest (grid `(groups · NHB, B)`), so those in flight read whole token rows."""
    g = tl.program_id(0) // NHB
    b = tl.program_id(1)
    heads = tl.program_id(0) % NHB * BLOCK_N + tl.arange(0, BLOCK_N)
    tok = g * ST + tl.arange(0, ST)
    h = tl.arange(0, BLOCK_H)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), L)
    offs = ((b.to(tl.int64) * L + tok[:, None, None]) * NH + heads[None, :, None]) * H \
        + h[None, None, :]  # [ST, BLOCK_N, BLOCK_H]
    ok = ((tok < length)[:, None, None] & (heads < NH)[None, :, None]
          & (h < H)[None, None, :])
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(x), 2), 0)  # [BLOCK_N]
    # amax / 448 = m · 2^e, m in [1/2, 1), read off the f32 exponent field E (e = E - 126; a
    # zero group takes e = 0, a ratio below 2^-126 is raised to it): scale 2^e, 1 / scale 2^-e.
    r = tl.maximum(tl.where(amax > 0.0, amax, 224.0) / 448.0, 1.1754943508222875e-38)
    field = (r.to(tl.int32, bitcast=True) >> 23) & 0xFF
    scale = ((field + 1) << 23).to(tl.float32, bitcast=True)
    inv = ((253 - field) << 23).to(tl.float32, bitcast=True)
    x8 = tl.minimum(tl.maximum(x * inv[None, :, None], -448.0), 448.0).to(tl.float8e4nv)
    tl.store(x8_ptr + offs, x8, mask=(tok < L)[:, None, None] & (heads < NH)[None, :, None]
             & (h < H)[None, None, :])
    tl.store(scale_ptr + (b * NH + heads) * MP + g, scale, mask=heads < NH)


def quantize_e4m3_kernel(x, lengths, stride, groups):
    """`quantize_e4m3` as one Triton pass (x read once, e4m3 written once), bit-equal to it
    (except groups whose `amax / 448` is below 2^-126); the scale array is `[B, heads,
    groups]` with `groups >= ceil(L / stride)` (the extra groups get scale 1)."""
    b, l, heads, h = x.shape
    block_h = triton.next_power_of_2(h)
    # 4 heads a program at stride 16, H128 (H100 S64K N32: 0.282 ms against 0.296 with 2).
    block_n = max(1, min(triton.next_power_of_2(heads), 8192 // (stride * block_h)))
    return triton_call(
        x, lengths.astype(jnp.int32),
        kernel=_quantize_kernel,
        out_shape=(jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),
                   jax.ShapeDtypeStruct((b, heads, groups), jnp.float32)),
        grid=(groups * _cdiv(heads, block_n), b),
        num_warps=4,
        num_stages=1,
        L=l, NH=heads, H=h, ST=stride, MP=groups, BLOCK_N=block_n, BLOCK_H=block_h,
        NHB=_cdiv(heads, block_n),
    )


@functools.cache
def _tile_table(num_row_tiles: int, cols: int, block_r: int, block_c: int) -> np.ndarray:
    """`[num_tiles, 2]` int32 (row tile i counted from the last valid row, column tile j): the
    tiles some lengths `<= (T, S)` can reach. Row tile i's last row is `rows - 1 - i·block_r`
    with `rows = ceil(q_len / st)`; it sees columns `<= rows - 1 - i·block_r + ceil((kv_len -
    q_len) / st) <= ceil(kv_len / st) - i·block_r` (ceilings add up to one more than their sum's)
    and `< ceil(kv_len / st) <= cols`."""
    pairs = [(i, j) for i in range(num_row_tiles)
             for j in range(_cdiv(max(0, min(cols, cols - i * block_r + 1)), block_c))]
    return np.asarray(pairs, np.int32).reshape(-1, 2)


@functools.partial(jax.jit, static_argnames=("block_size", "stride", "config"))
def block_sums(q, k, norm, q_lengths, kv_lengths, *, block_size, stride, config):
    """`[B, N, Tb, Sb]` f32 block masses, as `reference.xattn_estimate`'s first output."""
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    q_len, kv_len = _lengths(q_lengths, t, b), _lengths(kv_lengths, s, b)
    r = block_size // stride
    tb, sb = _cdiv(t, block_size), _cdiv(s, block_size)
    block_h = max(16, triton.next_power_of_2(h))
    block_r, block_c = config.block_r, max(config.block_c, r)
    if config.mosaic is not None:  # its column tiles (the block-sum kernel reads them)
        block_c = config.mosaic.block_c
    block_k = min(config.block_k, stride * block_h)
    tiles = _tile_table(_cdiv(_cdiv(t, stride), block_r), _cdiv(s, stride), block_r, block_c)
    geometry = (_cdiv(kv_len - q_len, stride), _cdiv(q_len, stride), _cdiv(kv_len, stride))
    scale = jnp.reshape(LOG2E / math.sqrt(h) / stride / jnp.asarray(norm, jnp.float32), (1,))
    qb = max(1, min(triton.next_power_of_2(tb), _FIXUP_ROWS // r))  # query tiles per program
    if config.fp8:
        if stride * block_h < 32:  # an fp8 MMA reduces over 32 elements
            raise NotImplementedError(f"fp8 needs stride * H >= 32, got {stride} * {h}")
        q, q_scale = quantize_e4m3_kernel(q, q_len, stride, _cdiv(t, stride))
        # k's scales padded with 1 to whole column tiles (the score kernel's MCP).
        k, k_scale = quantize_e4m3_kernel(k, kv_len, stride,
                                          _cdiv(_cdiv(s, stride), block_c) * block_c)
        precision = "tf32"  # unused by fp8 dots
    else:
        q_scale = k_scale = jnp.zeros((1,), jnp.float32)
        precision = "ieee" if q.dtype == jnp.float32 else "tf32"
    nt = _cdiv(_cdiv(s, stride), block_c)  # column tiles
    pairs_per_launch = max(1, min(b * n, _MAX_GRID_Y,
                                  config.scratch_bytes // (tb * r * (sb + nt) * 4)))
    parts = []
    for bn0 in range(0, b * n, pairs_per_launch):
        count = min(pairs_per_launch, b * n - bn0)
        first = jnp.full((1,), bn0, jnp.int32)
        if config.mosaic is not None:  # full lengths (checked by `xattn_estimate`)
            lse, tile_lse = mosaic_scores.scores(
                q, k, q_scale * scale[0], k_scale, stride=stride, block_size=block_size,
                first=bn0, count=count, config=config.mosaic)
            rt = lse.shape[1]  # rows padded to the Mosaic kernel's row tiles
            tile_strides = (1, rt)
        else:
            lse, tile_lse = triton_call(
                q, k, q_len, kv_len, *geometry, jnp.asarray(tiles), scale, q_scale, k_scale,
                first,
                kernel=_tile_lse_kernel,
                out_shape=(jax.ShapeDtypeStruct((count, tb * r, sb), jnp.float32),
                           jax.ShapeDtypeStruct((count, tb * r, nt), jnp.float32)),
                grid=(tiles.shape[0], count),
                num_warps=config.num_warps,
                num_stages=config.num_stages,
                T=t, S=s, K=kh, G=n // kh, H=h, ST=stride, R=r, RT=tb * r, SB=sb,
                BLOCK_R=block_r, BLOCK_C=block_c, BLOCK_K=block_k, BLOCK_H=block_h,
                PRECISION=precision, FP8=config.fp8,
                WARP_SPECIALIZE=config.warp_specialize and config.num_warps >= 8, NT=nt,
            )
            rt, tile_strides = tb * r, (nt, 1)
        parts.append(triton_call(
            lse, tile_lse, *geometry, first,
            kernel=_block_sums_kernel,
            out_shape=jax.ShapeDtypeStruct((count, tb, sb), jnp.float32),
            grid=(_cdiv(tb, qb), count),
            num_warps=_FIXUP_WARPS,
            num_stages=1,
            N=n, R=r, RT=rt, TB=tb, SB=sb, QB=qb,
            BLOCK_J=max(16, min(triton.next_power_of_2(sb), _FIXUP_ELEMENTS // (qb * r))),
            NT=nt, BLOCK_NT=min(triton.next_power_of_2(nt), max(1, _FIXUP_ELEMENTS // (qb * r))),
            TILE_COLS=block_c, TILE_ROW_STRIDE=tile_strides[0], TILE_STRIDE=tile_strides[1],
        ))
    sums = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return sums.reshape(b, n, tb, sb)


@functools.partial(jax.jit, static_argnames=("block_size", "stride", "config"))
def _estimate(q, k, threshold, norm, q_lengths, kv_lengths, *, block_size, stride, config):
    b, t = q.shape[:2]
    s = k.shape[1]
    q_len, kv_len = _lengths(q_lengths, t, b), _lengths(kv_lengths, s, b)
    sums = block_sums(q, k, norm, q_len, kv_len, block_size=block_size, stride=stride,
                      config=config)
    tb, sb = sums.shape[2:]
    diag = diagonal_blocks(tb, q_len, kv_len, block_size)
    select = reference.find_blocks if config.select_xla else select_blocks_kernel
    mask = select(sums, diag, threshold)
    r = jnp.arange(tb, dtype=jnp.int32)[:, None]
    j = jnp.arange(sb, dtype=jnp.int32)
    in_range = ((r < _cdiv(q_len, block_size)[:, None, None])
                & (j < _cdiv(kv_len, block_size)[:, None, None]))
    return sums, mask & in_range[:, None]


def xattn_estimate(q, k, *, block_size=128, stride=16, threshold=0.9, norm=1.0, q_lengths=None,
                   kv_lengths=None, config: Config | None = None):
    """XAttention estimate through the kernels; arguments as `attn.xattention.xattn_estimate`
    (validated there; `chunk_size` does not apply: `config.scratch_bytes` bounds memory). With
    `config.mosaic`, the Mosaic GPU score kernel where it applies (`mosaic.reasons` is empty),
    else the Triton one.

    Returns:
      `(block_sums [B, N, Tb, Sb] float32, block_mask [B, N, Tb, Sb] bool)`.

    Raises:
      NotImplementedError: what `supports` lists.
    """
    config = config or Config()
    reasons = supports(dict(q=q, stride=stride, fp8=config.fp8), config)
    if reasons:
        raise NotImplementedError(f"Triton XAttention estimate: {'; '.join(reasons)}")
    if config.mosaic is not None and mosaic_scores.reasons(
            q, k, block_size=block_size, stride=stride, q_lengths=q_lengths,
            kv_lengths=kv_lengths, config=config.mosaic):
        config = dataclasses.replace(config, mosaic=None)
    return _estimate(q, k, jnp.float32(threshold), jnp.float32(norm), q_lengths, kv_lengths,
                     block_size=block_size, stride=stride, config=config)
