"""Softmax attention layer, split into `project` → `attend` → `output`.

Design. An attention layer is three steps, and only the middle one depends on how keys and
values are stored:

    qkv       = layer.project(x, positions)      # projections, q/k norms, RoPE: QKV(q, k, v)
    o, state  = attend(layer.spec, qkv, state)   # softmax(q kᵀ) v over whatever KV there is
    y         = layer.output(o, qkv)             # (gating,) o_proj

`project` and `output` own every weight and are the same code for training, the full forward
and the generation engine. `attend` is a plain function chosen by the caller:

* full forward (`model(input_ids)`): `DenseAttend()` calls `attn.dense.attention` on this call's
  q, k, v (causal, the layer's window / sinks / scale, optional packed segment ids); no state.
* engine (later): an attend that writes k, v into this layer's paged KV `state` at the token
  positions, then runs chunked prefill or paged decode over the cache, returning the new state.

`layer.spec` (an `AttendSpec`: layer index, softmax scale, window, sinks) is static and hashable,
so an attend can key per-layer caches and kernel choices on it. Positions are absolute token
positions `[B, T]`; RoPE is applied inside `project`, so caches hold rotated keys. A family with
a different attention (Qwen3-Next output gate, MLA's latent KV) subclasses `Attention` or brings
its own projection type; the three-step contract stays.

Not done here: KV caching itself, cross-attention, ALiBi.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models.config import ConfigBase, ConfigError, check_choice, check_divisible, check_positive
from models.layers.linear import Linear
from models.layers.norms import RMSNorm
from models.layers.rope import RopeConfig, rotate

QK_NORMS = (None, "plain", "zero_centered")


class QKV(NamedTuple):
    """Output of `Attention.project` (a pytree).

    Attributes:
      q: `[B, T, N, H]` rotated queries.
      k: `[B, T, K, H]` rotated keys.
      v: `[B, T, K, Hv]` values.
      gate: optional `[B, T, N * Hv]` output gate logits (gated attention), else None.
    """

    q: Float[Array, "B T N H"]
    k: Float[Array, "B T K H"]
    v: Float[Array, "B T K Hv"]
    gate: Float[Array, "B T NHv"] | None = None


@dataclasses.dataclass(frozen=True)
class AttendSpec:
    """Static per-layer facts an attend function needs.

    Attributes:
      layer: layer index in the model (keys per-layer caches).
      scale: softmax scale.
      window: sliding window (most recent positions visible, own included) or None.
      sinks: leading positions always visible with a window.
    """

    layer: int
    scale: float
    window: int | None = None
    sinks: int = 0


class Attend(Protocol):
    """`attend(spec, qkv, state) -> (o [B, T, N, Hv], new_state)`."""

    def __call__(self, spec: AttendSpec, qkv: QKV, state: Any) -> tuple[Array, Any]: ...


@dataclasses.dataclass(frozen=True)
class DenseAttend:
    """Full-forward attend: causal attention of this call's tokens to themselves, no cache.

    Args:
      segment_ids: optional `[B, T]` int32 packed-sequence ids (tokens attend within their
        segment only; positions should restart per segment).
      implementation: passed to `attn.dense.attention`.
    """

    segment_ids: Int[Array, "B T"] | None = None
    implementation: str = "auto"

    def __call__(self, spec: AttendSpec, qkv: QKV, state: Any = None) -> tuple[Array, Any]:
        from attn.dense import attention

        o, _ = attention(
            qkv.q, qkv.k, qkv.v, causal=True, scale=spec.scale, window=spec.window,
            sinks=spec.sinks, q_segment_ids=self.segment_ids, kv_segment_ids=self.segment_ids,
            implementation=self.implementation)
        return o, state


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionConfig(ConfigBase):
    """One softmax-attention layer.

    Attributes:
      dim: D, model width.
      num_heads: N.
      num_kv_heads: K (divides N; query head n uses KV head n // (N // K)).
      head_dim: H.
      v_head_dim: Hv (None = H).
      qkv_bias: biases on q, k, v projections; o_bias: on the output projection.
      qk_norm: None, `"plain"` or `"zero_centered"` per-head RMSNorm of q and k before RoPE.
      norm_eps: epsilon of the q / k norms.
      rope: rotary embedding or None (NoPE).
      scale: softmax scale; None = `H ** -0.5`.
      window: sliding window of this layer or None.
      sinks: always-visible leading positions (with a window).
    """

    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None
    norm_eps: float = 1e-6
    rope: RopeConfig | None = None
    scale: float | None = None
    window: int | None = None
    sinks: int = 0

    def __post_init__(self):
        name = type(self).__name__
        check_positive(name, dim=self.dim, num_heads=self.num_heads,
                       num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
        check_divisible(name, "num_heads", self.num_heads, "num_kv_heads", self.num_kv_heads)
        if self.v_head_dim is not None:
            check_positive(name, v_head_dim=self.v_head_dim)
        check_choice(name, "qk_norm", self.qk_norm, QK_NORMS)
        if self.rope is not None and self.rope.rotary_dim > self.head_dim:
            raise ConfigError(f"{name}.rope.rotary_dim={self.rope.rotary_dim} exceeds "
                              f"head_dim={self.head_dim}")
        if self.window is not None:
            check_positive(name, window=self.window)
        if self.sinks < 0:
            raise ConfigError(f"{name}.sinks={self.sinks} must be >= 0")

    @property
    def hv(self) -> int:
        """Value head dim Hv."""
        return self.v_head_dim or self.head_dim


class Attention(nnx.Module):
    """Multi-head / grouped-query softmax attention (Llama, Qwen3): project, attend, output.

    Args:
      cfg: the layer config.
      layer: index of this layer in the model (becomes `spec.layer`).
      dtype: parameter and compute dtype.
    """

    def __init__(self, cfg: AttentionConfig, *, layer: int, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.cfg = cfg
        scale = cfg.scale if cfg.scale is not None else cfg.head_dim ** -0.5
        self.spec = AttendSpec(layer=layer, scale=float(scale), window=cfg.window,
                               sinks=cfg.sinks)
        d, n, k, h, hv = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hv
        self.q_proj = Linear(d, n * h, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, k * h, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, k * hv, bias=cfg.qkv_bias, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(n * hv, d, bias=cfg.o_bias, dtype=dtype, rngs=rngs)
        if cfg.qk_norm is not None:
            zc = cfg.qk_norm == "zero_centered"
            self.q_norm = RMSNorm(h, eps=cfg.norm_eps, zero_centered=zc, dtype=dtype)
            self.k_norm = RMSNorm(h, eps=cfg.norm_eps, zero_centered=zc, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"]) -> QKV:
        """Projections, per-head q/k norms, then RoPE at `positions`."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.hv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.rope is not None:
            q, k = rotate(cfg.rope, q, positions), rotate(cfg.rope, k, positions)
        return QKV(q, k, v)

    def output(self, o: Float[Array, "B T N Hv"], qkv: QKV) -> Float[Array, "B T D"]:
        """Merge heads and apply o_proj (`qkv` is there for subclasses with an output gate)."""
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b, t, -1).astype(qkv.q.dtype))

    def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"], *,
                 attend: Attend, state: Any = None) -> tuple[Float[Array, "B T D"], Any]:
        """`output(attend(spec, project(x, positions), state))`; returns `(y, new_state)`."""
        qkv = self.project(x, positions)
        o, state = attend(self.spec, qkv, state)
        return self.output(o, qkv), state
