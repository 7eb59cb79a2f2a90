"""The sequential kernels of the chunked GDN backward (`attn/gdn/_chunk_bwd.py`): the forward's
state pass saving what the backward reads, and the reverse pass over the state cotangent.

`state_save_kernel` is `_chunk_state.state_kernel` (same grid, same arithmetic, bitwise the same
output and final state) that also stores, per chunk, the state entering it `S` (`[Nc, Nv, H, Hv]`
in the intermediates' dtype) and `V_new = U − W S` (`[N_TOK, Nv, Hv]`, rounded as the forward
uses it). The forward keeps both in registers; storing them costs two write streams on a
latency-bound loop, against a second state pass in the backward.

`dstate_kernel` walks a sequence's chunks backwards with the cotangent `dS` of the state leaving
the chunk, a `[H, BLOCK_HV]` float32 tile in registers, starting from the final state's cotangent.
Per chunk (`L_C = exp(G_C − G)`, zero on padding rows):

    store dS                                              (dh: the chunk's outgoing cotangent)
    dV_new = Pᵀ dO + L_C ⊙ (K dS)                          (stored)
    dS    ← exp(G_C) dS + Qᵀ (exp(G) ⊙ dO) − Wᵀ dV_new

and the last `dS` is the initial state's cotangent. The dependent chain is `K dS → dV_new →
Wᵀ dV_new`, two dots as in the forward's step; `Pᵀ dO` and `Qᵀ dO` sit beside it. Same grid,
value slices and pipelining as the forward's state kernel (`Config.block_hv_state`,
`state_stages`), whose shared-memory estimate holds here too (P, K, Q, W and a `[C, BLOCK_HV]`
slice per stage).
"""

import triton
import triton.language as tl

from attn.gdn._chunk_common import col, dot_lp, store_rows
from attn.gdn._chunk_state import _chunk, _rows, _step_tiles


@triton.jit
def _state_tile(ptr, chunk, head, tile_hv, NV: tl.constexpr, H: tl.constexpr, HV: tl.constexpr):
    """Pointers of the `[BLOCK_H, BLOCK_HV]` tile `tile_hv` of chunk `chunk`'s state in a
    `[Nc, NV, H, HV]` tensor."""
    return ptr + (chunk.to(tl.int64) * NV + head) * (H * HV) + tile_hv


@triton.jit
def state_save_kernel(
    k_ptr, w_ptr, u_ptr, gcum_ptr, cstart_ptr, clen_ptr, sfirst_ptr, scount_ptr, h0_ptr, q_ptr,
    p_ptr,  # as `state_kernel`'s
    final_ptr,  # [NS, NV, H, HV] float32, out
    o_ptr,  # [N_TOK, NV, HV], out
    hs_ptr,  # [NC, NV, H, HV] the state entering each chunk slot, out
    vn_ptr,  # [N_TOK, NV, HV] V_new, out
    F32: tl.constexpr,
    HAS_INIT: tl.constexpr,
    T_ROW: tl.constexpr,
    SCALE: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    SLICE_MAJOR: tl.constexpr = False,
    QN: tl.constexpr = False,
    Q_OFF: tl.constexpr = 0,
):
    if SLICE_MAJOR:
        seq = tl.program_id(2)
        vslice = tl.program_id(0)
    else:
        seq = tl.program_id(0)
        vslice = tl.program_id(2)
    head = tl.program_id(1)
    kh = head // (NV // NK)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = vslice * BLOCK_HV + tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_v = offs_v < HV
    tile_hv = offs_h[:, None] * HV + offs_v[None, :]  # [BLOCK_H, BLOCK_HV]
    mask = mask_h[:, None] & mask_v[None, :]
    state_row = (seq.to(tl.int64) * NV + head) * (H * HV)
    if HAS_INIT:
        s = tl.load(h0_ptr + state_row + tile_hv, mask=mask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK_H, BLOCK_HV), tl.float32)

    r = tl.arange(0, BT)
    first = tl.load(sfirst_ptr + seq)
    count = tl.load(scount_ptr + seq)
    if QN:
        q_ptr = q_ptr + Q_OFF
    for c in range(0, count):
        start, n = _chunk(c, seq, first, cstart_ptr, clen_ptr, T_ROW, BT)
        w, u, k, gc, g_last, q, pm = _step_tiles(
            k_ptr, w_ptr, u_ptr, gcum_ptr, q_ptr, p_ptr, start, n, r, head, kh, offs_h, mask_h,
            offs_v, mask_v, NK, NV, H, HV, BT)
        tl.store(_state_tile(hs_ptr, first + c, head, tile_hv, NV, H, HV),
                 s.to(hs_ptr.dtype.element_ty), mask=mask)
        # `_chunk_state._step`, with V_new stored.
        valid = r < n
        v_new = u.to(tl.float32) - dot_lp(w, s, F32)  # [BT, BLOCK_HV]
        if not F32:
            v_new = v_new.to(w.dtype).to(tl.float32)
        if F32:
            k = k.to(tl.float32)
        store_rows(vn_ptr, start, r, valid, head, offs_v, mask_v, v_new, NV, HV)
        if QN:
            qf = q
        else:
            qf = q.to(tl.float32) * SCALE
        o = dot_lp(qf, s, F32) * tl.exp(gc)[:, None]
        o += dot_lp(pm, v_new, F32)
        store_rows(o_ptr, start, r, valid, head, offs_v, mask_v, o, NV, HV)
        v_new = v_new * tl.exp(g_last - gc)[:, None]
        s = s * tl.exp(g_last) + dot_lp(tl.trans(k), v_new, F32)
    tl.store(final_ptr + state_row + tile_hv, s, mask=mask)


