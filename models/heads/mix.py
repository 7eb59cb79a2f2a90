"""Attends that run full and streaming attention side by side, per KV head.

Head selection needs, for every (layer, KV head), the output the layer would have with that head
full and with that head streaming (sink + window). Both are dense `attn.dense.attention` calls
over this forward's q, k, v; the window / sinks of the streaming call are static Python ints, so
on a GPU both run in the flash kernels and both have their flash backward.

* `MixedAttend`: `o = s + g * (f - s)` per KV head, `f` full, `s` streaming, `g` in [0, 1] a gate
  (1 = full). Gates are a `[L, K]` array (DuoAttention's per-head gates, `models.heads.gates`) or a
  function of the layer's q, k, v (a router, `models.heads.router`). The returned state is the
  `[B, K]` gate the layer used, which `CausalLM.forward` collects per layer.
* `ProbeAttend`: the full output, plus what head scoring reads at a few query positions (the
  answer tokens): each KV head's attention mass on marked keys (the needle) and the full and
  streaming per-head outputs (`models.heads.scoring`).

Positions are the forward's token index (a right-padded batch of prompts starting at 0); neither
attend keeps a KV cache. Not done here: segment ids / packed rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from models.layers.attention import QKV, AttendSpec

GateFn = Callable[[AttendSpec, QKV], Float[Array, "B K"]]


def streaming_geometry(spec: AttendSpec, window: int, sinks: int) -> tuple[int, int]:
    """`(window, sinks)` of a streaming head on this layer: a sliding layer keeps its narrower
    window (a streaming head never sees more than the layer's own window)."""
    if spec.window is not None and spec.window < window:
        return spec.window, max(sinks, spec.sinks)
    return window, sinks


def full_and_streaming(spec: AttendSpec, qkv: QKV, *, window: int, sinks: int,
                       implementation: str = "auto"
                       ) -> tuple[Float[Array, "B T N Hv"], Float[Array, "B T N Hv"]]:
    """This layer's attention output with every head full, and with every head streaming."""
    from attn.dense import attention

    full, _ = attention(qkv.q, qkv.k, qkv.v, causal=True, scale=spec.scale, window=spec.window,
                        sinks=spec.sinks, implementation=implementation)
    w, s = streaming_geometry(spec, window, sinks)
    stream, _ = attention(qkv.q, qkv.k, qkv.v, causal=True, scale=spec.scale, window=w, sinks=s,
                          implementation=implementation)
    return full, stream


def static_gates(alpha: Float[Array, "L K"]) -> GateFn:
    """A gate function reading row `spec.layer` of a `[L, K]` gate array (same for every row)."""

    def gate(spec: AttendSpec, qkv: QKV) -> Float[Array, "B K"]:
        return jnp.broadcast_to(alpha[spec.layer], (qkv.q.shape[0], alpha.shape[1]))

    return gate


@dataclasses.dataclass(frozen=True)
class MixedAttend:
    """Per KV head, `gate * full + (1 - gate) * streaming` attention.

    Args:
      gates: `[L, K]` gates in [0, 1] (1 = full), or `gate_fn(spec, qkv) -> [B, K]`.
      window: most recent positions a streaming head sees (its own included).
      sinks: leading positions a streaming head keeps.
      implementation: passed to `attn.dense.attention`.

    Returns from a call `(o [B, T, N, Hv], gate [B, K] float32)`.
    """

    gates: Float[Array, "L K"] | GateFn
    window: int
    sinks: int
    implementation: str = "auto"

    def __call__(self, spec: AttendSpec, qkv: QKV, state: Any = None
                 ) -> tuple[Float[Array, "B T N Hv"], Float[Array, "B K"]]:
        gate_fn = self.gates if callable(self.gates) else static_gates(self.gates)
        g = gate_fn(spec, qkv).astype(jnp.float32)  # [B, K]
        full, stream = full_and_streaming(spec, qkv, window=self.window, sinks=self.sinks,
                                          implementation=self.implementation)
        group = qkv.q.shape[2] // g.shape[1]
        g_heads = jnp.repeat(g, group, axis=1)[:, None, :, None]  # [B, 1, N, 1]
        o = stream.astype(jnp.float32) + g_heads * (full - stream).astype(jnp.float32)
        return o.astype(full.dtype), g


class Probe(NamedTuple):
    """What `ProbeAttend` records per layer at the probe queries (`A` of them per row).

    Attributes:
      mass: `[B, A, K]` attention mass each KV head (mean over its G query heads) puts on the
        marked keys.
      full: `[B, A, N, Hv]` per-head output with every head full.
      stream: `[B, A, N, Hv]` per-head output with every head streaming.
    """

    mass: Float[Array, "B A K"]
    full: Float[Array, "B A N Hv"]
    stream: Float[Array, "B A N Hv"]


@dataclasses.dataclass(frozen=True)
class ProbeAttend:
    """Full attention that also records a `Probe` at the query positions `query_pos`.

    Args:
      query_pos: `[B, A]` int32 token indices of the probe queries (e.g. the answer positions).
      key_mask: `[B, S]` bool, the keys whose attention mass is measured (e.g. the needle).
      window, sinks: the streaming geometry whose output is recorded beside the full one.
      implementation: passed to `attn.dense.attention`.
    """

    query_pos: Int[Array, "B A"]
    key_mask: Bool[Array, "B S"]
    window: int
    sinks: int
    implementation: str = "auto"

    def __call__(self, spec: AttendSpec, qkv: QKV, state: Any = None
                 ) -> tuple[Float[Array, "B T N Hv"], Probe]:
        full, stream = full_and_streaming(spec, qkv, window=self.window, sinks=self.sinks,
                                          implementation=self.implementation)
        take = jax.vmap(lambda x, i: x[i])  # [B, T, ...] x [B, A] -> [B, A, ...]
        q = take(qkv.q, self.query_pos).astype(jnp.float32)  # [B, A, N, H]
        b, a, n, h = q.shape
        num_kv = qkv.k.shape[2]
        q = q.reshape(b, a, num_kv, n // num_kv, h)
        logits = jnp.einsum("BAKGH,BSKH->BAKGS", q, qkv.k.astype(jnp.float32)) * spec.scale
        s = qkv.k.shape[1]
        visible = jnp.arange(s)[None, None, :] <= self.query_pos[:, :, None]  # [B, A, S]
        if spec.window is not None:
            recent = jnp.arange(s)[None, None, :] > self.query_pos[:, :, None] - spec.window
            visible &= recent | (jnp.arange(s) < spec.sinks)[None, None, :]
        logits = jnp.where(visible[:, :, None, None, :], logits, -jnp.inf)
        p = jax.nn.softmax(logits, axis=-1)
        mass = jnp.einsum("BAKGS,BS->BAK", p, self.key_mask.astype(jnp.float32)) / (n // num_kv)
        probe = Probe(mass=mass, full=take(full, self.query_pos).astype(jnp.float32),
                      stream=take(stream, self.query_pos).astype(jnp.float32))
        return full, probe
