"""Triton causal conv1d decode step on the conv-state slot pool, updated in place.

One program handles one batch row and one block of `BLOCK_C` channels: it reads the `[BLOCK_C,
W - 1]` state of the row's slot, appends the new input, convolves the `W` taps (float32), applies
the activation, and writes the state shifted by one token back to the same slot. The pool is
aliased input → output, so when the caller donates it XLA updates it in place.

Numerics follow `attn.conv1d.reference.causal_conv1d_update`: the new input is rounded to the
pool's dtype before it enters the convolution (the state keeps raw inputs in that dtype), products
and sums are float32, `y` comes back in x's dtype.

Slot contract (as `attn.conv1d.reference.causal_conv1d_update_pool`): ids outside `[1, slots)`
(0 or a stray -1) mark padding rows, which read nothing, output exactly 0 and write nothing (the
reference writes garbage to the null slot 0 instead; no request reads it); a row with
`has_initial_state=False` starts from zeros whatever its slot holds.

Supports: any C and W >= 2 (padded to powers of two and masked), optional bias, SiLU or no
activation, any float dtypes. Not supported: several tokens per row, gradients.
"""

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn._harness import triton_call


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration: channels per program and warps per program."""

    block_c: int = 256
    num_warps: int = 4

    def __post_init__(self):
        if self.block_c < 16 or self.block_c & (self.block_c - 1):
            raise ValueError(f"{self.block_c=} must be a power of two >= 16")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"{self.num_warps=} must be a power of two >= 1")


@triton.jit
def _conv_update_kernel(
    x_ptr,  # [B, C] in the pool's dtype
    w_ptr,  # [C, W]
    bias_ptr,  # [C] (a dummy unless HAS_BIAS)
    slot_ptr,  # [B] int32
    init_ptr,  # [B] int32, 0: start from zeros
    pool_ptr,  # [SLOTS, C, W - 1]
    y_ptr,  # [B, C]
    new_pool_ptr,  # [SLOTS, C, W - 1], the same buffer as pool_ptr when donated
    C: tl.constexpr,
    W: tl.constexpr,
    SLOTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(slot_ptr + b)
    live = (slot > 0) & (slot < SLOTS)
    carry = live & (tl.load(init_ptr + b) != 0)
    slot = tl.where(live, slot, 0)  # a stray -1 never forms an address

    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_w = tl.arange(0, BLOCK_W)  # tap j; state column j for j < W - 1
    mask_c = offs_c < C
    in_state = offs_w < W - 1

    x = tl.load(x_ptr + b * C + offs_c, mask=mask_c, other=0.0)  # [BLOCK_C]
    rows = slot.to(tl.int64) * (C * (W - 1)) + offs_c[:, None] * (W - 1)  # [BLOCK_C, 1]
    old = tl.load(  # [BLOCK_C, BLOCK_W]: state columns, the last tap masked
        pool_ptr + rows + offs_w[None, :],
        mask=mask_c[:, None] & in_state[None, :] & carry,
        other=0.0,
    )
    # The new state is the old one shifted left by one token, the new input last.
    shifted = tl.load(  # [BLOCK_C, BLOCK_W]
        pool_ptr + rows + offs_w[None, :] + 1,
        mask=mask_c[:, None] & (offs_w < W - 2)[None, :] & carry,
        other=0.0,
    )
    xe = tl.where((offs_w == W - 1)[None, :], x[:, None], old)  # [BLOCK_C, BLOCK_W] all W taps
    w = tl.load(  # [BLOCK_C, BLOCK_W]
        w_ptr + offs_c[:, None] * W + offs_w[None, :],
        mask=mask_c[:, None] & (offs_w < W)[None, :],
        other=0.0,
    ).to(tl.float32)
    y = tl.sum(xe.to(tl.float32) * w, axis=1)  # [BLOCK_C]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    y = tl.where(live, y, 0.0)  # padding rows give exactly 0, even from NaN inputs
    tl.store(y_ptr + b * C + offs_c, y.to(y_ptr.dtype.element_ty), mask=mask_c)

    new = tl.where((offs_w == W - 2)[None, :], x[:, None], shifted)  # [BLOCK_C, BLOCK_W]
    tl.store(new_pool_ptr + rows + offs_w[None, :], new,
             mask=mask_c[:, None] & in_state[None, :] & live)


def causal_conv1d_update_pool(x, conv_pool, slot_ids, weight, bias=None, activation=None, *,
                              has_initial_state=None, config: Config | None = None):
    """Decode step on the conv slot pool through the kernel; inputs validated by the api.

    Args:
      x: `[B, C]` the new token per row.
      conv_pool: `[slots, C, W - 1]`; aliased to the returned pool (donate it to update in place).
      slot_ids: `[B]` integer slot per row; ids outside `[1, slots)` are padding.
      weight: `[C, W]`.
      bias: `[C]` or None.
      activation: `"silu"` or None.
      has_initial_state: `[B]` bool, or None (every real row continues its slot).
      config: launch configuration; None for `Config()`.

    Returns:
      `(y [B, C] in x.dtype, new_pool [slots, C, W - 1])`.
    """
    bsz, c = x.shape
    w = weight.shape[1]
    config = Config() if config is None else config
    if has_initial_state is None:
        init = jnp.ones((bsz,), jnp.int32)
    else:
        init = has_initial_state.astype(jnp.int32)
    block_c = min(config.block_c, max(16, triton.next_power_of_2(c)))
    y, new_pool = triton_call(
        # The state keeps raw inputs in its own dtype and the convolution reads them from there
        # (as the reference's concat). Rounding here, in XLA, is round-to-nearest-even on every
        # backend; Triton's interpreter truncates f32 -> bf16. A no-op when the dtypes agree.
        x.astype(conv_pool.dtype),
        weight,
        jnp.zeros((1,), jnp.float32) if bias is None else bias,
        slot_ids.astype(jnp.int32),
        init,
        conv_pool,
        kernel=_conv_update_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, c), x.dtype),
            jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
        ),
        grid=(bsz, triton.cdiv(c, block_c)),
        num_warps=config.num_warps,
        input_output_aliases={5: 1},
        C=c,
        W=w,
        SLOTS=conv_pool.shape[0],
        HAS_BIAS=bias is not None,
        SILU=activation == "silu",
        BLOCK_C=block_c,
        BLOCK_W=triton.next_power_of_2(w),
    )
    return y, new_pool
