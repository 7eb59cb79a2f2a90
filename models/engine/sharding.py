"""Tensor parallelism of the engine: the step under one mesh, layers and their state split by head.

`Engine(model, mesh=mesh)` (mesh axis `"tp"` by default) runs the same jitted step over every
device of the axis. What splits, and how:

* Weights (`shard_weights=True`), Megatron-style, by parameter name (`param_specs`): the
  projections into heads are split by output column (`q_proj`, `k_proj`, `v_proj`, MLA
  `q_proj` / `q_b_proj` / `kv_b_proj`, GDN `in_proj_z` / `in_proj_b` / `in_proj_a`, MLP
  `gate_proj` / `up_proj`), the projections out of them by
  input row (`o_proj`, `out_proj`, `down_proj`; a MoE's shared expert too), GDN `A_log` /
  `dt_bias` by value head, the routed expert stacks `[E, ...]` (the rank-3 parameters of a
  module named `experts`) by expert; the embedding, the output head, norms, routers, MLA's
  `q_a_proj` / `kv_a_proj`, GDN's `in_proj_qkv` / `in_proj_qkvz` / `in_proj_ba` (the conv
  input is kept whole; Qwen3-Next's fused ones interleave it with the gates) stay whole on
  every device. A dimension the axis size does not divide stays whole. XLA's SPMD partitioner
  places the rest (the all-reduce after each row-split projection) from these shardings.
* Every layer's mixer core runs under `shard_map` on this device's heads (`sharded_attend`), as
  its adapter's `tp_specs` says: attention over its KV heads' pages, MLA's query heads over the
  whole latent cache, GDN's delta rule over its value heads (the conv on every device). Custom
  kernels (Triton, Mosaic GPU) inside need no partitioning rule this way.
* Routed MoE (`models.layers.moe.MoE`, Qwen3-Next / Qwen3.5 / DeepSeek-V3 / V2), with split
  weights: expert parallelism. The engine steps a copy of the model whose MoE blocks carry an
  `ExpertParallel` (`expert_parallel`): the routed part runs under `shard_map`, every device
  routes all tokens with the whole router, dispatches only the choices of its `E / D` experts
  on its stacks, and one float32 `psum` outside the dispatch adds the partial outputs. The
  partitioner never sees a split stack: it would put collectives inside the dispatch's
  data-dependent per-tile `lax.cond`, which devices may reach in different orders (a
  deadlock). Shared experts split as dense MLPs do.
* State: attention page pools split by KV head, GDN ssm slots by value head (`kv.sharding`); MLA
  latent pools, GDN conv slots, the block tables and the page allocator are whole on every
  device (every device runs the same allocation on the same tables).

`shard_weights=False` keeps every weight whole on every device (routed experts included, the MoE
then runs as on one device) and gathers the heads' outputs after each mixer: only the KV state
and the attention over it split. It needs the whole model on every device, and each device does
every matmul; in exchange every matmul has the one-device shapes and operands (the
split-reduction order of a row-split projection is gone).

Head counts must divide the axis size (`check_heads`), and with split weights so must every MoE
layer's expert count (`check_experts`); a ValueError names the layer and the count. Not done
here: fewer KV heads than devices (replicated KV heads), experts on another mesh axis than the
heads (expert parallelism shares the tensor-parallel axis), token dispatch by all-to-all (every
device routes every token), a mesh with routed (elastic) layers, pipeline parallelism.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.layers.moe import ExpertParallel, MoE

# Output-column split (into heads) and input-row split (out of heads) projections, by name.
COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj",
                    "up_proj", "in_proj_z", "in_proj_b", "in_proj_a"})
ROW = frozenset({"o_proj", "down_proj", "out_proj"})
PER_V_HEAD = frozenset({"A_log", "dt_bias"})
EXPERTS = "experts"  # a module of this name holds routed expert stacks [E, ...] (rank 3)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The engine's tensor-parallel setting (hashable: a static argument of the jitted step).

    Attributes:
      mesh: the devices; its axes other than `axis` hold copies. Explicit axes are used as
        automatic ones (the partitioner places what the step does not).
      axis: the mesh axis heads are split over.
      shard_weights: split the weights too (see the module docstring).
    """

    mesh: Mesh
    axis: str = "tp"
    shard_weights: bool = True

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"mesh={self.mesh!r} (type {type(self.mesh).__name__}) must be a "
                            f"jax.sharding.Mesh")
        if self.axis not in self.mesh.axis_names:
            raise ValueError(f"mesh_axis={self.axis!r} is not an axis of the mesh "
                             f"{dict(self.mesh.shape)}")
        names = self.mesh.axis_names
        if any(t != AxisType.Auto for t in self.mesh.axis_types):
            object.__setattr__(self, "mesh", Mesh(self.mesh.devices, names,
                                                  axis_types=(AxisType.Auto,) * len(names)))

    @property
    def size(self) -> int:
        """Devices along `axis`."""
        return self.mesh.shape[self.axis]

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


