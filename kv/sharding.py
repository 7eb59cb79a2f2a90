"""How KV state shards over devices: by KV head, through a `PartitionSpec` on the head axis.

Head-major pools make KV heads independent: head `k`'s pages, its free stack and its block-table
rows are touched only by head `k`'s attention, so splitting the head axis over a mesh axis (tensor
parallelism over KV heads) needs no communication in the write, the read or the allocator, except
the all-or-nothing `ok` flag, which XLA reduces across shards inside `jit`.

- `PagePool`: `k`, `v` `[K, num_pages, P, H]` -> `P(axis, None, None, None)`; FP8 `k_scale`,
  `v_scale` `[K, num_pages, C]` -> `P(axis, None, None)`.
- `PageAllocator`: `free_stack`, `owned` `[K, num_pages]` -> `P(axis, None)`; `free_count` `[K]`
  -> `P(axis)`.
- `BlockTables`: `table` `[B, K, max_pages]` -> `P(None, axis, None)`; `extent`, `cursor` `[B, K]`
  -> `P(None, axis)`.
- `SlotPool`: `ssm` `[slots, Nv, H, Hv]` -> `P(None, axis, None, None)` (by value head); `conv`
  `[slots, conv_dim, W-1]` replicated (its q ‖ k ‖ v channels would need a per-segment split).
- `SlotAllocator`, `LatentPool`: replicated (no head axis; MLA has a single latent head).

The head count must be divisible by the mesh axis size (`shard` checks). Fewer KV heads than devices
(replicated KV heads, `K < tp`) is not supported yet.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as PS

from kv.allocator import PageAllocator
from kv.mla import LatentPool
from kv.pages import BlockTables, PagePool
from kv.slots import SlotAllocator, SlotPool

_STATE_TYPES = (PagePool, BlockTables, PageAllocator, SlotPool, SlotAllocator, LatentPool)


def _is_state(x) -> bool:
    return isinstance(x, _STATE_TYPES)


def _spec(x, axis: str):
    if isinstance(x, PagePool):
        pages, scales = PS(axis, None, None, None), PS(axis, None, None)
        return x.replace(k=pages, v=pages, k_scale=None if x.k_scale is None else scales,
                         v_scale=None if x.v_scale is None else scales)
    if isinstance(x, PageAllocator):
        return x.replace(free_stack=PS(axis, None), free_count=PS(axis), owned=PS(axis, None))
    if isinstance(x, BlockTables):
        return x.replace(table=PS(None, axis, None), extent=PS(None, axis),
                         cursor=PS(None, axis))
    if isinstance(x, SlotPool):
        return x.replace(conv=PS(), ssm=PS(None, axis, None, None))
    if isinstance(x, SlotAllocator | LatentPool):
        return jax.tree.map(lambda _: PS(), x)
    raise TypeError(f"no KV sharding rule for {type(x).__name__}")


def partition_specs(state, axis: str = "kv"):
    """The `PartitionSpec` pytree for `state` (one of the kv/ pytrees, or any pytree of them).

    Args:
      state: a `PagePool`, `BlockTables`, `PageAllocator`, `SlotPool`, `SlotAllocator`,
        `LatentPool`, or a container of them (list per layer, dict, tuple).
      axis: the mesh axis the KV heads are split over.

    Returns:
      A pytree of the same structure with a `PartitionSpec` at every array leaf.

    Raises:
      TypeError: a leaf outside the kv/ state types.
    """
    return jax.tree.map(lambda x: _spec(x, axis), state, is_leaf=_is_state)


def _head_count(x) -> int | None:
    if isinstance(x, PagePool | PageAllocator):
        return x.num_kv_heads
    if isinstance(x, BlockTables):
        return x.num_kv_heads
    if isinstance(x, SlotPool):
        return x.ssm.shape[1]
    return None


def shard(state, mesh: Mesh, axis: str = "kv"):
    """Place `state` on `mesh`, KV heads split over mesh axis `axis` (see the module table).

    Raises:
      ValueError: `axis` is not a mesh axis, or a head count is not divisible by its size.
      TypeError: a leaf outside the kv/ state types.
    """
    if axis not in mesh.shape:
        raise ValueError(f"{axis=} is not an axis of the mesh {dict(mesh.shape)}")
    size = mesh.shape[axis]
    for x in jax.tree.leaves(state, is_leaf=_is_state):
        heads = _head_count(x)
        if heads is not None and heads % size:
            raise ValueError(f"{type(x).__name__} has {heads} heads, not divisible by the mesh "
                             f"axis {axis!r} of size {size}")
    specs = partition_specs(state, axis)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                             is_leaf=lambda s: isinstance(s, PS))
    return jax.device_put(state, shardings)
