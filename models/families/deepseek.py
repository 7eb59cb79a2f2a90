"""DeepSeek-V3 and DeepSeek-V2 / V2-Lite families: multi-head latent attention (MLA) + DeepSeek MoE.

HF: `DeepseekV3ForCausalLM` (`model_type` "deepseek_v3") and `DeepseekV2ForCausalLM`
("deepseek_v2"; V2-Lite is `q_lora_rank: null`). Every layer's mixer is `MLAttention`
(`models/layers/mla.py`); layer i's MLP is a DeepSeek MoE iff `n_routed_experts` is set,
`i >= first_k_dense_replace` and `i % moe_layer_freq == 0` (DeepSeek's own rule; transformers 5
ignores `moe_layer_freq`, which is 1 in every released config), else a dense SwiGLU. The MoE is
`MoE(router, SwiGLUExperts, shared=GatedMLP)`: ungated shared experts of width
`moe_intermediate_size · n_shared_experts`, the router from `models/layers/deepseek_moe.py` (V3:
sigmoid + `e_score_correction_bias` + group-limited top-k, `norm_topk_prob`,
`routed_scaling_factor`; V2: softmax top-k, "greedy" or "group_limited_greedy"). V2's `mlp_bias`
applies to the dense MLP and the shared experts.

Checkpoints. Names as `save_pretrained` and the Hub write them (`mlp.experts.{e}.*` per expert,
`mlp.shared_experts.*`, `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`). DeepSeek's FP8
checkpoints (`quantization_config.quant_method == "fp8"`) store every linear of the decoder
layers except the router as float8_e4m3 `weight` plus float32 `weight_scale_inv`
`[ceil(out / bo), ceil(in / bi)]` for blocks `weight_block_size = [bo, bi]` (128 x 128); they are
dequantised at load, `W[i, j] = weight[i, j] · weight_scale_inv[i // bo, j // bi]` (a multiply,
despite the name), in the requested dtype, as HF's dequantising FP8 path does. Activations are not
quantised. `modules_to_not_convert` entries (module prefix at a `.` boundary, or suffix) name
linears stored unquantised. Ignored: rotary buffers, `mtp.*` and the multi-token-prediction layer
`model.layers.{>= num_hidden_layers}.*`.

`num_key_value_heads` is not used: MLA keys are per query head by construction.

Not done: the MTP head, packed sequences (segment ids), per-tensor FP8 scales, FP8 activations.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax.numpy as jnp
from flax import nnx

from models.config import ConfigBase, ConfigError, HFConfig, check_choice, check_positive
from models.convert.mapping import Rule, linear, param, transpose
from models.convert.registry import Family, register
from models.layers.deepseek_moe import V2_METHODS, DeepseekV2Router, DeepseekV3Router
from models.layers.linear import GatedMLP, activation
from models.layers.mla import MLAConfig, MLAttention
from models.layers.moe import MoE, SwiGLUExperts
from models.layers.norms import RMSNorm
from models.layers.rope import rope_from_hf
from models.transformer import CausalLM

MLP_TYPES = ("dense", "moe")
ROUTERS = ("noaux_tc",) + V2_METHODS
DEFAULT_FP8_BLOCK = (128, 128)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekMoEConfig(ConfigBase):
    """The MoE layers.

    Attributes:
      num_experts: E routed experts (`n_routed_experts`).
      top_k: experts per token (`num_experts_per_tok`).
      intermediate_size: I of each routed expert (`moe_intermediate_size`).
      num_shared_experts: shared experts (one MLP of width `I · num_shared_experts`; 0 = none).
      router: "noaux_tc" (V3), "greedy" or "group_limited_greedy" (V2).
      n_group, topk_group: expert groups and how many stay (group-limited routers).
      normalize: renormalise the top-k weights (`norm_topk_prob`, V3 only).
      routed_scaling_factor: multiplies the routing weights.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    router: str = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    normalize: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        name = type(self).__name__
        check_positive(name, num_experts=self.num_experts, top_k=self.top_k,
                       intermediate_size=self.intermediate_size, n_group=self.n_group,
                       topk_group=self.topk_group)
        check_choice(name, "router", self.router, ROUTERS)
        if self.num_shared_experts < 0:
            raise ConfigError(f"{name}.num_shared_experts={self.num_shared_experts} must be >= 0")
        if self.num_experts % self.n_group:
            raise ConfigError(f"{name}.num_experts={self.num_experts} must be divisible by "
                              f"n_group={self.n_group}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"{name}.topk_group={self.topk_group} exceeds "
                              f"n_group={self.n_group}")
        group_size = self.num_experts // self.n_group
        if self.router == "noaux_tc" and self.n_group > 1 and group_size < 2:
            raise ConfigError(f"{name}: groups of num_experts / n_group = {group_size} expert; "
                              f"V3 group scores need at least 2")
        grouped = self.router != "greedy"
        available = self.topk_group * group_size if grouped else self.num_experts
        if self.top_k > available:
            raise ConfigError(f"{name}.top_k={self.top_k} exceeds the {available} experts the "
                              f"router can choose from (topk_group={self.topk_group} groups of "
                              f"{group_size})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepseekConfig(ConfigBase):
    """A DeepSeek-V2 / V3 decoder.

    Attributes:
      vocab_size: V.
      dim: D (`hidden_size`).
      num_layers: decoder layers (the MTP layer excluded).
      attention: the MLA layer config (every layer).
      mlp_types: per layer "dense" or "moe".
      intermediate_size: I of the dense MLP layers (None if there are none).
      moe: the MoE layers (None if there are none).
      norm_eps: epsilon of the decoder norms (`rms_norm_eps`).
      act: MLP activation.
      mlp_bias: biases in the dense MLP and shared experts (V2 `mlp_bias`).
      tie_embeddings: output head = embedding transpose.
      fp8_block_size: `[bo, bi]` FP8 weight blocks of the checkpoint, None if not quantised.
      fp8_skip: `modules_to_not_convert` of an FP8 checkpoint.
    """

    vocab_size: int
    dim: int
    num_layers: int
    attention: MLAConfig
    mlp_types: tuple[str, ...]
    intermediate_size: int | None = None
    moe: DeepseekMoEConfig | None = None
    norm_eps: float = 1e-6
    act: str = "silu"
    mlp_bias: bool = False
    tie_embeddings: bool = False
    fp8_block_size: tuple[int, ...] | None = None
    fp8_skip: tuple[str, ...] = ()

    def __post_init__(self):
        name = type(self).__name__
        check_positive(name, vocab_size=self.vocab_size, dim=self.dim, num_layers=self.num_layers)
        if self.attention.dim != self.dim:
            raise ConfigError(f"{name}.attention.dim={self.attention.dim} must equal "
                              f"dim={self.dim}")
        if len(self.mlp_types) != self.num_layers:
            raise ConfigError(f"{name}.mlp_types has {len(self.mlp_types)} entries; "
                              f"num_layers={self.num_layers}")
        for t in self.mlp_types:
            check_choice(name, "mlp_types[i]", t, MLP_TYPES)
        if "dense" in self.mlp_types:
            check_positive(name, intermediate_size=self.intermediate_size)
        if "moe" in self.mlp_types and self.moe is None:
            raise ConfigError(f"{name}.moe is required: mlp_types has MoE layers")
        if not self.norm_eps > 0:
            raise ConfigError(f"{name}.norm_eps={self.norm_eps} must be positive")
        try:
            activation(self.act)
        except ValueError as e:
            raise ConfigError(f"{name}.act: {e}") from None
        if self.fp8_block_size is not None:
            b = self.fp8_block_size
            if len(b) != 2:
                raise ConfigError(f"{name}.fp8_block_size={b} must have 2 entries")
            check_positive(name, fp8_block_rows=b[0], fp8_block_cols=b[1])

    def fp8_block(self, module: str) -> tuple[int, int] | None:
        """The FP8 block size of HF linear `module` (e.g. `model.layers.0.self_attn.o_proj`), or
        None if it is stored unquantised."""
        if self.fp8_block_size is None or _skipped(module, self.fp8_skip):
            return None
        return tuple(self.fp8_block_size)


def _skipped(module: str, patterns: tuple[str, ...]) -> bool:
    """`modules_to_not_convert` match: a prefix ending at a `.` boundary (regex allowed), or a
    suffix."""
    for p in patterns:
        if module.endswith(p):
            return True
        try:
            if re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", module):
                return True
        except re.error:
            continue
    return False


class DeepseekV3ForCausalLM(CausalLM):
    """DeepSeek-V3 causal LM (`logits = model(input_ids)`): MLA mixers, dense / MoE MLPs.

    Layer states for `forward(..., states=...)`: whatever the attend's `mla_attend` keeps per
    layer (a latent pool in the engine); None in the full forward.
    """

    family = "deepseek_v3"

    def make_mixer(self, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        return MLAttention(self.cfg.attention, layer=layer, dtype=self.dtype, rngs=rngs)

    def make_mlp(self, layer: int, rngs: nnx.Rngs) -> nnx.Module:
        cfg, dtype = self.cfg, self.dtype
        if cfg.mlp_types[layer] == "dense":
            return GatedMLP(cfg.dim, cfg.intermediate_size, act=cfg.act, bias=cfg.mlp_bias,
                            dtype=dtype, rngs=rngs)
        m = cfg.moe
        if m.router == "noaux_tc":
            router = DeepseekV3Router(cfg.dim, m.num_experts, m.top_k, n_group=m.n_group,
                                      topk_group=m.topk_group, normalize=m.normalize,
                                      scaling=m.routed_scaling_factor, dtype=dtype, rngs=rngs)
        else:
            router = DeepseekV2Router(cfg.dim, m.num_experts, m.top_k, method=m.router,
                                      n_group=m.n_group, topk_group=m.topk_group,
                                      scaling=m.routed_scaling_factor, dtype=dtype, rngs=rngs)
        shared = None
        if m.num_shared_experts:
            shared = GatedMLP(cfg.dim, m.intermediate_size * m.num_shared_experts, act=cfg.act,
                              bias=cfg.mlp_bias, dtype=dtype, rngs=rngs)
        return MoE(router, SwiGLUExperts(cfg.dim, m.intermediate_size, m.num_experts,
                                         act=cfg.act, dtype=dtype, rngs=rngs), shared=shared)

    def make_norm(self, dim: int) -> nnx.Module:
        return RMSNorm(dim, eps=self.cfg.norm_eps, dtype=self.dtype)


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V2 / V2-Lite causal LM: V3's structure with V2's RoPE pairing and router."""

    family = "deepseek_v2"


_V3_DEFAULTS = dict(q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1,
                    num_experts_per_tok=8, moe_intermediate_size=2048, intermediate_size=18432,
                    first_k_dense_replace=3, routed_scaling_factor=2.5, n_group=8, topk_group=4)
_V2_DEFAULTS = dict(q_lora_rank=1536, n_routed_experts=64, n_shared_experts=2,
                    num_experts_per_tok=None, moe_intermediate_size=1407, intermediate_size=11008,
                    first_k_dense_replace=0, routed_scaling_factor=1.0, n_group=None,
                    topk_group=None)


def _nullable_int(hf: HFConfig, key: str, default):
    """An int field where an explicit null means "none" and absence means HF's default."""
    if key not in hf.data:
        return default
    return hf.optional(key, int, None)


def _fp8_from_hf(hf: HFConfig) -> tuple[tuple[int, int] | None, tuple[str, ...]]:
    q = hf.get("quantization_config")
    if q is None:
        return None, ()
    if not isinstance(q, dict):
        raise ConfigError(f"{hf.source}: field quantization_config={q!r} must be an object")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{hf.source}: quantization_config.quant_method={method!r} is not "
                          f"supported; supported: 'fp8' (block-wise weight_scale_inv)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{hf.source}: quantization_config.fmt={q['fmt']!r}; only 'e4m3' "
                          f"is supported")
    block = q.get("weight_block_size", DEFAULT_FP8_BLOCK)
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{hf.source}: quantization_config.weight_block_size={block!r} must "
                          f"be two positive ints (per-tensor FP8 scales are not supported)")
    skip = q.get("modules_to_not_convert") or ()
    if not isinstance(skip, list | tuple) or not all(isinstance(s, str) for s in skip):
        raise ConfigError(f"{hf.source}: quantization_config.modules_to_not_convert={skip!r} "
                          f"must be a list of strings")
    return (int(block[0]), int(block[1])), tuple(skip)


