"""Gated DeltaNet with the sequence sharded over a mesh axis: the chunk state passed along the ring.

The delta rule is linear in its state. For one block of tokens, with `M_t = exp(g_t) (I - beta_t
k_t k_tᵀ)` (K-first state `S [H, Hv]`, `S_t = M_t S_{t-1} + beta_t k_t v_tᵀ`), the state after
token `t` from an initial state `S0` is `P_t S0 + Q_t`: `P_t = M_t ... M_1` (`[H, H]`), `Q_t` the
state from zeros. So each device runs the chunked delta rule once over its block, with values
`[v | 0]` (`Hv + H` columns) from the state `[0 | I]`: the state columns evolve independently,
so the final state is `[Q | P]` (the block's transfer `S0 -> P S0 + Q`) and the output is
`[o_0 | scale P_tᵀ q_t]`. The transfers then pass the state along the ring: `D - 1` steps, each
device applies its transfer to the state it holds and `ppermute`s the result to the next one
(device 0 keeps the initial state), so after step `r` the first `r + 1` devices hold their true
entry states. Each device's output is then `o_0 + S0ᵀ (scale P_tᵀ q_t)`: no second pass.

Cost per device: one chunked pass at `Hv + H` value columns over `S / D` tokens (about 2x the
work of `Hv` columns when `H = Hv`), plus `D - 1` state-sized `[H, H] x [H, Hv]` products and
transfers in sequence; against one device's pass over `S` tokens, about `D / 2` faster for long
blocks. Gradients come from autodiff (the ring's transpose sends the state cotangents back).

Layouts (`layout=`):

- `"contiguous"`: device `d` holds tokens `[d S / D, (d + 1) S / D)`; the ring runs `0 -> D - 1`.
- `"zigzag"`: the layout of `ring_attention` (`_layout.py`: device `d` holds chunks `d` and
  `2 D - 1 - d`), so a hybrid model keeps one layout for its attention and GDN layers. The
  state runs forward over the first chunks (`0 -> D - 1`), through device `D - 1`'s second
  chunk, and back over the second chunks (`D - 1 -> 0`): `2 (D - 1)` steps.

Padding at the end of the sequence (zero q, k, v, g, beta) leaves the state unchanged (`M = I`,
nothing added), so lengths that do not split evenly are padded and the padded outputs dropped.

`ring_gdn_mixer` / `ring_gdn_mixer_local` are a whole layer's mix step (`models.layers.gdn.gdn_mix`:
conv, SiLU, split into `[q │ k │ v]`, delta rule) over the sharded sequence: `ring_causal_conv1d`
(`conv1d.py`, halo rows by `ppermute`) then the ring above, in one layout, with both states.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Float

from attn import _checks
from attn.context_parallel import _layout, conv1d
from attn.context_parallel.conv1d import check_conv, conv_shard
from attn.gdn import gdn_chunked

LAYOUTS = conv1d.LAYOUTS  # the conv and the delta rule share the layouts


def block_transfer(q, k, v, g, beta, *, scale, use_qk_l2norm, chunk_size, implementation):
    """One block's chunked pass from the state `[0 | I]` with values `[v | 0]`.

    Returns:
      `(o0 [B, T, Nv, Hv] float32, oi [B, T, Nv, H] float32, p [B, Nv, H, H], q0 [B, Nv, H, Hv])`:
      the output from a zero state, `scale P_tᵀ q_t`, the transfer `S0 -> p S0 + q0`.
    """
    b, t, nv, hv = v.shape
    h = q.shape[-1]
    v_ext = jnp.concatenate([v, jnp.zeros((b, t, nv, h), v.dtype)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(h, dtype=jnp.float32), (b, nv, h, h))
    start = jnp.concatenate([jnp.zeros((b, nv, h, hv), jnp.float32), eye], axis=-1)
    o, s = gdn_chunked(q, k, v_ext, g, beta, scale=scale, initial_state=start,
                       use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                       implementation=implementation)
    o = o.astype(jnp.float32)
    return o[..., :hv], o[..., hv:], s[..., hv:], s[..., :hv]


def _apply(p, q0, s):
    """The transfer `s -> p s + q0` (`[B, Nv, H, H]`, `[B, Nv, H, Hv]`)."""
    return jnp.einsum("bnij,bnjv->bniv", p, s, precision=lax.Precision.HIGHEST) + q0


def _finish(o0, oi, s0, dtype):
    """`o0 + s0ᵀ oi` per token: the block's output from its true entry state `s0`."""
    return (o0 + jnp.einsum("btnj,bnjv->btnv", oi, s0, precision=lax.Precision.HIGHEST)
            ).astype(dtype)


