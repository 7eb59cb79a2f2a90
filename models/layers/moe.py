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
on a GPU and `tiles` elsewhere. A row whose expert id is outside `[0, E)` is skipped by every
method (it adds 0): expert parallelism hands a device's dispatch the ids of its own experts only.

Expert parallelism (`MoE.expert_parallel = ExpertParallel(mesh, axis)`, set by the engine under
a mesh): the block's routed part runs under `jax.shard_map` over `axis` with every stack of the
experts module split by expert (device `i` of `D` holds experts `[i E / D, (i + 1) E / D)`).
Every device runs the router (whole) on all tokens, keeps the choices of its own experts (the
others become skipped ids of weight 0), dispatches them on its local stacks, and one `psum`
(float32) outside the dispatch adds the devices' partial outputs. No collective runs inside the
dispatch's per-tile `lax.cond`. The tiles path sizes its tiles as if every row were local
(static shapes), so a device pads its rows more than one device would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
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
      xs: `[R, D]` rows sorted by expert, skipped rows (an id outside the stack) last;
        sorted_e: `[R]` their experts; group_sizes: `[E]` rows of each expert.

    Returns:
      `[R, D]` outputs in the same (sorted) order; 0 in skipped rows.
    """
    rows, dim = xs.shape
    num_experts = wg.shape[0]
    b = _tile_rows(rows, num_experts)
    num_tiles = -(-(rows + min(num_experts, rows) * (b - 1)) // b)
    padded = -(-group_sizes // b) * b  # [E] rows per expert after padding
    pad_end = jnp.cumsum(padded)
    pad_start = pad_end - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    row = jnp.arange(rows, dtype=jnp.int32)
    rank = row - start[sorted_e]
    dest = (pad_start[sorted_e] + rank).astype(jnp.int32)  # [R], unique, < num_tiles * b
    dest = jnp.where(row < jnp.sum(group_sizes), dest, num_tiles * b)  # skipped rows: dropped
    xp = jnp.zeros((num_tiles * b, dim), xs.dtype).at[dest].set(xs, mode="drop",
                                                                unique_indices=True)
    tile_start = jnp.arange(num_tiles, dtype=pad_end.dtype) * b
    tile_expert = jnp.minimum(jnp.searchsorted(pad_end, tile_start, side="right"),
                              num_experts - 1)
    used = tile_start < pad_end[-1]

    def one_tile(args):
        xt, e, u = args
        return jax.lax.cond(u, lambda: _expert_ffn(xt, wg[e], wu[e], wd[e], act),
                            lambda: jnp.zeros_like(xt))

    yp = jax.lax.map(one_tile, (xp.reshape(num_tiles, b, dim), tile_expert, used))
    return yp.reshape(num_tiles * b, dim).at[dest].get(mode="fill", fill_value=0)


def moe_sorted(x, ids, weights, wg, wu, wd, act="silu", *, dispatch="auto"):
    """Sort-by-expert MoE: each (token, choice) row goes through its expert only.

    Args:
      x: `[M, D]`.
      ids: `[M, k]` int expert ids; a row with an id outside `[0, E)` is skipped (adds 0).
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
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # E: skipped
    order = jnp.argsort(flat, stable=True)  # rows grouped by expert, skipped rows last
    sorted_e = flat[order]
    xs = x[order // k]  # [R, D]
    group_sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    if dispatch == "ragged_dot":
        h = fn(jax.lax.ragged_dot(xs, wg, group_sizes)) * jax.lax.ragged_dot(xs, wu, group_sizes)
        ys = jax.lax.ragged_dot(h, wd, group_sizes)
        ys = jnp.where((sorted_e < num_experts)[:, None], ys, jnp.zeros((), ys.dtype))
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


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """A MoE block's routed part split by expert over mesh axis `axis` (module docstring).

    Hashable: it is static data of the model's graph (`MoE.expert_parallel`). Every parameter of
    the experts module is a stack `[E, ...]` whose leading axis the axis size must divide; the
    router's parameters enter whole.

    Attributes:
      mesh: the devices (explicit axes are not supported: the engine passes automatic ones).
      axis: the mesh axis the experts split over.
    """

    mesh: Mesh
    axis: str

    def __call__(self, router: nnx.Module, experts: nnx.Module,
                 x: Float[Array, "M D"]) -> Float[Array, "M D"]:
        """`experts(x, *router(x))` with the stacks split over `axis`, in x's dtype.

        Raises:
          ValueError: an experts parameter that is not an `[E, ...]` stack the axis size
            divides.
        """
        size = self.mesh.shape[self.axis]
        router_def, router_state = nnx.split(router)
        experts_def, experts_state = nnx.split(experts)
        stacks = jax.tree.leaves(experts_state)
        num = {a.shape[0] if a.ndim else None for a in stacks}
        if len(num) != 1 or None in num or next(iter(num)) % size:
            raise ValueError(f"expert parallelism needs every experts parameter to be a stack "
                             f"[E, ...] with E divisible by the mesh axis {self.axis!r} of size "
                             f"{size}; got leading dims {sorted(a.shape[0] for a in stacks)}")
        local = next(iter(num)) // size

        def body(router_state, experts_state, x):
            ids, weights = nnx.merge(router_def, router_state)(x)  # [M, k], all experts
            rel = ids - jax.lax.axis_index(self.axis) * local
            mine = (rel >= 0) & (rel < local)
            y = nnx.merge(experts_def, experts_state)(
                x, jnp.where(mine, rel, local), jnp.where(mine, weights, 0.0))
            return jax.lax.psum(y.astype(jnp.float32), self.axis)  # [M, D]

        whole = jax.tree.map(lambda _: P(), router_state)
        split = jax.tree.map(lambda _: P(self.axis), experts_state)
        y = jax.shard_map(body, mesh=self.mesh, in_specs=(whole, split, P()), out_specs=P(),
                          check_vma=False)(router_state, experts_state, x)
        return y.astype(x.dtype)


class MoE(nnx.Module):
    """Router + routed experts (+ shared expert, optionally sigmoid-gated), on `[..., D]`.

    Args:
      router: a module `x [M, D] -> (ids [M, k], weights [M, k])`.
      experts: `SwiGLUExperts` (or a module with its call and `[E, ...]` stacks).
      shared: optional `GatedMLP` applied to every token.
      shared_gate: optional `Linear(D, 1)`: the shared output is scaled by its sigmoid.

    Attributes:
      expert_parallel: None (every expert here), or an `ExpertParallel`: the routed part runs
        split by expert over a mesh axis (the engine sets it on its copy of a model); the shared
        expert is unaffected.
    """

    def __init__(self, router: nnx.Module, experts: SwiGLUExperts, *,
                 shared: GatedMLP | None = None, shared_gate: Linear | None = None):
        self.router = router
        self.experts = experts
        self.shared = shared
        self.shared_gate = shared_gate
        self.expert_parallel: ExpertParallel | None = None

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        flat = x.reshape(-1, x.shape[-1])
        if self.expert_parallel is None:
            y = self.experts(flat, *self.router(flat))
        else:
            y = self.expert_parallel(self.router, self.experts, flat)
        if self.shared is not None:
            s = self.shared(flat)
            if self.shared_gate is not None:
                s = jax.nn.sigmoid(self.shared_gate(flat).astype(jnp.float32)).astype(s.dtype) * s
            y = y + s
        return y.reshape(x.shape)