def _config_from_hf(hf: HFConfig, *, v3: bool) -> DeepseekConfig:
    d = _V3_DEFAULTS if v3 else _V2_DEFAULTS
    dim = hf.require("hidden_size")
    num_layers = hf.require("num_hidden_layers")
    heads = hf.require("num_attention_heads")
    rope_dim = hf.optional("qk_rope_head_dim", int, 64)
    fp8_block, fp8_skip = _fp8_from_hf(hf)
    num_experts = _nullable_int(hf, "n_routed_experts", d["n_routed_experts"])
    first_dense = hf.optional("first_k_dense_replace", int, d["first_k_dense_replace"])
    freq = hf.optional("moe_layer_freq", int, 1)
    if freq <= 0:
        raise ConfigError(f"{hf.source}: moe_layer_freq={freq} must be positive")
    mlp_types = tuple("moe" if num_experts and i >= first_dense and i % freq == 0 else "dense"
                      for i in range(num_layers))
    try:
        rope = rope_from_hf(hf, head_dim=rope_dim, rope_dim=rope_dim,
                            layout="neox" if v3 else "interleaved")
        attention = MLAConfig(
            dim=dim, num_heads=heads, q_lora_rank=_nullable_int(hf, "q_lora_rank",
                                                                d["q_lora_rank"]),
            kv_lora_rank=hf.optional("kv_lora_rank", int, 512),
            qk_nope_head_dim=hf.optional("qk_nope_head_dim", int, 128),
            qk_rope_head_dim=rope_dim, v_head_dim=hf.optional("v_head_dim", int, 128),
            rope=rope, deinterleave=v3 and hf.optional("rope_interleave", bool, True),
            bias=hf.optional("attention_bias", bool, False))
        moe = None
        if "moe" in mlp_types:
            top_k = _nullable_int(hf, "num_experts_per_tok", d["num_experts_per_tok"])
            if top_k is None:
                raise ConfigError(f"{hf.source}: required field 'num_experts_per_tok' is "
                                  f"missing (the model has MoE layers)")
            if v3:
                router = "noaux_tc"  # transformers' V3 router ignores topk_method / scoring_func
            else:
                router = hf.optional("topk_method", str, "greedy")
                if router not in V2_METHODS:
                    raise ConfigError(f"{hf.source}: topk_method={router!r} is not supported "
                                      f"by DeepseekV2ForCausalLM; supported: {V2_METHODS}")
            grouped = router != "greedy"
            n_group = _nullable_int(hf, "n_group", d["n_group"]) if grouped else 1
            topk_group = _nullable_int(hf, "topk_group", d["topk_group"]) if grouped else 1
            if n_group is None or topk_group is None:
                raise ConfigError(f"{hf.source}: router {router!r} needs n_group and topk_group; "
                                  f"got {n_group=}, {topk_group=}")
            moe = DeepseekMoEConfig(
                num_experts=num_experts, top_k=top_k,
                intermediate_size=hf.optional("moe_intermediate_size", int,
                                              d["moe_intermediate_size"]),
                num_shared_experts=_nullable_int(hf, "n_shared_experts",
                                                 d["n_shared_experts"]) or 0,
                router=router, n_group=n_group, topk_group=topk_group,
                normalize=v3 and hf.optional("norm_topk_prob", bool, True),
                routed_scaling_factor=hf.optional("routed_scaling_factor", float,
                                                  d["routed_scaling_factor"]))
        intermediate = None
        if "dense" in mlp_types:
            intermediate = hf.optional("intermediate_size", int, d["intermediate_size"])
        return DeepseekConfig(
            vocab_size=hf.require("vocab_size"), dim=dim, num_layers=num_layers,
            attention=attention, mlp_types=mlp_types, intermediate_size=intermediate, moe=moe,
            norm_eps=hf.optional("rms_norm_eps", float, 1e-6),
            act=hf.optional("hidden_act", str, "silu"),
            mlp_bias=(not v3) and hf.optional("mlp_bias", bool, False),
            tie_embeddings=hf.optional("tie_word_embeddings", bool, False),
            fp8_block_size=fp8_block, fp8_skip=fp8_skip)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(hf.source) else f"{hf.source}: {msg}") from None


