"""XAttention estimate and threshold selection against slow loop formulations (numpy, float64).

`_oracle_sums` computes every antidiagonal sum with explicit index arithmetic, one (reduced row,
reduced column) at a time, and the causal softmax one reduced row at a time: no flip / concat /
einsum trick as in `attn/xattention/reference.py`. `_oracle_select` walks each row's blocks in
sorted order with a running sum.
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.xattention import find_blocks, xattn_estimate
from attn.xattention import reference as ref
from tests.utils import assert_close, poison, randn, rng

T_PAD, S_PAD, BS, ST = 48, 80, 16, 4
# (q_len, kv_len) per request: full, lengths off the block and the stride, chunked prefill with an
# aligned and an unaligned prefix, a single token, more queries than keys.
LENGTHS = [(48, 80), (48, 48), (37, 37), (30, 62), (20, 51), (1, 33), (25, 10)]


def _inputs(gen, lengths=LENGTHS, N=4, K=2, H=8, T=T_PAD, S=S_PAD, dtype=jnp.float32):
    q_len, kv_len = (np.asarray(x, np.int32) for x in zip(*lengths))
    return (randn(gen, (len(lengths), T, N, H), dtype), randn(gen, (len(lengths), S, K, H), dtype),
            q_len, kv_len)


def _diagonal(r, q_len, kv_len, bs):
    """Key block of the last real query of tile r (queries are the last q_len of kv_len keys)."""
    return (kv_len - q_len + min((r + 1) * bs, q_len) - 1) // bs


def _oracle_sums(q, k, q_len, kv_len, bs, st, norm=1.0):
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, T, N, H = q.shape
    S, K = k.shape[1:3]
    Tb, Sb = -(-T // bs), -(-S // bs)
    sums = np.zeros((B, N, Tb, Sb))
    i = np.arange(st)
    for b in range(B):
        qb = np.zeros((Tb * bs, N, H))
        kb = np.zeros((Sb * bs, K, H))
        qb[:q_len[b]] = q[b, :q_len[b]]
        kb[:kv_len[b]] = k[b, :kv_len[b]]
        shift = math.ceil((kv_len[b] - q_len[b]) / st)
        for n in range(N):
            g = n // (N // K)
            for m in range(-(-q_len[b] // st)):
                cols = [r for r in range(-(-kv_len[b] // st)) if r <= m + shift]
                if not cols:
                    continue
                a = np.array([np.sum(qb[m * st + st - 1 - i, n] * kb[r * st + i, g])
                              for r in cols]) / math.sqrt(H) / st / norm
                p = np.exp(a - a.max())
                p /= p.sum()
                for r, pr in zip(cols, p):
                    sums[b, n, m * st // bs, r * st // bs] += pr
    return sums


def _oracle_select(sums, q_len, kv_len, bs, tau):
    sums = np.asarray(sums, np.float64)
    B, N, Tb, Sb = sums.shape
    mask = np.zeros(sums.shape, bool)
    for b, n in np.ndindex(B, N):
        for r in range(min(Tb, -(-q_len[b] // bs))):
            x, d = sums[b, n, r], _diagonal(r, q_len[b], kv_len[b], bs)
            forced = {j for j in (0, d) if 0 <= j < Sb}
            kept, acc = set(forced), sum(x[j] for j in forced)
            for j in sorted(set(range(Sb)) - forced, key=lambda j: (-x[j], j)):
                if not acc < tau * x.sum():
                    break
                kept.add(j)
                acc += x[j]
            for j in kept:
                if j <= d and j < -(-kv_len[b] // bs):
                    mask[b, n, r, j] = True
    return mask


def test_antidiagonal_scores_are_strided_antidiagonal_sums():
    gen = rng()
    st, N, K, H = 4, 6, 2, 8
    q, k = randn(gen, (2, 12, N, H)), randn(gen, (2, 20, K, H))
    got = np.asarray(ref.antidiagonal_scores(q, k, st))
    qn, kn = np.asarray(q, np.float64), np.asarray(k, np.float64)
    for b, n, m, r in np.ndindex(2, N, 3, 5):
        want = sum(qn[b, m * st + st - 1 - i, n] @ kn[b, r * st + i, n // (N // K)]
                   for i in range(st))
        assert abs(got[b, n, m, r] - want) < 1e-4, (b, n, m, r)


@pytest.mark.parametrize("tau", [0.5, 0.9], ids=lambda t: f"tau{t}")
def test_estimate_matches_slow_loops(tau):
    gen = rng()
    q, k, q_len, kv_len = _inputs(gen)
    sums, mask = xattn_estimate(q, k, block_size=BS, stride=ST, threshold=tau,
                                q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))
    assert sums.shape == mask.shape == (len(LENGTHS), 4, T_PAD // BS, S_PAD // BS)
    assert sums.dtype == jnp.float32 and mask.dtype == jnp.bool_
    assert_close(sums, _oracle_sums(q, k, q_len, kv_len, BS, ST), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(mask),
                                  _oracle_select(sums, q_len, kv_len, BS, tau))


def test_estimate_at_block_128_stride_16():
    gen = rng()
    lengths = [(300, 300), (170, 300)]
    q, k, q_len, kv_len = _inputs(gen, lengths, N=2, K=1, H=16, T=300, S=300)
    sums, mask = xattn_estimate(q, k, q_lengths=jnp.asarray(q_len),
                                kv_lengths=jnp.asarray(kv_len))  # defaults: 128, 16, 0.9
    assert mask.shape == (2, 2, 3, 3)
    assert_close(sums, _oracle_sums(q, k, q_len, kv_len, 128, 16), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(mask), _oracle_select(sums, q_len, kv_len, 128, 0.9))
    # each tile row holds one unit of mass per reduced row of real queries
    np.testing.assert_allclose(np.asarray(sums[0]).sum(-1), [[8, 8, 3]] * 2, rtol=1e-5)


def test_mask_structure_and_threshold_monotone():
    gen = rng()
    q, k, q_len, kv_len = _inputs(gen)
    lens = dict(q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))
    masks = [np.asarray(xattn_estimate(q, k, block_size=BS, stride=ST, threshold=t, **lens)[1])
             for t in (0.3, 0.8, 1.0)]
    for low, high in itertools.pairwise(masks):
        assert (low <= high).all()  # a larger threshold keeps a longer prefix of the same order
    for b, (ql, kl) in enumerate(zip(q_len, kv_len)):
        for r in range(T_PAD // BS):
            row = masks[1][b, :, r]
            if r >= -(-ql // BS):
                assert not row.any()
                continue
            d = _diagonal(r, ql, kl, BS)
            assert not row[:, d + 1:].any() and not row[:, -(-kl // BS):].any()
            if d >= 0:
                assert row[:, 0].all() and row[:, d].all()  # sink and diagonal kept


def test_chunking_changes_nothing_and_bfloat16():
    gen = rng()
    q, k, q_len, kv_len = _inputs(gen)
    lens = dict(q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))
    sums, mask = xattn_estimate(q, k, block_size=BS, stride=ST, **lens)
    for chunk in (16, 32):
        s, m = xattn_estimate(q, k, block_size=BS, stride=ST, chunk_size=chunk, **lens)
        assert_close(s, sums, atol=1e-6, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(m), np.asarray(mask))
    s16, _ = xattn_estimate(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), block_size=BS,
                            stride=ST, **lens)
    expected = _oracle_sums(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), q_len, kv_len, BS, ST)
    assert_close(s16, expected, atol=1e-5, rtol=1e-5)  # float32 math on bfloat16 inputs


def test_padding_poisoned_with_nan_and_jit():
    gen = rng()
    q, k, q_len, kv_len = _inputs(gen)
    fn = jax.jit(lambda q, k, ql, kl: xattn_estimate(q, k, block_size=BS, stride=ST,
                                                     q_lengths=ql, kv_lengths=kl))
    lens = jnp.asarray(q_len), jnp.asarray(kv_len)
    clean = fn(q, k, *lens)
    q_keep = np.arange(T_PAD)[None] < q_len[:, None]
    kv_keep = np.arange(S_PAD)[None] < kv_len[:, None]
    dirty = fn(poison(q, q_keep), poison(k, kv_keep), *lens)
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_find_blocks_properties():
    gen = rng()
    B, N, Tb, Sb, tau = 3, 4, 6, 9, 0.8
    sums = gen.random((B, N, Tb, Sb)) ** 3
    diagonal = np.arange(Tb) + Sb - Tb
    sums = np.where(np.arange(Sb) <= diagonal[:, None], sums, 0.0).astype(np.float32)
    mask = np.asarray(find_blocks(jnp.asarray(sums), threshold=tau))
    np.testing.assert_array_equal(mask, _oracle_select(sums, [Tb * 4] * B, [Sb * 4] * B, 4, tau))
    for b, n, r in np.ndindex(B, N, Tb):
        x, m, d = sums[b, n, r], mask[b, n, r], diagonal[r]
        assert m[0] and m[d] and not m[d + 1:].any()  # sink, diagonal, block causal
        assert x[m].sum() >= tau * x.sum() * (1 - 1e-6)  # enough mass
        free = m.copy()
        free[[0, d]] = False
        if free.any():  # minimal: dropping the lightest optional block falls short
            lightest = np.flatnonzero(free)[np.argmin(x[free])]
            assert x[m].sum() - x[lightest] < tau * x.sum()
            # and it is a prefix of the descending order: no unkept block outweighs a kept one
            unkept = ~m & (np.arange(Sb) <= d)
            assert not unkept.any() or x[unkept].max() <= x[free].min()
    # an explicit diagonal
    diag = jnp.zeros((B, Tb), jnp.int32)
    assert not np.asarray(find_blocks(jnp.asarray(sums), diag, threshold=tau))[..., 1:].any()


def test_default_chunk_size_rule():
    assert [ref.default_chunk_size(n) for n in (100, 8192, 16384, 32768, 65536)] == [
        2048, 8192, 16384, 8192, 4096]


def test_bad_input():
    q, k = jnp.ones((1, 32, 4, 8)), jnp.ones((1, 32, 2, 8))
    est = lambda **kw: xattn_estimate(kw.pop("q", q), kw.pop("k", k),
                                      **{"block_size": 16, "stride": 4, **kw})
    with pytest.raises(ValueError, match="q must have shape"):
        est(q=jnp.ones((32, 4, 8)))
    with pytest.raises(TypeError, match="k.dtype"):
        est(k=k.astype(jnp.int32))
    with pytest.raises(ValueError, match="num_heads=4 must be divisible by num_kv_heads=3"):
        est(k=jnp.ones((1, 32, 3, 8)))
    with pytest.raises(ValueError, match="block_size=24 must be a power of two"):
        est(block_size=24)
    with pytest.raises(ValueError, match="block_size=16 must be divisible by stride=3"):
        est(stride=3)
    with pytest.raises(ValueError, match="stride=0 must be positive"):
        est(stride=0)
    with pytest.raises(ValueError, match="threshold=0.0 must lie in"):
        est(threshold=0.0)
    with pytest.raises(ValueError, match="threshold=1.5 must lie in"):
        est(threshold=1.5)
    with pytest.raises(TypeError, match="threshold="):
        est(threshold="0.9")
    with pytest.raises(ValueError, match="norm=0 must be positive"):
        est(norm=0)
    with pytest.raises(ValueError, match="chunk_size=24 must be divisible by block_size=16"):
        est(chunk_size=24)
    with pytest.raises(ValueError, match="chunk_size=0 must be positive"):
        est(chunk_size=0)
    with pytest.raises(ValueError, match=r"kv_lengths=\[40\] must lie in \[0, 32\]"):
        est(kv_lengths=jnp.asarray([40]))
    with pytest.raises(ValueError, match="implementation="):
        est(implementation="cuda")
    with pytest.raises(ValueError, match="block_sums must have shape"):
        find_blocks(jnp.ones((2, 3, 4)))
    with pytest.raises(TypeError, match="block_sums.dtype"):
        find_blocks(jnp.ones((1, 1, 2, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"diagonal.shape=\(2,\)"):
        find_blocks(jnp.ones((1, 1, 2, 2)), jnp.zeros((2,), jnp.int32))
    with pytest.raises(TypeError, match="diagonal.dtype"):
        find_blocks(jnp.ones((1, 1, 2, 2)), jnp.zeros((1, 2)))
    with pytest.raises(ValueError, match="threshold=-1 must lie in"):
        find_blocks(jnp.ones((1, 1, 2, 2)), threshold=-1)
