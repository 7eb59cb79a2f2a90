"""Public context-parallel attention: causal prefill with the sequence sharded over a mesh axis.

Two variants (see `ring.py`, `allgather.py`), each with two entry points:

- `ring_attention` / `allgather_attention` take global arrays in sequence order and a mesh: they
  pad, reorder into the zig-zag layout (`_layout.py`), run the variant under `jax.shard_map`,
  restore the order and drop the padding. Differentiable.
- `ring_attention_local` / `allgather_attention_local` run inside the caller's own `shard_map`
  on blocks already in the layout. A model keeps its activations in the layout from embedding to
  loss (every other op is per token), so there is no reorder per layer; `to_zigzag` /
  `from_zigzag` convert at the ends.

The global entry points shard the sequence over `axis_name` inside (other mesh axes replicate).
On a mesh whose axis is explicit (`jax.make_mesh`'s default) they reorder a replicated copy and
return replicated arrays, since explicit sharding types have no rule for the reorder; on an
automatic axis XLA places the reorder. The ring is the default choice: on 4x H100 at S = 512K it
ran at 0.98x of 4x one GPU, the all-gather at 0.68x (benchmarks/multigpu.json).

`ring_gdn` / `ring_gdn_local` (`gdn.py`) run Gated DeltaNet's chunked delta rule over the same
kind of sharded sequence, contiguous or in the zig-zag layout, passing the chunk state along
the ring; they equal `attn.gdn.gdn_chunked` on the whole sequence.

Semantics are `attn.dense.attention`'s on the whole sequence (`reference.attention`): GQA, causal
or not, window + sinks per KV head (window needs `causal`). Queries and keys are the same
sequence (self-attention prefill: `q`, `k`, `v` share `S`).

A sequence length `S` that is not a multiple of `2 D` (`D` = size of the mesh axis) is padded at
its end to the next multiple, not refused: a causal mask already hides the padding from every
real query, a non-causal one masks it through `kv_lengths`, and the padded query rows are dropped
(in the local entry points, `seq_len` says where the padding starts).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from attn import _checks
from attn._op import IMPLEMENTATIONS
from attn.context_parallel import _layout
from attn.context_parallel.allgather import allgather_attention_shard
from attn.context_parallel.gdn import LAYOUTS, ring_gdn_shard
from attn.context_parallel.ring import ring_attention_shard

_FLOATS = (jnp.float32, jnp.bfloat16, jnp.float16)


def to_zigzag(x: Float[Array, "B S ..."], num_shards: int, *, axis: int = 1) -> Array:
    """Reorder the sequence axis into the zig-zag layout (device `d`: chunks `d`, `2D - 1 - d`).

    Args:
      x: array whose `axis` has length a multiple of `2 * num_shards`.
      num_shards: `D`, the size of the mesh axis.
      axis: the sequence axis.

    Returns:
      `x` with its `2 D` chunks reordered; shard it evenly over the mesh axis.

    Raises:
      ValueError: the length is not a multiple of `2 * num_shards`, `num_shards < 1`.
    """
    _check_layout_length(x, num_shards, axis)
    return _layout.to_zigzag(x, num_shards, axis=axis)


def from_zigzag(x: Float[Array, "B S ..."], num_shards: int, *, axis: int = 1) -> Array:
    """Inverse of `to_zigzag` (same arguments and errors)."""
    _check_layout_length(x, num_shards, axis)
    return _layout.from_zigzag(x, num_shards, axis=axis)


def ring_attention(
    q: Float[Array, "B S N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    *,
    mesh: Mesh,
    axis_name: str,
    causal: bool = True,
    scale: float | None = None,
    window: int | Int[Array, " K"] | None = None,
    sinks: int | Int[Array, " K"] = 0,
    implementation: str = "auto",
) -> tuple[Float[Array, "B S N Hv"], Float[Array, "B S N"]]:
    """Ring attention over `mesh`'s axis `axis_name` (K/V passed around with `ppermute`).

    Args:
      q: `[B, S, N, H]` queries in sequence order (float32, bfloat16 or float16).
      k: `[B, S, K, H]` keys, `N % K == 0`; v: `[B, S, K, Hv]` values; one dtype for all three.
      mesh: the device mesh; the sequence is sharded over `axis_name`, other axes replicate.
      axis_name: a name in `mesh.axis_names`.
      causal: key `s` visible only to queries at positions `>= s`.
      scale: softmax scale, default `H ** -0.5`.
      window: None, an int or `[K]` int32: most recent positions visible (`<= 0`: full);
        needs `causal`.
      sinks: int >= 0 or `[K]` int32: keys `s < sinks` stay visible despite the window.
      implementation: each block's `attn.dense.attention` backend (`"auto"`: Mosaic GPU / Triton
        on a GPU, XLA on a CPU).

    Returns:
      `(out [B, S, N, Hv] in q's dtype, lse [B, S, N] float32)`, as `reference.attention`.

    Raises:
      ValueError: wrong ranks, mismatched sizes (batch, heads, `S` of q vs k), `N % K != 0`, a
        window without `causal`, negative sinks, an axis name not in the mesh, a scale that is
        not finite and positive, an unknown implementation.
      TypeError: non-float or mixed dtypes, non-integer window / sinks, non-bool `causal`.
    """
    return _global(ring_attention_shard, q, k, v, mesh=mesh, axis_name=axis_name,
                   causal=causal, scale=scale, window=window, sinks=sinks,
                   implementation=implementation)


def allgather_attention(
    q: Float[Array, "B S N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K Hv"],
    *,
    mesh: Mesh,
    axis_name: str,
    causal: bool = True,
    scale: float | None = None,
    window: int | Int[Array, " K"] | None = None,
    sinks: int | Int[Array, " K"] = 0,
    implementation: str = "auto",
) -> tuple[Float[Array, "B S N Hv"], Float[Array, "B S N"]]:
    """All-gather attention over `mesh`'s axis `axis_name` (whole K/V gathered on every device).

    Args, Returns, Raises: as `ring_attention`.
    """
    return _global(allgather_attention_shard, q, k, v, mesh=mesh, axis_name=axis_name,
                   causal=causal, scale=scale, window=window, sinks=sinks,
                   implementation=implementation)


def ring_attention_local(
    q: Float[Array, "B T2 N H"],
    k: Float[Array, "B T2 K H"],
    v: Float[Array, "B T2 K Hv"],
    *,
    axis_name: str,
    seq_len: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: int | Int[Array, " K"] | None = None,
    sinks: int | Int[Array, " K"] = 0,
    implementation: str = "auto",
) -> tuple[Float[Array, "B T2 N Hv"], Float[Array, "B T2 N"]]:
    """Ring attention on this device's zig-zag block, inside the caller's `shard_map`.

    Args:
      q, k, v: this device's block of the `to_zigzag` layout, `T2 = 2C` tokens (even).
      axis_name: the `shard_map` axis the sequence is sharded over.
      seq_len: real length `S <= D * T2`; positions `>= S` are padding (default `D * T2`).
      causal, scale, window, sinks, implementation: as in `ring_attention`.

    Returns:
      `(out [B, T2, N, Hv] in q's dtype, lse [B, T2, N] float32)` for this device's tokens.

    Raises:
      ValueError: as `ring_attention`; an odd `T2`, `seq_len` outside `[1, D * T2]`, an
        `axis_name` that is not bound by an enclosing `shard_map`.
      TypeError: as `ring_attention`.
    """
    return _local(ring_attention_shard, q, k, v, axis_name=axis_name, seq_len=seq_len,
                  causal=causal, scale=scale, window=window, sinks=sinks,
                  implementation=implementation)


def allgather_attention_local(
    q: Float[Array, "B T2 N H"],
    k: Float[Array, "B T2 K H"],
    v: Float[Array, "B T2 K Hv"],
    *,
    axis_name: str,
    seq_len: int | None = None,
    causal: bool = True,
    scale: float | None = None,
    window: int | Int[Array, " K"] | None = None,
    sinks: int | Int[Array, " K"] = 0,
    implementation: str = "auto",
) -> tuple[Float[Array, "B T2 N Hv"], Float[Array, "B T2 N"]]:
    """All-gather attention on this device's zig-zag block, inside the caller's `shard_map`.

    Args, Returns, Raises: as `ring_attention_local`.
    """
    return _local(allgather_attention_shard, q, k, v, axis_name=axis_name, seq_len=seq_len,
                  causal=causal, scale=scale, window=window, sinks=sinks,
                  implementation=implementation)


def ring_gdn(
    q: Float[Array, "B S Nk H"],
    k: Float[Array, "B S Nk H"],
    v: Float[Array, "B S Nv Hv"],
    g: Float[Array, "B S Nv"],
    beta: Float[Array, "B S Nv"],
    *,
    mesh: Mesh,
    axis_name: str,
    initial_state: Float[Array, "B Nv H Hv"] | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    layout: str = "contiguous",
    implementation: str = "auto",
) -> tuple[Float[Array, "B S Nv Hv"], Float[Array, "B Nv H Hv"]]:
    """Chunked gated delta rule with the sequence sharded over `mesh`'s axis `axis_name`, the
    chunk state passed from device to device (`gdn.py`); equals `attn.gdn.gdn_chunked` on the
    whole sequence.

    Args:
      q, k: `[B, S, Nk, H]`; v: `[B, S, Nv, Hv]` (`Nv % Nk == 0`); g, beta: `[B, S, Nv]`
        float32 log-decay (<= 0) and write strength, in sequence order.
      mesh: the device mesh; the sequence is sharded over `axis_name`, other axes replicate.
      axis_name: a name in `mesh.axis_names`.
      initial_state: `[B, Nv, H, Hv]` state before the sequence (None: zeros).
      scale, use_qk_l2norm, chunk_size, implementation: each block's `attn.gdn.gdn_chunked`.
      layout: how the sequence is cut over the devices, `"contiguous"` or `"zigzag"` (the ring
        attention layout); the result is the same.

    Returns:
      `(o [B, S, Nv, Hv] in q's dtype, final_state [B, Nv, H, Hv] float32)`.

    Raises:
      ValueError: wrong ranks or mismatched sizes, `Nv % Nk != 0`, an axis name not in the
        mesh, an unknown layout or implementation, an initial state of another shape.
      TypeError: `mesh` not a `jax.sharding.Mesh`.
    """
    _check_gdn(q, k, v, g, beta, initial_state, layout, implementation)
    _layout.check_mesh(mesh, axis_name)
    if initial_state is None:
        initial_state = jnp.zeros((v.shape[0], v.shape[2], q.shape[-1], v.shape[-1]),
                                  jnp.float32)
    (out,), (final,) = _layout.run_global(
        _gdn_local, (q, k, v, g, beta), (initial_state.astype(jnp.float32),), mesh=mesh,
        axis_name=axis_name, layout=layout, scale=scale, use_qk_l2norm=bool(use_qk_l2norm),
        chunk_size=chunk_size, implementation=implementation)
    return out, final


def _gdn_local(q, k, v, g, beta, state, **options):
    """`ring_gdn_shard` in `_layout.run_global`'s calling convention."""
    out, final = ring_gdn_shard(q, k, v, g, beta, state, **options)
    return (out,), (final,)


