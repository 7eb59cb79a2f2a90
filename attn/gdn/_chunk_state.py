"""The state kernel of the chunked GDN prefill (`attn/gdn/triton_chunk.py`, stage 2): the
sequential pass over a sequence's chunks, with the output written on the way.

Grid `(Ns, Nv, cdiv(Hv, BLOCK_HV))` (slices first with `Config.state_slice_major`). One program
walks its sequence's chunks with a `[H, BLOCK_HV]` float32 state tile `S` in registers; per chunk,
from the intra kernel's W, U, G, P (and its normalised keys / scaled queries with l2-norm):

    V_new = U − W S
    O     = (Q ⊙ exp(G)) S + P V_new                      (stored; off the S chain)
    S    ← exp(G_C) S + Kᵀ (V_new ⊙ exp(G_C − G))

and the last `S` is the final state. The per-chunk states and V_new never reach HBM, and there is
no third kernel: the output's two dots sit beside the chain in the same instruction stream.

A step is latency-bound (its dots form one dependent chain, a program per SM): Triton
software-pipelines the dots' operand loads `num_stages - 1` chunks ahead as async copies (given
jax-triton's 16-byte-aligned pointers), so each step's loads are issued together at its top and
`default_config` runs the loop three stages deep where shared memory holds it.
"""

import triton
import triton.language as tl

from attn.gdn._chunk_common import col, dot_lp, store_rows, tile


@triton.jit
def _chunk(c, seq, first, cstart_ptr, clen_ptr, T_ROW: tl.constexpr, BT: tl.constexpr):
    """First token and length of chunk `c` of the program's sequence: from its index for B rows
    of T_ROW tokens (no table loads in the sequential loop), else from the chunk tables."""
    if T_ROW:
        start = seq * T_ROW + c * BT
        n = tl.minimum(T_ROW - c * BT, BT)
    else:
        start = tl.load(cstart_ptr + first + c)
        n = tl.load(clen_ptr + first + c)
    return start, n


@triton.jit
def _rows(ptr, start, n, r, head, offs, mask, NH: tl.constexpr, D: tl.constexpr):
    """Rows `start + r` (`r < n`) of head `head` of a token-major `[N_TOK, NH, D]` tensor, as
    stored (zeros elsewhere)."""
    return tl.load(tile(ptr, start, r, head, offs, NH, D),
                   mask=(r < n)[:, None] & mask[None, :], other=0.0)


@triton.jit
def _step_tiles(k_ptr, w_ptr, u_ptr, gcum_ptr, q_ptr, p_ptr, start, n, r, head, kh, offs_h,
                mask_h, offs_v, mask_v, NK: tl.constexpr, NV: tl.constexpr, H: tl.constexpr,
                HV: tl.constexpr, BT: tl.constexpr):
    """Every global load of one chunk step, issued together and kept as stored (the step converts
    them), so their latencies overlap one another: W, U, K, Q, P and the gates G `[BT]` and G_C
    (the chunk's last; n >= 1)."""
    w = _rows(w_ptr, start, n, r, head, offs_h, mask_h, NV, H)  # [BT, BLOCK_H]
    u = _rows(u_ptr, start, n, r, head, offs_v, mask_v, NV, HV)  # [BT, BLOCK_HV]
    k = _rows(k_ptr, start, n, r, kh, offs_h, mask_h, NK, H)  # [BT, BLOCK_H]
    gc = tl.load(col(gcum_ptr, start, r, head, NV), mask=r < n, other=0.0)  # [BT]
    g_last = tl.load(gcum_ptr + (start + n - 1).to(tl.int64) * NV + head)
    q = _rows(q_ptr, start, n, r, kh, offs_h, mask_h, NK, H)  # [BT, BLOCK_H]
    pm = _rows(p_ptr, start, n, r, head, r, r < BT, NV, BT)  # [BT, BT]
    return w, u, k, gc, g_last, q, pm


@triton.jit
def _step(s, w, u, k, gc, g_last, q, pm, start, n, r, head, offs_v, mask_v, o_ptr,
          F32: tl.constexpr, SCALE: tl.constexpr, NV: tl.constexpr, HV: tl.constexpr,
          QN: tl.constexpr):
    """One chunk: stores its output rows and returns the state leaving the chunk."""
    valid = r < n
    v_new = u.to(tl.float32) - dot_lp(w, s, F32)  # [BT, BLOCK_HV]
    if not F32:
        v_new = v_new.to(w.dtype).to(tl.float32)  # rounded as the intermediates are
    if F32:
        k = k.to(tl.float32)
    # The keys (normalised by the intra kernel with l2-norm) go into the dots as loaded; so do
    # the queries with QN (normalised and scaled there), else they are scaled here.
    if QN:
        qf = q
    else:
        qf = q.to(tl.float32) * SCALE
    o = dot_lp(qf, s, F32) * tl.exp(gc)[:, None]  # fla's order: exp(G) on the [BT, HV] product
    o += dot_lp(pm, v_new, F32)
    store_rows(o_ptr, start, r, valid, head, offs_v, mask_v, o, NV, HV)
    # The decay on V_new's [BT, BLOCK_HV] rows (fla's), not on K's [BT, BLOCK_H].
    v_new = v_new * tl.exp(g_last - gc)[:, None]
    return s * tl.exp(g_last) + dot_lp(tl.trans(k), v_new, F32)


@triton.jit
def state_kernel(
    k_ptr,  # [N_TOK, NK, H] the keys (l2-normalised by the intra kernel with l2-norm)
    w_ptr,  # [N_TOK, NV, H]
    u_ptr,  # [N_TOK, NV, HV]
    gcum_ptr,  # [N_TOK, NV] float32
    cstart_ptr,  # [NC] int32
    clen_ptr,  # [NC] int32
    sfirst_ptr,  # [NS] int32 first chunk of each sequence
    scount_ptr,  # [NS] int32 chunks of each sequence
    h0_ptr,  # [NS, NV, H, HV] float32 (a dummy unless HAS_INIT)
    q_ptr,  # [N_TOK, NK, H] the queries; with QN normalised and scaled, at Q_OFF
    p_ptr,  # [N_TOK, NV, BT] the intra kernel's P
    final_ptr,  # [NS, NV, H, HV] float32, out
    o_ptr,  # [N_TOK, NV, HV], out
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
    if SLICE_MAJOR:  # grid (slices, Nv, Ns): a head's value slices launch side by side
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
    if QN:  # the queries after the keys in the intra kernel's buffer
        q_ptr = q_ptr + Q_OFF
    for c in range(0, count):
        start, n = _chunk(c, seq, first, cstart_ptr, clen_ptr, T_ROW, BT)
        w, u, k, gc, g_last, q, pm = _step_tiles(
            k_ptr, w_ptr, u_ptr, gcum_ptr, q_ptr, p_ptr, start, n, r, head, kh, offs_h, mask_h,
            offs_v, mask_v, NK, NV, H, HV, BT)
        s = _step(s, w, u, k, gc, g_last, q, pm, start, n, r, head, offs_v, mask_v, o_ptr, F32,
                  SCALE, NV, HV, QN)
    tl.store(final_ptr + state_row + tile_hv, s, mask=mask)