def _pass(s_out, axis_name: str, num: int, forward: bool):
    """`s_out` of device `d` to `d + 1` (forward) or `d - 1`; the end device gets zeros."""
    pairs = [(i, i + 1) for i in range(num - 1)] if forward else [
        (i + 1, i) for i in range(num - 1)]
    return lax.ppermute(s_out, axis_name, pairs)


def _mask_padding(q, k, v, g, beta, seq_len, layout, num, d):
    """Zero k, v, g, beta of tokens at positions `>= seq_len`: they leave the state unchanged."""
    t = q.shape[1]
    if seq_len >= num * t:
        return q, k, v, g, beta
    idx = jnp.arange(t, dtype=jnp.int32)
    if layout == "contiguous":
        pos = d * t + idx
    else:
        c = t // 2
        pos = jnp.where(idx < c, d * c + idx, (2 * num - 1 - d) * c + idx - c)
    real = (pos < seq_len)[None, :]  # [1, T]
    zero = lambda x: jnp.where(real.reshape(real.shape + (1,) * (x.ndim - 2)), x,
                               jnp.zeros((), x.dtype))
    return q, zero(k), zero(v), zero(g), zero(beta)


def ring_gdn_shard(
    q: Float[Array, "B T Nk H"], k: Float[Array, "B T Nk H"], v: Float[Array, "B T Nv Hv"],
    g: Float[Array, "B T Nv"], beta: Float[Array, "B T Nv"], initial_state, *,
    axis_name: str, layout: str, seq_len: int, scale: float | None, use_qk_l2norm: bool,
    chunk_size: int, implementation: str,
) -> tuple[Float[Array, "B T Nv Hv"], Float[Array, "B Nv H Hv"]]:
    """One device's share (inside `shard_map`; validated by `api`): its block's output and the
    sequence's final state (the same on every device).

    Args:
      q, k, v, g, beta: this device's block in `layout` (zigzag: `T` even, chunks `d` and
        `2 D - 1 - d`).
      initial_state: `[B, Nv, H, Hv]` float32 state before the sequence (the same everywhere).
      seq_len: real length; tokens at positions `>= seq_len` are padding (made neutral here).
      axis_name, layout, scale, use_qk_l2norm, chunk_size, implementation: see `api`.
    """
    num = lax.axis_size(axis_name)
    d = lax.axis_index(axis_name)
    first, last = d == 0, d == num - 1
    q, k, v, g, beta = _mask_padding(q, k, v, g, beta, seq_len, layout, num, d)
    run = functools.partial(block_transfer, scale=scale, use_qk_l2norm=use_qk_l2norm,
                            chunk_size=chunk_size, implementation=implementation)
    if layout == "contiguous":
        o0, oi, p, q0 = run(q, k, v, g, beta)
        s = initial_state
        for _ in range(num - 1):  # after step r, devices 0..r+1 hold their entry states
            s = jnp.where(first, initial_state, _pass(_apply(p, q0, s), axis_name, num, True))
        final = lax.psum(jnp.where(last, _apply(p, q0, s), 0.0), axis_name)
        return _finish(o0, oi, s, q.dtype), final
    # zigzag: both chunks in one pass, as rows [B, 2] -> [2B].
    b, t = q.shape[:2]
    c = t // 2
    halves = lambda x: x.reshape(b * 2, c, *x.shape[2:])
    o0, oi, p, q0 = (x.reshape(b, 2, *x.shape[1:])
                     for x in run(*(halves(x) for x in (q, k, v, g, beta))))
    p_a, q_a, p_b, q_b = p[:, 0], q0[:, 0], p[:, 1], q0[:, 1]
    s_a = initial_state
    for _ in range(num - 1):  # forward over the first chunks
        s_a = jnp.where(first, initial_state, _pass(_apply(p_a, q_a, s_a), axis_name, num, True))
    turn = _apply(p_a, q_a, s_a)  # device D - 1: chunk D - 1 -> its second chunk D
    s_b = turn
    for _ in range(num - 1):  # backward over the second chunks
        s_b = jnp.where(last, turn, _pass(_apply(p_b, q_b, s_b), axis_name, num, False))
    final = lax.psum(jnp.where(first, _apply(p_b, q_b, s_b), 0.0), axis_name)
    out = jnp.concatenate([_finish(o0[:, 0], oi[:, 0], s_a, q.dtype),
                           _finish(o0[:, 1], oi[:, 1], s_b, q.dtype)], axis=1)
    return out, final


