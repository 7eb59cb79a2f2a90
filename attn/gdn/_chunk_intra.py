"""The intra-chunk kernels of the chunked GDN prefill (`attn/gdn/triton_chunk.py`, stage 1).

Per chunk of C = 64 tokens and value head, with `G` the chunk-local cumulative sum of g and
`L_ij = exp(G_i − G_j)` for `j <= i`:

- `G` (stored, float32), the strictly lower `A = (β K Kᵀ) ⊙ L` `[C, C]`;
- `T = (I + A)⁻¹` in registers: forward substitution inside the four 16 × 16 diagonal blocks (15
  steps), then the blocks below through the nilpotent block-lower remainder (4 dots,
  `_block_merge`);
- the WY pair `W = T (β K ⊙ exp(G))` `[C, H]` and `U = T (β V)` `[C, Hv]`, stored;
- the output's intra-chunk scores `P = (Q Kᵀ) ⊙ L` `[C, C]` (causal, diagonal included), stored
  for the state kernel;
- with l2-norm, the normalised keys and the normalised, scaled queries (stored once per key head),
  so the state kernel puts them into its dots as loaded.

`intra_kernel` does one value head a program. `intra_pair_kernel` (`Config.intra_pairs`) does the
two value heads 2j, 2j + 1 of a key head: K loaded, normalised and multiplied by itself once, both
heads' diagonal blocks solved as one batch of 3-D dots (`[8, 16, 16]`), the two merges
interleaved; two independent dependent chains in one instruction stream hide each other's dot
latency. H100 intra ms at B1 T32K / B8 T4K, Nk16 Nv32 H = Hv = 128 bf16: 1.01 / 0.95 per head,
0.73 / 0.71 in pairs. It applies β to `K Kᵀ`'s rows after the dot instead of to K before it, so W
and U round differently in bf16; G, P and the stored keys / queries are bitwise the per-head
kernel's.
"""

import triton
import triton.language as tl

from attn.gdn._chunk_common import col, dot_lp, load_keys, store_rows, tile


@triton.jit
def _head_gates(g_ptr, beta_ptr, start, r, valid, head, NV: tl.constexpr):
    """β and G `[BT]` (chunk-local cumulative sum of g; padding adds 0) of value head `head`."""
    beta = tl.load(col(beta_ptr, start, r, head, NV), mask=valid, other=0.0).to(tl.float32)
    gc = tl.cumsum(tl.load(col(g_ptr, start, r, head, NV), mask=valid,
                           other=0.0).to(tl.float32), axis=0)
    return beta, gc


