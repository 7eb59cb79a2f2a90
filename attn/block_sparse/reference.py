"""Reference block-sparse prefill attention with per-head modes (Block-Sparse-Attention semantics).

Each query head of each request picks a mode (the seed convention):

* `0` dense: every causally visible key block.
* `1` block-sparse: the key blocks set in that head's row of `block_mask` (an XAttention mask).
* `-1` streaming: `sink_blocks` sink blocks plus `local_blocks` local blocks ending at the diagonal.

Geometry (mit-han-lab Block-Sparse-Attention, FlashAttention 2 causal alignment): the queries of a
request sit at the end of its keys, so query `t` has absolute position `kv_len - q_len + t`. Rows of
the block grid are *query-local* tiles `r = t // block_size`; columns are absolute key blocks
`j = s // block_size`. The diagonal block of tile `r` is `d(r) = r + ceil((kv_len - q_len) /
block_size)`, clamped to the last key block: the last key block holding a key that some query
of the tile may see (the clamp fixes a partial last tile when `kv_len - q_len` is not a multiple
of the block, where the CUDA kernel's diagonal points past the keys). Block
selection happens per tile; inside a selected block the token-level causal rule `s <= position`
and the length rule `s < kv_len` still apply (the kernel masks the diagonal tiles by token).

So the effective visibility of key `s` for query `t` is
`eff[b, n, t // bs, s // bs] and s <= kv_len - q_len + t and s < kv_len and t < q_len`, where
`eff` is `effective_block_mask`. Parity with the CUDA kernel needs `block_size = 128` (its tile
grid is fixed at 128); other powers of two define the same semantics on a finer grid.
"""

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from attn.dense import reference as dense_reference

MODE_FULL = 0
MODE_BLOCK_SPARSE = 1
MODE_STREAMING = -1


