"""Dense attention reference: against a float64 numpy loop with an explicit mask, and its contracts.

The oracle (`_oracle_mask`, `_oracle`) is written from the conventions, one query row and KV head at
a time, independently of `attn/dense/reference.py` (no shared code, no einsum, float64).

Compilation dominates the run time on a CPU, so most tests share one shape (`B, T, S, N, K, H, HV`)
and pass every optional argument as an array: the public function then compiles once for them all.
Inputs are numpy arrays so that slicing them costs no compilation either.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import (
    attention,
    attention_varlen,
    masked_attention,
    positions_from_cu_seqlens,
    segment_ids_from_cu_seqlens,
    visible_mask,
)
from attn.dense import reference as ref
from tests.utils import (
    EDGE_LENGTHS,
    GROUP_SIZES,
    AttentionTestBase,
    assert_all_finite,
    assert_close,
    case_id,
    randn,
    rng,
)

B, T, S, N, K, H, HV = 2, 13, 21, 8, 2, 16, 12  # the shared shape: G = 4, Hv != H


def _oracle_mask(B, T, S, K, *, causal=True, q_offset=0, window=None, sinks=0,
                 q_segment_ids=None, kv_segment_ids=None, kv_lengths=None):
    """`[B, T, K, S]` visibility straight from the conventions, one (row, KV head) at a time."""
    offsets = np.broadcast_to(np.asarray(q_offset), (B,))
    windows = None if window is None else np.broadcast_to(np.asarray(window), (K,))
    sink = np.broadcast_to(np.asarray(sinks), (K,))
    s = np.arange(S)
    mask = np.zeros((B, T, K, S), bool)
    for b, t, kh in itertools.product(range(B), range(T), range(K)):
        pos = offsets[b] + t
        ok = np.ones(S, bool)
        if causal:
            ok &= s <= pos
        if windows is not None and windows[kh] > 0:
            ok &= (s > pos - windows[kh]) | (s < sink[kh])
        if q_segment_ids is not None:
            ok &= np.asarray(kv_segment_ids)[b] == np.asarray(q_segment_ids)[b, t]
        if kv_lengths is not None:
            ok &= s < np.asarray(kv_lengths)[b]
        mask[b, t, kh] = ok
    return mask


def _oracle(q, k, v, mask, scale=None):
    """float64 attention under a `[B, T, K or N, S]` mask; rows that see nothing give 0 / -inf."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    B, T, N, H = q.shape
    G = N // k.shape[2]
    scale = H**-0.5 if scale is None else scale
    out = np.zeros((B, T, N, v.shape[-1]))
    lse = np.full((B, T, N), -np.inf)
    for b, t, n in itertools.product(range(B), range(T), range(N)):
        vis = mask[b, t, n if mask.shape[2] == N else n // G]
        if vis.any():
            scores = k[b, vis, n // G] @ q[b, t, n] * scale
            m = scores.max()
            p = np.exp(scores - m)
            out[b, t, n] = p @ v[b, vis, n // G] / p.sum()
            lse[b, t, n] = m + np.log(p.sum())
    return out, lse


def _heads(mask_k, G):
    """Per-KV-head `[B, T, K, ...]` -> per-query-head `[B, T, N, ...]`."""
    return np.repeat(mask_k, G, axis=2)


def _qkv(gen, B=B, T=T, S=S, N=N, K=K, H=H, Hv=HV, dtype=jnp.float32):
    return tuple(np.array(randn(gen, shape, dtype))
                 for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv)))


def _nan_where(x, bad):
    """`x` with NaN wherever `bad` (broadcast over the trailing axes) is True."""
    bad = np.asarray(bad).reshape(np.shape(bad) + (1,) * (x.ndim - np.ndim(bad)))
    return np.where(bad, np.nan, x).astype(x.dtype)


def _segments(gen, B, L, num):
    """Sorted random segment ids `[B, L]` with `num` segments per row."""
    cuts = np.sort(gen.integers(0, L, (B, num - 1)), axis=1)
    return (np.arange(L)[None, :, None] >= cuts[:, None, :]).sum(-1).astype(np.int32)


def _all_options(**given):
    """Every optional mask argument as an array (defaults: no effect), so one compile serves all."""
    opts = dict(q_offset=np.zeros(B, np.int32), window=np.zeros(K, np.int32),
                sinks=np.zeros(K, np.int32), q_segment_ids=np.zeros((B, T), np.int32),
                kv_segment_ids=np.zeros((B, S), np.int32), kv_lengths=np.full(B, S, np.int32))
    opts.update({name: np.asarray(x, np.int32) for name, x in given.items()})
    return opts


@jax.jit
def _loss(q, k, v, w_out, w_lse, opts):
    out, lse = attention(q, k, v, **opts)
    return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse * w_lse, 0.0))


