"""Triton block-sparse backward (FlashAttention-2, recomputing the probabilities from the
forward's lse): dQ walks the key blocks each query tile selected, dK / dV walks the query tiles
that selected each key block, so the work is proportional to the selected blocks, as in the
forward (`attn/block_sparse/triton.py`). Three kernels:

- dQ: the forward's programs and lists (`triton.block_lists`: per (request, query head, query
  tile) the selected key blocks ascending, the first `whole` of them seen whole by every query of
  the tile). `BLOCK_M` queries of one query head walk the list in steps of `BLOCK_N` keys, one
  flat loop over the whole blocks without a mask, then one over the rest with the token rules.
  It also writes `delta = rowsum(dO * O) - dlse` (the lse cotangent enters there: d lse / d score
  = p, as for dO) for the dK / dV kernel, so no XLA pass reads dO and O.
- dK / dV: a program owns `BLOCK_N` keys of one KV head and walks the (sibling head, query tile)
  pairs that selected its key block (`transposed_lists`, in XLA: the block mask transposed, each
  row `[G * Tb]` partitioned into the pairs every query of which sees the block whole, then the
  masked ones, both ascending) in steps of `BLOCK_M` queries. The GQA siblings sum inside the
  program. A program with more than a fair share of the steps (a key block every query tile
  selects, such as the sink block) is cut into chunks (`dkv_schedule`) that write float32
  partial sums; started whole it would finish long after the rest (H100, S32K density 0.1,
  128-key programs: a sink program walks 2048 steps against ~1600 per SM for everything; the
  backward with 3 dK / dV stages takes 6.88 ms with the cut, 8.08 without).
- reduce: adds the partial sums of each cut program in order (deterministic, no atomics).

Where the Mosaic forward runs at `H == 128`, the fused Mosaic backward
(`attn/block_sparse/mosaic_bwd.py`: 5 tile products a step against 7 here) walks the same
transposed lists under the same schedule and takes its place; this backward serves every other
case (any lengths, block sizes, head dims and dtypes) and is the deterministic option
(`attn.block_sparse.mosaic.Config(fused_backward=False)`).

NaN and masks: in a masked step `dS` (and `P` for dV) is selected by the visibility rather than
multiplied by `P = 0`, and dQ zeroes non-finite keys before `dS K`, so a NaN key or value that a
row does not see reaches none of its gradients; padding queries (past `q_lengths`) and keys (past
`kv_lengths`) are loaded as zeros and get zero gradients. A row that sees nothing has lse -inf,
`P = 0` and zero gradients. A NaN a row sees makes the row's output NaN and so its dQ and the dK
of the keys it sees (through `delta`).

Supports what the forward supports: any group size, `H` / `Hv` up to 256, bf16 / f16 / f32,
block sizes that are powers of two >= 16, any lengths.
"""

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from attn._harness import on_gpu, triton_call
from attn.dense._flash_tiles import _load

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: kernels may read it