def _cdiv(a, b):
    """Ceiling division that is exact for negative numerators too (`-((-a) // b)`)."""
    return -((-a) // b)


def _lengths(lengths, default: int, batch: int) -> Int[Array, " B"]:
    """Lengths clamped to `[0, default]` (T or S): a traced length outside it means the nearest
    end, as in the kernel; concrete ones are refused by `api.py`."""
    if lengths is None:
        return jnp.full((batch,), default, jnp.int32)
    return jnp.clip(jnp.asarray(lengths, jnp.int32), 0, default)


def diagonal_blocks(
    num_q_blocks: int, q_lengths: Int[Array, " B"], kv_lengths: Int[Array, " B"], block_size: int
) -> Int[Array, "B Tb"]:
    """Diagonal key block of every query tile: the block of the tile's last valid query.

    That is `d(r) = min(r + ceil((kv_len - q_len) / bs), ceil(kv_len / bs) - 1)`. The first term
    is Block-Sparse-Attention's diagonal; the clamp only matters for a partial last tile when
    `kv_len - q_len` is not a multiple of `bs`, where the kernel's diagonal points one block past
    the keys (and a streaming head would lose one local block).
    """
    shift = _cdiv(kv_lengths - q_lengths, block_size)  # [B]
    last = _cdiv(kv_lengths, block_size) - 1  # [B]
    d = jnp.arange(num_q_blocks, dtype=jnp.int32)[None, :] + shift[:, None]
    return jnp.minimum(d, last[:, None])


def effective_block_mask(head_mask_type, block_mask, *, num_q_tokens, num_kv_tokens, block_size=128,
                         sink_blocks=1, local_blocks=16, q_lengths=None, kv_lengths=None):
    """Specification of `attn.block_sparse.effective_block_mask`, the key blocks each (request,
    query head, query tile) visits. With the diagonal `d(r)` (`diagonal_blocks`): dense rows hold
    every block `j <= d(r)`; block-sparse rows the `block_mask` row (None: all False) clipped to
    `j <= d(r)`; streaming rows `{d(r) - local_blocks < j <= d(r)} ∪ {j < sink_blocks}` clipped
    to `j <= d(r)`. Every row drops blocks past the request's keys and tiles past its queries."""
    B, N = head_mask_type.shape
    Tb, Sb = _cdiv(num_q_tokens, block_size), _cdiv(num_kv_tokens, block_size)
    q_len = _lengths(q_lengths, num_q_tokens, B)
    kv_len = _lengths(kv_lengths, num_kv_tokens, B)
    d = diagonal_blocks(Tb, q_len, kv_len, block_size)[:, None, :, None]  # [B, 1, Tb, 1]
    j = jnp.arange(Sb, dtype=jnp.int32)[None, None, None, :]  # [1, 1, 1, Sb]
    sink = jnp.broadcast_to(jnp.asarray(sink_blocks, jnp.int32), (N,))[None, :, None, None]
    local = jnp.broadcast_to(jnp.asarray(local_blocks, jnp.int32), (N,))[None, :, None, None]
    streaming = (j > d - local) | (j < sink)
    sparse = jnp.zeros((B, N, Tb, Sb), bool) if block_mask is None else block_mask.astype(bool)
    mode = head_mask_type.astype(jnp.int32)[:, :, None, None]
    selected = jnp.where(mode == MODE_FULL, True,
                         jnp.where(mode == MODE_BLOCK_SPARSE, sparse,
                                   jnp.where(mode == MODE_STREAMING, streaming, False)))
    r = jnp.arange(Tb, dtype=jnp.int32)[None, None, :, None]
    in_range = ((j <= d) & (j < _cdiv(kv_len, block_size)[:, None, None, None])
                & (r < _cdiv(q_len, block_size)[:, None, None, None]))
    return selected & in_range


def token_mask(
    block_mask: Bool[Array, "B N Tb Sb"],
    *,
    num_q_tokens: int,
    num_kv_tokens: int,
    block_size: int,
    q_lengths: Int[Array, " B"] | None = None,
    kv_lengths: Int[Array, " B"] | None = None,
) -> Bool[Array, "B N T S"]:
    """Expand an effective block mask to tokens and apply the causal and length rules."""
    B = block_mask.shape[0]
    T, S = num_q_tokens, num_kv_tokens
    q_len = _lengths(q_lengths, T, B)[:, None, None, None]
    kv_len = _lengths(kv_lengths, S, B)[:, None, None, None]
    t = jnp.arange(T, dtype=jnp.int32)[None, None, :, None]
    s = jnp.arange(S, dtype=jnp.int32)[None, None, None, :]
    blocks = jnp.repeat(jnp.repeat(block_mask, block_size, axis=2)[:, :, :T], block_size, axis=3)
    return blocks[..., :S] & (s <= kv_len - q_len + t) & (s < kv_len) & (t < q_len)


def block_sparse_attention(q, k, v, head_mask_type, block_mask=None, *, block_size=128,
                           sink_blocks=1, local_blocks=16, q_lengths=None, kv_lengths=None,
                           scale=None):
    """Specification of `attn.block_sparse.block_sparse_attention`: dense `masked_attention`
    under `token_mask` of `effective_block_mask`; padding is zeroed first so 0-weight keys
    cannot make `0 * NaN`."""
    B, T = q.shape[:2]
    S = k.shape[1]
    q_len = _lengths(q_lengths, T, B)
    kv_len = _lengths(kv_lengths, S, B)
    # Padding may hold anything (NaN included); zero it so 0-weight keys cannot make 0 * NaN.
    q = jnp.where((jnp.arange(T) < q_len[:, None])[:, :, None, None], q, 0)
    kv_valid = (jnp.arange(S) < kv_len[:, None])[:, :, None, None]
    k, v = jnp.where(kv_valid, k, 0), jnp.where(kv_valid, v, 0)
    eff = effective_block_mask(head_mask_type, block_mask, num_q_tokens=T, num_kv_tokens=S,
                               block_size=block_size, sink_blocks=sink_blocks,
                               local_blocks=local_blocks, q_lengths=q_len, kv_lengths=kv_len)
    mask = token_mask(eff, num_q_tokens=T, num_kv_tokens=S, block_size=block_size,
                      q_lengths=q_len, kv_lengths=kv_len)
    return dense_reference.masked_attention(q, k, v, jnp.swapaxes(mask, 1, 2), scale=scale)


def replace_ones_with_count(head_mask_type: Int[Array, "*B N"]) -> Int[Array, "*B N"]:
    """BSA input format: each mode 1 becomes its 1-based rank among the mode-1 heads.

    `[1, 0, 1, -1, 1] -> [1, 0, 2, -1, 3]`; the kernel then reads `base_blockmask[b, rank - 1]`.
    """
    x = jnp.asarray(head_mask_type, jnp.int32)
    ones = x == MODE_BLOCK_SPARSE
    return jnp.where(ones, jnp.cumsum(ones, axis=-1, dtype=jnp.int32), x)


def convert_blockmask_row_reverse(block_mask: Bool[Array, "*R Sb"]) -> Int[Array, "*R Sb"]:
    """BSA input format: each row lists its selected key blocks in descending order, -1 padded.

    `[1, 0, 1, 1] -> [3, 2, 0, -1]`. (Stable ascending sort of the 0/1 values, indices of the
    zeros set to -1, last axis flipped.)
    """
    m = jnp.asarray(block_mask).astype(jnp.int32)
    idx = jnp.argsort(m, axis=-1, stable=True).astype(jnp.int32)
    kept = jnp.take_along_axis(m, idx, axis=-1) > 0
    return jnp.flip(jnp.where(kept, idx, -1), axis=-1)
