"""NaN in the dense Triton flash kernels: XLA reference == Triton == float64 numpy.

A non-finite key or value that a row does not see (past `kv_lengths`, outside the window, after
the query) must not reach that row, even when the kernel visits its tile; one the row sees makes the
row NaN; a row that sees nothing gives exactly 0 and lse -inf. The poisoned positions sit in
masked tiles (sink tiles, the window edge, the causal diagonal), where a 0 weight times a NaN
value would leak. The interpreter on the CPU; one `-m gpu` case compiled (bf16, 128-token tiles).
The Mosaic GPU forward does not have the rule yet (see `attn/dense/mosaic.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import attention
from attn.dense import triton as triton_kernel
from tests.attn.paged_edges import _attend, assert_agree
from tests.utils import assert_all_finite, randn, rng


def np_dense(q, k, v, *, q_offset, kv_lengths, window, sinks, causal=True, scale=None):
    """float64 dense attention from the definition, one query and key at a time."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    scale = h**-0.5 if scale is None else scale
    window, sinks = (np.broadcast_to(np.asarray(x), (kh,)) for x in (window, sinks))
    out = np.zeros((b, t, n, v.shape[-1]))
    lse = np.full((b, t, n), -np.inf)
    for bi in range(b):
        for ti in range(t):
            pos = int(q_offset[bi]) + ti
            for ni in range(n):
                w, sk = int(window[ni // g]), int(sinks[ni // g])
                keys = [c for c in range(min(int(kv_lengths[bi]), s))
                        if (not causal or c <= pos) and (w <= 0 or c > pos - w or c < sk)]
                if keys:
                    out[bi, ti, ni], lse[bi, ti, ni] = _attend(
                        q[bi, ti, ni] * scale, [k[bi, c, ni // g] for c in keys],
                        [v[bi, c, ni // g] for c in keys])
    return out, lse


def _nan_at(x, points):
    """`x` `[B, S, K, D]` with NaN in the whole vector at each `(b, s, k)` point."""
    x = np.array(x)
    for bi, si, ki in points:
        x[bi, si, ki] = np.nan
    return jnp.asarray(x)


# B2, T37, S130, K2, G2; 64-row (32-token) x 32-key tiles. Row 0 at positions 93..129, length 120;
# row 1 at 60..96, length 100. KV head 0 has a 16-key window and 3 sinks (sink tile [0, 32)),
# head 1 the full causal range.
SHAPE = dict(b=2, t=37, s=130, kh=2, g=2, h=16, hv=16)
OPTIONS = dict(q_offset=np.array([93, 60], np.int32), window=np.array([16, 0], np.int32),
               sinks=np.array([3, 0], np.int32), kv_lengths=np.array([120, 100], np.int32))
PAST_LENGTHS = [(0, 120, 0), (0, 125, 1), (1, 100, 0), (1, 129, 1)]  # seen by no row
UNSEEN = [(0, 10, 0),  # between the sinks and the window, in the sink tile
          (1, 5, 0),  # the same, row 1
          (1, 98, 1)] + PAST_LENGTHS  # after every query of row 1, on the diagonal tile
SEEN_BY_SOME = [(0, 110, 1),  # value: tokens >= 17 of row 0, head 1 (diagonal tile)
                (1, 70, 1)]  # tokens >= 10 of row 1, head 1
KEY_SEEN_BY_SOME = [(0, 115, 0)]  # key: row 0 tokens 22..36 in head 0's window


def _inputs(dtype=jnp.float32, shape=SHAPE):
    gen = rng()
    b, t, s, kh, g, h, hv = (shape[x] for x in ("b", "t", "s", "kh", "g", "h", "hv"))
    return (randn(gen, (b, t, kh * g, h), dtype), randn(gen, (b, s, kh, h), dtype),
            randn(gen, (b, s, kh, hv), dtype))


def test_reference_pattern():
    """The expected pattern itself: unseen NaN changes nothing, seen NaN makes exactly its rows
    NaN (the test would pass vacuously if no row saw a poisoned position)."""
    q, k, v = _inputs()
    clean_out, _ = attention(q, k, v, implementation="xla", **OPTIONS)
    out, _ = attention(q, _nan_at(k, UNSEEN), _nan_at(v, UNSEEN), implementation="xla",
                       **OPTIONS)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clean_out))
    out, _ = attention(q, k, _nan_at(v, SEEN_BY_SOME), implementation="xla", **OPTIONS)
    bad = np.isnan(np.asarray(out)).any(axis=-1)  # [B, T, N]
    assert bad[0, 17:, 2:].all() and not bad[0, :17].any() and not bad[0, :, :2].any()
    assert bad[1, 10:, 2:].all() and not bad[1, :10].any()


def _forward_case(kernel_fn, dtype, atol, shape=SHAPE, options=OPTIONS,
                  k_nan=UNSEEN + KEY_SEEN_BY_SOME, v_nan=UNSEEN + SEEN_BY_SOME):
    q, k, v = _inputs(dtype, shape)
    kp, vp = _nan_at(k, k_nan), _nan_at(v, v_nan)
    out, lse = kernel_fn(q, kp, vp)
    exp_out, exp_lse = attention(q, kp, vp, implementation="xla", **options)
    np_out, np_lse = np_dense(q, kp, vp, **options)
    assert np.isnan(np_out).any() and np.isfinite(np_out).any()
    for who, o, l in (("xla", exp_out, exp_lse), ("kernel", out, lse)):
        assert_agree(f"{who} out", o, np_out, atol=atol, rtol=atol)
        assert_agree(f"{who} lse", l, np_lse, atol=atol, rtol=atol)


def test_triton_forward_nan_reaches_exactly_the_rows_that_see_it():
    config = triton_kernel.Config(block_m=64, block_n=32)
    _forward_case(lambda q, k, v: triton_kernel.attention(q, k, v, config=config, **OPTIONS),
                  jnp.float32, 1e-4)


def test_triton_gradients_ignore_unseen_nan():
    """NaN only where no row looks: dQ, dK, dV finite and equal to the reference's, which are 0
    at the poisoned keys."""
    q, k, v = _inputs()
    kp, vp = _nan_at(k, UNSEEN), _nan_at(v, UNSEEN)
    gen = rng()
    d_out = randn(gen, q.shape[:3] + (v.shape[-1],))
    d_lse = randn(gen, q.shape[:3])
    config = triton_kernel.Config(block_m=32, block_n=16, dkv_block_m=16, dkv_block_n=32,
                                  dq_block_m=32, dq_block_n=16)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
        return f

    got = jax.grad(loss(lambda *a: triton_kernel.attention(*a, config=config, **OPTIONS)),
                   (0, 1, 2))(q, kp, vp)
    exp = jax.grad(loss(lambda *a: attention(*a, implementation="xla", **OPTIONS)),
                   (0, 1, 2))(q, kp, vp)
    for name, a, e in zip("qkv", got, exp):
        assert_all_finite(a, err_msg=f"d{name}")
        assert_agree(f"d{name}", a, e, atol=5e-5, rtol=5e-5)


# GPU: B1, S512, K2, G2, H64, full lengths, window 100 + 3 sinks; the default 128 x 128 tiles.
GPU_SHAPE = dict(b=1, t=512, s=512, kh=2, g=2, h=64, hv=64)
GPU_OPTIONS = dict(q_offset=np.array([0], np.int32), window=100, sinks=3,
                   kv_lengths=np.array([512], np.int32))
# Value 10 (both heads): in the sink tile, seen by tokens 10..109 only; value 300 (head 1) on
# a diagonal tile, seen by tokens 300..399; value 200 (head 0) at the window edge of
# tokens 256..319; key 450 (head 0): tokens 450..511.
GPU_V_NAN = [(0, 10, 0), (0, 10, 1), (0, 300, 1), (0, 200, 0)]
GPU_K_NAN = [(0, 450, 0)]


@pytest.mark.gpu
def test_gpu_triton_nan_reaches_exactly_the_rows_that_see_it():
    _forward_case(lambda q, k, v: triton_kernel.attention(q, k, v, **GPU_OPTIONS),
                  jnp.bfloat16, 2e-2, GPU_SHAPE, GPU_OPTIONS, GPU_K_NAN, GPU_V_NAN)
