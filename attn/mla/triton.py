"""Triton MLA latent paged decode: one query token per sequence, one shared latent KV head.

One program handles a block of `BLOCK_HEADS` query heads of one sequence over one split of its
keys, so every latent page row is read from HBM once per (sequence, block of heads) and shared by
all the heads of the block. Token s of row b is `latent[table[b, s // P], s % P] = [c_kv ‖ k_pe]`
(`L + R` features). The score splits into a `c_kv` part over the first `L` features and a rope
part over the last `R`, each padded to a power of two and masked, so no dimension is hard-coded;
the value is the same `c_kv` tile, loaded once and used for both the score and the PV product
(FP8 may load it a second time instead, `Config.reload_value`: see `default_config`).
When the key tile divides the page size (`Config.page_tiles`, the default), a tile lies in one
page: one page id per tile, read a tile ahead, and one strided 2-D load; otherwise keys are
gathered token by token through the block table (a tile may span pages of any size `P`). A page
id outside `[0, NUM_PAGES)` (-1 = unallocated, or garbage) is an absent page, as in the reference:
its tokens are masked and so are their loads (the address is the null page's), so no load leaves
the pool; tokens past the length (clamped to `MAX_PAGES * P`: no table entry past the row is
read) are masked. FP8
latent pages are dequantised in the kernel: the token's scale multiplies the score columns and
the probabilities, so the tiles go to the tensor cores unscaled (widened to float16: e4m3 -> f16
is one instruction on Hopper).

Splits follow the reference (`attn.mla.reference.split_of_token`): row b's `cdiv(len_b, P)` pages
are cut into `SPLITS` page-aligned runs of `cdiv(cdiv(len_b, P), SPLITS)` pages, so the partials
`[B, N, splits, L]` and their log-sum-exp equal the reference's; `attn.merge` combines them.

Supports: any `N` (padded to `BLOCK_HEADS` rows and masked), any `L` and `R`, page sizes that are
powers of two, bf16 / f16 / f32 and fp8-e4m3 latent pages with fp32 scales per sub-block.
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

    block_n: int = 32
    block_heads: int = 16
    num_splits: int = 1
    num_warps: int = 4
    num_stages: int = 2
    # Load the value tile (the first L features of the rows) a second time for the PV product
    # instead of reusing the score's tile: each load then feeds one dot, in one operand layout.
    reload_value: bool = False
    # FP8 tiles widen to this dtype for the tensor cores. e4m3 -> f16 is one conversion
    # instruction on Hopper; e4m3 -> bf16 is not.
    fp8_compute: str = "float16"
    # When `BLOCK_N` divides the page size, a key tile lies in one page: its page id is one
    # scalar, read a tile ahead (loop-carried, so the pipeliner can issue the latent loads stages
    # ahead) and the rows are one strided 2-D block. Otherwise tokens are gathered one by one.
    page_tiles: bool = True

    def __post_init__(self):
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"{self.block_n=} must be a power of two >= 16")
        if self.block_heads < 16 or self.block_heads & (self.block_heads - 1):
            raise ValueError(f"{self.block_heads=} must be a power of two >= 16")
        if self.num_splits < 1:
            raise ValueError(f"{self.num_splits=} must be >= 1")
        if self.fp8_compute not in ("float16", "bfloat16"):
            raise ValueError(f"{self.fp8_compute=} must be 'float16' or 'bfloat16'")


def _splits(programs: int, slots: int, max_len: int) -> int:
    """Splits per row so the grid fills whole waves of `slots` resident programs.

    A 1.45-wave grid runs as 2 waves (measured: 9 splits at B64 N16 took 1.22x the time of 8).
    Take the fewest splits whose grid fills at least 2 waves to 95% (mixed lengths even out over
    waves), else the best-filled grid; at most 32 splits and at least 256 tokens per split.
    """
    best, best_fill = 1, 0.0
    for splits in range(1, max(1, min(32, max_len // 256)) + 1):
        n = programs * splits
        waves = -(-n // slots)
        fill = n / (waves * slots)
        if fill >= 0.95 and waves >= 2:
            return splits
        if fill > best_fill + 1e-9:
            best, best_fill = splits, fill
    return best


def default_config(batch: int, num_heads: int, max_len: int, *, fp8: bool = False,
                   itemsize: int = 2) -> Config:
    """Tiles measured best on the H100 at B64, S32K, L512 + R64.

    * `N < 64`: 16 heads per program (mma.sync), 32-token tiles, 4 warps, 2 stages; ~207
      registers per thread, so 2 programs per SM. FP8 loads the value tile a second time (an L2
      hit): one tile widened for two dots in two layouts costs more registers than the reload.
    * `N >= 64`: 64 heads per program (wgmma), 64-token tiles, 8 warps: 1 program per SM.

    Splits fill whole waves of resident programs (`_splits`). float32 latents halve the tile.
    """
    if num_heads >= 64:
        cfg = Config(block_n=64, block_heads=64, num_warps=8, num_stages=2)
        per_sm = 1
    else:
        cfg = Config(block_n=32, block_heads=16, num_warps=4, num_stages=2, reload_value=fp8)
        per_sm = 2
    if itemsize > 2 and not fp8:
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // 2))
    programs = batch * -(-num_heads // cfg.block_heads)
    slots = per_sm * device_facts().num_sms
    return dataclasses.replace(cfg, num_splits=_splits(programs, slots, max_len))


@triton.jit
def _mla_decode_kernel(
    q_lat_ptr,  # [B, N, L]
    q_pe_ptr,  # [B, N, R]
    latent_ptr,  # [NUM_PAGES, P, L + R]
    table_ptr,  # [B, MAX_PAGES] int32
    len_ptr,  # [B] int32
    scale_ptr,  # [1] f32: softmax scale · log2(e)
    latent_scale_ptr,  # [NUM_PAGES, P // SUB] f32 (unused unless FP8)
    o_ptr,  # [B, N, SPLITS, L] f32
    lse_ptr,  # [B, N, SPLITS] f32
    N: tl.constexpr,
    L: tl.constexpr,
    R: tl.constexpr,
    P: tl.constexpr,
    NUM_PAGES: tl.constexpr,
    MAX_PAGES: tl.constexpr,
    SPLITS: tl.constexpr,
    SUB: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RELOAD_V: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGE_TILES: tl.constexpr,
):
    # Head blocks vary fastest, so the programs sharing a sequence's latent run together (L2).
    hb = tl.program_id(0)
    b = tl.program_id(1)
    split = tl.program_id(2)

    # Page-aligned split of this row's tokens, as the reference's `split_of_token`.
    length = tl.minimum(tl.maximum(tl.load(len_ptr + b), 0), MAX_PAGES * P)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(length, P), SPLITS), 1) * P  # tokens
    lo = split * per_split
    hi = tl.minimum(lo + per_split, length)
    tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)

    offs_h = hb * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < N
    mask_l = offs_l < L
    mask_r = offs_r < R

    q_row = (b * N + offs_h).to(tl.int64)  # [BLOCK_HEADS]
    q_lat = tl.load(  # [BLOCK_HEADS, BLOCK_L]
        q_lat_ptr + q_row[:, None] * L + offs_l[None, :],
        mask=mask_h[:, None] & mask_l[None, :],
        other=0.0,
    )
    q_pe = tl.load(  # [BLOCK_HEADS, BLOCK_R]
        q_pe_ptr + q_row[:, None] * R + offs_r[None, :],
        mask=mask_h[:, None] & mask_r[None, :],
        other=0.0,
    )
    scale_log2 = tl.load(scale_ptr)
    table_row = table_ptr + b.to(tl.int64) * MAX_PAGES

    m = tl.full([BLOCK_HEADS], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_HEADS], tl.float32)
    acc = tl.zeros([BLOCK_HEADS, BLOCK_L], tl.float32)
    # Page tiles: `lo` is page-aligned and BLOCK_N divides P, so tile t lies in one page.
    next_page = tl.load(table_row + lo // P, mask=PAGE_TILES & (tiles > 0), other=0)
    for t in range(0, tiles):
        pos = lo + t * BLOCK_N + offs_n  # [BLOCK_N] token positions of the row
        valid = pos < hi
        if PAGE_TILES:
            page = next_page
            ahead = lo + (t + 1) * BLOCK_N
            next_page = tl.load(table_row + ahead // P, mask=ahead < hi, other=0)
        else:
            page = tl.load(table_row + pos // P, mask=valid, other=-1)
        present = (page >= 0) & (page < NUM_PAGES)  # else absent, as in the reference
        valid = valid & present
        page = tl.where(present, page, 0)  # the null page's address; its loads are masked
        row = page.to(tl.int64) * P + pos % P  # [BLOCK_N] latent rows
        c_kv = tl.load(  # [BLOCK_N, BLOCK_L]: the key's first L features and the value
            latent_ptr + row[:, None] * (L + R) + offs_l[None, :],
            mask=valid[:, None] & mask_l[None, :],
            other=0.0,
            eviction_policy="evict_last" if RELOAD_V else "",
        ).to(q_lat.dtype)
        k_pe = tl.load(  # [BLOCK_N, BLOCK_R]
            latent_ptr + row[:, None] * (L + R) + L + offs_r[None, :],
            mask=valid[:, None] & mask_r[None, :],
            other=0.0,
        ).to(q_lat.dtype)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=PRECISION)  # [BLOCK_HEADS, BLOCK_N]
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=PRECISION)
        if FP8:
            srow = page.to(tl.int64) * (P // SUB) + (pos % P) // SUB
            token_scale = tl.load(latent_scale_ptr + srow, mask=valid, other=0.0)  # [BLOCK_N]
            s = s * token_scale[None, :]
        s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen nothing yet (e.g. a split starting on an absent page) keeps p = 0
        # and alpha = 1 instead of 2^(-inf - -inf) = NaN.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])  # [BLOCK_HEADS, BLOCK_N]
        l = l * alpha + tl.sum(p, axis=1)
        if FP8:
            p = p * token_scale[None, :]
        if RELOAD_V:
            # The same rows again (an L2 hit); another eviction hint keeps it a separate load.
            c_kv = tl.load(  # [BLOCK_N, BLOCK_L]
                latent_ptr + row[:, None] * (L + R) + offs_l[None, :],
                mask=valid[:, None] & mask_l[None, :],
                other=0.0,
                eviction_policy="evict_first",
            ).to(q_lat.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q_lat.dtype), c_kv, input_precision=PRECISION)
        m = m_new

    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    lse2 = m + tl.log2(tl.where(empty, 1.0, l))  # base-2 log-sum-exp of the scaled scores
    lse = tl.where(empty, float("-inf"), lse2 * 0.6931471805599453)
    o_row = q_row * SPLITS + split  # [BLOCK_HEADS]
    tl.store(o_ptr + o_row[:, None] * L + offs_l[None, :], out,
             mask=mask_h[:, None] & mask_l[None, :])
    tl.store(lse_ptr + o_row, lse, mask=mask_h)


def mla_paged_decode_partials(
    q_lat, q_pe, latent_pages, block_tables, lengths, *, kv_lora_rank, scale,
    latent_scales=None, config: Config,
):
    """Partials `(o [B, N, splits, L] f32, lse [B, N, splits] f32)`; inputs validated.

    `scale` may be a Python float or a traced scalar; `kv_lora_rank` is `L`.
    """
    b, n, l = q_lat.shape
    _, p, lr = latent_pages.shape
    r = lr - kv_lora_rank
    fp8 = latent_scales is not None
    if not fp8:
        latent_scales = jnp.zeros((1,), jnp.float32)
    sub = p // latent_scales.shape[-1] if fp8 else p
    compute = jnp.dtype(config.fp8_compute) if fp8 else jnp.dtype(latent_pages.dtype)
    precision = "ieee" if compute == jnp.float32 else "tf32"
    splits = config.num_splits
    scale_log2 = (jnp.asarray(scale, jnp.float32) * LOG2E).reshape(1)
    o, lse = triton_call(
        q_lat.astype(compute),
        q_pe.astype(compute),
        latent_pages,
        block_tables.astype(jnp.int32),
        lengths.astype(jnp.int32),
        scale_log2,
        latent_scales,
        kernel=_mla_decode_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((b, n, splits, l), jnp.float32),
            jax.ShapeDtypeStruct((b, n, splits), jnp.float32),
        ),
        grid=(triton.cdiv(n, config.block_heads), b, splits),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        N=n,
        L=l,
        R=r,
        P=p,
        NUM_PAGES=latent_pages.shape[0],
        MAX_PAGES=block_tables.shape[-1],
        SPLITS=splits,
        SUB=sub,
        FP8=fp8,
        BLOCK_HEADS=config.block_heads,
        BLOCK_N=config.block_n,
        BLOCK_L=max(16, triton.next_power_of_2(l)),
        BLOCK_R=max(16, triton.next_power_of_2(r)),
        RELOAD_V=config.reload_value,
        PRECISION=precision,
        PAGE_TILES=config.page_tiles and p % config.block_n == 0,
    )
    return o, lse


def mla_paged_decode(q_lat, q_pe, latent_pages, block_tables, kv_lengths, *, kv_lora_rank, scale,
                     latent_scales=None, num_splits: int | None = None,
                     config: Config | None = None):
    """MLA decode through the kernel: `(o_lat [B, N, L] q_lat.dtype, lse [B, N] f32)`.

    `num_splits` (if given) overrides the config's; `config` defaults to `default_config`.
    """
    from attn.merge import triton as merge

    if config is None:
        config = default_config(q_lat.shape[0], q_lat.shape[1],
                                block_tables.shape[-1] * latent_pages.shape[1],
                                fp8=latent_scales is not None,
                                itemsize=jnp.dtype(latent_pages.dtype).itemsize)
    if num_splits is not None:
        config = dataclasses.replace(config, num_splits=num_splits)
    o, lse = mla_paged_decode_partials(q_lat, q_pe, latent_pages, block_tables, kv_lengths,
                                       kv_lora_rank=kv_lora_rank, scale=scale,
                                       latent_scales=latent_scales, config=config)
    if config.num_splits == 1:
        return o[:, :, 0].astype(q_lat.dtype), lse[:, :, 0]
    out, lse = merge.merge_partials(o, lse)
    return out.astype(q_lat.dtype), lse
