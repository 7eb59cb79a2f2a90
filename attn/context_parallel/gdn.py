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
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from attn.gdn import gdn_chunked

LAYOUTS = ("contiguous", "zigzag")


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
