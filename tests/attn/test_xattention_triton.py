"""The Triton XAttention estimate (scores, causal softmax, block sums) against the reference:
interpreted on CPU, compiled on GPU. Queries past `q_lengths` and keys past `kv_lengths` are
NaN-poisoned; the masks must match the reference's exactly (float32 sums agree to ~1e-7, so the
threshold selection sees the same order)."""

import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn.xattention import triton as kernel
from attn.xattention import xattn_estimate
from tests.utils import assert_close, poison, randn, rng

CASES = {  # name: (B, T, S, N, K, H, block, stride, q_lengths, kv_lengths, norm)
    "T64-S64-bs16-st4": (1, 64, 64, 2, 1, 16, 16, 4, None, None, 1.0),
    "T40-S100-lengths-G3": (2, 40, 100, 3, 1, 16, 16, 8, [37, 40], [90, 45], 1.0),
    "T70-bs32-st8-G1-norm": (1, 70, 70, 2, 2, 24, 32, 8, None, None, 1.7),
    "q-longer-than-kv-G4": (2, 48, 48, 4, 1, 16, 16, 4, [40, 9], [30, 48], 1.0),
}


def _problem(gen, b, t, s, n, kh, h, q_lengths, kv_lengths, dtype=jnp.float32):
    q, k = randn(gen, (b, t, n, h), dtype), randn(gen, (b, s, kh, h), dtype)
    lens = {}
    if q_lengths is not None:
        lens = dict(q_lengths=jnp.asarray(q_lengths, jnp.int32),
                    kv_lengths=jnp.asarray(kv_lengths, jnp.int32))
        q = poison(q, jnp.arange(t)[None, :] < lens["q_lengths"][:, None])
        k = poison(k, jnp.arange(s)[None, :] < lens["kv_lengths"][:, None])
    return q, k, lens


def _clean(x):
    return jnp.where(jnp.isnan(x), 0.0, x).astype(x.dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    b, t, s, n, kh, h, bs, st, ql, kl, norm = CASES[name]
    q, k, lens = _problem(rng(), b, t, s, n, kh, h, ql, kl)
    opts = dict(block_size=bs, stride=st, threshold=0.8, norm=norm, **lens)
    sums, mask = kernel.xattn_estimate(q, k, config=kernel.Config(block_r=16, block_c=16), **opts)
    exp_sums, exp_mask = xattn_estimate(_clean(q), _clean(k), implementation="xla", **opts)
    assert_close(sums, exp_sums, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(exp_mask))
    # Each real reduced row adds mass 1; the mask is not trivially all-True.
    total = np.asarray(exp_sums).sum(axis=(2, 3))
    q_len = np.full(b, t) if ql is None else np.asarray(ql)
    kv_len = np.full(b, s) if kl is None else np.asarray(kl)
    rows_seeing = [sum(1 for m in range(-(-int(a) // st))
                       if m + -(-(int(c) - int(a)) // st) >= 0) for a, c in zip(q_len, kv_len)]
    np.testing.assert_allclose(total, np.asarray(rows_seeing)[:, None].repeat(n, 1), rtol=1e-5)


def test_bf16_and_public_dispatch(monkeypatch):
    gen = rng()
    q, k, _ = _problem(gen, 1, 96, 96, 4, 2, 32, None, None, dtype=jnp.bfloat16)
    opts = dict(block_size=32, stride=8, threshold=0.9)
    sums, _ = xattn_estimate(q, k, implementation="triton", **opts)
    exp_sums, _ = xattn_estimate(q, k, implementation="xla", **opts)
    assert_close(sums, exp_sums, atol=2e-3, rtol=2e-3)
    wide = randn(gen, (1, 32, 1, 272))
    with pytest.raises(NotImplementedError, match="head dim"):
        xattn_estimate(wide, wide, block_size=16, stride=4, implementation="triton")
    monkeypatch.setattr(attn._harness, "on_gpu", lambda: True)
    got, _ = xattn_estimate(wide, wide, block_size=16, stride=4, implementation="auto")
    monkeypatch.undo()
    assert_close(got, xattn_estimate(wide, wide, block_size=16, stride=4,
                                     implementation="xla")[0])
    with pytest.raises(ValueError, match="block_r"):
        kernel.Config(block_r=8)
    with pytest.raises(ValueError, match="num_warps"):
        kernel.Config(num_warps=6)


@pytest.mark.gpu
@pytest.mark.parametrize("stride", [8, 16])
def test_gpu_matches_reference(stride):
    gen = rng()
    q, k, lens = _problem(gen, 2, 4096, 8192, 8, 2, 128, [4096, 3000], [8192, 5000],
                          dtype=jnp.bfloat16)
    opts = dict(block_size=128, stride=stride, threshold=0.9, **lens)
    sums, mask = xattn_estimate(q, k, implementation="triton", **opts)
    exp_sums, exp_mask = xattn_estimate(_clean(q).astype(jnp.float32),
                                        _clean(k).astype(jnp.float32), implementation="xla",
                                        **opts)
    assert_close(sums, exp_sums, atol=1e-2, rtol=1e-2)
    agree = float(np.mean(np.asarray(mask) == np.asarray(exp_mask)))
    assert agree > 0.99, f"masks agree on {agree:.4f} of the blocks"
