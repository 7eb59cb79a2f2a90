"""Mosaic GPU block-sparse prefill (Hopper): the dense Mosaic GPU forward's schedule walking each
query tile's list of selected key blocks (Block-Sparse-Attention semantics, as the Triton kernel).

The lists are the Triton kernel's (`triton.block_lists`: per (request, query head, query tile)
the selected key blocks ascending, their count, and how many of them every query of the tile
sees whole). One program owns one query tile (`block_size` = 128 tokens = the two compute warp
groups' 64 rows each) of one query head and walks its list with `attn.dense.mosaic.flash_call`:
a TMA warp group copies the listed K / V blocks (reading each block id from the list in GMEM a
step ahead, while it waits for the slot), two compute warp groups ping-pong on the tensor cores.
The first `whole` entries run without a mask; the rest (the diagonal, which the causal rule cuts)
with the token-level causal rule.

Programs: query heads of one KV head fastest (GQA siblings read the same K / V while it is in
L2), then query tiles (longest lists first), then KV heads, then requests, as the Triton kernel's
`kv_head_major` order (measured there: at 10% random masks the blocks then come from L2).

Supports: `T == S`, full lengths (no `q_lengths` / `kv_lengths` shorter than the arrays),
`block_size` 128, `H == Hv` in {64, 128}, bf16 / f16, `T` a multiple of 128. `supports` says
why not for anything else (the public op then runs the Triton kernel). Gradients: the fused Mosaic
backward (`attn/block_sparse/mosaic_bwd.py`, `H == 128`), else the Triton backward
(`attn/block_sparse/_triton_bwd.py`), from this forward's out and lse (`triton.differentiable`).
On a CPU it runs in Pallas's
Mosaic GPU interpreter with `Config(interpret=True)` (the tests). NaN: as the dense Mosaic
forward, a non-finite value in a masked (diagonal) step still reaches the rows of the step that
do not see it (issue 20; `attn/dense/mosaic.py` says why); the Triton kernel does not leak.
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
from attn.block_sparse import mosaic_bwd, reference, triton
from attn.block_sparse.triton import block_lists
from attn.dense import mosaic as dense_mosaic
from attn.dense import mosaic_bwd as dense_mosaic_bwd

_BLOCK = 128  # tokens a block = rows a program = keys a step


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """The tile schedule is fixed (128-token blocks, two 64-row compute groups, two slots);
    `interpret` runs Pallas's Mosaic GPU interpreter (on the CPU: the tests).

    Gradients come from the fused Mosaic backward (`attn/block_sparse/mosaic_bwd.py`) where it
    runs (`fused_backward` and its `supports` empty), else from the Triton backward;
    `backward_sms` sets the fused backward schedule's fair share (default: the device's SMs)."""

    interpret: bool = False
    fused_backward: bool = True
    backward_sms: int | None = None


def default_config(args: dict) -> Config:
    """The schedule is fixed: compiled, not interpreted."""
    del args
    return Config()


def supports(args: dict, config: Config) -> list[str]:
    """Why this kernel cannot run `attn.block_sparse.block_sparse_attention`'s validated `args`
    (without `config.interpret`, also without a Hopper GPU)."""
    q, v, block_size = args["q"], args["v"], args["block_size"]
    (_, t, _, h), (_, s, _, hv) = q.shape, v.shape
    reasons = [] if config.interpret else dense_mosaic.device_reasons()
    if block_size != _BLOCK:
        reasons.append(f"block_size={block_size}: only {_BLOCK}")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        reasons.append(f"dtype {q.dtype}: bfloat16 or float16 only")
    if h != hv or h not in dense_mosaic._HEAD_DIMS:
        reasons.append(f"H={h}, Hv={hv}: needs H == Hv in {dense_mosaic._HEAD_DIMS}")
    if t != s or t % _BLOCK:
        reasons.append(f"T={t}, S={s}: needs T == S, a multiple of {_BLOCK}")
    for name in ("q_lengths", "kv_lengths"):
        lengths = args[name]
        if lengths is not None:
            got = _checks.concrete(lengths)
            if got is None or np.any(got != t):
                reasons.append(f"{name}={lengths!r}: only the full length {t}")
    return reasons


def _launch(q, k, v, blocks, count, whole, *, scale: float, interpret: bool):
    b, t, n, _ = q.shape
    kh = k.shape[2]
    g = n // kh
    tb = t // _BLOCK
    config = dense_mosaic.Config(block_q=_BLOCK // 2, block_kv=_BLOCK, stages=2,
                                 interpret=interpret)

    def plan(blocks_ref, count_ref, whole_ref):
        pid = lax.axis_index("programs")
        bi = lax.axis_index("batch")
        head = (pid // (g * tb)) * g + lax.rem(pid, g)
        r = tb - 1 - lax.rem(pid // g, tb)  # longest lists first
        total, n_whole = count_ref[bi, head, r], whole_ref[bi, head, r]
        return dense_mosaic.Plan(
            batch=bi, head=head, kv_head=head // g, r0=r * _BLOCK, total=total,
            block_of=lambda i: blocks_ref[bi, head, r, i],
            runs=lambda q0: [(0, n_whole, "whole"), (n_whole, total, "masked")],
            visible=lambda pos, key: key <= pos)

    return dense_mosaic.flash_call(
        q, k, v, (blocks, count, whole), plan=plan, grid=(b, n * tb),  # the last axis fastest
        grid_names=("batch", "programs"), scale=scale, config=config)


def _forward(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, q_len, kv_len, *,
             block_size, scale, interpret):
    t = q.shape[1]
    eff = reference.effective_block_mask(
        head_mask_type, block_mask, num_q_tokens=t, num_kv_tokens=t, block_size=block_size,
        sink_blocks=sink_blocks, local_blocks=local_blocks, q_lengths=q_len, kv_lengths=kv_len)
    blocks, count, whole = block_lists(eff, q_len, kv_len, block_size)
    return _launch(q, k, v, blocks, count, whole, scale=scale, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("block_size", "scale", "config"))
def _block_sparse(q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, *, block_size,
                  scale, config):
    b, t = q.shape[:2]
    lengths = jnp.full((b,), t, jnp.int32)
    forward = functools.partial(_forward, block_size=block_size, scale=scale,
                                interpret=config.interpret)
    fused = None
    if config.fused_backward and not mosaic_bwd.supports(q.shape, block_size):
        fused = functools.partial(
            mosaic_bwd.backward, num_sms=config.backward_sms or device_facts().num_sms,
            config=dense_mosaic_bwd.Config(interpret=config.interpret))
    return triton.differentiable(
        q, k, v, head_mask_type, block_mask, sink_blocks, local_blocks, lengths, lengths,
        forward, block_size, scale,
        triton.default_config(q.shape[-1], v.shape[-1], q.dtype.itemsize), fused)


def block_sparse_attention(q, k, v, head_mask_type, block_mask=None, *, block_size=128,
                           sink_blocks=1, local_blocks=16, q_lengths=None, kv_lengths=None,
                           scale=None, config: Config | None = None):
    """Block-sparse prefill through the Mosaic GPU kernel, differentiable through the fused
    Mosaic backward or the Triton one (`Config`); arguments as
    `attn.block_sparse.block_sparse_attention` (validated there, and `supports` empty), plus
    `config`.

    Returns:
      `(out [B, T, N, H] in q's dtype, lse [B, T, N] float32)`.
    """
    del q_lengths, kv_lengths  # full lengths only (`supports`)
    config = config or Config()
    n = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    per_head = [jnp.broadcast_to(jnp.asarray(x, jnp.int32), (n,))
                for x in (sink_blocks, local_blocks)]
    return _block_sparse(q, k, v, jnp.asarray(head_mask_type, jnp.int32), block_mask, *per_head,
                         block_size=block_size, scale=scale, config=config)
