"""Dense building blocks: Linear, Embed (with the tied output head) and the gated MLP.

Parameters use the math layout, not torch's: a `Linear` kernel is `[in, out]` (torch `W.T`), an
embedding is `[V, D]`. Every parameter is made by `weight(...)`: random (normal) or constant
init for tests and training from scratch, or, inside `abstract_init()`, a bare
`jax.ShapeDtypeStruct` — how checkpoint loading builds a model's structure without allocating or
tracing anything. Modules of other families should create their parameters with `weight` too.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

ACTIVATIONS: dict[str, Callable] = {
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


_ABSTRACT = contextvars.ContextVar("models_abstract_init", default=False)


@contextlib.contextmanager
def abstract_init():
    """Inside this context `weight()` returns shape-only parameters (no memory, no tracing)."""
    token = _ABSTRACT.set(True)
    try:
        yield
    finally:
        _ABSTRACT.reset(token)


def weight(rngs: nnx.Rngs | None, shape: Sequence[int], dtype, *, init: str = "normal",
           std: float = 0.02) -> nnx.Param:
    """A parameter of `shape`: `init` in {"normal", "zeros", "ones"} (normal needs `rngs`).

    Inside `abstract_init()` it is a `jax.ShapeDtypeStruct` placeholder instead.
    """
    shape = tuple(int(d) for d in shape)
    if _ABSTRACT.get():
        return nnx.Param(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))
    if init == "normal":
        return nnx.Param(std * jax.random.normal(rngs.params(), shape, dtype))
    if init in ("zeros", "ones"):
        return nnx.Param((jnp.zeros if init == "zeros" else jnp.ones)(shape, dtype))
    raise ValueError(f"{init=} must be 'normal', 'zeros' or 'ones'")


def activation(name: str) -> Callable:
    """The activation called `name` in HF configs (`hidden_act`).

    Raises:
      ValueError: an unknown name.
    """
    if name not in ACTIVATIONS:
        raise ValueError(f"hidden_act={name!r} is not supported; supported: {tuple(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class Linear(nnx.Module):
    """`y = x @ kernel (+ bias)` with `kernel [in, out]`.

    Args:
      in_features, out_features: sizes.
      bias: whether there is a `bias [out]`.
      dtype: parameter and compute dtype.
      rngs: for the random init (normal, std 0.02).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.kernel = weight(rngs, (in_features, out_features), dtype)
        self.bias = weight(rngs, (out_features,), dtype, init="zeros") if bias else None

    def __call__(self, x: Float[Array, "... I"]) -> Float[Array, "... O"]:
        kernel = self.kernel[...]
        y = jnp.einsum("...i,io->...o", x.astype(kernel.dtype), kernel)
        if self.bias is not None:
            y = y + self.bias[...]
        return y


class Embed(nnx.Module):
    """Token embedding `[V, D]`; `attend` is the tied output head `x @ embedding.T`."""

    def __init__(self, vocab_size: int, dim: int, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = weight(rngs, (vocab_size, dim), dtype)

    def __call__(self, ids: Int[Array, "B T"]) -> Float[Array, "B T D"]:
        return jnp.take(self.embedding[...], ids, axis=0)

    def attend(self, x: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        emb = self.embedding[...]
        return jnp.einsum("btd,vd->btv", x.astype(emb.dtype), emb)


class GatedMLP(nnx.Module):
    """SwiGLU-style MLP `down(act(gate(x)) * up(x))` (Llama, Qwen, DeepSeek dense layers).

    Args:
      dim: D.
      hidden: intermediate size I.
      act: HF activation name (`"silu"`).
      bias: biases on all three projections (Llama's `mlp_bias`).
      dtype: parameter dtype.
    """

    def __init__(self, dim: int, hidden: int, *, act: str = "silu", bias: bool = False,
                 dtype=jnp.float32, rngs: nnx.Rngs):
        self.act = act
        activation(act)
        self.gate_proj = Linear(dim, hidden, bias=bias, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(dim, hidden, bias=bias, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(hidden, dim, bias=bias, dtype=dtype, rngs=rngs)

    def __call__(self, x: Float[Array, "... D"]) -> Float[Array, "... D"]:
        return self.down_proj(activation(self.act)(self.gate_proj(x)) * self.up_proj(x))
