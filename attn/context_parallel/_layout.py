"""The sequence layouts shared by the context-parallel ops, and their entry points' plumbing.

The zig-zag layout (the ring and all-gather variants; the GDN ops also run contiguous):

A sequence of `S` tokens, padded at its end to `S_pad`, a multiple of `2 D` (`D` devices on the
mesh axis), is cut into `2 D` chunks of `C = S_pad / (2 D)` tokens. Device `d` holds chunks `d` and
`2 D - 1 - d`, in that order: its local block is `[B, 2 C, ...]`. Under a causal mask each device
then owns the same amount of work (chunk `d` sees `d + 1/2` chunks, chunk `2 D - 1 - d` sees
`2 D - d - 1/2`: `2 D` chunk-pairs in all), where contiguous sharding would leave the last device
`2 D - 1` times the first one's work.

Padding sits at the end of the sequence, so causally no real query sees it; the first chunk of a
device precedes its second, so a device's valid tokens are always a prefix of its block.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

try:  # jax >= 0.7 exports it at the top level; the experimental module is the older home
    from jax import shard_map as _shard_map

    _NO_CHECK = {"check_vma": False}
except ImportError:  # pragma: no cover - depends on the installed jax
    from jax.experimental.shard_map import shard_map as _shard_map

    _NO_CHECK = {"check_rep": False}


def shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` without the replication / varying-axes check: the blocks run custom calls
    (Triton, Mosaic GPU) that carry no such rule, and every output here is sharded."""
    return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_NO_CHECK)


def is_explicit(mesh: Mesh, axis_name: str) -> bool:
    """Whether `axis_name` is an explicit-sharding axis (`jax.make_mesh`'s default): its arrays
    carry their sharding in their type, and only `reshard` moves them."""
    return dict(zip(mesh.axis_names, mesh.axis_types))[axis_name] == AxisType.Explicit


def place(x: jax.Array, mesh: Mesh, spec: P, *, explicit: bool) -> jax.Array:
    """`x` laid out as `spec` over `mesh`: `reshard` on explicit axes, a sharding constraint on
    automatic ones."""
    sharding = NamedSharding(mesh, spec)
    return jax.sharding.reshard(x, sharding) if explicit else lax.with_sharding_constraint(
        x, sharding)