_loss_grad = jax.jit(jax.grad(_loss, argnums=(0, 1, 2)))


def _explicit(q, k, v, mask_n, scale):
    """Textbook jnp attention: heads repeated, jax.nn.softmax; `[B, T, N, S]` mask, no empty row."""
    G = q.shape[2] // k.shape[2]
    kr, vr = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("btnh,bsnh->bnts", q, kr, precision=hi) * scale
    s = jnp.where(jnp.asarray(mask_n).transpose(0, 2, 1, 3), s, -jnp.inf)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), vr, precision=hi)
    return out, jax.nn.logsumexp(s, axis=-1).transpose(0, 2, 1)


# Named option sets on the shared shape; values that need K are per KV head.
OPTIONS = {
    "causal": dict(),
    "causal-offset": dict(q_offset=8),
    "noncausal": dict(causal=False),
    "noncausal-lengths": dict(causal=False, kv_lengths=np.array([21, 6], np.int32)),
    "window5": dict(q_offset=8, window=5),
    "window1": dict(q_offset=8, window=1),
    "window-sinks": dict(q_offset=8, window=4, sinks=3),
    "offset-array": dict(q_offset=np.array([3, 8], np.int32), window=6, sinks=2),
    "perhead-window": dict(q_offset=8, window=np.array([3, 0], np.int32),
                           sinks=np.array([2, 5], np.int32)),
    "perhead-negative": dict(q_offset=8, window=np.array([-1, 4], np.int32), sinks=1),
    "kv-lengths": dict(q_offset=np.array([8, 0], np.int32), kv_lengths=np.array([21, 5], np.int32)),
    "scale": dict(q_offset=2, scale=0.3),
    "segments": dict(segments=3),
    "everything": dict(q_offset=np.array([2, 8], np.int32), window=np.array([4, 0], np.int32),
                       sinks=np.array([1, 2], np.int32), segments=2,
                       kv_lengths=np.array([19, 20], np.int32)),
}

# Every edge length once, each with another group size; G=4 is the shared shape's.
EDGE = list(zip(EDGE_LENGTHS, (1, 5, 7, 16, 3, 2, 8)))


