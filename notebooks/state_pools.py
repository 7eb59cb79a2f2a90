# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # State per request: GDN slot pools and MLA latent pools vs a dense KV cache
#
# A request's decode state in the engine:
#
# * softmax attention layer: pages of `[K, P, H]` keys and `[K, P, Hv]` values, growing with the
#   context (`kv.PagePool`);
# * Gated DeltaNet layer (Qwen3-Next, Qwen3.5): one slot of a `kv.SlotPool`: conv state
#   `[conv_dim, W - 1]` (model dtype) and recurrent state `[Nv, H, Hv]` (float32), whatever the
#   context;
# * MLA layer (DeepSeek-V3 / V2): latent pages of `[P, L + R]` (one latent "head",
#   `kv.LatentPool`), growing with the context.
#
# Below, the byte count of each is read off pools of the real shapes built with `kv` (2 pages or
# 2 slots each, so they fit anywhere) and checked against the engine's own accounting on tiny
# random models, then plotted against the context for Qwen3-Next, Qwen3.5 and DeepSeek-V3 next
# to a dense-KV model of the same size: the same layers, every one a softmax-attention layer
# with a KV cache (the hybrids' own attention shape; for DeepSeek-V3, the multi-head KV that MLA
# compresses: `N` heads of `Dn + R` key and `Hv` value features).
#
# `GPU = False` checks the accounting at 256 tokens in float32 on a CPU (seconds);
# `GPU = True` checks it at 16K tokens in bfloat16.

# %%
# ruff: noqa: E402 (the setting comes first, the imports after it)
GPU = False

CHECK_CONTEXT, CHECK_CHUNK, CHECK_DTYPE = (16384, 2048, "bfloat16") if GPU else \
    (256, 64, "float32")
PAGE = 16

# %%
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import transformers
from flax import nnx

import kv
import models
from models.config import HFConfig
from models.convert import registry


def layer_kinds(cfg) -> list[str]:
    """Per layer "attention", "gdn" or "mla" (our family configs)."""
    if hasattr(cfg, "layer_types") and hasattr(cfg, "gdn"):
        return ["gdn" if t == "linear_attention" else "attention" for t in cfg.layer_types]
    if hasattr(cfg.attention, "kv_lora_rank"):
        return ["mla"] * cfg.num_layers
    return ["attention"] * cfg.num_layers


