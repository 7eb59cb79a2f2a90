"""RMSNorm variants with HF's exact precision semantics.

* plain (Llama, Qwen3, DeepSeek): `w * x̂.astype(dtype)`, `x̂ = x_f32 * rsqrt(mean(x_f32²) + eps)`;
* zero-centred (Qwen3-Next / Qwen3.5): `(x̂ * (1 + w_f32)).astype(dtype)`, weight initialised to 0;
* gated (GDN output): `(w * x̂.astype(dtype)) * silu(z_f32)`, cast back to x's dtype.

The statistic is always taken in float32 over the last axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float

from models.layers.linear import weight


def rms_normalize(x: Float[Array, "... D"], eps: float) -> Float[Array, "... D"]:
    """float32 `x * rsqrt(mean(x²) + eps)` over the last axis."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + eps)


def rms_norm(
    x: Float[Array, "... D"], weight: Float[Array, " D"], eps: float, *,
    zero_centered: bool = False,
) -> Float[Array, "... D"]:
    """RMSNorm of the last axis; see the module docstring for the two weightings."""
    xhat = rms_normalize(x, eps)
    if zero_centered:
        return (xhat * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    return weight.astype(x.dtype) * xhat.astype(x.dtype)


def gated_rms_norm(
    x: Float[Array, "... D"], z: Float[Array, "... D"], weight: Float[Array, " D"], eps: float
) -> Float[Array, "... D"]:
    """Norm first, then the SiLU gate `z` (Qwen3-Next / Qwen3.5 GDN output norm)."""
    y = weight.astype(x.dtype) * rms_normalize(x, eps).astype(x.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned `weight [D]`.

    Args:
      dim: D.
      eps: added to the mean square.
      zero_centered: `(1 + w)` weighting with `w` initialised to 0 (else `w`, initialised to 1).
      dtype: parameter and output dtype.
    """

    def __init__(self, dim: int, *, eps: float, zero_centered: bool = False,
                 dtype=jnp.float32):
        self.eps = eps
        self.zero_centered = zero_centered
        self.weight = weight(None, (dim,), dtype, init="zeros" if zero_centered else "ones")

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        return rms_norm(x, self.weight[...], self.eps, zero_centered=self.zero_centered)


class GatedRMSNorm(nnx.Module):
    """`gated_rms_norm` with a learned plain `weight [D]` (initialised to 1)."""

    def __init__(self, dim: int, *, eps: float, dtype=jnp.float32):
        self.eps = eps
        self.weight = weight(None, (dim,), dtype, init="ones")

    def __call__(self, x: Float[Array, "... D"], z: Float[Array, "... D"]) -> Float[Array, "... D"]:
        return gated_rms_norm(x, z, self.weight[...], self.eps)
