"""Llama family (Llama 2/3, SmolLM2, Mistral-style dense GQA without sliding window).

HF: `LlamaForCausalLM` (`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`, `model.norm`, `lm_head` unless tied).
GGUF: `general.architecture == "llama"`; llama.cpp stores q/k rows permuted for its GPT-J style
RoPE, undone here; a missing `output.weight` means tied embeddings.

The GGUF name table and metadata parsing here are shared by other llama.cpp-converted families
(Qwen3 imports them).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from models.config import ConfigError, HFConfig
from models.convert.registry import Family, register
from models.convert.sources import hf_config_from_gguf, unpermute_rotary
from models.layers.attention import AttentionConfig
from models.layers.rope import rope_from_hf
from models.transformer import CausalLM, DecoderConfig, decoder_rules, layer_types_from_hf


class LlamaForCausalLM(CausalLM):
    """Llama-architecture causal LM (`logits = model(input_ids)`)."""

    family = "llama"


def decoder_config_from_hf(hf: HFConfig, *, qk_norm: str | None = None,
                           head_dim_default: int | None = None,
                           use_sliding_default: bool = False) -> DecoderConfig:
    """A `DecoderConfig` from Llama-style HF fields (also used by Qwen3).

    Raises:
      ConfigError: a required field is missing / ill-typed, or the sizes are inconsistent.
    """
    dim = hf.require("hidden_size")
    heads = hf.require("num_attention_heads")
    if heads <= 0:
        raise ConfigError(f"{hf.source}: num_attention_heads={heads} must be positive")
    kv_heads = hf.optional("num_key_value_heads", int, heads)
    default_hd = head_dim_default if head_dim_default is not None else dim // heads
    head_dim = hf.optional("head_dim", int, default_hd)
    bias = hf.optional("attention_bias", bool, False)
    num_layers = hf.require("num_hidden_layers")
    layer_types, window = layer_types_from_hf(hf, num_layers,
                                              use_sliding_default=use_sliding_default)
    eps = hf.optional("rms_norm_eps", float, 1e-6)
    try:
        attention = AttentionConfig(
            dim=dim, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, qkv_bias=bias,
            o_bias=bias, qk_norm=qk_norm, norm_eps=eps, rope=rope_from_hf(hf, head_dim=head_dim))
        return DecoderConfig(
            vocab_size=hf.require("vocab_size"), dim=dim, num_layers=num_layers,
            intermediate_size=hf.require("intermediate_size"), attention=attention,
            layer_types=layer_types, sliding_window=window, norm_eps=eps,
            act=hf.optional("hidden_act", str, "silu"),
            mlp_bias=hf.optional("mlp_bias", bool, False),
            tie_embeddings=hf.optional("tie_word_embeddings", bool, False))
    except ConfigError as e:
        raise ConfigError(f"{hf.source}: {e}") from None


def config_from_hf(hf: HFConfig) -> DecoderConfig:
    """Llama config (no q/k norm; head_dim defaults to hidden_size // heads)."""
    return decoder_config_from_hf(hf)


def ignore(cfg: DecoderConfig) -> tuple[str, ...]:
    """Non-weight tensors some checkpoints carry (rotary buffers; a tied head's copy)."""
    pats = (r"model\.rotary_emb\.inv_freq", r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
    return pats + ((r"lm_head\.weight",) if cfg.tie_embeddings else ())


_GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size", "attention.key_length": "head_dim",
}


def gguf_to_hf(name: str) -> str | None:
    """llama.cpp tensor name → HF name (None if not a known tensor)."""
    if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name):
        part = _GGUF_BLOCK.get(m[2])
        return None if part is None else f"model.layers.{m[1]}.{part}.{m[3]}"
    if m := re.fullmatch(r"(\w+)\.(weight|bias)", name):
        top = _GGUF_TOP.get(m[1])
        return None if top is None else f"{top}.{m[2]}"
    return None


def gguf_config(meta: Mapping[str, Any], shapes: Mapping[str, tuple], *, arch: str,
                architecture: str, rope_dim_is_head_dim: bool) -> dict:
    """HF config dict from llama.cpp metadata (`{arch}.*` keys) and tensor shapes.

    Raises:
      ConfigError: llama.cpp rope scaling this converter does not reproduce (`rope_freqs`).
    """
    hf = hf_config_from_gguf(meta, arch, _GGUF_KEYS)
    hf["architectures"] = [architecture]
    dim_key = f"{arch}.rope.dimension_count"
    if "head_dim" not in hf and rope_dim_is_head_dim and dim_key in meta:
        hf["head_dim"] = meta[dim_key]
    if "vocab_size" not in hf and "token_embd.weight" in shapes:
        hf["vocab_size"] = shapes["token_embd.weight"][0]
    hf["tie_word_embeddings"] = "output.weight" not in shapes
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        rope = {"rope_type": scaling, "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0)}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            rope["original_max_position_embeddings"] = orig
        hf["rope_scaling"] = rope
    if "rope_freqs.weight" in shapes:
        raise ConfigError("GGUF tensor 'rope_freqs.weight' (llama.cpp per-frequency rope "
                          "factors) is not supported; convert from the HF checkpoint instead")
    return hf


def _llama_gguf_config(meta, shapes) -> dict:
    return gguf_config(meta, shapes, arch="llama", architecture="LlamaForCausalLM",
                       rope_dim_is_head_dim=True)


def unpermute_qk(name: str, arr: np.ndarray, cfg: DecoderConfig) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (weights and biases)."""
    if re.fullmatch(r"model\.layers\.\d+\.self_attn\.q_proj\.(weight|bias)", name):
        return unpermute_rotary(arr, cfg.attention.num_heads)
    if re.fullmatch(r"model\.layers\.\d+\.self_attn\.k_proj\.(weight|bias)", name):
        return unpermute_rotary(arr, cfg.attention.num_kv_heads)
    return arr


FAMILY = register(Family(
    name="llama", model_cls=LlamaForCausalLM, config_cls=DecoderConfig,
    config_from_hf=config_from_hf, rules=decoder_rules,
    hf_architectures=("LlamaForCausalLM",), ignore=ignore,
    gguf_architectures=("llama",), gguf_config=_llama_gguf_config, gguf_to_hf=gguf_to_hf,
    gguf_fixup=unpermute_qk,
))
