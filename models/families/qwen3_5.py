"""Qwen3.5 family (dense and MoE): the Qwen3-Next hybrid with flat GDN projections.

HF: `Qwen3_5ForCausalLM` / `Qwen3_5MoeForCausalLM` (text configs `qwen3_5_text`,
`qwen3_5_moe_text`) and the vision-language wrappers `Qwen3_5ForConditionalGeneration` /
`Qwen3_5MoeForConditionalGeneration`, which is how Hub checkpoints come: `config.json` nests the
text fields under `text_config`, decoder tensors are named `model.language_model.*`, and
`model.visual.*` (the vision tower) and `mtp.*` ride along; both are ignored here (text only).
The prefix is read from the tensor names when the checkpoint is at hand, else from the nesting.
The wrapper's own `tie_word_embeddings` decides tying, as in HF.

Differences from Qwen3-Next (`qwen3_next.py`, which holds the config, model and name map):
`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a` (flat, not grouped per key head); dense
models have a dense MLP on every layer, MoE models a MoE block on every layer with the top-k
probabilities always renormalised. The text rotary embedding is M-RoPE, which for text-only
positions (equal temporal / height / width rows) is exactly the partial RoPE used here; image and
video inputs are not supported.
"""

from __future__ import annotations

from models.config import ConfigError, HFConfig
from models.convert.registry import Family, register
from models.families.qwen3_next import (
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
    checkpoint_names,
    hybrid_config_from_hf,
    rules,
)
from models.families.qwen3_next import ignore as _next_ignore

_MOE_ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
_VLM_PREFIX = "model.language_model."


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense or MoE) hybrid causal LM, text only (`logits = model(input_ids)`)."""

    family = "qwen3_5"


def config_from_hf(hf: HFConfig) -> Qwen3NextConfig:
    """Qwen3.5 config from a text config or a vision-language wrapper's `text_config`.

    Raises:
      ConfigError: a missing / ill-typed field (`text_config` not an object, ...).
    """
    arch = (hf.get("architectures") or [""])[0]
    text, tie = hf, None
    if "text_config" in hf:
        nested = hf.get("text_config")
        if not isinstance(nested, dict):
            raise ConfigError(f"{hf.source}: field text_config={nested!r} must be an object")
        text = HFConfig(nested, source=f"{hf.source} (text_config)")
        tie = hf.optional("tie_word_embeddings", bool,
                          text.optional("tie_word_embeddings", bool, False))
    names = checkpoint_names(hf)
    if names is not None:
        prefix = _VLM_PREFIX if any(n.startswith(_VLM_PREFIX) for n in names) else "model."
    else:
        prefix = _VLM_PREFIX if "text_config" in hf else "model."
    moe = arch in _MOE_ARCHITECTURES
    return hybrid_config_from_hf(
        text, projection_layout="split", moe_layers="all" if moe else "none", prefix=prefix,
        tie_embeddings=tie, names=names,
        defaults={"intermediate_size": 12288, "num_experts": 256, "num_experts_per_tok": 8})


def ignore(cfg: Qwen3NextConfig) -> tuple[str, ...]:
    """Qwen3-Next's list plus the vision tower of vision-language checkpoints."""
    return _next_ignore(cfg) + (r"model\.visual\..*",)


FAMILY = register(Family(
    name="qwen3_5", model_cls=Qwen3_5ForCausalLM, config_cls=Qwen3NextConfig,
    config_from_hf=config_from_hf, rules=rules,
    hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
                      "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"),
    ignore=ignore,
))
