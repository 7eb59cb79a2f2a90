"""The chunk-parallel kernels of the chunked GDN backward (`attn/gdn/_chunk_bwd.py`).

Per chunk, with the forward's `G` (chunk-local cumulative gates), `Γ = exp(G)`,
`L_C = exp(G_C − G)`, `L_ij = exp(G_i − G_j)`, the state entering the chunk `S` and the
cotangent of the state leaving it `dS` (`_chunk_bwd_state.py`), `V_new` and `dV_new`:

`dqk_kernel` (the state and output side), a program per chunk and key head looping over the key
head's value heads (their q / k gradients add up in registers):

    dQ  = Γ ⊙ (dO Sᵀ) + (dP ⊙ L) K              dP = dO V_newᵀ (causal)
    dK  = L_C ⊙ (V_new dSᵀ) + (dP ⊙ L)ᵀ Q
    dW  = −dV_new Sᵀ                              (stored per value head for `wy_kernel`)
    dG  = Γ ⊙ rowdot(Q, dO Sᵀ) + rowsum(M) − colsum(M) − L_C ⊙ rowdot(K, V_new dSᵀ),
          M = dP ⊙ P; the chunk's last row adds exp(G_C) Σ S ⊙ dS + Σ_i L_C,i rowdot_i(K, …),

which the forward's output O and dV_new turn into `rowdot(dO, O) − rowdot(V_new, dV_new)` (and
`exp(G_C) Σ S ⊙ dS + Σ rowdot(V_new, dV_new) − Σ M` on the last row): elementwise on tiles the
program loads, where the row dots as written need `Q S` and `K dS`, two more `[C, H] × [H, BV]`
dots a block (H100, B1 T32K: 1.87 ms against 2.08; the gradient of g moves by 2.5e-3 relative
norm, the bf16 outputs' rounding). The value dimension runs in `BV`-wide blocks, so no per-head
`[C, H]` accumulator is kept beside the totals. With l2-norm the query gradient goes through the
normalisation here; the key gradient's part is stored in float32 for `dk_kernel`.

`wy_kernel` (the WY side), a program per chunk and value head: `T = (I + A)⁻¹` recomputed as
the forward's intra kernel does (`A = β (K Kᵀ) ⊙ L` strictly lower), then, with
`X_w = (βΓ) ⊙ K` and `X_u = β ⊙ V`,

    dT = dW X_wᵀ + dV_new X_uᵀ (strictly lower),  dA = −Tᵀ dT Tᵀ (strictly lower)
    dv = β ⊙ Tᵀ dV_new
    dβ = rowdot(Tᵀ dW, Γ ⊙ K) + rowdot(Tᵀ dV_new, V) + rowsum(dA ⊙ L ⊙ K Kᵀ)
    dG += rowdot(Tᵀ dW, X_w) + rowsum(dA ⊙ A) − colsum(dA ⊙ A)

(the row dots as column sums of `T ⊙ dW Kᵀ` and `T ⊙ dV_new Vᵀ`), and `dg` is the reverse
cumulative sum of `dG` within the chunk. It stores the keys' two remaining factors, `(βΓ) ⊙ Tᵀ`
and `dKK = dA ⊙ L ⊙ β` (`[C, C]` each), rather than accumulating `[C, H]` key cotangents over a
key head's value heads: with that accumulator the program spilled heavily at 4 and at 8 warps.

`dk_kernel`, a program per chunk and key head: `dK = dK₁ + Σ_heads ((βΓ) ⊙ Tᵀ) dW +
(dKK + dKKᵀ) K`, then through the l2-norm.

Dot precision as the forward (`dot_lp`).
"""

import triton
import triton.language as tl

from attn.gdn._chunk_common import col, dot_lp, load_keys, store_rows, tile
from attn.gdn._chunk_intra import _block_merge, _block_subst


