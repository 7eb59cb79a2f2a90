"""Model building blocks: norms, rotary embeddings, linear / MLP, MoE, attention layer."""

from models.layers.attention import (
    QKV,
    Attend,
    AttendSpec,
    Attention,
    AttentionConfig,
    DenseAttend,
)
from models.layers.linear import Embed, GatedMLP, Linear, activation
from models.layers.moe import (
    MoE,
    SoftmaxTopKRouter,
    SwiGLUExperts,
    moe_dense,
    moe_sorted,
    topk_softmax,
)
from models.layers.norms import GatedRMSNorm, RMSNorm, gated_rms_norm, rms_norm
from models.layers.rope import RopeConfig, apply_rope, cos_sin, rope_from_hf, rotate, yarn_mscale

__all__ = [
    "QKV",
    "Attend",
    "AttendSpec",
    "Attention",
    "AttentionConfig",
    "DenseAttend",
    "Embed",
    "GatedMLP",
    "GatedRMSNorm",
    "Linear",
    "MoE",
    "RMSNorm",
    "RopeConfig",
    "SoftmaxTopKRouter",
    "SwiGLUExperts",
    "activation",
    "apply_rope",
    "cos_sin",
    "gated_rms_norm",
    "moe_dense",
    "moe_sorted",
    "rms_norm",
    "rope_from_hf",
    "rotate",
    "topk_softmax",
    "yarn_mscale",
]
