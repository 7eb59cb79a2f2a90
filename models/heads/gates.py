"""Trainable per-head gates (DuoAttention): learn which KV heads need full attention.

Every (layer, KV head) gets a gate `alpha` in [0, 1]. The gated model runs each attention layer as
`alpha * full + (1 - alpha) * streaming` per KV head (`models.heads.mix.MixedAttend`), with the
backbone frozen. The loss distils the dense model on the answer tokens and pushes gates down:

    loss = KL(dense || gated) on the answer tokens  +  l1 * mean(alpha)

Gates start at 1 (the gated model is the dense model) and are projected back into [0, 1] after
every optimizer step. A head whose streaming output loses the answer keeps a high gate; the rest
drift to 0. `binarize` then streams the lowest gates at a target fraction (`streaming_mask`).

Only `Gate` variables train: `nnx.Optimizer(..., wrt=Gate)` and `nnx.DiffState(0, Gate)` select
them, so the backbone's parameters never get a gradient or an update.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.heads.data import Batch
from models.heads.mix import MixedAttend
from models.heads.scoring import attention_layers, streaming_mask
from models.layers.attention import DenseAttend


class Gate(nnx.Param):
    """A per-head gate: the only variable head training updates."""


class GatedLM(nnx.Module):
    """A frozen causal LM with a `[L, K]` gate per attention KV head.

    Args:
      model: the backbone (`CausalLM` whose every layer is softmax attention).
      window, sinks: the streaming heads' geometry (tokens).
      init: initial gate value (1 = every head full).
      implementation: dense attention backend.

    Raises:
      ValueError: a layer that is not softmax attention, `window < 1`, `sinks < 0`, or `init`
        outside [0, 1].
    """

    def __init__(self, model, *, window: int, sinks: int, init: float = 1.0,
                 implementation: str = "auto"):
        layers = attention_layers(model)
        if len(layers) != len(model.layers):
            raise ValueError("gate training needs every layer to be softmax attention; attention "
                             f"layers are {layers} of {len(model.layers)}")
        if window < 1 or sinks < 0:
            raise ValueError(f"{window=} must be >= 1 and {sinks=} >= 0")
        if not 0.0 <= init <= 1.0:
            raise ValueError(f"{init=} must be in [0, 1]")
        num_kv = model.layers[0].mixer.cfg.num_kv_heads
        self.model = model
        self.alpha = Gate(jnp.full((len(model.layers), num_kv), init, jnp.float32))
        self.window = int(window)
        self.sinks = int(sinks)
        self.implementation = implementation

    def hidden(self, input_ids, *, gated: bool = True):
        """Final hidden states `[B, T, D]`: gated, or the dense backbone's."""
        b, t = input_ids.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if gated:
            attend = MixedAttend(self.alpha[...], window=self.window, sinks=self.sinks,
                                 implementation=self.implementation)
        else:
            attend = DenseAttend(implementation=self.implementation)
        hidden, _ = self.model.forward(input_ids, positions, attend=attend)
        return hidden


def answer_logprobs(gated: GatedLM, hidden, batch: Batch):
    """`[B, A, V]` float32 log-probabilities at the answer positions."""
    h = jax.vmap(lambda x, i: x[i])(hidden, batch.answer_pos)
    return jax.nn.log_softmax(gated.model.logits(h).astype(jnp.float32), axis=-1)


def distill_loss(gated: GatedLM, batch: Batch, *, l1: float) -> tuple[jax.Array, dict]:
    """`KL(dense || gated)` per answer token (mean) + `l1 * mean(alpha)`; metrics beside it.

    The dense teacher is the same backbone with every head full, under `stop_gradient`.
    """
    teacher = jax.lax.stop_gradient(
        answer_logprobs(gated, gated.hidden(batch.input_ids, gated=False), batch))
    student = answer_logprobs(gated, gated.hidden(batch.input_ids), batch)
    kl = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1)  # [B, A]
    valid = batch.answer_valid.astype(jnp.float32)
    kl = jnp.sum(kl * valid) / jnp.maximum(valid.sum(), 1.0)
    alpha = gated.alpha[...]
    loss = kl + l1 * jnp.mean(alpha)
    # Teacher-forced accuracy of the gated model on the answer tokens (how much it still copies).
    hit = (jnp.argmax(student, -1) == batch.answer_ids).astype(jnp.float32)
    acc = jnp.sum(hit * valid) / jnp.maximum(valid.sum(), 1.0)
    return loss, dict(loss=loss, kl=kl, mean_gate=jnp.mean(alpha), answer_acc=acc)


def make_optimizer(gated: GatedLM, learning_rate: float = 0.02) -> nnx.Optimizer:
    """Adam over the gates only (DuoAttention trains gates at lr 0.02)."""
    return nnx.Optimizer(gated, optax.adam(learning_rate), wrt=Gate)


@nnx.jit(static_argnames=("l1",))
def train_step(gated: GatedLM, optimizer: nnx.Optimizer, batch: Batch, *, l1: float
               ) -> dict[str, Any]:
    """One optimizer step on the gates; returns the step's metrics (before the update)."""
    grad_fn = nnx.value_and_grad(lambda g: distill_loss(g, batch, l1=l1),
                                 argnums=nnx.DiffState(0, Gate), has_aux=True)
    (_, metrics), grads = grad_fn(gated)
    optimizer.update(gated, grads)
    gated.alpha[...] = jnp.clip(gated.alpha[...], 0.0, 1.0)
    return metrics


def binarize(alpha: np.ndarray, fraction: float) -> np.ndarray:
    """`[L, K]` streaming mask: the `round(fraction * L * K)` lowest gates stream."""
    return streaming_mask(np.asarray(alpha), fraction)
