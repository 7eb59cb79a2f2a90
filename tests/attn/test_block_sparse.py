"""Block-sparse attention with per-head modes: every backend through the shared base
(`block_sparse_base`: the token-level oracle under dense attention), and the XLA reference's own
checks: against dense attention with every block selected, streaming as a token window, the
Block-Sparse-Attention grid, gradients, the block-mask helpers against the CUDA kernel's streaming
iterator, and every validation error.

`_bsa_streaming_blocks` re-enacts the CUDA kernel's streaming iterator (`fwdStreaming` in
flash_blockmask.h) to pin the block sets.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import dense
from attn.block_sparse import (
    block_sparse_attention,
    convert_blockmask_row_reverse,
    effective_block_mask,
    replace_ones_with_count,
)
from tests.attn.block_sparse_base import (
    BS,
    S_PAD,
    T_PAD,
    BlockSparseTests,
    batch,
    check_vs_mask,
    mixed_case,
    oracle_mask,
    qkv,
    valid_rows,
)
from tests.utils import AttentionTestBase, assert_all_finite, assert_close, rng


class TestXla(BlockSparseTests):
    implementation = "xla"


def test_every_block_selected_all_full_and_wide_streaming_equal_dense():
    gen = rng()
    q, k, v, q_len, kv_len = batch(gen)
    B, N = q.shape[0], q.shape[2]
    lens = dict(q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))
    out, lse = dense.attention(q, k, v, q_offset=jnp.asarray(kv_len - q_len),
                               kv_lengths=lens["kv_lengths"])
    expected = valid_rows(out, q_len), valid_rows(lse, q_len)
    every = jnp.ones((B, N, T_PAD // BS, S_PAD // BS), bool)
    for modes, sink, local in ((1, 1, 1), (0, 1, 1), (-1, 0, S_PAD // BS)):
        # block-sparse with every block selected; all full; streaming with an all-covering window
        got = block_sparse_attention(q, k, v, jnp.full((B, N), modes, jnp.int32), every,
                                     block_size=BS, sink_blocks=sink, local_blocks=local, **lens)
        AttentionTestBase.check_output(*got, *expected, err_msg=f"mode {modes}")


# (sink, local) per head: adjacent, overlapping, gaps, no sink, no local, nothing at all.
STREAM_HEADS = [(1, 1), (1, 2), (2, 3), (0, 2), (3, 0), (0, 0), (2, 1), (1, 4)]


def test_streaming_equals_dense_with_block_token_mask():
    gen = rng()
    N = len(STREAM_HEADS)
    q, k, v, q_len, kv_len = batch(gen, N=N, K=2)
    sink, local = (np.asarray(x, np.int32) for x in zip(*STREAM_HEADS))
    modes = -np.ones((q.shape[0], N), np.int32)
    out, lse = block_sparse_attention(
        q, k, v, jnp.asarray(modes), block_size=BS, sink_blocks=jnp.asarray(sink),
        local_blocks=jnp.asarray(local), q_lengths=jnp.asarray(q_len),
        kv_lengths=jnp.asarray(kv_len))
    mask = oracle_mask(modes, None, T_PAD, S_PAD, BS, sink, local, q_len, kv_len)
    check_vs_mask(q, k, v, out, lse, mask)


def test_streaming_block_aligned_equals_dense_window_with_sinks():
    # The last query of tile r sees blocks (r - local, r] plus the sinks: a token window of
    # local * bs with sink * bs sink tokens.
    gen = rng()
    sink, local, T = 1, 2, T_PAD
    q, k, v = qkv(gen, 1, T, T, 2, 1)
    out, lse = block_sparse_attention(q, k, v, -jnp.ones((1, 2), jnp.int32), block_size=BS,
                                      sink_blocks=sink, local_blocks=local)
    exp_out, exp_lse = dense.attention(q, k, v, window=local * BS, sinks=sink * BS)
    last = np.arange(BS - 1, T, BS)
    AttentionTestBase.check_output(out[:, last], lse[:, last], exp_out[:, last], exp_lse[:, last])


def _mixed_run(gen, q, k, v, q_len, kv_len, bs):
    """Random modes, block mask and per-head sink / local counts: ours and the oracle mask."""
    B, T, N, _ = q.shape
    S = k.shape[1]
    modes, block_mask, sink, local = mixed_case(gen, B, N, T, S, bs)
    out, lse = block_sparse_attention(
        q, k, v, jnp.asarray(modes), jnp.asarray(block_mask), block_size=bs,
        sink_blocks=jnp.asarray(sink), local_blocks=jnp.asarray(local),
        q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))
    return out, lse, oracle_mask(modes, block_mask, T, S, bs, sink, local, q_len, kv_len)


def test_mixed_modes_on_the_block_sparse_attention_grid():
    """Blocks of 128 (Block-Sparse-Attention's), lengths off the block grid, one query."""
    gen = rng()
    q, k, v = qkv(gen, 3, 200, 300, 6, 2)
    q_len, kv_len = np.array([200, 191, 1], np.int32), np.array([300, 198, 160], np.int32)
    out, lse, mask = _mixed_run(gen, q, k, v, q_len, kv_len, 128)
    check_vs_mask(q, k, v, out, lse, mask)


def test_one_head_alone_under_its_own_mask():
    """Per head: dense attention of that head alone under its own token mask."""
    gen = rng()
    q, k, v, q_len, kv_len = batch(gen)
    out, lse, mask = _mixed_run(gen, q, k, v, q_len, kv_len, BS)
    N = q.shape[2]
    for n in (0, 1, 2):
        g = n // (N // k.shape[2])
        o, l = dense.masked_attention(q[:, :, n:n + 1], k[:, :, g:g + 1], v[:, :, g:g + 1],
                                      jnp.asarray(mask[:, :, n:n + 1]))
        AttentionTestBase.check_output(out[:, :, n:n + 1], lse[:, :, n:n + 1], o, l)


def test_gradients_match_dense_under_the_mask():
    """Modes and geometry traced under jit; rows with no key (empty block mask, streaming without
    blocks, more queries than keys) give finite gradients equal to dense attention's."""
    gen = rng()
    lengths = [(48, 80), (25, 10), (20, 52)]  # the second has more queries than keys
    q, k, v, q_len, kv_len = batch(gen, lengths=lengths)
    B, N = q.shape[0], q.shape[2]
    modes = jnp.asarray([[1, -1, 0, 1]] * B, jnp.int32)
    block_mask = jnp.asarray(gen.random((B, N, 3, 5)) < 0.5).at[:, 0].set(False)
    local = jnp.asarray([1, 0, 1, 1], jnp.int32)
    sink = jnp.asarray([1, 0, 1, 0], jnp.int32)
    mask = oracle_mask(modes, block_mask, T_PAD, S_PAD, BS, sink, local, q_len, kv_len)
    lens = dict(q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))

    def loss(q, k, v, modes, block_mask, sink, local):
        o, l = block_sparse_attention(q, k, v, modes, block_mask, block_size=BS, sink_blocks=sink,
                                      local_blocks=local, **lens)
        return jnp.sum(o ** 2) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0))

    def dense_loss(q, k, v):
        o, l = dense.masked_attention(q, k, v, jnp.asarray(mask))
        return jnp.sum(o ** 2) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, modes, block_mask, sink, local)
    expected = jax.jit(jax.grad(dense_loss, argnums=(0, 1, 2)))(q, k, v)
    for g, e in zip(grads, expected):
        assert_all_finite(g)
        assert_close(g, e, atol=1e-4, rtol=1e-4)


