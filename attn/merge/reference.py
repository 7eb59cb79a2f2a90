"""Reference merge of split-KV partial attention results by their log-sum-exp.

Split-KV decoding attends each split of the keys separately, giving a partial output normalised
within the split and that split's log-sum-exp. The exact full-attention result is the
lse-weighted average of the partials. Splits that saw no key carry lse = -inf and weigh nothing,
whatever their (possibly NaN) partial output; a row with no key in any split gives 0 and -inf.
Emptiness is `lse == -inf` and nothing else: a NaN lse or a NaN partial of a split that saw keys
makes the merged row NaN (never an empty row, never dropped by a weight that underflows).
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
    empty = lse == -jnp.inf  # [*R, P] splits that saw no key
    none = jnp.all(empty, axis=-1)  # [*R] rows that saw no key at all
    m = jnp.max(lse, axis=-1)  # NaN if some split's lse is NaN
    m_safe = jnp.where(none, 0.0, m)
    w = jnp.exp(lse - m_safe[..., None])  # [*R, P]; exactly 0 for empty splits
    denom = jnp.where(none, 1.0, jnp.sum(w, axis=-1))
    o = jnp.where(empty[..., None], 0.0, o.astype(jnp.float32))
    out = jnp.einsum("...p,...ph->...h", w, o) / denom[..., None]
    lse_out = jnp.where(none, -jnp.inf, m_safe + jnp.log(denom))
    return out, lse_out
