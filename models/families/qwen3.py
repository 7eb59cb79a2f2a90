"""Qwen3 dense family: Llama layout plus per-head q/k RMSNorm before RoPE; YaRN; sliding layers.

HF: `Qwen3ForCausalLM` (`self_attn.q_norm.weight`, `self_attn.k_norm.weight` `[H]`; `head_dim`
explicit, default 128; `attention_bias` on q, k, v and o). GGUF: `general.architecture ==
"qwen3"` (llama.cpp keeps Qwen's rotate-half layout, so no q/k un-permutation; head_dim from
`qwen3.attention.key_length`).

PawQwen3 (elastic router) builds on `Qwen3ForCausalLM` by subclassing it.
"""

from __future__ import annotations

from models.config import HFConfig
from models.convert.registry import Family, register
from models.families.llama import decoder_config_from_hf, gguf_config, gguf_to_hf, ignore
from models.transformer import CausalLM, DecoderConfig, decoder_rules


class Qwen3ForCausalLM(CausalLM):
    """Qwen3 dense causal LM (`logits = model(input_ids)`)."""

    family = "qwen3"


def config_from_hf(hf: HFConfig) -> DecoderConfig:
    """Qwen3 config: plain q/k RMSNorm, head_dim default 128, sliding window off by default."""
    return decoder_config_from_hf(hf, qk_norm="plain", head_dim_default=128)


def _qwen3_gguf_config(meta, shapes) -> dict:
    hf = gguf_config(meta, shapes, arch="qwen3", architecture="Qwen3ForCausalLM",
                     rope_dim_is_head_dim=False)
    if "head_dim" not in hf and "hidden_size" in hf and "num_attention_heads" in hf:
        hf["head_dim"] = hf["hidden_size"] // hf["num_attention_heads"]
    return hf


FAMILY = register(Family(
    name="qwen3", model_cls=Qwen3ForCausalLM, config_cls=DecoderConfig,
    config_from_hf=config_from_hf, rules=decoder_rules,
    hf_architectures=("Qwen3ForCausalLM",), ignore=ignore,
    gguf_architectures=("qwen3",), gguf_config=_qwen3_gguf_config, gguf_to_hf=gguf_to_hf,
))
