"""The shared test base of `attn.block_sparse.block_sparse_attention`, and its builders.

The oracle mask (`oracle_mask`) is written per query token from the Block-Sparse-Attention rules
(tile of the query, key block of the key, diagonal, sink / local sets), independently of
`attn/block_sparse/reference.py`, which builds blocks first and expands them; attention under a
mask is `attn.dense.masked_attention`. A backend's test class subclasses `BlockSparseTests` and
sets `implementation` (and `config`, and `lengths`: the (q_len, kv_len) rows of the batched
cases, fewer where the interpreter on a CPU is slow); each check asks the op first whether the
backend takes the case (`block_sparse_attention.reasons`): if it does, the output must match the
oracle; if not, the call must raise `NotImplementedError` naming those reasons.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np
import pytest

from attn import dense
from attn.block_sparse import block_sparse_attention
from tests.utils import AttentionTestBase, assert_close, poison, randn, rng


def qkv(gen, B, T, S, N, K, H=16, Hv=None, dtype=jnp.float32):
    return (randn(gen, (B, T, N, H), dtype), randn(gen, (B, S, K, H), dtype),
            randn(gen, (B, S, K, Hv or H), dtype))


def oracle_mask(modes, block_mask, T, S, bs, sink, local, q_len=None, kv_len=None):
    """`[B, T, N, S]` visibility, one query token and head at a time (numpy)."""
    modes = np.asarray(modes)
    B, N = modes.shape
    q_len = np.full(B, T) if q_len is None else np.asarray(q_len)
    kv_len = np.full(B, S) if kv_len is None else np.asarray(kv_len)
    sink = np.broadcast_to(np.asarray(sink), (N,))
    local = np.broadcast_to(np.asarray(local), (N,))
    s = np.arange(S)
    key_block = s // bs
    out = np.zeros((B, T, N, S), bool)
    for b in range(B):
        off = kv_len[b] - q_len[b]
        for t in range(q_len[b]):
            r = t // bs
            # the tile's diagonal: key block of its last real query (BSA: r + ceil(off / bs))
            last_q = min((r + 1) * bs, q_len[b]) - 1
            diag = (off + last_q) // bs
            assert off < 0 or diag <= r + math.ceil(off / bs)
            token_ok = (s <= off + t) & (s < kv_len[b])
            for n in range(N):
                if modes[b, n] == 0:
                    blocks = key_block <= diag
                elif modes[b, n] == 1:
                    blocks = np.asarray(block_mask)[b, n, r][key_block] & (key_block <= diag)
                else:
                    blocks = (key_block <= diag) & ((key_block > diag - local[n])
                                                    | (key_block < sink[n]))
                out[b, t, n] = blocks & token_ok
    return out


def check_vs_mask(q, k, v, out, lse, mask, dtype=None):
    exp_out, exp_lse = dense.masked_attention(q, k, v, jnp.asarray(mask))
    AttentionTestBase.check_output(out, lse, exp_out, exp_lse, dtype=dtype)
    AttentionTestBase.check_masked_rows(out, lse, np.asarray(mask).sum(-1))


# One padded shape serves every length case (lengths are traced: one compilation).
T_PAD, S_PAD, BS = 48, 80, 16
# (q_len, kv_len) per request: around the block, q shorter than k (chunked prefill) with aligned
# and unaligned prefixes, single tokens.
LENGTHS = [(48, 80), (1, 1), (7, 7), (33, 33), (20, 52), (40, 73), (1, 45), (48, 48), (17, 80)]


def batch(gen, N=4, K=2, lengths=LENGTHS, dtype=jnp.float32):
    q_len, kv_len = (np.asarray(x, np.int32) for x in zip(*lengths))
    q, k, v = qkv(gen, len(lengths), T_PAD, S_PAD, N, K, dtype=dtype)
    return q, k, v, q_len, kv_len


def valid_rows(x, q_len):
    """Zero the padding rows of a dense result so it can be compared with ours (0 / -inf there)."""
    keep = (np.arange(x.shape[1])[None] < q_len[:, None]).reshape(q_len.shape + (-1,)
                                                                  + (1,) * (x.ndim - 2))
    return jnp.where(keep, x, 0.0 if x.ndim == 4 else -jnp.inf)


def mixed_case(gen, B, N, T, S, bs):
    modes = gen.choice([-1, 0, 1], size=(B, N)).astype(np.int32)
    modes[0, :3] = (-1, 0, 1)  # every mode present
    block_mask = gen.random((B, N, -(-T // bs), -(-S // bs))) < 0.5
    sink = gen.integers(0, 3, N).astype(np.int32)
    local = gen.integers(1, 4, N).astype(np.int32)
    return modes, block_mask, sink, local


def problem(gen, *, b, t, s, n, kh, bs, h=16, hv=16, q_lengths=None, kv_lengths=None,
             dtype=jnp.float32, density=0.5):
    q = randn(gen, (b, t, n, h), dtype)
    k = randn(gen, (b, s, kh, h), dtype)
    v = randn(gen, (b, s, kh, hv), dtype)
    modes = jnp.asarray(gen.choice([0, 1, -1], (b, n)), jnp.int32)
    modes = modes.at[0, :3].set(jnp.asarray([0, 1, -1])[: min(3, n)])  # every mode present
    tb, sb = -(-t // bs), -(-s // bs)
    block_mask = jnp.asarray(gen.random((b, n, tb, sb)) < density)
    lens = {}
    if q_lengths is not None:
        lens["q_lengths"] = jnp.asarray(q_lengths, jnp.int32)
        q = poison(q, jnp.arange(t)[None, :] < lens["q_lengths"][:, None])
    if kv_lengths is not None:
        lens["kv_lengths"] = jnp.asarray(kv_lengths, jnp.int32)
        keep = jnp.arange(s)[None, :] < lens["kv_lengths"][:, None]
        k, v = poison(k, keep), poison(v, keep)
    return q, k, v, modes, block_mask, lens


def clean(x):
    """NaN (poisoned padding) as 0: the oracle's inputs."""
    return jnp.where(jnp.isnan(x), 0.0, x).astype(x.dtype)


