"""Gated DeltaNet token mixer (Qwen3-Next / Qwen3.5 `linear_attention` layers): project → mix →
output, with the recurrent state explicit.

Design. Like `Attention` (`models/layers/attention.py`), a GDN layer is three steps, and only the
middle one touches per-request state:

    inputs      = layer.project(x)                   # in_proj(s), ordering fix, gates: GDNInputs
    o, state    = mix(layer.spec, inputs, state)      # conv (conv state) + delta rule (ssm state)
    y           = layer.output(o, inputs)             # gated RMSNorm (gate z), out_proj

`project` and `output` own every weight except the conv taps, which travel in `GDNInputs` so that
`mix` stays a plain function of its arguments. `mix` is chosen by the caller through the attend
object the decoder passes to every layer: if `attend` has a `gdn_mix` attribute, GDN layers call
`attend.gdn_mix(spec, inputs, state)` (an engine's slot-pool version: `causal_conv1d_*_pool` +
`gdn_*_pool` with its own slot ids); otherwise they call `gdn_mix` below, which takes a per-row
`GDNState` (conv `[B, C, W - 1]`, ssm `[B, Nv, H, Hv]` float32), or None for zeros (the full
forward), and returns the final state either way.

Math (HF `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet`, transformers 5.x):
  1. projections → pre-conv `x = [q (Nk·H) │ k (Nk·H) │ v (Nv·Hv)]` (C = conv_dim channels), output
     gate `z [Nv, Hv]`, write-strength logits `b [Nv]`, decay input `a [Nv]`. Qwen3-Next fuses them
     (`in_proj_qkvz`, `in_proj_ba`) with rows grouped per key head, `[q H │ k H │ v r·Hv │ z r·Hv]`
     and `[b r │ a r]` (r = Nv / Nk), undone by `_ungroup`; Qwen3.5 has four flat projections.
  2. depthwise causal conv over time (taps `[C, W]`, no bias), SiLU; split into q, k, v.
  3. `g = -exp(A_log) softplus(a + dt_bias)`, `beta = sigmoid(b)` (float32).
  4. gated delta rule with l2-normalised q, k and query scale `H ** -0.5`; value head h reads key
     head `h // r`; chunked (WY) form for prefill, the recurrence for one-token steps.
  5. per value head gated RMSNorm `w · norm(o) · silu(z)` (plain weight), then `out_proj`.

Not done here: packed sequences in one row (segment ids) and HF's padding mask
(`apply_mask_to_padding_states`); positions are not used (GDN has no positional encoding).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models.config import ConfigBase, ConfigError, check_choice, check_divisible, check_positive
from models.layers.linear import Linear, weight
from models.layers.norms import GatedRMSNorm

PROJECTION_LAYOUTS = ("grouped", "split")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GDNConfig(ConfigBase):
    """One Gated DeltaNet layer.

    Attributes:
      dim: D, model width.
      num_k_heads: Nk (`linear_num_key_heads`).
      num_v_heads: Nv (`linear_num_value_heads`), a multiple of Nk.
      head_k_dim: H (`linear_key_head_dim`).
      head_v_dim: Hv (`linear_value_head_dim`).
      conv_width: W (`linear_conv_kernel_dim`).
      norm_eps: epsilon of the gated output RMSNorm (`rms_norm_eps`).
      projection_layout: `"grouped"` (Qwen3-Next `in_proj_qkvz` / `in_proj_ba`, rows grouped per
        key head) or `"split"` (Qwen3.5 `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`).
      chunk_size: C of the chunked delta rule (64 as HF and fla).
    """

    dim: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int = 4
    norm_eps: float = 1e-6
    projection_layout: str = "split"
    chunk_size: int = 64

    def __post_init__(self):
        name = type(self).__name__
        check_positive(name, dim=self.dim, num_k_heads=self.num_k_heads,
                       num_v_heads=self.num_v_heads, head_k_dim=self.head_k_dim,
                       head_v_dim=self.head_v_dim, conv_width=self.conv_width,
                       chunk_size=self.chunk_size)
        check_divisible(name, "num_v_heads", self.num_v_heads, "num_k_heads", self.num_k_heads)
        if self.conv_width < 2:
            raise ConfigError(f"{name}.conv_width={self.conv_width} must be >= 2")
        check_choice(name, "projection_layout", self.projection_layout, PROJECTION_LAYOUTS)
        if not self.norm_eps > 0:
            raise ConfigError(f"{name}.norm_eps={self.norm_eps} must be positive")

    @property
    def key_dim(self) -> int:
        """Nk · H."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """Nv · Hv."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """C = 2 · Nk · H + Nv · Hv conv channels (`[q │ k │ v]`)."""
        return 2 * self.key_dim + self.value_dim


@dataclasses.dataclass(frozen=True)
class GDNSpec:
    """Static per-layer facts a mix function needs (hashable).

    Attributes:
      layer: layer index in the model (keys per-layer state pools).
      num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_width: Nk, Nv, H, Hv, W.
      scale: query scale (`H ** -0.5`).
      chunk_size: C of the chunked prefill.
    """

    layer: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_width: int
    scale: float
    chunk_size: int = 64

    @property
    def conv_dim(self) -> int:
        """C = 2 · Nk · H + Nv · Hv."""
        return 2 * self.num_k_heads * self.head_k_dim + self.num_v_heads * self.head_v_dim


class GDNInputs(NamedTuple):
    """Output of `GatedDeltaNet.project` (a pytree).

    Attributes:
      x: `[B, T, C]` pre-conv `[q │ k │ v]` channels (what the conv state stores).
      z: `[B, T, Nv, Hv]` output gate (pre-SiLU).
      g: `[B, T, Nv]` float32 log-decay (<= 0).
      beta: `[B, T, Nv]` float32 write strength.
      conv_weight: `[C, W]` conv taps.
    """

    x: Float[Array, "B T C"]
    z: Float[Array, "B T Nv Hv"]
    g: Float[Array, "B T Nv"]
    beta: Float[Array, "B T Nv"]
    conv_weight: Float[Array, "C W"]


class GDNState(NamedTuple):
    """Per-row recurrent state of one GDN layer (a pytree).

    Attributes:
      conv: `[B, C, W - 1]` the last `W - 1` pre-conv inputs, oldest first (model dtype).
      ssm: `[B, Nv, H, Hv]` float32 delta-rule state (K-first).
    """

    conv: Float[Array, "B C Wm1"]
    ssm: Float[Array, "B Nv H Hv"]


class GDNMix(Protocol):
    """`mix(spec, inputs, state) -> (o [B, T, Nv, Hv], new_state)`."""

    def __call__(self, spec: GDNSpec, inputs: GDNInputs, state: Any) -> tuple[Array, Any]: ...


def zero_state(spec: GDNSpec, batch: int, dtype=jnp.float32) -> GDNState:
    """A fresh `GDNState` of `batch` rows (conv in `dtype`, ssm float32)."""
    return GDNState(
        conv=jnp.zeros((batch, spec.conv_dim, spec.conv_width - 1), dtype),
        ssm=jnp.zeros((batch, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim), jnp.float32))


def split_qkv(spec: GDNSpec, y: Float[Array, "B T C"]) -> tuple[
        Float[Array, "B T Nk H"], Float[Array, "B T Nk H"], Float[Array, "B T Nv Hv"]]:
    """Conv output channels `[q │ k │ v]` → q, k `[B, T, Nk, H]`, v `[B, T, Nv, Hv]`."""
    b, t, _ = y.shape
    kd = spec.num_k_heads * spec.head_k_dim
    q = y[..., :kd].reshape(b, t, spec.num_k_heads, spec.head_k_dim)
    k = y[..., kd:2 * kd].reshape(b, t, spec.num_k_heads, spec.head_k_dim)
    v = y[..., 2 * kd:].reshape(b, t, spec.num_v_heads, spec.head_v_dim)
    return q, k, v


def gdn_mix(spec: GDNSpec, inputs: GDNInputs,
            state: GDNState | None = None) -> tuple[Float[Array, "B T Nv Hv"], GDNState]:
    """Conv + delta rule of one GDN layer with the state carried explicitly.

    Args:
      spec: the layer's `GDNSpec`.
      inputs: the layer's `GDNInputs` for this call's `T` tokens.
      state: `GDNState` the rows continue from, or None for zeros (a fresh sequence).

    Returns:
      `(o [B, T, Nv, Hv] in x's dtype, GDNState after the T tokens)`. One-token calls run the
      recurrence, longer ones the chunked form (the same function of the inputs).
    """
    from attn.conv1d import causal_conv1d
    from attn.gdn import gdn_chunked, gdn_recurrent

    conv0 = None if state is None else state.conv
    ssm0 = None if state is None else state.ssm
    y, conv_state = causal_conv1d(inputs.x, inputs.conv_weight, initial_state=conv0,
                                  activation="silu")
    q, k, v = split_qkv(spec, y)
    if inputs.x.shape[1] == 1:
        o, ssm = gdn_recurrent(q, k, v, inputs.g, inputs.beta, scale=spec.scale,
                               initial_state=ssm0, use_qk_l2norm=True)
    else:
        o, ssm = gdn_chunked(q, k, v, inputs.g, inputs.beta, scale=spec.scale,
                             initial_state=ssm0, use_qk_l2norm=True, chunk_size=spec.chunk_size)
    return o, GDNState(conv_state, ssm)


def _ungroup(cfg: GDNConfig, qkvz: Float[Array, "B T E"], ba: Float[Array, "B T F"]):
    """Qwen3-Next's per-key-head row groups → flat `x [B, T, C]`, `z [B, T, Nv, Hv]`,
    `b, a [B, T, Nv]` (HF `fix_query_key_value_ordering`)."""
    bsz, t, _ = qkvz.shape
    nk, h, hv = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim
    r = cfg.num_v_heads // nk
    groups = qkvz.reshape(bsz, t, nk, 2 * h + 2 * r * hv)  # [B, T, Nk, q H | k H | v rHv | z rHv]
    q, k = groups[..., :h], groups[..., h:2 * h]
    v, z = groups[..., 2 * h:2 * h + r * hv], groups[..., 2 * h + r * hv:]
    x = jnp.concatenate([q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1)],
                        axis=-1)
    ba = ba.reshape(bsz, t, nk, 2 * r)  # [B, T, Nk, b r | a r]
    b = ba[..., :r].reshape(bsz, t, cfg.num_v_heads)
    a = ba[..., r:].reshape(bsz, t, cfg.num_v_heads)
    return x, z.reshape(bsz, t, cfg.num_v_heads, hv), b, a


class GatedDeltaNet(nnx.Module):
    """Gated DeltaNet mixer: `mixer(x, positions, *, attend, state) -> (y, state)`.

    Args:
      cfg: the layer config.
      layer: index of this layer in the model (becomes `spec.layer`).
      dtype: parameter and compute dtype (gates, l2 norms, the delta rule and its state run in
        float32).

    Parameters: the projections (see `GDNConfig.projection_layout`), `conv_weight [C, W]` (HF
    `conv1d.weight[:, 0]`), `A_log [Nv]`, `dt_bias [Nv]`, `norm` (gated RMSNorm over Hv),
    `out_proj`. Random init sets `A_log = 0`, `dt_bias = 1` (HF draws A_log at random).
    """

    def __init__(self, cfg: GDNConfig, *, layer: int, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.spec = GDNSpec(layer=layer, num_k_heads=cfg.num_k_heads, num_v_heads=cfg.num_v_heads,
                            head_k_dim=cfg.head_k_dim, head_v_dim=cfg.head_v_dim,
                            conv_width=cfg.conv_width, scale=float(cfg.head_k_dim ** -0.5),
                            chunk_size=cfg.chunk_size)
        d, nv = cfg.dim, cfg.num_v_heads
        if cfg.projection_layout == "grouped":
            self.in_proj_qkvz = Linear(d, cfg.conv_dim + cfg.value_dim, dtype=dtype, rngs=rngs)
            self.in_proj_ba = Linear(d, 2 * nv, dtype=dtype, rngs=rngs)
        else:
            self.in_proj_qkv = Linear(d, cfg.conv_dim, dtype=dtype, rngs=rngs)
            self.in_proj_z = Linear(d, cfg.value_dim, dtype=dtype, rngs=rngs)
            self.in_proj_b = Linear(d, nv, dtype=dtype, rngs=rngs)
            self.in_proj_a = Linear(d, nv, dtype=dtype, rngs=rngs)
        self.conv_weight = weight(rngs, (cfg.conv_dim, cfg.conv_width), dtype, std=0.2)
        self.A_log = weight(None, (nv,), dtype, init="zeros")
        self.dt_bias = weight(None, (nv,), dtype, init="ones")
        self.norm = GatedRMSNorm(cfg.head_v_dim, eps=cfg.norm_eps, dtype=dtype)
        self.out_proj = Linear(cfg.value_dim, d, dtype=dtype, rngs=rngs)

    def project(self, x: Float[Array, "B T D"]) -> GDNInputs:
        """Input projections, the Qwen3-Next ordering fix, and the gates."""
        from attn.gdn import gdn_gating

        cfg = self.cfg
        bsz, t, _ = x.shape
        if cfg.projection_layout == "grouped":
            mixed, z, b, a = _ungroup(cfg, self.in_proj_qkvz(x), self.in_proj_ba(x))
        else:
            mixed = self.in_proj_qkv(x)
            z = self.in_proj_z(x).reshape(bsz, t, cfg.num_v_heads, cfg.head_v_dim)
            b, a = self.in_proj_b(x), self.in_proj_a(x)
        g, beta = gdn_gating(a, b, self.A_log[...], self.dt_bias[...])
        return GDNInputs(x=mixed, z=z, g=g, beta=beta, conv_weight=self.conv_weight[...])

    def output(self, o: Float[Array, "B T Nv Hv"], inputs: GDNInputs) -> Float[Array, "B T D"]:
        """Gated RMSNorm per value head (gate `z`), merge heads, `out_proj`."""
        bsz, t = o.shape[:2]
        y = self.norm(o.astype(inputs.x.dtype), inputs.z)
        return self.out_proj(y.reshape(bsz, t, -1))

    def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"], *,
                 attend: Any, state: Any = None) -> tuple[Float[Array, "B T D"], Any]:
        """`output(mix(spec, project(x), state))`, `mix = attend.gdn_mix` if the attend has one,
        else `gdn_mix`; returns `(y, new_state)`.

        Raises:
          NotImplementedError: the attend packs several sequences in a row (`segment_ids`).
        """
        del positions  # GDN has no positional encoding
        if getattr(attend, "segment_ids", None) is not None:
            raise NotImplementedError(
                f"layer {self.spec.layer}: Gated DeltaNet layers do not support packed "
                f"sequences (segment_ids); run the sequences as separate rows")
        inputs = self.project(x)
        mix = getattr(attend, "gdn_mix", None) or gdn_mix
        o, state = mix(self.spec, inputs, state)
        return self.output(o, inputs), state
