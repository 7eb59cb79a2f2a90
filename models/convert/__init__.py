"""Checkpoint conversion: family registry, tensor sources, name-mapping rules, the loader."""

from models.convert.loader import LoadReport, from_pretrained
from models.convert.mapping import Rule, linear, param, stacked_experts, transpose
from models.convert.registry import (
    Family,
    families,
    family_for_gguf,
    family_for_hf,
    get_family,
    register,
    supported_architectures,
)
from models.convert.sources import CheckpointError, GGUFSource, SafetensorsSource

__all__ = [
    "CheckpointError",
    "Family",
    "GGUFSource",
    "LoadReport",
    "Rule",
    "SafetensorsSource",
    "families",
    "family_for_gguf",
    "family_for_hf",
    "from_pretrained",
    "get_family",
    "linear",
    "param",
    "register",
    "stacked_experts",
    "supported_architectures",
    "transpose",
]
