"""Qwen3-Next hybrid family: Gated DeltaNet layers + gated full attention, MoE with a shared expert.

HF: `Qwen3NextForCausalLM` (`model_type` "qwen3_next"). Layer i is `"linear_attention"` (a
`GatedDeltaNet`, `linear_attn.*`) or `"full_attention"` (`GatedAttention`, `self_attn.*`), from
`layer_types` or, absent, every `full_attention_interval`-th (4) layer full. Differences from
Qwen3 that the parity tests pin down:

* every decoder norm and the attention q/k norms are zero-centred `(1 + w)` RMSNorms; the GDN
  output norm is a plain-weight gated RMSNorm;
* `q_proj` has width `2·N·H` (per head `[query │ gate]`); the attention output is multiplied by
  `sigmoid(gate)` before `o_proj`;
* partial RoPE: the first `int(H · partial_rotary_factor)` (default 0.25) features, rotate-half;
* `in_proj_qkvz` / `in_proj_ba` are grouped per key head (`models/layers/gdn.py`);
* MoE layer iff `i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step
  == 0`: softmax top-k router (renormalised iff `norm_topk_prob`), SwiGLU experts, and a shared
  SwiGLU expert scaled by `sigmoid(x · shared_expert_gate)`; other layers use a dense SwiGLU.

The config, model and name map here also serve Qwen3.5 (`qwen3_5.py`), which differs only in the
GDN projections, MoE placement and checkpoint prefix. Checkpoint experts come either per expert
(`mlp.experts.{e}.gate_proj.weight`, what `save_pretrained` writes) or fused as HF keeps them in
memory (`mlp.experts.gate_up_proj [E, 2I, D]`, `down_proj [E, D, I]`, as Hub Qwen3.5-MoE files);
the loader looks at the tensor names to tell. `mtp.*` (multi-token prediction) is ignored.

Not done: packed sequences (segment ids) through GDN layers, the HF padding mask, MTP heads.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from models.config import ConfigBase, ConfigError, HFConfig, check_choice, check_positive
from models.convert.mapping import Rule, linear, param, stacked_experts
from models.convert.registry import Family, register
from models.layers.attention import QKV, Attention, AttentionConfig
from models.layers.gdn import GatedDeltaNet, GDNConfig
from models.layers.linear import GatedMLP, Linear, activation, weight
from models.layers.moe import MoE, SoftmaxTopKRouter, SwiGLUExperts, moe_sorted
from models.layers.norms import RMSNorm
from models.layers.rope import rope_from_hf
from models.transformer import CausalLM

LAYER_TYPES = ("linear_attention", "full_attention")
MLP_TYPES = ("dense", "moe")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(ConfigBase):
    """The sparse MLP of the MoE layers.

    Attributes:
      num_experts: E.
      top_k: experts per token.
      intermediate_size: I of each routed expert (`moe_intermediate_size`).
      shared_intermediate_size: I of the shared expert (`shared_expert_intermediate_size`).
      normalize: renormalise the top-k probabilities (`norm_topk_prob`; always on in Qwen3.5).
      fused_experts: experts as one `gate_up_proj [E, D, 2I]` parameter (checkpoints with HF's
        fused 3-D tensors) instead of `gate_proj`, `up_proj [E, D, I]`.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    normalize: bool = True
    fused_experts: bool = False

    def __post_init__(self):
        name = type(self).__name__
        check_positive(name, num_experts=self.num_experts, top_k=self.top_k,
                       intermediate_size=self.intermediate_size,
                       shared_intermediate_size=self.shared_intermediate_size)
        if self.top_k > self.num_experts:
            raise ConfigError(f"{name}.top_k={self.top_k} exceeds num_experts="
                              f"{self.num_experts}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3NextConfig(ConfigBase):
    """A Qwen3-Next / Qwen3.5 hybrid decoder.

    Attributes:
      vocab_size: V.
      dim: D (`hidden_size`).
      num_layers: decoder layers.
      layer_types: per layer `"linear_attention"` (GDN) or `"full_attention"`.
      mlp_types: per layer `"dense"` or `"moe"`.
      attention: the gated full-attention layers (zero-centred q/k norms, partial RoPE).
      gdn: the Gated DeltaNet layers.
      intermediate_size: I of the dense MLP layers (None if there are none).
      moe: the MoE layers (None if there are none).
      norm_eps: epsilon of the decoder norms (zero-centred).
      act: MLP activation (and the GDN conv's, which must be SiLU).
      tie_embeddings: output head = embedding transpose.
      checkpoint_prefix: HF name prefix of the decoder (`"model."`, or `"model.language_model."`
        for Qwen3.5 vision-language checkpoints).
    """

    vocab_size: int
    dim: int
    num_layers: int
    layer_types: tuple[str, ...]
    mlp_types: tuple[str, ...]
    attention: AttentionConfig
    gdn: GDNConfig
    intermediate_size: int | None = None
    moe: MoEConfig | None = None
    norm_eps: float = 1e-6
    act: str = "silu"
    tie_embeddings: bool = False
    checkpoint_prefix: str = "model."

    def __post_init__(self):
        name = type(self).__name__
        check_positive(name, vocab_size=self.vocab_size, dim=self.dim, num_layers=self.num_layers)
        for field, kinds in (("layer_types", LAYER_TYPES), ("mlp_types", MLP_TYPES)):
            values = getattr(self, field)
            if len(values) != self.num_layers:
                raise ConfigError(f"{name}.{field} has {len(values)} entries; "
                                  f"num_layers={self.num_layers}")
            for v in values:
                check_choice(name, f"{field}[i]", v, kinds)
        for sub in ("attention", "gdn"):
            if getattr(self, sub).dim != self.dim:
                raise ConfigError(f"{name}.{sub}.dim={getattr(self, sub).dim} must equal "
                                  f"dim={self.dim}")
        if self.attention.hv != self.attention.head_dim:
            raise ConfigError(f"{name}.attention.v_head_dim={self.attention.v_head_dim} must "
                              f"equal head_dim={self.attention.head_dim} (the output gate)")
        if "dense" in self.mlp_types:
            check_positive(name, intermediate_size=self.intermediate_size)
        if "moe" in self.mlp_types and self.moe is None:
            raise ConfigError(f"{name}.moe is required: mlp_types has MoE layers")
        if not self.norm_eps > 0:
            raise ConfigError(f"{name}.norm_eps={self.norm_eps} must be positive")
        if self.act != "silu" and "linear_attention" in self.layer_types:
            raise ConfigError(f"{name}.act={self.act!r}: the GDN conv supports only 'silu'")
        try:
            activation(self.act)
        except ValueError as e:
            raise ConfigError(f"{name}.act: {e}") from None


class GatedAttention(Attention):
    """Softmax attention with a per-head sigmoid output gate (Qwen3-Next / Qwen3.5).

    `q_proj` has width `2·N·H`: viewed `[B, T, N, 2H]`, the first H features of a head are its
    query and the last H its gate. `output` multiplies the merged heads by `sigmoid(gate)` before
    `o_proj`. Norms, RoPE and the attend are `Attention`'s.
    """

    def __init__(self, cfg: AttentionConfig, *, layer: int, dtype=jnp.float32,
                 rngs: nnx.Rngs):
        super().__init__(cfg, layer=layer, dtype=dtype, rngs=rngs)
        self.q_proj = Linear(cfg.dim, 2 * cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias,
                             dtype=dtype, rngs=rngs)

    def project(self, x: Float[Array, "B T D"], positions: Int[Array, "B T"]) -> QKV:
        """Query and gate, k, v; zero-centred q/k norms; partial RoPE at `positions`."""
        from models.layers.rope import rotate

        cfg = self.cfg
        b, t, _ = x.shape
        h = cfg.head_dim
        qg = self.q_proj(x).reshape(b, t, cfg.num_heads, 2 * h)  # per head [query H | gate H]
        q, gate = qg[..., :h], qg[..., h:]
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, h)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.hv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.rope is not None:
            q, k = rotate(cfg.rope, q, positions), rotate(cfg.rope, k, positions)
        return QKV(q, k, v, gate.reshape(b, t, cfg.num_heads * h))

    def output(self, o: Float[Array, "B T N Hv"], qkv: QKV) -> Float[Array, "B T D"]:
        """`o_proj(merge(o) · sigmoid(gate))`."""
        b, t = o.shape[:2]
        o = o.reshape(b, t, -1).astype(qkv.q.dtype)
        return self.o_proj(o * jax.nn.sigmoid(qkv.gate))