def ring_gdn_mixer(
    x: Float[Array, "B S C"], conv_weight: Float[Array, "C W"], g: Float[Array, "B S Nv"],
    beta: Float[Array, "B S Nv"], *, mesh: Mesh, axis_name: str, num_k_heads: int,
    head_k_dim: int, conv_state: Float[Array, "B C Wm1"] | None = None,
    ssm_state: Float[Array, "B Nv H Hv"] | None = None, scale: float | None = None,
    chunk_size: int = 64, layout: str = "contiguous", implementation: str = "auto",
) -> tuple[Float[Array, "B S Nv Hv"], Float[Array, "B C Wm1"], Float[Array, "B Nv H Hv"]]:
    """The conv and delta rule of a Gated DeltaNet layer (`models.layers.gdn.gdn_mix`) with the
    sequence sharded over `mesh`'s axis `axis_name`: `ring_causal_conv1d` (SiLU, no bias), split
    into `[q │ k │ v]`, `ring_gdn` with l2-normalised q, k.

    Args:
      x: `[B, S, C]` pre-conv channels `[q (Nk H) │ k (Nk H) │ v (Nv Hv)]` in sequence order
        (`GDNInputs.x`).
      conv_weight: `[C, W]` conv taps.
      g, beta: `[B, S, Nv]` float32 log-decay (<= 0) and write strength.
      mesh: the device mesh; the sequence is sharded over `axis_name`, other axes replicate.
      axis_name: a name in `mesh.axis_names`.
      num_k_heads, head_k_dim: Nk and H (Nv comes from `g`, Hv from `C`).
      conv_state: `[B, C, W - 1]` conv inputs before the sequence (None: zeros).
      ssm_state: `[B, Nv, H, Hv]` delta-rule state before the sequence (None: zeros).
      scale, chunk_size: the delta rule's query scale (default `H ** -0.5`) and chunk size.
      layout: `"contiguous"` or `"zigzag"`; the result is the same.
      implementation: the backend of each block's conv and chunked delta rule.

    Returns:
      `(o [B, S, Nv, Hv] in x's dtype, conv_state [B, C, W - 1] in x's dtype, ssm_state
      [B, Nv, H, Hv] float32)`, as `gdn_mix`'s output and `GDNState`.

    Raises:
      ValueError: wrong ranks or sizes (C not `2 Nk H + Nv Hv`, `Nv % Nk != 0`, states of
        other shapes), an axis name not in the mesh, an unknown layout or implementation.
      TypeError: non-floating tensors, `mesh` not a `jax.sharding.Mesh`.
    """
    hv = _check_mixer(x, conv_weight, g, beta, conv_state, ssm_state, num_k_heads, head_k_dim,
                      layout, implementation)
    _layout.check_mesh(mesh, axis_name)
    conv_state, ssm_state = _states(x, conv_weight, g, conv_state, ssm_state, head_k_dim, hv)
    (o,), (conv_out, ssm_out) = _layout.run_global(
        _mixer_local, (x, g, beta), (conv_weight, conv_state, ssm_state), mesh=mesh,
        axis_name=axis_name, layout=layout, num_k_heads=num_k_heads, head_k_dim=head_k_dim,
        scale=scale, chunk_size=chunk_size, implementation=implementation)
    return o, conv_out, ssm_out


def ring_gdn_mixer_local(
    x: Float[Array, "B T C"], conv_weight: Float[Array, "C W"], g: Float[Array, "B T Nv"],
    beta: Float[Array, "B T Nv"], *, axis_name: str, num_k_heads: int, head_k_dim: int,
    conv_state: Float[Array, "B C Wm1"] | None = None,
    ssm_state: Float[Array, "B Nv H Hv"] | None = None, seq_len: int | None = None,
    scale: float | None = None, chunk_size: int = 64, layout: str = "zigzag",
    implementation: str = "auto",
) -> tuple[Float[Array, "B T Nv Hv"], Float[Array, "B C Wm1"], Float[Array, "B Nv H Hv"]]:
    """`ring_gdn_mixer` on this device's block, inside the caller's `shard_map`.

    A model whose activations stay sharded in `layout` runs its GDN layers through the layer's
    mix hook (`models/layers/gdn.py`: the layer calls `attend.gdn_mix(spec, inputs, state)` when
    the attend object has one; the projections, gates, gated norm and `out_proj` are per token
    and run on the block unchanged):

        def gdn_mix(spec, inputs, state):
            o, conv, ssm = ring_gdn_mixer_local(
                inputs.x, inputs.conv_weight, inputs.g, inputs.beta, axis_name="sp",
                num_k_heads=spec.num_k_heads, head_k_dim=spec.head_k_dim,
                conv_state=None if state is None else state.conv,
                ssm_state=None if state is None else state.ssm, seq_len=seq_len,
                scale=spec.scale, chunk_size=spec.chunk_size)
            return o, GDNState(conv, ssm)

    Args:
      x, g, beta: this device's block of `layout` (zigzag: `T` even).
      axis_name: the `shard_map` axis the sequence is sharded over.
      conv_state, ssm_state: states before the sequence, the same on every device.
      seq_len: real length `S <= D * T`; tokens at positions `>= S` are padding: their outputs
        are garbage, and they change neither state (default `D * T`).
      conv_weight, num_k_heads, head_k_dim, scale, chunk_size, layout, implementation: as
        `ring_gdn_mixer`.

    Returns:
      `(o [B, T, Nv, Hv] for this device's tokens, conv_state, ssm_state)`, the states the same
      on every device.

    Raises:
      ValueError: as `ring_gdn_mixer`; an odd `T` with the zigzag layout, `seq_len` outside
        `[1, D * T]`, an `axis_name` not bound by an enclosing `shard_map`.
      TypeError: non-floating tensors.
    """
    hv = _check_mixer(x, conv_weight, g, beta, conv_state, ssm_state, num_k_heads, head_k_dim,
                      layout, implementation)
    seq_len = _layout.check_local(x.shape[1], axis_name, seq_len, layout)
    conv_state, ssm_state = _states(x, conv_weight, g, conv_state, ssm_state, head_k_dim, hv)
    return mixer_shard(x, conv_weight, g, beta, conv_state, ssm_state, axis_name=axis_name,
                       layout=layout, seq_len=seq_len, num_k_heads=num_k_heads,
                       head_k_dim=head_k_dim, scale=scale, chunk_size=chunk_size,
                       implementation=implementation)