def padded_length(seq_len: int, num_shards: int) -> int:
    """`seq_len` rounded up to a multiple of `2 * num_shards`."""
    unit = 2 * num_shards
    return -(-seq_len // unit) * unit


def to_zigzag(x: jax.Array, num_shards: int, *, axis: int = 1) -> jax.Array:
    """Reorder `x`'s sequence axis (length a multiple of `2 * num_shards`) into the layout.

    Slices, a reversal and a stack (no gather), so the transpose under autodiff is as cheap."""
    axis = axis % x.ndim
    halves = _split(x, (2, num_shards), axis)  # [..., 2, D, C, ...]: chunks d and D + d
    first, second = (lax.index_in_dim(halves, i, axis, keepdims=False) for i in (0, 1))
    pairs = jnp.stack([first, lax.rev(second, (axis,))], axis + 1)  # [..., D, 2, C, ...]
    return pairs.reshape(x.shape)


def from_zigzag(x: jax.Array, num_shards: int, *, axis: int = 1) -> jax.Array:
    """Inverse of `to_zigzag`."""
    axis = axis % x.ndim
    pairs = _split(x, (num_shards, 2), axis)  # [..., D, 2, C, ...]: chunks d and 2D - 1 - d
    first, second = (lax.index_in_dim(pairs, i, axis + 1, keepdims=False) for i in (0, 1))
    return jnp.concatenate([first, lax.rev(second, (axis,))], axis).reshape(x.shape)


def _split(x, leading: tuple[int, int], axis: int):
    """`x` with its `axis` split into `leading + (length / prod(leading),)`."""
    chunk = x.shape[axis] // (leading[0] * leading[1])
    return x.reshape(x.shape[:axis] + leading + (chunk,) + x.shape[axis + 1:])


def chunk_starts(num_shards: int, chunk: int, axis_name: str) -> tuple[jax.Array, jax.Array]:
    """Inside `shard_map`: global positions of this device's two chunks (int32 scalars)."""
    d = lax.axis_index(axis_name)
    return d * chunk, (2 * num_shards - 1 - d) * chunk


def valid_prefix(seq_len: int, lo_start, hi_start, chunk: int):
    """Valid (unpadded) tokens of a block whose chunks start at `lo_start` and `hi_start`: they are
    a prefix of the block (the layout's padding rule)."""
    return (jnp.clip(seq_len - lo_start, 0, chunk) + jnp.clip(seq_len - hi_start, 0, chunk)
            ).astype(jnp.int32)


def check_mesh(mesh, axis_name: str) -> None:
    """A global entry point's `mesh` and `axis_name`.

    Raises:
      TypeError: `mesh` not a `jax.sharding.Mesh`.
      ValueError: `axis_name` not one of its axes.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh={mesh!r} (type {type(mesh).__name__}) must be a jax.sharding.Mesh")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name={axis_name!r} is not an axis of the mesh "
                         f"{tuple(mesh.axis_names)}")


def check_local(local: int, axis_name: str, seq_len, layout: str, *, block: str = "T") -> int:
    """A local entry point's block length `local` (named `block` in the errors), axis and
    `seq_len` (inside `shard_map`); returns `seq_len` as an int (default `D * local`).

    Raises:
      ValueError: an odd block in the zig-zag layout, an `axis_name` no enclosing `shard_map`
        binds, `seq_len` outside `[1, D * local]`.
    """
    if layout == "zigzag" and local % 2:
        raise ValueError(f"local block length {block}={local} must be even (two chunks of the "
                         f"zig-zag layout)")
    try:
        num = lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"axis_name={axis_name!r} is not bound: call inside a shard_map over "
                         f"that axis") from e
    if seq_len is None:
        seq_len = num * local
    if not isinstance(seq_len, numbers.Integral) or not 1 <= seq_len <= num * local:
        raise ValueError(f"seq_len={seq_len!r} must be an int in [1, D * {block} = "
                         f"{num * local}]")
    return int(seq_len)


def run_global(local, seq, rep, *, mesh: Mesh, axis_name: str, layout: str, **options):
    """A global entry point's run: pad `seq`'s arrays (`[B, S, ...]`) at their end, lay them out
    (`"contiguous"` or `"zigzag"`), run `local` under `shard_map` with `rep` replicated, restore
    the order and drop the padding; jitted, keyed by `local` (a module-level function) and the
    hashable `options`.

    `local(*seq_blocks, *rep, axis_name=, layout=, seq_len=, **options)` returns
    `(seq_outs, rep_outs)`: tuples of per-token `[B, T, ...]` blocks and of values the same on
    every device. Entries of `rep` may be None (passed through as None).

    On an explicit axis (`jax.make_mesh`'s default) the reorder runs on a replicated copy and the
    outputs come back replicated: explicit sharding types have no rule for the reorder.
    """
    present = tuple(i for i, a in enumerate(rep) if a is not None)
    return _run_global(local, tuple(seq), tuple(rep[i] for i in present), present=present,
                       num_rep=len(rep), mesh=mesh, axis_name=axis_name, layout=layout,
                       options=tuple(sorted(options.items())))


@functools.partial(jax.jit, static_argnums=0, static_argnames=(
    "present", "num_rep", "mesh", "axis_name", "layout", "options"))
def _run_global(local, seq, rep, *, present, num_rep, mesh, axis_name, layout, options):
    num = mesh.shape[axis_name]
    seq_len = seq[0].shape[1]
    unit = num if layout == "contiguous" else 2 * num
    pad = -(-seq_len // unit) * unit - seq_len
    explicit = is_explicit(mesh, axis_name)
    spec = P(None, axis_name)

    def prepare(x):
        if explicit:  # reorder a replicated copy: explicit types have no rule for the reshape
            x = place(x, mesh, P(), explicit=True)
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        if layout == "zigzag":
            x = to_zigzag(x, num)
        return place(x, mesh, spec, explicit=explicit)

    def restore(x):
        if explicit:
            x = place(x, mesh, P(), explicit=True)
        if layout == "zigzag":
            x = from_zigzag(x, num)
        return x[:, :seq_len]

    def body(*args):
        blocks, given = args[:len(seq)], dict(zip(present, args[len(seq):]))
        return local(*blocks, *(given.get(i) for i in range(num_rep)), axis_name=axis_name,
                     layout=layout, seq_len=seq_len, **dict(options))

    seq_out, rep_out = shard_map(
        body, mesh=mesh, in_specs=(spec,) * len(seq) + (P(),) * len(rep),
        out_specs=(spec, P()))(*(prepare(x) for x in seq), *rep)
    return tuple(restore(x) for x in seq_out), rep_out
