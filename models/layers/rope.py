"""Rotary position embeddings: the rope types of HF `modeling_rope_utils`, two layouts, partial.

Frequencies (`inv_freq`, `[R // 2]`) and the cos/sin factor ("attention factor") follow
transformers' `_compute_*_parameters` for `rope_type` in

* `default`   `inv_freq[j] = theta ** (-2j / R)`;
* `linear`    default divided by `factor`;
* `dynamic`   NTK-aware: theta grows with the sequence once it exceeds `max_position_embeddings`;
* `yarn`      NTK-by-parts ramp between interpolated and extrapolated frequencies, with the
              attention factor `0.1 ln(factor) + 1` (or the mscale ratio) multiplying cos and sin;
* `llama3`    Llama-3.1 wavelength-banded scaling;
* `longrope`  per-frequency short / long factors (Phi-3).

`dynamic` and `longrope` depend on the sequence length; here it is `max(positions) + 1` of the
call (what HF computes for a fresh full forward; HF's cache of the largest length seen so far is
not reproduced). All other types are static and become compile-time constants.

Layouts: `"neox"` rotates the two halves of the rotary dims (`rotate_half`, Llama / Qwen);
`"interleaved"` rotates adjacent pairs `(x[2i], x[2i+1])` (GPT-J, DeepSeek-V2's complex form).
Partial rotary (`rotary_dim < head_dim`) rotates the first `rotary_dim` features and passes the
rest through (Qwen3-Next / Qwen3.5).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from models.config import ConfigBase, ConfigError, HFConfig, check_choice, check_positive

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
LAYOUTS = ("neox", "interleaved")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeConfig(ConfigBase):
    """One rotary embedding. Hashable: it is static model structure.

    Attributes:
      rotary_dim: R, number of rotated features per head (even; `int(H * partial_rotary_factor)`).
      theta: base wavelength.
      rope_type: one of `ROPE_TYPES`.
      layout: `"neox"` (rotate halves) or `"interleaved"` (rotate adjacent pairs).
      factor: scaling factor (linear, dynamic, yarn, llama3, longrope).
      max_position_embeddings: the model's context length (dynamic; yarn / longrope default factor).
      original_max_position_embeddings: pre-training length (yarn, llama3, longrope).
      beta_fast, beta_slow, mscale, mscale_all_dim, truncate: YaRN knobs, as in HF.
      attention_factor: explicit cos/sin factor (yarn, longrope); None = the paper's default.
      low_freq_factor, high_freq_factor: llama3 band edges.
      short_factor, long_factor: longrope per-frequency factors, `R // 2` each.
    """

    rotary_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    layout: str = "neox"
    factor: float = 1.0
    max_position_embeddings: int | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    attention_factor: float | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self):
        name = type(self).__name__
        check_positive(name, rotary_dim=self.rotary_dim)
        if self.rotary_dim % 2:
            raise ConfigError(f"{name}.rotary_dim={self.rotary_dim} must be even")
        check_choice(name, "rope_type", self.rope_type, ROPE_TYPES)
        check_choice(name, "layout", self.layout, LAYOUTS)
        if not self.theta > 0:
            raise ConfigError(f"{name}.theta={self.theta} must be positive")
        if self.rope_type != "default" and not self.factor > 0:
            raise ConfigError(f"{name}.factor={self.factor} must be positive")
        needs = {
            "dynamic": ("max_position_embeddings",),
            "yarn": ("original_max_position_embeddings",),
            "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
            "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
        }.get(self.rope_type, ())
        for field in needs:
            if getattr(self, field) is None:
                raise ConfigError(f"{name}.{field} is required for rope_type={self.rope_type!r}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"{name}.high_freq_factor={self.high_freq_factor} must exceed "
                              f"low_freq_factor={self.low_freq_factor}")
        for field in ("short_factor", "long_factor"):
            f = getattr(self, field)
            if f is not None and len(f) != self.rotary_dim // 2:
                raise ConfigError(f"{name}.{field} has {len(f)} entries; rotary_dim // 2 = "
                                  f"{self.rotary_dim // 2} expected")


def rope_from_hf(
    cfg: HFConfig, *, head_dim: int, layout: str = "neox", rope_dim: int | None = None
) -> RopeConfig:
    """Parse HF rope settings (v5 `rope_parameters` or legacy `rope_theta` + `rope_scaling`).

    Args:
      cfg: the HF config.
      head_dim: H; the rotary dim is `int(H * partial_rotary_factor)` unless `rope_dim` is given.
      layout: `"neox"` or `"interleaved"`.
      rope_dim: explicit rotary dim (DeepSeek's `qk_rope_head_dim`).

    Raises:
      ConfigError: an unknown `rope_type` or a missing field it needs.
    """
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "su":  # legacy longrope name
        rope_type = "longrope"
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{cfg.source}: rope_type={rope_type!r} is not supported; "
                          f"supported: {ROPE_TYPES}")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary_dim = rope_dim if rope_dim is not None else int(head_dim * partial)
    max_pos = cfg.get("max_position_embeddings")
    orig = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn", "longrope"):
        # HF gives a top-level original_max_position_embeddings priority (Phi-3), else max_pos.
        orig = cfg.get("original_max_position_embeddings", orig if orig is not None else max_pos)
    factor = params.get("factor")
    if factor is None and rope_type in ("yarn", "longrope") and max_pos and orig:
        factor = max_pos / orig
    tup = lambda x: None if x is None else tuple(float(v) for v in x)
    opt = lambda k: None if params.get(k) is None else float(params[k])
    return RopeConfig(
        rotary_dim=rotary_dim, theta=float(theta), rope_type=rope_type, layout=layout,
        factor=float(1.0 if factor is None else factor),
        max_position_embeddings=max_pos, original_max_position_embeddings=orig,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)), attention_factor=opt("attention_factor"),
        low_freq_factor=opt("low_freq_factor"), high_freq_factor=opt("high_freq_factor"),
        short_factor=tup(params.get("short_factor")), long_factor=tup(params.get("long_factor")),
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction `0.1 * mscale * ln(scale) + 1` (1 for `scale <= 1`)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _base_inv_freq(theta, dim: int) -> np.ndarray:
    # float32 throughout, as HF computes it (keeps f32 parity at long positions tight).
    return np.float32(1.0) / (np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))


@functools.lru_cache(maxsize=64)
def static_inv_freq(cfg: RopeConfig) -> tuple[np.ndarray, float]:
    """`(inv_freq [R // 2] float32, attention_factor)` for the length-independent rope types."""
    dim = cfg.rotary_dim
    inv = _base_inv_freq(cfg.theta, dim)
    af = 1.0
    if cfg.rope_type == "linear":
        inv = inv / cfg.factor
    elif cfg.rope_type == "yarn":
        f = cfg.factor
        if cfg.attention_factor is not None:
            af = cfg.attention_factor
        elif cfg.mscale and cfg.mscale_all_dim:
            af = yarn_mscale(f, cfg.mscale) / yarn_mscale(f, cfg.mscale_all_dim)
        else:
            af = yarn_mscale(f)
        orig = cfg.original_max_position_embeddings
        corr = lambda rot: dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(cfg.theta))
        low, high = corr(cfg.beta_fast), corr(cfg.beta_slow)
        if cfg.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrap = 1.0 - ramp
        inv = inv / f * (1 - extrap) + inv * extrap
    elif cfg.rope_type == "llama3":
        f, orig = cfg.factor, cfg.original_max_position_embeddings
        low_wl = orig / cfg.low_freq_factor
        high_wl = orig / cfg.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wl, inv / f, inv)
        smooth = (orig / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor
                                                          - cfg.low_freq_factor)
        smoothed = (1 - smooth) * scaled / f + smooth * scaled
        medium = (wavelen >= high_wl) & (wavelen <= low_wl)
        inv = np.where(medium, smoothed, scaled)
    elif cfg.rope_type != "default":
        raise ValueError(f"rope_type={cfg.rope_type!r} depends on the sequence length")
    return inv.astype(np.float32), float(af)


def inv_freq(cfg: RopeConfig, seq_len) -> tuple[Float[Array, " R2"], float]:
    """`(inv_freq [R // 2] float32, attention_factor)`; `seq_len` only matters for dynamic types.

    Args:
      cfg: the rope config.
      seq_len: traced or static int, `max(positions) + 1` of the call.
    """
    dim = cfg.rotary_dim
    if cfg.rope_type == "dynamic":
        max_pos = cfg.max_position_embeddings
        n = jnp.maximum(jnp.asarray(seq_len, jnp.float32), float(max_pos))
        theta = cfg.theta * (cfg.factor * n / max_pos - (cfg.factor - 1)) ** (dim / (dim - 2))
        exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
        return 1.0 / theta ** exponent, 1.0
    if cfg.rope_type == "longrope":
        orig = cfg.original_max_position_embeddings
        af = cfg.attention_factor
        if af is None:
            af = 1.0 if cfg.factor <= 1 else math.sqrt(1 + math.log(cfg.factor) / math.log(orig))
        base = _base_inv_freq(cfg.theta, dim).astype(np.float32)
        short = base / np.asarray(cfg.short_factor, np.float32)
        long = base / np.asarray(cfg.long_factor, np.float32)
        return jnp.where(jnp.asarray(seq_len) > orig, long, short), float(af)
    inv, af = static_inv_freq(cfg)
    return jnp.asarray(inv), af


def cos_sin(
    cfg: RopeConfig, positions: Int[Array, "B T"]
) -> tuple[Float[Array, "B T R2"], Float[Array, "B T R2"]]:
    """float32 `(cos, sin)` of `positions * inv_freq`, times the attention factor."""
    seq_len = None
    if cfg.rope_type in ("dynamic", "longrope"):
        seq_len = jnp.max(positions) + 1
    inv, af = inv_freq(cfg, seq_len)
    angles = positions.astype(jnp.float32)[..., None] * inv  # [B, T, R/2]
    return jnp.cos(angles) * af, jnp.sin(angles) * af


def apply_rope(
    x: Float[Array, "B T n H"],
    cos: Float[Array, "B T R2"],
    sin: Float[Array, "B T R2"],
    *,
    layout: str = "neox",
) -> Float[Array, "B T n H"]:
    """Rotate the first `R = 2 * cos.shape[-1]` features of every head; the rest pass through.

    Args:
      x: `[B, T, n, H]` queries or keys (any head count n).
      cos, sin: `[B, T, R // 2]` from `cos_sin` (float32).
      layout: `"neox"` pairs feature i with i + R/2; `"interleaved"` pairs 2i with 2i + 1.

    Returns:
      `[B, T, n, H]` in x's dtype (the rotation is computed in float32).
    """
    half = cos.shape[-1]
    rot, rest = x[..., : 2 * half].astype(jnp.float32), x[..., 2 * half:]
    c, s = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, R/2]
    if layout == "neox":
        x1, x2 = rot[..., :half], rot[..., half:]
        out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    elif layout == "interleaved":
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(rot.shape)
    else:
        raise ValueError(f"{layout=} must be one of {LAYOUTS}")
    return jnp.concatenate([out.astype(x.dtype), rest], axis=-1)


def rotate(cfg: RopeConfig, x: Float[Array, "B T n H"],
           positions: Int[Array, "B T"]) -> Float[Array, "B T n H"]:
    """`apply_rope` with `cfg`'s frequencies at `positions`."""
    c, s = cos_sin(cfg, positions)
    return apply_rope(x, c, s, layout=cfg.layout)