def mixer_shard(x, conv_weight, g, beta, conv_state, ssm_state, *, axis_name: str, layout: str,
                seq_len: int, num_k_heads: int, head_k_dim: int, scale: float | None,
                chunk_size: int, implementation: str):
    """One device's share of `ring_gdn_mixer` (inside `shard_map`; states not None)."""
    y, conv_out = conv_shard(x, conv_weight, None, conv_state, axis_name=axis_name,
                             layout=layout, seq_len=seq_len, activation="silu",
                             implementation=implementation)
    b, t, _ = y.shape
    kd = num_k_heads * head_k_dim
    nv = g.shape[-1]
    q = y[..., :kd].reshape(b, t, num_k_heads, head_k_dim)  # [q │ k │ v]: split_qkv's order
    k = y[..., kd:2 * kd].reshape(b, t, num_k_heads, head_k_dim)
    v = y[..., 2 * kd:].reshape(b, t, nv, -1)
    o, ssm_out = ring_gdn_shard(q, k, v, g, beta, ssm_state, axis_name=axis_name, layout=layout,
                                seq_len=seq_len, scale=scale, use_qk_l2norm=True,
                                chunk_size=chunk_size, implementation=implementation)
    return o, conv_out, ssm_out


def _mixer_local(x, g, beta, conv_weight, conv_state, ssm_state, **options):
    """`mixer_shard` in `_layout.run_global`'s calling convention."""
    o, conv_out, ssm_out = mixer_shard(x, conv_weight, g, beta, conv_state, ssm_state, **options)
    return (o,), (conv_out, ssm_out)


def _states(x, conv_weight, g, conv_state, ssm_state, head_k_dim: int, hv: int):
    """The states as given, zeros for None (conv in x's dtype, ssm float32)."""
    b, nv = x.shape[0], g.shape[-1]
    if conv_state is None:
        conv_state = jnp.zeros((b, x.shape[2], conv_weight.shape[1] - 1), x.dtype)
    if ssm_state is None:
        ssm_state = jnp.zeros((b, nv, head_k_dim, hv), jnp.float32)
    return conv_state.astype(x.dtype), ssm_state.astype(jnp.float32)


def _check_mixer(x, conv_weight, g, beta, conv_state, ssm_state, num_k_heads, head_k_dim,
                 layout, implementation) -> int:
    """Checks of the mixer entry points; returns Hv."""
    check_conv(x, conv_weight, None, conv_state, "silu", layout, implementation)
    _checks.check_positive("num_k_heads", num_k_heads)
    _checks.check_positive("head_k_dim", head_k_dim)
    _checks.check_rank("g", g, 3, "B S Nv")
    _checks.check_same("g.shape", g.shape, "beta.shape", beta.shape)
    _checks.check_same("g.shape[:2] (B, S)", g.shape[:2], "x.shape[:2] (B, S)", x.shape[:2])
    nv = g.shape[-1]
    _checks.check_divisible("num_v_heads Nv", nv, "num_k_heads Nk", num_k_heads)
    value = x.shape[2] - 2 * num_k_heads * head_k_dim
    if value <= 0 or value % nv:
        raise ValueError(f"channels C={x.shape[2]} must be 2 * Nk * H = "
                         f"{2 * num_k_heads * head_k_dim} plus Nv * Hv with Nv={nv}")
    hv = value // nv
    if ssm_state is not None:
        _checks.check_same("ssm_state.shape", tuple(ssm_state.shape), "[B, Nv, H, Hv]",
                           (x.shape[0], nv, head_k_dim, hv))
    return hv
