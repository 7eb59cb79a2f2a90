"""DeepSeek MoE routers (plug into `models.layers.moe.MoE`: `x [M, D] -> (ids, weights)`).

* V3 (`DeepseekV3TopkRouter`, "noaux_tc"): `s = sigmoid(x·W)` (float32); selection on
  `c = s + e_score_correction_bias`: each of `n_group` expert groups scores the sum of its two
  largest `c`, the best `topk_group` groups stay, top-k of `c` within them; the weights are the
  *unbiased* `s` of the chosen experts, divided by their sum (+1e-20) if `norm_topk_prob`, times
  `routed_scaling_factor`.
* V2 (`DeepseekV2TopkRouter`): `s = softmax(x·W)` (float32); "greedy" top-k of `s`, or
  "group_limited_greedy": groups score their max `s`, the best `topk_group` stay, the others'
  scores become 0, then top-k; weights times `routed_scaling_factor`, never renormalised
  (transformers 5 ignores V2's `norm_topk_prob`).

Router logits are computed in float32 from float32 inputs and weights, as HF does, whatever the
model dtype; the correction bias is a float32 parameter. Ties pick the lower expert id
(`lax.top_k`); HF's unsorted top-k may pick another id among exact ties, which only matters for
the weight-0 experts of V2's group-limited routing (they contribute nothing either way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models.layers.linear import Linear, weight

V2_METHODS = ("greedy", "group_limited_greedy")


def _group_mask(group_scores: Float[Array, "M G"], topk_group: int,
                group_size: int) -> Array:
    """`[M, G * group_size]` bool: experts of the `topk_group` best-scoring groups."""
    _, keep = jax.lax.top_k(group_scores, topk_group)  # [M, topk_group]
    groups = jnp.any(jax.nn.one_hot(keep, group_scores.shape[-1], dtype=jnp.bool_), axis=-2)
    return jnp.repeat(groups, group_size, axis=-1)


def noaux_topk(
    logits: Float[Array, "M E"], bias: Float[Array, " E"], k: int, *, n_group: int,
    topk_group: int, normalize: bool, scaling: float,
) -> tuple[Int[Array, "M k"], Float[Array, "M k"]]:
    """DeepSeek-V3 routing (see the module docstring) on float32 router logits.

    Args:
      logits: `[M, E]` router logits.
      bias: `[E]` `e_score_correction_bias` (selection only).
      k: experts per token.
      n_group, topk_group: expert groups and how many of them stay (1, 1 = no grouping).
      normalize: `norm_topk_prob`.
      scaling: `routed_scaling_factor`.

    Returns:
      `(ids [M, k] int32, weights [M, k] float32)`.
    """
    m, e = logits.shape
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))
    choice = scores + bias.astype(jnp.float32)
    if n_group > 1:
        top2, _ = jax.lax.top_k(choice.reshape(m, n_group, e // n_group), 2)
        keep = _group_mask(jnp.sum(top2, axis=-1), topk_group, e // n_group)
        choice = jnp.where(keep, choice, -jnp.inf)
    _, ids = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * scaling


def softmax_group_topk(
    logits: Float[Array, "M E"], k: int, *, method: str = "greedy", n_group: int = 1,
    topk_group: int = 1, scaling: float = 1.0,
) -> tuple[Int[Array, "M k"], Float[Array, "M k"]]:
    """DeepSeek-V2 routing (see the module docstring) on float32 router logits.

    Args:
      logits: `[M, E]` router logits.
      k: experts per token.
      method: "greedy" or "group_limited_greedy".
      n_group, topk_group: expert groups and how many stay (group-limited only).
      scaling: `routed_scaling_factor`.

    Returns:
      `(ids [M, k] int32, weights [M, k] float32)`.

    Raises:
      ValueError: an unknown `method`.
    """
    if method not in V2_METHODS:
        raise ValueError(f"{method=} must be one of {V2_METHODS}")
    m, e = logits.shape
    scores = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if method == "group_limited_greedy":
        group_max = jnp.max(scores.reshape(m, n_group, e // n_group), axis=-1)
        scores = jnp.where(_group_mask(group_max, topk_group, e // n_group), scores, 0.0)
    weights, ids = jax.lax.top_k(scores, k)
    return ids.astype(jnp.int32), weights * scaling


def _router_logits(x: Float[Array, "M D"], kernel: Float[Array, "D E"]) -> Float[Array, "M E"]:
    return jnp.einsum("md,de->me", x.astype(jnp.float32), kernel.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


class DeepseekV3Router(nnx.Module):
    """`noaux_topk` with `proj.kernel [D, E]` (HF `mlp.gate.weight` transposed) and the float32
    `e_score_correction_bias [E]`.

    Args:
      dim: D.
      num_experts: E (divisible by `n_group`).
      k: experts per token.
      n_group, topk_group: group-limited selection.
      normalize: `norm_topk_prob`.
      scaling: `routed_scaling_factor`.
    """

    def __init__(self, dim: int, num_experts: int, k: int, *, n_group: int, topk_group: int,
                 normalize: bool, scaling: float, dtype=jnp.float32, rngs: nnx.Rngs):
        self.k = k
        self.n_group = n_group
        self.topk_group = topk_group
        self.normalize = normalize
        self.scaling = scaling
        self.proj = Linear(dim, num_experts, dtype=dtype, rngs=rngs)
        self.e_score_correction_bias = weight(None, (num_experts,), jnp.float32, init="zeros")

    def __call__(self, x: Float[Array, "M D"]) -> tuple[Int[Array, "M k"], Float[Array, "M k"]]:
        return noaux_topk(_router_logits(x, self.proj.kernel[...]),
                          self.e_score_correction_bias[...], self.k, n_group=self.n_group,
                          topk_group=self.topk_group, normalize=self.normalize,
                          scaling=self.scaling)


class DeepseekV2Router(nnx.Module):
    """`softmax_group_topk` with `proj.kernel [D, E]` (HF `mlp.gate.weight` transposed).

    Args:
      dim: D.
      num_experts: E.
      k: experts per token.
      method: "greedy" or "group_limited_greedy" (`topk_method`).
      n_group, topk_group: group-limited selection.
      scaling: `routed_scaling_factor`.
    """

    def __init__(self, dim: int, num_experts: int, k: int, *, method: str, n_group: int,
                 topk_group: int, scaling: float, dtype=jnp.float32, rngs: nnx.Rngs):
        if method not in V2_METHODS:
            raise ValueError(f"{method=} must be one of {V2_METHODS}")
        self.k = k
        self.method = method
        self.n_group = n_group
        self.topk_group = topk_group
        self.scaling = scaling
        self.proj = Linear(dim, num_experts, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "M D"]) -> tuple[Int[Array, "M k"], Float[Array, "M k"]]:
        return softmax_group_topk(_router_logits(x, self.proj.kernel[...]), self.k,
                                  method=self.method, n_group=self.n_group,
                                  topk_group=self.topk_group, scaling=self.scaling)