def transposed_lists(eff, q_lengths, kv_lengths, block_size: int, num_kv_heads: int, *,
                     use_kernel: bool | None = None):
    """Per (request, KV head, key block): the (sibling, query tile) pairs that selected it.

    Args:
      eff: `[B, N, Tb, Sb]` bool, `reference.effective_block_mask`.
      q_lengths, kv_lengths: `[B]` int32, clamped to `[0, T]` / `[0, S]`.
      block_size: the block size.
      num_kv_heads: K.
      use_kernel: `_transposed_lists_kernel` (one Triton pass over the transposed mask: each
        row partitioned and written once) instead of the XLA formulation (scans and a scatter);
        default: on a GPU for rows of at most `_TRANSPOSED_MAX_WIDTH` entries (`G * Tb`; a row
        is one program's registers). Both give the same arrays.

    Returns:
      `(entries [B, K, Sb, G * Tb] int32, count [B, K, Sb] int32, whole [B, K, Sb] int32)`: entry
      `g * Tb + r` is query tile r of sibling g (head `kh * G + g`); `entries[..., :count]` are
      the selected pairs, the first `whole` of them those whose every query sees the whole key
      block (all queries of the tile valid, the block inside the keys and wholly below the
      tile's first query), each part ascending; the rest of a row is the unselected entries
      (the kernel reads one entry ahead, so every slot holds a valid entry).
    """
    b, n, tb, sb = eff.shape
    # [B, K, Sb, G * Tb]: row (request, KV head, key block), entry g * Tb + r.
    sel = eff.reshape(b, num_kv_heads, n // num_kv_heads, tb, sb).transpose(0, 1, 4, 2, 3)
    sel = sel.reshape(b, num_kv_heads, sb, -1)
    if use_kernel is None:
        use_kernel = on_gpu() and sel.shape[-1] <= _TRANSPOSED_MAX_WIDTH
    if use_kernel:
        return _transposed_lists_triton(sel, q_lengths, kv_lengths, block_size, tb)
    return _transposed_lists_xla(sel, q_lengths, kv_lengths, block_size, tb)


def _transposed_lists_xla(sel, q_lengths, kv_lengths, block_size, tb):
    b, num_kv_heads, sb, width = sel.shape
    g = width // tb
    r = jnp.arange(tb, dtype=jnp.int32)
    j = jnp.arange(sb, dtype=jnp.int32)
    first = (kv_lengths - q_lengths)[:, None] + r[None, :] * block_size  # [B, Tb]
    whole = (((r[None, :] + 1) * block_size <= q_lengths[:, None])[:, :, None]
             & ((j[None, :] + 1) * block_size <= kv_lengths[:, None])[:, None, :]
             & ((j + 1)[None, None, :] * block_size - 1 <= first[:, :, None]))  # [B, Tb, Sb]
    whole = jnp.broadcast_to(whole.transpose(0, 2, 1)[:, None, :, None, :],
                             (b, num_kv_heads, sb, g, tb)).reshape(sel.shape)
    w, m = sel & whole, sel & ~whole
    if width < 2**15:  # one scan: whole counts in the low 16 bits, masked counts above
        cs = jnp.cumsum(w.astype(jnp.int32) + (m.astype(jnp.int32) << 16), axis=-1)
        cw, cm = cs & 0xFFFF, cs >> 16
    else:
        cw, cm = jnp.cumsum(w, axis=-1, dtype=jnp.int32), jnp.cumsum(m, axis=-1, dtype=jnp.int32)
    num_whole, num_masked = cw[..., -1], cm[..., -1]
    count = num_whole + num_masked
    e = jnp.arange(width, dtype=jnp.int32)
    # Slots of the stable partition "whole, masked, unselected" (each ascending), as one scatter.
    slot = jnp.where(w, cw - 1, jnp.where(m, num_whole[..., None] + cm - 1,
                                          count[..., None] + e - cw - cm))
    if sel.size <= 2**31 - 1:
        rows = jnp.arange(sel.size // width, dtype=jnp.int32).reshape(sel.shape[:-1] + (1,))
        entries = jnp.zeros((sel.size,), jnp.int32).at[(rows * width + slot).reshape(-1)].set(
            jnp.broadcast_to(e, sel.shape).reshape(-1), unique_indices=True,
            mode="promise_in_bounds").reshape(sel.shape)
    else:  # flat slots would overflow int32
        key = jnp.where(w, 0, jnp.where(m, 1, 2))
        entries = jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)
    return entries, count, num_whole


_TRANSPOSED_ELEMENTS = 4096  # mask entries per program of `_transposed_lists_kernel`
_TRANSPOSED_MAX_WIDTH = 8192  # the widest row it takes (G8 at S128K, blocks of 128)


@triton.jit
def _transposed_lists_kernel(
    sel_ptr,  # [ROWS_ALL, W] int8 transposed block mask, rows (b, kh, j), entries g * TB + r
    q_len_ptr,  # [B] int32
    kv_len_ptr,  # [B] int32
    entries_ptr,  # [ROWS_ALL, W] int32, out
    count_ptr,  # [ROWS_ALL] int32, out
    whole_ptr,  # [ROWS_ALL] int32, out
    ROWS_ALL: tl.constexpr,
    ROWS_PER_B: tl.constexpr,
    SB: tl.constexpr,
    TB: tl.constexpr,
    W: tl.constexpr,
    BS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """`_transposed_lists_xla` for `ROWS` rows: the same stable partition (whole pairs, masked
    pairs, the rest, each ascending) as one scatter of each row's permutation, and the counts."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    e = tl.arange(0, BLOCK_W)  # [BLOCK_W]
    row_ok = rows < ROWS_ALL
    ok = row_ok[:, None] & (e < W)[None, :]
    base = rows.to(tl.int64)[:, None] * W
    sel = tl.load(sel_ptr + base + e[None, :], mask=ok, other=0) != 0
    b = rows // ROWS_PER_B
    q_len = tl.load(q_len_ptr + b, mask=row_ok, other=0)[:, None]
    kv_len = tl.load(kv_len_ptr + b, mask=row_ok, other=0)[:, None]
    j_end = ((rows % SB) + 1)[:, None] * BS  # one past the key block's last key
    r = (e % TB)[None, :]
    whole = (((r + 1) * BS <= q_len) & (j_end <= kv_len)
             & (j_end - 1 <= kv_len - q_len + r * BS))  # [ROWS, BLOCK_W]
    w = (sel & whole).to(tl.int32)
    m = (sel & ~whole).to(tl.int32)
    cw = tl.cumsum(w, axis=1)
    cm = tl.cumsum(m, axis=1)
    num_whole = tl.sum(w, axis=1)
    count = num_whole + tl.sum(m, axis=1)
    slot = tl.where(w != 0, cw - 1, tl.where(m != 0, num_whole[:, None] + cm - 1,
                                             count[:, None] + e[None, :] - cw - cm))
    tl.store(entries_ptr + base + slot, tl.broadcast_to(e[None, :], (ROWS, BLOCK_W)), mask=ok)
    tl.store(count_ptr + rows, count, mask=row_ok)
    tl.store(whole_ptr + rows, num_whole, mask=row_ok)


def _transposed_lists_triton(sel, q_lengths, kv_lengths, block_size, tb):
    b, kh, sb, width = sel.shape
    rows = b * kh * sb
    block_w = max(16, triton.next_power_of_2(width))
    per_program = max(1, _TRANSPOSED_ELEMENTS // block_w)
    entries, count, whole = triton_call(
        sel.reshape(rows, width).astype(jnp.int8), q_lengths.astype(jnp.int32),
        kv_lengths.astype(jnp.int32), kernel=_transposed_lists_kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, width), jnp.int32),
                   jax.ShapeDtypeStruct((rows,), jnp.int32),
                   jax.ShapeDtypeStruct((rows,), jnp.int32)),
        grid=(triton.cdiv(rows, per_program),), num_warps=4 if block_w <= 4096 else 8,
        ROWS_ALL=rows, ROWS_PER_B=kh * sb, SB=sb, TB=tb, W=width, BS=block_size,
        ROWS=per_program, BLOCK_W=block_w)
    return entries.reshape(sel.shape), count.reshape(sel.shape[:3]), whole.reshape(sel.shape[:3])


def dkv_schedule(count, num_n: int, block_n: int, block_size: int, block_m: int,
                 num_sms: int, split: bool = True):
    """Work units of the dK / dV launch: programs (a key tile of a KV head of a request, walking
    its list) cut into chunks of at most a fair share of the steps.

    Programs are indexed `(kh * B + b) * num_n + nt` (`nt`: the key tile of `block_n` keys). A
    fair share is `chunk = ceil(all steps / E)` steps, `E = min(2 * num_sms, programs)`: a
    program with more (a block
    every query tile selects, such as the sink block: `G * Tb` tiles, ~10x a typical list at
    density 0.1) is cut into chunks that run side by side and write float32 partial sums, added
    in order by `_dkdv_reduce_kernel` (deterministic, no atomics). Units run the programs with
    more than half a chunk of steps first, longest first, then the rest KV head by KV head, key
    tiles ascending (the programs in flight then read one KV head's queries).

    Static bounds (a cut program has more than `chunk >= all steps / E` steps): at most
    `programs + E` units, `2 E` partial slots, `E` cut programs.

    Returns:
      `units [4, programs + E]` int32 (program or -1, first step, end step, partial slot or -1)
      and `cut [3, E]` int32 (program or -1, first slot, slots).
    """
    per_block = block_size // block_n
    steps = jnp.repeat(count.transpose(1, 0, 2), per_block, axis=-1)[..., :num_n]  # [K, B, NUM_N]
    steps = steps.reshape(-1) * (block_size // block_m)
    num_programs = steps.shape[0]
    total = jnp.sum(steps)
    extra = min(2 * num_sms, num_programs)
    chunk = jnp.maximum(-(-total // extra), 1)
    if not split:
        chunk = jnp.maximum(jnp.max(steps), 1)
    chunks = jnp.maximum(-(-steps // chunk), 1)  # [NP]
    order = jnp.argsort(jnp.where(2 * steps > chunk, -steps, 0), stable=True)
    c_o = chunks[order]
    ends = jnp.cumsum(c_o)
    max_units = num_programs + extra
    u = jnp.arange(max_units, dtype=jnp.int32)
    # The ordered program of unit u, #{p: ends[p] <= u}, as a scatter and a scan: `searchsorted`
    # would be a loop of dependent launches on the GPU.
    idx = jnp.cumsum(jnp.zeros((max_units + 1,), jnp.int32).at[ends].add(1))[:max_units]
    valid = idx < num_programs
    idx = jnp.minimum(idx, num_programs - 1)
    prog = order[idx]
    part = u - (ends - c_o)[idx]
    lo = part * chunk
    hi = jnp.minimum(steps[prog], lo + chunk)
    cut_o = c_o > 1
    slots_o = jnp.where(cut_o, c_o, 0)
    first_slot = (jnp.cumsum(slots_o) - slots_o)  # per ordered program
    slot = jnp.where(cut_o[idx], first_slot[idx] + part, -1)
    units = jnp.stack([jnp.where(valid, prog, -1), lo, hi, jnp.where(valid, slot, -1)])
    max_cut = extra
    rank = jnp.where(cut_o, jnp.cumsum(cut_o) - 1, max_cut)  # max_cut: dropped
    cut = jnp.stack([jnp.full((max_cut,), -1, jnp.int32).at[rank].set(order, mode="drop"),
                     jnp.zeros((max_cut,), jnp.int32).at[rank].set(first_slot, mode="drop"),
                     jnp.zeros((max_cut,), jnp.int32).at[rank].set(c_o, mode="drop")])
    return units.astype(jnp.int32), cut.astype(jnp.int32)


@triton.jit
def _dq_step(dq, j, q, do, lse2, delta, k_base, v_base, pos, row_ok, blocks, i, kv_len,
             SCALE_LOG2: tl.constexpr, K: tl.constexpr, H: tl.constexpr, HV: tl.constexpr,
             SB: tl.constexpr, BS: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_H: tl.constexpr, BLOCK_HV: tl.constexpr, PRECISION: tl.constexpr):
    """Step `i` of the dQ walk: `BLOCK_N` keys of listed block `j`; returns the block of step
    `i + 1` too (loaded one step ahead, as in the forward)."""
    SPB: tl.constexpr = BS // BLOCK_N
    start = tl.multiple_of(j * BS + (i % SPB) * BLOCK_N, BLOCK_N)
    j_next = tl.load(blocks + tl.minimum((i + 1) // SPB, SB - 1))
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    cols = start + offs_n  # [BLOCK_N] key positions
    in_kv = cols < kv_len
    k = _load(k_base + cols[:, None] * (K * H) + offs_h[None, :],  # [BLOCK_N, BLOCK_H]
              in_kv, offs_h < H, MASKED, BLOCK_H != H)
    v = _load(v_base + cols[:, None] * (K * HV) + offs_hv[None, :],  # [BLOCK_N, BLOCK_HV]
              in_kv, offs_hv < HV, MASKED, BLOCK_HV != HV)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    p = tl.exp2(qk * SCALE_LOG2 - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
    ds = p * (dp - delta[:, None])
    if MASKED:  # selected, not multiplied: P = 0 times a NaN key / value would leak
        visible = (cols[None, :] <= pos[:, None]) & in_kv[None, :] & row_ok[:, None]
        ds = tl.where(visible, ds, 0.0)
        k = tl.where(tl.abs(k.to(tl.float32)) < float("inf"), k, 0.0)  # dS = 0 times it
    dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    return dq, j_next


@triton.jit
def _dq_kernel(
    q_ptr,  # [B, T, N, H]
    k_ptr,  # [B, S, K, H]
    v_ptr,  # [B, S, K, HV]
    do_ptr,  # [B, T, N, HV]
    o_ptr,  # [B, T, N, HV]
    lse_ptr,  # [B, T, N] f32
    dlse_ptr,  # [B, T, N] f32
    q_len_ptr,  # [B] int32
    kv_len_ptr,  # [B] int32
    blocks_ptr,  # [B, N, TB, SB] int32 selected key blocks, ascending
    count_ptr,  # [B, N, TB] int32
    whole_ptr,  # [B, N, TB] int32
    dq_ptr,  # [B, T, N, H]
    delta_ptr,  # [B, T, N] f32, out: rowsum(dO * O) - dlse, for the dK / dV kernel
    SCALE: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    TB: tl.constexpr,
    SB: tl.constexpr,
    BS: tl.constexpr,
    NUM_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # The forward's order: siblings fastest, then query tiles (longest lists first), requests,
    # KV heads, so the programs in flight read one KV head's K / V.
    N: tl.constexpr = K * G
    SCALE_LOG2: tl.constexpr = SCALE * LOG2E
    pid = tl.program_id(0)
    kh = pid // (G * NUM_M * B)
    b = (pid // (G * NUM_M)) % B
    mt = NUM_M - 1 - (pid // G) % NUM_M
    n = kh * G + pid % G
    r = (mt * BLOCK_M) // BS

    toks = mt * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    q_len = tl.minimum(tl.maximum(tl.load(q_len_ptr + b), 0), T)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), S)
    row_ok = toks < q_len
    pos = kv_len - q_len + toks
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    q_rows = b.to(tl.int64) * (T * N) + toks * N + n  # [BLOCK_M] of [B * T * N]
    q = tl.load(q_ptr + q_rows[:, None] * H + offs_h[None, :],  # [BLOCK_M, BLOCK_H]
                mask=row_ok[:, None] & (offs_h < H)[None, :], other=0.0)
    do = tl.load(do_ptr + q_rows[:, None] * HV + offs_hv[None, :],  # [BLOCK_M, BLOCK_HV]
                 mask=row_ok[:, None] & (offs_hv < HV)[None, :], other=0.0)
    o = tl.load(o_ptr + q_rows[:, None] * HV + offs_hv[None, :],  # [BLOCK_M, BLOCK_HV]
                mask=row_ok[:, None] & (offs_hv < HV)[None, :], other=0.0)
    lse = tl.load(lse_ptr + q_rows, mask=row_ok, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1) - tl.load(
        dlse_ptr + q_rows, mask=row_ok, other=0.0)
    delta = tl.where(lse == float("-inf"), 0.0, delta)  # rows that see nothing: P = 0
    tl.store(delta_ptr + q_rows, delta, mask=toks < T)
    k_base = k_ptr + b.to(tl.int64) * (S * K * H) + kh * H
    v_base = v_ptr + b.to(tl.int64) * (S * K * HV) + kh * HV

    list_row = (b * N + n) * TB + r
    count = tl.load(count_ptr + list_row)
    whole = tl.load(whole_ptr + list_row)
    blocks = blocks_ptr + list_row.to(tl.int64) * SB

    dq = tl.zeros([BLOCK_M, BLOCK_H], tl.float32)
    SPB: tl.constexpr = BS // BLOCK_N
    j = tl.load(blocks)
    for i in range(0, whole * SPB):  # blocks every query of the tile sees whole: no mask
        dq, j = _dq_step(dq, j, q, do, lse2, delta, k_base, v_base, pos, row_ok, blocks, i,
                         kv_len, SCALE_LOG2, K, H, HV, SB, BS, False, BLOCK_N, BLOCK_H, BLOCK_HV,
                         PRECISION)
    j = tl.load(blocks + tl.minimum(whole, SB - 1))
    for i in range(whole * SPB, count * SPB):  # the diagonal and the length tail
        dq, j = _dq_step(dq, j, q, do, lse2, delta, k_base, v_base, pos, row_ok, blocks, i,
                         kv_len, SCALE_LOG2, K, H, HV, SB, BS, True, BLOCK_N, BLOCK_H, BLOCK_HV,
                         PRECISION)
    # Padding rows: zero (a NaN key of a whole block reaches them through P = 0 times NaN).
    dq = tl.where(row_ok[:, None], dq * SCALE, 0.0)
    tl.store(dq_ptr + q_rows[:, None] * H + offs_h[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=(toks < T)[:, None] & (offs_h < H)[None, :])


@triton.jit
def _dkdv_step(dk, dv, e, k, v, cols, q_base, do_base, lse_base, delta_base, entries, i, kh,
               q_len, kv_len, SCALE_LOG2: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
               H: tl.constexpr, HV: tl.constexpr, TB: tl.constexpr, BS: tl.constexpr,
               MASKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_HV: tl.constexpr, PRECISION: tl.constexpr):
    """Step `i` of the dK / dV walk: `BLOCK_M` queries of entry `e` (query tile `e % TB` of
    sibling `e // TB`); returns the entry of step `i + 1` too (loaded one step ahead)."""
    SPM: tl.constexpr = BS // BLOCK_M
    e_next = tl.load(entries + tl.minimum((i + 1) // SPM, G * TB - 1))
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    toks = (e % TB) * BS + (i % SPM) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = toks < q_len
    q_rows = toks * N + kh * G + e // TB  # [BLOCK_M] rows of this request's [T * N]
    q = _load(q_base + q_rows[:, None] * H + offs_h[None, :],  # [BLOCK_M, BLOCK_H]
              row_ok, offs_h < H, MASKED, BLOCK_H != H)
    do = _load(do_base + q_rows[:, None] * HV + offs_hv[None, :],  # [BLOCK_M, BLOCK_HV]
               row_ok, offs_hv < HV, MASKED, BLOCK_HV != HV)
    if MASKED:
        lse = tl.load(lse_base + q_rows, mask=row_ok, other=float("-inf"))
        delta = tl.load(delta_base + q_rows, mask=row_ok, other=0.0)
    else:
        lse = tl.load(lse_base + q_rows)
        delta = tl.load(delta_base + q_rows)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    p_t = tl.exp2(qk_t * SCALE_LOG2 - lse2[None, :])
    if MASKED:
        pos = kv_len - q_len + toks
        visible = (cols[:, None] <= pos[None, :]) & (cols < kv_len)[:, None] & row_ok[None, :]
        p_t = tl.where(visible, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    ds_t = p_t * (dp_t - delta[None, :])
    if MASKED:  # P = 0 times a NaN value in dP would leak into dK
        ds_t = tl.where(visible, ds_t, 0.0)
    dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    return dk, dv, e_next


@triton.jit
def _dkdv_kernel(
    q_ptr,  # [B, T, N, H]
    k_ptr,  # [B, S, K, H]
    v_ptr,  # [B, S, K, HV]
    do_ptr,  # [B, T, N, HV]
    lse_ptr,  # [B, T, N] f32
    delta_ptr,  # [B, T, N] f32
    q_len_ptr,  # [B] int32
    kv_len_ptr,  # [B] int32
    entries_ptr,  # [B, K, SB, G * TB] int32 (sibling, query tile) pairs, whole first
    whole_ptr,  # [B, K, SB] int32
    units_ptr,  # [4, UNITS] int32: program or -1, first step, end step, partial slot or -1
    dk_ptr,  # [B, S, K, H]
    dv_ptr,  # [B, S, K, HV]
    pk_ptr,  # [SLOTS, BLOCK_N, BLOCK_H] f32 partial dK of cut programs
    pv_ptr,  # [SLOTS, BLOCK_N, BLOCK_HV] f32 partial dV
    SCALE: tl.constexpr,
    B: tl.constexpr,
    T: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    G: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    TB: tl.constexpr,
    SB: tl.constexpr,
    BS: tl.constexpr,
    NUM_N: tl.constexpr,
    UNITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    N: tl.constexpr = K * G
    SCALE_LOG2: tl.constexpr = SCALE * LOG2E
    unit = tl.program_id(0)
    prog = tl.load(units_ptr + unit)
    if prog < 0:  # past the units of this launch (the grid has the static bound)
        return
    lo = tl.load(units_ptr + UNITS + unit)
    hi = tl.load(units_ptr + 2 * UNITS + unit)
    slot = tl.load(units_ptr + 3 * UNITS + unit)
    kh = prog // (B * NUM_N)
    b = (prog // NUM_N) % B
    nt = prog % NUM_N
    jb = (nt * BLOCK_N) // BS  # the key block

    offs_n = tl.arange(0, BLOCK_N)
    cols = nt * BLOCK_N + offs_n  # [BLOCK_N] key positions
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    q_len = tl.minimum(tl.maximum(tl.load(q_len_ptr + b), 0), T)
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + b), 0), S)
    key_ok = cols < kv_len
    k_rows = b.to(tl.int64) * (S * K) + cols * K + kh  # [BLOCK_N] rows of [B * S * K]
    k = tl.load(k_ptr + k_rows[:, None] * H + offs_h[None, :],  # [BLOCK_N, BLOCK_H]
                mask=key_ok[:, None] & (offs_h < H)[None, :], other=0.0)
    v = tl.load(v_ptr + k_rows[:, None] * HV + offs_hv[None, :],  # [BLOCK_N, BLOCK_HV]
                mask=key_ok[:, None] & (offs_hv < HV)[None, :], other=0.0)
    q_base = q_ptr + b.to(tl.int64) * (T * N * H)
    do_base = do_ptr + b.to(tl.int64) * (T * N * HV)
    lse_base = lse_ptr + b.to(tl.int64) * (T * N)
    delta_base = delta_ptr + b.to(tl.int64) * (T * N)

    list_row = (b * K + kh) * SB + jb
    whole = tl.load(whole_ptr + list_row)
    entries = entries_ptr + list_row.to(tl.int64) * (G * TB)

    dk = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_HV], tl.float32)
    SPM: tl.constexpr = BS // BLOCK_M
    # This unit's steps [lo, hi) of the walk: the whole part, then the masked one.
    e = tl.load(entries + tl.minimum(lo // SPM, G * TB - 1))
    for i in range(lo, tl.minimum(hi, whole * SPM)):  # every query sees every key: no mask
        dk, dv, e = _dkdv_step(dk, dv, e, k, v, cols, q_base, do_base, lse_base, delta_base,
                               entries, i, kh, q_len, kv_len, SCALE_LOG2, N, G, H, HV, TB, BS,
                               False, BLOCK_M, BLOCK_H, BLOCK_HV, PRECISION)
    masked_lo = tl.maximum(lo, whole * SPM)
    e = tl.load(entries + tl.minimum(masked_lo // SPM, G * TB - 1))
    for i in range(masked_lo, hi):  # the diagonal tile and the length tails
        dk, dv, e = _dkdv_step(dk, dv, e, k, v, cols, q_base, do_base, lse_base, delta_base,
                               entries, i, kh, q_len, kv_len, SCALE_LOG2, N, G, H, HV, TB, BS,
                               True, BLOCK_M, BLOCK_H, BLOCK_HV, PRECISION)
    if slot < 0:  # the whole program: write its rows
        in_s = cols < S
        tl.store(dk_ptr + k_rows[:, None] * H + offs_h[None, :],
                 (dk * SCALE).to(dk_ptr.dtype.element_ty),
                 mask=in_s[:, None] & (offs_h < H)[None, :])
        tl.store(dv_ptr + k_rows[:, None] * HV + offs_hv[None, :],
                 dv.to(dv_ptr.dtype.element_ty), mask=in_s[:, None] & (offs_hv < HV)[None, :])
    else:  # a chunk of a cut program: its partial sums
        base = slot.to(tl.int64) * BLOCK_N
        tl.store(pk_ptr + (base + offs_n[:, None]) * BLOCK_H + offs_h[None, :], dk)
        tl.store(pv_ptr + (base + offs_n[:, None]) * BLOCK_HV + offs_hv[None, :], dv)


@triton.jit
def _dkdv_reduce_kernel(
    pk_ptr,  # [SLOTS, BLOCK_N, BLOCK_H] f32
    pv_ptr,  # [SLOTS, BLOCK_N, BLOCK_HV] f32
    cut_ptr,  # [3, CUTS] int32: program or -1, first slot, slots
    dk_in_ptr,  # [B, S, K, H], aliased to dk_ptr
    dv_in_ptr,  # [B, S, K, HV], aliased to dv_ptr
    dk_ptr,  # [B, S, K, H]
    dv_ptr,  # [B, S, K, HV]
    SCALE: tl.constexpr,
    B: tl.constexpr,
    S: tl.constexpr,
    K: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    NUM_N: tl.constexpr,
    CUTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HV: tl.constexpr,
):
    """dK / dV rows of the cut programs: their partial sums added in slot order."""
    prog = tl.load(cut_ptr + tl.program_id(0))
    if prog < 0:
        return
    first = tl.load(cut_ptr + CUTS + tl.program_id(0))
    slots = tl.load(cut_ptr + 2 * CUTS + tl.program_id(0))
    kh = prog // (B * NUM_N)
    b = (prog // NUM_N) % B
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_hv = tl.arange(0, BLOCK_HV)
    dk = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_HV], tl.float32)
    for c in range(0, slots):
        base = (first.to(tl.int64) + c) * BLOCK_N
        dk += tl.load(pk_ptr + (base + offs_n[:, None]) * BLOCK_H + offs_h[None, :])
        dv += tl.load(pv_ptr + (base + offs_n[:, None]) * BLOCK_HV + offs_hv[None, :])
    cols = (prog % NUM_N) * BLOCK_N + offs_n
    k_rows = b.to(tl.int64) * (S * K) + cols * K + kh  # [BLOCK_N]
    in_s = cols < S
    tl.store(dk_ptr + k_rows[:, None] * H + offs_h[None, :], (dk * SCALE).to(
        dk_ptr.dtype.element_ty), mask=in_s[:, None] & (offs_h < H)[None, :])
    tl.store(dv_ptr + k_rows[:, None] * HV + offs_hv[None, :], dv.to(dv_ptr.dtype.element_ty),
             mask=in_s[:, None] & (offs_hv < HV)[None, :])


def backward(q, k, v, out, lse, d_out, d_lse, eff, blocks, count, whole, q_lengths, kv_lengths,
             *, block_size: int, scale: float, config, num_sms: int = 132):
    """dQ, dK, dV of block-sparse attention.

    Args:
      q, k, v, out, lse: the forward's inputs and outputs.
      d_out, d_lse: their cotangents (`[B, T, N, Hv]`, `[B, T, N]`).
      eff: `[B, N, Tb, Sb]` bool, the effective block mask.
      blocks, count, whole: the forward's lists (`triton.block_lists` of `eff`).
      q_lengths, kv_lengths: `[B]` int32, clamped to `[0, T]` / `[0, S]`.
      block_size, scale: as the forward.
      config: `attn.block_sparse.triton.Config` (its `dq_*` and `dkv_*` fields; tiles capped at
        the block size).
      num_sms: streaming multiprocessors (`dkv_schedule`'s fair share).

    Returns:
      `(dq, dk, dv)` in the dtypes of q, k, v.
    """
    b, t, n, h = q.shape
    s, kh, hv = k.shape[1], k.shape[2], v.shape[-1]
    dims = dict(SCALE=float(scale), B=b, T=t, S=s, K=kh, G=n // kh, H=h, HV=hv,
                TB=blocks.shape[2], SB=blocks.shape[3], BS=block_size,
                BLOCK_H=max(16, triton.next_power_of_2(h)),
                BLOCK_HV=max(16, triton.next_power_of_2(hv)),
                PRECISION="ieee" if q.dtype == jnp.float32 else "tf32")
    d_out = d_out.astype(q.dtype)

    dq_m, dq_n = min(config.dq_block_m, block_size), min(config.dq_block_n, block_size)
    num_m = triton.cdiv(t, dq_m)
    dq, delta = triton_call(
        q, k, v, d_out, out, lse, d_lse.astype(jnp.float32), q_lengths, kv_lengths, blocks,
        count, whole, kernel=_dq_kernel,
        out_shape=(jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct(lse.shape, jnp.float32)),
        grid=(num_m * b * n,), num_warps=config.dq_num_warps, num_stages=config.dq_num_stages,
        NUM_M=num_m, BLOCK_M=dq_m, BLOCK_N=dq_n, **dims)

    kv_n, kv_m = min(config.dkv_block_n, block_size), min(config.dkv_block_m, block_size)
    num_n = triton.cdiv(s, kv_n)
    entries, t_count, t_whole = transposed_lists(eff, q_lengths, kv_lengths, block_size, kh)
    units, cut = dkv_schedule(t_count, num_n, kv_n, block_size, kv_m, num_sms,
                              split=config.dkv_split)
    slots = 2 * cut.shape[1]
    f32 = jnp.float32
    dk, dv, pk, pv = triton_call(
        q, k, v, d_out, lse, delta, q_lengths, kv_lengths, entries, t_whole, units,
        kernel=_dkdv_kernel,
        out_shape=(jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct((slots, kv_n, dims["BLOCK_H"]), f32),
                   jax.ShapeDtypeStruct((slots, kv_n, dims["BLOCK_HV"]), f32)),
        grid=(units.shape[1],), num_warps=config.dkv_num_warps,
        num_stages=config.dkv_num_stages, NUM_N=num_n, UNITS=units.shape[1], BLOCK_M=kv_m,
        BLOCK_N=kv_n, **dims)
    return (dq, *add_cut_partials(pk, pv, cut, dk, dv, scale=scale, block_n=kv_n))


def add_cut_partials(pk, pv, cut, dk, dv, *, scale: float, block_n: int):
    """`(dk, dv)` with the key rows of the cut programs (`dkv_schedule`'s `cut`) replaced by the
    sums of their float32 partials `pk`, `pv` (`[slots, block_n, >= H]`, dK unscaled), added in
    slot order by `_dkdv_reduce_kernel`."""
    b, s, kh, h = dk.shape
    hv = dv.shape[-1]
    return triton_call(
        pk, pv, cut, dk, dv, kernel=_dkdv_reduce_kernel,
        out_shape=(jax.ShapeDtypeStruct(dk.shape, dk.dtype),
                   jax.ShapeDtypeStruct(dv.shape, dv.dtype)),
        input_output_aliases={3: 0, 4: 1}, grid=(cut.shape[1],), num_warps=4,
        SCALE=float(scale), B=b, S=s, K=kh, H=h, HV=hv, NUM_N=triton.cdiv(s, block_n),
        CUTS=cut.shape[1], BLOCK_N=block_n, BLOCK_H=pk.shape[-1], BLOCK_HV=pv.shape[-1])
