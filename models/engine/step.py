"""The engine's device side: its state, the attend object handed to the model, the jitted step.

Two jitted step functions with static shapes, both over `B` batch slots and the same state
(`EngineKV`): the mixed step (`T = chunk` tokens per slot: a prompt chunk over the row's cached
prefix, or one decode token, rows padded to `T`) and the decode step (`T = 1`). A step allocates
the pages its new tokens need once before the layers (`kv.alloc_batch`), runs
`CausalLM.forward` with a `PagedAttend` (every layer reaches its own state through its adapter,
`models.engine.adapters`), recycles once after them (`kv.recycle`: streaming heads give back the
pages outside sink + window), so 30 layers do not compile 30 allocators, then samples the next
token of every row from its last real position (`models.engine.sampling`).

Windows and sinks are data (`[B, L, K]` int32), so requests with different policies share a
batch and a compilation; nothing is vmapped over rows, which jax-triton's kernels could not be.
The adapters, the custom attend (`Engine(attend=...)`) and the tensor-parallel setting are
static arguments: engines over equal layers share a compilation, and `TRACES` counts how often
each step was traced.

Under a mesh (`models.engine.sharding`) the step is one SPMD program: every layer's attend runs
under `shard_map` on this device's heads, the weights and the state arrive split by head, and
the new state is constrained to the same layout, so the donated buffers are reused in place.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Int

import kv
from models.engine import sharding
from models.engine.adapters import MixerAdapter
from models.engine.sampling import sample

TRACES = collections.Counter()  # ("mixed" | "decode") -> times the step was traced (compiled)


class EngineKV(NamedTuple):
    """The engine's device state.

    Attributes:
      pools: one state per model layer, made by its adapter: a `kv.PagePool` `[K, num_pages, P,
        H]` (attention), a `kv.LatentPool` `[num_pages, P, L + R]` (MLA) or a `kv.SlotPool` (GDN:
        conv `[B + 1, C, W - 1]`, ssm `[B + 1, Nv, H, Hv]` float32; row `r` owns slot `r + 1`).
      tables: `BlockTables` over the paged layers' heads, `[B, Lp * K, max_pages]`: the `p`-th
        paged layer (in model order), head `k` is entry `p * K + k`. One table and one
        allocator for every layer, so the step allocates once before the layers and recycles
        once after them; page ids of a layer index that layer's pool.
      allocator: `PageAllocator` over the same `Lp * K` heads.
    """

    pools: list[Any]
    tables: kv.BlockTables
    allocator: kv.PageAllocator


@dataclasses.dataclass(frozen=True)
class PagedAttend:
    """The attend object of one step: every layer's call goes to its adapter, with this as `ctx`.

    Attention layers call the object itself, MLA layers `mla_attend`, GDN layers `gdn_mix` (the
    layers' protocol, `models.layers`); each dispatches on `spec.layer` to
    `adapters[layer].attend(self, spec, inputs, state)`. The pages the new tokens need are
    allocated before the layers run (`table` already holds them).

    Attributes:
      offsets: `[B]` int32 tokens cached before this step (position of token 0).
      num_new: `[B]` int32 real tokens of this step per row (0 = idle slot).
      table: `[B, Lp * K, max_pages]` int32 block tables of every paged layer (see `EngineKV`).
      window: `[B, L, K]` int32 effective window per row, layer and head (`<= 0` full).
      sinks: `[B, L, K]` int32.
      page_size: `P`.
      adapters: static, one per model layer.
      decode: True for the `T = 1` step.
      implementation: attention backend.
      custom: the engine's custom attend of attention layers (`Engine(attend=...)`), or None.
      tp: the tensor-parallel setting: each layer's attend runs under `shard_map`
        (`sharding.sharded_attend`); None inside that `shard_map` and without a mesh.
      axis: inside the `shard_map`, the mesh axis it splits heads over (`local_heads`).
      table_layers: model indices of the layers whose heads `table` holds (None: every paged
        layer; inside the `shard_map`: the calling layer's heads on this device).
    """

    offsets: Int[Array, "B"]  # noqa: F821
    num_new: Int[Array, "B"]  # noqa: F821
    table: Int[Array, "B LK M"]
    window: Int[Array, "B L K"]
    sinks: Int[Array, "B L K"]
    page_size: int
    adapters: tuple[MixerAdapter, ...]
    decode: bool = False
    implementation: str = "auto"
    custom: Any = None
    tp: sharding.TensorParallel | None = None
    axis: str | None = None
    table_layers: tuple[int, ...] | None = None

    @property
    def paged(self) -> tuple[int, ...]:
        """Model indices of the paged layers (`p`-th entry: table block `p`)."""
        return tuple(i for i, a in enumerate(self.adapters) if a.paged)

    @property
    def num_kv_heads(self) -> int:
        """`K` per paged layer in `table`."""
        layers = self.paged if self.table_layers is None else self.table_layers
        return self.table.shape[1] // max(len(layers), 1)

    def layer_table(self, layer: int, num_kv: int) -> Int[Array, "B K M"]:
        """The block table `[B, K, M]` of one paged layer."""
        layers = self.paged if self.table_layers is None else self.table_layers
        p = layers.index(layer)
        return self.table[:, p * num_kv:(p + 1) * num_kv]

    def local_heads(self, x: Array, dim: int) -> Array:
        """This device's share of `x`'s head axis `dim` inside the tensor-parallel `shard_map`
        (device `i` of `D`: heads `[i n / D, (i + 1) n / D)`); `x` itself elsewhere."""
        if self.axis is None:
            return x
        size = x.shape[dim] // jax.lax.axis_size(self.axis)
        start = jax.lax.axis_index(self.axis) * size
        return jax.lax.dynamic_slice_in_dim(x, start, size, axis=dim)

    def _attend(self, spec, inputs, state):
        adapter = self.adapters[spec.layer]
        if self.tp is not None:
            return sharding.sharded_attend(self, adapter, spec, inputs, state)
        return adapter.attend(self, spec, inputs, state)

    def __call__(self, spec, qkv, state):
        return self._attend(spec, qkv, state)

    def mla_attend(self, spec, proj, state):
        return self._attend(spec, proj, state)

    def gdn_mix(self, spec, inputs, state):
        return self._attend(spec, inputs, state)


def constrain_states(states: EngineKV, adapters, tp: sharding.TensorParallel | None) -> EngineKV:
    """`states` constrained to the engine's layout under `tp` (unchanged without a mesh)."""
    if tp is None:
        return states
    specs = sharding.state_specs(adapters, *states, tp)
    return EngineKV(*sharding.constrain(tuple(states), specs, tp))


def _step(graphdef, params, states, ids, offsets, num_new, window, sinks, seeds, temperature,
          top_k, top_p, *, decode, implementation, adapters, counter, attend=None, tp=None,
          draw=True):
    counter["decode" if decode else "mixed"] += 1  # trace time only: counts compilations
    model = nnx.merge(graphdef, params)
    pools, tables, allocator = states
    batch = window.shape[0]
    lengths = offsets + num_new
    allocator, tables, _ = kv.alloc_batch(allocator, tables, kv.pages_needed(tables, lengths))
    if tp is not None:  # the page bookkeeping stays whole on every device (no partitioning)
        allocator, tables = sharding.constrain(
            (allocator, tables), jax.tree.map(lambda _: sharding.P(), (allocator, tables)), tp)
    positions = offsets[:, None] + jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :]
    attend = PagedAttend(offsets, num_new, tables.table, window, sinks, tables.page_size,
                         adapters, decode=decode, implementation=implementation, custom=attend,
                         tp=tp)
    hidden, pools = model.forward(ids, positions, attend=attend, states=pools)
    paged = attend.paged
    decisions = None  # [B, L, K] int32 decisions of routed layers (mixed step), -1 = none
    if not decode and any(a.routed for a in adapters):
        none = jnp.full((batch, tables.table.shape[1] // len(paged)), -1, jnp.int32)
        decisions = jnp.stack([p[1] if a.routed else none for a, p in zip(adapters, pools)],
                              axis=1)
        pools = [p[0] if a.routed else p for a, p in zip(adapters, pools)]
    # Streaming heads release the pages no later query sees (after every layer's attention).
    index = np.asarray(paged)
    allocator, tables, _ = kv.recycle(allocator, tables, lengths,
                                      window=window[:, index].reshape(batch, -1),
                                      sinks=sinks[:, index].reshape(batch, -1))
    states = constrain_states(EngineKV(pools, tables, allocator), adapters, tp)
    last = jnp.clip(num_new - 1, 0, ids.shape[1] - 1)
    h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)  # [B, 1, D]
    logits = model.logits(h)[:, 0]
    tokens = _sample_rows(logits, seeds, offsets + num_new, temperature, top_k, top_p, tp=tp,
                          draw=draw)
    return tokens, logits.astype(jnp.float32), states, decisions


def _sample_rows(logits, seeds, positions, temperature, top_k, top_p, *, tp, draw):
    """`sample` with the key of each row's next position; under a mesh each device samples its
    `B / D` rows (the sort over `[B, V]` is the step's largest part that does not shrink with
    the heads) and the tokens are gathered whole. Rows are independent: the same tokens."""
    def rows(logits, seeds, positions, temperature, top_k, top_p):
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
        return sample(logits, keys, temperature, top_k, top_p, draw=draw)

    args = (logits, seeds, positions, temperature, top_k, top_p)
    if tp is None or logits.shape[0] % tp.size:
        return rows(*args)
    split = sharding.P(tp.axis)
    # Whole logits into the row split: the split must not reach back into the model (the
    # partitioner would otherwise carry a batch split up through every layer).
    args = (jax.lax.with_sharding_constraint(logits, tp.sharding(sharding.P())),) + args[1:]
    tokens = jax.shard_map(rows, mesh=tp.mesh, in_specs=(sharding.P(tp.axis, None),) + (split,) * 5,
                           out_specs=split, check_vma=False)(*args)
    return jax.lax.with_sharding_constraint(tokens, tp.sharding(sharding.P()))


def _free_rows(states: EngineKV, rows, *, adapters, tp=None) -> EngineKV:
    """Free the pages of the rows in `rows` (`[B]` bool) and reset their slots (GDN: zeros)."""
    allocator, tables, _ = kv.free_batch(states.allocator, states.tables, rows)
    slots = jnp.where(rows, jnp.arange(rows.shape[0], dtype=jnp.int32) + 1, kv.NULL_SLOT)
    pools = [a.reset(p, slots) for a, p in zip(adapters, states.pools)]
    return constrain_states(EngineKV(pools, tables, allocator), adapters, tp)


free_rows = jax.jit(_free_rows, static_argnames=("adapters", "tp"), donate_argnums=0)


class StaticGraph:
    """A model's `nnx.GraphDef` as the step's static argument, hashed once: jit hashes its
    static arguments on every call, and a GraphDef hashes its whole node tree (about 2 ms for a
    28-layer model, host time added to every step). Equal to another holding an equal GraphDef,
    so engines of one model share the compiled steps."""

    __slots__ = ("_hash", "graphdef")

    def __init__(self, graphdef):
        self.graphdef = graphdef
        self._hash = hash(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, StaticGraph) and (
            self.graphdef is other.graphdef or self.graphdef == other.graphdef)


@functools.partial(jax.jit, static_argnums=0,
                   static_argnames=("decode", "implementation", "adapters", "attend", "tp",
                                    "draw"),
                   donate_argnums=2)
def jit_step(graphdef, params, states, *args, decode, implementation, adapters, attend=None,
             tp=None, draw=True):
    """The jitted step (donates `states`): `(tokens [B], logits [B, V] float32, states,
    decisions [B, L, K] int32 or None)`. `draw=False`: every row is greedy (`sample`).
    `graphdef`: an `nnx.GraphDef` or a `StaticGraph` holding one."""
    if isinstance(graphdef, StaticGraph):
        graphdef = graphdef.graphdef
    return _step(graphdef, params, states, *args, decode=decode, implementation=implementation,
                 adapters=adapters, counter=TRACES, attend=attend, tp=tp, draw=draw)


__all__ = ["TRACES", "EngineKV", "PagedAttend", "StaticGraph", "constrain_states", "free_rows",
           "jit_step"]