class TestDense(AttentionTestBase):
    def test_grids_cover_every_group_size(self):
        assert {g for _, g in EDGE} | {N // K} == set(GROUP_SIZES)

    @pytest.mark.parametrize("T,G", EDGE, ids=[case_id(T=t, G=g) for t, g in EDGE])
    def test_edge_grid_causal(self, T, G):
        kv_heads = 2 if G < 8 else 1
        q, k, v = _qkv(rng(), T=T, S=T + 3, N=G * kv_heads, K=kv_heads)  # chunk after 3 keys
        out, lse = attention(q, k, v, q_offset=3)
        exp = _oracle(q, k, v, _oracle_mask(B, T, T + 3, kv_heads, q_offset=3))
        self.check_output(out, lse, *exp, err_msg=case_id(T=T, G=G))

    @pytest.mark.parametrize("name", list(OPTIONS))
    def test_options(self, name):
        gen = rng()
        opts = dict(OPTIONS[name])
        scale, num_seg = opts.pop("scale", None), opts.pop("segments", 0)
        if num_seg:
            opts["q_segment_ids"] = _segments(gen, B, T, num_seg)
            opts["kv_segment_ids"] = np.concatenate(  # keys past T: one more segment
                [opts["q_segment_ids"], np.full((B, S - T), num_seg, np.int32)], axis=1)
        q, k, v = _qkv(gen)
        out, lse = attention(q, k, v, scale=scale, **opts)
        mask = _oracle_mask(B, T, S, K, **opts)
        self.check_output(out, lse, *_oracle(q, k, v, mask, scale), err_msg=name)
        self.check_masked_rows(out, lse, _heads(mask.sum(-1), N // K))
        np.testing.assert_array_equal(np.asarray(visible_mask(B, T, S, K, **opts)), mask)

    def test_fully_masked_rows_poisoned_padding_and_gradients(self):
        gen = rng()
        # Row 0 has no key at all; in row 1 the window slides past kv_lengths from t=5 on; the
        # last two queries of each row are in a segment no key belongs to.
        q_seg = np.zeros((B, T), np.int32)
        q_seg[:, -2:] = 7
        opts = _all_options(q_offset=[8, 8], window=[3, 3], kv_lengths=[0, 11],
                            q_segment_ids=q_seg)
        mask = _oracle_mask(B, T, S, K, **opts)
        count = _heads(mask.sum(-1), N // K)  # [B, T, N]
        assert (count[0] == 0).all() and (count[1, :5] > 0).all() and (count[1, 5:] == 0).all()
        q, k, v = _qkv(gen)
        out, lse = attention(q, k, v, **opts)
        self.check_masked_rows(out, lse, count)
        self.check_output(out, lse, *_oracle(q, k, v, mask))

        # NaN in keys nobody sees and in queries that see nothing changes nothing ...
        dead_keys = np.arange(S)[None] >= opts["kv_lengths"][:, None]  # [B, S]
        dead_rows = count == 0  # [B, T, N]
        bad = (_nan_where(q, dead_rows), _nan_where(k, dead_keys), _nan_where(v, dead_keys))
        self.check_output(*attention(*bad, **opts), out, lse)
        # ... and gradients stay finite, zero where nothing is seen, equal to the clean ones.
        w_out, w_lse = np.array(randn(gen, out.shape)), np.array(randn(gen, lse.shape))
        clean = _loss_grad(q, k, v, w_out, w_lse, opts)
        dirty = _loss_grad(*bad, w_out, w_lse, opts)
        for name, g, c, dead in zip("qkv", dirty, clean, (dead_rows, dead_keys, dead_keys)):
            assert_all_finite(g, f"d{name}")
            assert (np.asarray(g)[dead] == 0).all(), f"d{name} nonzero where nothing is seen"
            assert_close(g, c, err_msg=f"d{name}")

    def test_window_edge_cases(self):
        q, k, v = _qkv(rng())
        full = attention(q, k, v, q_offset=8)
        # A window <= 0 means "full", as an int and per head.
        for window in (0, -3, np.array([0, -1], np.int32)):
            self.check_output(*attention(q, k, v, q_offset=8, window=window, sinks=2), *full)
        # window=1: each query sees only its own position, so out = v there and lse = scale q.k.
        out, lse = attention(q, k, v, q_offset=8, window=1)
        own_k, own_v = _heads(k[:, 8:], N // K), _heads(v[:, 8:], N // K)
        assert_close(out, own_v)
        assert_close(lse, np.einsum("btnh,btnh->btn", q, own_k) * H**-0.5)
        # An empty window: it lies wholly past the valid keys, so those rows see nothing.
        lengths = np.array([3, 11], np.int32)
        out, lse = attention(q, k, v, q_offset=8, window=2, kv_lengths=lengths)
        count = _heads(_oracle_mask(B, T, S, K, q_offset=8, window=2, kv_lengths=lengths)
                       .sum(-1), N // K)
        assert (count[0] == 0).all() and (count[1, 0] > 0).all() and (count[1, -1] == 0).all()
        self.check_masked_rows(out, lse, count)

    def test_window_sinks_equal_explicit_mask(self):
        window, sinks, offset = 6, 3, S - T
        q, k, v = _qkv(rng())
        got = attention(q, k, v, q_offset=offset, window=window, sinks=sinks)
        pos = (offset + np.arange(T))[:, None]
        s = np.arange(S)[None, :]
        token_mask = (s <= pos) & ((pos - s < window) | (s < sinks))  # [T, S]
        shared = np.broadcast_to(token_mask[None, :, None], (B, T, 1, S))
        self.check_output(*got, *masked_attention(q, k, v, shared))
        self.check_output(*got, *masked_attention(q, k, v, np.broadcast_to(shared, (B, T, N, S))))

    @pytest.mark.parametrize("heads", ["N", "K"])
    def test_masked_attention_random_mask(self, heads):
        gen = rng()
        q, k, v = _qkv(gen)
        mask = gen.random((B, T, N if heads == "N" else K, S)) < 0.4
        mask[0, 3] = False  # some fully masked rows
        out, lse = masked_attention(q, k, v, mask, scale=0.2)
        self.check_output(out, lse, *_oracle(q, k, v, mask, 0.2))
        count = mask.sum(-1) if heads == "N" else _heads(mask.sum(-1), N // K)
        self.check_masked_rows(out, lse, count)

    @pytest.mark.parametrize("window", [None, 9], ids=["causal", "window9"])
    def test_chunked_prefill_equals_full(self, window):
        q, k, v = _qkv(rng(), T=S)
        full_out, full_lse = map(np.asarray, attention(q, k, v, window=window, sinks=2))
        for offset, chunk in ((0, T), (1, T), (S - T, T), (0, 1), (12, 1), (S - 1, 1)):
            out, lse = attention(q[:, offset:offset + chunk], k, v, q_offset=offset,
                                 window=window, sinks=2)
            rows = slice(offset, offset + chunk)
            self.check_output(out, lse, full_out[:, rows], full_lse[:, rows], err_msg=f"{offset=}")
        # Per-row offsets, with the keys past each row's prefix + chunk poisoned.
        offsets = np.array([S - T, 3], np.int32)
        lengths = offsets + T
        chunks = np.stack([q[b, o:o + T] for b, o in enumerate(offsets)])
        dead = np.arange(S)[None] >= lengths[:, None]
        out, lse = map(np.asarray, attention(
            chunks, _nan_where(k, dead), _nan_where(v, dead), q_offset=offsets,
            kv_lengths=lengths, window=window, sinks=2))
        for b, o in enumerate(offsets):
            self.check_output(out[b], lse[b], full_out[b, o:o + T], full_lse[b, o:o + T])

    @staticmethod
    def _padded_batch(gen, q, k, v, cu_q, cu_k, *, causal, **opts):
        """One dense batch row per packed sequence (keys past each length poisoned)."""
        lens_q, lens_k = np.diff(cu_q), np.diff(cu_k)
        hidden = np.where(causal, np.maximum(lens_q - lens_k, 0), 0)  # queries before every key
        offsets = np.where(causal, np.maximum(lens_k - lens_q, 0), 0).astype(np.int32)
        rows = len(lens_q)
        qb, _, _ = _qkv(gen, B=rows, T=6, S=10)  # filler for rows past each sequence
        kb = np.full((rows, 10) + k.shape[1:], np.nan, k.dtype)
        vb = np.full((rows, 10) + v.shape[1:], np.nan, v.dtype)
        for b in range(rows):
            n_q = lens_q[b] - hidden[b]
            qb[b, :n_q] = q[cu_q[b] + hidden[b]:cu_q[b + 1]]
            kb[b, :lens_k[b]], vb[b, :lens_k[b]] = k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        out, lse = attention(qb, kb, vb, causal=causal, q_offset=offsets,
                             kv_lengths=lens_k.astype(np.int32), **opts)
        return np.asarray(out), np.asarray(lse), hidden

    @pytest.mark.parametrize("causal,window,sinks", [(True, None, 0), (True, 3, 1),
                                                     (False, None, 0)],
                             ids=["causal", "window3-sink1", "noncausal"])
    def test_varlen_equals_per_sequence(self, causal, window, sinks):
        gen = rng()
        lens_q, lens_k = [3, 0, 5, 4, 6], [3, 4, 9, 2, 6]  # chunked, empty, q longer than k
        cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
        q = np.array(randn(gen, (cu_q[-1] + 2, N, H)))  # padded packed buffers
        k = np.array(randn(gen, (cu_k[-1] + 3, K, H)))
        v = np.array(randn(gen, (cu_k[-1] + 3, K, HV)))
        q[cu_q[-1]:], k[cu_k[-1]:], v[cu_k[-1]:] = np.nan, np.nan, np.nan
        out, lse = attention_varlen(q, k, v, cu_q.astype(np.int32), cu_k.astype(np.int32),
                                    causal=causal, window=window, sinks=sinks)
        out, lse = np.asarray(out), np.asarray(lse)
        self.check_masked_rows(out[cu_q[-1]:], lse[cu_q[-1]:], np.zeros((2, N)))
        exp_out, exp_lse, hidden = self._padded_batch(
            gen, q, k, v, cu_q, cu_k, causal=causal, window=window, sinks=sinks)
        for b in range(len(lens_q)):
            start, n_q = cu_q[b] + hidden[b], lens_q[b] - hidden[b]
            self.check_output(out[start:start + n_q], lse[start:start + n_q], exp_out[b, :n_q],
                              exp_lse[b, :n_q], err_msg=f"seq {b}")
            self.check_masked_rows(out[cu_q[b]:start], lse[cu_q[b]:start],
                                   np.zeros((hidden[b], N)))

    def test_packed_segments_equal_per_sequence(self):
        gen = rng()
        lens = [5, 1, 6, 4, 3]
        cu = np.cumsum([0] + lens).astype(np.int32)
        L = cu[-1] + 2
        seg = np.asarray(segment_ids_from_cu_seqlens(cu, int(L)))[None]
        q, k, v = _qkv(gen, B=1, T=L, S=L)
        out, lse = attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, window=3)
        exp_out, exp_lse, _ = self._padded_batch(gen, q[0], k[0], v[0], cu, cu, causal=True,
                                                 window=3)
        for b, n in enumerate(lens):
            rows = slice(cu[b], cu[b] + n)
            self.check_output(out[0, rows], lse[0, rows], exp_out[b, :n], exp_lse[b, :n],
                              err_msg=f"seq {b}")

    def test_cu_seqlens_helpers(self):
        cu = np.array([0, 3, 3, 5], np.int32)
        np.testing.assert_array_equal(segment_ids_from_cu_seqlens(cu, 7), [0, 0, 0, 2, 2, -1, -1])
        np.testing.assert_array_equal(positions_from_cu_seqlens(cu, 7), [0, 1, 2, 0, 1, 0, 0])
        jitted = jax.jit(ref.positions_from_cu_seqlens, static_argnums=1)
        np.testing.assert_array_equal(jitted(jnp.array([2, 4], jnp.int32), 5), [0, 0, 0, 1, 0])

    def test_batch_of_one_equals_batch_rows(self):
        q, k, v = _qkv(rng())
        opts = dict(q_offset=np.array([8, 2], np.int32), window=3, sinks=1,
                    kv_lengths=np.array([21, 12], np.int32))
        out, lse = map(np.asarray, attention(q, k, v, **opts))
        for b in range(B):
            one = {name: x[b:b + 1] if isinstance(x, np.ndarray) else x for name, x in opts.items()}
            self.check_output(out[b:b + 1], lse[b:b + 1], *attention(
                q[b:b + 1], k[b:b + 1], v[b:b + 1], **one), err_msg=f"row {b}")

    def test_deterministic_and_jittable(self):
        q, k, v = _qkv(rng())
        opts = dict(q_offset=np.array([4, 1], np.int32), window=np.array([3, 0], np.int32),
                    sinks=1, kv_lengths=np.array([21, 9], np.int32))
        self.check_deterministic(attention, q, k, v, **opts)
        # The public function validates at trace time, so it also takes traced arguments.
        jitted = jax.jit(lambda q, k, v, o, w, l: attention(
            q, k, v, q_offset=o, window=w, sinks=1, kv_lengths=l))
        self.check_output(*jitted(q, k, v, opts["q_offset"], opts["window"], opts["kv_lengths"]),
                          *attention(q, k, v, **opts))

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                             ids=["f32", "bf16", "f16"])
    def test_dtypes(self, dtype):
        q, k, v = _qkv(rng(), dtype=dtype)
        out, lse = attention(q, k, v, q_offset=8, window=9, sinks=2)
        assert out.dtype == dtype and lse.dtype == jnp.float32
        exp_out, exp_lse = _oracle(q, k, v, _oracle_mask(B, T, S, K, q_offset=8, window=9, sinks=2))
        assert_close(out, exp_out, dtype=dtype)
        assert_close(lse, exp_lse, dtype=jnp.float32)

    def test_gradients_match_explicit_mask(self):
        gen = rng()
        opts = _all_options(q_offset=[6, 3], window=[4, 0], sinks=[2, 0], kv_lengths=[20, 21])
        q, k, v = _qkv(gen)
        mask_n = _heads(_oracle_mask(B, T, S, K, **opts), N // K)
        assert mask_n.any(-1).all()  # the textbook version cannot handle empty rows
        w_out, w_lse = np.array(randn(gen, (B, T, N, HV))), np.array(randn(gen, (B, T, N)))
        got = _loss_grad(q, k, v, w_out, w_lse, opts)

        def theirs(q, k, v):
            out, lse = _explicit(q, k, v, mask_n, H**-0.5)
            return jnp.sum(out * w_out) + jnp.sum(lse * w_lse)

        exp = jax.jit(jax.grad(theirs, argnums=(0, 1, 2)))(q, k, v)
        for name, g, e in zip("qkv", got, exp):
            assert_close(g, e, atol=1e-4, rtol=1e-4, err_msg=f"d{name}")
        # A central finite difference along a random direction agrees too.
        d = [np.array(randn(gen, x.shape)) for x in (q, k, v)]
        eps = 1e-2
        plus = float(_loss(*(x + eps * dx for x, dx in zip((q, k, v), d)), w_out, w_lse, opts))
        minus = float(_loss(*(x - eps * dx for x, dx in zip((q, k, v), d)), w_out, w_lse, opts))
        directional = sum(np.sum(np.asarray(g) * dx) for g, dx in zip(got, d))
        assert_close(np.float32((plus - minus) / (2 * eps)), directional, atol=2e-2, rtol=2e-2)

    def test_implementation(self):
        q, k, v = _qkv(rng())
        self.check_output(*attention(q, k, v, implementation="xla"),
                          *attention(q, k, v, implementation="auto"))
        with pytest.raises(NotImplementedError, match="segment ids"):  # the kernel has no varlen
            attention(q, k, v, q_segment_ids=np.zeros((B, T), np.int32),
                      kv_segment_ids=np.zeros((B, S), np.int32), implementation="triton")
        cu = np.array([0, T], np.int32)
        with pytest.raises(TypeError, match="implementation"):  # XLA only: no such argument
            attention_varlen(q[0], k[0, :T], v[0, :T], cu, cu, implementation="xla")
        with pytest.raises(TypeError, match="implementation"):
            masked_attention(q, k, v, np.ones((B, T, 1, S), bool), implementation="xla")
        with pytest.raises(ValueError, match="implementation="):
            attention(q, k, v, implementation="cuda")


def _bad(**changes):
    return changes


BAD_ATTENTION = {
    "q-rank": (_bad(q=(2, 4, 4)), ValueError, "q must have shape"),
    "k-rank": (_bad(k=(2, 8, 2, 16, 1)), ValueError, "k must have shape"),
    "v-rank": (_bad(v=(2, 8, 2)), ValueError, "v must have shape"),
    "n-not-divisible": (_bad(q=(2, 4, 5, 16)), ValueError, "num_heads N=5 .* num_kv_heads K=2"),
    "head-dim": (_bad(q=(2, 4, 4, 8)), ValueError, "q head dim H=8"),
    "kv-mismatch": (_bad(v=(2, 7, 2, 16)), ValueError, r"k.shape\[:-1\]"),
    "batch": (_bad(q=(3, 4, 4, 16)), ValueError, "q batch B=3"),
    "int-dtype": (_bad(dtype_q=jnp.int32), TypeError, "q.dtype=int32"),
    "mixed-dtype": (_bad(dtype_k=jnp.bfloat16), TypeError, "k.dtype=bfloat16"),
    "q-past-keys": (_bad(q_offset=5), ValueError, "q_offset=5 .* T=4 .* S=8"),
    "q-longer-than-keys": (_bad(q=(2, 9, 4, 16)), ValueError, "q_offset=0 .* T=9"),
    "offset-array-too-long": (_bad(q=(2, 9, 4, 16), q_offset=np.zeros(2, np.int32)),
                              ValueError, "T=9 causal"),
    "negative-offset": (_bad(q_offset=-1), ValueError, "q_offset=-1"),
    "offset-float": (_bad(q_offset=1.0), TypeError, "q_offset=1.0"),
    "offset-shape": (_bad(q_offset=np.zeros(3, np.int32)), ValueError, r"q_offset must .* \[2\]"),
    "window-float": (_bad(window=2.5), TypeError, "window=2.5"),
    "window-bool": (_bad(window=True), TypeError, "window=True"),
    "window-list": (_bad(window=[1, 2]), TypeError, "window="),
    "window-float-array": (_bad(window=np.ones(2, np.float32)), TypeError, "window.dtype"),
    "window-shape": (_bad(window=np.ones(3, np.int32)), ValueError, r"window must .* \[2\]"),
    "window-noncausal": (_bad(window=4, causal=False), ValueError, "window needs causal"),
    "sinks-negative": (_bad(window=4, sinks=-1), ValueError, "sinks=-1"),
    "sinks-float": (_bad(window=4, sinks=0.5), TypeError, "sinks=0.5"),
    "one-segment-array": (_bad(q_segment_ids=np.zeros((2, 4), np.int32)), ValueError,
                          "both q_segment_ids and kv_segment_ids"),
    "segment-shape": (_bad(q_segment_ids=np.zeros((2, 5), np.int32),
                           kv_segment_ids=np.zeros((2, 8), np.int32)), ValueError,
                      "q_segment_ids must"),
    "segment-dtype": (_bad(q_segment_ids=np.zeros((2, 4), np.float32),
                           kv_segment_ids=np.zeros((2, 8), np.int32)), TypeError,
                      "q_segment_ids.dtype"),
    "lengths-shape": (_bad(kv_lengths=np.zeros((2, 1), np.int32)), ValueError, "kv_lengths must"),
    "lengths-dtype": (_bad(kv_lengths=np.zeros(2, np.float32)), TypeError, "kv_lengths.dtype"),
    "scale-string": (_bad(scale="0.1"), TypeError, "scale='0.1'"),
    "scale-nan": (_bad(scale=float("nan")), ValueError, "scale=nan"),
    "causal-int": (_bad(causal=1), TypeError, "causal=1"),
}


@pytest.mark.parametrize("name", list(BAD_ATTENTION))
def test_attention_bad_input(name):
    changes, error, match = BAD_ATTENTION[name]
    changes = dict(changes)
    shapes = dict(q=(2, 4, 4, 16), k=(2, 8, 2, 16), v=(2, 8, 2, 16))
    dtypes = {x: changes.pop(f"dtype_{x}", jnp.float32) for x in "qkv"}
    arrays = {x: np.ones(changes.pop(x, shapes[x]), dtypes[x]) for x in "qkv"}
    with pytest.raises(error, match=match):
        attention(arrays["q"], arrays["k"], arrays["v"], **changes)


def test_other_functions_bad_input():
    q, k, v = np.ones((2, 4, 4, 8), np.float32), np.ones((2, 6, 2, 8), np.float32), np.ones(
        (2, 6, 2, 8), np.float32)
    with pytest.raises(ValueError, match=r"mask.shape=\(2, 4, 3, 6\)"):
        masked_attention(q, k, v, np.ones((2, 4, 3, 6), bool))
    with pytest.raises(TypeError, match="mask.dtype=float32"):
        masked_attention(q, k, v, np.ones((2, 4, 1, 6), np.float32))
    with pytest.raises(ValueError, match="mask must have shape"):
        masked_attention(q, k, v, np.ones((2, 4, 6), bool))
    with pytest.raises(TypeError, match="kv_len=6.0"):
        visible_mask(2, 4, 6.0, 2)
    with pytest.raises(ValueError, match="num_kv_heads=0"):
        visible_mask(2, 4, 6, 0)
    with pytest.raises(ValueError, match="window needs causal"):
        visible_mask(2, 4, 6, 2, causal=False, window=2)
    cu = np.array([0, 2, 4], np.int32)
    with pytest.raises(ValueError, match="q must have shape"):
        attention_varlen(q, k[0], v[0], cu, cu)
    with pytest.raises(ValueError, match="cu_seqlens_q.shape"):
        attention_varlen(q[0], k[0], v[0], cu, cu[:2])
    with pytest.raises(TypeError, match="cu_seqlens_k.dtype=float32"):
        attention_varlen(q[0], k[0], v[0], cu, cu.astype(np.float32))
    with pytest.raises(ValueError, match="B >= 1"):
        attention_varlen(q[0], k[0], v[0], cu[:1], cu[:1])
    with pytest.raises(ValueError, match="window needs causal"):
        attention_varlen(q[0], k[0], v[0], cu, cu, causal=False, window=3)
    with pytest.raises(TypeError, match="cu_seqlens .* must be an integer array"):
        segment_ids_from_cu_seqlens([0, 2], 4)
    with pytest.raises(ValueError, match="total=-1"):
        positions_from_cu_seqlens(cu, -1)
    with pytest.raises(TypeError, match="total=4.0"):
        segment_ids_from_cu_seqlens(cu, 4.0)
    with pytest.raises(ValueError, match="k tokens=0"):
        attention(q, k[:, :0], v[:, :0], causal=False)
