"""Public causal depthwise conv1d (prefill, decode step, slot pools): validation once, then the
backend.

`causal_conv1d_update_pool` has a Triton kernel (`attn/conv1d/triton.py`) and `causal_conv1d` /
`causal_conv1d_prefill_pool` one for prefill (`attn/conv1d/triton_prefill.py`), the defaults on a
GPU; `causal_conv1d_update` is XLA only and takes no `implementation=`.
Semantics and layouts are documented in `attn/conv1d/reference.py`.
"""

import numpy as np
from jaxtyping import Array, Bool, Float, Int

from attn import _checks
from attn._op import Backend, op
from attn.conv1d import reference


def _prefill_triton(*, x, weight, bias, **args):
    from attn.conv1d import triton_prefill as kernel

    return kernel.causal_conv1d(x, weight, bias, **args)


def _prefill_xla(*, x, weight, bias, **args):
    return reference.causal_conv1d(x, weight, bias, **args)


def _update_pool_triton(*, x, conv_pool, slot_ids, weight, bias, activation, has_initial_state):
    from attn.conv1d import triton as kernel

    return kernel.causal_conv1d_update_pool(x, conv_pool, slot_ids, weight, bias, activation,
                                            has_initial_state=has_initial_state)


def _update_pool_xla(*, x, conv_pool, slot_ids, weight, bias, activation, has_initial_state):
    return reference.causal_conv1d_update_pool(x, conv_pool, slot_ids, weight, bias, activation,
                                               has_initial_state=has_initial_state)


def _prefill_pool(conv):
    def run(*, x, conv_pool, slot_ids, weight, bias, **args):
        return reference.causal_conv1d_prefill_pool(x, conv_pool, slot_ids, weight, bias,
                                                    conv=conv(), **args)
    return run


def _triton_conv():
    from attn.conv1d import triton_prefill as kernel

    return kernel.causal_conv1d


# The Triton kernels differentiate themselves (prefill: its own backward kernels,
# `attn/conv1d/_triton_bwd.py`); the update kernels are forward only.
_PREFILL_BACKENDS = (Backend(name="triton", run=_prefill_triton),
                     Backend(name="xla", run=_prefill_xla, platforms=("cpu", "gpu")))
_UPDATE_POOL_BACKENDS = (Backend(name="triton", run=_update_pool_triton),
                         Backend(name="xla", run=_update_pool_xla, platforms=("cpu", "gpu")))
_PREFILL_POOL_BACKENDS = (
    Backend(name="triton", run=_prefill_pool(_triton_conv)),
    Backend(name="xla", run=_prefill_pool(lambda: reference.causal_conv1d),
            platforms=("cpu", "gpu")),
)


def check_cu_seqlens(cu_seqlens, batch: int, tokens: int) -> int:
    """Validate packed-sequence boundaries; return the number of sequences.

    Raises:
      ValueError: wrong rank / length, batch != 1, or (when concrete) not a non-decreasing run
        from 0 to `tokens`.
      TypeError: not an integer array.
    """
    _checks.check_integer("cu_seqlens", cu_seqlens)
    _checks.check_rank("cu_seqlens", cu_seqlens, 1, "Ns+1")
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must hold at least 2 entries; got shape {cu_seqlens.shape}")
    if batch != 1:
        raise ValueError(f"varlen mode packs sequences into one row: batch={batch} must be 1")
    cu = _checks.concrete(cu_seqlens)
    if cu is not None:
        if cu[0] != 0 or cu[-1] != tokens or (np.diff(cu) < 0).any():
            raise ValueError(f"cu_seqlens={cu.tolist()} must rise from 0 to the token count "
                             f"{tokens} without decreasing")
    return cu_seqlens.shape[0] - 1


def check_slot_ids(slot_ids, rows: int, num_slots: int, has_initial_state=None) -> None:
    """Validate slot ids `[rows]` into a pool of `num_slots` (slot 0 = padding / null).

    When the ids are concrete: each must lie in `[-1, num_slots)` (-1 is read as padding, i.e. 0),
    and no real slot (> 0) may appear twice.

    Raises:
      ValueError: wrong shape, id out of range, duplicate real slot.
      TypeError: non-integer ids, non-bool `has_initial_state`.
    """
    _checks.check_integer("slot_ids", slot_ids)
    _checks.check_rank("slot_ids", slot_ids, 1, "B")
    _checks.check_same("slot_ids.shape[0]", slot_ids.shape[0], "rows", rows)
    if has_initial_state is not None:
        _checks.check_dtype("has_initial_state", has_initial_state, (np.bool_,))
        if has_initial_state.shape != slot_ids.shape:
            raise ValueError(f"has_initial_state.shape={has_initial_state.shape} must equal "
                             f"slot_ids.shape={slot_ids.shape}")
    ids = _checks.concrete(slot_ids)
    if ids is not None:
        bad = (ids < -1) | (ids >= num_slots)
        if bad.any():
            raise ValueError(f"slot_ids={ids.tolist()} must lie in [0, {num_slots}) "
                             f"(0 or -1 = padding)")
        real = ids[ids > 0]
        if np.unique(real).size != real.size:
            raise ValueError(f"slot_ids={ids.tolist()}: two requests share a slot")


