"""Triton chunked (WY) gated delta rule for prefill: three kernels, fla's pipeline.

Chunks of `C = 64` tokens never cross a sequence boundary (`B` rows of T tokens, or the packed
sequences of `cu_seqlens`); a chunk table built in XLA (`_chunk_tables`) gives every chunk slot its
first token and length (0 for the unused slots of the static varlen bound). Per chunk and value
head, with `G` the chunk-local cumulative sum of g and `L_ij = exp(G_i − G_j)` for `j <= i`:

1. `_intra_kernel`, grid `(chunks, Nv)`: `G` (stored, float32); the strictly lower
   `A = (β K Kᵀ) ⊙ L` `[C, C]`; `T = (I + A)⁻¹` in registers: forward substitution inside the four
   16 × 16 diagonal blocks (15 steps, each one `[C, C]` dot over all four blocks at once), then
   the blocks below through the nilpotent block-lower remainder (4 dots, see the kernel); the WY
   pair `W = T (β K ⊙ exp(G))` `[C, H]` and `U = T (β V)` `[C, Hv]`, stored.
2. `_state_kernel`, grid `(Ns, Nv, cdiv(Hv, BLOCK_HV))`: the sequential part. One program walks
   its sequence's chunks with a `[H, BLOCK_HV]` float32 state tile in registers: it stores the
   state entering each chunk, `V_new = U − W S` (stored), then
   `S ← exp(G_C) S + (K ⊙ exp(G_C − G))ᵀ V_new`; the last state is the final state.
3. `_output_kernel`, grid `(chunks, Nv, cdiv(Hv, BLOCK_HV))`, parallel over chunks:
   `O = (Q ⊙ exp(G)) S_in + ((Q Kᵀ) ⊙ L) V_new`.

q and k are l2-normalised (optional) and q scaled inside the kernels that read them, so nothing
is precomputed in XLA. Value head h reads key head `h // (Nv // Nk)`. Arithmetic is float32.
With float32 q, k and v everything is float32, the dots in 3-pass TF32 (`tf32x3`, about float32
accuracy on tensor cores; IEEE dots spilled tens of KB in ptxas; the interpreter tests match the
float64 recurrence to ~1e-6). Otherwise, as fla: intermediates (W, U, V_new, per-chunk states) in
v's dtype; `K Kᵀ`, `T K`, `T V`, `W S` and `Kᵀ V_new` with bf16 operands and float32
accumulation; the `(I + A)⁻¹` solve and the output kernel's products in TF32 (bf16 there doubled
the output error in the interpreter and made ptxas spill); the state carried from chunk to chunk
stays float32 in registers.

`Config`'s speed options (off in `Config()`; each tested in the interpreter, compiled for sm_90a
by the tests and timed on an H100 by `experiments/profile_gdn_chunk.py --variants`, NOTES.md
sessions 4-7): the solve's variants (`solve`, `solve_bf16`), bf16 output dots (`out_bf16`), the
state update's decay on V_new (`decay_on_v`), int32 address tiles (`i32_offsets`), normalised
keys stored once (`store_kn`), table-free chunk addressing in the sequential loop
(`affine_state`), the state kernel's own warps / stages, and `fuse_output`: the output written by
the state kernel (no per-chunk states or V_new in HBM, no third kernel). Session 5 (each bitwise
the other options' results in the interpreter): each state step's loads issued together
(`state_prefetch`), the grids' launch orders (`state_slice_major`, `intra_head_major`), P made by
the state kernel (`qk_in_state`), the normalised queries stored once (`store_qn`). Session 7:
one intra program per pair of value heads (`intra_pairs`, `_intra_pair_kernel`: both heads'
diagonal blocks solved as one batch), the state step's non-dot loads (gates, U) a chunk ahead
(`state_gates_ahead`, `state_u_ahead`). Session 8: the state loop three stages deep (Triton
issues a step's copies for the next chunk at the step's end, after its dots) and the value-slice
width chosen by waves x step time. `default_config` turns on the combinations that measured
fastest; bytes and latencies per kernel in the comments above it.

Supports: any B, T, Nk | Nv, H and Hv (padded to powers of two >= 16 and masked), initial and
final states `[Ns, Nv, H, Hv]` float32, varlen with empty sequences, gradients (the XLA
reference's VJP). Not supported: chunk sizes other than 64.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl

from attn._harness import triton_call
from attn.gdn import reference
from attn.gdn.reference import L2NORM_EPS

CHUNK = 64
_SUB = 16  # rows of the blocks the (I + A)⁻¹ solve works on; CHUNK == 4 * _SUB
SOLVES = ("subst", "subst_hoist", "nested", "stacked")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """Launch configuration: value features per program of the state and output kernels, warps
    of those two and of the intra-chunk kernel, software pipeline stages.

    H100 sweeps (benchmarks/NOTES.md; Nk16 Nv32 H = Hv = 128, bf16, whole op). Session 3: 4
    intra-chunk warps 4.52 ms at B1 T32K and 4.61 ms at B8 T4K against 5.27 / 5.44 ms with 8; the
    tiles are within ~10% of the best single change. Session 4 (`experiments.profile_gdn_chunk`,
    per kernel): the speed options below, all on except `fuse_output`, take B1 T32K from 4.49 to
    3.21 ms and B8 T4K from 4.61 to 3.27 ms (intra 1.25 -> 0.81, state 1.40 -> 1.28, output
    2.04 -> 1.22 ms); output within 4e-3 (relative) of the former defaults'. `fuse_output` with
    the state / output options: 3.08 / 3.21 ms, but its state kernel (the output dots inside the
    sequential loop) takes 1.76 ms.
    """

    block_hv_state: int = 32
    block_hv_out: int = 64
    num_warps: int = 8
    intra_warps: int = 4
    num_stages: int = 2
    # Speed options (static; on the float32 path the bf16 ones do nothing and the others
    # rearrange the same float32 algebra):
    # `solve`: "subst" (15 forward-substitution dots inside the 16-row blocks, then the 4-block
    # merge: 19 [C, C] dots), "subst_hoist" (the same, the dot's A operand loop-invariant: its
    # per-step row mask moved to the result, same values), "nested" (forward substitution in
    # 4-row blocks, merged to 16 and then to 64 rows: 3 + 4 + 4 = 11 dots), "stacked" (as
    # "subst_hoist" with the 16-row blocks' inverse kept as [C, 16]: 15 [C, C] x [C, 16] dots,
    # then the merge's 4).
    solve: str = "stacked"
    solve_bf16: bool = True  # the solve's dots with bf16 operands (float32 accumulation)
    out_bf16: bool = True  # output kernel dots with bf16 operands (fla's), exp(G) after Q S
    decay_on_v: bool = True  # state update scales V_new's rows [C, BLOCK_HV], not K [C, H]
    # int32 per-element offsets after an int64 per-chunk base (fewer registers and 64-bit
    # multiplies in the address tiles; the same addresses).
    i32_offsets: bool = True
    # With l2-norm: the intra kernel also writes the normalised keys [B·T, Nk, H] (v's dtype;
    # +2 bytes per key element written) and the state and output kernels read them instead of
    # normalising k again; with `decay_on_v` (state) / `out_bf16` (output) and bf16 inputs they
    # go into the dots as loaded.
    store_kn: bool = True
    # Without cu_seqlens the state kernel computes each chunk's first token and length from its
    # index (no two dependent table loads per step of its sequential loop).
    affine_state: bool = True
    # The state kernel's launch on its own (0: `num_warps` / `num_stages`, as the output kernel).
    state_warps: int = 0
    state_stages: int = 0
    # No output kernel: the intra kernel also stores P = (Q Kᵀ) ⊙ L [B·T, Nv, C] (v's dtype) and
    # the state kernel writes O chunk by chunk from the state it holds: the per-chunk states
    # (the largest intermediate, written and read once each) and V_new never reach HBM. The
    # output's dots follow `out_bf16`; they sit off the sequential S chain but in its loop.
    fuse_output: bool = False
    # Session-5 options (off in `Config()`; `default_config` takes `store_qn` and the head-major
    # grids: NOTES.md sessions 5-8, byte / latency arithmetic in the comments above
    # `default_config`). `state_prefetch`: the state kernel's chunk loop with every global load
    # of a step issued together at its top, not each right before its dot. Same arithmetic in
    # the same order. Triton already software-pipelines the loop's loads a chunk ahead (async
    # copies to shared memory; `num_stages` / `state_stages` deep), so expect ~no change.
    state_prefetch: bool = False
    # State grid `(slices, Nv, Ns)`, not `(Ns, Nv, slices)`: the value slices of one head (which
    # read the same W, K, Q, P) and the two heads of a key head launch next to one another, so
    # their re-reads hit L2 (with Ns >= 2 the slices otherwise launch ~a wave apart).
    # Sequences <= 65535.
    state_slice_major: bool = False
    # Intra grid `(Nv, chunks)`: the value heads of a chunk launch together (k / q read once
    # from HBM per key head, the W / U / P rows of a chunk written together). Chunks <= 65535.
    intra_head_major: bool = False
    # With `fuse_output`: the state kernel computes P = (Q Kᵀ) ⊙ L itself from the Q and K tiles
    # it loads anyway (one more [C, H] x [H, C] dot per step and value slice, off the S chain);
    # the intra kernel neither reads q nor writes P.
    qk_in_state: bool = False
    # With `fuse_output`, `store_kn` and l2-norm: the intra kernel also writes the queries
    # normalised and scaled (v's dtype, after the keys in the same buffer), and the state kernel
    # puts them into its dots as loaded, instead of re-normalising Q ([C, H] float32: cast,
    # square, row sum, rsqrt, scale) on every chunk step of every value slice.
    store_qn: bool = False
    # Session 7: one intra program per pair of value heads of a key head (`_intra_pair_kernel`;
    # Nv // Nk even, the "stacked" solve), half the programs: K loaded, normalised and
    # multiplied by itself once, the two heads' 16 x 16 diagonal blocks inverted as one batch
    # of 3-D dots (`[8, 16, 16] x [8, 16, 16]`: the blocks' own work, a quarter of a stacked
    # step's, both chains in each instruction). H100 intra ms at B1 T32K / B8 T4K: 1.01-1.02 /
    # 0.95-0.96 per head, 0.73-0.75 / 0.71-0.72 in pairs. Also measured (NOTES.md, session 7):
    # the stacked steps as 3-D `[2, C, C] x [2, C, 16]` dots 2.72 / 2.66 (Triton 3.6 puts every
    # warp on the batch axis of 2: each step runs twice), two 2-D chains interleaved 0.78 /
    # 0.73, 8 warps 1.23-1.61. Same algebra as the per-head kernel but for β applied to K Kᵀ's
    # rows after the dot instead of to K before it (W / U round differently in bf16; G, P and
    # the normalised keys / queries bitwise the same). sm_90a at 4 warps ~251 registers, no
    # spills, 48 KB shared.
    intra_pairs: bool = False
    # The state kernel's per-chunk gates (G [C], strided by Nv, and G_C) loaded one chunk ahead
    # into registers and carried, in the loop of `state_prefetch` / `qk_in_state` / `store_qn`.
    # Triton's pipeliner prefetches only the dots' operands (W, U, K, Q, P), so those two loads
    # otherwise wait out a full L2 / DRAM latency inside every step of the sequential chain.
    state_gates_ahead: bool = False
    # The same for U's rows (`U − W S`: an operand of a subtraction, not of a dot, so not
    # prefetched by the pipeliner either).
    state_u_ahead: bool = False

    def __post_init__(self):
        if self.intra_pairs and self.solve != "stacked":
            raise ValueError(f"intra_pairs needs solve='stacked', not {self.solve!r}")
        for name in ("qk_in_state", "store_qn"):
            if getattr(self, name) and not self.fuse_output:
                raise ValueError(f"{name} needs fuse_output")
        if self.solve not in SOLVES:
            raise ValueError(f"solve={self.solve!r} must be one of {SOLVES}")
        for name in ("block_hv_state", "block_hv_out"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        for name in ("num_warps", "intra_warps", "state_warps"):
            value = getattr(self, name)
            if name == "state_warps" and value == 0:
                continue
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 1")
        if self.num_stages < 1:
            raise ValueError(f"{self.num_stages=} must be >= 1")
        if self.state_stages < 0:
            raise ValueError(f"{self.state_stages=} must be >= 0 (0: num_stages)")


@triton.jit
def _dot_lp(a, b, F32: tl.constexpr):
    """Product of input-sized operands: 3-pass TF32 for float32 inputs (`F32`), else both rounded to
    bf16 (tensor cores at full rate, float32 accumulation), as fla does."""
    if F32:
        out = tl.dot(a, b, input_precision="tf32x3")
    else:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    return out


@triton.jit
def _sdot(a, b, F32: tl.constexpr, LP: tl.constexpr):
    """A solve / output product: 3-pass TF32 for float32 inputs (`F32`), bf16 operands with
    float32 accumulation if `LP`, TF32 otherwise. (One return: the compiler traces the
    statements after a constexpr-taken `return` too.)"""
    if F32:
        out = tl.dot(a, b, input_precision="tf32x3")
    elif LP:
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32")
    return out


@triton.jit
def _block_subst(a, r, eye, SB: tl.constexpr, HOIST: tl.constexpr, F32: tl.constexpr,
                 LP: tl.constexpr):
    """Inverse of `I + A` on its SB × SB diagonal blocks (block-diagonal, zero elsewhere) by
    forward substitution, all blocks at once: step i sets row i of every block,
    `d[r] = e_r − Σ_{s<r} a[r, s] d[s]`. `HOIST`: the dot's A operand is the same every step
    (the step's row mask applies to the result only, which gives the same rows)."""
    same = (r[:, None] // SB) == (r[None, :] // SB)
    a_diag = tl.where(same, a, 0.0)
    d = eye
    for i in range(1, SB):
        sel = (r % SB == i)[:, None]
        if HOIST:
            d = tl.where(sel, d - _sdot(a_diag, d, F32, LP), d)
        else:
            d = tl.where(sel, d - _sdot(tl.where(sel, a_diag, 0.0), d, F32, LP), d)
    return d


@triton.jit
def _block_subst_stacked(a, r, SB: tl.constexpr, BT: tl.constexpr, F32: tl.constexpr,
                         LP: tl.constexpr):
    """`_block_subst` (hoisted) with the inverse kept as its SB × SB diagonal blocks stacked,
    `d[r, c] = D[r, SB (r // SB) + c]` `[BT, SB]`: each step one `[BT, BT] × [BT, SB]` dot (a
    quarter of the square one's work, a quarter of its operand shuffles); expanded to the
    block-diagonal `[BT, BT]` at the end."""
    same = (r[:, None] // SB) == (r[None, :] // SB)
    a_diag = tl.where(same, a, 0.0)
    c = tl.arange(0, SB)
    d = tl.where((r % SB)[:, None] == c[None, :], 1.0, 0.0)
    for i in range(1, SB):
        sel = (r % SB == i)[:, None]
        d = tl.where(sel, d - _sdot(a_diag, d, F32, LP), d)
    full = tl.reshape(tl.broadcast_to(d[:, None, :], (BT, BT // SB, SB)), (BT, BT))
    return tl.where(same, full, 0.0)


@triton.jit
def _block_merge(a, d, r, eye, INNER: tl.constexpr, F32: tl.constexpr, LP: tl.constexpr):
    """`(I + A)⁻¹` on the 4·INNER-row diagonal blocks from `d`, the inverse on the INNER-row ones:
    with `N = D A_off` (A_off: A inside the outer blocks, off the inner ones; strictly
    block-lower, N⁴ = 0), `I + A = D⁻¹ (I + N)`, so `(I + A)⁻¹ = (I − N)(I + N²) D` (4 dots)."""
    outer = (r[:, None] // (4 * INNER)) == (r[None, :] // (4 * INNER))
    off = outer & ((r[:, None] // INNER) != (r[None, :] // INNER))
    nil = _sdot(d, tl.where(off, a, 0.0), F32, LP)
    return _sdot(_sdot(eye - nil, eye + _sdot(nil, nil, F32, LP), F32, LP), d, F32, LP)


@triton.jit
def _tile(ptr, start, r, I32: tl.constexpr, head, offs, NH: tl.constexpr, D: tl.constexpr):
    """Pointers `[start + r, offs]` of head `head` in a token-major `[N_TOK, NH, D]` tensor;
    `I32`: one int64 scalar base, int32 per-element offsets (same addresses)."""
    if I32:
        p = (ptr + (start.to(tl.int64) * NH + head) * D) + ((r * (NH * D))[:, None]
                                                            + offs[None, :])
    else:
        p = ptr + ((start + r).to(tl.int64) * NH + head)[:, None] * D + offs[None, :]
    return p


@triton.jit
def _col(ptr, start, r, I32: tl.constexpr, head, NH: tl.constexpr):
    """Pointers `[start + r]` of head `head` in a token-major `[N_TOK, NH]` tensor."""
    if I32:
        p = (ptr + (start.to(tl.int64) * NH + head)) + r * NH
    else:
        p = ptr + (start + r).to(tl.int64) * NH + head
    return p


@triton.jit
def _load_keys(k_ptr, start, r, I32: tl.constexpr, valid, kh, offs_h, mask_h, EPS: tl.constexpr,
               L2NORM: tl.constexpr, NK: tl.constexpr, H: tl.constexpr, RAW: tl.constexpr = False):
    """`[rows, BLOCK_H]` float32 keys of key head kh at tokens `start + r` (zero rows where not
    valid); `RAW`: as stored (no cast, no l2-norm), for a dot that takes them as they are."""
    k = tl.load(_tile(k_ptr, start, r, I32, kh, offs_h, NK, H),
                mask=valid[:, None] & mask_h[None, :], other=0.0)
    if not RAW:
        k = k.to(tl.float32)
        if L2NORM:
            k = k * tl.math.rsqrt(tl.sum(k * k, axis=1) + EPS)[:, None]
    return k


@triton.jit
def _store_rows(ptr, start, r, I32: tl.constexpr, valid, head, offs, mask, x, NV: tl.constexpr,
                D: tl.constexpr):
    tl.store(_tile(ptr, start, r, I32, head, offs, NV, D), x.to(ptr.dtype.element_ty),
             mask=valid[:, None] & mask[None, :])


@triton.jit
def _head_gates(g_ptr, beta_ptr, start, r, I32: tl.constexpr, valid, head, NV: tl.constexpr):
    """β and G `[BT]` (chunk-local cumulative sum of g; padding adds 0) of value head `head`."""
    beta = tl.load(_col(beta_ptr, start, r, I32, head, NV), mask=valid, other=0.0).to(tl.float32)
    gc = tl.cumsum(tl.load(_col(g_ptr, start, r, I32, head, NV), mask=valid,
                           other=0.0).to(tl.float32), axis=0)
    return beta, gc


@triton.jit
def _intra_kernel(
    q_ptr,  # [N_TOK, NK, H] (read if FUSE)
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
    p_ptr,  # [N_TOK, NV, BT] P = (Q Kᵀ) ⊙ L (causal, diagonal included), out if FUSE
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    F32: tl.constexpr,
    I32: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    HOIST: tl.constexpr,
    STACKED: tl.constexpr,
    SOLVE_LP: tl.constexpr,
    STORE_KN: tl.constexpr,
    FUSE: tl.constexpr,
    OUT_LP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    HEAD_MAJOR: tl.constexpr = False,
    STORE_QN: tl.constexpr = False,
    QN_OFF: tl.constexpr = 0,
):
    tl.static_assert(BT == 64 and (SUB == 16 or SUB == 4))  # merges by fours rely on N⁴ = 0
    if HEAD_MAJOR:  # grid (Nv, chunks): a chunk's value heads (a key head's pair) side by side
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

    k = _load_keys(k_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    beta, gc = _head_gates(g_ptr, beta_ptr, start, r, I32, valid, head, NV)
    tl.store(_col(gcum_ptr, start, r, I32, head, NV), gc, mask=valid)
    if STORE_KN:  # by the first value head of each key head
        _store_rows(kn_ptr, start, r, I32, valid & (head % (NV // NK) == 0), kh, offs_h, mask_h,
                    k, NK, H)
    if STORE_QN:
        qs = _load_keys(q_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
        _store_rows(kn_ptr + QN_OFF, start, r, I32, valid & (head % (NV // NK) == 0), kh, offs_h,
                    mask_h, qs * SCALE, NK, H)

    # A = StrictLower((β K Kᵀ) ⊙ L), [BT, BT]; the mask comes before the exp (no overflow).
    lower = r[:, None] > r[None, :]
    decay = tl.exp(tl.where(lower, gc[:, None] - gc[None, :], float("-inf")))
    a = tl.where(lower, _dot_lp(k * beta[:, None], tl.trans(k), F32) * decay, 0.0)
    if FUSE:  # the output's intra-chunk scores, for the state kernel (the output kernel's)
        q = _load_keys(q_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
        causal = r[:, None] >= r[None, :]
        pdecay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
        scores = tl.where(causal, _sdot(q * SCALE, tl.trans(k), F32, OUT_LP) * pdecay, 0.0)
        _store_rows(p_ptr, start, r, I32, valid, head, r, r < BT, scores, NV, BT)
    # (I + A)⁻¹: forward substitution inside the SUB × SUB diagonal blocks (the block-diagonal
    # inverse D), then merged by fours (`_block_merge`) up to BT rows: SUB = 16 one merge,
    # SUB = 4 ("nested") two.
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    if STACKED:
        d = _block_subst_stacked(a, r, SUB, BT, F32, SOLVE_LP)
    else:
        d = _block_subst(a, r, eye, SUB, HOIST, F32, SOLVE_LP)
    if SUB == 4:
        d = _block_merge(a, d, r, eye, 4, F32, SOLVE_LP)
    t_inv = _block_merge(a, d, r, eye, 16, F32, SOLVE_LP)  # [BT, BT]

    # k and v are (re)loaded here, not kept through the solve: fewer live registers (L2 hits).
    k = _load_keys(k_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    w = _dot_lp(t_inv, k * (beta * tl.exp(gc))[:, None], F32)  # W = T (β K ⊙ exp(G))
    _store_rows(w_ptr, start, r, I32, valid, head, offs_h, mask_h, w, NV, H)
    v = tl.load(_tile(v_ptr, start, r, I32, head, offs_v, NV, HV),  # [BT, BLOCK_HV]
                mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    u = _dot_lp(t_inv, v * beta[:, None], F32)  # U = T (β V)
    _store_rows(u_ptr, start, r, I32, valid, head, offs_v, mask_v, u, NV, HV)


# `Config.intra_pairs`: one intra program per pair of value heads of a key head (value heads
# 2j and 2j + 1, of key head 2j // (Nv // Nk); Nv // Nk even). K is loaded, normalised and
# multiplied by itself once ([C, C], β applied to its rows afterwards, not to K before the
# dot), P's Q Kᵀ once; the two heads' solves run side by side: two independent dependent chains
# in one instruction stream, so each hides the other's dot latency.


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
def _pair_subst_blocks(a0, a1, SB: tl.constexpr, BT: tl.constexpr, F32: tl.constexpr,
                       LP: tl.constexpr):
    """`_block_subst` on the diagonal SB × SB blocks of both heads' A as one batch
    `[2 BT / SB, SB, SB]`: each step one batched `[8, 16, 16] × [8, 16, 16]` dot (only the
    blocks' own work, a quarter of the stacked step's; a batch of 8 spreads over the warps,
    mma.sync); returns both block-diagonal inverses `[BT, BT]`."""
    NB: tl.constexpr = BT // SB
    ab = tl.permute(tl.join(_diag_blocks(a0, SB, BT), _diag_blocks(a1, SB, BT)), (3, 0, 1, 2))
    ab = tl.reshape(ab, (2 * NB, SB, SB))  # [head · NB + block, i, j]
    i_r = tl.arange(0, SB)
    d = tl.broadcast_to(tl.where(i_r[:, None] == i_r[None, :], 1.0, 0.0)[None, :, :],
                        (2 * NB, SB, SB))
    for i in range(1, SB):
        sel = (i_r == i)[None, :, None]
        d = tl.where(sel, d - _sdot(ab, d, F32, LP), d)
    d0, d1 = _pair_unstack(tl.reshape(d, (2, NB * SB, SB)))
    return (_block_diag(tl.reshape(d0, (NB, SB, SB)), SB, BT),
            _block_diag(tl.reshape(d1, (NB, SB, SB)), SB, BT))


@triton.jit
def _pair_merge(a0, a1, d0, d1, r, INNER: tl.constexpr, F32: tl.constexpr, LP: tl.constexpr):
    """`_block_merge` on two matrices, dot by dot interleaved (two independent chains)."""
    outer = (r[:, None] // (4 * INNER)) == (r[None, :] // (4 * INNER))
    off = outer & ((r[:, None] // INNER) != (r[None, :] // INNER))
    eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    nil0 = _sdot(d0, tl.where(off, a0, 0.0), F32, LP)
    nil1 = _sdot(d1, tl.where(off, a1, 0.0), F32, LP)
    sq0 = _sdot(nil0, nil0, F32, LP)
    sq1 = _sdot(nil1, nil1, F32, LP)
    m0 = _sdot(eye - nil0, eye + sq0, F32, LP)
    m1 = _sdot(eye - nil1, eye + sq1, F32, LP)
    return _sdot(m0, d0, F32, LP), _sdot(m1, d1, F32, LP)


@triton.jit
def _pair_scores(qk, gc, p_ptr, start, r, I32: tl.constexpr, valid, head, NV: tl.constexpr,
                 BT: tl.constexpr):
    """P = (Q Kᵀ) ⊙ L of value head `head` from the shared `qk` (scaled Q times Kᵀ), stored:
    `_intra_kernel`'s arithmetic in its order."""
    causal = r[:, None] >= r[None, :]
    pdecay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
    scores = tl.where(causal, qk * pdecay, 0.0)
    _store_rows(p_ptr, start, r, I32, valid, head, r, r < BT, scores, NV, BT)


@triton.jit
def _intra_pair_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, cstart_ptr, clen_ptr,  # as `_intra_kernel`'s
    gcum_ptr, w_ptr, u_ptr, kn_ptr, p_ptr,
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    F32: tl.constexpr,
    I32: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    SUB: tl.constexpr,
    HOIST: tl.constexpr,
    STACKED: tl.constexpr,
    SOLVE_LP: tl.constexpr,
    STORE_KN: tl.constexpr,
    FUSE: tl.constexpr,
    OUT_LP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    HEAD_MAJOR: tl.constexpr = False,
    STORE_QN: tl.constexpr = False,
    QN_OFF: tl.constexpr = 0,
):
    """`_intra_kernel` for value heads 2j and 2j + 1 (`Config.intra_pairs`), grid
    `(chunks, Nv / 2)` (`(Nv / 2, chunks)` if HEAD_MAJOR): G, P and the normalised keys /
    queries exactly as `_intra_kernel` stores them; A from one K Kᵀ; the 16-row diagonal blocks
    of both heads inverted together as one batch of 3-D dots (`_pair_subst_blocks`), then the
    two 4-dot merges interleaved. (A 3-D dot puts all warps on its batch axis in Triton 3.6, so
    only the batch of 8 blocks is 3-D; the [C, C] products stay 2-D, per head.)"""
    tl.static_assert(BT == 64 and SUB == 16 and STACKED and (NV // NK) % 2 == 0)
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
    k = _load_keys(k_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    if FUSE or STORE_QN:  # loaded once for both (`_intra_kernel` loads it twice)
        q = _load_keys(q_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    beta0, gc0 = _head_gates(g_ptr, beta_ptr, start, r, I32, valid, h0, NV)
    beta1, gc1 = _head_gates(g_ptr, beta_ptr, start, r, I32, valid, h1, NV)
    tl.store(_col(gcum_ptr, start, r, I32, h0, NV), gc0, mask=valid)
    tl.store(_col(gcum_ptr, start, r, I32, h1, NV), gc1, mask=valid)
    first = valid & (h0 % (NV // NK) == 0)  # the key head's first pair stores its keys
    if STORE_KN:
        _store_rows(kn_ptr, start, r, I32, first, kh, offs_h, mask_h, k, NK, H)
    if STORE_QN:
        _store_rows(kn_ptr + QN_OFF, start, r, I32, first, kh, offs_h, mask_h, q * SCALE, NK, H)
    if FUSE:  # one Q Kᵀ for both heads' P
        qk = _sdot(q * SCALE, tl.trans(k), F32, OUT_LP)
        _pair_scores(qk, gc0, p_ptr, start, r, I32, valid, h0, NV, BT)
        _pair_scores(qk, gc1, p_ptr, start, r, I32, valid, h1, NV, BT)

    # A_h = StrictLower(β_h (K Kᵀ) ⊙ L_h), one K Kᵀ for both heads.
    lower = r[:, None] > r[None, :]
    kk = _dot_lp(k, tl.trans(k), F32)
    a0 = tl.where(lower, beta0[:, None] * kk
                  * tl.exp(tl.where(lower, gc0[:, None] - gc0[None, :], float("-inf"))), 0.0)
    a1 = tl.where(lower, beta1[:, None] * kk
                  * tl.exp(tl.where(lower, gc1[:, None] - gc1[None, :], float("-inf"))), 0.0)
    d0, d1 = _pair_subst_blocks(a0, a1, SUB, BT, F32, SOLVE_LP)
    t0, t1 = _pair_merge(a0, a1, d0, d1, r, 16, F32, SOLVE_LP)

    # W = T (β K ⊙ exp(G)) of both heads (K reloaded), then U = T (β V) with both heads' v
    # loaded together.
    k = _load_keys(k_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H)
    _store_rows(w_ptr, start, r, I32, valid, h0, offs_h, mask_h,
                _dot_lp(t0, k * (beta0 * tl.exp(gc0))[:, None], F32), NV, H)
    _store_rows(w_ptr, start, r, I32, valid, h1, offs_h, mask_h,
                _dot_lp(t1, k * (beta1 * tl.exp(gc1))[:, None], F32), NV, H)
    vmask = valid[:, None] & mask_v[None, :]
    v0 = tl.load(_tile(v_ptr, start, r, I32, h0, offs_v, NV, HV), mask=vmask, other=0.0)
    v1 = tl.load(_tile(v_ptr, start, r, I32, h1, offs_v, NV, HV), mask=vmask, other=0.0)
    _store_rows(u_ptr, start, r, I32, valid, h0, offs_v, mask_v,
                _dot_lp(t0, v0.to(tl.float32) * beta0[:, None], F32), NV, HV)
    _store_rows(u_ptr, start, r, I32, valid, h1, offs_v, mask_v,
                _dot_lp(t1, v1.to(tl.float32) * beta1[:, None], F32), NV, HV)


@triton.jit
def _state_chunk(c, seq, first, cstart_ptr, clen_ptr, T_ROW: tl.constexpr, BT: tl.constexpr,
                 count=0, AHEAD: tl.constexpr = False):
    """First token and length of chunk `c` of the program's sequence (`_state_kernel`'s).
    AHEAD (the loads a chunk ahead, which ask for the chunk after the last): n = 0 from chunk
    `count` on, the table loads masked."""
    if AHEAD:
        ok = c < count
        if T_ROW:
            start = seq * T_ROW + c * BT
            n = tl.where(ok, tl.minimum(T_ROW - c * BT, BT), 0)
        else:
            start = tl.load(cstart_ptr + first + c, mask=ok, other=0)
            n = tl.load(clen_ptr + first + c, mask=ok, other=0)
    elif T_ROW:
        start = seq * T_ROW + c * BT
        n = tl.minimum(T_ROW - c * BT, BT)
    else:
        start = tl.load(cstart_ptr + first + c)
        n = tl.load(clen_ptr + first + c)
    return start, n


@triton.jit
def _rows(ptr, start, n, r, I32: tl.constexpr, head, offs, mask, NH: tl.constexpr,
          D: tl.constexpr):
    """Rows `start + r` (`r < n`) of head `head` of a token-major `[N_TOK, NH, D]` tensor, as
    stored (zeros elsewhere)."""
    return tl.load(_tile(ptr, start, r, I32, head, offs, NH, D),
                   mask=(r < n)[:, None] & mask[None, :], other=0.0)


@triton.jit
def _gates(gcum_ptr, start, n, r, I32: tl.constexpr, head, NV: tl.constexpr,
           AHEAD: tl.constexpr = False):
    """G `[BT]` and G_C (the chunk's last) of one chunk of n >= 1 tokens (AHEAD: n >= 0, zeros
    for none)."""
    gc = tl.load(_col(gcum_ptr, start, r, I32, head, NV), mask=r < n, other=0.0)
    if AHEAD:
        g_last = tl.load(gcum_ptr + (start + n - 1).to(tl.int64) * NV + head, mask=n > 0,
                         other=0.0)
    else:
        g_last = tl.load(gcum_ptr + (start + n - 1).to(tl.int64) * NV + head)
    return gc, g_last


@triton.jit
def _state_tiles(k_ptr, w_ptr, u_ptr, gcum_ptr, q_ptr, p_ptr, start, n, r, I32: tl.constexpr,
                 head, kh, offs_h, mask_h, offs_v, mask_v, FUSE: tl.constexpr, QK: tl.constexpr,
                 NK: tl.constexpr, NV: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
                 BT: tl.constexpr, GATES: tl.constexpr = True, U: tl.constexpr = True):
    """Every global load of one chunk step, issued together and kept as stored (no casts: the
    step converts them), so their latencies overlap one another. `q` / `pm` are `[1, 1]` zeros
    when the step does not read them; so are `gc` / `g_last` without GATES and `u` without U
    (loaded a chunk ahead)."""
    w = _rows(w_ptr, start, n, r, I32, head, offs_h, mask_h, NV, H)  # [BT, BLOCK_H]
    if U:
        u = _rows(u_ptr, start, n, r, I32, head, offs_v, mask_v, NV, HV)  # [BT, BLOCK_HV]
    else:
        u = tl.zeros((1, 1), tl.float32)
    k = _rows(k_ptr, start, n, r, I32, kh, offs_h, mask_h, NK, H)
    if GATES:
        gc, g_last = _gates(gcum_ptr, start, n, r, I32, head, NV)
    else:
        gc = tl.zeros((1,), tl.float32)
        g_last = 0.0
    q = tl.zeros((1, 1), tl.float32)  # placeholders
    pm = tl.zeros((1, 1), tl.float32)
    if FUSE:
        q = _rows(q_ptr, start, n, r, I32, kh, offs_h, mask_h, NK, H)
        if not QK:
            pm = _rows(p_ptr, start, n, r, I32, head, r, r < BT, NV, BT)
    return w, u, k, gc, g_last, q, pm


@triton.jit
def _finish_keys(k, EPS: tl.constexpr, L2NORM: tl.constexpr):
    """`_load_keys`'s float32 cast and l2-norm on keys loaded raw."""
    k = k.to(tl.float32)
    if L2NORM:
        k = k * tl.math.rsqrt(tl.sum(k * k, axis=1) + EPS)[:, None]
    return k


@triton.jit
def _state_step(s, w, u, k, gc, g_last, q, pm, start, n, ci, r, I32: tl.constexpr, head,
                offs_v, mask_v, tile, mask, hbuf_ptr, vnew_ptr, o_ptr, EPS: tl.constexpr,
                L2NORM: tl.constexpr, F32: tl.constexpr, DECAY_V: tl.constexpr,
                FUSE: tl.constexpr, OUT_LP: tl.constexpr, QNORM: tl.constexpr,
                SCALE: tl.constexpr, QK: tl.constexpr, NV: tl.constexpr, H: tl.constexpr,
                HV: tl.constexpr, BT: tl.constexpr, QRAW: tl.constexpr):
    """One chunk of `_state_kernel`'s loop on tiles `_state_tiles` loaded: the same arithmetic
    in the same order; returns the state leaving the chunk."""
    valid = r < n
    if not FUSE:
        tl.store(hbuf_ptr + (ci.to(tl.int64) * NV + head) * (H * HV) + tile,
                 s.to(hbuf_ptr.dtype.element_ty), mask=mask)
    v_new = u.to(tl.float32) - _dot_lp(w, s, F32)  # [BT, BLOCK_HV]
    if not FUSE:
        _store_rows(vnew_ptr, start, r, I32, valid, head, offs_v, mask_v, v_new, NV, HV)
    if not F32:
        v_new = v_new.to(w.dtype).to(tl.float32)  # what the output reads
    # Keys stored normalised (bf16) go into the dots as loaded when nothing scales them.
    if not (DECAY_V and not (L2NORM or F32)):
        k = _finish_keys(k, EPS, L2NORM)
    if FUSE:  # O = (Q ⊙ exp(G)) S + P V_new for this chunk and value tile (off the S chain)
        if QRAW:  # stored normalised and scaled by the intra kernel: into the dots as loaded
            qf = q
        else:
            qf = _finish_keys(q, EPS, QNORM) * SCALE
        if OUT_LP:
            o = _sdot(qf, s, F32, OUT_LP) * tl.exp(gc)[:, None]
        else:
            o = _sdot(qf * tl.exp(gc)[:, None], s, F32, OUT_LP)
        if QK:  # P = (Q Kᵀ) ⊙ L here, as the intra kernel would have stored it
            causal = r[:, None] >= r[None, :]
            pdecay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))
            pf = tl.where(causal, _sdot(qf, tl.trans(k), F32, OUT_LP) * pdecay, 0.0)
            if not F32:
                pf = pf.to(w.dtype)
        else:
            pf = pm
        o += _sdot(pf, v_new, F32, OUT_LP)
        _store_rows(o_ptr, start, r, I32, valid, head, offs_v, mask_v, o, NV, HV)
    if DECAY_V:  # the decay on V_new's [BT, BLOCK_HV] rows (fla's), not on K's [BT, BLOCK_H]
        v_new = v_new * tl.exp(g_last - gc)[:, None]
    else:
        k = k * tl.exp(g_last - gc)[:, None]
    return s * tl.exp(g_last) + _dot_lp(tl.trans(k), v_new, F32)


@triton.jit
def _state_loop(s, k_ptr, w_ptr, u_ptr, gcum_ptr, cstart_ptr, clen_ptr, q_ptr, p_ptr, hbuf_ptr,
                vnew_ptr, o_ptr, seq, head, kh, first, count, r, offs_h, mask_h, offs_v, mask_v,
                tile, mask, EPS: tl.constexpr, L2NORM: tl.constexpr, F32: tl.constexpr,
                I32: tl.constexpr, T_ROW: tl.constexpr, DECAY_V: tl.constexpr,
                FUSE: tl.constexpr, OUT_LP: tl.constexpr, QNORM: tl.constexpr,
                SCALE: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, H: tl.constexpr,
                HV: tl.constexpr, BT: tl.constexpr, QK: tl.constexpr, QRAW: tl.constexpr,
                GATES_AHEAD: tl.constexpr = False, U_AHEAD: tl.constexpr = False):
    """`_state_kernel`'s chunk loop with each step's loads issued together at its top
    (`Config.state_prefetch`, and `qk_in_state`). Triton software-pipelines the dots' operands
    either way (async copies a chunk ahead, given jax-triton's 16-byte-aligned pointers);
    GATES_AHEAD / U_AHEAD load the next chunk's gates / U rows into registers during this
    one's step."""
    if GATES_AHEAD or U_AHEAD:
        start_next, n_next = _state_chunk(0, seq, first, cstart_ptr, clen_ptr, T_ROW, BT, count,
                                          True)
        if GATES_AHEAD:
            gc_next, g_last_next = _gates(gcum_ptr, start_next, n_next, r, I32, head, NV, True)
        if U_AHEAD:
            u_next = _rows(u_ptr, start_next, n_next, r, I32, head, offs_v, mask_v, NV, HV)
    for c in range(0, count):
        start, n = _state_chunk(c, seq, first, cstart_ptr, clen_ptr, T_ROW, BT)
        w, u, k, gc, g_last, q, pm = _state_tiles(
            k_ptr, w_ptr, u_ptr, gcum_ptr, q_ptr, p_ptr, start, n, r, I32, head, kh, offs_h,
            mask_h, offs_v, mask_v, FUSE, QK, NK, NV, H, HV, BT, not GATES_AHEAD, not U_AHEAD)
        if GATES_AHEAD or U_AHEAD:
            start_next, n_next = _state_chunk(c + 1, seq, first, cstart_ptr, clen_ptr, T_ROW, BT,
                                              count, True)
        if GATES_AHEAD:
            gc, g_last = gc_next, g_last_next
            gc_next, g_last_next = _gates(gcum_ptr, start_next, n_next, r, I32, head, NV,
                                          True)
        if U_AHEAD:
            u = u_next
            u_next = _rows(u_ptr, start_next, n_next, r, I32, head, offs_v, mask_v, NV, HV)
        s = _state_step(s, w, u, k, gc, g_last, q, pm, start, n, first + c, r, I32, head, offs_v,
                        mask_v, tile, mask, hbuf_ptr, vnew_ptr, o_ptr, EPS, L2NORM, F32, DECAY_V,
                        FUSE, OUT_LP, QNORM, SCALE, QK, NV, H, HV, BT, QRAW)
    return s


@triton.jit
def _state_kernel(
    k_ptr,  # [N_TOK, NK, H]
    w_ptr,  # [N_TOK, NV, H]
    u_ptr,  # [N_TOK, NV, HV]
    gcum_ptr,  # [N_TOK, NV] float32
    cstart_ptr,  # [NC] int32
    clen_ptr,  # [NC] int32
    sfirst_ptr,  # [NS] int32 first chunk of each sequence
    scount_ptr,  # [NS] int32 chunks of each sequence
    h0_ptr,  # [NS, NV, H, HV] float32 (a dummy unless HAS_INIT)
    q_ptr,  # [N_TOK, NK, H] (read if FUSE); with QRAW normalised and scaled, at Q_OFF
    p_ptr,  # [N_TOK, NV, BT] the intra kernel's P (read if FUSE and not QK)
    hbuf_ptr,  # [NC, NV, H, HV] state entering each chunk, out (unless FUSE)
    vnew_ptr,  # [N_TOK, NV, HV] V_new = U − W S, out (unless FUSE)
    final_ptr,  # [NS, NV, H, HV] float32, out
    o_ptr,  # [N_TOK, NV, HV], out if FUSE
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    F32: tl.constexpr,
    I32: tl.constexpr,
    HAS_INIT: tl.constexpr,
    T_ROW: tl.constexpr,
    DECAY_V: tl.constexpr,
    FUSE: tl.constexpr,
    OUT_LP: tl.constexpr,
    QNORM: tl.constexpr,
    SCALE: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    SLICE_MAJOR: tl.constexpr = False,
    QK: tl.constexpr = False,
    QRAW: tl.constexpr = False,
    Q_OFF: tl.constexpr = 0,
    GATES_AHEAD: tl.constexpr = False,
    U_AHEAD: tl.constexpr = False,
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
    tile = offs_h[:, None] * HV + offs_v[None, :]  # [BLOCK_H, BLOCK_HV]
    mask = mask_h[:, None] & mask_v[None, :]
    state_row = (seq.to(tl.int64) * NV + head) * (H * HV)
    if HAS_INIT:
        s = tl.load(h0_ptr + state_row + tile, mask=mask, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((BLOCK_H, BLOCK_HV), tl.float32)

    r = tl.arange(0, BT)
    first = tl.load(sfirst_ptr + seq)
    count = tl.load(scount_ptr + seq)
    if PREFETCH or QK or QRAW or GATES_AHEAD or U_AHEAD:  # these exist in `_state_loop` only
        if QRAW:  # the queries after the keys in the intra kernel's buffer
            q_ptr = q_ptr + Q_OFF
        s = _state_loop(
            s, k_ptr, w_ptr, u_ptr, gcum_ptr, cstart_ptr, clen_ptr, q_ptr, p_ptr, hbuf_ptr,
            vnew_ptr, o_ptr, seq, head, kh, first, count, r, offs_h, mask_h, offs_v, mask_v,
            tile, mask, EPS, L2NORM, F32, I32, T_ROW, DECAY_V, FUSE, OUT_LP, QNORM, SCALE, NK, NV,
            H, HV, BT, QK, QRAW, GATES_AHEAD, U_AHEAD)
    else:
        for c in range(0, count):
            ci = first + c
            if T_ROW:  # B rows of T_ROW tokens: the chunk from its index, no table loads
                start = seq * T_ROW + c * BT
                n = tl.minimum(T_ROW - c * BT, BT)
            else:
                start = tl.load(cstart_ptr + ci)
                n = tl.load(clen_ptr + ci)
            if not FUSE:
                tl.store(hbuf_ptr + (ci.to(tl.int64) * NV + head) * (H * HV) + tile,
                         s.to(hbuf_ptr.dtype.element_ty), mask=mask)
            valid = r < n
            w = tl.load(_tile(w_ptr, start, r, I32, head, offs_h, NV, H),  # [BT, BLOCK_H]
                        mask=valid[:, None] & mask_h[None, :], other=0.0)
            u = tl.load(_tile(u_ptr, start, r, I32, head, offs_v, NV, HV),  # [BT, BLOCK_HV]
                        mask=valid[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
            v_new = u - _dot_lp(w, s, F32)  # [BT, BLOCK_HV]
            if not FUSE:
                _store_rows(vnew_ptr, start, r, I32, valid, head, offs_v, mask_v, v_new, NV, HV)
            if not F32:
                v_new = v_new.to(w_ptr.dtype.element_ty).to(tl.float32)  # what the output reads
            gc = tl.load(_col(gcum_ptr, start, r, I32, head, NV), mask=valid, other=0.0)  # [BT]
            if FUSE:  # O = (Q ⊙ exp(G)) S + P V_new, this chunk and value tile (off the S chain)
                q = _load_keys(q_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, QNORM, NK,
                               H) * SCALE
                if OUT_LP:
                    o = _sdot(q, s, F32, OUT_LP) * tl.exp(gc)[:, None]
                else:
                    o = _sdot(q * tl.exp(gc)[:, None], s, F32, OUT_LP)
                pm = tl.load(_tile(p_ptr, start, r, I32, head, r, NV, BT), mask=valid[:, None],
                             other=0.0)
                o += _sdot(pm, v_new, F32, OUT_LP)
                _store_rows(o_ptr, start, r, I32, valid, head, offs_v, mask_v, o, NV, HV)
            g_last = tl.load(gcum_ptr + (start + n - 1).to(tl.int64) * NV + head)
            # Keys stored normalised (bf16) go into the dot as loaded when nothing scales them.
            k = _load_keys(k_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H,
                           DECAY_V and not (L2NORM or F32))
            if DECAY_V:  # the decay on V_new's [BT, BLOCK_HV] rows (fla's), not K's [BT, BLOCK_H]
                v_new = v_new * tl.exp(g_last - gc)[:, None]
            else:
                k = k * tl.exp(g_last - gc)[:, None]
            s = s * tl.exp(g_last) + _dot_lp(tl.trans(k), v_new, F32)
    tl.store(final_ptr + state_row + tile, s, mask=mask)


@triton.jit
def _output_kernel(
    q_ptr,  # [N_TOK, NK, H]
    k_ptr,  # [N_TOK, NK, H]
    gcum_ptr,  # [N_TOK, NV] float32
    hbuf_ptr,  # [NC, NV, H, HV]
    vnew_ptr,  # [N_TOK, NV, HV]
    cstart_ptr,  # [NC] int32
    clen_ptr,  # [NC] int32
    o_ptr,  # [N_TOK, NV, HV], out
    SCALE: tl.constexpr,
    EPS: tl.constexpr,
    L2NORM: tl.constexpr,
    F32: tl.constexpr,
    I32: tl.constexpr,
    OUT_LP: tl.constexpr,
    KNORM: tl.constexpr,
    NK: tl.constexpr,
    NV: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
):
    ci = tl.program_id(0)
    head = tl.program_id(1)
    kh = head // (NV // NK)
    start = tl.load(cstart_ptr + ci)
    n = tl.load(clen_ptr + ci)
    offs_h = tl.arange(0, BLOCK_H)
    offs_v = tl.program_id(2) * BLOCK_HV + tl.arange(0, BLOCK_HV)
    mask_h = offs_h < H
    mask_v = offs_v < HV
    r = tl.arange(0, BT)
    valid = r < n

    q = _load_keys(q_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, L2NORM, NK, H) * SCALE
    k = _load_keys(k_ptr, start, r, I32, valid, kh, offs_h, mask_h, EPS, KNORM, NK, H,
                   OUT_LP and not (KNORM or F32))
    gc = tl.load(_col(gcum_ptr, start, r, I32, head, NV), mask=valid, other=0.0)  # [BT]
    s = tl.load(  # [BLOCK_H, BLOCK_HV], the state entering the chunk
        hbuf_ptr + (ci.to(tl.int64) * NV + head) * (H * HV) + offs_h[:, None] * HV
        + offs_v[None, :], mask=mask_h[:, None] & mask_v[None, :], other=0.0)
    v_new = tl.load(_tile(vnew_ptr, start, r, I32, head, offs_v, NV, HV),
                    mask=valid[:, None] & mask_v[None, :], other=0.0)
    if not OUT_LP:  # else they stay in their stored dtype: bf16 dot operands as they are
        s = s.to(tl.float32)
        v_new = v_new.to(tl.float32)
    causal = r[:, None] >= r[None, :]
    decay = tl.exp(tl.where(causal, gc[:, None] - gc[None, :], float("-inf")))  # [BT, BT]
    scores = tl.where(causal, _sdot(q, tl.trans(k), F32, OUT_LP) * decay, 0.0)
    if OUT_LP:  # fla's order: exp(G) on the [BT, BLOCK_HV] product, q rounded to bf16 as is
        o = _sdot(q, s, F32, OUT_LP) * tl.exp(gc)[:, None]
    else:
        o = _sdot(q * tl.exp(gc)[:, None], s, F32, OUT_LP)
    o += _sdot(scores, v_new, F32, OUT_LP)  # [BT, BLOCK_HV]
    _store_rows(o_ptr, start, r, I32, valid, head, offs_v, mask_v, o, NV, HV)


def _chunk_tables(b: int, t: int, cu_seqlens):
    """Chunk slots of C tokens that never cross a sequence.

    Returns:
      `(chunk_start [Nc], chunk_len [Nc], seq_first_chunk [Ns], seq_chunks [Ns])` int32; unused
      slots (varlen's static bound `Nc = (T + Ns (C − 1)) // C`) have length 0.
    """
    c = CHUNK
    if cu_seqlens is None:
        per_row = -(-t // c)
        j = np.arange(b * per_row)
        local = j % per_row
        tables = ((j // per_row) * t + local * c, np.minimum(t - local * c, c),
                  np.arange(b) * per_row, np.full(b, per_row))
        return tuple(jnp.asarray(x, jnp.int32) for x in tables)
    n = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.astype(jnp.int32)
    count = (cu[1:] - cu[:-1] + c - 1) // c
    end = jnp.cumsum(count)
    first = end - count
    j = jnp.arange(max((t + n * (c - 1)) // c, 1), dtype=jnp.int32)
    seq_raw = jnp.searchsorted(end, j, side="right")
    used = seq_raw < n
    seq = jnp.minimum(seq_raw, n - 1)
    start = cu[seq] + (j - first[seq]) * c
    length = jnp.where(used, jnp.clip(cu[seq + 1] - start, 0, c), 0)
    return (jnp.where(used, start, 0).astype(jnp.int32), length.astype(jnp.int32),
            first.astype(jnp.int32), count.astype(jnp.int32))


def with_reference_gradient(kernel_fn, reference_fn):
    """`kernel_fn` forward, the VJP of `reference_fn` (same arguments and outputs) backward.

    The kernels are forward-only; this keeps the op differentiable when `implementation="auto"`
    picks them on a GPU. The backward recomputes the pure-jnp reference (its memory and time).
    Integer arguments get `float0` cotangents, as `jax.vjp` gives them.
    """

    @jax.custom_vjp
    def fn(*args):
        return kernel_fn(*args)

    def fwd(*args):
        return kernel_fn(*args), args

    def bwd(args, cotangents):
        return jax.vjp(reference_fn, *args)[1](cotangents)

    fn.defvjp(fwd, bwd)
    return fn


def gdn_chunked(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=False,
                cu_seqlens=None, config: Config | None = None):
    """Chunked gated delta rule (C = 64) through the kernels; inputs validated by the api.

    Differentiable: the backward is the XLA reference's (`with_reference_gradient`).

    Args:
      q, k: `[B, T, Nk, H]`; v `[B, T, Nv, Hv]`; g, beta `[B, T, Nv]`.
      scale: query scale, None for `H ** -0.5`.
      initial_state: `[Ns, Nv, H, Hv]` (cast to float32), or None for zeros.
      use_qk_l2norm: l2-normalise q and k over H in the kernels (eps 1e-6).
      cu_seqlens: `[Ns + 1]` packed-sequence boundaries (`B == 1`), or None (`Ns = B`).
      config: launch configuration; None for `default_config`.

    Returns:
      `(o [B, T, Nv, Hv] in q.dtype, final_state [Ns, Nv, H, Hv] float32)`.
    """
    opts = dict(scale=scale, use_qk_l2norm=use_qk_l2norm)

    def kernel_fn(q, k, v, g, beta, h0, cu):
        return _forward(q, k, v, g, beta, h0, cu, config=config, **opts)

    def reference_fn(q, k, v, g, beta, h0, cu):
        return reference.gdn_chunked(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                     chunk_size=CHUNK, **opts)

    return with_reference_gradient(kernel_fn, reference_fn)(q, k, v, g, beta, initial_state,
                                                            cu_seqlens)


def _forward(q, k, v, g, beta, initial_state, cu_seqlens, *, scale, use_qk_l2norm, config):
    intra, state, output, x = stages(q, k, v, g, beta, initial_state, cu_seqlens, scale=scale,
                                     use_qk_l2norm=use_qk_l2norm, config=config)
    tables = (x["cstart"], x["clen"])
    gcum, w, u, kn, p = intra(x["q2"], x["k2"], x["v2"], x["g2"], x["beta2"], *tables)
    hbuf, v_new, final, o = state(kn, w, u, gcum, *tables, x["sfirst"], x["scount"], x["h0"],
                                  x["q2"], p)
    if output is not None:  # else `config.fuse_output`: the state kernel wrote o
        o = output(x["q2"], kn, gcum, hbuf, v_new, *tables)
    return o.reshape(v.shape), final


NUM_SMS = 132  # H100 / H200 SXM

# Bytes, dots and floors at B1 T32K (Nk16 Nv32 H = Hv = 128, bf16 q / k / v, l2-norm, no initial
# state; session 4's `default_config`: fused, 32-wide state slices, 4 warps; counts from
# `experiments.profile_gdn_chunk.cost`, registers / shared memory from its `--ptxas`; HBM
# 3.0 TB/s; times measured in session 4, benchmarks/NOTES.md runs 6-7 and 10).
#
# Intra, 512 chunks x 32 value heads = 16K programs. Per program: reads k, v, q (16 KB each;
# k and q read by both value heads of a key head) and g, beta; writes W, U (16 KB each), P (8 KB),
# G (float32, 256 B) and half of the normalised keys (16 KB per key head). All intermediates but
# G are already in v's dtype (bf16): no float32 store is left to halve. 1.36 GB unique = 0.45 ms;
# 1.62 GB with q / k read per value head = 0.54 ms. Dots: K Kᵀ 1.0, the "stacked" solve 4.1,
# W and U 2.1, Q Kᵀ 1.0 MFLOP = 135 GFLOP, ~0.2 ms of bf16 tensor-core time. Measured ~0.8 ms:
# 1.5-1.8x the byte floor. 255 registers at 4 warps (217 without P) = two programs (8 warps) per
# SM, whose 15 dependent solve dots cannot hide each other's latency: latency / occupancy-bound.
# `qk_in_state` drops q and P (1.09 GB, 0.36 ms floor; 217 registers); `intra_head_major` makes
# the second read of k / q an L2 hit.
#
# State (fused), grid 1 x 32 x 4 = 128 programs: one per SM (131 KB shared memory: W, U, K, Q,
# P, G two chunks deep) and 512 dependent chunk steps each. Per step: loads W 16 + K 16 + Q 16 +
# P 8 + U 4 KB, stores O 4 KB; dots W S and Q S (64 x 128 x 32), Kᵀ V_new (128 x 64 x 32),
# P V_new (64 x 64 x 32) = 1.8 MFLOP, ~0.25 us of one SM's tensor cores. 1.21 GB unique =
# 0.40 ms; 4.57 GB as the programs read it (W / P by the 4 slices of a head, K / Q by 8 programs;
# they run in lockstep, so the repeats should mostly hit L2) = 1.52 ms were it all HBM.
# Measured ~1.6 ms = 3.1 us (~5,500 cycles) per step: ~21 GB/s per SM, ~2.9 TB/s in all.
# Triton already software-pipelines every load of the loop one chunk ahead (async copies, given
# jax-triton's 16-byte-aligned pointers), so a step is its dependent chain: wait for the copies;
# S -> bf16 -> shared; W S; V_new -> shared; Q cast / l2-norm / scale ([64, 128] float32); Q S;
# P V_new; O store; decays; Kᵀ V_new; S update, all issued in order by one warpgroup (the
# output's work is off the S chain but in the same instruction stream). The floor here is 512 x
# that latency, not bytes. Levers: fewer instructions per step (`store_qn`: no Q normalisation,
# 196 -> 140 registers), fewer bytes per step (`qk_in_state`: no P, -8 of 60 KB, but one more
# 64 x 128 x 64 dot), two chains per SM (16-wide slices with `qk_in_state` and `store_qn`:
# 107 KB shared memory, 211 registers; each chain still walks 512 steps, so this pays only if a
# narrower step is faster and two steps share an SM without slowing down).
#
# B8 T4K: 256 chains x 2 slices of 64 = 512 programs at one per SM (148 KB) = 3.9 waves of 64
# steps. The default grid (Ns, Nv, slices) launches the two slices of a head 256 programs (one
# to two waves) apart, so W / K / Q / P come from HBM twice: ~1.9 GB (2.7 GB counting every
# re-read) against 1.23 GB unique, 0.63-0.90 vs 0.41 ms; `state_slice_major` launches them side
# by side. 32-wide slices with `qk_in_state` and
# `store_qn` (115 KB, 242 registers) may fit two programs per SM (2 x 116 KB of 228 KB).


# Session 8 (ncu source counters, NOTES.md): Triton issues the state step's async copies for the
# next chunk at the end of the step, after its dots, so with two stages every step opened by
# waiting out a whole copy latency (28% of the kernel's warp samples at B1 T32K). Three stages put
# them two steps ahead: state 1.16 -> 0.75 ms at B1 T32K. Three stages hold one program per SM,
# so a step's time is all a wave costs, and the value-slice width trades the number of waves
# against the step: a 64-wide step takes ~1.36x a 32-wide one (1.49 / 2.02 us, H100), and at B8
# T4K 32-wide slices fill 7.8 waves of 64 steps against 3.9 at 64 (state 0.74 vs 0.50 ms; the
# two-stage, two-programs-per-SM form with q kᵀ in the step and the gates ahead: 0.90).
_STEP_COST = {32: 1.0, 64: 1.36}  # relative time of one state step by slice width (H100)
_SMEM_LIMIT = 232448  # bytes of shared memory one program may take (H100 / H200)


def state_smem(h: int, hv_slice: int, itemsize: int, stages: int) -> int:
    """Shared memory (bytes, a slight over-estimate) of the fused state kernel as `default_config`
    launches it: per stage the W, K, Q rows, P and the U slice of one chunk and its float32
    gates; the state and V_new staged for the dots. ptxas for sm_90a, bf16, H = 128: 184,840 B at
    32-wide slices and three stages (this gives 197,376 with U pipelined), 213,512 at 64-wide."""
    block_h = max(16, triton.next_power_of_2(h))
    per_stage = itemsize * CHUNK * (3 * block_h + CHUNK + hv_slice) + 4 * CHUNK
    return stages * per_stage + itemsize * hv_slice * (block_h + CHUNK)


def default_config(num_seqs: int, nv: int, hv: int, num_chunks: int = 1, *,
                   nk: int | None = None, h: int = 128, itemsize: int = 2) -> Config:
    """`Config()` with the output fused into the state kernel, whose loop runs three stages deep
    where that fits (`state_smem`; the float32 path keeps two), with the value-slice width that
    makes the fewest waves of steps (`_STEP_COST`, one program per SM) and stored normalised
    queries. H100, Nk16 Nv32 H = Hv = 128, bf16, whole op (`experiments.profile_gdn_chunk`,
    NOTES.md sessions 4-8): B1 T32K (32 chains: 32-wide slices, 128 programs) 1.45 ms, B8 T4K
    (256 chains: 64-wide, 512 programs) 1.23 ms, against session 7's 1.84 / 1.61 (two stages;
    at B8 64-wide slices with q kᵀ in the step and the gates ahead).

    Where `nk` is given and each key head has an even number of value heads, one intra program
    per value-head pair solving on the diagonal blocks (`intra_pairs`; session 7: intra
    1.01-1.02 -> 0.73-0.75 ms at B1, 0.95 -> 0.71 at B8). The head-major grids hold up to 65535
    chunks / sequences (`num_chunks`: an upper bound). `h` and `itemsize` (of the intermediates:
    4 on the float32 path) size the shared memory."""
    majors = dict(state_slice_major=num_seqs <= 65535, intra_head_major=num_chunks <= 65535)
    pairs = nk is not None and nv % nk == 0 and (nv // nk) % 2 == 0

    def waves(width):
        return triton.cdiv(num_seqs * nv * triton.cdiv(hv, width), NUM_SMS) * _STEP_COST[width]

    fits = [(waves(w), w, s) for s in (3, 2) for w in _STEP_COST
            if state_smem(h, min(w, max(16, triton.next_power_of_2(hv))), itemsize, s)
            <= _SMEM_LIMIT]
    _, width, stages = min(fits, key=lambda f: (f[0], -f[2], f[1])) if fits else (0, 32, 2)
    return Config(fuse_output=True, block_hv_state=width, state_warps=4, state_stages=stages,
                  store_qn=True, intra_pairs=pairs, **majors)


def kernel_options(config: Config) -> dict:
    """Constexprs every kernel takes from `config`."""
    return dict(I32=config.i32_offsets)


def intra_options(config: Config) -> dict:
    """`_intra_kernel`'s constexprs from `config` (STORE_KN: `stages` turns it off without
    l2-norm)."""
    return dict(SUB=4 if config.solve == "nested" else _SUB, HOIST=config.solve == "subst_hoist",
                STACKED=config.solve == "stacked", SOLVE_LP=config.solve_bf16,
                STORE_KN=config.store_kn, FUSE=config.fuse_output and not config.qk_in_state,
                OUT_LP=config.out_bf16, HEAD_MAJOR=config.intra_head_major)


def intra_kernel(config: Config):
    """The intra-chunk kernel `config` launches (`intra_options` are its constexprs)."""
    return _intra_pair_kernel if config.intra_pairs else _intra_kernel


def intra_grid(config: Config, nv: int, n_chunks: int) -> tuple[int, int]:
    """The intra kernel's grid: a program per (chunk, value head), or per (chunk, pair of value
    heads) with `intra_pairs`; heads first with `intra_head_major`."""
    heads = nv // 2 if config.intra_pairs else nv
    return (heads, n_chunks) if config.intra_head_major else (n_chunks, heads)


def state_options(config: Config, t_row: int = 0) -> dict:
    """`_state_kernel`'s constexprs from `config`; `t_row` the row length without cu_seqlens."""
    return dict(DECAY_V=config.decay_on_v, T_ROW=t_row if config.affine_state else 0,
                FUSE=config.fuse_output, OUT_LP=config.out_bf16, PREFETCH=config.state_prefetch,
                SLICE_MAJOR=config.state_slice_major, QK=config.qk_in_state,
                GATES_AHEAD=config.state_gates_ahead, U_AHEAD=config.state_u_ahead)


def state_launch(config: Config) -> dict:
    return dict(num_warps=config.state_warps or config.num_warps,
                num_stages=config.state_stages or config.num_stages)


def output_options(config: Config) -> dict:
    return dict(OUT_LP=config.out_bf16)


def stages(q, k, v, g, beta, initial_state=None, cu_seqlens=None, *, scale=None,
           use_qk_l2norm=False, config: Config | None = None):
    """The pipeline's three kernel launches as separate functions (`_forward` chains them;
    `experiments/profile_gdn_chunk.py` times them one by one).

    Returns:
      `(intra, state, output, x)`:
      `intra(q2, k2, v2, g2, beta2, cstart, clen) -> (gcum, w, u, kn, p)`,
      `state(kn, w, u, gcum, cstart, clen, sfirst, scount, h0, q2, p) -> (hbuf, v_new, final, o)`,
      `output(q2, kn, gcum, hbuf, v_new, cstart, clen) -> o [B·T, Nv, Hv]`, and `x` the flattened
      inputs and chunk tables by those names. `kn` is the l2-normalised keys with
      `config.store_kn` and l2-norm, else `k2` itself; with `config.store_qn` too (fused)
      `[2·B·T, Nk, H]`, the normalised and scaled queries after the keys (the state kernel then
      reads its queries there, not from `q2`). With `config.fuse_output`, `output` is
      None and the state kernel's `o` is the output (`hbuf` and `v_new` `(1,)` dummies; `p`
      too with `config.qk_in_state`); else `p` and `o` are the dummies.
    """
    bsz, t, nk, h = q.shape
    nv, hv = v.shape[2:]
    n_tok = bsz * t
    n_seq = bsz if cu_seqlens is None else cu_seqlens.shape[0] - 1
    f32 = all(x.dtype == jnp.float32 for x in (q, k, v))
    inter = jnp.float32 if f32 else v.dtype
    if config is None:
        config = default_config(n_seq, nv, hv, num_chunks=triton.cdiv(n_tok, CHUNK) + n_seq,
                                nk=nk, h=h, itemsize=jnp.dtype(inter).itemsize)
    scale = h**-0.5 if scale is None else scale
    cstart, clen, sfirst, scount = _chunk_tables(bsz, t, cu_seqlens)
    n_chunks = cstart.shape[0]
    has_init = initial_state is not None
    x = dict(q2=q.reshape(n_tok, nk, h), k2=k.reshape(n_tok, nk, h), v2=v.reshape(n_tok, nv, hv),
             g2=g.reshape(n_tok, nv), beta2=beta.reshape(n_tok, nv), cstart=cstart, clen=clen,
             sfirst=sfirst, scount=scount,
             h0=initial_state.astype(jnp.float32) if has_init else jnp.zeros((1,), jnp.float32))
    block_h = max(16, triton.next_power_of_2(h))
    block_hv = max(16, triton.next_power_of_2(hv))
    l2 = bool(use_qk_l2norm)
    store_kn = config.store_kn and l2
    store_qn = config.store_qn and store_kn and config.fuse_output
    common = dict(EPS=L2NORM_EPS, L2NORM=l2, F32=f32, NK=nk, NV=nv, H=h, HV=hv, BLOCK_H=block_h,
                  **kernel_options(config))

    fuse = config.fuse_output
    shape = lambda full, on: jax.ShapeDtypeStruct(full if on else (1,), inter)
    if config.intra_head_major and n_chunks > 65535:
        raise ValueError(f"intra_head_major: {n_chunks} chunks > 65535 (the grid's y limit)")
    if config.state_slice_major and n_seq > 65535:
        raise ValueError(f"state_slice_major: {n_seq} sequences > 65535 (the grid's z limit)")
    if config.intra_pairs and (nv % nk or (nv // nk) % 2):
        raise ValueError(f"intra_pairs needs an even number of value heads per key head: "
                         f"Nv={nv}, Nk={nk} (Nv // Nk = {nv // nk})")

    def intra(q2, k2, v2, g2, beta2, cstart, clen):
        out = triton_call(
            q2, k2, v2, g2, beta2, cstart, clen,
            kernel=intra_kernel(config),
            out_shape=(jax.ShapeDtypeStruct((n_tok, nv), jnp.float32),
                       jax.ShapeDtypeStruct((n_tok, nv, h), inter),
                       jax.ShapeDtypeStruct((n_tok, nv, hv), inter),
                       shape(((1 + store_qn) * n_tok, nk, h), store_kn),
                       shape((n_tok, nv, CHUNK), fuse and not config.qk_in_state)),
            grid=intra_grid(config, nv, n_chunks),
            num_warps=config.intra_warps,
            num_stages=1,
            BT=CHUNK, BLOCK_HV=block_hv, SCALE=float(scale),
            **dict(intra_options(config), STORE_KN=store_kn, STORE_QN=store_qn,
                   QN_OFF=n_tok * nk * h if store_qn else 0), **common,
        )
        return (*out[:3], out[3] if store_kn else k2, out[4])

    def state(k2, w, u, gcum, cstart, clen, sfirst, scount, h0, q2, p):
        bv = min(config.block_hv_state, block_hv)
        return triton_call(
            k2, w, u, gcum, cstart, clen, sfirst, scount, h0, k2 if store_qn else q2, p,
            kernel=_state_kernel,
            out_shape=(shape((n_chunks, nv, h, hv), not fuse), shape((n_tok, nv, hv), not fuse),
                       jax.ShapeDtypeStruct((n_seq, nv, h, hv), jnp.float32),
                       jax.ShapeDtypeStruct((n_tok, nv, hv) if fuse else (1,), q.dtype)),
            grid=((triton.cdiv(hv, bv), nv, n_seq) if config.state_slice_major
                  else (n_seq, nv, triton.cdiv(hv, bv))),
            **state_launch(config),
            HAS_INIT=has_init, BT=CHUNK, BLOCK_HV=bv, SCALE=float(scale), QNORM=l2,
            QRAW=store_qn, Q_OFF=n_tok * nk * h if store_qn else 0,
            **state_options(config, t if cu_seqlens is None else 0),
            **dict(common, L2NORM=l2 and not store_kn),
        )

    def output(q2, k2, gcum, hbuf, v_new, cstart, clen):
        bv = min(config.block_hv_out, block_hv)
        return triton_call(
            q2, k2, gcum, hbuf, v_new, cstart, clen,
            kernel=_output_kernel,
            out_shape=jax.ShapeDtypeStruct((n_tok, nv, hv), q.dtype),
            grid=(n_chunks, nv, triton.cdiv(hv, bv)),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            SCALE=float(scale), KNORM=l2 and not store_kn, BT=CHUNK, BLOCK_HV=bv,
            **output_options(config), **common,
        )

    return intra, state, None if fuse else output, x
