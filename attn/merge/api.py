"""Public split-KV merge: validation once, then the backend (`attn._op`)."""

import jax.numpy as jnp
from jaxtyping import Array, Float

from attn import _checks
from attn._op import Backend, op
from attn.merge import reference


def _merge_triton(*, o, lse):
    from attn.merge import triton as kernel

    return kernel.merge_partials(o, lse.astype(jnp.float32))


_BACKENDS = (
    Backend(name="triton", run=_merge_triton),
    Backend(name="xla", run=reference.merge_partials, platforms=("cpu", "gpu")),
)


@op(name="merge_partials", backends=_BACKENDS)
def merge_partials(
    o: Float[Array, "*R P Hv"],
    lse: Float[Array, "*R P"],
) -> tuple[Float[Array, "*R Hv"], Float[Array, "*R"]]:
    """Merge split-KV partial attention outputs by their log-sum-exp.

    Args:
      o: `[*R, P, Hv]` partial outputs, each normalised within its split (any float dtype).
      lse: `[*R, P]` log-sum-exp per split, `-inf` for a split that saw no key.
      implementation: `"xla"`, `"triton"` (forward only) or `"auto"`.

    Returns:
      `(out [*R, Hv] float32, lse [*R] float32)`; rows with no key anywhere give 0 and `-inf`.

    Raises:
      ValueError: ranks or the split axis disagree.
      TypeError: non-floating inputs.
    """
    _checks.check_floating("o", o)
    _checks.check_floating("lse", lse)
    if o.ndim < 2:
        raise ValueError(f"o must have shape [*R, P, Hv]; got shape {o.shape}")
    if lse.shape != o.shape[:-1]:
        raise ValueError(f"lse.shape={lse.shape} must equal o.shape[:-1]={o.shape[:-1]}")
    return dict(o=o, lse=lse)
