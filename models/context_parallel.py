"""Context parallelism in a model's full forward: the sequence sharded over a mesh axis.

`ContextParallelAttend` is a full-forward attend (`models/layers/attention.py`) whose attention
layers run `attn.context_parallel`'s ring or all-gather attention and whose Gated DeltaNet
layers (its `gdn_mix`, the hook of `models/layers/gdn.py`) run `ring_gdn_mixer` (the halo conv,
then the chunk state passed along the ring). Every other op of a decoder (embedding, norms,
MLPs, MoE routing, the output head) is per token, so nothing else needs to know. Two ways in:

- `model(ids, attend=ContextParallelAttend(mesh=mesh, axis_name="sp"))` (or `model.forward`):
  the attend gets global arrays in sequence order; each layer's op pads, reorders into the
  zig-zag layout, shards and restores (`attn.context_parallel.ring_attention`); GDN layers run
  the contiguous layout, so they need no reorder. XLA places the rest of the model.
- `context_parallel_forward(model, ids, mesh=mesh, axis_name="sp")`: the whole forward inside
  one `shard_map`, activations in the zig-zag layout from embedding to logits (one reorder of
  the token ids and positions in, one of the logits or per-token losses out), every layer on
  its local block (`ring_attention_local`, `ring_gdn_mixer_local(layout="zigzag")`), MoE
  dispatch over the local tokens only. The parameters enter replicated. The training path.

A training step (the sequence of a long document split over the `"sp"` devices)::

    mesh = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))
    graphdef, params = nnx.split(model)

    def loss_fn(params, ids, targets):                       # ids, targets: [B, S] int32
        nll = context_parallel_forward(nnx.merge(graphdef, params), ids, mesh=mesh,
                                       axis_name="sp", targets=targets)   # [B, S] float32
        return jnp.mean(nll)

    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, ids, targets)
    params = optax.apply_updates(params, optimizer.update(grads, opt_state, params)[0])

Gradients flow through the context-parallel ops (their `ppermute`s transpose to the reverse
direction); a replicated parameter's gradient is the sum of the devices' contributions.

Supported: causal self-attention with the layer's `AttendSpec` (scale, window, sinks; GQA from
the shapes, any `N / K`), gated attention (the gate is per token, in `output`), Gated DeltaNet
layers with or without an initial `GDNState`, lengths the device count does not divide (padded at
the end: causally invisible, dropped from the outputs). Not supported, each raising
`NotImplementedError` naming it: a KV-cache `state` for an attention layer (this is the full
forward; the engine has its own attends), an attend spec with more options than `AttendSpec`
(the elastic `ElasticAttendSpec`), MLA layers (no context-parallel MLA op). Packed sequences
are not supported either (the ring ops take no segment ids; `model(ids, segment_ids=...,
attend=...)` is refused by the model itself).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int

from attn import context_parallel as cp
from attn._op import IMPLEMENTATIONS
from attn.context_parallel import _layout
from models.layers.attention import QKV, AttendSpec
from models.layers.gdn import GDNInputs, GDNSpec, GDNState

VARIANTS = ("ring", "allgather")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ContextParallelAttend:
    """Full-forward attend with the sequence sharded over `mesh`'s axis `axis_name`.

    Hashable (a static argument of `model(ids, attend=...)`'s jitted forward). Attention layers
    call `__call__`, GDN layers `gdn_mix`, MLA layers `mla_attend` (which refuses).

    Args:
      mesh: the device mesh (other axes replicate the sequence).
      axis_name: the mesh axis the sequence is split over.
      variant: `"ring"` (K / V blocks passed around with `ppermute`) or `"allgather"` (the whole
        K / V gathered on every device) for the attention layers; GDN layers always pass their
        state along the ring.
      seq_len: None: the layers see global `[B, T, ...]` arrays in sequence order (each op lays
        them out itself). An int: the layers see this device's zig-zag block inside a
        `shard_map` over `axis_name` (as `context_parallel_forward` runs them) and `seq_len` is
        the real sequence length (positions at or past it are padding).
      implementation: each block's attention / conv / delta-rule backend (`"auto"`: a GPU
        kernel on a GPU, XLA on a CPU).

    Raises:
      TypeError: `mesh` not a `jax.sharding.Mesh`.
      ValueError: an axis name not in the mesh, an unknown variant or implementation, a
        `seq_len` below 1.
    """

    mesh: Mesh
    axis_name: str
    variant: str = "ring"
    seq_len: int | None = None
    implementation: str = "auto"

    def __post_init__(self):
        _layout.check_mesh(self.mesh, self.axis_name)
        if self.variant not in VARIANTS:
            raise ValueError(f"variant={self.variant!r} must be one of {VARIANTS}")
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"implementation={self.implementation!r} must be one of "
                             f"{IMPLEMENTATIONS}")
        if self.seq_len is not None and not (isinstance(self.seq_len, int)
                                             and self.seq_len >= 1):
            raise ValueError(f"seq_len={self.seq_len!r} must be None or an int >= 1")

    def __call__(self, spec: AttendSpec, qkv: QKV, state: Any = None
                 ) -> tuple[Float[Array, "B T N Hv"], None]:
        """Causal attention of the layer's q, k, v (global or this device's block).

        Raises:
          NotImplementedError: a `state` (a KV cache), or a spec with options beyond
            `AttendSpec`'s scale / window / sinks.
        """
        _check_spec(spec)
        if state is not None:
            raise NotImplementedError(
                f"layer {spec.layer}: ContextParallelAttend is the full forward without a KV "
                f"cache; got state of type {type(state).__name__}")
        options = dict(causal=True, scale=spec.scale, window=spec.window, sinks=spec.sinks,
                       implementation=self.implementation)
        if self.seq_len is None:
            fn = cp.ring_attention if self.variant == "ring" else cp.allgather_attention
            o, _ = fn(qkv.q, qkv.k, qkv.v, mesh=self.mesh, axis_name=self.axis_name, **options)
        else:
            fn = (cp.ring_attention_local if self.variant == "ring"
                  else cp.allgather_attention_local)
            o, _ = fn(qkv.q, qkv.k, qkv.v, axis_name=self.axis_name, seq_len=self.seq_len,
                      **options)
        return o, None

    def gdn_mix(self, spec: GDNSpec, inputs: GDNInputs, state: GDNState | None = None
                ) -> tuple[Float[Array, "B T Nv Hv"], GDNState]:
        """A GDN layer's conv + delta rule over the sharded sequence (`ring_gdn_mixer`), from
        `state` (None: zeros); returns the output and the state after the whole sequence, as
        `models.layers.gdn.gdn_mix`."""
        common = dict(num_k_heads=spec.num_k_heads, head_k_dim=spec.head_k_dim,
                      conv_state=None if state is None else state.conv,
                      ssm_state=None if state is None else state.ssm, scale=spec.scale,
                      chunk_size=spec.chunk_size, implementation=self.implementation)
        if self.seq_len is None:
            o, conv, ssm = cp.ring_gdn_mixer(
                inputs.x, inputs.conv_weight, inputs.g, inputs.beta, mesh=self.mesh,
                axis_name=self.axis_name, layout="contiguous", **common)
        else:
            o, conv, ssm = cp.ring_gdn_mixer_local(
                inputs.x, inputs.conv_weight, inputs.g, inputs.beta, axis_name=self.axis_name,
                seq_len=self.seq_len, layout="zigzag", **common)
        return o, GDNState(conv, ssm)

    def mla_attend(self, spec: Any, proj: Any, state: Any = None):
        """MLA layers: refused (no context-parallel MLA op).

        Raises:
          NotImplementedError: always, naming the layer.
        """
        raise NotImplementedError(
            f"layer {spec.layer}: ContextParallelAttend does not support MLA layers (no "
            f"context-parallel multi-head latent attention op)")


def _check_spec(spec: AttendSpec) -> None:
    """`spec` must be a plain `AttendSpec` (scale, window, sinks are honoured)."""
    if type(spec) is AttendSpec:
        return
    base = {f.name for f in dataclasses.fields(AttendSpec)}
    extra = ([f.name for f in dataclasses.fields(spec) if f.name not in base]
             if dataclasses.is_dataclass(spec) else [])
    raise NotImplementedError(
        f"layer {getattr(spec, 'layer', '?')}: ContextParallelAttend honours AttendSpec's "
        f"scale / window / sinks only; {type(spec).__name__} adds {extra or 'unknown options'}")


def context_parallel_forward(
    model: Any,
    input_ids: Int[Array, "B S"],
    positions: Int[Array, "B S"] | None = None,
    *,
    mesh: Mesh,
    axis_name: str,
    variant: str = "ring",
    implementation: str = "auto",
    states: Any = None,
    targets: Int[Array, "B S"] | None = None,
) -> Float[Array, "B S V"] | Float[Array, "B S"]:
    """A causal LM's full forward with the sequence sharded over `mesh`'s axis `axis_name`,
    every layer on its local zig-zag block inside one `shard_map`; differentiable.

    With `targets` the per-token negative log-likelihood is computed on each device's block and
    only `[B, S]` float32 leaves the devices (at long `S` the `[B, S, V]` logits are the largest
    activation of the step); without, the logits come back.

    Args:
      model: a `models.transformer.CausalLM` (any family whose mixers are attention or GDN).
      input_ids: `[B, S]` integer token ids in sequence order.
      positions: `[B, S]` positions (RoPE); default `0..S-1` in every row.
      mesh: the device mesh; the sequence is split over `axis_name`, parameters and the other
        axes replicate.
      axis_name: a name in `mesh.axis_names`.
      variant: the attention layers' `"ring"` or `"allgather"` (`ContextParallelAttend`).
      implementation: each block's backend.
      states: per-layer `GDNState` (or None) the GDN layers start from (None: zeros); attention
        layers take None.
      targets: `[B, S]` integer target ids (each in `[0, V)`) or None.

    Returns:
      `[B, S, V]` logits in the model dtype, or with `targets` `[B, S]` float32
      `-log softmax(logits)[target]`, in sequence order.

    Raises:
      ValueError: `input_ids` not rank 2, positions or targets of another shape, and as
        `ContextParallelAttend`.
      TypeError: non-integer ids, positions or targets; `mesh` not a `jax.sharding.Mesh`.
      NotImplementedError: as `ContextParallelAttend` (raised while tracing the layer).
    """
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must have shape [B, S]; got shape {input_ids.shape}")
    b, s = input_ids.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    positions = jnp.asarray(positions)
    given = {"input_ids": input_ids, "positions": positions}
    if targets is not None:
        given["targets"] = targets = jnp.asarray(targets)
    for name, x in given.items():
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{name}.dtype={x.dtype} must be an integer type")
        if x.shape != input_ids.shape:
            raise ValueError(f"{name}.shape={x.shape} must equal "
                             f"input_ids.shape={input_ids.shape}")
    attend = ContextParallelAttend(mesh=mesh, axis_name=axis_name, variant=variant,
                                   implementation=implementation, seq_len=s)
    num = mesh.shape[axis_name]
    padded = _layout.padded_length(s, num)
    explicit = _layout.is_explicit(mesh, axis_name)
    spec = P(None, axis_name)
    place = lambda x, where: _layout.place(x, mesh, where, explicit=explicit)

    def lay_out(x, extend):
        if explicit:  # explicit sharding types have no rule for the reorder: reorder replicated
            x = place(x, P())
        tail = x[:, -1:] + jnp.arange(1, padded - s + 1, dtype=x.dtype) if extend else (
            jnp.zeros((b, padded - s), x.dtype))
        return place(cp.to_zigzag(jnp.concatenate([x, tail], axis=1), num), spec)

    graphdef, params = nnx.split(model)

    def body(params, states, ids, pos, *tgt):
        local = nnx.merge(graphdef, params)
        hidden, _ = local.forward(ids, pos, attend=attend, states=states)
        logits = local.logits(hidden)
        if not tgt:
            return logits
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))  # [B, T2, V]
        return -jnp.take_along_axis(logp, tgt[0][..., None], -1)[..., 0]

    seq = [lay_out(input_ids.astype(jnp.int32), False), lay_out(positions.astype(jnp.int32), True)]
    if targets is not None:
        seq.append(lay_out(targets.astype(jnp.int32), False))
    # `_layout.shard_map`: the context-parallel ops' `shard_map` without the replication check
    # (their blocks' custom calls carry no rule); a replicated input's cotangent is summed.
    out = _layout.shard_map(body, mesh=mesh, in_specs=(P(), P()) + (spec,) * len(seq),
                            out_specs=spec)(params, states, *seq)
    if explicit:
        out = place(out, P())
    return cp.from_zigzag(out, num)[:, :s]
