"""Name-mapping rules: which checkpoint tensors make which model parameter, and how.

A `Rule` names one target parameter (its `/`-joined nnx path, e.g. `layers/0/mixer/q_proj/kernel`),
the checkpoint tensors it consumes (HF names) and a transform written with `jax.numpy` (so the
loader can check shapes with `jax.eval_shape` before reading any data). Every checkpoint tensor
must be consumed by exactly one rule or matched by the family's ignore list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Rule:
    """`target = transform(*[checkpoint[s] for s in sources])`.

    Attributes:
      target: `/`-joined parameter path in the model state.
      sources: checkpoint tensor names (HF naming).
      transform: jnp function of the source arrays; None = the single source as is.
    """

    target: str
    sources: tuple[str, ...]
    transform: Callable | None = None

    def apply(self, *arrays):
        """The target value from the source arrays."""
        if self.transform is None:
            (x,) = arrays
            return x
        return self.transform(*arrays)


def transpose(w):
    """torch Linear `[out, in]` → kernel `[in, out]`."""
    return jnp.transpose(w)


def param(target: str, source: str) -> Rule:
    """A tensor copied as is (norm weights, embeddings, biases)."""
    return Rule(target, (source,))


def linear(target: str, source: str, *, bias: bool = False) -> list[Rule]:
    """torch `nn.Linear` `{source}.weight [out, in]` (+ `.bias`) → `{target}/kernel [in, out]`."""
    rules = [Rule(f"{target}/kernel", (f"{source}.weight",), transpose)]
    if bias:
        rules.append(param(f"{target}/bias", f"{source}.bias"))
    return rules


def _stack_transposed(*ws):
    return jnp.stack([jnp.transpose(w) for w in ws])


def stacked_experts(target: str, source: str, num_experts: int, *,
                    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
                    ) -> list[Rule]:
    """Per-expert HF Linears `{source}.{e}.{name}.weight` → stacked `[E, in, out]` kernels.

    Targets are `{target}/gate_proj`, `{target}/up_proj`, `{target}/down_proj` (the
    `SwiGLUExperts` parameters); `names` are the HF names of the three projections.
    """
    ours = ("gate_proj", "up_proj", "down_proj")
    return [Rule(f"{target}/{mine}",
                 tuple(f"{source}.{e}.{theirs}.weight" for e in range(num_experts)),
                 _stack_transposed)
            for mine, theirs in zip(ours, names)]