def check_heads(adapters, mixers, tp: TensorParallel) -> None:
    """Every layer can split by head over `tp.axis`.

    Raises:
      ValueError: a layer without a tensor-parallel layout, or a head count the axis size does
        not divide (naming the layer, the count and the size).
    """
    for i, (adapter, mixer) in enumerate(zip(adapters, mixers)):
        heads = adapter.tp_heads(mixer)
        if heads is None:
            raise ValueError(f"layer {i} ({adapter.kind}, {type(adapter).__name__}) has no "
                             f"tensor-parallel layout; the engine cannot run it on a mesh")
        for name, count in heads.items():
            if count % tp.size:
                raise ValueError(
                    f"layer {i} ({adapter.kind}): {name}={count} is not divisible by the mesh "
                    f"axis {tp.axis!r} of size {tp.size}; tensor parallelism splits heads "
                    f"evenly (use a mesh axis size that divides {count})")


def moe_layers(model) -> dict[int, MoE]:
    """The model layers whose MLP is a routed `MoE`, by layer index."""
    return {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)}


def _num_experts(moe: MoE) -> int:
    return jax.tree.leaves(nnx.state(moe.experts))[0].shape[0]


def check_experts(model, tp: TensorParallel) -> None:
    """Every MoE layer's routed experts split evenly over `tp.axis` (with split weights).

    Raises:
      ValueError: an expert count the axis size does not divide (naming the layer, the count
        and the size).
    """
    if not tp.shard_weights:
        return
    for i, moe in moe_layers(model).items():
        num = _num_experts(moe)
        if num % tp.size:
            raise ValueError(
                f"layer {i} (moe): num_experts={num} is not divisible by the mesh axis "
                f"{tp.axis!r} of size {tp.size}; expert parallelism splits the routed experts "
                f"evenly (use a mesh axis size that divides {num}, or shard_weights=False)")


def expert_parallel(model, tp: TensorParallel):
    """The model the engine steps: with split weights and MoE layers, a copy (sharing the
    weights) whose MoE blocks run their routed part split by expert (`MoE.expert_parallel`);
    else `model` itself. The caller's model is left as it is."""
    if not tp.shard_weights or not moe_layers(model):
        return model
    copy = nnx.merge(*nnx.split(model))
    for moe in moe_layers(copy).values():
        moe.expert_parallel = ExpertParallel(tp.mesh, tp.axis)
    return copy


def _names(path) -> list:
    return [getattr(k, "key", getattr(k, "name", getattr(k, "idx", None))) for k in path]


def param_spec(path, shape: tuple[int, ...], tp: TensorParallel) -> P:
    """The `PartitionSpec` of one parameter (module docstring); whole if not divisible."""
    names = [n for n in _names(path) if n != "value"]
    last, parent = names[-1], names[-2] if len(names) > 1 else None
    dim = None
    if last == "kernel" and len(shape) == 2:
        dim = 1 if parent in COLUMN else 0 if parent in ROW else None
    elif last == "bias" and len(shape) == 1 and parent in COLUMN:
        dim = 0
    elif len(shape) == 1 and last in PER_V_HEAD:
        dim = 0
    elif len(shape) == 3 and parent == EXPERTS:  # a routed expert stack: by expert
        dim = 0
    if dim is None or shape[dim] % tp.size:
        return P()
    return P(*(tp.axis if i == dim else None for i in range(len(shape))))


