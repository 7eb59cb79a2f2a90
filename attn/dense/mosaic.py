"""Mosaic GPU flash prefill (Pallas `plgpu.kernel`, Hopper): causal or full, GQA, window + sinks.

Why a second forward next to `attn/dense/triton.py`: the Triton kernel stalls ~18% of the time on
the `Q Kᵀ` wgmma right after issuing it (softmax never overlaps the tensor cores inside a warp
group) and Triton 3.6 through jax-triton 0.3.1 cannot express the schedule that hides it. Here
the schedule is written out (FlashAttention-3's):

- Three warp groups per program. Two compute warp groups own `block_q` query rows each (the
  program's `2 * block_q` consecutive tokens of one query head); the third only issues TMA copies
  of the K / V tiles into a ring of `stages` shared-memory slots (`k_ready` / `v_ready` barriers),
  and refills a slot once both compute groups have released it (`k_free` / `v_free`, two
  arrivals each). It runs with 40 registers, the compute groups with 232.
- Ping-pong: a two-arrival `turn` barrier that each compute group passes twice a step, once
  after issuing `S = Q Kᵀ` and once after its softmax, just before issuing `O += P V`; group 1
  passes it once more before its first step and group 0 once after its last. The groups thus
  alternate on the tensor cores: one computes its softmax while the other's two GEMMs run.

Key steps (`block_kv` keys each). A program walks one list of steps, which both compute groups
follow in lock step (the slots and barriers are shared): the sink steps `[0, n_sink)`, then the
window `[w_lo, w_hi)` (every step of a causal program when there is no window). Each group runs a
step in one of three ways: *whole* (every row of the group sees every key: no mask), *masked*
(the causal diagonal, the window's lower edge, the sinks: the token-level rule), or *skip* (the
group sees nothing of it, which happens for at most one step at each end of the window because
the two groups' rows differ by `block_q`): a skipped step only keeps the barrier protocol (it waits
and releases the slot and passes `turn` twice). `step_ranges` computes these ranges; it is plain
integer arithmetic, checked on the CPU against a brute-force visibility count.

Non-finite values: a NaN key is masked out of the scores, but a non-finite *value* in a masked
step reaches the rows of the step that do not see it (`P V` makes `0 * NaN`); keys no step visits
never do. Zeroing them in a masked step (a cleaned copy of the V slot in shared memory for the
wgmma, the rows that see one marked NaN) was exact but cost 11% at causal S8K N32 / K8 H128 on
the H100 (0.99 -> 1.10 ms), so the fix is still open (issue 20); the Triton kernels have it.

The program-independent part is `flash_call`: it runs the schedule above over whatever list a
`Plan` gives each program (its request, heads, first row, number of steps, the key block of each
step, the compute groups' runs of whole / masked / skipped steps and the token rule of the masked
ones). The dense plan is `_forward`'s; `attn/block_sparse/mosaic.py` walks block lists with it.

Programs: the grid is (query head, query tile, request). Mosaic GPU launches the grid's last
axis fastest, so the requests vary fastest, then the query tiles, the last (longest causal) first,
then the heads: the programs running together are one head's, and read its K / V while it is in
L2. (Heads fastest, so that a KV head's group runs together, measures no faster.) The lse is
stored `[B, N, T]` (1-D TMA stores of `block_q` rows) and transposed outside.

Supports: causal with `T == S` and no offset, or non-causal; `window` / `sinks` as Python ints
or concrete arrays equal across KV heads; `H == Hv` in {64, 128}; bf16 / f16; `T` a multiple of
`2 * block_q` and `S` of `block_kv`. `supports` lists what else it refuses (the public op then
runs the Triton kernel). Gradients, from this forward's out and lse: the fused Mosaic GPU
backward (`attn/dense/mosaic_bwd.py`) at `H == 128`, else the Triton backward kernels
(`fused_backward_reasons` says which and why).
Compiles for a Hopper GPU (`pytest -m gpu` checks it against the reference); on the CPU it runs in
Pallas's Mosaic GPU interpreter with `Config(interpret=True)` (the CPU tests: the schedule,
barriers, copies and masks as compiled, the two products as `jnp` products of the same
shared-memory tiles; slow, small shapes only).

Speed (H100, N32 / K8 H128 bf16, benchmarks/prefill.json): causal S8K..32K 1.02-1.08x cuDNN, about
0.98x tokamax's Mosaic GPU kernel; window 4K + sink 128 at S64K 1.00x cuDNN's window without sink.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from attn import _checks
from attn._harness import on_gpu
from attn.dense import mosaic_bwd
from attn.dense import triton as dense_triton

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_HEAD_DIMS = (64, 128)
_COMPUTE_REGISTERS, _MEMORY_REGISTERS = 232, 40


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """`block_q` query rows per compute warp group (a program owns two groups: `2 * block_q`
    tokens), `block_kv` keys per step, `stages` K / V slots in shared memory."""

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    # Gradients from the one-kernel Mosaic GPU backward (`attn/dense/mosaic_bwd.py`) where it
    # runs (`fused_backward_reasons` empty), else from the Triton backward kernels. False is the
    # deterministic option: the fused kernel sums dQ by reduce-adds in arbitrary order.
    fused_backward: bool = True
    # Run in Pallas's Mosaic GPU interpreter (on the CPU: the tests), not compiled. The two
    # wgmmas become `jnp` products of the same shared-memory tiles there (the interpreter has no
    # transposed-ref wgmma nor `run_state`); the schedule, barriers and copies are the kernel's.
    # Needs 4 threads in XLA's CPU pool (`xla_cpu_threads`; NPROC=4 on smaller hosts).
    interpret: bool = False

    def __post_init__(self):
        if self.block_q % 64:
            raise ValueError(f"block_q={self.block_q} must be a multiple of 64 (one wgmma M)")
        if self.block_kv % 64 or self.block_kv <= 0:
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of 64")
        if self.stages < 2:
            raise ValueError(f"stages={self.stages} must be >= 2 (one slot loads while one "
                             f"is read)")


def default_config(head_dim: int) -> Config:
    """64 rows a compute group, 128-key steps, 2 slots: H100, causal N32 / K8 H128 at S8K / S16K
    (JAX's example kernel of this schedule), 2 slots 0.92 / 3.58 ms against 3 slots' 0.98 / 3.74
    and 64-key steps' 1.12 / 4.17; 3 slots of 128 keys do not fit in shared memory at H128 here
    (120 B over)."""
    del head_dim
    return Config()


def _cdiv(a, b):
    return (a + b - 1) // b


def step_ranges(r0, rows: int, *, block_kv: int, seq_len: int, causal: bool, window: int,
                sinks: int):
    """Key steps of a program, or of one compute group, whose query rows (= positions) are
    `[r0, r0 + rows)`; `r0` may be a traced int32 or a Python / numpy int.

    Returns `(n_sink, w_lo, full_lo, full_hi, w_hi)` in steps of `block_kv` keys: the sink steps
    `[0, n_sink)` (masked), then the window `[w_lo, w_hi)`, of which `[full_lo, full_hi)` every
    row sees whole and the rest only partly. Without a window, `n_sink = w_lo = 0`.
    """
    num_steps = seq_len // block_kv
    if not causal:
        return 0, 0, 0, num_steps, num_steps
    last = r0 + rows - 1  # the last row's position
    w_hi = jnp.minimum(_cdiv(last + 1, block_kv), num_steps)
    full_hi = jnp.minimum((r0 + 1) // block_kv, w_hi)  # steps whose last key <= r0
    if window <= 0:
        return 0, 0, 0, full_hi, w_hi
    n_sink = jnp.minimum(_cdiv(min(sinks, seq_len), block_kv), w_hi)
    w_lo = jnp.clip(jnp.maximum(r0 - window + 1, 0) // block_kv, n_sink, w_hi)
    # A step starting at or after `last - window + 1` is inside every row's window.
    full_lo = jnp.clip(_cdiv(jnp.maximum(last - window + 1, 0), block_kv), w_lo, w_hi)
    full_hi = jnp.clip(full_hi, full_lo, w_hi)
    return n_sink, w_lo, full_lo, full_hi, w_hi


def group_ranges(program, group):
    """A compute group's window steps `(lo, full_lo, full_hi, hi)`, nested in the program's window
    `[w_lo, w_hi)` (`program`; `group` is `step_ranges` of the group's rows, whose sink count can
    be smaller: its rows end earlier). The group skips `[w_lo, lo)` and `[hi, w_hi)` (it sees no
    key there), masks `[lo, full_lo)` and `[full_hi, hi)`, and sees `[full_lo, full_hi)` whole."""
    w_lo, w_hi = program
    _, lo, full_lo, full_hi, hi = group
    lo = jnp.clip(lo, w_lo, w_hi)
    full_lo = jnp.clip(full_lo, lo, w_hi)
    full_hi = jnp.clip(full_hi, full_lo, w_hi)
    return lo, full_lo, full_hi, jnp.clip(hi, full_hi, w_hi)


def _transposed(plgpu, ref):
    """`ref` `[R, C]` viewed `[C, R]` (jax 0.11: `ref.transpose`; 0.10: `plgpu.transpose_ref`)."""
    if hasattr(ref, "transpose"):
        return ref.transpose((1, 0))
    return plgpu.transpose_ref(ref, (1, 0))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one program walks, built inside the kernel from its grid indices (traced scalars).

    `total` key steps in list order; list position `i` holds key block `block_of(i)` (steps of
    `block_kv` keys). `runs(q0)` splits `[0, total)` into consecutive `(lo, hi, mode)` runs for the
    compute group whose rows start at token `q0`, `mode` in {"whole", "masked", "skip"};
    `visible(pos, key)` is the token rule of the masked steps (int32 arrays in, bool out)."""

    batch: object
    head: object
    kv_head: object
    r0: object
    total: object
    block_of: Callable
    runs: Callable
    visible: Callable


# The interpreter runs each of a program's three warp groups as its own XLA computation, blocked
# in barrier callbacks while the caller's waits too: XLA's CPU thread pool must hold all four.
_INTERPRETER_THREADS = 4


def xla_cpu_threads() -> tuple[int, str]:
    """XLA's CPU thread-pool size and where it comes from (`PJRT_NPROC` / `NPROC` when set, else
    the core count), as XLA sizes it when jax starts."""
    for name in ("PJRT_NPROC", "NPROC"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name]), f"{name}={os.environ[name]}"
    return os.cpu_count() or 1, f"{os.cpu_count()} cores, NPROC unset"


