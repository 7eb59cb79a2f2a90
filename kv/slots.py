"""GDN recurrent-state slot pools (conv + ssm) and their slot allocator.

Layout (conventions): `conv: [slots, conv_dim, W - 1]` (model dtype), `ssm: [slots, Nv, H, Hv]`
float32 (K-first). A request owns one slot id from admission to finish, the same id in every GDN
layer's pool (one `SlotAllocator` serves all layers). Slot 0 is null and reserved: it is never
handed out, padding rows use slot id 0 (not -1, so no sentinel rewrite is needed; seed 003 #1), a
read of slot 0 returns zeros and a write to it is dropped. Any other id outside `[1, slots)` is
treated like 0.

`alloc_slots` zeroes the fresh slots in every pool it is given, so a request never starts from its
predecessor's state (seed 003 #7); stale contents of free slots, NaN included, never reach a read
because `read_slots` selects (not multiplies) zeros for slot 0.

Sharding: `ssm` shards by value head (axis 1). `conv` is replicated: its channel axis is the
concatenation q ‖ k ‖ v and must be split per segment, which needs a segment-major layout (later).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from kv import _validate as v_
from kv.allocator import exclusive_prefix_sum

NULL_SLOT = 0


@struct.dataclass
class SlotPool:
    """One GDN layer's per-request states.

    Attributes:
      conv: `[slots, conv_dim, W - 1]` causal-conv tail (the last `W - 1` inputs).
      ssm: `[slots, Nv, H, Hv]` float32 recurrent state.
    """

    conv: Float[Array, "slots conv_dim Wm1"]
    ssm: Float[Array, "slots Nv H Hv"]

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]


@struct.dataclass
class SlotAllocator:
    """Free stack of slot ids `1 .. slots - 1` plus an ownership mask.

    Attributes:
      free_stack: `[slots]` int32; `free_stack[:free_count]` are free ids, top last.
      free_count: `[]` int32.
      owned: `[slots]` bool, slot handed out (`owned[0]` is False).
    """

    free_stack: Int[Array, "slots"]  # noqa: F821
    free_count: Int[Array, ""]
    owned: Bool[Array, "slots"]  # noqa: F821

    @property
    def num_slots(self) -> int:
        return self.free_stack.shape[0]


def create_slot_pool(
    *,
    num_slots: int,
    conv_dim: int,
    conv_width: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    dtype=jnp.bfloat16,
) -> SlotPool:
    """A zero-filled slot pool; `num_slots` counts the null slot 0 (so `max_seqs + 1`).

    Args:
      num_slots: slots including the null slot; at least 2.
      conv_dim: conv channels (`2 * Nk * H + Nv * Hv` for GDN).
      conv_width: `W`, the conv kernel width (the state keeps `W - 1` inputs); at least 2.
      num_v_heads: `Nv`.
      head_k_dim: `H`.
      head_v_dim: `Hv`.
      dtype: conv state dtype (the model dtype); `ssm` is always float32.

    Raises:
      TypeError / ValueError: bad sizes or dtype.
    """
    num_slots = v_.check_positive_int("num_slots", num_slots, minimum=2)
    conv_dim = v_.check_positive_int("conv_dim", conv_dim)
    conv_width = v_.check_positive_int("conv_width", conv_width, minimum=2)
    sizes = [v_.check_positive_int(n, x) for n, x in
             (("num_v_heads", num_v_heads), ("head_k_dim", head_k_dim), ("head_v_dim", head_v_dim))]
    dtype = v_.check_float_dtype("dtype", dtype)
    return SlotPool(conv=jnp.zeros((num_slots, conv_dim, conv_width - 1), dtype),
                    ssm=jnp.zeros((num_slots, *sizes), jnp.float32))


def create_slot_allocator(*, num_slots: int) -> SlotAllocator:
    """Every slot `1 .. num_slots - 1` free; the first pops return 1, 2, 3, ..."""
    num_slots = v_.check_positive_int("num_slots", num_slots, minimum=2)
    stack = jnp.concatenate([jnp.arange(num_slots - 1, 0, -1, dtype=jnp.int32),
                             jnp.zeros((1,), jnp.int32)])
    return SlotAllocator(free_stack=stack, free_count=jnp.int32(num_slots - 1),
                         owned=jnp.zeros((num_slots,), bool))


def _safe_slots(slots, num_slots: int, fill: int):
    ok = (slots >= 1) & (slots < num_slots)
    return jnp.where(ok, slots, fill), ok


def reset_slots(pools, slots: Int[Array, "B"]):  # noqa: F821
    """Zero the given slots in every leaf of `pools` (leaves are `[slots, ...]`); 0 is skipped.

    Args:
      pools: a `SlotPool` or any pytree of them (e.g. a list, one per GDN layer).
      slots: `[B]` int slot ids.
    """
    slots = jnp.asarray(slots)
    v_.check_integer("slots", slots)

    def zero(x):
        idx, _ = _safe_slots(slots.astype(jnp.int32), x.shape[0], x.shape[0])
        return x.at[idx].set(jnp.zeros((), x.dtype), mode="drop")

    return jax.tree.map(zero, pools)


def alloc_slots(
    allocator: SlotAllocator, pools, want: Bool[Array, "B"]  # noqa: F821
) -> tuple[SlotAllocator, object, Int[Array, "B"], Bool[Array, ""]]:  # noqa: F821
    """Hand one fresh, zeroed slot to every batch row with `want[b]`; all-or-nothing.

    Rows are served in order `0 .. B-1`, popping from the top of the stack.

    Args:
      allocator: the slot allocator (shared by all GDN layers).
      pools: the `SlotPool` (or pytree of them) whose new slots are zeroed.
      want: `[B]` bool, rows being admitted.

    Returns:
      `(allocator, pools, slots [B] int32, ok)`: `slots[b]` is the new id, 0 where not wanted.
      If there are fewer free slots than wanted, nothing changes, every slot is 0 and `ok` is
      False.
    """
    v_.check_instance("allocator", allocator, SlotAllocator)
    want = jnp.asarray(want)
    v_.check_bool("want", want)
    v_.check_rank("want", want, 1, "B")
    n = allocator.num_slots
    rank = exclusive_prefix_sum(want)  # pops before this row
    total = jnp.sum(want, dtype=jnp.int32)
    ok = total <= allocator.free_count
    depth = jnp.clip(allocator.free_count - 1 - rank, 0, n - 1)
    slots = jnp.where(want & ok, allocator.free_stack[depth], NULL_SLOT)
    idx, _ = _safe_slots(slots, n, n)
    new_alloc = allocator.replace(
        free_count=jnp.where(ok, allocator.free_count - total, allocator.free_count),
        owned=allocator.owned.at[idx].set(True, mode="drop"))
    return new_alloc, reset_slots(pools, slots), slots, ok


def free_slots(
    allocator: SlotAllocator, slots: Int[Array, "B"]  # noqa: F821
) -> tuple[SlotAllocator, Bool[Array, ""]]:
    """Return slots to the stack (finish / abort / preempt); ids 0 (padding) are ignored.

    All-or-nothing: `ok` is False and nothing changes if an id is out of range, not owned, or
    listed twice. The state is not zeroed here; `alloc_slots` zeroes it on the next hand-out.
    """
    v_.check_instance("allocator", allocator, SlotAllocator)
    slots = jnp.asarray(slots)
    v_.check_integer("slots", slots)
    v_.check_rank("slots", slots, 1, "B")
    n = allocator.num_slots
    slots = slots.astype(jnp.int32)
    mask = slots != NULL_SLOT
    idx, in_range = _safe_slots(slots, n, n)
    times = jnp.zeros((n,), jnp.int32).at[idx].add(1, mode="drop")
    ok = jnp.all(~mask | in_range) & jnp.all(times <= allocator.owned.astype(jnp.int32))
    pos = jnp.where(mask, allocator.free_count + exclusive_prefix_sum(mask), n)
    new = allocator.replace(
        free_stack=allocator.free_stack.at[pos].set(slots, mode="drop"),
        free_count=allocator.free_count + jnp.sum(mask, dtype=jnp.int32),
        owned=allocator.owned.at[idx].set(False, mode="drop"))
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, allocator), ok


def read_slots(
    pool: SlotPool,
    slots: Int[Array, "B"],  # noqa: F821
    has_initial_state: Bool[Array, "B"] | None = None,  # noqa: F821
) -> tuple[Float[Array, "B conv_dim Wm1"], Float[Array, "B Nv H Hv"]]:
    """Gather each row's state; slot 0 (padding) and out-of-range ids read exact zeros.

    Args:
      pool: the layer's slot pool.
      slots: `[B]` int slot ids (0 = padding).
      has_initial_state: optional `[B]` bool; rows with False read zeros whatever their slot
        holds (a first prefill chunk; defence in depth on top of the zeroing in `alloc_slots`).

    Returns:
      `(conv [B, conv_dim, W - 1], ssm [B, Nv, H, Hv])`; zeros are selected, not multiplied in,
      so NaN in a slot never leaks into a row that does not own it.
    """
    v_.check_instance("pool", pool, SlotPool)
    slots = jnp.asarray(slots)
    v_.check_integer("slots", slots)
    v_.check_rank("slots", slots, 1, "B")
    idx, ok = _safe_slots(slots.astype(jnp.int32), pool.num_slots, NULL_SLOT)
    if has_initial_state is not None:
        has_initial_state = jnp.asarray(has_initial_state)
        v_.check_bool("has_initial_state", has_initial_state)
        v_.check_shape("has_initial_state", has_initial_state, slots.shape, "B")
        ok = ok & has_initial_state

    def take(x):
        return jnp.where(ok.reshape((-1,) + (1,) * (x.ndim - 1)), x[idx], jnp.zeros((), x.dtype))

    return take(pool.conv), take(pool.ssm)


def write_slots(
    pool: SlotPool,
    slots: Int[Array, "B"],  # noqa: F821
    conv: Float[Array, "B conv_dim Wm1"],
    ssm: Float[Array, "B Nv H Hv"],
) -> SlotPool:
    """Scatter each row's new state into its slot; rows with slot 0 (padding) write nothing.

    Two real rows must not share a slot. Donate `pool` when jitting for an in-place update.
    """
    v_.check_instance("pool", pool, SlotPool)
    slots = jnp.asarray(slots)
    v_.check_integer("slots", slots)
    v_.check_rank("slots", slots, 1, "B")
    v_.check_shape("conv", conv, slots.shape + pool.conv.shape[1:], "B conv_dim W-1")
    v_.check_shape("ssm", ssm, slots.shape + pool.ssm.shape[1:], "B Nv H Hv")
    idx, _ = _safe_slots(slots.astype(jnp.int32), pool.num_slots, pool.num_slots)
    return pool.replace(conv=pool.conv.at[idx].set(conv.astype(pool.conv.dtype), mode="drop"),
                        ssm=pool.ssm.at[idx].set(ssm.astype(jnp.float32), mode="drop"))
