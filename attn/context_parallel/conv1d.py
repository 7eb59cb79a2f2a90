"""Causal depthwise conv1d with the sequence sharded over a mesh axis: halo rows by `ppermute`.

The short conv in front of Gated DeltaNet (`attn.conv1d.causal_conv1d`, width `W`) makes output
`t` read inputs `t - W + 1 .. t`, so each device's first `W - 1` outputs need the `W - 1` inputs
before its block, which another device holds. Each device sends the last `W - 1` rows of its
block(s) to the device holding the next part of the sequence (one `lax.ppermute` per direction,
`[B, W - 1, C]` each; nothing else of `x` moves) and then runs the single-device conv on its block
with those rows as the conv state. The first block of the sequence takes `initial_state` instead.
Under autodiff the `ppermute`s transpose to the reverse permutation: a halo's cotangent returns to
the device that owns those rows.

Layouts (`layout=`, as `ring_gdn`):

- `"contiguous"`: device `d` holds tokens `[d T, (d + 1) T)`; its halo comes from device `d - 1`.
- `"zigzag"` (`_layout.py`): device `d` holds chunks `d` and `2 D - 1 - d`. Chunk `d`'s halo is
  the tail of chunk `d - 1`, device `d - 1`'s first chunk (a forward permute); chunk
  `2 D - 1 - d`'s is the tail of chunk `2 D - 2 - d`, device `d + 1`'s second chunk (a backward
  permute), except on device `D - 1`, where it is the tail of its own first chunk (no transfer).

A block (zig-zag: a chunk) shorter than `W - 1` tokens cannot supply a whole halo alone: the
exchange then repeats `ceil((W - 1) / T)` times, each round passing the tail of `[halo │ block]`,
so the halo reaches back over several devices. With `W = 1` nothing moves.

The final conv state (the last `W - 1` inputs of the whole sequence, from `initial_state` where
the sequence is shorter) is cut by the device whose block holds token `S - 1` from its
`[halo │ block]` and shared by a `psum` of `[B, C, W - 1]` (zeros elsewhere).

Padding sits at the end of the sequence (the package's convention: `S` padded to a multiple of
`D`, zig-zag `2 D`); a causal conv never reads forward, so no real output sees it, and the padded
outputs are dropped (in the local entry point, `seq_len` says where padding starts).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Float

from attn import _checks
from attn._op import IMPLEMENTATIONS
from attn.context_parallel import _layout
from attn.conv1d import causal_conv1d
from attn.conv1d import reference as conv_reference

LAYOUTS = ("contiguous", "zigzag")


def ring_causal_conv1d(
    x: Float[Array, "B S C"],
    weight: Float[Array, "C W"],
    bias: Float[Array, " C"] | None = None,
    *,
    mesh: Mesh,
    axis_name: str,
    initial_state: Float[Array, "B C Wm1"] | None = None,
    activation: str | None = None,
    layout: str = "contiguous",
    implementation: str = "auto",
) -> tuple[Float[Array, "B S C"], Float[Array, "B C Wm1"]]:
    """Causal depthwise conv1d with the sequence sharded over `mesh`'s axis `axis_name`; equals
    `attn.conv1d.causal_conv1d` on the whole sequence.

    Args:
      x: `[B, S, C]` inputs in sequence order, channel-last.
      weight: `[C, W]` taps, `W >= 1` (tap `W - 1` multiplies the current token).
      bias: `[C]` or None.
      mesh: the device mesh; the sequence is sharded over `axis_name`, other axes replicate.
      axis_name: a name in `mesh.axis_names`.
      initial_state: `[B, C, W - 1]` inputs before the sequence, oldest first (None: zeros).
      activation: `"silu"` or None.
      layout: how the sequence is cut over the devices, `"contiguous"` or `"zigzag"`; the result
        is the same.
      implementation: each block's `attn.conv1d.causal_conv1d` backend (`"auto"`: Triton on a
        GPU, XLA on a CPU; `W = 1` always runs XLA).

    Returns:
      `(y [B, S, C] in x's dtype, final_state [B, C, W - 1] in x's dtype)`.

    Raises:
      ValueError: wrong ranks or shapes, `W < 1`, an unknown activation, layout or
        implementation, an axis name not in the mesh.
      TypeError: non-floating tensors, `mesh` not a `jax.sharding.Mesh`.
    """
    check_conv(x, weight, bias, initial_state, activation, layout, implementation)
    _layout.check_mesh(mesh, axis_name)
    state = _state_or_zeros(initial_state, x, weight.shape[1])
    (y,), (final,) = _layout.run_global(_conv_local, (x,), (weight, bias, state), mesh=mesh,
                                axis_name=axis_name, layout=layout, activation=activation,
                                implementation=implementation)
    return y, final


def ring_causal_conv1d_local(
    x: Float[Array, "B T C"],
    weight: Float[Array, "C W"],
    bias: Float[Array, " C"] | None = None,
    *,
    axis_name: str,
    initial_state: Float[Array, "B C Wm1"] | None = None,
    activation: str | None = None,
    seq_len: int | None = None,
    layout: str = "zigzag",
    implementation: str = "auto",
) -> tuple[Float[Array, "B T C"], Float[Array, "B C Wm1"]]:
    """`ring_causal_conv1d` on this device's block, inside the caller's `shard_map`.

    Args:
      x: this device's block of `layout` (zigzag: `T` even, chunks `d` and `2 D - 1 - d`).
      weight, bias, activation, layout, implementation: as `ring_causal_conv1d`.
      axis_name: the `shard_map` axis the sequence is sharded over.
      initial_state: `[B, C, W - 1]` inputs before the sequence, the same on every device.
      seq_len: real length `S <= D * T`; tokens at positions `>= S` are padding: their outputs
        are garbage and they never reach a real output or the final state (default `D * T`).

    Returns:
      `(y [B, T, C] for this device's tokens, final_state [B, C, W - 1], the same on every
      device)`.

    Raises:
      ValueError: as `ring_causal_conv1d`; an odd `T` with the zigzag layout, `seq_len` outside
        `[1, D * T]`, an `axis_name` not bound by an enclosing `shard_map`.
      TypeError: as `ring_causal_conv1d`.
    """
    check_conv(x, weight, bias, initial_state, activation, layout, implementation)
    seq_len = _layout.check_local(x.shape[1], axis_name, seq_len, layout)
    state = _state_or_zeros(initial_state, x, weight.shape[1])
    return conv_shard(x, weight, bias, state, axis_name=axis_name, layout=layout,
                      seq_len=seq_len, activation=activation, implementation=implementation)


def conv_shard(x, weight, bias, initial_state, *, axis_name: str, layout: str, seq_len: int,
               activation: str | None, implementation: str):
    """One device's share (inside `shard_map`; validated by the callers): its block's conv output
    `[B, T, C]` and the sequence's final conv state `[B, C, W - 1]` (the same on every device).

    `initial_state` is `[B, C, W - 1]` (not None)."""
    num = lax.axis_size(axis_name)
    d = lax.axis_index(axis_name)
    b, t, c = x.shape
    m = weight.shape[1] - 1
    init = jnp.swapaxes(initial_state, 1, 2).astype(x.dtype)  # [B, W - 1, C]
    if layout == "contiguous":
        blocks, starts = x[:, None], (d * t,)  # [B, 1, T, C]
    else:
        blocks = x.reshape(b, 2, t // 2, c)  # [B, 2, T/2, C]: chunks d and 2D - 1 - d
        starts = _layout.chunk_starts(num, t // 2, axis_name)
    halos = _halos(blocks, init, axis_name, num, d)  # [B, nb, W - 1, C]
    nb = blocks.shape[1]
    rows = lambda a: a.reshape(b * nb, *a.shape[2:])
    state = jnp.swapaxes(rows(halos), 1, 2)  # [B nb, C, W - 1]
    if m == 0:  # no taps before the current token: attn.conv1d's op refuses W = 1
        y, _ = conv_reference.causal_conv1d(rows(blocks), weight, bias, activation=activation)
    else:
        y, _ = causal_conv1d(rows(blocks), weight, bias, initial_state=state,
                             activation=activation, implementation=implementation)
    final = _final_state(blocks, halos, starts, seq_len, axis_name)
    return y.reshape(b, t, c), final


def _halos(blocks, init, axis_name: str, num: int, d):
    """The `W - 1` inputs before each block (`[B, nb, W - 1, C]`, `nb` = 1 or 2 blocks a device,
    in sequence order on the device); see the module docstring."""
    m = init.shape[1]
    b, nb, tb, c = blocks.shape
    if m == 0:
        return jnp.zeros((b, nb, 0, c), blocks.dtype)
    first, last = d == 0, d == num - 1
    forward = [(i, i + 1) for i in range(num - 1)]
    backward = [(i + 1, i) for i in range(num - 1)]
    tail = lambda halo, block: jnp.concatenate([halo, block], axis=1)[:, -m:]  # [B, W - 1, C]
    halo_a = jnp.where(first, init, jnp.zeros_like(init))
    halo_b = jnp.zeros_like(init)
    for _ in range(-(-m // tb)):  # one round when a block holds >= W - 1 tokens
        tail_a = tail(halo_a, blocks[:, 0])
        halo_a_next = jnp.where(first, init, lax.ppermute(tail_a, axis_name, forward))
        if nb == 2:
            tail_b = tail(halo_b, blocks[:, 1])
            halo_b = jnp.where(last, tail_a, lax.ppermute(tail_b, axis_name, backward))
        halo_a = halo_a_next
    return jnp.stack([halo_a, halo_b][:nb], axis=1)


def _final_state(blocks, halos, starts, seq_len: int, axis_name: str):
    """The last `W - 1` inputs of the sequence `[B, C, W - 1]`: cut by the device whose block
    holds token `seq_len - 1` from that block's `[halo │ block]`, summed over the axis."""
    m = halos.shape[2]
    b, nb, tb, c = blocks.shape
    if m == 0:
        return jnp.zeros((b, c, 0), blocks.dtype)
    final = jnp.zeros((b, m, c), blocks.dtype)
    for i in range(nb):
        ext = jnp.concatenate([halos[:, i], blocks[:, i]], axis=1)  # [B, W - 1 + Tb, C]
        ends = seq_len - starts[i]  # tokens of this block before the sequence's end
        owns = (ends >= 1) & (ends <= tb)
        cut = lax.dynamic_slice_in_dim(ext, jnp.clip(ends, 0, tb), m, axis=1)  # [B, W - 1, C]
        final = final + jnp.where(owns, cut, jnp.zeros((), cut.dtype))
    return jnp.swapaxes(lax.psum(final, axis_name), 1, 2)