def _check_weight(weight, bias, channels: int, activation) -> int:
    _checks.check_floating("weight", weight)
    if weight.ndim == 3 and weight.shape[1] == 1:
        raise ValueError(f"weight must have shape [C, W]; got shape {weight.shape} "
                         f"(HF's Conv1d layout [C, 1, W]: pass weight[:, 0])")
    _checks.check_rank("weight", weight, 2, "C W")
    _checks.check_same("weight.shape[0]", weight.shape[0], "channels C", channels)
    if weight.shape[1] < 2:
        raise ValueError(f"conv width W={weight.shape[1]} must be >= 2")
    if bias is not None:
        _checks.check_floating("bias", bias)
        if bias.shape != (channels,):
            raise ValueError(f"bias.shape={bias.shape} must be ({channels},)")
    if activation not in reference.ACTIVATIONS:
        raise ValueError(f"{activation=} must be one of {reference.ACTIVATIONS}")
    return weight.shape[1]


def _check_state(name: str, state, rows: int, channels: int, width: int) -> None:
    _checks.check_floating(name, state)
    expected = (rows, channels, width - 1)
    if state.shape != expected:
        raise ValueError(f"{name}.shape={state.shape} must be {expected} ([rows, C, W - 1])")


def _check_x(x, rank: int, letters: str) -> None:
    _checks.check_floating("x", x)
    _checks.check_rank("x", x, rank, letters)
    if rank == 3 and x.shape[1] < 1:
        raise ValueError(f"x must hold at least one token; got shape {x.shape}")


@op(name="causal_conv1d", backends=_PREFILL_BACKENDS)
def causal_conv1d(
    x: Float[Array, "B T C"],
    weight: Float[Array, "C W"],
    bias: Float[Array, " C"] | None = None,
    *,
    initial_state: Float[Array, "Ns C Wm1"] | None = None,
    activation: str | None = None,
    cu_seqlens: Int[Array, " Ns+1"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "Ns C Wm1"]]:
    """Causal depthwise conv1d over a prefill, with state in and out.

    `y[t, c] = act(bias[c] + Σ_j weight[c, j] · xe[t + j, c])`, `xe = concat(state, x)` in time;
    the final state is the last `W - 1` entries of `xe` (raw inputs, oldest first).

    Args:
      x: `[B, T, C]` inputs, channel-last (HF passes `[B, C, T]`).
      weight: `[C, W]` taps (HF `conv1d.weight [C, 1, W]` → `weight[:, 0]`).
      bias: `[C]` or None.
      initial_state: `[Ns, C, W - 1]` (`Ns = B`, or the sequence count with `cu_seqlens`); None
        means zeros.
      activation: `"silu"` or None.
      cu_seqlens: `[Ns + 1]` integer boundaries of sequences packed in one row (`B == 1`).
      implementation: `"xla"`, `"triton"` or `"auto"` (the Triton kernel on a GPU).

    Returns:
      `(y [B, T, C] in x.dtype, final_state [Ns, C, W - 1] in x.dtype)`.

    Raises:
      ValueError: bad shapes, width, activation, boundaries.
      TypeError: non-floating tensors or non-integer `cu_seqlens`.
    """
    _check_x(x, 3, "B T C")
    width = _check_weight(weight, bias, x.shape[2], activation)
    rows = x.shape[0]
    if cu_seqlens is not None:
        rows = check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
    if initial_state is not None:
        _check_state("initial_state", initial_state, rows, x.shape[2], width)
    return dict(x=x, weight=weight, bias=bias, initial_state=initial_state, activation=activation,
                cu_seqlens=cu_seqlens)


def causal_conv1d_update(
    x: Float[Array, "B C"],
    conv_state: Float[Array, "B C Wm1"],
    weight: Float[Array, "C W"],
    bias: Float[Array, " C"] | None = None,
    activation: str | None = None,
) -> tuple[Float[Array, "B C"], Float[Array, "B C Wm1"]]:
    """One decode step of the causal conv; XLA only (`causal_conv1d_update_pool` has the
    kernel).

    Args:
      x: `[B, C]` the new token.
      conv_state: `[B, C, W - 1]` the previous `W - 1` inputs, oldest first.
      weight: `[C, W]`.
      bias: `[C]` or None.
      activation: `"silu"` or None.

    Returns:
      `(y [B, C] in x.dtype, new_state [B, C, W - 1] in conv_state.dtype)`.

    Raises:
      ValueError: bad shapes, width or activation.
      TypeError: non-floating tensors.
    """
    _check_x(x, 2, "B C")
    width = _check_weight(weight, bias, x.shape[1], activation)
    _check_state("conv_state", conv_state, x.shape[0], x.shape[1], width)
    return reference.causal_conv1d_update(x, conv_state, weight, bias, activation)