@triton.jit
def _l2norm_grad(ptr, start, r, valid, kh, offs_h, mask_h, dy, EPS: tl.constexpr,
                 NK: tl.constexpr, H: tl.constexpr):
    """`dx` of `y = x · rsqrt(Σ x² + eps)` (rows of key head kh at `start + r`) given `dy`:
    `rsqrt(Σ x² + eps) · (dy − y (y · dy))`."""
    x = tl.load(tile(ptr, start, r, kh, offs_h, NK, H),
                mask=valid[:, None] & mask_h[None, :], other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) + EPS)
    y = x * rstd[:, None]
    return rstd[:, None] * (dy - y * tl.sum(y * dy, axis=1)[:, None])


@triton.jit
def _operand(x, F32: tl.constexpr):
    """`x` as the dots take it (bf16 unless F32): half the registers of a float32 tile kept
    live through the program."""
    if F32:
        out = x
    else:
        out = x.to(tl.bfloat16)
    return out


@triton.jit
def _program(HEAD_MAJOR: tl.constexpr):
    """(chunk slot, key head) of this program."""
    if HEAD_MAJOR:  # grid (Nk, chunks)
        ci = tl.program_id(1)
        kh = tl.program_id(0)
    else:
        ci = tl.program_id(0)
        kh = tl.program_id(1)
    return ci, kh