def _conv_local(x, weight, bias, state, *, axis_name, layout, seq_len, activation,
                implementation):
    y, final = conv_shard(x, weight, bias, state, axis_name=axis_name, layout=layout,
                          seq_len=seq_len, activation=activation, implementation=implementation)
    return (y,), (final,)


def _state_or_zeros(initial_state, x, width: int):
    if initial_state is None:
        return jnp.zeros((x.shape[0], x.shape[2], width - 1), x.dtype)
    return initial_state.astype(x.dtype)


def check_conv(x, weight, bias, initial_state, activation, layout, implementation) -> None:
    """The checks of `attn.conv1d.causal_conv1d` (without `cu_seqlens`), `W >= 1`."""
    _checks.check_floating("x", x)
    _checks.check_rank("x", x, 3, "B S C")
    if x.shape[1] < 1:
        raise ValueError(f"x must hold at least one token; got shape {x.shape}")
    _checks.check_floating("weight", weight)
    _checks.check_rank("weight", weight, 2, "C W")
    _checks.check_same("weight.shape[0]", weight.shape[0], "channels C", x.shape[2])
    if weight.shape[1] < 1:
        raise ValueError(f"conv width W={weight.shape[1]} must be >= 1")
    if bias is not None:
        _checks.check_floating("bias", bias)
        if bias.shape != (x.shape[2],):
            raise ValueError(f"bias.shape={bias.shape} must be ({x.shape[2]},)")
    if activation not in conv_reference.ACTIVATIONS:
        raise ValueError(f"{activation=} must be one of {conv_reference.ACTIVATIONS}")
    if initial_state is not None:
        _checks.check_floating("initial_state", initial_state)
        want = (x.shape[0], x.shape[2], weight.shape[1] - 1)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state.shape={tuple(initial_state.shape)} must be {want} "
                             f"([B, C, W - 1])")
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} must be one of {LAYOUTS}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