def ring_gdn_local(
    q: Float[Array, "B T Nk H"],
    k: Float[Array, "B T Nk H"],
    v: Float[Array, "B T Nv Hv"],
    g: Float[Array, "B T Nv"],
    beta: Float[Array, "B T Nv"],
    *,
    axis_name: str,
    initial_state: Float[Array, "B Nv H Hv"] | None = None,
    seq_len: int | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    layout: str = "zigzag",
    implementation: str = "auto",
) -> tuple[Float[Array, "B T Nv Hv"], Float[Array, "B Nv H Hv"]]:
    """`ring_gdn` on this device's block, inside the caller's `shard_map` (a model that keeps
    its activations in the ring-attention layout calls this with `layout="zigzag"`).

    Args:
      q, k, v, g, beta: this device's block of `layout` (zigzag: `T` even).
      axis_name: the `shard_map` axis the sequence is sharded over.
      initial_state: `[B, Nv, H, Hv]` state before the sequence, the same on every device.
      seq_len: real length `S <= D * T`; tokens at positions `>= S` are padding and leave the
        state unchanged (default `D * T`).
      scale, use_qk_l2norm, chunk_size, layout, implementation: as `ring_gdn`.

    Returns:
      `(o [B, T, Nv, Hv] for this device's tokens, final_state [B, Nv, H, Hv] float32, the
      same on every device)`.

    Raises:
      ValueError: as `ring_gdn`; an odd `T` with the zigzag layout, `seq_len` outside
        `[1, D * T]`, an `axis_name` not bound by an enclosing `shard_map`.
    """
    _check_gdn(q, k, v, g, beta, initial_state, layout, implementation)
    seq_len = _layout.check_local(q.shape[1], axis_name, seq_len, layout)
    if initial_state is None:
        initial_state = jnp.zeros((v.shape[0], v.shape[2], q.shape[-1], v.shape[-1]),
                                  jnp.float32)
    return ring_gdn_shard(q, k, v, g, beta, initial_state.astype(jnp.float32),
                          axis_name=axis_name, layout=layout, seq_len=seq_len, scale=scale,
                          use_qk_l2norm=bool(use_qk_l2norm), chunk_size=chunk_size,
                          implementation=implementation)


