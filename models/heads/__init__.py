"""Head selection: score heads, train gates and routers, turn them into per-head policies.

    scores = score_heads(model, batches, window=512, sinks=64)      # no training
    mask = streaming_mask(scores.combined(), 0.5)                    # [L, K] bool
    policy = Policy.headwise(L, K, window=512, sinks=64, streaming=mask)

    gated = GatedLM(model, window=512, sinks=64)                     # DuoAttention gates
    opt = make_optimizer(gated)
    for batch in batches: train_step(gated, opt, batch, l1=0.05)
    mask = binarize(gated.alpha[...], 0.5)

`models.heads.router` trains Elastic-Attention routers the same way (straight-through relaxed
decisions, a Lagrangian sparsity target); `models.heads.elastic.elastic_from` gives any Llama /
Qwen3 backbone those routers (a PawQwen3 model). `experiments.train_heads` runs all of it.
"""

from models.heads.data import Batch, batch_from_samples
from models.heads.gates import Gate, GatedLM, binarize, distill_loss, make_optimizer, train_step
from models.heads.mix import MixedAttend, ProbeAttend, full_and_streaming, static_gates
from models.heads.scoring import (
    SCORE_METHODS,
    HeadScores,
    attention_layers,
    score_heads,
    streaming_mask,
)
from models.heads.selection import SOURCES, HeadSelection

__all__ = [
    "SCORE_METHODS",
    "SOURCES",
    "Batch",
    "Gate",
    "GatedLM",
    "HeadScores",
    "HeadSelection",
    "MixedAttend",
    "ProbeAttend",
    "attention_layers",
    "batch_from_samples",
    "binarize",
    "distill_loss",
    "full_and_streaming",
    "make_optimizer",
    "score_heads",
    "static_gates",
    "streaming_mask",
    "train_step",
]
