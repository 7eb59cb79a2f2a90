"""Triton block-sparse prefill: a flash forward that visits only the key blocks a head's mode
selects (0 full, 1 block mask, -1 streaming), Block-Sparse-Attention semantics.

The block selection is built before the launch: `reference.effective_block_mask` (XLA) gives
`[B, N, Tb, Sb]`, and `block_lists` (one Triton pass on a GPU, `_block_lists_kernel`; XLA
elsewhere) turns each (request, query head, query tile) row into its selected key blocks in
ascending order, their count, and how many of them every query of the tile sees whole (a prefix of
the list: the blocks wholly below the tile's first query and inside the keys). One program owns
`BLOCK_M` queries (a part of one query tile of `block_size`) of one query head of one request and
walks its list in steps of `BLOCK_N` keys: the steps of the whole blocks with no mask at all, then
the rest (the diagonal and the length tail) with the token-level causal and length rules. Online
softmax in base 2, fp32 accumulators. The work is thus proportional to the selected blocks: at
density `d` the kernel does about `d` of the dense kernel's work.

The walk: each part is one flat loop over the steps `i` of its blocks (`block_size // BLOCK_N`
steps per listed block, block `blocks[i // steps]`), like the key loop of the dense kernel
(`attn/dense/triton.py`), so Triton's software pipelining overlaps the K / V loads of the next
steps with the current step's math across block boundaries (a loop over blocks around a loop over
steps would pipeline only the inner steps and expose the load latency once per block). The block
index is loaded one step ahead and carried in the loop, so K / V are not second-level indirect
loads and keep the dense kernel's two-step prefetch. Unmasked steps load K / V without masks where
the head dims need none; the default launch is the dense forward's. ptxas (sm_90a, H = 128,
128 x 64 tiles, 8 warps, 3 stages): 197 registers, no spills, 128 KiB shared memory.
`block_lists` builds the lists with one scatter (slots from a cumulative sum) rather than a
stable argsort of each of the `B N Tb` rows; on a GPU one Triton pass does the same per row
(S64K: 0.09 ms against 0.16 for the XLA form).

Programs are per query head (the modes are per query head, so GQA siblings may walk different
lists), ordered KV head by KV head: the siblings of a KV head vary fastest, then the query tiles
(longest lists first), then the requests. The programs in flight thus read one KV head's K / V
(32 MB at S64K, H128 bf16: it stays in L2); ordered heads fastest they would spread over all
KV heads' K / V and, at 10% random masks, come from DRAM (H100 density 0.1: S64K 7.63 ms against
8.64, S128K 30.2 against 34.6; density 1.0 the same). Folding
the `G` heads of a KV head into the query tile (as the dense kernel does) is not done: with
`BLOCK_M` rows per program either way, a folded program covers `BLOCK_M / G` tokens of `G` heads,
so the number of programs, the K / V tiles each loads and the FLOPs per loaded byte are the same;
it only pays for short query tiles (decode-like shapes).
Query positions: `kv_len - q_len + t` (queries are the last `q_len` of `kv_len` keys); query rows
past `q_len` give 0 / -inf.

Supports: any group size, `H` / `Hv` up to 256 (padded and masked), bf16 / f16 / f32, block sizes
that are powers of two >= 16, `q_len <= kv_len` or not. Gradients: `differentiable` gives this
forward (and the Mosaic GPU one) the Triton backward of `attn/block_sparse/_triton_bwd.py`, whose
work is proportional to the selected blocks too.
Not supported (`supports` says why; `"auto"` then runs XLA): head dims over 256, block sizes
under 16.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn import _checks
from attn._harness import on_gpu, triton_call
from attn._op import device_facts
from attn.block_sparse import _triton_bwd, reference
from attn.dense._flash_tiles import (
    _load,
    _masked_softmax_step,
    _whole_softmax_step,
    wide_rows,
    wide_rows_query_tile,
)

LOG2E = math.log2(math.e)
_MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration: `block_m` queries x `block_n` keys per step (each capped at the
    block size, which they must then divide)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    # The unmasked (whole-block) loop warp-specialised (Triton's Hopper pass; >= 8 warps), as
    # the dense kernel's `Config.warp_specialize`.
    warp_specialize: bool = False
    # Programs ordered KV head by KV head (siblings fastest); False: heads fastest (the module
    # docstring says why and what it measured).
    kv_head_major: bool = True
    # The backward (`_triton_bwd.py`): dQ walks `dq_block_n` keys a step over `dq_block_m`
    # queries; dK / dV walks `dkv_block_m` queries a step over `dkv_block_n` keys.
    dq_block_m: int = 128
    dq_block_n: int = 64
    dq_num_warps: int = 8
    dq_num_stages: int = 3
    dkv_block_m: int = 64
    dkv_block_n: int = 128
    dkv_num_warps: int = 8
    dkv_num_stages: int = 4
    # Programs with more than a fair share of the dK / dV steps cut into chunks whose partial
    # sums are added by a second kernel (`_triton_bwd.dkv_schedule`); False: never cut.
    dkv_split: bool = True

    def __post_init__(self):
        _checks.check_launch_config(
            self, tiles=("block_m", "block_n", "dq_block_m", "dq_block_n", "dkv_block_m",
                         "dkv_block_n"),
            warps=("num_warps", "dq_num_warps", "dkv_num_warps"),
            stages=("num_stages", "dq_num_stages", "dkv_num_stages"))


def default_config(head_dim: int, value_head_dim: int | None = None, itemsize: int = 2) -> Config:
    """128 queries x 128 keys, 8 warps, 3 stages (224 KiB of shared memory at H = 128): H100,
    N32/K8/H128 bf16, S64K at density 0.1 7.63-7.82 ms (128 x 64 tiles or 4 stages 1-4% slower,
    warp specialisation +-0.5%); density 1.0 at 1.09-1.11x the dense flash. Backward: dQ 128
    queries x 64 keys, 8 warps, 3 stages (H100 S32K density 0.1: 2.35 ms, against 2.68 with 2
    stages and 5.52 with 64 x 64); dK / dV 128 keys x 64 queries, 8 warps, 4 stages (192 KiB),
    heavy programs cut (forward + backward at S32K / S64K 8.00 / 29.93 ms, against 8.01-8.11 /
    30.66-30.72 with 3 stages and 8.41 / 31.06 with 5; at S32K 2 stages take 1.04x as long as 3,
    uncut programs 1.16x, 32 x 32 tiles over 4 warps 1.9x). Wide rows
    (`dense._flash_tiles.wide_rows`: H > 128 in 16-bit types, H > 64 in float32) take 32-key
    steps and 2 stages, as dense does, so the K / V stages fit in shared memory (over 512 bytes,
    float32 at H256, with 64-row forward and 32-row dQ tiles); float32 at H <= 64 takes 2 forward
    stages (3 need 256 KiB at H64; `python -m experiments.tools.hopper_fit` prints each launch's
    shared memory).
    `python -m experiments.tools.sweep block_sparse_prefill` times alternatives."""
    if wide_rows(head_dim, value_head_dim, itemsize):
        block_m = wide_rows_query_tile(head_dim, value_head_dim, itemsize)
        return Config(block_m=block_m, block_n=32, num_stages=2, dq_block_m=block_m // 2,
                      dq_block_n=32, dq_num_stages=2, dkv_block_m=32, dkv_block_n=32,
                      dkv_num_stages=2)
    if itemsize > 2:
        return Config(num_stages=2)
    return Config()


def block_lists(
    eff: jax.Array, q_lengths: jax.Array, kv_lengths: jax.Array, block_size: int, *,
    use_kernel: bool | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per (request, head, query tile): selected key blocks ascending, count, whole-block count.

    Args:
      eff: `[B, N, Tb, Sb]` bool, `reference.effective_block_mask`.
      q_lengths, kv_lengths: `[B]` int32.
      block_size: the block size.
      use_kernel: `_block_lists_kernel` (one Triton pass: each row read once, its lists written
        once) instead of the XLA formulation; default: on a GPU. Both give the same arrays.

    Returns:
      `(blocks [B, N, Tb, Sb] int32, count [B, N, Tb] int32, whole [B, N, Tb] int32)`:
      `blocks[..., :count]` are the selected blocks in ascending order (the rest is padding), and
      the first `whole` of them are seen whole by every query of the tile (no mask needed).
    """
    if on_gpu() if use_kernel is None else use_kernel:
        return _block_lists_triton(eff, q_lengths, kv_lengths, block_size)
    return _block_lists_xla(eff, q_lengths, kv_lengths, block_size)