def config_from_hf_v3(hf: HFConfig) -> DeepseekConfig:
    """DeepSeek-V3 config (HF `DeepseekV3Config` defaults for absent fields)."""
    return _config_from_hf(hf, v3=True)


def config_from_hf_v2(hf: HFConfig) -> DeepseekConfig:
    """DeepSeek-V2 / V2-Lite config (HF `DeepseekV2Config` defaults for absent fields)."""
    return _config_from_hf(hf, v3=False)


def dequantize_fp8_block(w, scale_inv, *, block: tuple[int, int]):
    """`w [out, in] · scale_inv[i // bo, j // bi]`, in w's dtype.

    Args:
      w: `[out, in]` FP8 weight values (already cast to a float dtype by the loader).
      scale_inv: `[ceil(out / bo), ceil(in / bi)]` per-block scales.
      block: `(bo, bi)`.

    Raises:
      ValueError: `scale_inv` has the wrong shape for `w` and `block`.
    """
    (rows, cols), (bo, bi) = w.shape, block
    want = (-(-rows // bo), -(-cols // bi))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv.shape={tuple(scale_inv.shape)} must be {want} for a "
                         f"{[rows, cols]} weight in {[bo, bi]} blocks")
    s = jnp.repeat(jnp.repeat(scale_inv.astype(w.dtype), bo, axis=0), bi, axis=1)
    return w * s[:rows, :cols]


def _fp8_kernel(w, scale_inv, *, block):
    """FP8 torch Linear weight + scales → dequantised kernel `[in, out]`."""
    return transpose(dequantize_fp8_block(w, scale_inv, block=block))


def _fp8_stacked(*pairs, block):
    """`(w_0, s_0, w_1, s_1, ...)` per-expert FP8 weights → stacked kernels `[E, in, out]`."""
    return jnp.stack([_fp8_kernel(w, s, block=block) for w, s in zip(pairs[::2], pairs[1::2])])


def _stack_transposed(*ws):
    return jnp.stack([jnp.transpose(w) for w in ws])


def _linear(cfg: DeepseekConfig, target: str, source: str, *, bias: bool = False) -> list[Rule]:
    """A torch Linear, dequantised if the checkpoint stores it as FP8."""
    block = cfg.fp8_block(source)
    if block is None:
        return linear(target, source, bias=bias)
    rules = [Rule(f"{target}/kernel", (f"{source}.weight", f"{source}.weight_scale_inv"),
                  functools.partial(_fp8_kernel, block=block))]
    if bias:
        rules.append(param(f"{target}/bias", f"{source}.bias"))
    return rules


def _experts(cfg: DeepseekConfig, target: str, source: str) -> list[Rule]:
    """Per-expert HF Linears `{source}.{e}.{proj}` → stacked `[E, in, out]` (FP8 or not)."""
    rules = []
    for proj in ("gate_proj", "up_proj", "down_proj"):
        mods = [f"{source}.{e}.{proj}" for e in range(cfg.moe.num_experts)]
        blocks = {cfg.fp8_block(m) for m in mods}
        if blocks == {None}:
            rules.append(Rule(f"{target}/{proj}", tuple(f"{m}.weight" for m in mods),
                              _stack_transposed))
        elif len(blocks) == 1:
            srcs = tuple(s for m in mods for s in (f"{m}.weight", f"{m}.weight_scale_inv"))
            rules.append(Rule(f"{target}/{proj}", srcs,
                              functools.partial(_fp8_stacked, block=blocks.pop())))
        else:
            raise ConfigError(f"modules_to_not_convert={list(cfg.fp8_skip)} leaves some but not "
                              f"all experts of {source}.*.{proj} quantised; not supported")
    return rules


def rules(cfg: DeepseekConfig) -> list[Rule]:
    """HF names → parameters (FP8 linears dequantised with their `weight_scale_inv`)."""
    a = cfg.attention
    out = [param("embed/embedding", "model.embed_tokens.weight"),
           param("norm/weight", "model.norm.weight")]
    if not cfg.tie_embeddings:
        out += linear("lm_head", "lm_head")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}", f"layers/{i}"
        s, d = f"{src}.self_attn", f"{dst}/mixer"
        out += [param(f"{dst}/input_norm/weight", f"{src}.input_layernorm.weight"),
                param(f"{dst}/post_norm/weight", f"{src}.post_attention_layernorm.weight")]
        if a.q_lora_rank is None:
            out += _linear(cfg, f"{d}/q_proj", f"{s}.q_proj")
        else:
            out += _linear(cfg, f"{d}/q_a_proj", f"{s}.q_a_proj", bias=a.bias)
            out += [param(f"{d}/q_a_norm/weight", f"{s}.q_a_layernorm.weight")]
            out += _linear(cfg, f"{d}/q_b_proj", f"{s}.q_b_proj")
        out += _linear(cfg, f"{d}/kv_a_proj", f"{s}.kv_a_proj_with_mqa", bias=a.bias)
        out += [param(f"{d}/kv_a_norm/weight", f"{s}.kv_a_layernorm.weight")]
        out += _linear(cfg, f"{d}/kv_b_proj", f"{s}.kv_b_proj")
        out += _linear(cfg, f"{d}/o_proj", f"{s}.o_proj", bias=a.bias)
        m, md = f"{src}.mlp", f"{dst}/mlp"
        if cfg.mlp_types[i] == "dense":
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out += _linear(cfg, f"{md}/{proj}", f"{m}.{proj}", bias=cfg.mlp_bias)
            continue
        out += linear(f"{md}/router/proj", f"{m}.gate")  # the router is never FP8
        if cfg.moe.router == "noaux_tc":
            out += [param(f"{md}/router/e_score_correction_bias",
                          f"{m}.gate.e_score_correction_bias")]
        out += _experts(cfg, f"{md}/experts", f"{m}.experts")
        if cfg.moe.num_shared_experts:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                out += _linear(cfg, f"{md}/shared/{proj}", f"{m}.shared_experts.{proj}",
                               bias=cfg.mlp_bias)
    return out


