"""Mosaic GPU XAttention score kernel (Hopper, e4m3): the reduced GEMM of `triton.py`'s fp8 path
with TMA loads, persistent programs.

It computes what `triton._tile_lse_kernel` does (per reduced row: the log2-sum-exp2 of its
scaled scores over each key block, and over each column tile) for `triton._block_sums_kernel`
to finish; quantisation, block sums and selection stay the Triton kernels'.

- Work items: the causally reachable `[128, block_c]` tiles of reduced scores (a static table,
  longest row tiles first) of each (request, query head) pair, tiles fastest, so the programs
  in flight share one head's q and k in L2. One persistent program per SM takes every
  `programs`-th item.
- Two warp groups of 64 reduced rows each walk the program's items slice by slice through one
  ring of `stages` slots: slice `i` of a tile is q rows `m·st + st-1-i` (`[128, H]`) and k rows
  `c·st + i` (`[block_c, H]`), read through `[B, T/st, st, N, H]` views, so the antidiagonal
  gather is the TMA box's row stride. Each group issues one `e4m3 x e4m3 -> f32` wgmma a slice
  on the shared k slice and releases the slot (two arrivals); group 0 then refills it with the
  slice `stages` steps on, which runs on into the next tile, so the ring is full while the
  groups finish a tile. No separate TMA warp group: it would make the kernel 384 threads at 168
  registers a thread; without it the groups get 255, which the epilogue below uses (2-4% faster
  on the H100, 6% on an H200).
- Epilogue per group: scores times the q row scales (the score scale folded in; both scales'
  loads issued before the mainloop) and the k column scales, the causal rule `c <= m + shift`
  (on tiles across the diagonal only), the row maximum, `p = 2^(s - max)`; the block sums
  `Σ_{c in block} p` as one more wgmma, `p` (f16, registers) times a 0/1 matrix
  `E [block_c, block_c / R]` in shared memory (f32 accumulation; p's f16 rounding moves a block
  sum by ~2^-11 of itself); then `max + log2(sum)` and the tile's row log-sum-exp, stored to
  GMEM from the registers (`[pairs, RP, Sb]` and `[pairs, NT, RP]`, `RP` the reduced rows
  padded to whole row tiles).

Where the time goes (H100, S64K N32 / K8): the slices'
loads alone take ~0.9 ms, 786 KB per tile at ~32 B per clock per SM (CTA pairs multicasting k
did not change it: the bound is each SM's intake, not L2); the epilogue adds ~0.2 ms (without
it 0.77 of ~0.98). 128 x 256 is the largest tile the registers hold: a 64 x 256 f32
accumulator is 128 registers a thread, and a third group (192-row tiles, 0.79x the intake a
score) leaves 168 registers a thread, where group 0's copy issue spills.

Supports (else `reasons` names what is missing; the caller runs the Triton kernel): full
lengths, `H = 128`, `block_size / stride = 8`, `T` a multiple of `64·stride`, `S` of
`block_c·stride`, `T <= S` (queries at the end of the keys), a config that fits the device's
shared memory. A Hopper GPU; on the CPU it runs in Pallas's Mosaic GPU
interpreter with `interpret=True` (the wgmmas as `jnp` products of the same shared-memory tiles;
`T / stride` a multiple of 128 there, whole row tiles: its copies fail out of bounds).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attn import _checks
from attn._op import device_facts
from attn.dense import mosaic as dense_mosaic

_GROUP_ROWS = 64  # reduced rows a compute warp group (one wgmma M)
_HEAD_DIM = 128  # one slice = one 128-byte e4m3 row = the 128-byte swizzle
_R = 8  # reduced columns per key block (block_size / stride)
# Compute warp groups: a program's tile is 128 x block_c. Two groups (256 threads) get 255
# registers a thread; a third (384 threads: 168) spills group 0's copy issue next to a 64 x 256
# accumulator (524 bytes, the scores 1.54 ms against 0.98 at S64K).
_GROUPS = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """`block_c` reduced key columns a program (64 x `block_c` f32 accumulators per compute
    group), `stages` slices in flight."""

    block_c: int = 256
    # H100 S64K scores alone: 4 slots 0.960-0.966 ms, 3 slots 1.10-1.12; 5 do not fit at 256
    # columns.
    stages: int = 4
    # Persistent programs, each walking every `programs`-th (pair, tile) item (default: one per
    # SM), so the TMA ring runs on into the next tile while the compute groups finish one.
    programs: int | None = None
    # Pallas's Mosaic GPU interpreter (the CPU tests), not compiled.
    interpret: bool = False

    def __post_init__(self):
        if self.block_c not in (128, 256):  # E's rows (block_c / R f16) need a >= 32 B swizzle
            raise ValueError(f"block_c={self.block_c} must be 128 or 256")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages} must be >= 2")
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"programs={self.programs} must be positive")

    @property
    def smem_bytes(self) -> int:
        """The ring of e4m3 q / k slices and the block matrix."""
        return (self.stages * (_GROUP_ROWS * _GROUPS + self.block_c) * _HEAD_DIM
                + self.block_c * (self.block_c // _R) * 2)


def reasons(q, k, *, block_size: int, stride: int, q_lengths, kv_lengths, config: Config,
            device: bool = True) -> list[str]:
    """What this kernel does not do for these arguments, each naming the value: shapes, lengths,
    a `config` taking more shared memory than the device has (`attn._op.device_facts`), and
    (`device`, unless interpreted) a device other than a Hopper GPU."""
    (_, t, _, h), s = q.shape, k.shape[1]
    why = []
    if h != _HEAD_DIM:
        why.append(f"H={h}: only {_HEAD_DIM}")
    if block_size // stride != _R:
        why.append(f"block_size={block_size}, stride={stride}: needs block_size / stride = {_R}")
    if t % (_GROUP_ROWS * stride) or s % (config.block_c * stride) or t > s:
        why.append(f"T={t}, S={s}: needs T a multiple of {_GROUP_ROWS * stride}, S of "
                   f"{config.block_c * stride} and T <= S")
    for name, lengths, full in (("q_lengths", q_lengths, t), ("kv_lengths", kv_lengths, s)):
        if lengths is None:
            continue
        got = _checks.concrete(lengths)
        if got is None or np.any(got != full):
            why.append(f"{name}={lengths!r}: only the full length {full}")
    if config.interpret and (t // stride) % (_GROUP_ROWS * _GROUPS):
        # TMA fills a last row tile's rows past T / st with zeros; the interpreter's copies
        # fail out of bounds instead.
        why.append(f"T={t}: interpreted, T / stride must be a multiple of "
                   f"{_GROUP_ROWS * _GROUPS} (whole row tiles)")
    limit = device_facts().shared_memory  # (an H100's on a CPU)
    if config.smem_bytes > limit:
        why.append(f"stages={config.stages} slots of {_GROUP_ROWS * _GROUPS} q + "
                   f"{config.block_c} k rows need {config.smem_bytes} bytes of shared "
                   f"memory, over the device's {limit}")
    if device and not config.interpret:
        why.extend(dense_mosaic.device_reasons())
    return [f"Mosaic GPU XAttention scores: {w}" for w in why]


def check_supported(q, k, *, block_size: int, stride: int, q_lengths, kv_lengths,
                    config: Config, device: bool = True) -> None:
    """Raise NotImplementedError listing `reasons`, if any."""
    why = reasons(q, k, block_size=block_size, stride=stride, q_lengths=q_lengths,
                  kv_lengths=kv_lengths, config=config, device=device)
    if why:
        raise NotImplementedError("; ".join(why))


@functools.cache
def tile_table(rows: int, cols: int, block_r: int, block_c: int) -> np.ndarray:
    """`[num_tiles, 2]` int32 `(row tile, column tile)` of the causal reduced scores, row tiles of
    `block_r` from the top (longest first; the last may run past `rows`): row tile `i` sees
    columns `<= (i + 1)·block_r - 1 + shift` with `shift = cols - rows`."""
    shift = cols - rows
    pairs = [(i, j) for i in reversed(range(-(-rows // block_r)))
             for j in range(min((i + 1) * block_r + shift - 1, cols - 1) // block_c + 1)]
    return np.asarray(pairs, np.int32).reshape(-1, 2)


def block_matrix(block_c: int) -> np.ndarray:
    """`E [block_c, block_c / R]` f16: `E[c, j] = 1` iff column `c` lies in key block `j`."""
    return (np.arange(block_c)[:, None] // _R == np.arange(block_c // _R)[None, :]).astype(
        np.float16)


def scores(q8, k8, q_scale, k_scale, *, stride: int, block_size: int, first: int, count: int,
           config: Config):
    """Per-block and per-tile log2-sum-exp2 of the scaled reduced scores, as
    `triton._tile_lse_kernel` (full lengths).

    Args:
      q8: `[B, T, N, H]` e4m3; `k8`: `[B, S, K, H]` e4m3.
      q_scale: `[B, N, T/st]` f32 e4m3 scale of each reduced row times the score scale
        (`log2(e) / sqrt(H) / st / norm`); `k_scale`: `[B, K, S/st]` f32.
      first, count: the flat (request, head) pairs `[first, first + count)` of this launch.

    Returns:
      `(lse [count, RP, S/block_size], tile_lse [count, NT, RP])` f32 with `RP` the `T/st`
      reduced rows padded to whole row tiles (rows past `T/st` hold junk), `-inf` where a row
      sees nothing of the block / tile; entries of blocks past a row tile's reach unwritten.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, t, n, h = q8.shape
    s, kh = k8.shape[1], k8.shape[2]
    g, st, bc, stages = n // kh, stride, config.block_c, config.stages
    groups = _GROUPS
    block_r = _GROUP_ROWS * groups
    rows, cols = t // st, s // st
    # Outputs (and q's scales) padded to whole row tiles: the last tile's extra rows (loaded as
    # zeros by TMA) write there, never into another row.
    rows_p = -(-rows // block_r) * block_r
    q_scale = jnp.pad(q_scale, ((0, 0), (0, 0), (0, rows_p - rows)), constant_values=1.0)
    shift, cb, nt, sb = cols - rows, bc // _R, cols // bc, s // block_size
    tiles = tile_table(rows, cols, block_r, bc)
    interpret = dense_mosaic._interpret_params() if config.interpret else None
    q5 = q8.reshape(b, rows, st, n, h)
    k5 = k8.reshape(b, cols, st, kh, h)

    if interpret is None:
        def load(ref, layout):
            return dense_mosaic.load_whole(ref, layout=layout, optimized=False)

        def iota(shape, dim):
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
    else:
        def load(ref, layout):
            del layout
            return ref[...]

        def iota(shape, dim):
            return lax.broadcasted_iota(jnp.int32, shape, dim)

    num_tiles = tiles.shape[0]
    total = num_tiles * count  # (pair, tile) work items, tiles fastest
    # One program per SM; interpreted (on a CPU) 4, each a set of Python threads.
    sms = 4 if config.interpret else device_facts().num_sms
    programs = min(total, config.programs or sms)

    def kernel(q_ref, k_ref, qs_ref, ks_ref, e_ref, tiles_ref, lse_ref, tile_lse_ref, scoped):
        (q_smem, k_smem, e_smem), (ready, e_ready), free = scoped
        wg = lax.axis_index("wg")
        pid = lax.axis_index("programs")
        mine = (total - 1 - pid) // programs + 1  # work items of this program
        steps = mine * st  # slices of all this program's tiles, one ring

        def item(j):
            """The j-th work item of this program: its pair, head, KV head, tile origin."""
            w = pid + j * programs
            pair, tile = w // num_tiles, lax.rem(w, num_tiles)
            bi, head = (first + pair) // n, lax.rem(first + pair, n)
            col_tile = tiles_ref[tile, 1]
            return pair, bi, head, head // g, tiles_ref[tile, 0] * block_r, col_tile

        def copy(step):
            """Issue slice `step % st` of item `step // st` into its slot (group 0 only)."""
            _, bi, head, kv_head, m0, col_tile = item(step // st)
            i, slot = lax.rem(step, st), lax.rem(step, stages)
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(m0, block_r), st - 1 - i, head],
                                    q_smem.at[slot], ready.at[slot])
            plgpu.copy_gmem_to_smem(k_ref.at[bi, pl.ds(col_tile * bc, bc), i, kv_head],
                                    k_smem.at[slot], ready.at[slot])

        def consumed(step):
            """Every group is done with `step`'s slot; group 0 refills it `stages` steps on."""
            plgpu.barrier_arrive(free.at[lax.rem(step, stages)])

            @pl.when((wg == 0) & (step + stages < steps))
            def _():
                plgpu.barrier_wait(free.at[lax.rem(step, stages)])
                copy(step + stages)

        @pl.when(wg == 0)
        def _():
            plgpu.copy_gmem_to_smem(e_ref, e_smem, e_ready)

            @pl.loop(0, jnp.minimum(steps, stages))
            def _(step):
                copy(step)

        plgpu.barrier_wait(e_ready)

        @pl.loop(0, mine)
        def _(j):
            pair, bi, head, kv_head, m0, col_tile = item(j)
            c0, row0 = col_tile * bc, m0 + wg * _GROUP_ROWS
            # The scales' loads are issued here and land during the mainloop.
            qs = load(qs_ref.at[bi, head, pl.ds(row0, _GROUP_ROWS)], plgpu.Layout.WGMMA.reduce(1))
            ks = load(ks_ref.at[bi, kv_head, pl.ds(c0, bc)], plgpu.Layout.WGMMA.reduce(0))
            if interpret is None:
                def mainloop(acc_ref):
                    @pl.loop(0, st)
                    def _(i):
                        slot = lax.rem(j * st + i, stages)
                        plgpu.barrier_wait(ready.at[slot])
                        plgpu.wgmma(acc_ref, q_smem.at[slot, pl.ds(wg * _GROUP_ROWS, _GROUP_ROWS)],
                                    dense_mosaic._transposed(plgpu, k_smem.at[slot]))
                        plgpu.wgmma_wait(0)
                        consumed(j * st + i)

                    return acc_ref[...]

                acc = pl.run_scoped(mainloop, plgpu.ACC((_GROUP_ROWS, bc), jnp.float32))
            else:  # the same products of the same shared-memory tiles
                def step(i, acc):
                    slot = lax.rem(j * st + i, stages)
                    plgpu.barrier_wait(ready.at[slot])
                    qt = q_smem.at[slot, pl.ds(wg * _GROUP_ROWS, _GROUP_ROWS)][...]
                    kt = k_smem.at[slot][...]
                    acc = acc + lax.dot_general(qt.astype(jnp.float32), kt.astype(jnp.float32),
                                                (((1,), (1,)), ((), ())),
                                                preferred_element_type=jnp.float32)
                    consumed(j * st + i)
                    return acc

                acc = lax.fori_loop(0, st, step, jnp.zeros((_GROUP_ROWS, bc), jnp.float32))

            # The next tile's first slices are in flight meanwhile.
            a = (acc * lax.broadcast_in_dim(qs, acc.shape, [0])
                 * lax.broadcast_in_dim(ks, acc.shape, [1]))

            def causal(a):
                vis = c0 + iota(acc.shape, 1) <= row0 + shift + iota(acc.shape, 0)
                return jnp.where(vis, a, -jnp.inf)

            # Only tiles across the diagonal have columns past a row's reach.
            a = lax.cond(c0 + bc - 1 > row0 + shift, causal, lambda a: a, a)
            mx = a.max(axis=1)
            mx = jnp.where(mx == -jnp.inf, 0.0, mx)
            p = jnp.exp2(a - lax.broadcast_in_dim(mx, a.shape, [0])).astype(jnp.float16)
            if interpret is None:
                def block_sums(ref):
                    plgpu.wgmma(ref, p, e_smem)
                    return ref[...]

                blk = pl.run_scoped(block_sums, plgpu.ACC((_GROUP_ROWS, cb), jnp.float32))
            else:
                blk = jnp.dot(p.astype(jnp.float32), e_smem[...].astype(jnp.float32))
            row = blk.sum(axis=1)
            lse = jnp.where(blk > 0.0, lax.broadcast_in_dim(mx, blk.shape, [0])
                            + jnp.log2(jnp.where(blk > 0.0, blk, 1.0)), -jnp.inf)
            row_lse = jnp.where(row > 0.0, mx + jnp.log2(jnp.where(row > 0.0, row, 1.0)),
                                -jnp.inf)
            # Straight from the registers (staging through shared memory and TMA: 1% slower).
            lse_ref.at[pair, pl.ds(row0, _GROUP_ROWS), pl.ds(col_tile * cb, cb)][...] = lse
            tile_lse_ref.at[pair, col_tile, pl.ds(row0, _GROUP_ROWS)][...] = row_lse

        @pl.when(wg == 0)
        def _():  # observe the releases no refill waited for (the interpreter checks)
            @pl.loop(jnp.maximum(steps - stages, 0), steps)
            def _(step):
                plgpu.barrier_wait(free.at[lax.rem(step, stages)])

    def entry(*refs):
        fp8 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: kernel(*refs, scoped),
            (plgpu.SMEM((stages, block_r, h), q8.dtype, transforms=fp8),
             plgpu.SMEM((stages, bc, h), k8.dtype, transforms=fp8),
             plgpu.SMEM((bc, cb), jnp.float16, transforms=(
                 plgpu.TilingTransform((8, cb)), plgpu.SwizzleTransform(2 * cb)))),
            # A slot is ready when both its copies (q, k) have landed: two arrivals; free when
            # every compute group has read it.
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier()),
            plgpu.Barrier(num_arrivals=groups, num_barriers=stages),
            collective_axes="wg",
        )

    return plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((count, rows_p, sb), jnp.float32),
                  jax.ShapeDtypeStruct((count, nt, rows_p), jnp.float32)),
        grid=(programs,),
        grid_names=("programs",),
        num_threads=groups,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q5, k5, q_scale, k_scale, jnp.asarray(block_matrix(bc)), jnp.asarray(tiles))