def _bsa_streaming_blocks(r, act_q, act_k, bs, sink, local):
    """Key blocks the CUDA kernel's streaming iterator visits for query tile r (fwdStreaming)."""
    start_row = max((act_q - act_k) // bs, 0)
    start = math.ceil(max(act_k - act_q, 0) / bs) + 1 + r - start_row
    n_block_max = math.ceil(min(act_k, (r + 1) * bs + act_k - act_q) / bs)
    no_gap = start < sink + local
    count = min(sink + local, start)
    blocks = set()
    for i in range(count):
        if no_gap or i < local:
            val = start - 1 - i
        else:
            val = sink - 1 - (i - local)
        if 0 <= val < n_block_max:
            blocks.add(val)
    return blocks


def test_effective_block_mask_matches_bsa_streaming_iterator():
    bs, T, S = 16, 112, 112
    lengths = [(64, 64), (48, 112), (40, 90), (16, 100), (100, 100), (33, 33), (17, 53), (5, 5)]
    heads = [(1, 2), (2, 1), (1, 3), (0, 1), (3, 3), (1, 1), (2, 5), (0, 0)]
    q_len, kv_len = (np.asarray(x, np.int32) for x in zip(*lengths))
    sink, local = (np.asarray(x, np.int32) for x in zip(*heads))
    eff = np.asarray(effective_block_mask(
        -jnp.ones((len(lengths), len(heads)), jnp.int32), num_q_tokens=T, num_kv_tokens=S,
        block_size=bs, sink_blocks=jnp.asarray(sink), local_blocks=jnp.asarray(local),
        q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len)))
    clamped = 0
    for b, (act_q, act_k) in enumerate(lengths):
        last_block = -(-act_k // bs) - 1
        for n, (sk, lc) in enumerate(heads):
            for r in range(T // bs):
                got = set(np.flatnonzero(eff[b, n, r]).tolist())
                if r >= -(-act_q // bs):
                    assert not got
                    continue
                want = _bsa_streaming_blocks(r, act_q, act_k, bs, sk, lc)
                if r + math.ceil((act_k - act_q) / bs) > last_block:
                    # partial last tile: the kernel's local window starts one block past the
                    # keys; ours is clamped to the last key block, so it holds one more block
                    assert r == -(-act_q // bs) - 1
                    extra = last_block - lc + 1
                    want = want | ({extra} if lc > 0 and extra >= 0 else set())
                    clamped += 1
                assert got == want, (act_q, act_k, sk, lc, r, got, want)
    assert clamped > 0


def test_effective_block_mask_small_cases():
    modes = jnp.asarray([[0, 1, -1]], jnp.int32)
    bm = jnp.asarray(np.tril(np.ones((4, 4), bool))[None, None].repeat(3, 1)).at[0, 1, 3, 1].set(
        False)
    eff = np.asarray(effective_block_mask(modes, bm, num_q_tokens=64, num_kv_tokens=64,
                                          block_size=16, sink_blocks=1, local_blocks=1))
    tril = np.tril(np.ones((4, 4), bool))
    np.testing.assert_array_equal(eff[0, 0], tril)
    np.testing.assert_array_equal(eff[0, 1], tril & (np.arange(4)[:, None] * 4 + np.arange(4)
                                                     != 13))
    np.testing.assert_array_equal(eff[0, 2], np.eye(4, dtype=bool) | (np.arange(4) == 0))
    # chunked prefill: 20 queries after a 32-token prefix, a padded block-mask row beyond q_len
    eff = np.asarray(effective_block_mask(
        jnp.zeros((1, 1), jnp.int32), num_q_tokens=32, num_kv_tokens=64, block_size=16,
        q_lengths=jnp.asarray([20]), kv_lengths=jnp.asarray([52])))[0, 0]
    np.testing.assert_array_equal(eff, [[1, 1, 1, 0], [1, 1, 1, 1]])
    # block-sparse rows are clipped to the diagonal whatever the mask says
    eff = np.asarray(effective_block_mask(jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1, 2, 2), bool),
                                          num_q_tokens=32, num_kv_tokens=32, block_size=16))
    np.testing.assert_array_equal(eff[0, 0], [[1, 0], [1, 1]])


def test_effective_block_mask_under_jit_with_traced_modes():
    fn = jax.jit(lambda m, bm: effective_block_mask(m, bm, num_q_tokens=32, num_kv_tokens=32,
                                                    block_size=16))
    got = fn(jnp.asarray([[1, 0]], jnp.int32), jnp.zeros((1, 2, 2, 2), bool))
    np.testing.assert_array_equal(np.asarray(got)[0], [[[0, 0], [0, 0]], [[1, 0], [1, 1]]])


@pytest.mark.parametrize("modes,expected", [
    ([1, 1, 1], [1, 2, 3]),  # all sparse
    ([1, 0, 1, -1, 1], [1, 0, 2, -1, 3]),  # mixed
    ([0, -1, 0, 0], [0, -1, 0, 0]),  # none
    ([[1, 0, 1], [0, 1, 1]], [[1, 0, 2], [0, 1, 2]]),  # per request
], ids=["all-sparse", "mixed", "none", "batched"])
def test_replace_ones_with_count(modes, expected):
    got = replace_ones_with_count(jnp.asarray(modes, jnp.int32))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("row,expected", [
    ([1, 1, 1, 1], [3, 2, 1, 0]),  # all kept
    ([0, 0, 0, 0], [-1, -1, -1, -1]),  # all dropped
    ([1, 0, 1, 1], [3, 2, 0, -1]),  # descending + padding
    ([0, 1, 0, 0, 1], [4, 1, -1, -1, -1]),
], ids=["all-kept", "all-dropped", "descending-padding", "sparse"])
def test_convert_blockmask_row_reverse(row, expected):
    got = convert_blockmask_row_reverse(jnp.asarray(row, bool))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_convert_blockmask_row_reverse_random_rows():
    mask = rng().random((2, 3, 5, 9)) < 0.4
    got = np.asarray(convert_blockmask_row_reverse(jnp.asarray(mask)))
    for idx in np.ndindex(mask.shape[:-1]):
        chosen = sorted(np.flatnonzero(mask[idx]).tolist(), reverse=True)
        assert got[idx].tolist() == chosen + [-1] * (9 - len(chosen))


def test_bad_input():
    q, k = jnp.ones((1, 8, 4, 16)), jnp.ones((1, 8, 2, 16))
    modes = jnp.zeros((1, 4), jnp.int32)
    call = lambda **kw: block_sparse_attention(
        kw.pop("q", q), kw.pop("k", k), kw.pop("v", k), kw.pop("modes", modes),
        kw.pop("bm", None), **{"block_size": 8, **kw})
    with pytest.raises(ValueError, match="q must have shape"):
        call(q=jnp.ones((8, 4, 16)))
    with pytest.raises(ValueError, match="v must have shape"):
        call(v=jnp.ones((8, 2, 16)))
    with pytest.raises(TypeError, match="q.dtype"):
        call(q=q.astype(jnp.int32))
    with pytest.raises(TypeError, match="v.dtype"):
        call(v=k.astype(jnp.int32))
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by num_kv_heads=3"):
        call(k=jnp.ones((1, 8, 3, 16)), v=jnp.ones((1, 8, 3, 16)))
    with pytest.raises(ValueError, match="q head dim"):
        call(k=jnp.ones((1, 8, 2, 8)), v=jnp.ones((1, 8, 2, 8)))
    with pytest.raises(ValueError, match="q batch"):
        call(k=jnp.ones((2, 8, 2, 16)), v=jnp.ones((2, 8, 2, 16)))
    with pytest.raises(ValueError, match=r"v.shape=\(1, 9, 2, 16\) must match"):
        call(v=jnp.ones((1, 9, 2, 16)))
    with pytest.raises(ValueError, match="block_size=12 must be a power of two"):
        call(block_size=12)
    with pytest.raises(ValueError, match=r"head_mask_type.shape=\(4,\)"):
        call(modes=jnp.zeros((4,), jnp.int32))
    with pytest.raises(TypeError, match="head_mask_type.dtype"):
        call(modes=jnp.zeros((1, 4)))
    with pytest.raises(ValueError, match=r"head_mask_type values \[2\]"):
        call(modes=jnp.asarray([[0, 2, 1, -1]]), bm=jnp.ones((1, 4, 1, 1), bool))
    with pytest.raises(ValueError, match="block_mask=None"):
        call(modes=jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"block_mask.shape=\(1, 4, 2, 1\)"):
        call(bm=jnp.ones((1, 4, 2, 1), bool))
    with pytest.raises(TypeError, match="block_mask.dtype"):
        call(bm=jnp.ones((1, 4, 1, 1), jnp.int32))
    with pytest.raises(ValueError, match="sink_blocks=-1 must be >= 0"):
        call(sink_blocks=-1)
    with pytest.raises(ValueError, match=r"local_blocks.shape=\(2,\)"):
        call(local_blocks=jnp.ones((2,), jnp.int32))
    with pytest.raises(ValueError, match=r"local_blocks=\[1, -2, 1, 1\] must be >= 0"):
        call(local_blocks=jnp.asarray([1, -2, 1, 1]))
    with pytest.raises(TypeError, match="sink_blocks.dtype"):
        call(sink_blocks=jnp.ones((4,)))
    with pytest.raises(ValueError, match=r"q_lengths=\[9\] must lie in \[0, 8\]"):
        call(q_lengths=jnp.asarray([9]))
    with pytest.raises(ValueError, match=r"kv_lengths.shape=\(2,\)"):
        call(kv_lengths=jnp.asarray([1, 2]))
    with pytest.raises(TypeError, match="kv_lengths.dtype"):
        call(kv_lengths=jnp.asarray([1.0]))
    with pytest.raises(ValueError, match="scale=0.0 must be positive"):
        call(scale=0.0)
    with pytest.raises(ValueError, match="implementation="):
        call(implementation="cuda")
    with pytest.raises(NotImplementedError, match="Mosaic GPU"):  # no Hopper GPU here
        call(implementation="mosaic")
    with pytest.raises(ValueError, match="num_q_tokens=0 must be positive"):
        effective_block_mask(modes, num_q_tokens=0, num_kv_tokens=8)
    with pytest.raises(ValueError, match="head_mask_type must have shape"):
        effective_block_mask(jnp.zeros((4,), jnp.int32), num_q_tokens=8, num_kv_tokens=8)
    with pytest.raises(TypeError, match="head_mask_type.dtype"):
        replace_ones_with_count(jnp.ones((3,)))
    with pytest.raises(ValueError, match="head axis"):
        replace_ones_with_count(jnp.int32(1))
    with pytest.raises(TypeError, match="block_mask.dtype"):
        convert_blockmask_row_reverse(jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="block axis"):
        convert_blockmask_row_reverse(jnp.bool_(True))