@op(name="causal_conv1d_update_pool", backends=_UPDATE_POOL_BACKENDS)
def causal_conv1d_update_pool(
    x: Float[Array, "B C"],
    conv_pool: Float[Array, "slots C Wm1"],
    slot_ids: Int[Array, " B"],
    weight: Float[Array, "C W"],
    bias: Float[Array, " C"] | None = None,
    activation: str | None = None,
    *,
    has_initial_state: Bool[Array, " B"] | None = None,
) -> tuple[Float[Array, "B C"], Float[Array, "slots C Wm1"]]:
    """Decode step on a conv slot pool: gather `pool[slot_ids]`, step, scatter back.

    Slot 0 is the null slot: padding rows use it, read zeros, output 0, and write their garbage
    there. Rows with `has_initial_state=False` start from zeros whatever their slot holds.

    Args:
      x: `[B, C]` the new token per row.
      conv_pool: `[slots, C, W - 1]` states (model dtype).
      slot_ids: `[B]` int32 slot of each row; 0 (or -1) = padding.
      weight, bias, activation: as `causal_conv1d_update`.
      has_initial_state: `[B]` bool, or None (= every real row continues its slot's state).
      implementation: `"xla"`, `"triton"` or `"auto"` (the Triton kernel on a GPU). The kernel
        updates the pool in place when the caller donates it, and leaves slot 0 untouched.

    Returns:
      `(y [B, C], new_pool [slots, C, W - 1])`.

    Raises:
      ValueError: bad shapes, slot ids out of range or shared, width, activation.
      TypeError: wrong dtypes.
    """
    _check_x(x, 2, "B C")
    width = _check_weight(weight, bias, x.shape[1], activation)
    _check_state("conv_pool", conv_pool, conv_pool.shape[0], x.shape[1], width)
    check_slot_ids(slot_ids, x.shape[0], conv_pool.shape[0], has_initial_state)
    return dict(x=x, conv_pool=conv_pool, slot_ids=slot_ids, weight=weight, bias=bias,
                activation=activation, has_initial_state=has_initial_state)


@op(name="causal_conv1d_prefill_pool", backends=_PREFILL_POOL_BACKENDS)
def causal_conv1d_prefill_pool(
    x: Float[Array, "B T C"],
    conv_pool: Float[Array, "slots C Wm1"],
    slot_ids: Int[Array, " Ns"],
    weight: Float[Array, "C W"],
    bias: Float[Array, " C"] | None = None,
    *,
    activation: str | None = None,
    has_initial_state: Bool[Array, " Ns"] | None = None,
    cu_seqlens: Int[Array, " Ns+1"] | None = None,
) -> tuple[Float[Array, "B T C"], Float[Array, "slots C Wm1"]]:
    """Prefill on a conv slot pool: states from `pool[slot_ids]`, final states written back.

    Args:
      x: `[B, T, C]` (`B == 1` with `cu_seqlens`).
      conv_pool: `[slots, C, W - 1]`.
      slot_ids: `[Ns]` one slot per row (or per sequence with `cu_seqlens`); 0 = padding.
      weight, bias, activation: as `causal_conv1d`.
      has_initial_state: `[Ns]` bool, or None (= every real sequence continues its slot's state).
      cu_seqlens: `[Ns + 1]` packed-sequence boundaries, or None.
      implementation: `"xla"`, `"triton"` or `"auto"` (the prefill kernel on a GPU; gather,
        mask and scatter stay in XLA).

    Returns:
      `(y [B, T, C], new_pool)`; tokens of padding rows / sequences give 0.

    Raises:
      ValueError: bad shapes, slot ids, boundaries, width, activation.
      TypeError: wrong dtypes.
    """
    _check_x(x, 3, "B T C")
    width = _check_weight(weight, bias, x.shape[2], activation)
    rows = x.shape[0]
    if cu_seqlens is not None:
        rows = check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])
    _check_state("conv_pool", conv_pool, conv_pool.shape[0], x.shape[2], width)
    check_slot_ids(slot_ids, rows, conv_pool.shape[0], has_initial_state)
    return dict(x=x, conv_pool=conv_pool, slot_ids=slot_ids, weight=weight, bias=bias,
                activation=activation, has_initial_state=has_initial_state, cu_seqlens=cu_seqlens)
