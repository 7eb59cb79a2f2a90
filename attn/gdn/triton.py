"""Triton Gated DeltaNet decode step on the recurrent-state slot pool, updated in place.

One program handles one batch row, one value head and one block of `BLOCK_HV` value features: it
streams its `[H, BLOCK_HV]` float32 state tile out of the row's slot once, applies the token
(`S ← e^g S; u = β (v − Sᵀ k); S ← S + k uᵀ; o = Sᵀ q`) in registers, and writes the tile back to
the same slot. The pool is aliased input → output, so when the caller donates it XLA updates it in
place and the step moves only the state bytes (`2 · B · Nv · H · Hv · 4`) plus the small q/k/v/o.

Slot contract (as `attn.gdn.reference.gdn_decode_pool`): slot ids outside `[1, slots)` (0 or a
stray -1) mark padding rows, which read nothing, output exactly 0 and write nothing; a row with
`has_initial_state=False` starts from zeros whatever its slot holds. Unlike the reference, padding
rows leave the null slot 0 untouched instead of writing garbage there (several padding rows would
race on it); no request reads slot 0 either way.

Supports: GVA (value head h reads key head `h // (Nv // Nk)`), any H and Hv (padded to powers of
two and masked), q/k/v/g/beta in any float dtype, float32 (or bf16 / f16) pools, in-kernel q/k
l2-norm. Not supported: several tokens per row (speculative decoding), gradients.
"""

import dataclasses

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn._harness import triton_call
from attn.gdn.reference import L2NORM_EPS


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration: value features per program and warps per program."""

    block_hv: int = 32
    num_warps: int = 4

    def __post_init__(self):
        if self.block_hv < 4 or self.block_hv & (self.block_hv - 1):
            raise ValueError(f"{self.block_hv=} must be a power of two >= 4")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"{self.num_warps=} must be a power of two >= 1")


def default_config(hv: int) -> Config:
    """64 value features per program (a 32 KB fp32 state tile at H = 128) and 4 warps: the best
    launch on the H100 at B64 / Nv32 / H = Hv = 128, 0.84 of the copy bandwidth on the state
    traffic (benchmarks/decode.md; 32 or 128 features are 7-20% slower)."""
    return Config(block_hv=min(64, max(4, triton.next_power_of_2(hv))), num_warps=4)


@triton.jit
def _gdn_decode_kernel(
    q_ptr,  # [B, NK, H]
    k_ptr,  # [B, NK, H]
    v_ptr,  # [B, NV, HV]
    g_ptr,  # [B, NV]
    beta_ptr,  # [B, NV]
    slot_ptr,  # [B] int32
    init_ptr,  # [B] int32, 0: start from zeros
    pool_ptr,  # [SLOTS, NV, H, HV]
    o_ptr,  # [B, NV, HV]
    new_pool_ptr,  # [SLOTS, NV, H, HV], the same buffer as pool_ptr when donated
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    kh = head // (NV // NK)

    slot = tl.load(slot_ptr + b)
    live = (slot > 0) & (slot < SLOTS)
    carry = live & (tl.load(init_ptr + b) != 0)
    slot = tl.where(live, slot, 0)  # a stray -1 never forms an address

    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.program_id(2) * BLOCK_HV + tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_v = offs_v < HV
    tile = (slot.to(tl.int64) * NV + head) * (H * HV) + offs_h[:, None] * HV + offs_v[None, :]
    mask = mask_h[:, None] & mask_v[None, :]

    qk_row = (b * NK + kh) * H
    q = tl.load(q_ptr + qk_row + offs_h, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
    k = tl.load(k_ptr + qk_row + offs_h, mask=mask_h, other=0.0).to(tl.float32)  # [BLOCK_H]
    if L2NORM:
        q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + EPS)
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + EPS)
    q = q * SCALE
    v = tl.load(  # [BLOCK_HV]
        v_ptr + (b * NV + head) * HV + offs_v, mask=mask_v, other=0.0
    ).to(tl.float32)
    g = tl.load(g_ptr + b * NV + head).to(tl.float32)
    beta = tl.load(beta_ptr + b * NV + head).to(tl.float32)

    s = tl.load(pool_ptr + tile, mask=mask & carry, other=0.0)
    s = s.to(tl.float32) * tl.exp(g)  # [BLOCK_H, BLOCK_HV]
    u = beta * (v - tl.sum(s * k[:, None], axis=0))  # [BLOCK_HV]
    s = s + k[:, None] * u[None, :]
    o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_HV]

    o = tl.where(live, o, 0.0)  # padding rows give exactly 0, even from NaN inputs
    tl.store(o_ptr + (b * NV + head) * HV + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)
    tl.store(new_pool_ptr + tile, s.to(new_pool_ptr.dtype.element_ty), mask=mask & live)


def gdn_decode_pool(q, k, v, g, beta, ssm_pool, slot_ids, *, has_initial_state=None, scale=None,
                    use_qk_l2norm=False, config: Config | None = None):
    """Decode step on the slot pool through the kernel; inputs validated by `attn.gdn.api`.

    Args:
      q, k: `[B, 1, Nk, H]`; v `[B, 1, Nv, Hv]`; g, beta `[B, 1, Nv]`.
      ssm_pool: `[slots, Nv, H, Hv]`; aliased to the returned pool (donate it to update in place).
      slot_ids: `[B]` integer slot per row; ids outside `[1, slots)` are padding.
      has_initial_state: `[B]` bool, or None (every real row continues its slot).
      scale: query scale, None for `H ** -0.5`.
      use_qk_l2norm: l2-normalise q and k over H in the kernel (eps 1e-6, as the reference).
      config: launch configuration; None for `default_config`.

    Returns:
      `(o [B, 1, Nv, Hv] in q.dtype, new_pool [slots, Nv, H, Hv])`.
    """
    bsz, _, nk, h = q.shape
    nv, hv = v.shape[2:]
    slots = ssm_pool.shape[0]
    config = default_config(hv) if config is None else config
    scale = h**-0.5 if scale is None else scale
    if has_initial_state is None:
        init = jnp.ones((bsz,), jnp.int32)
    else:
        init = has_initial_state.astype(jnp.int32)
    block_hv = min(config.block_hv, max(4, triton.next_power_of_2(hv)))
    o, new_pool = triton_call(
        q.reshape(bsz, nk, h),
        k.reshape(bsz, nk, h),
        v.reshape(bsz, nv, hv),
        g.reshape(bsz, nv),
        beta.reshape(bsz, nv),
        slot_ids.astype(jnp.int32),
        init,
        ssm_pool,
        kernel=_gdn_decode_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((bsz, nv, hv), q.dtype),
            jax.ShapeDtypeStruct(ssm_pool.shape, ssm_pool.dtype),
        ),
        grid=(bsz, nv, triton.cdiv(hv, block_hv)),
        num_warps=config.num_warps,
        input_output_aliases={7: 1},
        SCALE=float(scale),
        EPS=L2NORM_EPS,
        L2NORM=bool(use_qk_l2norm),
        NK=nk,
        NV=nv,
        H=h,
        HV=hv,
        SLOTS=slots,
        BLOCK_H=max(4, triton.next_power_of_2(h)),
        BLOCK_HV=block_hv,
    )
    return o[:, None], new_pool
