"""Model families (Flax NNX), layers, HF / GGUF conversion, orbax checkpoints, generation.

    model, tokenizer = models.load_pretrained(path)   # .gguf file, HF dir or orbax checkpoint
    models.generate(model, tokenizer, ["The capital of France is"], max_tokens=16)
    logits = model(input_ids)                         # [B, T] int32 -> [B, T, V], no cache
    models.save(model, ckpt_dir); model = models.load(ckpt_dir, dtype=jnp.bfloat16)

`Engine` (paged KV, continuous batching, chunked prefill), its per-request `Policy` (window and
sinks per layer and KV head) and `SamplingParams` are the token-level interface under
`generate`.
"""

from models.checkpoint import load, save
from models.config import ConfigError
from models.convert import (
    CheckpointError,
    LoadReport,
    from_pretrained,
    supported_architectures,
)
from models.engine import Engine, Policy, Request, SamplingParams
from models.families import LlamaForCausalLM, Qwen3ForCausalLM
from models.generate import generate, load_pretrained, load_tokenizer
from models.transformer import CausalLM, DecoderConfig

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ConfigError",
    "DecoderConfig",
    "Engine",
    "LlamaForCausalLM",
    "LoadReport",
    "Policy",
    "Qwen3ForCausalLM",
    "Request",
    "SamplingParams",
    "from_pretrained",
    "generate",
    "load",
    "load_pretrained",
    "load_tokenizer",
    "save",
    "supported_architectures",
]
