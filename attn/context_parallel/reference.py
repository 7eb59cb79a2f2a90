"""Context-parallel attention's specification: the whole sequence on one device.

Every sharded variant must equal dense attention over the gathered sequence; this is that, with
the arguments of `api.ring_attention` (the mesh only says where the inputs live, so it is not
needed here). Under `jit` with sharded inputs XLA gathers them; eagerly they are global arrays.
"""

from __future__ import annotations

from jaxtyping import Array, Float, Int

from attn import dense


def attention(
    q: Float[Array, "B S N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | Int[Array, " K"] | None = None,
    sinks: int | Int[Array, " K"] = 0,
) -> tuple[Float[Array, "B S N Hv"], Float[Array, "B S N"]]:
    """Dense self-attention of the whole sequence (XLA), `(out [B, S, N, Hv], lse [B, S, N])`."""
    return dense.attention(q, k, v, causal=causal, scale=scale, window=window, sinks=sinks,
                           implementation="xla")