@triton.jit
def dstate_kernel(
    k_ptr,  # [N_TOK, NK, H] the keys (l2-normalised by the intra kernel with l2-norm)
    w_ptr,  # [N_TOK, NV, H]
    gcum_ptr,  # [N_TOK, NV] float32
    cstart_ptr,  # [NC] int32
    clen_ptr,  # [NC] int32
    sfirst_ptr,  # [NS] int32
    scount_ptr,  # [NS] int32
    q_ptr,  # [N_TOK, NK, H] the queries; with QN normalised and scaled, at Q_OFF
    p_ptr,  # [N_TOK, NV, BT] the intra kernel's P
    do_ptr,  # [N_TOK, NV, HV] the output's cotangent
    dfinal_ptr,  # [NS, NV, H, HV] the final state's cotangent
    dh_ptr,  # [NC, NV, H, HV] the cotangent of the state leaving each chunk slot, out
    dvn_ptr,  # [N_TOK, NV, HV] dV_new, out
    dh0_ptr,  # [NS, NV, H, HV] float32 the initial state's cotangent, out
    F32: tl.constexpr,
    T_ROW: tl.constexpr,
    SCALE: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    SLICE_MAJOR: tl.constexpr = False,
    QN: tl.constexpr = False,
    Q_OFF: tl.constexpr = 0,
):
    if SLICE_MAJOR:
        seq = tl.program_id(2)
        vslice = tl.program_id(0)
    else:
        seq = tl.program_id(0)
        vslice = tl.program_id(2)
    head = tl.program_id(1)
    kh = head // (NV // NK)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = vslice * BLOCK_HV + tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_v = offs_v < HV
    tile_hv = offs_h[:, None] * HV + offs_v[None, :]  # [BLOCK_H, BLOCK_HV]
    mask = mask_h[:, None] & mask_v[None, :]
    state_row = (seq.to(tl.int64) * NV + head) * (H * HV)
    ds = tl.load(dfinal_ptr + state_row + tile_hv, mask=mask, other=0.0).to(tl.float32)

    r = tl.arange(0, BT)
    first = tl.load(sfirst_ptr + seq)
    count = tl.load(scount_ptr + seq)
    if QN:
        q_ptr = q_ptr + Q_OFF
    for i in range(0, count):
        c = count - 1 - i
        start, n = _chunk(c, seq, first, cstart_ptr, clen_ptr, T_ROW, BT)
        valid = r < n
        w = _rows(w_ptr, start, n, r, head, offs_h, mask_h, NV, H)  # [BT, BLOCK_H]
        k = _rows(k_ptr, start, n, r, kh, offs_h, mask_h, NK, H)  # [BT, BLOCK_H]
        q = _rows(q_ptr, start, n, r, kh, offs_h, mask_h, NK, H)  # [BT, BLOCK_H]
        pm = _rows(p_ptr, start, n, r, head, r, r < BT, NV, BT)  # [BT, BT]
        do = _rows(do_ptr, start, n, r, head, offs_v, mask_v, NV, HV)  # [BT, BLOCK_HV]
        gc = tl.load(col(gcum_ptr, start, r, head, NV), mask=valid, other=0.0)  # [BT]
        g_last = tl.load(gcum_ptr + (start + n - 1).to(tl.int64) * NV + head)
        tl.store(_state_tile(dh_ptr, first + c, head, tile_hv, NV, H, HV),
                 ds.to(dh_ptr.dtype.element_ty), mask=mask)
        decay_last = tl.where(valid, tl.exp(g_last - gc), 0.0)
        dv_new = dot_lp(tl.trans(pm), do, F32) + dot_lp(k, ds, F32) * decay_last[:, None]
        if not F32:
            dv_new = dv_new.to(w.dtype).to(tl.float32)  # rounded as stored
        store_rows(dvn_ptr, start, r, valid, head, offs_v, mask_v, dv_new, NV, HV)
        if QN:
            qf = q
        else:
            qf = q.to(tl.float32) * SCALE
        do_dec = do.to(tl.float32) * tl.exp(gc)[:, None]
        ds = (ds * tl.exp(g_last) + dot_lp(tl.trans(qf), do_dec, F32)
              - dot_lp(tl.trans(w), dv_new, F32))
    tl.store(dh0_ptr + state_row + tile_hv, ds, mask=mask)
