"""Tiny random Hugging Face checkpoints, built offline in the tests (transformers on torch CPU).

Weights are perturbed away from HF's init (norm weights and biases start at 1 / 0 there), so a
mistake in a norm, a bias or a scale changes the logits by far more than the 1e-4 tolerance.
"""

from __future__ import annotations

import os

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

VOCAB = 256
TOLERANCE = 1e-4  # f32 logits, JAX vs HF eager


def _transformers():
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def hf_classes(kind: str):
    """`(model class, config class)` of a family name."""
    t = _transformers()
    return {"llama": (t.LlamaForCausalLM, t.LlamaConfig),
            "qwen3": (t.Qwen3ForCausalLM, t.Qwen3Config)}[kind]


def base_config(kind: str, **overrides) -> dict:
    """A tiny config dict of `kind` (2 layers, width 64, GQA 4/2)."""
    cfg = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               initializer_range=0.1, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "qwen3":
        cfg["head_dim"] = 16
    cfg.update(overrides)
    return cfg


def perturb(model, seed: int = 0) -> None:
    """Move every 1-D parameter (norm weights, biases) away from its init."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))


def token_ids(batch: int, length: int, seed: int = 1, vocab: int = VOCAB) -> np.ndarray:
    """Random token ids `[batch, length]` int64."""
    return np.random.default_rng(seed).integers(0, vocab, (batch, length))


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    """float32 logits of an HF model."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def save_tiny(kind: str, path: str, *, seed: int = 0, ids: np.ndarray | None = None,
              **overrides):
    """Build, perturb and `save_pretrained` a tiny model; return `(hf_model, ids, logits)`.

    The reference logits come from the model reloaded from disk with eager attention, i.e. from
    exactly the tensors our loader reads.
    """
    import torch

    model_cls, config_cls = hf_classes(kind)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**base_config(kind, **overrides))).eval()
    perturb(model, seed)
    model.save_pretrained(path)
    model = model_cls.from_pretrained(path, attn_implementation="eager").eval()
    ids = token_ids(2, 160) if ids is None else ids
    return model, ids, hf_logits(model, ids)


def permute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (HF rotate-half → GGML interleaved), as its converter."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]) \
        .swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: str, model, *, tied: bool, quant: bool = True,
                     arch: str = "llama") -> None:
    """Write an HF model as llama.cpp would: names, metadata, q/k permutation, Q8_0 / Q4_1.

    Args:
      path: output `.gguf` file.
      model: an HF `LlamaForCausalLM` (arch "llama") or `Qwen3ForCausalLM` (arch "qwen3": no
        q/k permutation, q/k norms, `attention.key_length`).
      tied: leave out `output.weight` (tied embeddings).
      quant: quantise the matrices (embedding Q8_0, others Q4_1; norms stay F32).
    """
    import gguf

    c = model.config
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(path, arch=arch)
    w.add_name("tiny")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "llama":
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    else:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1 if quant else gguf.LlamaFileType.ALL_F32)

    def put(name, arr, qtype):
        if quant and arr.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, arr.astype(np.float32))

    Q = gguf.GGMLQuantizationType
    put("token_embd.weight", sd["model.embed_tokens.weight"], Q.Q8_0)
    put("output_norm.weight", sd["model.norm.weight"], Q.F32)
    if not tied:
        put("output.weight", sd["lm_head.weight"], Q.Q8_0)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    if arch == "qwen3":
        names.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            arr = sd[f"model.layers.{i}.{hf}.weight"]
            if hf == "self_attn.q_proj" and arch == "llama":
                arr = permute_rotary(arr, c.num_attention_heads)
            elif hf == "self_attn.k_proj" and arch == "llama":
                arr = permute_rotary(arr, c.num_key_value_heads)
            put(f"blk.{i}.{gg}.weight", arr, Q.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


_QWEN = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
             layer_types=["linear_attention", "full_attention"],
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=512, linear_conv_kernel_dim=4, linear_key_head_dim=8,
             linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
             initializer_range=0.1, rms_norm_eps=1e-6,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5})
_DEEPSEEK = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                 moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
                 num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                 qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=1, max_position_embeddings=512,
                 initializer_range=0.1, rms_norm_eps=1e-6)
# Hybrid (GDN + gated attention) and MLA families: family -> (HF model class, HF config class,
# config overrides).
HYBRID_HF = {
    # MoE layer 0 (routed + shared expert), dense layer 1.
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        _QWEN, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=16, mlp_only_layers=[1])),
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(_QWEN, intermediate_size=64)),
    # q LoRA, interleaved rope, noaux_tc router over 2 groups.
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        _DEEPSEEK, q_lora_rank=16, n_group=2, topk_group=1, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # q_proj (no LoRA), complex rope, greedy softmax router.
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        _DEEPSEEK, q_lora_rank=None, topk_method="greedy",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def save_hybrid(family: str, path: str) -> None:
    """Build, perturb (norms, biases; realistic GDN decays) and save a tiny hybrid or MLA HF model
    (`HYBRID_HF`), as the engine tests use them."""
    import torch

    t = _transformers()
    model_cls, config_cls, overrides = HYBRID_HF[family]
    torch.manual_seed(0)
    model = getattr(t, model_cls)(getattr(t, config_cls)(**overrides)).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # per-token decay mostly 0.7-0.99: state matters
                p.copy_(torch.empty(p.shape).uniform_(0.05, 1.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-3.0, 0.0, generator=g))
            elif p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)


# Elastic PawQwen3 (block 16 via `testing_small_blocks`, XAttention retrieval heads, streaming
# sparse heads with sink 16 + window 32) and the engine shape its tests share.
PAW_SINK, PAW_LOCAL = 16, 32
PAW_FIELDS = dict(enable_ada_sparsity=True, use_softmax=True, pooling_mode="ctx_q",
              retrieval_mode="xattn", toggle_type="streaming", block_size=16,
              longctx_testing_small_blocks=True, xattn_stride=8, xattn_threshold=0.6,
              sink_size=PAW_SINK, local_window_size=PAW_LOCAL)
# 13 allocatable pages per head: two growing requests do not fit (preemption); one shape for
# every test, so one compiled step per kind and mode.
PAW_ENGINE_SHAPE = dict(batch_slots=2, max_len=96, page_size=8, chunk=64, num_pages=14,
             implementation="xla")


class ByteTokenizer:
    """Bytes as token ids (vocab 256): enough for the synthetic tasks of `experiments.tasks`."""

    eos_token_id = 0

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i).decode(errors="replace")


def tiny_llama(layers: int = 2, seed: int = 0):
    """A random in-memory Llama (vocab 256, width 32, 4 query / 2 KV heads of 8 dims)."""
    from flax import nnx

    from models.families.llama import LlamaForCausalLM
    from models.layers.attention import AttentionConfig
    from models.layers.rope import RopeConfig
    from models.transformer import DecoderConfig

    att = AttentionConfig(dim=32, num_heads=4, num_kv_heads=2, head_dim=8,
                          rope=RopeConfig(rotary_dim=8))
    cfg = DecoderConfig(vocab_size=256, dim=32, num_layers=layers, intermediate_size=64,
                        attention=att)
    return LlamaForCausalLM(cfg, rngs=nnx.Rngs(seed))
