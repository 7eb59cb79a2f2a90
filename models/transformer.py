"""Generic decoder-only causal LM: embed → N × (norm, mixer, residual, norm, MLP, residual) → norm
→ head. Families subclass `CausalLM` and override the `make_*` builders.

`CausalLM.forward(input_ids, positions, attend=..., states=...)` is the entry point the engine
uses (explicit positions, a pluggable attend, per-layer states threaded through); `__call__` is
the jitted full forward without a cache, compiled once per length bucket, with `DenseAttend` or
a caller's attend. `CausalLM.logits` applies the output head, so the engine
can compute it for the last positions only.

Families whose mixer is not an `Attention` (Gated DeltaNet) override `make_mixer` with a module
of the same call signature `mixer(x, positions, *, attend, state) -> (y, state)`.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models.config import ConfigBase, ConfigError, check_choice, check_positive
from models.layers.attention import Attend, Attention, AttentionConfig, DenseAttend
from models.layers.linear import Embed, GatedMLP, Linear, activation
from models.layers.norms import RMSNorm

LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(ConfigBase):
    """A dense decoder-only transformer (Llama, Qwen3).

    Attributes:
      vocab_size: V.
      dim: D (`hidden_size`).
      num_layers: number of decoder layers.
      intermediate_size: MLP hidden size I.
      attention: the attention layer config shared by all layers (window overridden per layer).
      layer_types: per layer `"full_attention"` or `"sliding_attention"` (empty = all full).
      sliding_window: window of the sliding layers.
      norm_eps: RMSNorm epsilon of the decoder norms.
      zero_centered_norms: `(1 + w)` decoder norms.
      act: MLP activation name.
      mlp_bias: biases in the MLP.
      tie_embeddings: output head = embedding transpose (no `lm_head`).
    """

    vocab_size: int
    dim: int
    num_layers: int
    intermediate_size: int
    attention: AttentionConfig
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    norm_eps: float = 1e-6
    zero_centered_norms: bool = False
    act: str = "silu"
    mlp_bias: bool = False
    tie_embeddings: bool = False

    def __post_init__(self):
        name = type(self).__name__
        check_positive(name, vocab_size=self.vocab_size, dim=self.dim,
                       num_layers=self.num_layers, intermediate_size=self.intermediate_size)
        if self.attention.dim != self.dim:
            raise ConfigError(f"{name}.attention.dim={self.attention.dim} must equal "
                              f"dim={self.dim}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ConfigError(f"{name}.layer_types has {len(self.layer_types)} entries; "
                              f"num_layers={self.num_layers}")
        for t in self.layer_types:
            check_choice(name, "layer_types[i]", t, LAYER_TYPES)
        if "sliding_attention" in self.layer_types:
            check_positive(name, sliding_window=self.sliding_window)
        if not self.norm_eps > 0:
            raise ConfigError(f"{name}.norm_eps={self.norm_eps} must be positive")
        try:
            activation(self.act)
        except ValueError as e:
            raise ConfigError(f"{name}.act: {e}") from None

    def attention_config(self, layer: int) -> AttentionConfig:
        """The attention config of `layer` (the sliding window applied on sliding layers)."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return dataclasses.replace(self.attention, window=self.sliding_window)
        return self.attention


class DecoderLayer(nnx.Module):
    """Pre-norm residual block: `x += mixer(norm1(x)); x += mlp(norm2(x))`."""

    def __init__(self, mixer: nnx.Module, mlp: nnx.Module, input_norm: nnx.Module,
                 post_norm: nnx.Module):
        self.input_norm = input_norm
        self.mixer = mixer
        self.post_norm = post_norm
        self.mlp = mlp

    def __call__(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"], *,
                 attend: Attend, state: Any = None) -> tuple[Float[Array, "B T D"], Any]:
        h, state = self.mixer(self.input_norm(x), positions, attend=attend, state=state)
        x = x + h
        return x + self.mlp(self.post_norm(x)), state