def param_specs(params, tp: TensorParallel):
    """`PartitionSpec` pytree of a model's `nnx.split` state (whole everywhere unless
    `tp.shard_weights`)."""
    if not tp.shard_weights:
        return jax.tree.map(lambda _: P(), params)
    return jax.tree_util.tree_map_with_path(lambda p, x: param_spec(p, np.shape(x), tp), params)


def state_specs(adapters, pools, tables, allocator, tp: TensorParallel):
    """`(pool specs per layer, table specs, allocator specs)`: pools by their adapters'
    `tp_state_spec`, tables and allocator whole."""
    whole = lambda x: jax.tree.map(lambda _: P(), x)
    return ([a.tp_state_spec(p, tp.axis) for a, p in zip(adapters, pools)], whole(tables),
            whole(allocator))


def place(tree, specs, tp: TensorParallel):
    """`jax.device_put` of `tree` with `NamedSharding(tp.mesh, spec)` per leaf."""
    return jax.device_put(tree, _shardings(specs, tp))


def constrain(tree, specs, tp: TensorParallel):
    """`with_sharding_constraint` of `tree` to `specs` (inside the jitted step)."""
    return jax.lax.with_sharding_constraint(tree, _shardings(specs, tp))


def _shardings(specs, tp):
    return jax.tree.map(tp.sharding, specs, is_leaf=lambda s: isinstance(s, P))


def sharded_attend(ctx, adapter, spec, inputs, state) -> tuple[Any, Any]:
    """`adapter.attend` of one layer under `shard_map` over `ctx.tp.axis`, on this device's heads.

    The body gets a `ctx` holding this layer's block-table rows, windows and sinks: of this
    device's KV heads (`tp_specs(...).kv_heads`) or all of them, with `tp = None` and `axis`
    set (so `ctx.local_heads` slices by the device's index); the output comes back split by
    head (gathered whole if the weights are not split).
    """
    tp = ctx.tp
    axis = tp.axis
    specs = adapter.tp_specs(spec, inputs, axis)
    state_spec = adapter.tp_state_spec(state, axis)
    num_kv = ctx.num_kv_heads

    # The block tables, windows and sinks enter whole (as every device holds them) and each
    # device takes its heads' rows inside: a head-split entry spec would let the partitioner
    # split the page bookkeeping upstream and move table slices between devices. With whole
    # weights the inputs enter whole too: a head-split entry would let the partitioner compute
    # only this device's columns of the projections into heads, a matmul of another shape than
    # one device's (and another rounding).
    input_specs = specs.inputs if tp.shard_weights else jax.tree.map(
        lambda _: P(), specs.inputs, is_leaf=lambda s: isinstance(s, P))

    def body(offsets, num_new, table, window, sinks, inputs, state):
        local = dataclasses.replace(ctx, offsets=offsets, num_new=num_new, table=table,
                                    window=window, sinks=sinks, tp=None, axis=axis)
        if not tp.shard_weights:
            inputs = jax.tree.map(lambda s, x: local.local_heads(x, list(s).index(axis))
                                  if axis in list(s) else x, specs.inputs, inputs,
                                  is_leaf=lambda s: isinstance(s, P))
        if adapter.paged:
            table = local.layer_table(spec.layer, num_kv)  # [B, K, M]
            local = dataclasses.replace(local, table=table, table_layers=(spec.layer,))
        if specs.kv_heads:
            local = dataclasses.replace(local, table=local.local_heads(local.table, 1),
                                        window=local.local_heads(window, 2),
                                        sinks=local.local_heads(sinks, 2))
        return adapter.attend(local, spec, inputs, state)

    o, state = jax.shard_map(
        body, mesh=tp.mesh, in_specs=(P(), P(), P(), P(), P(), input_specs, state_spec),
        out_specs=(specs.out, state_spec), check_vma=False,
    )(ctx.offsets, ctx.num_new, ctx.table, ctx.window, ctx.sinks, inputs, state)
    if not tp.shard_weights:
        o = jax.lax.with_sharding_constraint(o, tp.sharding(P()))
    return o, state


__all__ = ["TensorParallel", "check_experts", "check_heads", "expert_parallel", "moe_layers",
           "param_spec", "param_specs", "place", "sharded_attend", "state_specs"]
