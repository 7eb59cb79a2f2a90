"""Mixture of experts: routers, stacked SwiGLU experts, and sort-by-expert dispatch.

A MoE block is `router` + `experts` (+ optional shared expert with an optional sigmoid gate):

    ids, weights = router(x)                # [M, k] int32, [M, k] float32
    y = experts(x, ids, weights)            # sum_k weights * expert_{ids}(x)
    y += sigmoid(x @ g) * shared(x)         # Qwen3-Next / 3.5 (DeepSeek: ungated)

A router is any callable `x [M, D] -> (ids [M, k] int32, weights [M, k] float32)`; the weights
already include every family-specific factor (renormalisation, routed scaling). Families add
their routers (DeepSeek-V3's sigmoid + correction bias + group-limited top-k, V2's softmax
top-k) without touching the experts or the dispatch.

Dispatch never runs an expert on a token that did not pick it. Rows `(token, choice)` are sorted
by expert, then either
* `"ragged_dot"`: three `jax.lax.ragged_dot` grouped matmuls over the sorted rows (GPU / TPU
  grouped GEMM; on the CPU jax lowers ragged_dot densely, so it is not the CPU default), or
* `"tiles"`: each expert's rows are padded to whole tiles of `b` rows, and a `lax.map` over
  tiles runs one expert's SwiGLU per tile. Work is at most `M*k + min(E, M*k) * (b-1)` rows.
`"dense"` runs every expert on every token: the test oracle only. `"auto"` picks `ragged_dot`
on a GPU and `tiles` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models.layers.linear import GatedMLP, Linear, activation, weight

DISPATCH = ("auto", "ragged_dot", "tiles", "dense")

Router = Callable[[Float[Array, "M D"]], tuple[Int[Array, "M k"], Float[Array, "M k"]]]


def topk_softmax(
    logits: Float[Array, "M E"], k: int, *, normalize: bool
) -> tuple[Int[Array, "M k"], Float[Array, "M k"]]:
    """Softmax over experts (float32), top-k, optionally renormalised to sum 1 (Qwen MoE)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


class SoftmaxTopKRouter(nnx.Module):
    """`topk_softmax(x @ kernel)` with `kernel [D, E]` (HF `mlp.gate.weight` transposed).

    Args:
      dim: D.
      num_experts: E.
      k: experts per token.
      normalize: renormalise the top-k probabilities (`norm_topk_prob`).
    """

    def __init__(self, dim: int, num_experts: int, k: int, *, normalize: bool,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.k = k
        self.normalize = normalize
        self.proj = Linear(dim, num_experts, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "M D"]) -> tuple[Int[Array, "M k"], Float[Array, "M k"]]:
        return topk_softmax(self.proj(x), self.k, normalize=self.normalize)


def _expert_ffn(x, wg, wu, wd, act):
    """One expert's SwiGLU on rows `x [r, D]`: `[r, D]`."""
    return (act(x @ wg) * (x @ wu)) @ wd


def moe_dense(x, ids, weights, wg, wu, wd, act="silu"):
    """Oracle: every expert on every token, then the routing weights pick and weigh.

    Args:
      x: `[M, D]`.
      ids, weights: `[M, k]` chosen experts and their weights.
      wg, wu: `[E, D, I]`; wd: `[E, I, D]`.

    Returns:
      `[M, D]` in x's dtype.
    """
    act = activation(act)
    h = act(jnp.einsum("md,edi->emi", x, wg)) * jnp.einsum("md,edi->emi", x, wu)
    y = jnp.einsum("emi,eid->emd", h, wd)  # [E, M, D]
    onehot = jax.nn.one_hot(ids, wg.shape[0], dtype=jnp.float32)  # [M, k, E]
    combine = jnp.einsum("mke,mk->me", onehot, weights.astype(jnp.float32))
    return jnp.einsum("me,emd->md", combine, y.astype(jnp.float32)).astype(x.dtype)