def load_whole(ref, **kwargs):
    """`plgpu.load` of a whole ref (`kwargs`: its `layout`, `optimized`). jax 0.10 takes the index
    as an argument (required; here empty), jax 0.11 deprecates that (the ref is indexed instead)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    index = ((),) if idx is not None and idx.default is inspect.Parameter.empty else ()
    return plgpu.load(ref, *index, **kwargs)


def _interpret_params():
    """The interpreter's parameters (exported as `plgpu.InterpretGPUParams` from jax 0.11).
    Raises RuntimeError where XLA's CPU pool is too small for the warp groups: they would wait
    for each other forever."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    threads, source = xla_cpu_threads()
    if threads < _INTERPRETER_THREADS:
        raise RuntimeError(
            f"Config(interpret=True): XLA's CPU thread pool has {threads} threads ({source}); "
            f"the Mosaic GPU interpreter needs {_INTERPRETER_THREADS} (three warp groups and the "
            f"caller, all blocking) or it hangs. Set NPROC={_INTERPRETER_THREADS} in the "
            f"environment before jax starts.")

    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params
    return params()


def flash_call(q, k, v, extra=(), *, plan: Callable, grid: tuple[int, ...],
               grid_names: tuple[str, ...], scale: float, config: Config):
    """Run the flash forward over the programs of `grid`, each walking `plan(*extra_refs)`
    (`extra`: int32 arrays the plan reads, e.g. block lists). Returns `(out [B, T, N, H],
    lse [B, T, N] natural log)`; rows of `T` no program covers are left unwritten."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    b, t, n, h = q.shape
    bq, bkv, stages = config.block_q, config.block_kv, config.stages
    dtype = q.dtype
    scale_log2 = scale * LOG2E
    interpret = _interpret_params() if config.interpret else None

    # Register layouts are hints for the Mosaic GPU compiler; the CPU interpreter has none.
    if interpret is None:
        def with_layout(x, layout):
            return plgpu.layout_cast(x, layout)

        def iota(shape, dim):
            return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)
    else:
        def with_layout(x, layout):
            del layout
            return x

        def iota(shape, dim):
            return lax.broadcasted_iota(jnp.int32, shape, dim)

    def kernel(q_ref, k_ref, v_ref, extra_refs, o_ref, lse_ref, scoped):
        (q_smem, k_smem, v_smem, lse_smem), (k_ready, v_ready, q_ready), (k_free, v_free), turn = (
            scoped)
        wg = lax.axis_index("wg")
        pln = plan(*extra_refs)
        bi, head, total = pln.batch, pln.head, pln.total

        def pass_turn():
            plgpu.barrier_arrive(turn)
            plgpu.barrier_wait(turn)

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
            q0 = pln.r0 + wg * bq
            q_tile = q_smem.at[wg]
            plgpu.copy_gmem_to_smem(q_ref.at[bi, pl.ds(q0, bq), head], q_tile, q_ready.at[wg])

            def one_step(i, carry, mode):
                acc, m, l = carry
                slot = lax.rem(i, stages)
                nxt = i + 1

                def wait_next_k():
                    @pl.when(nxt < total)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(nxt, stages)])

                if mode == "skip":  # the barrier protocol of a step, no math
                    pass_turn()
                    plgpu.barrier_arrive(k_free.at[slot])
                    plgpu.barrier_arrive(turn)
                    plgpu.barrier_wait(v_ready.at[slot])
                    plgpu.barrier_wait(turn)
                    wait_next_k()
                    plgpu.barrier_arrive(v_free.at[slot])
                    return carry

                if mode == "masked":  # read before the scores land (a list may live in GMEM)
                    key0 = pln.block_of(i) * bkv

                if interpret is None:
                    def scores(acc_ref):
                        plgpu.wgmma(acc_ref, q_tile, _transposed(plgpu, k_smem.at[slot]))
                        pass_turn()  # the other group's P V runs while this one's S lands
                        return acc_ref[...]

                    qk = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32))
                else:  # the interpreter: the same product from the same shared memory
                    qk = lax.dot_general(q_tile[...], k_smem.at[slot][...],
                                         (((1,), (1,)), ((), ())),
                                         preferred_element_type=jnp.float32)
                    pass_turn()
                plgpu.barrier_arrive(k_free.at[slot])
                if mode == "masked":
                    pos, key = q0 + iota(qk.shape, 0), key0 + iota(qk.shape, 1)
                    s_ = jnp.where(pln.visible(pos, key), qk * scale_log2, -jnp.inf)
                    m_new = jnp.maximum(m, s_.max(axis=1))
                    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a row that saw nothing
                    p = jnp.exp2(s_ - lax.broadcast_in_dim(m_use, s_.shape, [0]))
                else:
                    m_new = jnp.maximum(m, qk.max(axis=1) * scale_log2)
                    m_use = m_new
                    p = jnp.exp2(qk * scale_log2 - lax.broadcast_in_dim(m_new, qk.shape, [0]))
                alpha = jnp.exp2(m - m_use)
                acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
                l = l * alpha + p.sum(axis=1)
                p = p.astype(dtype)
                # Keep the rescale and the row sums before the barrier (measured upstream in
                # JAX's Mosaic GPU attention example to matter at H <= 128), then hand over the
                # tensor cores.
                acc, l, m_new, p = lax.optimization_barrier((acc, l, m_new, p))
                plgpu.barrier_arrive(turn)
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(turn)

                if interpret is None:  # accumulated in place by the tensor cores
                    def values(acc_ref):
                        plgpu.wgmma(acc_ref, p, v_smem.at[slot])
                        wait_next_k()  # while P V runs

                    acc = pl.run_state(values)(plgpu.ACC.init(acc))
                else:
                    acc = acc + jnp.dot(p, v_smem.at[slot][...],
                                        preferred_element_type=jnp.float32)
                    wait_next_k()
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l

            m = with_layout(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = with_layout(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = with_layout(jnp.zeros((bq, h), jnp.float32), plgpu.Layout.WGMMA)
            carry = (acc, m, l)
            plgpu.barrier_wait(q_ready.at[wg])

            @pl.when(total > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            pl.when(wg == 1)(pass_turn)
            for lo, hi, mode in pln.runs(q0):
                carry = lax.fori_loop(lo, hi, functools.partial(one_step, mode=mode), carry)
            pl.when(wg == 0)(pass_turn)
            acc, m, l = carry

            empty = l == 0.0
            safe_l = jnp.where(empty, 1.0, l)
            acc /= lax.broadcast_in_dim(safe_l, acc.shape, [0])
            q_tile[...] = acc.astype(dtype)
            lse_smem.at[wg][...] = jnp.where(empty, -jnp.inf, m * LN2 + jnp.log(safe_l))
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_tile, o_ref.at[bi, pl.ds(q0, bq), head])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[bi, head, pl.ds(q0, bq)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

            def copy(block, slot, ready, src, dst):
                plgpu.copy_gmem_to_smem(src.at[bi, pl.ds(block * bkv, bkv), pln.kv_head],
                                        dst.at[slot], ready.at[slot])

            for i in range(stages):
                @pl.when(i < total)
                def _(i=i):
                    block = pln.block_of(i)
                    copy(block, i, k_ready, k_ref, k_smem)
                    copy(block, i, v_ready, v_ref, v_smem)

            @pl.loop(0, jnp.maximum(total - stages, 0))
            def _(i):
                slot = lax.rem(i, stages)
                block = pln.block_of(i + stages)  # read before the wait: its latency hides there
                plgpu.barrier_wait(k_free.at[slot])
                copy(block, slot, k_ready, k_ref, k_smem)
                plgpu.barrier_wait(v_free.at[slot])
                copy(block, slot, v_ready, v_ref, v_smem)

            # Observe the last releases too (the compute groups finish after them anyway): every
            # barrier phase is then waited on by the thread that waits on its others, which
            # Pallas's interpreter checks.
            @pl.loop(jnp.maximum(total - stages, 0), total)
            def _(i):
                slot = lax.rem(i, stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])

    def entry(q_ref, k_ref, v_ref, *refs):
        *extra_refs, o_ref, lse_ref = refs
        tiles = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        pl.run_scoped(
            lambda *scoped: kernel(q_ref, k_ref, v_ref, extra_refs, o_ref, lse_ref, scoped),
            (plgpu.SMEM((2, bq, h), dtype, transforms=tiles),
             plgpu.SMEM((stages, bkv, h), dtype, transforms=tiles),
             plgpu.SMEM((stages, bkv, h), dtype, transforms=tiles),
             plgpu.SMEM((2, bq), jnp.float32)),
            (plgpu.Barrier(num_barriers=stages), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_barriers=2)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=stages),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )

    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct(q.shape, dtype),
                  jax.ShapeDtypeStruct((b, n, t), jnp.float32)),
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret,
    )(q, k, v, *extra)
    return out, jnp.swapaxes(lse, 1, 2)


def _forward(q, k, v, *, causal: bool, scale: float, window: int, sinks: int, config: Config):
    """The dense forward: programs over (query head, query tile, request), the list of each
    program its sink steps then its window (`step_ranges`)."""
    b, t, n, _ = q.shape
    s, kh = k.shape[1], k.shape[2]
    rows = 2 * config.block_q
    num_tiles = t // rows
    ranges = functools.partial(step_ranges, block_kv=config.block_kv, seq_len=s, causal=causal,
                               window=window, sinks=sinks)

    def visible(pos, key):
        vis = key <= pos if causal else key >= 0
        if window > 0:
            vis &= (key > pos - window) | (key < sinks)
        return vis

    def plan():
        head = lax.axis_index("heads")
        r0 = (num_tiles - 1 - lax.axis_index("q_seq")) * rows  # longest tiles first
        n_sink, w_lo, _, _, w_hi = ranges(r0, rows)

        def at(step):  # list position of window step `step`
            return n_sink + step - w_lo

        def runs(q0):
            lo, full_lo, full_hi, hi = group_ranges((w_lo, w_hi), ranges(q0, config.block_q))
            return [(0, n_sink, "masked"), (at(w_lo), at(lo), "skip"),
                    (at(lo), at(full_lo), "masked"), (at(full_lo), at(full_hi), "whole"),
                    (at(full_hi), at(hi), "masked"), (at(hi), at(w_hi), "skip")]

        return Plan(batch=lax.axis_index("batch"), head=head, kv_head=head // (n // kh), r0=r0,
                    total=n_sink + w_hi - w_lo,
                    block_of=lambda i: jnp.where(i < n_sink, i, w_lo + i - n_sink),
                    runs=runs, visible=visible)

    return flash_call(q, k, v, plan=plan, grid=(n, num_tiles, b),
                      grid_names=("heads", "q_seq", "batch"), scale=scale, config=config)


def device_reasons() -> list[str]:
    """Why the default device cannot compile the kernels (they issue wgmma: Hopper only;
    elsewhere only `Config(interpret=True)` runs them)."""
    if not on_gpu():
        return ["a CPU: Mosaic GPU kernels compile for a CUDA GPU (Hopper); on a CPU they run only "
                "in the interpreter (Config(interpret=True))"]
    capability = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not capability.startswith("9."):
        return [f"compute capability {capability or 'unknown'}: Mosaic GPU kernels need Hopper "
                f"(sm_90, wgmma)"]
    return []


def check_device() -> None:
    """Raise NotImplementedError with `device_reasons`, if any."""
    reasons = device_reasons()
    if reasons:
        raise NotImplementedError(f"Mosaic GPU kernels: {reasons[0]}")


def _static_per_head(x, num_kv_heads: int) -> int | None:
    """A Python int from an int or a concrete `[K]` array whose entries are all equal; None
    for anything else (traced, or different per head)."""
    if isinstance(x, (int, np.integer)):
        return int(x)
    arr = _checks.concrete(x)
    if arr is None or arr.shape not in ((), (num_kv_heads,)) or np.unique(arr).size != 1:
        return None
    return int(arr.reshape(-1)[0])


def static_window_sinks(causal: bool, window, sinks, num_kv_heads: int) -> tuple[int, int]:
    """The static `(window, sinks)` the kernel takes (window 0: none); `supports` is empty."""
    window = 0 if window is None or not causal else max(_static_per_head(window, num_kv_heads), 0)
    sinks = _static_per_head(sinks, num_kv_heads) if window else 0
    return window, max(sinks, 0)


def supports(args: dict, config: Config) -> list[str]:
    """Why this kernel cannot run `attn.dense.attention`'s validated `args` (empty: it can)."""
    q, v, causal = args["q"], args["v"], args["causal"]
    (_, t, _, h), (_, s, kh, hv) = q.shape, v.shape
    reasons = [] if config.interpret else device_reasons()
    if args["q_segment_ids"] is not None:
        reasons.append("segment ids (packed varlen)")
    if args.get("softcap") is not None:
        reasons.append("soft-capping")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        reasons.append(f"dtype {q.dtype}: bfloat16 or float16 only")
    if h != hv or h not in _HEAD_DIMS:
        reasons.append(f"H={h}, Hv={hv}: needs H == Hv in {_HEAD_DIMS}")
    if t % (2 * config.block_q) or s % config.block_kv:
        reasons.append(f"T={t} must be a multiple of {2 * config.block_q} and S={s} of "
                       f"{config.block_kv}")
    if causal and t != s:
        reasons.append(f"causal with T={t} != S={s} (a query offset)")
    offset = _checks.concrete(args["q_offset"])
    if offset is None or np.any(offset != 0):
        reasons.append(f"q_offset={args['q_offset']!r}: only a static 0")
    if args["kv_lengths"] is not None:
        lengths = _checks.concrete(args["kv_lengths"])
        if lengths is None or np.any(lengths != s):
            reasons.append(f"kv_lengths={args['kv_lengths']!r}: only the full length S={s}")
    window = _static_per_head(args["window"], kh) if causal and args["window"] is not None else 0
    if window is None:
        reasons.append(f"window={args['window']!r}: one static value for every KV head")
    elif window > 0 and _static_per_head(args["sinks"], kh) is None:
        reasons.append(f"sinks={args['sinks']!r}: one static value for every KV head")
    return reasons


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _flash(q, k, v, causal, scale, window, sinks, config):
    return _forward(q, k, v, causal=causal, scale=scale, window=window, sinks=sinks,
                    config=config)


