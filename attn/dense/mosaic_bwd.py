"""Mosaic GPU flash backward (Pallas, Hopper): dQ, dK and dV in one kernel (FlashAttention-3's
design), for the cases the Mosaic forward (`attn/dense/mosaic.py`) runs at `H == 128`.

Why one kernel: the Triton backward (`attn/dense/_flash_bwd.py`) runs a dQ kernel and a dK / dV
kernel, which recompute `S = Q Kᵀ` and `dP = dO Vᵀ` twice: 7 tile products per (query tile, key
tile) pair against 5 here. The price of the fused form is that dQ is summed across programs:
every step's partial dQ goes from shared memory to a float32 accumulator in global memory by a
TMA reduce-add (one bulk operation per tile, done in L2), which the Triton route through
jax-triton cannot express (its per-element atomics are slower than the second kernel).

The kernel (`backward_call`) walks whatever each program's `Walk` lists: a key tile of one KV
head and the query tiles that see it, in runs of whole and masked steps. `backward` is the dense
schedule below; `attn/block_sparse/mosaic_bwd.py` walks block-sparse lists with the same kernel.

Programs: one per (key tile of `2 * block_kv` keys, KV head, request). Mosaic GPU launches the
grid's last axis fastest. By default the order is requests, then KV heads, then key tiles, the
first (longest causal, and the sink tile) first; without sinks, from
`Config.key_tiles_fastest_from` keys on, key tiles go fastest, so that the programs running
together walk the same query tiles a couple of steps apart and share them in L2 (Speed).
`key_tiles_fastest` decides. Two warp groups, each owning `block_kv` keys: their K / V rows stay in
shared memory and their dK / dV accumulate in registers over every query tile of every query head of
the KV head (the heads of a group sum in registers: no dK / dV reduction afterwards). The query
tiles (Q, dO and the rows' `lse`, `delta`) stream through a ring of `stages` shared-memory slots;
group 0 issues their TMA copies.

Why two warp groups and no copy-only one (the forward's layout): ptxas allocates registers for
the launch's thread count, not for what `setmaxnreg` grants later, so with three groups the
compute code would be compiled into 168 registers, of which dK and dV alone take 128: it spills
and ptxas serialises the wgmmas. With two groups there are 255 per thread.

A step, per group (keys `k`, the step's `block_q` query rows `q`; transposed products keep the
keys on the wgmma's M side, so dK / dV accumulate in the wgmma layout):

    Sᵀ = K Qᵀ - lse / scale,  dPᵀ = V dOᵀ - delta     (issued together)
    Pᵀ = exp2(Sᵀ · scale · log2 e)                     (while dPᵀ runs)
    dV += Pᵀ dO                                        (Pᵀ from registers; runs while dSᵀ is made)
    dSᵀ = Pᵀ ∘ dPᵀ -> shared memory; both groups meet
    dQ[:, half] = dS K[:, half],  dK += dSᵀ Q          (issued together; each group one half of H)
    dQ half -> shared memory (while dK runs) -> TMA reduce-add into the float32 dQ (in flight
    during the next step)

The row statistics enter as the first values of the Sᵀ and dPᵀ accumulators (each query's
`-lse / scale` and `-delta` down its column): the products subtract them, and no row vector is
live past the step's start. dK / dV live in wgmma accumulators across the whole walk (one
`run_state`): they are never read back into values between steps; the dQ accumulator is scoped to
the dQ product, after Sᵀ and dPᵀ are dead. `delta = rowsum(dO ∘ O) - dlse` (the lse cotangent
folds in there) and the base-2 `lse₂` come from one Triton pass before the kernel
(`_stats_kernel`, which also zeroes the float32 dQ accumulator: XLA takes three passes for the
same), and `dQ · scale` is cast after it. Steps are *whole* (every pair visible: no mask) or
*masked*, `Pᵀ` selected rather than multiplied so a non-finite key there reaches no gradient (a
non-finite value there reaches `dSᵀ` through `dPᵀ`, as it reaches the forward's output:
`attn/dense/mosaic.py`'s note).
`query_ranges` splits each key tile's query tiles into runs, and a masked run's rule keeps only
the terms its tiles need (`run_visible`): the causal diagonal (`key <= pos` once the window spans
the tile), the window's far edge (no causal term) and, for a key tile holding sink and window
keys, the tiles past the window (`key < sinks`, no positions). Both are checked on the CPU
against brute-force visibility.

Not deterministic: the reduce-adds land in the order the programs reach them, so dQ's float32
rounding can differ from run to run. `attn.dense.mosaic.Config(fused_backward=False)` gives the
Triton backward, which is deterministic (each dQ row summed by one program in a fixed order).

On the CPU the kernel runs in Pallas's Mosaic GPU interpreter (`Config(interpret=True)`): the
products become `jnp` products of the same shared-memory tiles, and the interpreter has no TMA
reduction, so each program stores its partial dQ tiles into its own slice of a
`[key tiles, B, T, N, H]` buffer that is summed afterwards (small shapes only).

Speed (H100, N32 / K8 H128 bf16, forward + backward with the Mosaic forward,
benchmarks/prefill.json, the median of five rounds interleaved with cuDNN): causal S8K / 16K / 32K
1.05x / 1.03x / 0.99x cuDNN's (backward 463 / 519 / 508 TFLOP/s against cuDNN's 441 / 517 / 521);
window 2048 + 64 sinks at S8K / S32K 1.01x / 1.02x cuDNN's window without sinks (ours without sinks
1.08x / 1.09x); S128K 1.02x (no S x S buffer; backward 536 TFLOP/s against 533). The ratios move by
up to 10% between rounds (causal S32K 0.97x-1.16x): at S32K the two are at parity. From S16K on the
GPU holds its 700 W power limit (SM clock 1.5-1.7 GHz of 1.98, the rows' `gpu_clocks`), so a call's
time follows the energy it draws as much as its cycles: over 1.5 s of back-to-back calls at causal
S32K, ours and cuDNN's draw 39-41 J a call each on one H100, while on another ours draws 42-45 J
and takes 1.08x cuDNN's time. The Triton backward takes 1.1-1.2x as long at causal S8K-32K.

The defaults, each the faster of the measured alternatives (forward + backward):

- Registers are the limit: at 255 per thread ptxas spills 96 bytes causal, 240 with a window and
  sinks (`MOSAIC_GPU_DUMP_PTXAS=1`), most of it in the masked steps' mask code. Hence `lse` /
  `delta` as the accumulators' starts (as per-step row vectors: 2-6% slower) and the dQ
  accumulator scoped to its product (scoped to the step: 0.4-3% slower).
- Launch order: Q / dO / dQ tiles are reused in L2 only while the programs walking them stay
  close. Key tiles fastest is 1% / 3-4% faster at causal S16K / S32K (at S128K KV heads fastest
  varies 0.94-1.32 s from call to call); KV heads fastest is 3% faster at S8K, and always taken
  with sinks (`key_tiles_fastest`). Each head's query tiles go up from the diagonal.
- Two shared-memory slots for the query tiles (`stages=3` is slower).
- With a window and sinks, a key tile holding sinks is walked by every query tile (`G T /
  block_q` steps, against `G (window + 2 block_kv) / block_q` for the others) and stays one
  program: cut per query head, with dK / dV partial sums added afterwards, S8K is 5% slower and
  the causal cases 1-2% slower for the extra index arithmetic.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from jax import lax

from attn._harness import triton_call

LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """`block_q` query rows a step, `block_kv` keys per warp group (a program owns
    `2 * block_kv`), `stages` query-tile slots in shared memory; from `key_tiles_fastest_from`
    keys on, programs launch key tile fastest rather than KV head fastest (see Speed)."""

    block_q: int = 64
    block_kv: int = 64
    stages: int = 2
    key_tiles_fastest_from: int = 16384
    interpret: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            if getattr(self, name) != 64:
                raise ValueError(f"{name}={getattr(self, name)} must be 64 (one wgmma M)")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages} must be >= 2 (one slot loads while one "
                             f"is read)")


def _cdiv(a, b):
    return (a + b - 1) // b


def key_tiles_fastest(s: int, sinks: int, config: Config) -> bool:
    """Whether programs launch key tile fastest: from `config.key_tiles_fastest_from` keys on,
    and never with sinks. A key tile holding sinks is walked by every query tile, `S / (window +
    2 block_kv)` times as many steps as the others; key tile fastest would start the last KV
    head's sink tile near the end of the launch, and the backward would wait for it (H100, window
    2048 + 64 sinks, S16K / S32K: 1.37x / 1.39x the time of KV head fastest, which starts every
    sink tile first)."""
    return s >= config.key_tiles_fastest_from and sinks == 0


def query_ranges(k0, keys: int, *, block_q: int, q_len: int, causal: bool, window: int,
                 sinks: int):
    """Query tiles (`block_q` rows) that see any of the keys `[k0, k0 + keys)`: `(lo, full_lo,
    full_hi, sinks_lo, hi)`, of which `[full_lo, full_hi)` see all of them whole, `[sinks_lo,
    hi)` exactly the sink keys among them (a tile holding sink and window keys, past the
    window), and the rest partly (masked steps). `k0` may be traced. Causal assumes queries at
    positions `0..q_len-1` (no offset)."""
    num_tiles = q_len // block_q
    if not causal:
        return 0, 0, num_tiles, num_tiles, num_tiles
    last = k0 + keys - 1
    lo = jnp.minimum(k0 // block_q, num_tiles)
    full_lo = jnp.clip(_cdiv(last, block_q), lo, num_tiles)  # first tile with every row >= last
    if window <= 0:
        return lo, full_lo, num_tiles, num_tiles, num_tiles
    # Rows up to `key + window - 1` see a non-sink key; sink keys stay visible to every row.
    hi = jnp.where(k0 < sinks, num_tiles,
                   jnp.clip((last + window - 1) // block_q + 1, lo, num_tiles))
    full_lo = jnp.minimum(full_lo, hi)
    # Whole while the tile's last row still sees the first key: `row - window < k0`.
    window_hi = jnp.clip(_cdiv(k0 + window - block_q + 1, block_q), full_lo, hi)
    full_hi = jnp.where(last < sinks, hi, jnp.where(k0 < sinks, full_lo, window_hi))
    # Past `last + window` every row sees none of the tile's window keys, only its sinks.
    mixed = (k0 < sinks) & (last >= sinks)
    sinks_lo = jnp.where(mixed, jnp.clip(_cdiv(last + window, block_q), full_hi, hi), hi)
    return lo, full_lo, full_hi, sinks_lo, hi


def run_visible(run: str, pos, key, *, causal: bool, window: int, sinks: int, keys: int,
                block_q: int):
    """Which (query position, key) pairs of a masked run's steps are visible: the token rule
    without the terms that every pair of the run satisfies (fewer instructions and registers in
    the step). Runs (`query_ranges`): "diagonal" `[lo, full_lo)`, "edge" (the window's far edge)
    `[full_hi, sinks_lo)`, "sinks" `[sinks_lo, hi)`."""
    if run == "sinks":  # every row is past the window: only the sink keys
        return key < sinks
    if run == "edge":  # every row is at or past the tile's last key: causal holds
        far = key > pos - window
        return far | (key < sinks) if sinks else far
    vis = key <= pos if causal else key >= 0
    # The diagonal tiles' rows end at the tile's last key (`keys` is a multiple of `block_q`),
    # so with `window >= keys` none of them is past the window of any of its keys.
    if run == "diagonal" and window >= keys:
        return vis
    if window > 0:
        vis &= (key > pos - window) | (key < sinks)
    return vis


def row_stats(out, lse, d_out, d_lse, *, block_q: int):
    """The rows' `[B, N, T / block_q, 2, block_q]` float32 statistics, the kernel's layout: the
    base-2 lse of the scaled scores (+inf for a row that sees nothing: P = 0) and `delta =
    rowsum(dO ∘ O) - dlse` (the lse cotangent folds in there). `_stats_kernel` is the same in one
    pass."""
    b, t, n, _ = out.shape
    delta = jnp.einsum("btnh,btnh->bnt", d_out.astype(jnp.float32), out.astype(jnp.float32))
    delta = delta - jnp.swapaxes(d_lse, 1, 2)
    lse2 = jnp.swapaxes(jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf), 1, 2)
    shape = (b, n, t // block_q, block_q)
    return jnp.stack([lse2.reshape(shape), delta.reshape(shape)], axis=3)


@triton.jit
def _stats_kernel(o_ptr, do_ptr, lse_ptr, dlse_ptr, stats_ptr, dq_ptr, T: tl.constexpr,
                  N: tl.constexpr, H: tl.constexpr, BLOCK_Q: tl.constexpr,
                  LOG2E_: tl.constexpr):
    """One (query tile, head, request): its `row_stats` tile and zeros over its tile of the
    float32 dQ accumulator (`[B, N, T / BLOCK_Q, BLOCK_Q * H]`), in one pass."""
    qt, n, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = (b.to(tl.int64) * T + qt * BLOCK_Q + tl.arange(0, BLOCK_Q)) * N + n  # of [B * T * N]
    cols = tl.arange(0, H)
    o = tl.load(o_ptr + rows[:, None] * H + cols[None, :]).to(tl.float32)
    do = tl.load(do_ptr + rows[:, None] * H + cols[None, :]).to(tl.float32)
    lse = tl.load(lse_ptr + rows)
    finite = (lse == lse) & (tl.abs(lse) != float("inf"))
    tile = (b.to(tl.int64) * N + n) * (T // BLOCK_Q) + qt
    stats = stats_ptr + tile * (2 * BLOCK_Q) + tl.arange(0, BLOCK_Q)
    tl.store(stats, tl.where(finite, lse * LOG2E_, float("inf")))
    tl.store(stats + BLOCK_Q, tl.sum(o * do, 1) - tl.load(dlse_ptr + rows))
    tl.store(dq_ptr + tile * (BLOCK_Q * H) + tl.arange(0, BLOCK_Q)[:, None] * H + cols[None, :],
             tl.zeros((BLOCK_Q, H), tl.float32))


def stats_and_zeroed_dq(out, lse, d_out, d_lse, *, block_q: int):
    """`(row_stats, zeros [B, N, T / block_q, block_q * H] float32)` by `_stats_kernel`: what
    XLA does in three passes (the delta reduction, the small stats, the memset) in one."""
    b, t, n, h = out.shape
    num_q = t // block_q
    return triton_call(
        out, d_out.astype(out.dtype), lse, d_lse.astype(jnp.float32), kernel=_stats_kernel,
        out_shape=(jax.ShapeDtypeStruct((b, n, num_q, 2, block_q), jnp.float32),
                   jax.ShapeDtypeStruct((b, n, num_q, block_q * h), jnp.float32)),
        grid=(num_q, n, b), num_warps=4, T=t, N=n, H=h, BLOCK_Q=block_q, LOG2E_=LOG2E)


def _transposed(plgpu, ref):
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return plgpu.transpose_ref(ref, (1, 0))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Walk:
    """What one backward program walks, built inside the kernel from its grid indices and the
    schedule's refs (traced scalars): the `2 * block_kv` keys of key tile `key_tile` of
    `kv_head` in request `batch`, and `total` steps of `block_q` query rows. Step `i` reads query
    tile `tile_of(i) = (query head, query tile)`; `runs(step_fn, carry)` calls `step_fn(i,
    carry, masked=mode)` for every step in order, `mode` None for a step whose every pair is
    visible, else the name `visible(mode, pos, key)` takes (the token rule of those steps; `pos`
    None for a rule without positions). dK / dV go to the key rows if `slot < 0`, else to
    float32 partial slot `slot` (unscaled: a program cut in parts, summed afterwards);
    `writes` False: nothing (a launch slot with no program)."""

    batch: object
    kv_head: object
    key_tile: object
    total: object
    tile_of: Callable
    runs: Callable
    visible: Callable
    slot: object = -1
    writes: object = True


def backward_call(q, k, v, out, lse, d_out, d_lse, schedule, *, walk_of: Callable, grid,
                  grid_names, seen, partial_slots: int, scale: float, config: Config):
    """The fused backward kernel over any schedule: `walk_of(*schedule_refs)` builds each
    program's `Walk` (the dense one: `backward`; block-sparse lists:
    `attn/block_sparse/mosaic_bwd.py`). Programs launch over `grid` (named `grid_names`, the
    last fastest). Shapes as `backward`. In the interpreter every program's partial dQ goes to
    its key tile's slice of a buffer, summed where `seen` (`[key tiles, B, T, N]`, broadcastable)
    says the key tile's programs walked the row's query tile.

    Returns:
      `(dq, dk, dv)`, and with `partial_slots` the float32 partial sums `(pk, pv)` `[slots, 2
      block_kv, H]` of the programs with `slot >= 0` (whose key rows in dk / dv are not written).
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    from attn.dense.mosaic import _interpret_params, load_whole

    b, t, n, h = q.shape
    s = k.shape[1]
    bq, bkv, stages = config.block_q, config.block_kv, config.stages
    keys, half = 2 * bkv, h // 2
    num_q, num_kv = t // bq, s // keys
    dtype = q.dtype
    scale_log2 = scale * LOG2E
    interpret = _interpret_params() if config.interpret else None
    schedule = tuple(schedule)

    # Row statistics, one [2, block_q] tile per (request, head, query tile): `row_stats`.
    if interpret is None:
        stats, dq_zeros = stats_and_zeroed_dq(out, lse, d_out, d_lse, block_q=bq)
    else:
        stats = row_stats(out, lse, d_out, d_lse, block_q=bq)

    if interpret is None:
        def iota(shape, dim):
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

        def row_vector(ref):  # [block_q] laid out along the wgmma tile's columns
            return load_whole(ref, layout=plgpu.Layout.WGMMA.reduce(0))

        def zero_grads():
            return plgpu.layout_cast(jnp.zeros((bkv, h), jnp.float32), plgpu.Layout.WGMMA)
    else:
        def iota(shape, dim):
            return lax.broadcasted_iota(jnp.int32, shape, dim)

        def row_vector(ref):
            return ref[...]

        def zero_grads():
            return jnp.zeros((bkv, h), jnp.float32)

    def kernel(*refs):
        q_ref, k_ref, v_ref, do_ref, stats_ref = refs[:5]
        schedule_refs = refs[5:5 + len(schedule)]
        refs = refs[5 + len(schedule):]
        # dQ: the float32 accumulator (compiled), the key tiles' partial buffer (interpreted)
        dq_ref, dk_ref, dv_ref, *partial_refs, scoped = refs
        ((k_smem, v_smem, streams, stats_smem, ds_smem, dq_smem),
         (k_ready, v_ready, q_ready, do_ready, stats_ready), ds_ready, done) = scoped
        (q_smem, do_smem), *partial_smem = streams
        wg = lax.axis_index("wg")
        walk = walk_of(*schedule_refs)
        bi, kv_head, total = walk.batch, walk.kv_head, walk.total
        kw0 = walk.key_tile * keys + wg * bkv

        def load(step):  # a step's query tile into its slot (group 0 issues it)
            head, qt = walk.tile_of(step)
            slot, rows = lax.rem(step, stages), pl.ds(qt * bq, bq)
            plgpu.copy_gmem_to_smem(q_ref.at[bi, rows, head], q_smem.at[slot], q_ready.at[slot])
            plgpu.copy_gmem_to_smem(do_ref.at[bi, rows, head], do_smem.at[slot],
                                    do_ready.at[slot])
            plgpu.copy_gmem_to_smem(stats_ref.at[bi, head, qt], stats_smem.at[slot],
                                    stats_ready.at[slot])

        k_rows = k_smem.at[pl.ds(wg * bkv, bkv)]
        v_rows = v_smem.at[pl.ds(wg * bkv, bkv)]
        # Both groups load their own rows; the dQ product reads the other group's too.
        plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(kw0, bkv), kv_head], k_rows, k_ready.at[wg])
        plgpu.copy_gmem_to_smem(v_ref.at[bi, pl.ds(kw0, bkv), kv_head], v_rows, v_ready.at[wg])

        @pl.when(wg == 0)
        def _():
            for i in range(stages):
                pl.when(i < total)(functools.partial(load, i))

        k_half = k_smem.at[:, pl.ds(wg * half, half)]
        dq_tile = dq_smem.at[wg]

        def accumulator_starts(slot):
            """The Sᵀ and dPᵀ accumulators' first values, `-lse₂ / (scale log2 e)` and `-delta`
            down each query's column: the products then leave `Sᵀ - lse / scale` and
            `dPᵀ - delta`, and no row vector stays live through the step."""
            plgpu.barrier_wait(stats_ready.at[slot])
            shape = (bkv, bq)
            lse = row_vector(stats_smem.at[slot, 0]) * (-1.0 / scale_log2)
            delta = row_vector(stats_smem.at[slot, 1])
            return (lax.broadcast_in_dim(lse, shape, [1]),
                    lax.broadcast_in_dim(-delta, shape, [1]))

        def probabilities(st, qt, masked):  # st: Sᵀ - lse / scale
            pt = jnp.exp2(st * scale_log2)
            if masked:  # selected, not multiplied: a NaN score must not survive as 0 * NaN
                pos = qt * bq + iota(st.shape, 1) if masked != "sinks" else None
                pt = jnp.where(walk.visible(masked, pos, kw0 + iota(st.shape, 0)), pt, 0.0)
            return pt

        def exchange(dst, step):
            """Both groups' dSᵀ rows into shared memory; then step - 1's slot is free in both
            groups (their dK products read it before this step's Sᵀ), so it takes the tile of
            step - 1 + stages."""
            buf = lax.rem(step, 2)
            ds_smem.at[buf, pl.ds(wg * bkv, bkv)][...] = dst
            plgpu.commit_smem()
            plgpu.barrier_arrive(ds_ready.at[buf])
            plgpu.barrier_wait(ds_ready.at[buf])
            ahead = step - 1 + stages
            pl.when((wg == 0) & (step >= 1) & (ahead < total))(functools.partial(load, ahead))
            return ds_smem.at[buf]

        def reduce_dq(dq, step):
            head, qt = walk.tile_of(step)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # step - 1's reduction has read it
            dq_tile[...] = dq
            plgpu.commit_smem()
            if interpret is None:
                plgpu.copy_smem_to_gmem(dq_tile, dq_ref.at[bi, head, qt, wg], reduction_op="add")
            else:  # no TMA reduction in the interpreter: the key tile's own slice
                plgpu.copy_smem_to_gmem(dq_tile, dq_ref.at[walk.key_tile, bi, pl.ds(qt * bq, bq),
                                                           head, pl.ds(wg * half, half)])

        def dq_and_dk(ds, dst, q_tile, dk_acc, step, dq_acc):
            """This group's half of the step's dQ, reduce-added, and its dK product. dQ is issued
            first, so its trip out (registers -> shared memory -> reduce-add) runs while the dK
            product does. Its accumulator is scoped here, after Sᵀ and dPᵀ are dead, rather than
            for the whole step: the step's live registers peak lower."""
            plgpu.wgmma(dq_acc, _transposed(plgpu, ds), k_half)
            plgpu.wgmma(dk_acc, dst, q_tile)
            reduce_dq(plgpu.wgmma_accumulator_load(dq_acc, wait_n=1), step)

        def wait_tile(step):
            slot = lax.rem(step, stages)
            plgpu.barrier_wait(q_ready.at[slot])
            plgpu.barrier_wait(do_ready.at[slot])
            _, qt = walk.tile_of(step)
            return slot, qt, q_smem.at[slot], do_smem.at[slot]

        def compiled_step(grad_refs, step, carry, masked):
            dv_acc, dk_acc = grad_refs
            slot, qt, q_tile, do_tile = wait_tile(step)

            def products(refs):
                st_acc, dpt_acc = refs
                plgpu.wgmma(st_acc, k_rows, _transposed(plgpu, q_tile))
                plgpu.wgmma(dpt_acc, v_rows, _transposed(plgpu, do_tile))
                pt = probabilities(plgpu.wgmma_accumulator_load(st_acc, wait_n=1), qt, masked)
                plgpu.wgmma(dv_acc, pt.astype(dtype), do_tile)
                # dSᵀ, zero wherever Pᵀ was masked to zero
                dst = (pt * plgpu.wgmma_accumulator_load(dpt_acc, wait_n=1)).astype(dtype)
                ds = exchange(dst, step)
                pl.run_scoped(functools.partial(dq_and_dk, ds, dst, q_tile, dk_acc, step),
                              plgpu.ACC((bq, half), jnp.float32))

            pl.run_state(products)(tuple(map(plgpu.ACC.init, accumulator_starts(slot))))
            return carry

        def interpreted_step(step, carry, masked):
            dk, dv = carry
            slot, qt, q_tile, do_tile = wait_tile(step)
            contract = (((1,), (1,)), ((), ()))
            st = lax.dot_general(k_rows[...], q_tile[...], contract,
                                 preferred_element_type=jnp.float32)
            dpt = lax.dot_general(v_rows[...], do_tile[...], contract,
                                  preferred_element_type=jnp.float32)
            st0, dp0 = accumulator_starts(slot)
            pt = probabilities(st + st0, qt, masked)
            dst = (pt * (dpt + dp0)).astype(dtype)
            dv = dv + jnp.dot(pt.astype(dtype), do_tile[...], preferred_element_type=jnp.float32)
            dk = dk + jnp.dot(dst, q_tile[...], preferred_element_type=jnp.float32)
            ds = exchange(dst, step)
            dq = lax.dot_general(ds[...], k_half[...], (((0,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            reduce_dq(dq, step)
            return dk, dv

        plgpu.barrier_wait(k_ready.at[wg])
        plgpu.barrier_wait(v_ready.at[wg])
        plgpu.barrier_wait(k_ready.at[1 - wg])  # the dQ product reads the other group's K
        if interpret is None:
            def grads(grad_refs):
                walk.runs(functools.partial(compiled_step, grad_refs), jnp.int32(0))

            dv, dk = pl.run_state(grads)((plgpu.ACC.init(zero_grads()),
                                          plgpu.ACC.init(zero_grads())))
        else:
            dk, dv = walk.runs(interpreted_step, (zero_grads(), zero_grads()))

        # The other group may still read K for its last dQ product.
        plgpu.barrier_arrive(done)
        plgpu.barrier_wait(done)
        rows = pl.ds(kw0, bkv)

        @pl.when(walk.writes & (walk.slot < 0))
        def _():
            k_rows[...] = (dk * scale).astype(dtype)
            v_rows[...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(k_rows, dk_ref.at[bi, rows, kv_head])
            plgpu.copy_smem_to_gmem(v_rows, dv_ref.at[bi, rows, kv_head])
            plgpu.wait_smem_to_gmem(0)

        if partial_slots:
            # Float32 partial sums through the query tiles' slots (every load there has been
            # read): dK, then dV.
            @pl.when(walk.writes & (walk.slot >= 0))
            def _():
                part = partial_smem[0].at[pl.ds(wg * bkv, bkv)]
                for grad, ref in ((dk, partial_refs[0]), (dv, partial_refs[1])):
                    part[...] = grad
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(part, ref.at[walk.slot, pl.ds(wg * bkv, bkv)])
                    plgpu.wait_smem_to_gmem(0)

    tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    f32_tiles = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
    streams = ((plgpu.SMEM((stages, bq, h), dtype, transforms=tiles),
                plgpu.SMEM((stages, bq, h), dtype, transforms=tiles)),)
    if partial_slots:
        streams += (plgpu.SMEM((keys, h), jnp.float32, transforms=f32_tiles),)
        # Compiled, the partial sums' buffer shares the query tiles' memory (227 KB a program).
        if interpret is None:
            streams = plgpu.RefUnion(*streams)

    def entry(*refs):
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            (plgpu.SMEM((keys, h), dtype, transforms=tiles),
             plgpu.SMEM((keys, h), dtype, transforms=tiles),
             streams,
             plgpu.SMEM((stages, 2, bq), jnp.float32),
             plgpu.SMEM((2, keys, bq), dtype, transforms=tiles),
             plgpu.SMEM((2, bq, half), jnp.float32, transforms=f32_tiles)),
            (*(plgpu.Barrier(num_barriers=2),) * 2, *(plgpu.Barrier(num_barriers=stages),) * 3),
            plgpu.Barrier(num_arrivals=2, num_barriers=2),
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    mesh = plgpu.Mesh(grid=grid, grid_names=grid_names, num_threads=2, thread_name="wg")
    out_type = [jax.ShapeDtypeStruct(k.shape, dtype), jax.ShapeDtypeStruct(v.shape, dtype)]
    if partial_slots:
        out_type += [jax.ShapeDtypeStruct((partial_slots, keys, h), jnp.float32)] * 2
    params = plgpu.CompilerParams(approx_math=True)
    if interpret is None:
        # Tile-contiguous float32 dQ, zeroed, that every program reduce-adds into: `pl.kernel`
        # with a mesh aliases the ref in and out (`plgpu.kernel`'s wrapper rejects refs).
        dq_acc = jax.new_ref(dq_zeros.reshape(b, n, num_q, 2, bq, half))
        grads = pl.kernel(entry, out_type=tuple(out_type), mesh=mesh, compiler_params=params)(
            q, k, v, d_out, stats, *schedule, dq_acc)
        dq = jax.freeze(dq_acc).transpose(0, 2, 4, 1, 3, 5).reshape(q.shape)
    else:
        parts_type = jax.ShapeDtypeStruct((num_kv, *q.shape), jnp.float32)
        parts, *grads = pl.kernel(entry, out_type=(parts_type, *out_type), mesh=mesh,
                                  compiler_params=params, interpret=interpret)(
            q, k, v, d_out, stats, *schedule)
        seen = jnp.broadcast_to(seen, (num_kv, b, t, n))
        dq = jnp.where(seen[..., None], parts, 0.0).sum(axis=0)
    return ((dq * scale).astype(dtype), *grads)


def backward(q, k, v, out, lse, d_out, d_lse, *, causal: bool, scale: float, window: int,
             sinks: int, config: Config):
    """`(dq, dk, dv)` of the Mosaic forward's `(out, lse)` with cotangents `(d_out, d_lse)`;
    shapes as `attn.dense.mosaic.attention` accepts them, `H == 128`, `T` a multiple of
    `block_q` and `S` of `2 * block_kv`. One program per (key tile, KV head, request), walking
    its `query_ranges` head by head."""
    t, n = q.shape[1], q.shape[2]
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    bq, keys = config.block_q, 2 * config.block_kv
    num_kv = s // keys
    ranges = functools.partial(query_ranges, block_q=bq, q_len=t, causal=causal, window=window,
                               sinks=sinks)
    visible = functools.partial(run_visible, causal=causal, window=window, sinks=sinks,
                                keys=keys, block_q=bq)

    def walk_of():
        tile = lax.axis_index("kv_seq")
        lo, full_lo, full_hi, sinks_lo, hi = ranges(tile * keys, keys)
        kv_head = lax.axis_index("kv_heads")

        def tile_of(step):  # every query tile that sees the keys, head by head
            return kv_head * g + step // (hi - lo), lo + lax.rem(step, hi - lo)

        def runs(step_fn, carry):
            """Per query head of the group, its runs of query tiles (`query_ranges`): masked on
            the diagonal, whole, masked at the window's far edge and past it (sinks)."""
            def one_head(i, carry):
                first = i * (hi - lo) - lo
                for a, z, masked in ((lo, full_lo, "diagonal"), (full_lo, full_hi, None),
                                     (full_hi, sinks_lo, "edge"), (sinks_lo, hi, "sinks")):
                    carry = lax.fori_loop(first + a, first + z,
                                          functools.partial(step_fn, masked=masked), carry)
                return carry
            return lax.fori_loop(0, g, one_head, carry)

        return Walk(batch=lax.axis_index("batch"), kv_head=kv_head, key_tile=tile,
                    total=g * (hi - lo), tile_of=tile_of, runs=runs, visible=visible)

    # Consecutive programs differ in the last grid axis (CUDA's x). Key tile fastest puts the
    # programs running together on neighbouring key tiles of one head, each two steps behind
    # the next on the same query tiles: at long S that keeps Q / dO / dQ reuse in L2 (Speed).
    if key_tiles_fastest(s, sinks, config):
        grid, names = (kh, q.shape[0], num_kv), ("kv_heads", "batch", "kv_seq")
    else:
        grid, names = (num_kv, kh, q.shape[0]), ("kv_seq", "kv_heads", "batch")
    seen = None
    if config.interpret:  # [key tiles, T]: the query tiles each key tile's programs walk
        lo, *_, hi = jax.vmap(lambda k0: ranges(k0, keys))(jnp.arange(num_kv) * keys)
        tiles_of_t = jnp.arange(t) // bq
        seen = ((tiles_of_t >= lo[:, None]) & (tiles_of_t < hi[:, None]))[:, None, :, None]
    return backward_call(q, k, v, out, lse, d_out, d_lse, (), walk_of=walk_of, grid=grid,
                         grid_names=names, seen=seen, partial_slots=0, scale=scale,
                         config=config)