def _tile_rows(rows: int, experts: int) -> int:
    """Tile height: about the mean rows per used expert, a power of two in [8, 128]."""
    per = -(-rows // max(1, min(experts, rows)))
    b = 8
    while b < per and b < 128:
        b *= 2
    return b


def _tiles_ffn(xs, sorted_e, group_sizes, wg, wu, wd, act):
    """Expert FFN over rows sorted by expert, one expert per tile of padded rows.

    Args:
      xs: `[R, D]` rows sorted by expert; sorted_e: `[R]` their experts; group_sizes: `[E]`.

    Returns:
      `[R, D]` outputs in the same (sorted) order.
    """
    rows, dim = xs.shape
    num_experts = wg.shape[0]
    b = _tile_rows(rows, num_experts)
    num_tiles = -(-(rows + min(num_experts, rows) * (b - 1)) // b)
    padded = -(-group_sizes // b) * b  # [E] rows per expert after padding
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    rank = jnp.arange(rows, dtype=jnp.int32) - start[sorted_e]
    dest = (pad_start[sorted_e] + rank).astype(jnp.int32)  # [R], unique, < num_tiles * b
    xp = jnp.zeros((num_tiles * b, dim), xs.dtype).at[dest].set(xs, unique_indices=True)
    tile_start = jnp.arange(num_tiles, dtype=pad_end.dtype) * b
    tile_expert = jnp.minimum(jnp.searchsorted(pad_end, tile_start, side="right"),
                              num_experts - 1)
    used = tile_start < pad_end[-1]

    def one_tile(args):
        xt, e, u = args
        return jax.lax.cond(u, lambda: _expert_ffn(xt, wg[e], wu[e], wd[e], act),
                            lambda: jnp.zeros_like(xt))

    yp = jax.lax.map(one_tile, (xp.reshape(num_tiles, b, dim), tile_expert, used))
    return yp.reshape(num_tiles * b, dim)[dest]


def moe_sorted(x, ids, weights, wg, wu, wd, act="silu", *, dispatch="auto"):
    """Sort-by-expert MoE: each (token, choice) row goes through its expert only.

    Args:
      x: `[M, D]`.
      ids: `[M, k]` int expert ids in `[0, E)`.
      weights: `[M, k]` routing weights.
      wg, wu: `[E, D, I]`; wd: `[E, I, D]` stacked SwiGLU weights.
      act: activation name.
      dispatch: one of `DISPATCH`.

    Returns:
      `[M, D]` in x's dtype: `sum_k weights[m, k] * expert_{ids[m, k]}(x[m])`.

    Raises:
      ValueError: unknown `dispatch`.
    """
    if dispatch not in DISPATCH:
        raise ValueError(f"{dispatch=} must be one of {DISPATCH}")
    if dispatch == "auto":
        dispatch = "ragged_dot" if jax.default_backend() == "gpu" else "tiles"
    if dispatch == "dense":
        return moe_dense(x, ids, weights, wg, wu, wd, act)
    fn = activation(act)
    m, k = ids.shape
    num_experts = wg.shape[0]
    flat = ids.reshape(m * k).astype(jnp.int32)
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert
    sorted_e = flat[order]
    xs = x[order // k]  # [R, D]
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    if dispatch == "ragged_dot":
        h = fn(jax.lax.ragged_dot(xs, wg, group_sizes)) * jax.lax.ragged_dot(xs, wu, group_sizes)
        ys = jax.lax.ragged_dot(h, wd, group_sizes)
    else:
        ys = _tiles_ffn(xs, sorted_e, group_sizes, wg, wu, wd, fn)
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True).reshape(m, k, -1)
    out = jnp.einsum("mkd,mk->md", y.astype(jnp.float32), weights.astype(jnp.float32))
    return out.astype(x.dtype)


class SwiGLUExperts(nnx.Module):
    """E stacked SwiGLU experts: `gate_proj, up_proj [E, D, I]`, `down_proj [E, I, D]`.

    Args:
      dim: D.
      hidden: I (`moe_intermediate_size`).
      num_experts: E.
      act: activation name.
      dispatch: default dispatch method (see `moe_sorted`).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, *, act: str = "silu",
                 dispatch: str = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        if dispatch not in DISPATCH:
            raise ValueError(f"{dispatch=} must be one of {DISPATCH}")
        activation(act)
        self.act = act
        self.dispatch = dispatch
        self.gate_proj = weight(rngs, (num_experts, dim, hidden), dtype)
        self.up_proj = weight(rngs, (num_experts, dim, hidden), dtype)
        self.down_proj = weight(rngs, (num_experts, hidden, dim), dtype)

    def __call__(self, x: Float[Array, "M D"], ids: Int[Array, "M k"],
                 weights: Float[Array, "M k"], *, dispatch: str | None = None
                 ) -> Float[Array, "M D"]:
        return moe_sorted(x, ids, weights, self.gate_proj[...], self.up_proj[...],
                          self.down_proj[...], self.act, dispatch=dispatch or self.dispatch)


class MoE(nnx.Module):
    """Router + routed experts (+ shared expert, optionally sigmoid-gated), on `[..., D]`.

    Args:
      router: a module `x [M, D] -> (ids [M, k], weights [M, k])`.
      experts: `SwiGLUExperts`.
      shared: optional `GatedMLP` applied to every token.
      shared_gate: optional `Linear(D, 1)`: the shared output is scaled by its sigmoid.
    """

    def __init__(self, router: nnx.Module, experts: SwiGLUExperts, *,
                 shared: GatedMLP | None = None, shared_gate: Linear | None = None):
        self.router = router
        self.experts = experts
        self.shared = shared
        self.shared_gate = shared_gate

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        flat = x.reshape(-1, x.shape[-1])
        ids, weights = self.router(flat)
        y = self.experts(flat, ids, weights)
        if self.shared is not None:
            s = self.shared(flat)
            if self.shared_gate is not None:
                s = jax.nn.sigmoid(self.shared_gate(flat).astype(jnp.float32)).astype(s.dtype) * s
            y = y + s
        return y.reshape(x.shape)