@triton.jit
def _block_subst(a, r, SB: tl.constexpr, BT: tl.constexpr, F32: tl.constexpr):
    """Inverse of `I + A` on its SB × SB diagonal blocks (block-diagonal `[BT, BT]`, zero
    elsewhere) by forward substitution, all blocks at once: step i sets row i of every block,
    `d[r] = e_r − Σ_{s<r} a[r, s] d[s]`. The inverse is kept as its diagonal blocks stacked,
    `d[r, c] = D[r, SB (r // SB) + c]` `[BT, SB]`, so each step is one `[BT, BT] × [BT, SB]` dot
    (a quarter of a square one's work); expanded to `[BT, BT]` at the end."""
    same = (r[:, None] // SB) == (r[None, :] // SB)
    a_diag = tl.where(same, a, 0.0)
    c = tl.arange(0, SB)
    d = tl.where((r % SB)[:, None] == c[None, :], 1.0, 0.0)
    for i in range(1, SB):
        sel = (r % SB == i)[:, None]
        d = tl.where(sel, d - dot_lp(a_diag, d, F32), d)
    full = tl.reshape(tl.broadcast_to(d[:, None, :], (BT, BT // SB, SB)), (BT, BT))
    return tl.where(same, full, 0.0)


@triton.jit
def _block_merge(a, d, r, eye, INNER: tl.constexpr, F32: tl.constexpr):
    """`(I + A)⁻¹` on the 4·INNER-row diagonal blocks from `d`, the inverse on the INNER-row ones:
    with `N = D A_off` (A_off: A inside the outer blocks, off the inner ones; strictly
    block-lower, N⁴ = 0), `I + A = D⁻¹ (I + N)`, so `(I + A)⁻¹ = (I − N)(I + N²) D` (4 dots)."""
    outer = (r[:, None] // (4 * INNER)) == (r[None, :] // (4 * INNER))
    off = outer & ((r[:, None] // INNER) != (r[None, :] // INNER))
    nil = dot_lp(d, tl.where(off, a, 0.0), F32)
    return dot_lp(dot_lp(eye - nil, eye + dot_lp(nil, nil, F32), F32), d, F32)


@triton.jit
def intra_kernel(
    q_ptr,  # [N_TOK, NK, H]
    k_ptr,  # [N_TOK, NK, H]
    v_ptr,  # [N_TOK, NV, HV]
    g_ptr,  # [N_TOK, NV]
    beta_ptr,  # [N_TOK, NV]
    cstart_ptr,  # [NC] int32 first token of each chunk
    clen_ptr,  # [NC] int32 tokens of each chunk (0: an unused slot)
    gcum_ptr,  # [N_TOK, NV] float32, out
    w_ptr,  # [N_TOK, NV, H], out
    u_ptr,  # [N_TOK, NV, HV], out
    kn_ptr,  # [N_TOK, NK, H] the l2-normalised keys, out if STORE_KN (else a dummy); with
    # STORE_QN [2 N_TOK, NK, H], the normalised and scaled queries after the keys (QN_OFF)
    p_ptr,  # [N_TOK, NV, BT] P = (Q Kᵀ) ⊙ L (causal, diagonal included), out
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    F32: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    STORE_KN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    HEAD_MAJOR: tl.constexpr = False,
    STORE_QN: tl.constexpr = False,
    QN_OFF: tl.constexpr = 0,
):
    tl.static_assert(BT == 4 * SUB)  # one merge by fours relies on N⁴ = 0
    if HEAD_MAJOR:  # grid (Nv, chunks): a chunk's value heads side by side
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

    k = load_keys(k_ptr, start, r, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)  # [BT, BLOCK_H]
    beta, gc = _head_gates(g_ptr, beta_ptr, start, r, valid, head, NV)
    tl.store(col(gcum_ptr, start, r, head, NV), gc, mask=valid)
    if STORE_KN:  # by the first value head of each key head
        store_rows(kn_ptr, start, r, valid & (head % (NV // NK) == 0), kh, offs_h, mask_h, k, NK,
                   H)
    if STORE_QN:
        qs = load_keys(q_ptr, start, r, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
        store_rows(kn_ptr + QN_OFF, start, r, valid & (head % (NV // NK) == 0), kh, offs_h,
                   mask_h, qs * SCALE, NK, H)

    # A = StrictLower((β K Kᵀ) ⊙ L), [BT, BT]; the mask comes before the exp (no overflow).
    lower = r[:, None] > r[None, :]
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
    a = tl.where(lower, dot_lp(k * beta[:, None], tl.trans(k), F32) * decay, 0.0)
    # P = (Q Kᵀ) ⊙ L, the output's intra-chunk scores, for the state kernel.
    q = load_keys(q_ptr, start, r, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    causal = r[:, None] >= r[None, :]
    pdecay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    scores = tl.where(causal, dot_lp(q * SCALE, tl.trans(k), F32) * pdecay, 0.0)
    store_rows(p_ptr, start, r, valid, head, r, r < BT, scores, NV, BT)
    # (I + A)⁻¹: substitution inside the SUB × SUB diagonal blocks, then one merge by fours.
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    d = _block_subst(a, r, SUB, BT, F32)
    t_inv = _block_merge(a, d, r, eye, SUB, F32)  # [BT, BT]

    # k and v are (re)loaded here, not kept through the solve: fewer live registers (L2 hits).
    k = load_keys(k_ptr, start, r, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    w = dot_lp(t_inv, k * (beta * tl.exp(gc))[:, None], F32)  # W = T (β K ⊙ exp(G))
    store_rows(w_ptr, start, r, valid, head, offs_h, mask_h, w, NV, H)
    v = tl.load(tile(v_ptr, start, r, head, offs_v, NV, HV),  # [BT, BLOCK_HV]
                mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    u = dot_lp(t_inv, v * beta[:, None], F32)  # U = T (β V)
    store_rows(u_ptr, start, r, valid, head, offs_v, mask_v, u, NV, HV)


@triton.jit
def _pair_unstack(x):
    """The two `[M, N]` tiles of a `[2, M, N]` one."""
    return tl.split(tl.permute(x, (1, 2, 0)))


@triton.jit
def _diag_blocks(a, SB: tl.constexpr, BT: tl.constexpr):
    """The `BT // SB` diagonal SB × SB blocks of `a` `[BT, BT]`, `[BT // SB, SB, SB]`."""
    NB: tl.constexpr = BT // SB
    a4 = tl.reshape(a, (NB, SB, NB, SB))
    rows = tl.arange(0, NB)[:, None, None, None]
    cols = tl.arange(0, NB)[None, None, :, None]
    return tl.sum(tl.where(rows == cols, a4, 0.0), axis=2)


@triton.jit
def _block_diag(d, SB: tl.constexpr, BT: tl.constexpr):
    """`[BT, BT]` block-diagonal from its `BT // SB` diagonal blocks `d` `[BT // SB, SB, SB]`."""
    NB: tl.constexpr = BT // SB
    d4 = tl.broadcast_to(tl.reshape(d, (NB, SB, 1, SB)), (NB, SB, NB, SB))
    rows = tl.arange(0, NB)[:, None, None, None]
    cols = tl.arange(0, NB)[None, None, :, None]
    return tl.reshape(tl.where(rows == cols, d4, 0.0), (BT, BT))


@triton.jit
def _pair_subst_blocks(a0, a1, SB: tl.constexpr, BT: tl.constexpr, F32: tl.constexpr):
    """`_block_subst` on the diagonal SB × SB blocks of both heads' A as one batch
    `[2 BT / SB, SB, SB]`: each step one batched `[8, 16, 16] × [8, 16, 16]` dot (only the
    blocks' own work; a batch of 8 spreads over the warps, mma.sync). A 3-D dot puts every warp
    on its batch axis in Triton 3.6, so only this batch of 8 is 3-D; the `[C, C]` products stay
    2-D, per head. Returns both block-diagonal inverses `[BT, BT]`."""
    NB: tl.constexpr = BT // SB
    ab = tl.permute(tl.join(_diag_blocks(a0, SB, BT), _diag_blocks(a1, SB, BT)), (3, 0, 1, 2))
    ab = tl.reshape(ab, (2 * NB, SB, SB))  # [head · NB + block, i, j]
    i_r = tl.arange(0, SB)
    d = tl.broadcast_to(tl.where(i_r[:, None] == i_r[None, :], 1.0, 0.0)[None, :, :],
                        (2 * NB, SB, SB))
    for i in range(1, SB):
        sel = (i_r == i)[None, :, None]
        d = tl.where(sel, d - dot_lp(ab, d, F32), d)
    d0, d1 = _pair_unstack(tl.reshape(d, (2, NB * SB, SB)))
    return (_block_diag(tl.reshape(d0, (NB, SB, SB)), SB, BT),
            _block_diag(tl.reshape(d1, (NB, SB, SB)), SB, BT))


@triton.jit
def _pair_merge(a0, a1, d0, d1, r, INNER: tl.constexpr, F32: tl.constexpr):
    """`_block_merge` on two matrices, dot by dot interleaved (two independent chains)."""
    outer = (r[:, None] // (4 * INNER)) == (r[None, :] // (4 * INNER))
    off = outer & ((r[:, None] // INNER) != (r[None, :] // INNER))
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    nil0 = dot_lp(d0, tl.where(off, a0, 0.0), F32)
    nil1 = dot_lp(d1, tl.where(off, a1, 0.0), F32)
    sq0 = dot_lp(nil0, nil0, F32)
    sq1 = dot_lp(nil1, nil1, F32)
    m0 = dot_lp(eye - nil0, eye + sq0, F32)
    m1 = dot_lp(eye - nil1, eye + sq1, F32)
    return dot_lp(m0, d0, F32), dot_lp(m1, d1, F32)


@triton.jit
def _pair_scores(qk, gc, p_ptr, start, r, valid, head, NV: tl.constexpr, BT: tl.constexpr):
    """P = (Q Kᵀ) ⊙ L of value head `head` from the shared `qk` (scaled Q times Kᵀ), stored:
    `intra_kernel`'s arithmetic in its order."""
    causal = r[:, None] >= r[None, :]
    pdecay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    scores = tl.where(causal, qk * pdecay, 0.0)
    store_rows(p_ptr, start, r, valid, head, r, r < BT, scores, NV, BT)


@triton.jit
def intra_pair_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cstart_ptr, clen_ptr,  # as `intra_kernel`'s
    gcum_ptr, w_ptr, u_ptr, kn_ptr, p_ptr,
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    F32: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    STORE_KN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    HEAD_MAJOR: tl.constexpr = False,
    STORE_QN: tl.constexpr = False,
    QN_OFF: tl.constexpr = 0,
):
    """`intra_kernel` for value heads 2j and 2j + 1, grid `(chunks, Nv / 2)` (`(Nv / 2, chunks)`
    if HEAD_MAJOR): G, P and the normalised keys / queries exactly as `intra_kernel` stores them;
    A from one K Kᵀ; the diagonal blocks of both heads inverted together
    (`_pair_subst_blocks`), then the two 4-dot merges interleaved."""
    tl.static_assert(BT == 4 * SUB and (NV // NK) % 2 == 0)
    if HEAD_MAJOR:
        ci = tl.program_id(1)
        pair = tl.program_id(0)
    else:
        ci = tl.program_id(0)
        pair = tl.program_id(1)
    h0 = 2 * pair
    h1 = h0 + 1
    kh = h0 // (NV // NK)
    start = tl.load(cstart_ptr + ci)
    n = tl.load(clen_ptr + ci)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_v = offs_v < HV
    r = tl.arange(0, BT)
    valid = r < n

    # The prologue's loads all issued before its first store (a store the compiler cannot tell
    # apart from a later load's address would hold that load back).
    k = load_keys(k_ptr, start, r, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    q = load_keys(q_ptr, start, r, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    beta0, gc0 = _head_gates(g_ptr, beta_ptr, start, r, valid, h0, NV)
    beta1, gc1 = _head_gates(g_ptr, beta_ptr, start, r, valid, h1, NV)
    tl.store(col(gcum_ptr, start, r, h0, NV), gc0, mask=valid)
    tl.store(col(gcum_ptr, start, r, h1, NV), gc1, mask=valid)
    first = valid & (h0 % (NV // NK) == 0)  # the key head's first pair stores its keys
    if STORE_KN:
        store_rows(kn_ptr, start, r, first, kh, offs_h, mask_h, k, NK, H)
    if STORE_QN:
        store_rows(kn_ptr + QN_OFF, start, r, first, kh, offs_h, mask_h, q * SCALE, NK, H)
    qk = dot_lp(q * SCALE, tl.trans(k), F32)  # one Q Kᵀ for both heads' P
    _pair_scores(qk, gc0, p_ptr, start, r, valid, h0, NV, BT)
    _pair_scores(qk, gc1, p_ptr, start, r, valid, h1, NV, BT)

    # A_h = StrictLower(β_h (K Kᵀ) ⊙ L_h), one K Kᵀ for both heads.
    lower = r[:, None] > r[None, :]
    kk = dot_lp(k, tl.trans(k), F32)
    a0 = tl.where(lower, beta0[:, None] * kk
                  * tl.exp(tl.where(lower, gc0[:, None] - gc0[None, :], float("-inf"))), 0.0)
    a1 = tl.where(lower, beta1[:, None] * kk
                  * tl.exp(tl.where(lower, gc1[:, None] - gc1[None, :], float("-inf"))), 0.0)
    d0, d1 = _pair_subst_blocks(a0, a1, SUB, BT, F32)
    t0, t1 = _pair_merge(a0, a1, d0, d1, r, SUB, F32)

    # W = T (β K ⊙ exp(G)) of both heads (K reloaded), then U = T (β V) with both heads' v
    # loaded together.
    k = load_keys(k_ptr, start, r, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    store_rows(w_ptr, start, r, valid, h0, offs_h, mask_h,
               dot_lp(t0, k * (beta0 * tl.exp(gc0))[:, None], F32), NV, H)
    store_rows(w_ptr, start, r, valid, h1, offs_h, mask_h,
               dot_lp(t1, k * (beta1 * tl.exp(gc1))[:, None], F32), NV, H)
    vmask = valid[:, None] & mask_v[None, :]
    v0 = tl.load(tile(v_ptr, start, r, h0, offs_v, NV, HV), mask=vmask, other=0.0)
    v1 = tl.load(tile(v_ptr, start, r, h1, offs_v, NV, HV), mask=vmask, other=0.0)
    store_rows(u_ptr, start, r, valid, h0, offs_v, mask_v,
               dot_lp(t0, v0.to(tl.float32) * beta0[:, None], F32), NV, HV)
    store_rows(u_ptr, start, r, valid, h1, offs_v, mask_v,
               dot_lp(t1, v1.to(tl.float32) * beta1[:, None], F32), NV, HV)