def _check_gdn(q, k, v, g, beta, initial_state, layout, implementation) -> None:
    _checks.check_rank("q", q, 4, "B, S, Nk, H")
    _checks.check_rank("k", k, 4, "B, S, Nk, H")
    _checks.check_rank("v", v, 4, "B, S, Nv, Hv")
    _checks.check_rank("g", g, 3, "B, S, Nv")
    _checks.check_rank("beta", beta, 3, "B, S, Nv")
    _checks.check_same("q.shape", q.shape, "k.shape", k.shape)
    _checks.check_same("v.shape[:3] (B, S, Nv)", v.shape[:3], "g.shape", g.shape)
    _checks.check_same("g.shape", g.shape, "beta.shape", beta.shape)
    _checks.check_same("q.shape[:2] (B, S)", q.shape[:2], "v.shape[:2] (B, S)", v.shape[:2])
    _checks.check_divisible("num_v_heads Nv", v.shape[2], "num_k_heads Nk", q.shape[2])
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} must be one of {LAYOUTS}")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    if initial_state is not None:
        want = (v.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
        _checks.check_same("initial_state.shape", tuple(initial_state.shape),
                           "[B, Nv, H, Hv]", want)


def _check_layout_length(x, num_shards, axis) -> None:
    _checks.check_positive("num_shards", num_shards)
    length = x.shape[axis]
    if length % (2 * num_shards):
        raise ValueError(f"sequence length {length} (axis {axis}) must be a multiple of "
                         f"2 * num_shards = {2 * num_shards}")


def _validate(q, k, v, *, causal, scale, window, sinks, implementation) -> dict:
    """Checks shared by every entry point; returns the normalised options."""
    _checks.check_rank("q", q, 4, "B S N H")
    _checks.check_rank("k", k, 4, "B S K H")
    _checks.check_rank("v", v, 4, "B S K Hv")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _checks.check_dtype(name, x, _FLOATS)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q.dtype={q.dtype}, k.dtype={k.dtype} and v.dtype={v.dtype} must agree")
    _checks.check_same("k.shape[:-1]", k.shape[:-1], "v.shape[:-1]", v.shape[:-1])
    _checks.check_same("q.shape[:2] (B, S)", q.shape[:2], "k.shape[:2] (B, S)", k.shape[:2])
    _checks.check_same("q head dim H", q.shape[-1], "k head dim H", k.shape[-1])
    _checks.check_divisible("num_heads N", q.shape[2], "num_kv_heads K", k.shape[2])
    _checks.check_positive("sequence length S", q.shape[1])
    _checks.check_flag("causal", causal)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
    scale = _checks.check_scale(scale)
    num_kv_heads = k.shape[2]
    if window is not None:
        if not causal:
            raise ValueError(f"window={window!r} needs causal=True (the window counts back from "
                             f"the query)")
        window = _checks.as_int_array("window", window, (num_kv_heads,), "K")
    sinks = _checks.as_int_array("sinks", sinks, (num_kv_heads,), "K")
    _checks.check_range("sinks", sinks, 0)
    return dict(causal=bool(causal), scale=float(q.shape[-1] ** -0.5 if scale is None else scale),
                window=window, sinks=sinks, implementation=implementation)


def _global(shard_fn, q, k, v, *, mesh, axis_name, **options):
    options = _validate(q, k, v, **options)
    _layout.check_mesh(mesh, axis_name)
    window, sinks = options.pop("window"), options.pop("sinks")
    (out, lse), () = _layout.run_global(_attention_local, (q, k, v), (window, sinks), mesh=mesh,
                                        axis_name=axis_name, layout="zigzag",
                                        shard_fn=shard_fn, **options)
    return out, lse


def _attention_local(q, k, v, window, sinks, *, shard_fn, layout, **options):
    """A variant's shard function in `_layout.run_global`'s calling convention (zig-zag)."""
    del layout
    return shard_fn(q, k, v, window=window, sinks=sinks, **options), ()


def _local(shard_fn, q, k, v, *, axis_name, seq_len, **options):
    options = _validate(q, k, v, **options)
    seq_len = _layout.check_local(q.shape[1], axis_name, seq_len, "zigzag", block="T2")
    return shard_fn(q, k, v, axis_name=axis_name, seq_len=seq_len, **options)