class CausalLM(nnx.Module):
    """Decoder-only causal LM. `logits = model(input_ids)`: `[B, T]` int → `[B, T, V]`.

    Args:
      cfg: the family config.
      dtype: parameter and compute dtype (norm statistics, RoPE and softmax run in float32).
      rngs: random init (tests, training from scratch); `from_pretrained` never materialises it.

    Subclasses override `make_mixer`, `make_mlp`, `make_norm`. Not done here: KV caching (the
    engine passes its own `attend` and `states` to `forward`), encoder-decoder, vision inputs.
    """

    family: ClassVar[str] = ""

    def __init__(self, cfg: DecoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.embed = Embed(cfg.vocab_size, cfg.dim, dtype=dtype, rngs=rngs)
        self.layers = nnx.List([
            DecoderLayer(self.make_mixer(i, rngs), self.make_mlp(i, rngs),
                         self.make_norm(cfg.dim), self.make_norm(cfg.dim))
            for i in range(cfg.num_layers)])
        self.norm = self.make_norm(cfg.dim)
        self.lm_head = (None if cfg.tie_embeddings
                        else Linear(cfg.dim, cfg.vocab_size, dtype=dtype, rngs=rngs))

    def make_mixer(self, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        """Token mixer of `layer` (softmax attention by default)."""
        return Attention(self.cfg.attention_config(layer), layer=layer, dtype=self.dtype,
                         rngs=rngs)

    def make_mlp(self, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        """Channel mixer of `layer` (gated MLP by default)."""
        cfg = self.cfg
        return GatedMLP(cfg.dim, cfg.intermediate_size, act=cfg.act, bias=cfg.mlp_bias,
                        dtype=self.dtype, rngs=rngs)

    def make_norm(self, dim: int) -> nnx.Module:
        """Decoder RMSNorm."""
        return RMSNorm(dim, eps=self.cfg.norm_eps, zero_centered=self.cfg.zero_centered_norms,
                       dtype=self.dtype)

    def forward(
        self, input_ids: Int[Array, "B T"], positions: Int[Array, "B T"], *, attend: Attend,
        states: Sequence[Any] | None = None,
    ) -> tuple[Float[Array, "B T D"], list[Any]]:
        """Hidden states after the final norm, and the new per-layer states.

        Args:
          input_ids: `[B, T]` token ids.
          positions: `[B, T]` absolute positions (RoPE; the attend's causal structure).
          attend: the attend function every attention layer calls.
          states: per-layer state passed to `attend` (None = no state anywhere).
        """
        x = self.embed(input_ids)
        states = list(states) if states is not None else [None] * len(self.layers)
        new_states = []
        for layer, state in zip(self.layers, states):
            x, state = layer(x, positions, attend=attend, state=state)
            new_states.append(state)
        return self.norm(x), new_states

    def logits(self, hidden: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """Output head (tied or not) on final hidden states; logits in the model dtype."""
        if self.lm_head is None:
            return self.embed.attend(hidden)
        return self.lm_head(hidden)

    def __call__(self, input_ids: Int[Array, "B T"], *, positions: Int[Array, "B T"] | None = None,
                 segment_ids: Int[Array, "B T"] | None = None, attend: Attend | None = None,
                 buckets: str | Sequence[int] | None = "pow2",
                 implementation: str = "auto") -> Float[Array, "B T V"]:
        """Full causal forward without a cache (jitted once per length bucket).

        `T` is right-padded to a bucket length before the jitted forward and the logits are
        sliced back to `T`, so a new length within a bucket reuses the compiled forward. Every
        mixer is causal (attention, conv, delta rule; MoE routes tokens independently), so
        padding after the last real token is invisible to real tokens: their logits are those
        of the unpadded forward.

        Args:
          input_ids: `[B, T]` integer token ids.
          positions: `[B, T]` positions; default `0..T-1` in every row.
          segment_ids: `[B, T]` packed-sequence ids (attention stays inside a segment); only
            with the default attend.
          attend: an `Attend` every attention layer calls instead of `DenseAttend` (it must be
            causal, and hashable: it is a static argument of the jitted forward, so an equal
            attend reuses the compiled forward). GDN and MLA layers use it only if it has a
            `gdn_mix` / `mla_attend` attribute.
          buckets: `"pow2"` pads `T` to the next power of two (at least `MIN_BUCKET`; up to 2x
            the tokens, so at most log2 compiles); a sequence of lengths pads to the smallest
            one `>= T` (finer buckets, less padding); None compiles per length, no padding.
          implementation: dense attention backend of the default attend.

        Returns:
          `[B, T, V]` logits in the model dtype.

        Raises:
          ValueError: `input_ids` not rank 2, positions / segment ids of another shape, `T`
            above every bucket, unknown `buckets`, `segment_ids` or `implementation` together
            with `attend`.
          TypeError: non-integer ids, positions or segment ids; an unhashable `attend`.
        """
        for name, x in (("input_ids", input_ids), ("positions", positions),
                        ("segment_ids", segment_ids)):
            if x is None:
                continue
            if jnp.ndim(x) != 2:
                raise ValueError(f"{name} must have shape [B, T]; got shape {jnp.shape(x)}")
            if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
                raise TypeError(f"{name}.dtype={jnp.asarray(x).dtype} must be an integer type")
            if jnp.shape(x) != jnp.shape(input_ids):
                raise ValueError(f"{name}.shape={jnp.shape(x)} must equal "
                                 f"input_ids.shape={jnp.shape(input_ids)}")
        if attend is not None:
            if segment_ids is not None or implementation != "auto":
                raise ValueError("segment_ids and implementation configure the default attend; "
                                 f"with attend={attend!r} put them into the attend itself")
            try:
                hash(attend)
            except TypeError:
                raise TypeError(f"attend={attend!r} must be hashable (a frozen dataclass or a "
                                f"function): it is a static argument of the jitted forward"
                                ) from None
        b, t = jnp.shape(input_ids)
        padded = bucket_length(t, buckets)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(padded, dtype=jnp.int32), (b, padded))
        else:
            positions = jnp.asarray(positions, jnp.int32)
            extra = jnp.arange(1, padded - t + 1, dtype=jnp.int32)[None, :]
            positions = jnp.concatenate([positions, positions[:, -1:] + extra], axis=1)
        pad = ((0, 0), (0, padded - t))
        input_ids = jnp.pad(jnp.asarray(input_ids, jnp.int32), pad)
        if segment_ids is not None:  # padding continues the last segment (never seen: causal)
            segment_ids = jnp.pad(jnp.asarray(segment_ids, jnp.int32), pad, mode="edge")
        logits = _full_forward(self, input_ids, positions, segment_ids, attend=attend,
                               implementation=implementation)
        return logits[:, :t]


MIN_BUCKET = 16  # smallest "pow2" bucket: short prompts share one compiled forward
TRACES = collections.Counter()  # "full_forward" -> times `_full_forward` was traced (compiled)


def bucket_length(t: int, buckets: str | Sequence[int] | None) -> int:
    """The padded length `model(ids)` runs a `T`-token input at.

    Args:
      t: input length `T >= 1`.
      buckets: `"pow2"`, an increasing sequence of lengths, or None (no padding).

    Returns:
      `T` itself (None), the next power of two `>= max(T, MIN_BUCKET)` ("pow2"), or the
      smallest bucket `>= T`.

    Raises:
      ValueError: `T < 1`, `T` above every bucket, or `buckets` neither `"pow2"`, None nor a
        sequence of positive ints.
    """
    if t < 1:
        raise ValueError(f"input length T={t} must be >= 1")
    if buckets is None:
        return t
    if isinstance(buckets, str):
        if buckets != "pow2":
            raise ValueError(f"buckets={buckets!r} must be 'pow2', None or a sequence of lengths")
        return max(MIN_BUCKET, 1 << (t - 1).bit_length())
    sizes = sorted(int(x) for x in buckets)
    if not sizes or sizes[0] < 1:
        raise ValueError(f"buckets={buckets!r} must be positive lengths")
    fit = [x for x in sizes if x >= t]
    if not fit:
        raise ValueError(f"input length T={t} exceeds the largest bucket {sizes[-1]} "
                         f"(buckets={list(buckets)}); add a bucket or pass buckets=None")
    return fit[0]


@nnx.jit(static_argnames=("attend", "implementation"))
def _full_forward(model: CausalLM, input_ids, positions, segment_ids, *, attend, implementation):
    TRACES["full_forward"] += 1  # runs at trace time only: counts compilations
    if attend is None:
        attend = DenseAttend(segment_ids=segment_ids, implementation=implementation)
    hidden, _ = model.forward(input_ids, positions, attend=attend)
    return model.logits(hidden)


def decoder_rules(cfg: DecoderConfig, *, prefix: str = "model.") -> list:
    """HF names → our parameters for the standard Llama-style layout (`model.layers.{i}...`)."""
    from models.convert.mapping import linear, param

    a = cfg.attention
    rules = [param("embed/embedding", f"{prefix}embed_tokens.weight"),
             param("norm/weight", f"{prefix}norm.weight")]
    if not cfg.tie_embeddings:
        rules += linear("lm_head", "lm_head")
    for i in range(cfg.num_layers):
        src, dst = f"{prefix}layers.{i}", f"layers/{i}"
        rules += [param(f"{dst}/input_norm/weight", f"{src}.input_layernorm.weight"),
                  param(f"{dst}/post_norm/weight", f"{src}.post_attention_layernorm.weight")]
        for proj in ("q_proj", "k_proj", "v_proj"):
            rules += linear(f"{dst}/mixer/{proj}", f"{src}.self_attn.{proj}", bias=a.qkv_bias)
        rules += linear(f"{dst}/mixer/o_proj", f"{src}.self_attn.o_proj", bias=a.o_bias)
        if a.qk_norm is not None:
            rules += [param(f"{dst}/mixer/q_norm/weight", f"{src}.self_attn.q_norm.weight"),
                      param(f"{dst}/mixer/k_norm/weight", f"{src}.self_attn.k_norm.weight")]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            rules += linear(f"{dst}/mlp/{proj}", f"{src}.mlp.{proj}", bias=cfg.mlp_bias)
    return rules


def layer_types_from_hf(hf, num_layers: int, *, use_sliding_default: bool = False,
                        max_window_layers_default: int = 28
                        ) -> tuple[tuple[str, ...], int | None]:
    """`(layer_types, sliding_window)` from HF's `layer_types` / `use_sliding_window` fields.

    Mirrors Qwen3's config: the window exists only if `use_sliding_window`; without explicit
    `layer_types`, layers `>= max_window_layers` slide.
    """
    window = hf.get("sliding_window") if hf.get("use_sliding_window", use_sliding_default) \
        else None
    if window is None:
        return (), None
    types = hf.get("layer_types")
    if types is None:
        mwl = hf.get("max_window_layers", max_window_layers_default)
        types = ["sliding_attention" if i >= mwl else "full_attention" for i in range(num_layers)]
    types = tuple(types)
    if "sliding_attention" not in types:
        return (), None
    return types, int(window)