def request_bytes(cfg, context: int, *, dtype, dense_twin: bool = False) -> dict[str, int]:
    """Bytes of one request's state at `context` tokens, per layer kind, from pools of `cfg`'s
    shapes (page size `PAGE`). `dense_twin`: every layer a softmax-attention layer instead."""
    pages = -(-context // PAGE)
    kinds = layer_kinds(cfg)
    a = cfg.attention
    out = {}
    for kind in sorted(set(kinds)):
        n = kinds.count(kind)
        if dense_twin or kind == "attention":
            if kind == "mla":  # the multi-head KV MLA replaces
                heads, h, hv = a.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim, a.v_head_dim
            else:
                heads, h, hv = a.num_kv_heads, a.head_dim, a.hv
            pool = kv.create_page_pool(num_kv_heads=heads, num_pages=2, page_size=PAGE,
                                       head_dim=h, value_head_dim=hv, dtype=dtype)
            out["attention"] = out.get("attention", 0) + n * pages * heads * kv.page_bytes(pool)
        elif kind == "gdn":
            g = cfg.gdn
            pool = kv.create_slot_pool(num_slots=2, conv_dim=g.conv_dim, conv_width=g.conv_width,
                                       num_v_heads=g.num_v_heads, head_k_dim=g.head_k_dim,
                                       head_v_dim=g.head_v_dim, dtype=dtype)
            out["gdn"] = n * (pool.conv[0].nbytes + pool.ssm[0].nbytes)
        else:
            pool = kv.create_latent_pool(num_pages=2, page_size=PAGE, kv_lora_rank=a.kv_lora_rank,
                                         rope_dim=a.qk_rope_head_dim, dtype=dtype)
            out["mla"] = n * pages * pool.pages[0].nbytes
    return out


# %% [markdown]
# ## The accounting agrees with the engine
#
# Tiny random Qwen3-Next (one GDN and one gated-attention layer, MoE) and DeepSeek-V3 (two MLA
# layers) run one `CHECK_CONTEXT`-token prompt through the engine; once the prompt is prefilled,
# `Engine.kv_usage()` (device page counts and occupied GDN slots) must equal `request_bytes`.

# %%
TINY = {
    "qwen3_next": dict(
        vocab_size=256, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5}),
    "deepseek_v3": dict(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2,
        num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        q_lora_rank=16, n_group=2, topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
for name, hf in TINY.items():
    family = registry.get_family(name)
    cfg = family.config_from_hf(HFConfig(hf, source=f"tiny {name}"))
    model = family.model_cls(cfg, dtype=jnp.dtype(CHECK_DTYPE), rngs=nnx.Rngs(0))
    engine = models.Engine(model, batch_slots=1, max_len=CHECK_CONTEXT + 16, page_size=PAGE,
                           chunk=CHECK_CHUNK)
    prompt = np.random.default_rng(0).integers(1, 256, CHECK_CONTEXT).tolist()
    req = engine.add(models.Request(prompt, models.SamplingParams(max_tokens=2)))
    while not req.output:
        engine.step()
    measured = engine.kv_usage()["total_bytes"]
    counted = sum(request_bytes(cfg, CHECK_CONTEXT, dtype=CHECK_DTYPE).values())
    print(f"{name}: engine {measured} bytes, request_bytes {counted} bytes at {CHECK_CONTEXT} "
          f"tokens ({CHECK_DTYPE})")
    assert measured == counted, (name, measured, counted)

# %% [markdown]
# ## Real shapes
#
# The shapes are transformers' config defaults, converted by our families' `config_from_hf`:
# `Qwen3NextConfig()` (Qwen3-Next-80B-A3B: 48 layers, 36 of them GDN), `Qwen3_5TextConfig()`
# (32 layers, 24 GDN) and `DeepseekV3Config()` (61 MLA layers, 128 heads, `L = 512`,
# `R = 64`), served in bfloat16 (GDN recurrent state float32).

# %%
REAL = {"Qwen3-Next": ("qwen3_next", transformers.Qwen3NextConfig),
        "Qwen3.5": ("qwen3_5", transformers.Qwen3_5TextConfig),
        "DeepSeek-V3": ("deepseek_v3", transformers.DeepseekV3Config)}
configs = {}
for label, (name, hf_cls) in REAL.items():
    hf = HFConfig(hf_cls().to_dict(), source=hf_cls.__name__)
    configs[label] = registry.get_family(name).config_from_hf(hf)
    kinds = layer_kinds(configs[label])
    print(f"{label}: {len(kinds)} layers, " + ", ".join(
        f"{kinds.count(k)} {k}" for k in sorted(set(kinds))))

contexts = 2 ** np.arange(10, 21)  # 1K .. 1M tokens
table = {}
for label, cfg in configs.items():
    table[label] = [sum(request_bytes(cfg, int(s), dtype=jnp.bfloat16).values())
                    for s in contexts]
    table[f"{label}, dense KV"] = [
        sum(request_bytes(cfg, int(s), dtype=jnp.bfloat16, dense_twin=True).values())
        for s in contexts]

print(f"\n{'GiB per request':<24}" + "".join(f"{f'{s // 1024}K':>9}" for s in contexts))
for label, row in table.items():
    print(f"{label:<24}" + "".join(f"{b / 2**30:>9.3f}" for b in row))
for label, cfg in configs.items():
    parts = request_bytes(cfg, 131072, dtype=jnp.bfloat16)
    ratio = table[label][7] / table[f"{label}, dense KV"][7]
    print(f"{label} at 128K: " + ", ".join(f"{k} {v / 2**30:.3f} GiB" for k, v in parts.items())
          + f"; {ratio:.3f} of its dense-KV twin")

# %%
fig, ax = plt.subplots(figsize=(8, 5))
for i, label in enumerate(configs):
    color = f"C{i}"
    ax.loglog(contexts, np.asarray(table[label]) / 2**30, "-o", color=color, ms=3, label=label)
    ax.loglog(contexts, np.asarray(table[f"{label}, dense KV"]) / 2**30, "--", color=color,
              label=f"{label}: same layers, dense KV")
ax.set(xlabel="context (tokens)", ylabel="state per request (GiB)",
       title="GDN slots and MLA latents vs a dense KV cache (bf16 pages, page size 16)")
ax.legend(fontsize=8)
ax.grid(True, which="both", alpha=0.3)
fig.tight_layout()
plt.show()