class FusedSwiGLUExperts(nnx.Module):
    """E SwiGLU experts kept as HF's fused tensors: `gate_up_proj [E, D, 2I]` (the I gate columns
    first, then up), `down_proj [E, I, D]`. Dispatch is `moe_sorted`'s on the two column halves,
    which XLA may copy out per call (a `moe_sorted` taking the fused matrix would avoid that).

    Args:
      dim: D.
      hidden: I.
      num_experts: E.
      act: activation name.
      dispatch: default dispatch (see `models.layers.moe.moe_sorted`).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, *, act: str = "silu",
                 dispatch: str = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        activation(act)
        self.act = act
        self.dispatch = dispatch
        self.hidden = hidden
        self.gate_up_proj = weight(rngs, (num_experts, dim, 2 * hidden), dtype)
        self.down_proj = weight(rngs, (num_experts, hidden, dim), dtype)

    def __call__(self, x: Float[Array, "M D"], ids: Int[Array, "M k"],
                 weights: Float[Array, "M k"], *, dispatch: str | None = None
                 ) -> Float[Array, "M D"]:
        gate_up = self.gate_up_proj[...]
        i = self.hidden
        return moe_sorted(x, ids, weights, gate_up[..., :i], gate_up[..., i:],
                          self.down_proj[...], self.act, dispatch=dispatch or self.dispatch)


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3-Next hybrid causal LM (`logits = model(input_ids)`).

    Layer states for `forward(..., states=...)`: a `models.layers.gdn.GDNState` (or None = zeros)
    for each GDN layer, the attend's state for each attention layer.
    """

    family = "qwen3_next"

    def make_mixer(self, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        cfg = self.cfg
        if cfg.layer_types[layer] == "linear_attention":
            return GatedDeltaNet(cfg.gdn, layer=layer, dtype=self.dtype, rngs=rngs)
        return GatedAttention(cfg.attention, layer=layer, dtype=self.dtype, rngs=rngs)

    def make_mlp(self, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        cfg, dtype = self.cfg, self.dtype
        if cfg.mlp_types[layer] == "dense":
            return GatedMLP(cfg.dim, cfg.intermediate_size, act=cfg.act, dtype=dtype, rngs=rngs)
        m = cfg.moe
        experts_cls = FusedSwiGLUExperts if m.fused_experts else SwiGLUExperts
        return MoE(
            SoftmaxTopKRouter(cfg.dim, m.num_experts, m.top_k, normalize=m.normalize,
                              dtype=dtype, rngs=rngs),
            experts_cls(cfg.dim, m.intermediate_size, m.num_experts, act=cfg.act, dtype=dtype,
                        rngs=rngs),
            shared=GatedMLP(cfg.dim, m.shared_intermediate_size, act=cfg.act, dtype=dtype,
                            rngs=rngs),
            shared_gate=Linear(cfg.dim, 1, dtype=dtype, rngs=rngs))

    def make_norm(self, dim: int) -> nnx.Module:
        return RMSNorm(dim, eps=self.cfg.norm_eps, zero_centered=True, dtype=self.dtype)


def checkpoint_names(hf: HFConfig) -> list[str] | None:
    """Tensor names of the safetensors next to `hf.source` (header only), or None if there are
    none to read (an in-memory config; the loader reports unreadable files itself)."""
    from models.convert.sources import CheckpointError, SafetensorsSource

    directory = os.path.dirname(hf.source)
    if os.path.basename(hf.source) != "config.json" or not directory:
        return None
    try:
        return SafetensorsSource(directory).names()
    except CheckpointError:
        return None


def hybrid_config_from_hf(
    hf: HFConfig, *, projection_layout: str, moe_layers: str, defaults: dict,
    prefix: str = "model.", tie_embeddings: bool | None = None,
    names: list[str] | None = None,
) -> Qwen3NextConfig:
    """A `Qwen3NextConfig` from the fields of a Qwen3-Next / Qwen3.5 (text) `config.json`.

    Args:
      hf: the (text) config.
      projection_layout: GDN projections, `"grouped"` or `"split"`.
      moe_layers: `"next"` (Qwen3-Next placement rule), `"all"` or `"none"`.
      defaults: HF's defaults of this model type for `intermediate_size`, `num_experts`,
        `num_experts_per_tok`.
      prefix: HF name prefix of the decoder.
      tie_embeddings: overrides the config's `tie_word_embeddings` (vision-language wrappers).
      names: the checkpoint's tensor names, to tell fused from per-expert MoE tensors.

    Raises:
      ConfigError: a missing / ill-typed field or inconsistent sizes.
    """
    dim = hf.require("hidden_size")
    num_layers = hf.require("num_hidden_layers")
    heads = hf.require("num_attention_heads")
    kv_heads = hf.optional("num_key_value_heads", int, heads)
    head_dim = hf.optional("head_dim", int, 256)
    eps = hf.optional("rms_norm_eps", float, 1e-6)
    bias = hf.optional("attention_bias", bool, False)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        interval = hf.optional("full_attention_interval", int, 4)
        layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                       for i in range(num_layers)]
    rope_hf = hf
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if "partial_rotary_factor" not in params and "partial_rotary_factor" not in hf:
        rope_hf = HFConfig({**hf.data, "partial_rotary_factor": 0.25}, source=hf.source)
    if moe_layers == "next":
        num_experts = hf.optional("num_experts", int, defaults["num_experts"])
        step = hf.optional("decoder_sparse_step", int, 1)
        only = set(hf.optional("mlp_only_layers", list, []))
        if step <= 0:
            raise ConfigError(f"{hf.source}: decoder_sparse_step={step} must be positive")
        mlp_types = ["moe" if i not in only and num_experts > 0 and (i + 1) % step == 0
                     else "dense" for i in range(num_layers)]
    else:
        mlp_types = [{"all": "moe", "none": "dense"}[moe_layers]] * num_layers
    fused = names is not None and any(
        n.endswith(".mlp.experts.gate_up_proj") and not n.startswith("mtp.") for n in names)
    try:
        attention = AttentionConfig(
            dim=dim, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, qkv_bias=bias,
            o_bias=bias, qk_norm="zero_centered", norm_eps=eps,
            rope=rope_from_hf(rope_hf, head_dim=head_dim))
        gdn = GDNConfig(
            dim=dim, num_k_heads=hf.optional("linear_num_key_heads", int, 16),
            num_v_heads=hf.optional("linear_num_value_heads", int, 32),
            head_k_dim=hf.optional("linear_key_head_dim", int, 128),
            head_v_dim=hf.optional("linear_value_head_dim", int, 128),
            conv_width=hf.optional("linear_conv_kernel_dim", int, 4), norm_eps=eps,
            projection_layout=projection_layout)
        moe = None
        if "moe" in mlp_types:
            moe = MoEConfig(
                num_experts=hf.optional("num_experts", int, defaults["num_experts"]),
                top_k=hf.optional("num_experts_per_tok", int, defaults["num_experts_per_tok"]),
                intermediate_size=hf.optional("moe_intermediate_size", int, 512),
                shared_intermediate_size=hf.optional("shared_expert_intermediate_size", int, 512),
                normalize=(hf.optional("norm_topk_prob", bool, True) if moe_layers == "next"
                           else True),
                fused_experts=fused)
        intermediate = None
        if "dense" in mlp_types:
            intermediate = hf.optional("intermediate_size", int, defaults["intermediate_size"])
        if tie_embeddings is None:
            tie_embeddings = hf.optional("tie_word_embeddings", bool, False)
        return Qwen3NextConfig(
            vocab_size=hf.require("vocab_size"), dim=dim, num_layers=num_layers,
            layer_types=tuple(layer_types), mlp_types=tuple(mlp_types), attention=attention,
            gdn=gdn, intermediate_size=intermediate, moe=moe, norm_eps=eps,
            act=hf.optional("hidden_act", str, "silu"), tie_embeddings=tie_embeddings,
            checkpoint_prefix=prefix)
    except ConfigError as e:
        raise ConfigError(f"{hf.source}: {e}") from None


def config_from_hf(hf: HFConfig) -> Qwen3NextConfig:
    """Qwen3-Next config (HF defaults of `Qwen3NextConfig` for absent fields)."""
    return hybrid_config_from_hf(
        hf, projection_layout="grouped", moe_layers="next", names=checkpoint_names(hf),
        defaults={"intermediate_size": 5632, "num_experts": 512, "num_experts_per_tok": 10})


def _conv_taps(w):
    """HF `Conv1d` depthwise weight `[C, 1, W]` → `[C, W]`."""
    return w[:, 0, :]


def _swap_last(w):
    """Fused HF experts `[E, out, in]` → `[E, in, out]`."""
    return jnp.swapaxes(w, 1, 2)


def gdn_rules(cfg: GDNConfig, dst: str, src: str) -> list[Rule]:
    """HF `...linear_attn.*` → `GatedDeltaNet` parameters under `dst`."""
    projs = (("in_proj_qkvz", "in_proj_ba") if cfg.projection_layout == "grouped"
             else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    rules = [r for p in projs for r in linear(f"{dst}/{p}", f"{src}.{p}")]
    return rules + [
        Rule(f"{dst}/conv_weight", (f"{src}.conv1d.weight",), _conv_taps),
        param(f"{dst}/A_log", f"{src}.A_log"), param(f"{dst}/dt_bias", f"{src}.dt_bias"),
        param(f"{dst}/norm/weight", f"{src}.norm.weight"),
        *linear(f"{dst}/out_proj", f"{src}.out_proj")]


def moe_rules(cfg: MoEConfig, dst: str, src: str) -> list[Rule]:
    """HF Qwen MoE block `...mlp.*` (router `gate`, experts, `shared_expert(_gate)`) → `MoE`."""
    rules = linear(f"{dst}/router/proj", f"{src}.gate")
    if cfg.fused_experts:
        rules += [Rule(f"{dst}/experts/{p}", (f"{src}.experts.{p}",), _swap_last)
                  for p in ("gate_up_proj", "down_proj")]
    else:
        rules += stacked_experts(f"{dst}/experts", f"{src}.experts", cfg.num_experts)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        rules += linear(f"{dst}/shared/{proj}", f"{src}.shared_expert.{proj}")
    return rules + linear(f"{dst}/shared_gate", f"{src}.shared_expert_gate")


def rules(cfg: Qwen3NextConfig) -> list[Rule]:
    """HF names (under `cfg.checkpoint_prefix`) → parameters."""
    pre = cfg.checkpoint_prefix
    a = cfg.attention
    out = [param("embed/embedding", f"{pre}embed_tokens.weight"),
           param("norm/weight", f"{pre}norm.weight")]
    if not cfg.tie_embeddings:
        out += linear("lm_head", "lm_head")
    for i in range(cfg.num_layers):
        src, dst = f"{pre}layers.{i}", f"layers/{i}"
        out += [param(f"{dst}/input_norm/weight", f"{src}.input_layernorm.weight"),
                param(f"{dst}/post_norm/weight", f"{src}.post_attention_layernorm.weight")]
        if cfg.layer_types[i] == "linear_attention":
            out += gdn_rules(cfg.gdn, f"{dst}/mixer", f"{src}.linear_attn")
        else:
            for proj in ("q_proj", "k_proj", "v_proj"):
                out += linear(f"{dst}/mixer/{proj}", f"{src}.self_attn.{proj}", bias=a.qkv_bias)
            out += linear(f"{dst}/mixer/o_proj", f"{src}.self_attn.o_proj", bias=a.o_bias)
            out += [param(f"{dst}/mixer/q_norm/weight", f"{src}.self_attn.q_norm.weight"),
                    param(f"{dst}/mixer/k_norm/weight", f"{src}.self_attn.k_norm.weight")]
        if cfg.mlp_types[i] == "moe":
            out += moe_rules(cfg.moe, f"{dst}/mlp", f"{src}.mlp")
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out += linear(f"{dst}/mlp/{proj}", f"{src}.mlp.{proj}")
    return out


def ignore(cfg: Qwen3NextConfig) -> tuple[str, ...]:
    """Rotary buffers, multi-token-prediction heads (`mtp.*`), a tied head's copy."""
    pats = (r"model\.(language_model\.)?rotary_emb\.inv_freq", r"mtp\..*")
    return pats + ((r"lm_head\.weight",) if cfg.tie_embeddings else ())


FAMILY = register(Family(
    name="qwen3_next", model_cls=Qwen3NextForCausalLM, config_cls=Qwen3NextConfig,
    config_from_hf=config_from_hf, rules=rules, hf_architectures=("Qwen3NextForCausalLM",),
    ignore=ignore,
))