def _flash_fwd(q, k, v, causal, scale, window, sinks, config):
    out, lse = _forward(q, k, v, causal=causal, scale=scale, window=window, sinks=sinks,
                        config=config)
    return (out, lse), (q, k, v, out, lse)


def fused_backward_reasons(q_shape, k_shape, config: Config) -> list[str]:
    """Why `_flash_bwd` takes the Triton backward for these shapes (empty: the fused one)."""
    (_, t, _, h), s = q_shape, k_shape[1]
    reasons = [] if config.fused_backward else ["Config(fused_backward=False)"]
    if h != 128:
        reasons.append(f"H={h}: the fused backward splits dQ's head dim in two 64-column halves "
                       f"(H == 128 only)")
    tiles = mosaic_bwd.Config()
    keys = 2 * tiles.block_kv
    if s % keys or t % tiles.block_q:
        reasons.append(f"S={s} must be a multiple of {keys} and T={t} of {tiles.block_q}")
    return reasons


def _flash_bwd(causal, scale, window, sinks, config, res, cotangents):
    q, k, v, out, lse = res
    d_out, d_lse = cotangents
    if not fused_backward_reasons(q.shape, k.shape, config):
        return mosaic_bwd.backward(q, k, v, out, lse, d_out, d_lse, causal=causal, scale=scale,
                                   window=window, sinks=sinks,
                                   config=mosaic_bwd.Config(interpret=config.interpret))
    b, s, kh = q.shape[0], k.shape[1], k.shape[2]
    return dense_triton._backward(
        q, k, v, out, lse, d_out, d_lse, jnp.zeros((b,), jnp.int32),
        jnp.full((kh,), window, jnp.int32), jnp.full((kh,), sinks, jnp.int32),
        jnp.full((b,), s, jnp.int32), causal=causal, scale=scale,
        config=dense_triton.default_config(q.shape[-1], v.shape[-1], q.dtype.itemsize))


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "window", "sinks", "config"))
def _attention(q, k, v, *, causal, scale, window, sinks, config):
    return _flash(q, k, v, causal, scale, window, sinks, config)


def attention(q, k, v, *, causal=True, scale=None, q_offset=0, window=None, sinks=0,
              q_segment_ids=None, kv_segment_ids=None, kv_lengths=None, softcap=None,
              config: Config | None = None):
    """Dense attention through the Mosaic GPU forward (differentiable: `_flash_bwd`);
    arguments as `attn.dense.attention` (validated there, and `supports` empty), plus `config`
    (default: `default_config`).

    Returns:
      `(out [B, T, N, H] in q's dtype, lse [B, T, N] float32)`.
    """
    del q_offset, q_segment_ids, kv_segment_ids, kv_lengths, softcap  # as `supports` requires
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    config = config or default_config(q.shape[-1])
    window, sinks = static_window_sinks(causal, window, sinks, k.shape[2])
    return _attention(q, k, v, causal=bool(causal), scale=scale, window=window, sinks=sinks,
                      config=config)
