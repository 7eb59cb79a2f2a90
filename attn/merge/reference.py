"""Reference merge of split-KV partial attention results by their log-sum-exp.

Split-KV decoding attends each split of the keys separately, giving a partial output normalised
within the split and that split's log-sum-exp. The exact full-attention result is the
lse-weighted average of the partials. Splits that saw no key carry lse = -inf and weigh nothing,
whatever their (possibly NaN) partial output; a row with no key in any split gives 0 and -inf.
"""

import jax.numpy as jnp
from jaxtyping import Array, Float


def merge_partials(
    o: Float[Array, "*R P Hv"], lse: Float[Array, "*R P"]
) -> tuple[Float[Array, "*R Hv"], Float[Array, "*R"]]:
    """Merge `P` partial results per row.

    Args:
      o: `[*R, P, Hv]` partial outputs, each normalised within its split.
      lse: `[*R, P]` float32 log-sum-exp of each split's scores; `-inf` for an empty split.

    Returns:
      `(out [*R, Hv] float32, lse [*R] float32)`.
    """
    lse = lse.astype(jnp.float32)
    m = jnp.max(lse, axis=-1)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe[..., None])  # [*R, P]; exactly 0 for empty splits
    denom = jnp.sum(w, axis=-1)
    o = jnp.where(w[..., None] > 0, o.astype(jnp.float32), 0.0)
    out = jnp.einsum("...p,...ph->...h", w, o) / jnp.where(denom > 0, denom, 1.0)[..., None]
    lse_out = jnp.where(denom > 0, m_safe + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out, lse_out
