"""Triton merge of split-KV partials: one program per row, all splits and features in registers.

Supports any number of splits and any `Hv` (padded to powers of two and masked). Rows are the
flattened leading axes. Output is float32, as the reference. A split is empty iff its lse is -inf
(counted, not read off the max: the GPU's max drops a NaN operand), so a NaN lse or partial of a
split that saw keys makes the row NaN, as in the reference.
"""

import triton
import triton.language as tl

from attn._harness import triton_call


@triton.jit
def _merge_kernel(
    o_ptr,  # [R, P, Hv]
    lse_ptr,  # [R, P]
    out_ptr,  # [R, Hv]
    out_lse_ptr,  # [R]
    P: tl.constexpr,
    HV: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_HV: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs_p = tl.arange(0, BLOCK_P)
    offs_h = tl.arange(0, BLOCK_HV)
    mask_p = offs_p < P
    mask_h = offs_h < HV
    lse = tl.load(lse_ptr + row * P + offs_p, mask=mask_p, other=float("-inf"))  # [BLOCK_P]
    empty = lse == float("-inf")  # [BLOCK_P]; padding splits too
    none = tl.sum(tl.where(empty, 0, 1), axis=0) == 0  # the row saw no key in any split
    m = tl.max(lse, axis=0)  # -inf also when the only non-empty split's lse is NaN (GPU max)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # [BLOCK_P]; 0 for empty splits, NaN for a NaN lse
    denom = tl.where(none, 1.0, tl.sum(w, axis=0))
    o = tl.load(  # [BLOCK_P, BLOCK_HV]
        o_ptr + row * P * HV + offs_p[:, None] * HV + offs_h[None, :],
        mask=mask_p[:, None] & mask_h[None, :],
        other=0.0,
    ).to(tl.float32)
    o = tl.where(empty[:, None], 0.0, o)  # an empty split's partial may be NaN
    out = tl.sum(w[:, None] * o, axis=0) / denom  # [BLOCK_HV]
    tl.store(out_ptr + row * HV + offs_h, out, mask=mask_h)
    out_lse = tl.where(none, float("-inf"), m_safe + tl.log(denom))
    tl.store(out_lse_ptr + row, out_lse)


def merge_partials(o, lse):
    """Triton merge; same contract as `reference.merge_partials` (inputs already validated)."""
    import jax

    *rows, p, hv = o.shape
    r = 1
    for d in rows:
        r *= d
    out, out_lse = triton_call(
        o.reshape(r, p, hv),
        lse.reshape(r, p),
        kernel=_merge_kernel,
        out_shape=(
            jax.ShapeDtypeStruct((r, hv), jax.numpy.float32),
            jax.ShapeDtypeStruct((r,), jax.numpy.float32),
        ),
        grid=(r,),
        num_warps=4,
        P=p,
        HV=hv,
        BLOCK_P=triton.next_power_of_2(p),
        BLOCK_HV=triton.next_power_of_2(hv),
    )
    return out.reshape(*rows, hv), out_lse.reshape(*rows)
