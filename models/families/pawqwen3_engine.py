"""PawQwen3's engine adapter: elastic attention in `models.engine` (`Engine(..., elastic=True)`).

Importing this module registers `ElasticAdapter` (kind `"elastic"`, routed) with the engine's
adapter registry; `models.families` imports it, so every PawQwen3 model can run routed.

Design (FastDeploy-style). In the mixed step each elastic layer writes k / v into its pages and
runs dense paged prefill like plain attention (`AttentionAdapter`); for the rows at offset 0 (a
whole prompt in this chunk) it also routes from the chunk's pre-RoPE keys (`ctx_q_pool` over the
`num_new` valid tokens, then the layer's router: `z [B, K]`), turns the decisions into per-head
modes and runs the elastic block-sparse attention over the chunk itself (exactly `ElasticAttend`
with `lengths = num_new`), and takes that output for those rows. Both branches run in every
elastic mixed step. The layer's state comes back as `(pool, z)`, `z` = -1 on rows not routed.

Afterwards (`routed_policy`) heads whose mode is streaming become sink + window heads
(`sink_size`, `local_window_size` of the config, in tokens), so the engine's mirror and
`kv.recycle` give their pages back; full and XAttention heads decode full (dense paged decode;
no sparse decode, as in FastDeploy). The geometry differs between the two: prefill streaming
heads see whole blocks (`sink_blocks`, `local_blocks` of `block_size`), decode sees exactly
`sink_size` + the last `local_window_size` tokens.

Not done here: prompts longer than one chunk, sparse decode for XAttention heads, elastic MLA.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

import kv
from attn.elastic.reference import MODE_CODES
from models.engine.adapters import AttentionAdapter, register_adapter
from models.families.pawqwen3 import ElasticAttend, ElasticAttendSpec, ElasticQKV


@register_adapter
@dataclasses.dataclass(frozen=True)
class ElasticAdapter(AttentionAdapter):
    """Routed attention for layers whose spec is an `ElasticAttendSpec` (see the module
    docstring).

    Attributes:
      retrieval: mode code of z = 1 heads.
      toggle: mode code of z = 0 heads.
      window: `local_window_size` of a streaming head, in tokens.
      sinks: `sink_size` of a streaming head, in tokens.
    """

    kind: ClassVar[str] = "elastic"
    routed: ClassVar[bool] = True

    retrieval: int
    toggle: int
    window: int
    sinks: int

    @classmethod
    def matches(cls, mixer) -> bool:
        return super().matches(mixer) and isinstance(mixer.spec, ElasticAttendSpec)

    @classmethod
    def for_layer(cls, model, mixer) -> ElasticAdapter:
        return cls(retrieval=MODE_CODES[mixer.spec.retrieval_mode],
                   toggle=MODE_CODES[mixer.spec.toggle_type],
                   window=int(model.cfg.local_window_size), sinks=int(model.cfg.sink_size))

    def routed_policy(self, decisions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mode = np.where(decisions == 1, self.retrieval, self.toggle)
        stream = (mode == MODE_CODES["streaming"]) & (decisions >= 0)
        return (np.where(stream, self.window, 0).astype(np.int32),
                np.where(stream, self.sinks, 0).astype(np.int32))

    def attend(self, ctx, spec: ElasticAttendSpec, qkv: ElasticQKV, pool: kv.PagePool):
        dense, pool = super().attend(ctx, spec, qkv, pool)
        if ctx.decode:
            return dense, pool
        routed = (ctx.offsets == 0) & (ctx.num_new > 0)  # [B]
        o, z = ElasticAttend(lengths=ctx.num_new, implementation=ctx.implementation)(spec, qkv)
        o = jnp.where(routed[:, None, None, None], o.astype(dense.dtype), dense)
        return o, (pool, jnp.where(routed[:, None], z, -1).astype(jnp.int32))


__all__ = ["ElasticAdapter"]
