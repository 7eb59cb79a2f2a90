"""Elastic-Attention router MLP (PawQwen3 `AttentionRouter`, softmax variant) as a Flax NNX module.

One MLP shared by every KV head ("head agnostic"), applied to the pooled pre-RoPE keys
(`attn.elastic.ctx_q_pool`), `d = head_dim`:

    h      = Linear(4d -> d)(silu(Linear(d -> 4d)(pooled)))                          # features
    logits = Linear(d -> 2)(silu(Linear(4d -> d)(silu(Linear(d -> 4d)(h)))))         # 2 classes
    z      = argmax(logits)          # 1 = retrieval / full, 0 = sparse (the code's convention)

All Linears have a bias. The layers sit in `nnx.Sequential`s whose indices equal the HF
`nn.Sequential` indices (activations included), so the checkpoint tensor
`...mask_allocator.cls_router_head_agnostic.4.weight` (`[out, in]`) is
`router.cls_router_head_agnostic.layers[4].kernel` transposed (`[in, out]`); biases load as they
are. `load_hf_state` does exactly that. Not supported: the sigmoid (`use_softmax=False`) variant,
task embeddings and the training-only Gumbel / temperature machinery (`log_temp` is skipped).

The decision `z` is an argmax: its derivative is zero almost everywhere, so a gradient of a loss
through the inference path would give the routers exactly zero gradients. `hard_decision` makes
differentiating it an error instead: `z` comes from a `jax.custom_jvp` whose rule raises a
`TypeError` pointing at `models.heads.router` (a straight-through Gumbel-softmax relaxation
trained on `AttentionRouter.logits`). The rule fires only when a tangent reaches the router, so
forwards that do not route (PawQwen3 with `elastic=False`) differentiate as before.
"""

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

# HF sub-module name -> indices of its Linear layers inside the nn.Sequential.
HF_LINEARS = {"cls_feat_extractor": (0, 2), "cls_router_head_agnostic": (0, 2, 4)}

NOT_DIFFERENTIABLE = (
    "elastic router decisions are a hard rule (an argmax of the router logits, or PawQwen3's "
    "static hard-concrete decisions) and have no gradient; differentiating them would give the "
    "router exactly zero gradients. Train the routers with models.heads.router (a relaxed, "
    "differentiable gate over AttentionRouter.logits), or differentiate the dense backbone "
    "(PawQwen3ForCausalLM(..., elastic=False))")


def _refuse_jvp(primals, tangents):
    del primals, tangents
    raise TypeError(NOT_DIFFERENTIABLE)


def hard_decision(fn):
    """Wrap `fn` (float arrays -> integer decisions) so that differentiating it raises.

    Returns:
      `fn` as a `jax.custom_jvp`: the same values; a tangent reaching its inputs raises
      `TypeError(NOT_DIFFERENTIABLE)` (under `jax.grad`, `jax.jvp`, `jax.vjp`).
    """
    wrapped = jax.custom_jvp(fn)
    wrapped.defjvp(_refuse_jvp)
    return wrapped


@hard_decision
def argmax_decision(logits: Float[Array, "B K 2"]) -> Int[Array, "B K"]:
    """`argmax(logits, -1)` as int32 (1 = retrieval / full); not differentiable (raises)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


class AttentionRouter(nnx.Module):
    """Per-request, per-KV-head full / sparse decision from pooled pre-RoPE keys.

    Deterministic (inference): no Gumbel noise, no temperature. Computes in `param_dtype`.
    """

    def __init__(self, head_dim: int, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        """Build the five Linear layers.

        Args:
          head_dim: d, the key head dim the router reads (128 for Qwen3-4B / 8B).
          rngs: initialiser keys (real weights come from `load_hf_state`).
          param_dtype: parameter and compute dtype.

        Raises:
          ValueError: `head_dim <= 0`.
        """
        if not isinstance(head_dim, int) or head_dim <= 0:
            raise ValueError(f"{head_dim=} must be a positive int")
        d = head_dim
        lin = lambda i, o: nnx.Linear(i, o, use_bias=True, param_dtype=param_dtype, rngs=rngs)
        self.head_dim = d
        self.cls_feat_extractor = nnx.Sequential(lin(d, 4 * d), jax.nn.silu, lin(4 * d, d))
        self.cls_router_head_agnostic = nnx.Sequential(
            lin(d, 4 * d), jax.nn.silu, lin(4 * d, d), jax.nn.silu, lin(d, 2))

    def __call__(
        self, pooled: Float[Array, "B K H"]
    ) -> tuple[Float[Array, "B K 2"], Int[Array, "B K"]]:
        """Route.

        Args:
          pooled: `[B, K, H]` pooled keys (`ctx_q_pool`), `H == head_dim`.

        Returns:
          `(logits [B, K, 2] float32, z [B, K] int32)`, `z = argmax(logits)`; z = 1 means
          retrieval (full attention), z = 0 sparse.

        Raises:
          ValueError: last axis is not `head_dim`.
          TypeError: when differentiated with a tangent reaching the logits (`z` is an argmax;
            train on `logits` instead, see `hard_decision`).
        """
        logits = self.logits(pooled)
        return logits, argmax_decision(logits)

    def logits(self, pooled: Float[Array, "B K H"]) -> Float[Array, "B K 2"]:
        """The two class logits `[B, K, 2]` float32 (differentiable; index 1 = retrieval).

        Raises:
          ValueError: last axis is not `head_dim`.
        """
        if pooled.shape[-1] != self.head_dim:
            raise ValueError(f"pooled.shape={pooled.shape} must end in head_dim={self.head_dim}")
        dtype = self.cls_feat_extractor.layers[0].kernel[...].dtype
        h = self.cls_feat_extractor(pooled.astype(dtype))
        return self.cls_router_head_agnostic(h).astype(jnp.float32)


def load_hf_state(router: AttentionRouter, tensors: Mapping[str, object], prefix: str = "") -> None:
    """Copy HF router weights into `router` in place (Linear weights `[out, in]` -> `[in, out]`).

    Args:
      router: the module to fill.
      tensors: name -> array-like (numpy, jax or torch CPU tensors), e.g. a safetensors dict.
      prefix: the router's prefix in `tensors`, e.g. `"model.layers.3.self_attn.mask_allocator."`.

    Raises:
      KeyError: a tensor is missing (all missing names listed).
      ValueError: a tensor has the wrong shape.
    """
    names = [f"{prefix}{seq}.{i}.{p}" for seq, idx in HF_LINEARS.items() for i in idx
             for p in ("weight", "bias")]
    missing = [n for n in names if n not in tensors]
    if missing:
        raise KeyError(f"missing router tensors: {missing}")
    for seq, indices in HF_LINEARS.items():
        for i in indices:
            layer = getattr(router, seq).layers[i]
            for hf_name, var, transpose in (("weight", layer.kernel, True),
                                            ("bias", layer.bias, False)):
                name = f"{prefix}{seq}.{i}.{hf_name}"
                value = tensors[name]
                if hasattr(value, "detach"):  # a torch tensor
                    value = value.detach().float().numpy()
                value = np.asarray(value)
                expected = var[...].shape[::-1] if transpose else var[...].shape
                if value.shape != expected:
                    raise ValueError(f"{name} has shape {value.shape}; expected {expected}")
                value = value.T if transpose else value
                var[...] = jnp.asarray(value, var[...].dtype)