CASES = {  # name: (problem, options)
    "T64-S64-bs16-G2": (dict(b=1, t=64, s=64, n=4, kh=2, bs=16),
                        dict(block_size=16, sink_blocks=1, local_blocks=2)),
    "T40-S100-bs16-G3-lengths": (
        dict(b=2, t=40, s=100, n=3, kh=1, bs=16, q_lengths=[37, 40], kv_lengths=[90, 45]),
        dict(block_size=16, sink_blocks=np.array([1, 2, 0], np.int32), local_blocks=2)),
    "T65-S65-bs32-G7-subtiles": (dict(b=1, t=65, s=65, n=7, kh=1, bs=32, hv=24),
                                 dict(block_size=32, sink_blocks=1, local_blocks=1, scale=0.2)),
    "q-longer-than-kv": (dict(b=2, t=48, s=48, n=2, kh=2, bs=16, q_lengths=[40, 9],
                              kv_lengths=[30, 48]),
                         dict(block_size=16, local_blocks=np.array([1, 3], np.int32))),
}



class BlockSparseTests(AttentionTestBase):
    """Checks every backend of `block_sparse_attention` passes (or refuses with reasons)."""

    implementation: str = "xla"
    config = None
    lengths = LENGTHS  # rows of the batched cases

    def call(self, q, k, v, modes, block_mask=None, **opts):
        """The op on this backend, or None after checking it refuses with its reasons."""
        kw = dict(implementation=self.implementation, config=self.config)
        reasons = block_sparse_attention.reasons(self.implementation, q, k, v, modes, block_mask,
                                                 config=self.config, **opts)
        if reasons:
            with pytest.raises(NotImplementedError, match=re.escape(reasons[0])):
                block_sparse_attention(q, k, v, modes, block_mask, **kw, **opts)
            return None
        return block_sparse_attention(q, k, v, modes, block_mask, **kw, **opts)

    def check(self, q, k, v, modes, block_mask, *, dtype=None, block_size, sink_blocks=1,
              local_blocks=16, q_lengths=None, kv_lengths=None, scale=None):
        """The backend against dense attention under the token oracle mask (on the inputs with
        their poisoned padding zeroed); returns which (row, query, head) see a key, or None."""
        opts = dict(block_size=block_size, sink_blocks=sink_blocks, local_blocks=local_blocks,
                    q_lengths=q_lengths, kv_lengths=kv_lengths, scale=scale)
        got = self.call(q, k, v, modes, block_mask, **opts)
        if got is None:
            return None
        out, lse = got
        t = q.shape[1]
        mask = oracle_mask(modes, block_mask, t, k.shape[1], block_size, sink_blocks,
                           local_blocks, q_lengths, kv_lengths)
        f32 = [clean(x).astype(jnp.float32) for x in (q, k, v)]
        exp_out, exp_lse = dense.masked_attention(*f32, jnp.asarray(mask), scale=scale)
        tol = {} if dtype is not None else dict(atol=2e-5, rtol=2e-5)
        assert_close(out, exp_out, dtype=dtype, err_msg="out", **tol)
        assert_close(lse, exp_lse, dtype=dtype, allow_neg_inf=True, err_msg="lse")
        self.check_masked_rows(out, lse, mask.sum(-1))
        return mask.any(-1)

    @pytest.mark.parametrize("name", list(CASES))
    def test_matches_token_oracle(self, name):
        """Every mode over the query heads of GQA groups, poisoned padding, lengths, per-head
        sink / local counts, blocks walked in sub-tiles."""
        spec, opts = CASES[name]
        q, k, v, modes, bm, lens = problem(rng(), **spec)
        sees = self.check(q, k, v, modes, bm, **opts, **lens)
        if sees is not None and name == "q-longer-than-kv":
            # Row 0: the first 10 queries sit before key 0; head 0 is full.
            assert not sees[0, :10].any() and sees[0, 10:40, 0].all() and not sees[0, 40:].any()

    def test_mixed_modes_per_head_and_request(self):
        gen = rng()
        q, k, v, q_len, kv_len = batch(gen, lengths=self.lengths)
        b, t, n, _ = q.shape
        modes, block_mask, sink, local = mixed_case(gen, b, n, t, k.shape[1], BS)
        self.check(q, k, v, jnp.asarray(modes), jnp.asarray(block_mask), block_size=BS,
                   sink_blocks=jnp.asarray(sink), local_blocks=jnp.asarray(local),
                   q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))

    @pytest.mark.parametrize("group", [1, 5, 7, 16], ids=lambda g: f"G{g}")
    def test_gqa_group_sizes(self, group):
        gen = rng()
        q, k, v = qkv(gen, 1, 29, 41, group, 1, H=8, Hv=12)
        modes = np.resize(np.array([1, -1, 0], np.int32), group)[None]
        block_mask = gen.random((1, group, 2, 3)) < 0.6
        got = self.check(q, k, v, jnp.asarray(modes), jnp.asarray(block_mask), block_size=16,
                         local_blocks=1)
        assert got is None or got.shape == (1, 29, group)

    def test_fully_masked_rows(self):
        """An empty block mask, streaming without blocks, more queries than keys: exactly 0 and
        -inf."""
        gen = rng()
        q, k, v, q_len, kv_len = batch(gen, lengths=[(48, 80), (25, 10), (20, 52)])
        b, n = q.shape[0], q.shape[2]
        # head 0: empty block mask; head 1: streaming without blocks; head 2: full; 3: sparse.
        modes = jnp.asarray([[1, -1, 0, 1]] * b, jnp.int32)
        block_mask = jnp.asarray(gen.random((b, n, 3, 5)) < 0.5).at[:, 0].set(False)
        sees = self.check(q, k, v, modes, block_mask, block_size=BS,
                          sink_blocks=jnp.asarray([1, 0, 1, 0], jnp.int32),
                          local_blocks=jnp.asarray([1, 0, 1, 1], jnp.int32),
                          q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))
        if sees is not None:
            assert not sees[:, :, :2].any() and not sees[1, 25:].any() and sees[1, 15:25, 2].any()

    def test_padding_poisoned_with_nan_changes_nothing(self):
        """NaN past the lengths: bitwise the result of clean padding (so two runs agree too); the
        other requests' data changes nothing in a request's rows."""
        gen = rng()
        q, k, v, q_len, kv_len = batch(gen, lengths=self.lengths)
        b, t, n, _ = q.shape
        s = k.shape[1]
        modes, block_mask, _, _ = mixed_case(gen, b, n, t, s, BS)
        modes, block_mask = jnp.asarray(modes), jnp.asarray(block_mask)
        opts = dict(block_size=BS, sink_blocks=1, local_blocks=2, q_lengths=jnp.asarray(q_len),
                    kv_lengths=jnp.asarray(kv_len))
        clean_out = self.call(q, k, v, modes, block_mask, **opts)
        if clean_out is None:
            return
        q_keep = np.arange(t)[None] < q_len[:, None]
        kv_keep = np.arange(s)[None] < kv_len[:, None]
        dirty = self.call(poison(q, q_keep), poison(k, kv_keep), poison(v, kv_keep), modes,
                          block_mask, **opts)
        for a, d in zip(clean_out, dirty):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(d))
        last = b - 1
        alone = [jnp.where(jnp.arange(b)[:, None, None, None] == last, x, jnp.roll(x, 1, axis=0))
                 for x in (q, k, v)]
        one = self.call(*alone, modes, block_mask, **opts)
        assert_close(one[0][last], clean_out[0][last])
        assert_close(one[1][last], clean_out[1][last], allow_neg_inf=True)

    def test_bfloat16_matches_float32_oracle(self):
        gen = rng()
        q, k, v, q_len, kv_len = batch(gen, lengths=self.lengths, dtype=jnp.bfloat16)
        b, t, n, _ = q.shape
        modes, block_mask, sink, local = mixed_case(gen, b, n, t, k.shape[1], BS)
        got = self.call(q, k, v, jnp.asarray(modes), jnp.asarray(block_mask), block_size=BS,
                        sink_blocks=jnp.asarray(sink), local_blocks=jnp.asarray(local),
                        q_lengths=jnp.asarray(q_len), kv_lengths=jnp.asarray(kv_len))
        if got is None:
            return
        out, lse = got
        assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
        mask = oracle_mask(modes, block_mask, t, k.shape[1], BS, sink, local, q_len, kv_len)
        exp = dense.masked_attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                     jnp.asarray(mask))
        self.check_output(out, lse, *exp, dtype=jnp.bfloat16)