def ignore(cfg: DeepseekConfig) -> tuple[str, ...]:
    """Rotary buffers, the MTP module (`mtp.*`, layers `>= num_layers`), a tied head's copy."""
    own = "|".join(str(i) for i in range(cfg.num_layers))
    pats = [r"model\.rotary_emb\.inv_freq", r"model\.layers\.\d+\.self_attn\.rotary_emb\..*",
            r"mtp\..*", rf"model\.layers\.(?!(?:{own})\.)\d+\..*"]
    if cfg.moe is not None and not cfg.moe.num_shared_experts:  # HF keeps 0-width MLPs
        pats.append(r"model\.layers\.\d+\.mlp\.shared_experts\..*")
    if cfg.tie_embeddings:
        pats.append(r"lm_head\.weight")
    return tuple(pats)


FAMILY_V3 = register(Family(
    name="deepseek_v3", model_cls=DeepseekV3ForCausalLM, config_cls=DeepseekConfig,
    config_from_hf=config_from_hf_v3, rules=rules, hf_architectures=("DeepseekV3ForCausalLM",),
    ignore=ignore,
))
FAMILY_V2 = register(Family(
    name="deepseek_v2", model_cls=DeepseekV2ForCausalLM, config_cls=DeepseekConfig,
    config_from_hf=config_from_hf_v2, rules=rules, hf_architectures=("DeepseekV2ForCausalLM",),
    ignore=ignore,
))