@triton.jit
def dqk_kernel(
    q_ptr,  # [N_TOK, NK, H] the queries as given
    k_ptr,  # [N_TOK, NK, H] the keys as given
    gcum_ptr,  # [N_TOK, NV] float32 G
    cstart_ptr,  # [NC] int32
    clen_ptr,  # [NC] int32
    hs_ptr,  # [NC, NV, H, HV] the state entering each chunk
    dh_ptr,  # [NC, NV, H, HV] the cotangent of the state leaving each chunk
    vn_ptr,  # [N_TOK, NV, HV] V_new
    dvn_ptr,  # [N_TOK, NV, HV] dV_new
    do_ptr,  # [N_TOK, NV, HV] the output's cotangent
    p_ptr,  # [N_TOK, NV, BT] the intra kernel's P = (Q Kᵀ) ⊙ L
    o_ptr,  # [N_TOK, NV, HV] the forward's output
    dq_ptr,  # [N_TOK, NK, H] out, q's dtype
    dk1_ptr,  # [N_TOK, NK, H] float32 out: this side's cotangent of the (normalised) keys
    dw_ptr,  # [N_TOK, NV, H] out: dW
    dg1_ptr,  # [N_TOK, NV] float32 out: this side's dG
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    F32: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    BV: tl.constexpr,
    HEAD_MAJOR: tl.constexpr = False,
):
    ci, kh = _program(HEAD_MAJOR)
    start = tl.load(cstart_ptr + ci)
    n = tl.load(clen_ptr + ci)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    r = tl.arange(0, BT)
    valid = r < n
    has = n > 0
    last = tl.maximum(n - 1, 0)

    qs = _operand(load_keys(q_ptr, start, r, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
                  * SCALE, F32)  # [BT, BLOCK_H]
    k = _operand(load_keys(k_ptr, start, r, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H), F32)
    causal = r[:, None] >= r[None, :]
    dq = tl.zeros((BT, BLOCK_H), tl.float32)
    dk = tl.zeros((BT, BLOCK_H), tl.float32)
    for j in range(0, NV // NK):
        head = kh * (NV // NK) + j
        gc = tl.load(col(gcum_ptr, start, r, head, NV), mask=valid, other=0.0)  # [BT]
        g_last = tl.load(gcum_ptr + (start + last).to(tl.int64) * NV + head, mask=has,
                         other=0.0)
        gam = tl.where(valid, tl.exp(gc), 0.0)
        decay_last = tl.where(valid, tl.exp(g_last - gc), 0.0)
        state = (ci.to(tl.int64) * NV + head) * (H * HV)
        dp = tl.zeros((BT, BT), tl.float32)
        dw = tl.zeros((BT, BLOCK_H), tl.float32)
        ro = tl.zeros((BT,), tl.float32)  # rowdot(dO, O)
        rv = tl.zeros((BT,), tl.float32)  # rowdot(V_new, dV_new)
        sds = tl.zeros((BLOCK_H,), tl.float32)
        for vb in range(0, BLOCK_HV // BV):
            offs_v = vb * BV + tl.arange(0, BV)
            mask_v = offs_v < HV
            smask = mask_h[:, None] & mask_v[None, :] & has
            st = offs_h[:, None] * HV + offs_v[None, :]
            s = tl.load(hs_ptr + state + st, mask=smask, other=0.0)  # [BLOCK_H, BV]
            ds = tl.load(dh_ptr + state + st, mask=smask, other=0.0)  # [BLOCK_H, BV]
            vmask = valid[:, None] & mask_v[None, :]
            do = tl.load(tile(do_ptr, start, r, head, offs_v, NV, HV), mask=vmask, other=0.0)
            vn = tl.load(tile(vn_ptr, start, r, head, offs_v, NV, HV), mask=vmask, other=0.0)
            dvn = tl.load(tile(dvn_ptr, start, r, head, offs_v, NV, HV), mask=vmask, other=0.0)
            o = tl.load(tile(o_ptr, start, r, head, offs_v, NV, HV), mask=vmask, other=0.0)
            do = do.to(tl.float32)  # [BT, BV]
            vn = vn.to(tl.float32)
            dq += dot_lp(do * gam[:, None], tl.trans(s), F32)
            dk += dot_lp(vn * decay_last[:, None], tl.trans(ds), F32)
            dw += dot_lp(dvn, tl.trans(s), F32)
            dp += dot_lp(do, tl.trans(vn), F32)
            ro += tl.sum(do * o.to(tl.float32), axis=1)
            rv += tl.sum(vn * dvn.to(tl.float32), axis=1)
            sds += tl.sum(s.to(tl.float32) * ds.to(tl.float32), axis=1)
        pdecay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        dqk = tl.where(causal, dp * pdecay, 0.0)  # cotangent of Q Kᵀ
        pm = tl.load(tile(p_ptr, start, r, head, r, NV, BT), mask=valid[:, None], other=0.0)
        m = dp * pm.to(tl.float32)  # dP ⊙ P
        dq += dot_lp(dqk, k, F32)
        dk += dot_lp(tl.trans(dqk), qs, F32)
        # dG = Γ ⊙ rowdot(Q, dO Sᵀ) + rowsum(M) − colsum(M) − L_C ⊙ rowdot(K, V_new dSᵀ), and the
        # last row's Σ_i L_C,i rowdot_i(K, V_new dSᵀ), from what is loaded: O = Γ ⊙ (Q S) + P V_new
        # makes the first rowdot(dO, O) − rowsum(M), and dV_new = Pᵀ dO + L_C ⊙ (K dS) makes
        # L_C ⊙ rowdot(K, V_new dSᵀ) = rowdot(V_new, dV_new) − colsum(M).
        # So dG = rowdot(dO, O) − rowdot(V_new, dV_new), the last row adding
        # exp(G_C) Σ S ⊙ dS + Σ rowdot(V_new, dV_new) − Σ M.
        dg = ro - rv + tl.where(r == last, tl.exp(g_last) * tl.sum(sds, axis=0)
                                + tl.sum(rv, axis=0) - tl.sum(tl.sum(m, axis=1), axis=0), 0.0)
        store_rows(dw_ptr, start, r, valid, head, offs_h, mask_h, -dw, NV, H)
        tl.store(col(dg1_ptr, start, r, head, NV), dg, mask=valid)
    if L2NORM:
        dq = _l2norm_grad(q_ptr, start, r, valid, kh, offs_h, mask_h, dq * SCALE, EPS, NK, H)
    else:
        dq = dq * SCALE
    store_rows(dq_ptr, start, r, valid, kh, offs_h, mask_h, dq, NK, H)
    store_rows(dk1_ptr, start, r, valid, kh, offs_h, mask_h, dk, NK, H)


@triton.jit
def wy_kernel(
    kn_ptr,  # [N_TOK, NK, H] the keys as the forward's dots took them (normalised with l2-norm)
    v_ptr,  # [N_TOK, NV, HV]
    gcum_ptr,  # [N_TOK, NV] float32 G
    beta_ptr,  # [N_TOK, NV]
    cstart_ptr,  # [NC] int32
    clen_ptr,  # [NC] int32
    dw_ptr,  # [N_TOK, NV, H] dW (`dqk_kernel`)
    dvn_ptr,  # [N_TOK, NV, HV] dV_new = dU
    dg1_ptr,  # [N_TOK, NV] float32 (`dqk_kernel`)
    dv_ptr,  # [N_TOK, NV, HV] out, v's dtype
    dbeta_ptr,  # [N_TOK, NV] out, beta's dtype
    dg_ptr,  # [N_TOK, NV] out, g's dtype
    tb_ptr,  # [N_TOK, NV, BT] out: (βΓ) ⊙ Tᵀ, for `dk_kernel`
    dkk_ptr,  # [N_TOK, NV, BT] out: the cotangent of K Kᵀ, for `dk_kernel`
    F32: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    HEAD_MAJOR: tl.constexpr = False,
):
    tl.static_assert(BT == 4 * SUB)
    if HEAD_MAJOR:  # grid (Nv, chunks)
        ci = tl.program_id(1)
        head = tl.program_id(0)
    else:
        ci = tl.program_id(0)
        head = tl.program_id(1)
    kh = head // (NV // NK)
    start = tl.load(cstart_ptr + ci)
    n = tl.load(clen_ptr + ci)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_v = offs_v < HV
    r = tl.arange(0, BT)
    valid = r < n
    hmask = valid[:, None] & mask_h[None, :]
    vmask = valid[:, None] & mask_v[None, :]
    lower = r[:, None] > r[None, :]

    beta = tl.load(col(beta_ptr, start, r, head, NV), mask=valid, other=0.0).to(tl.float32)
    gc = tl.load(col(gcum_ptr, start, r, head, NV), mask=valid, other=0.0)
    gam = tl.exp(gc)
    bg = beta * gam
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
    k = tl.load(tile(kn_ptr, start, r, kh, offs_h, NK, H), mask=hmask, other=0.0)
    kk = dot_lp(k, tl.trans(k), F32)  # [BT, BT]
    a = tl.where(lower, beta[:, None] * kk * decay, 0.0)
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    t = _block_merge(a, _block_subst(a, r, SUB, BT, F32), r, eye, SUB, F32)  # (I + A)⁻¹
    tt = tl.trans(t)
    # dT = dU (β V)ᵀ + dW X_wᵀ (U = T (β ⊙ V), W = T X_w, X_w = (βΓ) ⊙ K), only its strictly
    # lower part (T's); rowdot(Tᵀ dU, V) = colsum(T ⊙ dU Vᵀ) and likewise for dW.
    du = tl.load(tile(dvn_ptr, start, r, head, offs_v, NV, HV), mask=vmask, other=0.0)
    v = tl.load(tile(v_ptr, start, r, head, offs_v, NV, HV), mask=vmask, other=0.0)
    duv = dot_lp(du, tl.trans(v), F32)  # [BT, BT]
    store_rows(dv_ptr, start, r, valid, head, offs_v, mask_v,
               dot_lp(tt, du, F32) * beta[:, None], NV, HV)  # dv = β ⊙ Tᵀ dU
    dw = tl.load(tile(dw_ptr, start, r, head, offs_h, NV, H), mask=hmask, other=0.0)
    dwk = dot_lp(dw, tl.trans(k), F32)  # [BT, BT]
    rdk = tl.sum(t * dwk, axis=0)  # rowdot(Tᵀ dW, K)
    db = tl.sum(t * duv, axis=0) + gam * rdk
    dg = tl.load(col(dg1_ptr, start, r, head, NV), mask=valid, other=0.0) + bg * rdk
    dt = tl.where(lower, duv * beta[None, :] + dwk * bg[None, :], 0.0)
    store_rows(tb_ptr, start, r, valid, head, r, r < BT, tt * bg[:, None], NV, BT)
    # A = β (K Kᵀ) ⊙ L strictly lower: dA = −Tᵀ dT Tᵀ.
    da = -dot_lp(tt, dot_lp(dt, tt, F32), F32)
    dal = tl.where(lower, da * decay, 0.0)  # dA ⊙ L
    db += tl.sum(dal * kk, axis=1)
    dkk = dal * beta[:, None]  # cotangent of K Kᵀ
    m = dkk * kk  # dA ⊙ A
    dg += tl.sum(m, axis=1) - tl.sum(m, axis=0)
    store_rows(dkk_ptr, start, r, valid, head, r, r < BT, dkk, NV, BT)
    # G_i is the sum of g over rows <= i: dg_i sums dG over rows >= i.
    dg = tl.where(valid, dg, 0.0)
    dg = tl.sum(tl.where(r[None, :] >= r[:, None], dg[None, :], 0.0), axis=1)
    tl.store(col(dg_ptr, start, r, head, NV), dg.to(dg_ptr.dtype.element_ty), mask=valid)
    tl.store(col(dbeta_ptr, start, r, head, NV), db.to(dbeta_ptr.dtype.element_ty), mask=valid)


@triton.jit
def dk_kernel(
    k_ptr,  # [N_TOK, NK, H] the keys as given
    kn_ptr,  # [N_TOK, NK, H] the keys as the forward's dots took them
    cstart_ptr,  # [NC] int32
    clen_ptr,  # [NC] int32
    dw_ptr,  # [N_TOK, NV, H] dW
    tb_ptr,  # [N_TOK, NV, BT] (βΓ) ⊙ Tᵀ (`wy_kernel`)
    dkk_ptr,  # [N_TOK, NV, BT] the cotangent of K Kᵀ (`wy_kernel`)
    dk1_ptr,  # [N_TOK, NK, H] float32 (`dqk_kernel`)
    dk_ptr,  # [N_TOK, NK, H] out, k's dtype
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    F32: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_MAJOR: tl.constexpr = False,
):
    ci, kh = _program(HEAD_MAJOR)
    start = tl.load(cstart_ptr + ci)
    n = tl.load(clen_ptr + ci)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    r = tl.arange(0, BT)
    valid = r < n
    hmask = valid[:, None] & mask_h[None, :]
    cmask = valid[:, None] & valid[None, :]
    k = tl.load(tile(kn_ptr, start, r, kh, offs_h, NK, H), mask=hmask, other=0.0)
    dk = tl.load(tile(dk1_ptr, start, r, kh, offs_h, NK, H), mask=hmask, other=0.0)
    for j in range(0, NV // NK):
        head = kh * (NV // NK) + j
        tb = tl.load(tile(tb_ptr, start, r, head, r, NV, BT), mask=cmask, other=0.0)
        dw = tl.load(tile(dw_ptr, start, r, head, offs_h, NV, H), mask=hmask, other=0.0)
        dk += dot_lp(tb, dw, F32)  # (βΓ) ⊙ Tᵀ dW
        # (dKKᵀ + dKKᵀᵀ) K: the transpose read from memory.
        rows = (start.to(tl.int64) * NV + head) * BT
        dkk = (tl.load(dkk_ptr + rows + (r * (NV * BT))[:, None] + r[None, :], mask=cmask,
                       other=0.0).to(tl.float32)
               + tl.load(dkk_ptr + rows + (r * (NV * BT))[None, :] + r[:, None], mask=cmask,
                         other=0.0).to(tl.float32))
        dk += dot_lp(dkk, k, F32)
    if L2NORM:
        dk = _l2norm_grad(k_ptr, start, r, valid, kh, offs_h, mask_h, dk, EPS, NK, H)
    store_rows(dk_ptr, start, r, valid, kh, offs_h, mask_h, dk, NK, H)
