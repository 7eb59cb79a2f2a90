"""Any Llama / Qwen3 backbone as an elastic-attention (PawQwen3) model, for router training.

Elastic Attention's router is a small MLP per layer over pooled pre-RoPE keys
(`attn.elastic.AttentionRouter`); PawQwen3 is Qwen3 with one per layer. `elastic_from(model)`
builds the PawQwen3 model of the same backbone — every backbone weight shared by value, a fresh
router per layer — so the router of any dense checkpoint (SmolLM2 here) can be trained with
`models.heads.router` and served by the engine's elastic path (`Engine(..., elastic=True)`):
sparse heads (z = 0) run sink + window at prefill, retrieval heads full attention; decode stays
dense, as in Elastic Attention.

Streaming at prefill runs on Block-Sparse-Attention's 128-token tile grid, so the sink and the
window are rounded up to whole blocks there (`PawQwen3Config.sink_blocks`, `local_blocks`); the
training relaxation (`models.heads.mix.MixedAttend`) uses the token values.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from models.families.pawqwen3 import PawQwen3Config, PawQwen3ForCausalLM
from models.transformer import CausalLM, DecoderConfig


def elastic_from(model: CausalLM, *, window: int, sinks: int, toggle_type: str = "streaming",
                 seed: int = 0) -> PawQwen3ForCausalLM:
    """A PawQwen3 model with `model`'s weights and freshly initialised routers.

    Args:
      model: a dense decoder (`DecoderConfig`: Llama, Qwen3) with no sliding layers.
      window: `local_window_size` of sparse heads (tokens).
      sinks: `sink_size` of sparse heads (tokens).
      toggle_type: mode of sparse heads: `"streaming"` or `"xattn"`.
      seed: router initialisation.

    Returns:
      `PawQwen3ForCausalLM` with `enable_ada_sparsity=True`, `pooling_mode="ctx_q"`, the softmax
      router, in the backbone's dtype. The backbone weights are the same arrays as `model`'s.

    Raises:
      TypeError: `model.cfg` is not a plain `DecoderConfig`.
      ConfigError: sliding-window layers, or an invalid window / sinks / toggle type.
    """
    if type(model.cfg) is not DecoderConfig:
        raise TypeError(f"elastic_from needs a dense decoder (DecoderConfig); got "
                        f"{type(model.cfg).__name__}")
    fields = {f.name: getattr(model.cfg, f.name) for f in dataclasses.fields(DecoderConfig)}
    cfg = PawQwen3Config(**fields, local_window_size=window, sink_size=sinks,
                         toggle_type=toggle_type, retrieval_mode="full",
                         enable_ada_sparsity=True, pooling_mode="ctx_q", use_softmax=True)
    elastic = PawQwen3ForCausalLM(cfg, dtype=model.dtype, rngs=nnx.Rngs(seed))
    # Routers start in float32 whatever the backbone dtype: they are what trains.
    for layer in elastic.layers:
        for _, var in nnx.iter_graph(layer.mixer.router):
            if isinstance(var, nnx.Param):
                var[...] = var[...].astype(jnp.float32)
    nnx.update(elastic, nnx.state(model))
    return elastic

