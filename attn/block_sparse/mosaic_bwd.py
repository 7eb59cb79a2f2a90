"""Mosaic GPU block-sparse backward (Hopper): the dense fused backward's kernel
(`attn/dense/mosaic_bwd.py`: dQ, dK and dV in one kernel, 5 tile products a step against the
Triton backward's 7) walking, for each key block, the (sibling head, query tile) pairs that
selected it.

Lists and schedule are the Triton backward's (`attn/block_sparse/_triton_bwd.py`):
`transposed_lists` gives per (request, KV head, key block) the selected pairs, those every query
of which sees the block whole first; a program owns one key block (the kernel's `2 * block_kv`
= 128 keys, so the block size must be 128) and walks its pairs in steps of `block_q` queries, the
whole ones without a mask, the rest (the diagonal) with the causal rule. `dkv_schedule` cuts a
program with more than a fair share of the steps (a key block every query tile selects, such as
the sink block: at S32K, density 0.1, its 2048 steps against ~1700 per SM for everything) into
chunks that write float32 partial sums, which `add_cut_partials` adds afterwards; and it launches
the long programs first, then KV head by KV head, key blocks ascending.

Why that order makes the fused form pay here: dQ is summed across programs by TMA reduce-adds
into a float32 accumulator, which runs at speed only while the rows it adds to are in L2. With
the programs in flight all on one KV head, the query tiles they walk (Q, dO, dQ) are its sibling
heads' only, and they share them in L2; launched with the KV heads interleaved, the same work took
1.42x as long (S32K), and other orders of each list are slower too (Speed).

Speed (H100, B1 N32 / K8 H128 bf16, density 0.1, forward + backward with the Mosaic forward,
benchmarks/sparse_prefill.json, the median of five rounds interleaved with the dense): S32K 7.33 ms,
S64K 27.2 ms, 1.31x / 1.20x density x our dense forward + backward (rounds 1.25-1.37 / 1.16-1.21).
The row's `kernel_ms` splits a call by kernel: this backward kernel takes 1.18x / 1.14x density x
the dense one (the forward 1.09x / 1.02x), and with the same number of blocks in every row as a
band of neighbouring blocks, 1.01x / 0.95x. The excess is a random mask's scattered query tiles: a
KV head's programs walk the Q, dO and float32 dQ of its sibling heads all over the sequence (4 KB
a query, 128 MB at S32K), more than the 50 MB L2; without its dQ reduce-adds the kernel takes
0.79x / 0.82x as long. The other kernels, O(S) at any density, take 0.79 / 1.55 ms: the row
statistics with the zeroed float32 dQ (0.41 ms at S32K) and dQ's cast (0.27 ms), 1-2% of the dense
time, here 14% / 7% of density x dense. The launch and list order, two query-tile slots and the cut
at the fair share are the fastest measured: other walk orders and a TMA prefetch of Q / dO into L2
make the kernel 1.01-1.29x as long, `stages=3` the call 1.10x, and bands of query tiles (whose cut key blocks add
float32 partial sums afterwards) gain nothing on the call. The same forward with the Triton
backward takes 1.24x / 1.20x as long.

Supports what the Mosaic forward supports (`attn/block_sparse/mosaic.py`: `T == S`, full lengths,
blocks of 128, bf16 / f16) at `H == 128` (the dense fused kernel's head dim); `supports` says why
not, and the Triton backward runs instead. Not deterministic (dQ's reduce-adds land in any order;
the cut programs' partial sums are added in order). NaN: as the dense fused backward.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from attn.block_sparse._triton_bwd import add_cut_partials, dkv_schedule, transposed_lists
from attn.dense import mosaic_bwd

_KEYS = 2 * mosaic_bwd.Config().block_kv  # a program's keys: one block


def supports(q_shape, block_size: int) -> list[str]:
    """Why the fused kernel cannot take the gradient of a Mosaic block-sparse forward (whose own
    limits hold) of queries shaped `q_shape`."""
    reasons = []
    if q_shape[-1] != 128:
        reasons.append(f"H={q_shape[-1]}: the fused backward needs 128")
    if block_size != _KEYS:
        reasons.append(f"block_size={block_size}: the fused backward needs {_KEYS}")
    return reasons


def _causal(mode, pos, key):
    del mode  # the masked pairs are the diagonal's
    return key <= pos


def backward(q, k, v, out, lse, d_out, d_lse, eff, *, scale: float, num_sms: int,
             config: mosaic_bwd.Config):
    """`(dq, dk, dv)` of block-sparse attention from the forward's `(out, lse)` and their
    cotangents, `eff` `[B, N, Tb, Sb]` the effective block mask (`supports` empty; `num_sms`:
    the schedule's fair share)."""
    b, t, n, _ = q.shape
    kh = k.shape[2]
    g = n // kh
    per_block = _KEYS // config.block_q  # steps a (sibling, query block) pair takes
    tb, num_kv = t // _KEYS, k.shape[1] // _KEYS
    lengths = jnp.full((b,), t, jnp.int32)
    entries, count, whole = transposed_lists(eff, lengths, lengths, _KEYS, kh)
    units, cut = dkv_schedule(count, num_kv, _KEYS, _KEYS, config.block_q, num_sms)

    def walk_of(entries_ref, whole_ref, units_ref):
        unit = lax.axis_index("units")
        program, first, end, slot = (units_ref[i, unit] for i in range(4))
        writes = program >= 0  # the launch has more units than the schedule fills
        program = jnp.maximum(program, 0)
        key_tile, bi = lax.rem(program, num_kv), lax.rem(program // num_kv, b)
        kv_head = program // (b * num_kv)
        total = jnp.where(writes, end - first, 0)
        whole_steps = jnp.clip(per_block * whole_ref[bi, kv_head, key_tile] - first, 0, total)

        def tile_of(step):  # entry `g * Tb + r`: query block r of sibling g
            i = first + step
            e = entries_ref[bi, kv_head, key_tile, i // per_block]
            return kv_head * g + e // tb, lax.rem(e, tb) * per_block + lax.rem(i, per_block)

        def runs(step_fn, carry):
            carry = lax.fori_loop(0, whole_steps, functools.partial(step_fn, masked=None), carry)
            return lax.fori_loop(whole_steps, total,
                                 functools.partial(step_fn, masked="diagonal"), carry)

        return mosaic_bwd.Walk(batch=bi, kv_head=kv_head, key_tile=key_tile, total=total,
                               tile_of=tile_of, runs=runs, visible=_causal, slot=slot,
                               writes=writes)

    seen = None
    if config.interpret:  # [key blocks, B, T, N]: the rows each key block's programs walk
        seen = jnp.repeat(eff, _KEYS, axis=2)[:, :, :t].transpose(3, 0, 2, 1)
    dq, dk, dv, pk, pv = mosaic_bwd.backward_call(
        q, k, v, out, lse, d_out, d_lse, (entries, whole, units), walk_of=walk_of,
        grid=(units.shape[1],), grid_names=("units",), seen=seen,
        partial_slots=2 * cut.shape[1], scale=scale, config=config)
    return (dq, *add_cut_partials(pk, pv, cut, dk, dv, scale=scale, block_n=_KEYS))
