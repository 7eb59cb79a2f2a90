"""Reference causal depthwise conv1d: the short convolution in front of Gated DeltaNet.

Layouts are channel-last: `x [B, T, C]`, `weight [C, W]` (HF's `nn.Conv1d.weight [C, 1, W]` with the
middle axis squeezed), conv state `[B, C, W - 1]` = the last `W - 1` raw (pre-conv) inputs, oldest
first, as in the vLLM / FastDeploy conv pools. HF's own cache keeps `W` inputs (`[B, C, W]`); its
first column never reaches an output, so our state is `hf_state[..., 1:]`.

With `xe = concat(state, x)` along time (zeros when there is no state):

    y[t, c] = act(bias[c] + Σ_{j<W} weight[c, j] · xe[t + j, c])
    new_state = the last W - 1 entries of xe (a call shorter than W - 1 tokens keeps part of the
                old state)

Products and sums are float32; `y` comes back in `x`'s dtype and the state holds the raw inputs in
`x`'s dtype. (HF convolves in the weight dtype; for bf16 models the difference is bf16 rounding.)

Varlen (`cu_seqlens`): `x` is one packed row `[1, T, C]`; sequence i owns tokens
`cu_seqlens[i]:cu_seqlens[i + 1]` and never sees another sequence's inputs.

Pools: `conv_pool [slots, C, W - 1]`, slot 0 is the null slot. Rows with slot id 0 (padding) read
zeros, give output 0 and write their garbage to slot 0, which no request ever reads.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

ACTIVATIONS = ("silu", None)


def _activate(y: jax.Array, activation: str | None) -> jax.Array:
    return jax.nn.silu(y) if activation == "silu" else y


def causal_conv1d(x, weight, bias=None, *, initial_state=None, activation=None, cu_seqlens=None):
    """Specification of `attn.conv1d.causal_conv1d`: the causal depthwise conv over time from
    `initial_state` (zeros when None); tap `W - 1` multiplies the current token."""
    if cu_seqlens is not None:
        return _causal_conv1d_varlen(x, weight, bias, initial_state, activation, cu_seqlens)
    b, t, c = x.shape
    w = weight.shape[1]
    if initial_state is None:
        initial_state = jnp.zeros((b, c, w - 1), x.dtype)
    xe = jnp.concatenate([jnp.swapaxes(initial_state, 1, 2).astype(x.dtype), x], axis=1)
    xf = xe.astype(jnp.float32)  # [B, W - 1 + T, C]
    wf = weight.astype(jnp.float32)
    y = sum(xf[:, j : j + t] * wf[:, j] for j in range(w))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    final_state = jnp.swapaxes(xe[:, t:], 1, 2)  # the last W - 1 entries of xe
    return _activate(y, activation).astype(x.dtype), final_state


def _causal_conv1d_varlen(x, weight, bias, initial_state, activation, cu_seqlens):
    """Packed sequences: every tap reads from its own sequence, or from that sequence's state."""
    _, t, c = x.shape
    w = weight.shape[1]
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    if initial_state is None:
        initial_state = jnp.zeros((n, c, w - 1), x.dtype)
    state = initial_state.astype(x.dtype)
    xs = x[0]  # [T, C]
    tok = jnp.arange(t)
    seq = jnp.minimum(jnp.searchsorted(cu[1:], tok, side="right"), n - 1)  # [T]
    pos = tok - cu[seq]  # position inside its sequence
    y = jnp.zeros((t, c), jnp.float32)
    for j in range(w):
        back = w - 1 - j  # tap j reads the input `back` steps before the current one
        from_x = xs[jnp.maximum(tok - back, 0)]
        from_state = state[seq, :, jnp.minimum(pos + j, w - 2)]  # [T, C]
        tap = jnp.where((pos >= back)[:, None], from_x, from_state)
        y = y + tap.astype(jnp.float32) * weight[:, j].astype(jnp.float32)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    # Entry m of the final state is xe[L + m]: an input when L + m >= W - 1, else the old state.
    lens = cu[1:] - cu[:-1]  # [Ns]
    m = jnp.arange(w - 1)
    e = lens[:, None] + m  # [Ns, W - 1]
    from_x = xs[jnp.clip(cu[1:, None] - (w - 1) + m, 0, max(t - 1, 0))]  # [Ns, W - 1, C]
    from_state = jnp.take_along_axis(state, jnp.minimum(e, w - 2)[:, None, :], axis=2)
    final_state = jnp.where((e >= w - 1)[:, None, :], jnp.swapaxes(from_x, 1, 2), from_state)
    return _activate(y, activation).astype(x.dtype)[None], final_state


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """Specification of `attn.conv1d.causal_conv1d_update`: append `x` to the state and convolve
    the last `W` inputs."""
    xe = jnp.concatenate([conv_state, x[:, :, None].astype(conv_state.dtype)], axis=2)  # [B, C, W]
    y = jnp.einsum("bcw,cw->bc", xe.astype(jnp.float32), weight.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return _activate(y, activation).astype(x.dtype), xe[:, :, 1:]


def gather_slots(
    pool: Float[Array, "slots ..."], slot_ids: Int[Array, " B"],
    has_initial_state: Bool[Array, " B"] | None = None,
) -> tuple[Float[Array, "B ..."], Int[Array, " B"]]:
    """Read each row's state from its slot; padding rows (slot 0) and fresh requests read zeros.

    Ids outside `[1, slots)` (a stray `-1` pad) are mapped to the null slot 0 before any gather.

    Returns:
      `(state [B, *S], safe_ids [B] int32)`.
    """
    ids = slot_ids.astype(jnp.int32)
    ids = jnp.where((ids > 0) & (ids < pool.shape[0]), ids, 0)
    live = ids > 0
    if has_initial_state is not None:
        live = live & has_initial_state
    live = live.reshape(live.shape + (1,) * (pool.ndim - 1))
    return jnp.where(live, pool[ids], jnp.zeros((), pool.dtype)), ids


def causal_conv1d_update_pool(x, conv_pool, slot_ids, weight, bias=None, activation=None, *,
                              has_initial_state=None):
    """Specification of `attn.conv1d.causal_conv1d_update_pool`: gather `pool[slot_ids]`, step,
    scatter back; padding rows (slot 0) give `y = 0`."""
    state, ids = gather_slots(conv_pool, slot_ids, has_initial_state)
    y, new_state = causal_conv1d_update(x, state, weight, bias, activation)
    y = jnp.where((ids > 0)[:, None], y, jnp.zeros((), y.dtype))
    return y, conv_pool.at[ids].set(new_state.astype(conv_pool.dtype))


def causal_conv1d_prefill_pool(x, conv_pool, slot_ids, weight, bias=None, *, activation=None,
                               has_initial_state=None, cu_seqlens=None, conv=None):
    """Specification of `attn.conv1d.causal_conv1d_prefill_pool`: states from `pool[slot_ids]` (or
    zeros), final states written back, padding tokens (slot 0) give `y = 0`. `conv` replaces
    `causal_conv1d` (same signature; the api passes the Triton kernel's wrapper), None here."""
    state, ids = gather_slots(conv_pool, slot_ids, has_initial_state)
    conv = causal_conv1d if conv is None else conv
    y, final = conv(x, weight, bias, initial_state=state, activation=activation,
                             cu_seqlens=cu_seqlens)
    if cu_seqlens is None:
        live = (ids > 0)[:, None, None]
    else:
        tok = jnp.arange(x.shape[1])
        seq = jnp.searchsorted(cu_seqlens.astype(jnp.int32)[1:], tok, side="right")
        live = (ids[jnp.minimum(seq, ids.shape[0] - 1)] > 0)[None, :, None]
    y = jnp.where(live, y, jnp.zeros((), y.dtype))
    return y, conv_pool.at[ids].set(final.astype(conv_pool.dtype))
