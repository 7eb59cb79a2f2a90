"""Model families (Flax NNX), layers, HF / GGUF conversion and orbax checkpoints.

    model = models.from_pretrained(path, dtype=jnp.float32)   # HF dir or .gguf file
    logits = model(input_ids)                                  # [B, T] int32 -> [B, T, V]
    models.save(model, ckpt_dir); model = models.load(ckpt_dir)
"""

from models.checkpoint import load, save
from models.config import ConfigError
from models.convert import (
    CheckpointError,
    LoadReport,
    from_pretrained,
    supported_architectures,
)
from models.families import LlamaForCausalLM, Qwen3ForCausalLM
from models.transformer import CausalLM, DecoderConfig

__all__ = [
    "CausalLM",
    "CheckpointError",
    "ConfigError",
    "DecoderConfig",
    "LlamaForCausalLM",
    "LoadReport",
    "Qwen3ForCausalLM",
    "from_pretrained",
    "load",
    "save",
    "supported_architectures",
]
