"""Model families; importing this package registers each with `models.convert.registry`."""

from models.families.llama import LlamaForCausalLM
from models.families.qwen3 import Qwen3ForCausalLM

__all__ = ["LlamaForCausalLM", "Qwen3ForCausalLM"]