def _block_lists_xla(eff, q_lengths, kv_lengths, block_size):
    sb = eff.shape[-1]
    j = jnp.arange(sb, dtype=jnp.int32)
    count = jnp.sum(eff, axis=-1, dtype=jnp.int32)
    # The stable partition "selected first, then the rest", both ascending (what a stable argsort
    # of ~eff gives), as one scatter of a permutation: selected block j goes to slot
    # cumsum(eff)[j] - 1, an unselected one after all selected ones, to count + (j - cumsum[j]).
    # Cheaper than a sort of every row (a scan and a write of each entry).
    if eff.size <= 2**31 - 1:
        cs = jnp.cumsum(eff, axis=-1, dtype=jnp.int32)
        slot = jnp.where(eff, cs - 1, count[..., None] + j - cs)
        row = jnp.arange(eff.size // sb, dtype=jnp.int32).reshape(eff.shape[:-1] + (1,))
        blocks = jnp.zeros((eff.size,), jnp.int32).at[(row * sb + slot).reshape(-1)].set(
            jnp.broadcast_to(j, eff.shape).reshape(-1), unique_indices=True,
            mode="promise_in_bounds").reshape(eff.shape)
    else:  # flat slots would overflow int32
        blocks = jnp.argsort(~eff, axis=-1, stable=True).astype(jnp.int32)
    r = jnp.arange(eff.shape[2], dtype=jnp.int32)
    first_pos = (kv_lengths - q_lengths)[:, None] + r[None, :] * block_size  # [B, Tb]
    # Block j is whole for every query at position >= first_pos iff (j + 1) * bs <= first_pos + 1,
    # and inside the keys iff (j + 1) * bs <= kv_len.
    limit = jnp.minimum(first_pos + 1, kv_lengths[:, None]) // block_size  # [B, Tb]
    whole = jnp.sum(eff & (j < limit[:, None, :, None]), axis=-1, dtype=jnp.int32)
    return blocks, count, whole


_LIST_ROWS = 8  # rows of the block mask per program of `_block_lists_kernel`


@triton.jit
def _block_lists_kernel(
    eff_ptr,  # [ROWS_ALL, SB] int8 effective block mask, rows (b, n, r)
    q_len_ptr,  # [B] int32
    kv_len_ptr,  # [B] int32
    blocks_ptr,  # [ROWS_ALL, SB] int32, out
    count_ptr,  # [ROWS_ALL] int32, out
    whole_ptr,  # [ROWS_ALL] int32, out
    ROWS_ALL: tl.constexpr,
    N: tl.constexpr,
    TB: tl.constexpr,
    SB: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """`_block_lists_xla` for `ROWS` rows: the same stable partition (selected blocks first,
    then the rest, both ascending) as one scatter of each row's permutation, and the counts."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    j = tl.arange(0, BLOCK_S)  # [BLOCK_S]
    row_ok = rows < ROWS_ALL
    ok = row_ok[:, None] & (j < SB)[None, :]
    base = rows.to(tl.int64)[:, None] * SB
    sel = tl.load(eff_ptr + base + j[None, :], mask=ok, other=0).to(tl.int32)
    cs = tl.cumsum(sel, axis=1)
    count = tl.sum(sel, axis=1)  # [ROWS]
    slot = tl.where(sel != 0, cs - 1, count[:, None] + j[None, :] - cs)
    tl.store(blocks_ptr + base + slot, tl.broadcast_to(j[None, :], (ROWS, BLOCK_S)), mask=ok)
    b = rows // (N * TB)
    q_len = tl.load(q_len_ptr + b, mask=row_ok, other=0)
    kv_len = tl.load(kv_len_ptr + b, mask=row_ok, other=0)
    first_pos = kv_len - q_len + (rows % TB) * BS
    # Floor division as XLA's (`limit` may be negative only when no block is whole anyway).
    reach = tl.minimum(first_pos + 1, kv_len)
    limit = tl.where(reach >= 0, reach // BS, -((BS - 1 - reach) // BS))
    whole = tl.sum(sel * (j[None, :] < limit[:, None]).to(tl.int32), axis=1)
    tl.store(count_ptr + rows, count, mask=row_ok)
    tl.store(whole_ptr + rows, whole, mask=row_ok)


def _block_lists_triton(eff, q_lengths, kv_lengths, block_size):
    b, n, tb, sb = eff.shape
    rows = b * n * tb
    blocks, count, whole = triton_call(
        eff.reshape(rows, sb).astype(jnp.int8), q_lengths.astype(jnp.int32),
        kv_lengths.astype(jnp.int32),
        kernel=_block_lists_kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, sb), jnp.int32),
                   jax.ShapeDtypeStruct((rows,), jnp.int32),
                   jax.ShapeDtypeStruct((rows,), jnp.int32)),
        grid=(triton.cdiv(rows, _LIST_ROWS),),
        num_warps=4,
        ROWS_ALL=rows, N=n, TB=tb, SB=sb, BS=block_size, ROWS=_LIST_ROWS,
        BLOCK_S=max(16, triton.next_power_of_2(sb)),
    )
    return blocks.reshape(eff.shape), count.reshape(eff.shape[:3]), whole.reshape(eff.shape[:3])


@triton.jit
def _visit(acc, l, m, bad, j, q, k_base, v_base, pos, blocks, i, kv_len,
           SCALE_LOG2: tl.constexpr, K: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
           SB: tl.constexpr, BS: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_H: tl.constexpr, BLOCK_HV: tl.constexpr, PRECISION: tl.constexpr):
    """Step `i` of a list walk: `BLOCK_N` keys, sub-step `i % (BS // BLOCK_N)` of the listed block
    `j` (entry `i // (BS // BLOCK_N)`); MASKED applies the causal and length rules, and zeroes a
    non-finite value, marking in `bad` the rows that see it (they become NaN at the end: a 0
    weight would still give 0 * NaN in the rows that do not). Returns the block of step `i + 1`
    too, loaded one step ahead (see the kernel)."""
    SPB: tl.constexpr = BS // BLOCK_N  # steps per block
    start = tl.multiple_of(j * BS + (i % SPB) * BLOCK_N, BLOCK_N)
    j_next = tl.load(blocks + tl.minimum((i + 1) // SPB, SB - 1))
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    cols = start + offs_n  # [BLOCK_N] key positions
    in_kv = cols < kv_len
    k = _load(k_base + cols[:, None] * (K * H) + offs_h[None, :], in_kv, offs_h < H, MASKED,
              BLOCK_H != H)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] f32
    if MASKED:
        visible = (cols[None, :] <= pos[:, None]) & in_kv[None, :]
        p, alpha, m_new = _masked_softmax_step(qk, m, visible, SCALE_LOG2)
    else:
        p, alpha, m_new = _whole_softmax_step(qk, m, SCALE_LOG2)
    v = _load(v_base + cols[:, None] * (K * HV) + offs_hv[None, :], in_kv, offs_hv < HV, MASKED,
              BLOCK_HV != HV)
    if MASKED:
        v_bad = ~(tl.abs(v.to(tl.float32)) < float("inf"))  # [BLOCK_N, BLOCK_HV]
        col_bad = tl.max(v_bad.to(tl.int32), 1)  # [BLOCK_N]
        bad = tl.maximum(bad, tl.max((visible & (col_bad > 0)[None, :]).to(tl.int32), 1))
        v = tl.where(v_bad, 0.0, v)
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
    return acc, l, m_new, bad, j_next


@triton.jit
def _block_sparse_kernel(
    q_ptr,  # [B, T, N, H]
    k_ptr,  # [B, S, K, H]
    v_ptr,  # [B, S, K, HV]
    q_len_ptr,  # [B] int32
    kv_len_ptr,  # [B] int32
    blocks_ptr,  # [B, N, TB, SB] int32 selected key blocks, ascending
    count_ptr,  # [B, N, TB] int32
    whole_ptr,  # [B, N, TB] int32
    o_ptr,  # [B, T, N, HV]
    lse_ptr,  # [B, T, N] f32
    SCALE_LOG2: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    TB: tl.constexpr,
    SB: tl.constexpr,
    BS: tl.constexpr,
    NUM_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    KV_HEAD_MAJOR: tl.constexpr = False,
):
    # The last query tiles (longest lists) first. Heads fastest: GQA siblings run together.
    # KV_HEAD_MAJOR: siblings fastest, then query tiles, then requests, then KV heads, so the
    # programs in flight walk the blocks of one KV head (its K / V, 32 MB at S64K H128 bf16, can
    # stay in L2; heads fastest spreads them over all K heads' K / V).
    N: tl.constexpr = K * G
    pid = tl.program_id(0)
    if KV_HEAD_MAJOR:
        kh = pid // (G * NUM_M * B)
        b = (pid // (G * NUM_M)) % B
        mt = NUM_M - 1 - (pid // G) % NUM_M
        n = kh * G + pid % G
    else:
        n = pid % N
        b = (pid // N) % B
        mt = NUM_M - 1 - pid // (N * B)
        kh = n // G
    r = (mt * BLOCK_M) // BS  # the query tile (block row)

    toks = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_len = tl.minimum(tl.maximum(tl.load(q_len_ptr + b), 0), T)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), S)
    row_ok = toks < q_len
    pos = kv_len - q_len + toks
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    q_rows = b.to(tl.int64) * (T * N) + toks * N + n  # [BLOCK_M] of [B * T * N]
    q = tl.load(q_ptr + q_rows[:, None] * H + offs_h[None, :],
                mask=row_ok[:, None] & (offs_h < H)[None, :], other=0.0)
    k_base = k_ptr + b.to(tl.int64) * (S * K * H) + kh * H
    v_base = v_ptr + b.to(tl.int64) * (S * K * HV) + kh * HV

    list_row = (b * N + n) * TB + r
    count = tl.load(count_ptr + list_row)
    whole = tl.load(whole_ptr + list_row)
    blocks = blocks_ptr + list_row.to(tl.int64) * SB

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_HV], tl.float32)
    bad = tl.zeros([BLOCK_M], tl.int32)
    # One flat loop per part over the (listed block, sub-step) steps, so Triton's software
    # pipelining (num_stages) overlaps the K / V loads of the next steps with this step's math
    # across block boundaries (a nested loop over the BS // BLOCK_N steps of a block could only
    # overlap inside a block). The block index is loaded one step ahead and carried: a load of it
    # in the step itself makes it a second-level indirect load, for which Triton's pipeliner
    # halves the K / V prefetch distance (seen in the sm_90 TTGIR at 3 stages).
    SPB: tl.constexpr = BS // BLOCK_N
    j = tl.load(blocks)
    for i in tl.range(0, whole * SPB, warp_specialize=WARP_SPECIALIZE):  # seen whole: no mask
        acc, l, m, bad, j = _visit(acc, l, m, bad, j, q, k_base, v_base, pos, blocks, i, kv_len,
                                   SCALE_LOG2, K, H, HV, SB, BS, False, BLOCK_N, BLOCK_H,
                                   BLOCK_HV, PRECISION)
    j = tl.load(blocks + tl.minimum(whole, SB - 1))
    for i in range(whole * SPB, count * SPB):  # the diagonal and the length tail: token masks
        acc, l, m, bad, j = _visit(acc, l, m, bad, j, q, k_base, v_base, pos, blocks, i, kv_len,
                                   SCALE_LOG2, K, H, HV, SB, BS, True, BLOCK_N, BLOCK_H,
                                   BLOCK_HV, PRECISION)

    empty = (l == 0.0) | (toks >= q_len)
    safe_l = tl.where(empty, 1.0, l)
    out = tl.where(empty[:, None], 0.0, acc / safe_l[:, None])
    out = tl.where(bad[:, None] > 0, float("nan"), out)
    lse = tl.where(empty, float("-inf"), (m + tl.log2(safe_l)) * 0.6931471805599453)
    store_ok = toks < T
    tl.store(o_ptr + q_rows[:, None] * HV + offs_hv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=store_ok[:, None] & (offs_hv < HV)[None, :])
    tl.store(lse_ptr + q_rows, lse, mask=store_ok)


def supports(args: dict, config=None) -> list[str]:
    """Why this kernel cannot run `attn.block_sparse.block_sparse_attention`'s validated `args`."""
    del config
    h, hv, block_size = args["q"].shape[-1], args["v"].shape[-1], args["block_size"]
    reasons = []
    if max(h, hv) > _MAX_HEAD_DIM:
        reasons.append(f"head dims H={h}, Hv={hv} over {_MAX_HEAD_DIM}")
    if block_size < 16:
        reasons.append(f"{block_size=}: blocks of at least 16 tokens")
    return reasons


def _launch(q, k, v, blocks, count, whole, q_lengths, kv_lengths, *, scale, block_size, config):
    b, t, n, h = q.shape
    s, kh, hv = k.shape[1], k.shape[2], v.shape[-1]
    block_m, block_n = min(config.block_m, block_size), min(config.block_n, block_size)
    num_m = triton.cdiv(t, block_m)
    return triton_call(
        q, k, v, q_lengths, kv_lengths, blocks, count, whole,
        kernel=_block_sparse_kernel,
        out_shape=(jax.ShapeDtypeStruct((b, t, n, hv), q.dtype),
                   jax.ShapeDtypeStruct((b, t, n), jnp.float32)),
        grid=(num_m * b * n,),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        SCALE_LOG2=scale * LOG2E, B=b, T=t, S=s, K=kh, G=n // kh, H=h, HV=hv,
        TB=blocks.shape[2], SB=blocks.shape[3], BS=block_size, NUM_M=num_m, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_H=max(16, triton.next_power_of_2(h)),
        BLOCK_HV=max(16, triton.next_power_of_2(hv)),
        PRECISION="ieee" if q.dtype == jnp.float32 else "tf32",
        WARP_SPECIALIZE=config.warp_specialize and config.num_warps >= 8,
        KV_HEAD_MAJOR=config.kv_head_major,
    )


def clamped_lengths(q_lengths, kv_lengths, b: int, t: int, s: int):
    """`[B]` int32 lengths clamped to `[0, T]` / `[0, S]` (None: full), as the reference does."""
    q_len = jnp.clip(jnp.broadcast_to(
        jnp.asarray(t if q_lengths is None else q_lengths, jnp.int32), (b,)), 0, t)
    kv_len = jnp.clip(jnp.broadcast_to(
        jnp.asarray(s if kv_lengths is None else kv_lengths, jnp.int32), (b,)), 0, s)
    return q_len, kv_len


def _effective(q, k, head_mask_type, block_mask, sink_blocks, local_blocks, q_len, kv_len,
               block_size):
    """The effective block mask (`reference.effective_block_mask`)."""
    return reference.effective_block_mask(
        head_mask_type, block_mask, num_q_tokens=q.shape[1], num_kv_tokens=k.shape[1],
        block_size=block_size, sink_blocks=sink_blocks, local_blocks=local_blocks,
        q_lengths=q_len, kv_lengths=kv_len)


def _forward(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, q_len, kv_len, *,
             block_size, scale, config):
    eff = _effective(q, k, head_mask_type, block_mask, sink_blocks, local_blocks, q_len, kv_len,
                     block_size)
    blocks, count, whole = block_lists(eff, q_len, kv_len, block_size)
    return _launch(q, k, v, blocks, count, whole, q_len, kv_len, scale=scale,
                   block_size=block_size, config=config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13))
def differentiable(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, q_len, kv_len,
                   forward, block_size, scale, config, fused_backward=None):
    """`forward(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, q_len, kv_len)`
    (this module's kernel or the Mosaic one: `(out, lse)`) with the Triton backward
    (`_triton_bwd.py`, launched with `config`) as its VJP, or `fused_backward(q, k, v, out, lse,
    d_out, d_lse, eff, scale=)` (`attn/block_sparse/mosaic_bwd.py`) when given. Lengths clamped
    `[B]` int32, counts `[N]` int32."""
    return forward(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, q_len, kv_len)


def _differentiable_fwd(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, q_len,
                        kv_len, forward, block_size, scale, config, fused_backward):
    out, lse = forward(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, q_len,
                       kv_len)
    return (out, lse), (q, k, v, out, lse, head_mask_type, block_mask, sink_blocks,
                        local_blocks, q_len, kv_len)


def _differentiable_bwd(forward, block_size, scale, config, fused_backward, res, cotangents):
    del forward
    q, k, v, out, lse, head_mask_type, block_mask, sink_blocks, local_blocks, q_len, kv_len = res
    d_out, d_lse = cotangents
    # The lists are rebuilt rather than kept from the forward: `[B, N, Tb, Sb]` int32 of memory
    # against a few XLA passes over the block mask.
    eff = _effective(q, k, head_mask_type, block_mask, sink_blocks, local_blocks, q_len, kv_len,
                     block_size)
    if fused_backward is not None:
        dq, dk, dv = fused_backward(q, k, v, out, lse, d_out, d_lse, eff, scale=scale)
        return dq, dk, dv, None, None, None, None, None, None
    blocks, count, whole = block_lists(eff, q_len, kv_len, block_size)
    dq, dk, dv = _triton_bwd.backward(
        q, k, v, out, lse, d_out, d_lse, eff, blocks, count, whole, q_len, kv_len,
        block_size=block_size, scale=scale, config=config, num_sms=device_facts().num_sms)
    return dq, dk, dv, None, None, None, None, None, None


differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "config"))
def _block_sparse(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, q_lengths,
                  kv_lengths, *, block_size, scale, config):
    b, t = q.shape[:2]
    q_len, kv_len = clamped_lengths(q_lengths, kv_lengths, b, t, k.shape[1])
    forward = functools.partial(_forward, block_size=block_size, scale=scale, config=config)
    return differentiable(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, q_len,
                          kv_len, forward, block_size, scale, config)


def block_sparse_attention(q, k, v, head_mask_type, block_mask=None, *, block_size=128,
                           sink_blocks=1, local_blocks=16, q_lengths=None, kv_lengths=None,
                           scale=None, config: Config | None = None):
    """Block-sparse prefill through the kernel, differentiable through the Triton backward
    (`_triton_bwd.py`); arguments as `attn.block_sparse.block_sparse_attention` (validated
    there, and `supports` empty; `sink_blocks` / `local_blocks` ints or `[N]` int32), plus
    `config` (default: `default_config`).

    Returns:
      `(out [B, T, N, Hv] in q's dtype, lse [B, T, N] float32)`.
    """
    n = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if config is None:
        config = default_config(q.shape[-1], v.shape[-1], jnp.dtype(q.dtype).itemsize)
    per_head = [jnp.broadcast_to(jnp.asarray(x, jnp.int32), (n,))
                for x in (sink_blocks, local_blocks)]
    return _block_sparse(q, k, v, jnp.asarray(head_mask_type, jnp.int32), block_mask, *per_head,
                         q_lengths, kv_lengths, block_size=block_size, scale=scale,
                         config=config)
