"""Multi-head latent attention layer (DeepSeek-V2 / V3), split into `project` → `attend` → `output`.

Design. Same three steps as `models/layers/attention.py`, with the latent KV made explicit:

    proj      = layer.project(x, positions)      # q_nope, q_pe, c_kv, k_pe, w_uk, w_uv
    o, state  = attend(layer.spec, proj, state)  # attention over the latent KV: [B, T, N, Hv]
    y         = layer.output(o, proj)            # o_proj

`project` produces exactly what a latent cache stores and what its queries need: the RMS-normed
compressed KV `c_kv [B, T, L]` and the rotated rope key `k_pe [B, T, R]` (one head shared by all
query heads: the `[c_kv ‖ k_pe]` row of the paged latent pool), the no-rope query
`q_nope [B, T, N, Dn]` and the rotated rope query `q_pe [B, T, N, R]`, plus the per-head
up-projections `w_uk [N, Dn, L]`, `w_uv [N, Hv, L]` (views of `kv_b_proj`), so the attend stays a
plain function of its arguments (like GDN's conv taps). The attend is chosen by the caller
through the attend object the decoder hands to every layer: if it has an `mla_attend` attribute
(an engine's latent-cache version: write `[c_kv ‖ k_pe]` by slot mapping, then
`attn.mla.mla_absorbed_attention` for prefill chunks, or `absorb_query` → `mla_paged_decode` →
`expand_output` for decode), MLA layers call `attend.mla_attend(spec, proj, state)`; otherwise
`mla_dense_attend`: materialised causal MLA over this call's tokens
(`attn.mla.mla_naive_attention`), the full forward, no cache.

Math (HF `DeepseekV3Attention` / `DeepseekV2Attention`, transformers 5.x):
  q        = q_b_proj(RMSNorm_1e-6(q_a_proj(x)))  or  q_proj(x) when q_lora_rank is None
  q        → [N, Dn + R] per head: [q_nope │ q_pe]
  [c │ kr] = kv_a_proj_with_mqa(x);  c_kv = RMSNorm_1e-6(c)  (kv_a_layernorm)
  q_pe, k_pe = RoPE(q_pe), RoPE(kr)   (k_pe one head)
  k[n]     = [w_uk[n] c_kv ‖ k_pe],  v[n] = w_uv[n] c_kv   (kv_b_proj rows per head [Dn │ Hv])
  o        = o_proj(softmax(q·k · scale) v),  scale = (Dn + R)^-½ · mscale(factor, mscale_all_dim)²
             when the rope type is not "default" and `mscale_all_dim` is set (`yarn_apply_mscale`).
RoPE pairing: DeepSeek-V2 rotates adjacent pairs (complex multiply, output stays interleaved:
layout "interleaved"); V3 with `rope_interleave` takes the even features then the odd ones and
rotates halves (`apply_rotary_pos_emb_interleave`: output de-interleaved), reproduced here as a
permutation followed by the "neox" layout (`deinterleave=True`), so `q_pe` / `k_pe` (and a latent
cache) have HF's feature order; V3 without `rope_interleave` is plain "neox". The full forward's
attend ignores the dense attend's `implementation` (the MLA ops choose their own backend).

Not done here: packed sequences (segment ids) in the full forward, sliding windows, KV caching
itself (the engine's attend owns it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models.config import ConfigBase, ConfigError, check_positive
from models.layers.linear import Linear
from models.layers.norms import RMSNorm
from models.layers.rope import RopeConfig, rotate, yarn_mscale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps


def mla_softmax_scale(qk_head_dim: int, rope: RopeConfig) -> float:
    """HF's MLA scale: `qk_head_dim ** -0.5`, times `mscale(factor, mscale_all_dim) ** 2` when
    the rope type is not "default" and `mscale_all_dim` is set (`yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return float(scale)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig(ConfigBase):
    """One MLA layer.

    Attributes:
      dim: D, model width.
      num_heads: N.
      q_lora_rank: rank of the query LoRA (`q_a_proj` → norm → `q_b_proj`); None = one
        `q_proj` (DeepSeek-V2-Lite).
      kv_lora_rank: L, latent (compressed KV) width.
      qk_nope_head_dim: Dn, no-rope part of each query / key head.
      qk_rope_head_dim: R, rope part (one shared key head).
      v_head_dim: Hv.
      rope: the rotary embedding of the R rope features (`rotary_dim == R`).
      deinterleave: take features `[0, 2, 4, ..., 1, 3, 5, ...]` before a "neox" rotation
        (DeepSeek-V3 `rope_interleave`).
      bias: biases on `q_a_proj`, `kv_a_proj`, `o_proj` (`attention_bias`).
    """

    dim: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    deinterleave: bool = False
    bias: bool = False

    def __post_init__(self):
        name = type(self).__name__
        check_positive(name, dim=self.dim, num_heads=self.num_heads,
                       kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                       qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        if self.q_lora_rank is not None:
            check_positive(name, q_lora_rank=self.q_lora_rank)
        if self.rope.rotary_dim != self.qk_rope_head_dim:
            raise ConfigError(f"{name}.rope.rotary_dim={self.rope.rotary_dim} must equal "
                              f"qk_rope_head_dim={self.qk_rope_head_dim}")
        if self.deinterleave and self.rope.layout != "neox":
            raise ConfigError(f"{name}.deinterleave=True needs rope.layout='neox'; got "
                              f"{self.rope.layout!r}")

    @property
    def qk_head_dim(self) -> int:
        """Dn + R."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        """Softmax scale (`mla_softmax_scale`)."""
        return mla_softmax_scale(self.qk_head_dim, self.rope)


@dataclasses.dataclass(frozen=True)
class MLASpec:
    """Static per-layer facts an MLA attend needs (hashable).

    Attributes:
      layer: layer index in the model (keys per-layer latent pools).
      scale: softmax scale over the `Dn + R` query·key dims (also the absorbed `L + R` ones).
      num_heads: N.
      kv_lora_rank: L (latent pool rows are `L + R` wide).
      rope_dim: R.
      qk_nope_head_dim: Dn.
      v_head_dim: Hv.
    """

    layer: int
    scale: float
    num_heads: int
    kv_lora_rank: int
    rope_dim: int
    qk_nope_head_dim: int
    v_head_dim: int


class MLAProjection(NamedTuple):
    """Output of `MLAttention.project` (a pytree).

    Attributes:
      q_nope: `[B, T, N, Dn]` no-rope query.
      q_pe: `[B, T, N, R]` rotated rope query.
      c_kv: `[B, T, L]` RMS-normed compressed KV (cached).
      k_pe: `[B, T, R]` rotated rope key, one head shared by all query heads (cached).
      w_uk: `[N, Dn, L]` key up-projection (`k_nope[n] = w_uk[n] c_kv`).
      w_uv: `[N, Hv, L]` value up-projection (`v[n] = w_uv[n] c_kv`).
    """

    q_nope: Float[Array, "B T N Dn"]
    q_pe: Float[Array, "B T N R"]
    c_kv: Float[Array, "B T L"]
    k_pe: Float[Array, "B T R"]
    w_uk: Float[Array, "N Dn L"]
    w_uv: Float[Array, "N Hv L"]


class MLAAttend(Protocol):
    """`mla_attend(spec, proj, state) -> (o [B, T, N, Hv], new_state)`."""

    def __call__(self, spec: MLASpec, proj: MLAProjection, state: Any) -> tuple[Array, Any]: ...


def mla_dense_attend(spec: MLASpec, proj: MLAProjection,
                     state: Any = None) -> tuple[Float[Array, "B T N Hv"], Any]:
    """Full-forward MLA: causal, materialised (`attn.mla.mla_naive_attention`), no cache."""
    from attn.mla import mla_naive_attention

    o, _ = mla_naive_attention(proj.q_nope, proj.q_pe, proj.c_kv, proj.k_pe, proj.w_uk,
                               proj.w_uv, scale=spec.scale, causal=True)
    return o, state


def _deinterleave(x: Float[Array, "... R"]) -> Float[Array, "... R"]:
    """`[x0, x2, x4, ..., x1, x3, x5, ...]` (HF V3 `rope_interleave` reads pairs this way)."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class MLAttention(nnx.Module):
    """DeepSeek multi-head latent attention: `mixer(x, positions, *, attend, state)`.

    Parameters (HF name → ours): `q_proj` or `q_a_proj` / `q_a_layernorm` (`q_a_norm`) /
    `q_b_proj`; `kv_a_proj_with_mqa` (`kv_a_proj`); `kv_a_layernorm` (`kv_a_norm`); `kv_b_proj`;
    `o_proj`. Kernels are `[in, out]`.

    Args:
      cfg: the layer config.
      layer: index of this layer in the model (becomes `spec.layer`).
      dtype: parameter and compute dtype.
    """

    def __init__(self, cfg: MLAConfig, *, layer: int, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.spec = MLASpec(layer=layer, scale=cfg.scale, num_heads=cfg.num_heads,
                            kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim,
                            qk_nope_head_dim=cfg.qk_nope_head_dim, v_head_dim=cfg.v_head_dim)
        d, n = cfg.dim, cfg.num_heads
        q_out = n * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(d, q_out, dtype=dtype, rngs=rngs)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(d, cfg.q_lora_rank, bias=cfg.bias, dtype=dtype, rngs=rngs)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, dtype=dtype, rngs=rngs)
        self.kv_a_proj = Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.bias,
                                dtype=dtype, rngs=rngs)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, eps=LATENT_NORM_EPS, dtype=dtype)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                dtype=dtype, rngs=rngs)
        self.o_proj = Linear(n * cfg.v_head_dim, d, bias=cfg.bias, dtype=dtype, rngs=rngs)

    def up_projections(self) -> tuple[Float[Array, "N Dn L"], Float[Array, "N Hv L"]]:
        """`(w_uk [N, Dn, L], w_uv [N, Hv, L])` from `kv_b_proj` (`attn.mla.split_kv_b`)."""
        from attn.mla import split_kv_b

        cfg = self.cfg
        return split_kv_b(jnp.transpose(self.kv_b_proj.kernel[...]), cfg.num_heads,
                          cfg.qk_nope_head_dim, cfg.v_head_dim)

    def _rotate(self, x: Float[Array, "B T n R"], positions: Int[Array, "B T"]):
        if self.cfg.deinterleave:
            x = _deinterleave(x)
        return rotate(self.cfg.rope, x, positions)

    def project(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"]) -> MLAProjection:
        """Query (LoRA or direct), latent KV (normed), RoPE on q_pe / k_pe at `positions`."""
        cfg = self.cfg
        b, t, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q = q.reshape(b, t, cfg.num_heads, cfg.qk_head_dim)  # per head [q_nope Dn │ q_pe R]
        q_nope, q_pe = q[..., :cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        kv = self.kv_a_proj(x)  # [B, T, L + R]: [c_kv │ k_pe]
        c_kv = self.kv_a_norm(kv[..., :cfg.kv_lora_rank])
        k_pe = kv[..., cfg.kv_lora_rank:]
        q_pe = self._rotate(q_pe, positions)
        k_pe = self._rotate(k_pe[:, :, None, :], positions)[:, :, 0, :]
        w_uk, w_uv = self.up_projections()
        return MLAProjection(q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe, w_uk=w_uk,
                             w_uv=w_uv)

    def output(self, o: Float[Array, "B T N Hv"], proj: MLAProjection) -> Float[Array, "B T D"]:
        """Merge heads and apply `o_proj`."""
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b, t, -1).astype(proj.q_nope.dtype))

    def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"], *,
                 attend: Any, state: Any = None) -> tuple[Float[Array, "B T D"], Any]:
        """`output(mla_attend(spec, project(x, positions), state))`; `mla_attend` is
        `attend.mla_attend` if the attend has one, else `mla_dense_attend`.

        Raises:
          NotImplementedError: the attend packs several sequences in a row (`segment_ids`).
        """
        mla_attend = getattr(attend, "mla_attend", None)
        if mla_attend is None:
            if getattr(attend, "segment_ids", None) is not None:
                raise NotImplementedError(
                    f"layer {self.spec.layer}: MLA layers do not support packed sequences "
                    f"(segment_ids) in the full forward; run the sequences as separate rows")
            mla_attend = mla_dense_attend
        proj = self.project(x, positions)
        o, state = mla_attend(self.spec, proj, state)
        return self.output(o, proj), state
