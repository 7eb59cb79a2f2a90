"""Triton helpers the chunked GDN kernels share (`_chunk_intra.py`, `_chunk_state.py`): the dot
precision rule and the token-major addressing.

Every tensor is token-major, `[N_TOK, heads, D]`; a chunk's rows are `start + r`, `r < BT`.
Addresses are one int64 base per chunk and head plus int32 per-element offsets (fewer registers
and 64-bit multiplies in the address tiles than int64 throughout; the same addresses).
"""

import triton
import triton.language as tl


@triton.jit
def dot_lp(a, b, F32: tl.constexpr):
    """Product of input-sized operands: 3-pass TF32 for float32 inputs (`F32`, about float32
    accuracy on tensor cores), else both rounded to bf16 with float32 accumulation, as fla."""
    if F32:
        out = tl.dot(a, b, input_precision="tf32x3")
    else:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return out


@triton.jit
def tile(ptr, start, r, head, offs, NH: tl.constexpr, D: tl.constexpr):
    """Pointers `[start + r, offs]` of head `head` in a token-major `[N_TOK, NH, D]` tensor."""
    return (ptr + (start.to(tl.int64) * NH + head) * D) + ((r * (NH * D))[:, None]
                                                           + offs[None, :])


@triton.jit
def col(ptr, start, r, head, NH: tl.constexpr):
    """Pointers `[start + r]` of head `head` in a token-major `[N_TOK, NH]` tensor."""
    return (ptr + (start.to(tl.int64) * NH + head)) + r * NH


@triton.jit
def load_keys(k_ptr, start, r, valid, kh, offs_h, mask_h, EPS: tl.constexpr,
              L2NORM: tl.constexpr, NK: tl.constexpr, H: tl.constexpr):
    """`[rows, BLOCK_H]` float32 keys (or queries) of key head kh at tokens `start + r`, zero rows
    where not valid; l2-normalised over H with `L2NORM`."""
    k = tl.load(tile(k_ptr, start, r, kh, offs_h, NK, H),
                mask=valid[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
    if L2NORM:
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=1) + EPS)[:, None]
    return k


@triton.jit
def store_rows(ptr, start, r, valid, head, offs, mask, x, NH: tl.constexpr, D: tl.constexpr):
    """`x` `[rows, len(offs)]` into rows `start + r` (where valid) of head `head`, in the
    tensor's dtype."""
    tl.store(tile(ptr, start, r, head, offs, NH, D), x.to(ptr.dtype.element_ty),
             mask=valid[:, None] & mask[None, :])
