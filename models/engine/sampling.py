"""Token sampling inside the jitted step: greedy, temperature, top-k, top-p, per row.

The key of the token at position `p` is `fold_in(key(seed), p)` (made by the step), so a
preempted request that is recomputed samples the very same tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def sample(logits: Float[Array, "B V"], keys, temperature, top_k, top_p, *,
           draw: bool = True) -> Int[Array, "B"]:  # noqa: F821
    """Greedy / temperature / top-k / top-p sampling per row (jittable).

    Args:
      logits: `[B, V]` next-token logits.
      keys: `[B]` PRNG keys.
      temperature: `[B]` float32, 0 = greedy.
      top_k: `[B]` int32, 0 = no limit.
      top_p: `[B]` float32 in (0, 1].
      draw: static; False when the caller knows every row is greedy: the argmax alone, without
        the sort over the vocabulary (as much time as a few layers of a small model's decode
        step). A static flag, not a `lax.cond` on the temperatures: a conditional makes the
        GPU step wait for its predicate on the host, so the host cannot run ahead.

    Returns:
      `[B]` int32 tokens.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not draw:
        return greedy
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    scaled = sorted_logits / jnp.maximum(temperature, 1e-6)[:, None]
    rank = jnp.arange(logits.shape[-1], dtype=jnp.int32)[None, :]
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    scaled = jnp.where(keep, scaled, -jnp.inf)
    probs = jax.nn.softmax(scaled, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better tokens
    keep = keep & ((before < top_p[:, None]) | (rank == 0))
    scaled = jnp.where(keep, scaled, -jnp.inf)
    pick = jax.vmap(jax.random.categorical)(keys, scaled)
    drawn = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)
