"""The Triton XAttention estimate (scores, causal softmax, block sums) against the reference:
interpreted on CPU, compiled on GPU. Queries past `q_lengths` and keys past `kv_lengths` are
NaN-poisoned; the masks must match the reference's exactly (float32 sums agree to ~1e-7, so the
threshold selection sees the same order). Every tile shape of `SWEEP` (the configurations the GPU
sweep tries) runs in at least one interpreted case."""

import itertools
import math

import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn.xattention import triton as kernel
from attn.xattention import xattn_estimate
from tests.utils import assert_close, poison, randn, rng

C = kernel.Config
F32, BF16 = jnp.float32, jnp.bfloat16
# The tile shapes a GPU sweep tries (see `kernel.Config`); all compile for sm_90a without spills.
SWEEP = {
    "128x128x64-w8-s3": C(),
    "128x128x64-w8-s4": C(num_stages=4),
    "128x128x128-w8-s2": C(block_k=128, num_stages=2),
    "128x128x32-w8-s4": C(block_k=32, num_stages=4),
    "128x64x64-w8-s3": C(block_c=64),
    "64x64x64-w4-s3": C(block_r=64, block_c=64, num_warps=4),
    "64x128x64-w4-s3": C(block_r=64, num_warps=4),
    "256x128x64-w8-s3": C(block_r=256),
    "128x256x64-w8-s3": C(block_c=256),
}
CASES = {  # name: (B, T, S, N, K, H, block, stride, q_lengths, kv_lengths, norm, dtype, config)
    # H16: one 64-feature slice joins 4 strides; one 128 x 128 tile per head.
    "st16-bs128-T300-G1-f32-128x128x64": (1, 300, 300, 2, 2, 16, 128, 16, None, None, 1.0, F32,
                                          C()),
    # q shorter than k, lengths off the block grid, 32-feature slices = one stride.
    "st8-bs64-G5-lengths-bf16-64x64x32": (2, 200, 333, 5, 1, 32, 64, 8, [190, 77], [333, 200],
                                          1.0, BF16, C(block_r=64, block_c=64, block_k=32)),
    # H40 padded to 64 and masked; 16-feature slices split each stride; norm.
    "st4-bs32-H40-G2-norm-64x128x16": (1, 130, 150, 4, 2, 40, 32, 4, [121], [150], 1.7, F32,
                                       C(block_r=64, block_k=16)),
    # R = 32 reduced rows per block raises block_c 16 -> 32; many small tiles.
    "st4-bs128-G3-lengths-16x16x16": (2, 140, 140, 3, 1, 16, 128, 4, [137, 60], [140, 100], 1.0,
                                      F32, C(block_r=16, block_c=16, block_k=16)),
    # q longer than kv: rows with no visible key get no mass.
    "q-longer-than-kv-G4-256x128x128": (2, 48, 48, 4, 1, 16, 16, 4, [40, 9], [30, 48], 1.0, F32,
                                        C(block_r=256, block_k=128)),
    # H64 in two 32-feature slices per stride, lengths off the stride grid.
    "st8-bs128-G1-T257-f32-128x64x32": (1, 257, 263, 2, 2, 64, 128, 8, [251], [262], 1.0, F32,
                                        C(block_c=64, block_k=32)),
    # One (request, head) pair per launch: the scratch bound splits the launch four ways.
    "st16-bs32-scratch-bf16-128x256x64": (2, 100, 140, 2, 1, 24, 32, 16, [100, 37], [140, 90],
                                          1.0, BF16, C(block_c=256, scratch_bytes=1)),
}


def _problem(gen, b, t, s, n, kh, h, q_lengths, kv_lengths, dtype=F32):
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


def test_sweep_shapes_are_interpreted():
    tested = [c for *_, c in CASES.values()]
    assert {(c.block_r, c.block_c) for c in SWEEP.values()} <= {(c.block_r, c.block_c)
                                                                for c in tested}
    assert {c.block_k for c in SWEEP.values()} <= {c.block_k for c in tested}


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
    b, t, s, n, kh, h, bs, st, ql, kl, norm, dtype, config = CASES[name]
    q, k, lens = _problem(rng(), b, t, s, n, kh, h, ql, kl, dtype)
    opts = dict(block_size=bs, stride=st, threshold=0.8, norm=norm, **lens)
    sums, mask = kernel.xattn_estimate(q, k, config=config, **opts)
    exp_sums, exp_mask = xattn_estimate(_clean(q), _clean(k), implementation="xla", **opts)
    assert_close(sums, exp_sums, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(exp_mask))
    # Each real reduced row that sees a key adds mass 1; the mask is not trivially all-True.
    total = np.asarray(exp_sums).sum(axis=(2, 3))
    q_len = np.full(b, t) if ql is None else np.asarray(ql)
    kv_len = np.full(b, s) if kl is None else np.asarray(kl)
    rows_seeing = [sum(1 for m in range(-(-int(a) // st))
                       if m + -(-(int(c) - int(a)) // st) >= 0) for a, c in zip(q_len, kv_len)]
    np.testing.assert_allclose(total, np.asarray(rows_seeing)[:, None].repeat(n, 1), rtol=1e-5)
    assert not np.asarray(exp_mask).all()


@pytest.mark.parametrize("t,s,stride,block_r,block_c",  # tiles below 16 so many fit
                         [(24, 24, 2, 4, 4), (20, 34, 2, 4, 8), (34, 20, 3, 8, 4),
                          (48, 48, 4, 16, 16)], ids=lambda v: str(v))
def test_tile_table_covers_every_visible_score(t, s, stride, block_r, block_c):
    """Every (row, column) that some lengths `<= (T, S)` make visible lies in a listed tile (row
    tiles counted from the last valid row); at full lengths at most one tile per row tile is
    listed beyond those needed (the slack that unaligned lengths can use)."""

    def needed(a, c):
        rows, cols, shift = -(-a // stride), -(-c // stride), -(-(c - a) // stride)
        return {((rows - 1 - m) // block_r, col // block_c)
                for m in range(rows) for col in range(min(m + shift, cols - 1) + 1)}

    num_row_tiles = math.ceil(math.ceil(t / stride) / block_r)
    table = kernel._tile_table(num_row_tiles, -(-s // stride), block_r, block_c)
    listed = {tuple(p) for p in table.tolist()}
    assert len(listed) == len(table)
    for a, c in itertools.product(range(t + 1), range(s + 1)):
        assert needed(a, c) <= listed, (a, c, needed(a, c) - listed)
    assert len(listed) - len(needed(t, s)) <= num_row_tiles


def test_length_one_and_empty_requests_batch_invariant():
    """Length-1 queries, empty requests (q or kv length 0: zero mass) and G7 in one batch; a
    request alone gives bitwise its rows of the batch (no atomics: programs are independent)."""
    q, k, lens = _problem(rng(), 4, 20, 40, 7, 1, 16, [1, 0, 20, 13], [1, 40, 0, 40])
    opts = dict(block_size=16, stride=4, threshold=0.9, config=C(block_r=16, block_c=16))
    sums, mask = kernel.xattn_estimate(q, k, **opts, **lens)
    exp_sums, exp_mask = xattn_estimate(_clean(q), _clean(k), implementation="xla",
                                        block_size=16, stride=4, threshold=0.9, **lens)
    assert_close(sums, exp_sums, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(exp_mask))
    np.testing.assert_allclose(np.asarray(sums).sum(axis=(2, 3)),  # zeros exactly
                               np.asarray([[1.0] * 7, [0.0] * 7, [0.0] * 7, [4.0] * 7]),
                               rtol=1e-5, atol=0)
    one, _ = kernel.xattn_estimate(q[3:], k[3:], q_lengths=lens["q_lengths"][3:],
                                   kv_lengths=lens["kv_lengths"][3:], **opts)
    np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(sums[3]))


def test_bf16_and_public_dispatch(monkeypatch):
    gen = rng()
    q, k, _ = _problem(gen, 1, 96, 96, 4, 2, 32, None, None, dtype=BF16)
    opts = dict(block_size=32, stride=8, threshold=0.9)
    sums, _ = xattn_estimate(q, k, implementation="triton", **opts)
    exp_sums, _ = xattn_estimate(q, k, implementation="xla", **opts)
    assert_close(sums, exp_sums, atol=1e-5, rtol=1e-5)  # norm is in the scale, q is not rounded
    wide = randn(gen, (1, 32, 1, 272))
    with pytest.raises(NotImplementedError, match="head dim"):
        xattn_estimate(wide, wide, block_size=16, stride=4, implementation="triton")
    monkeypatch.setattr(attn._harness, "on_gpu", lambda: True)
    got, _ = xattn_estimate(wide, wide, block_size=16, stride=4, implementation="auto")
    monkeypatch.undo()
    assert_close(got, xattn_estimate(wide, wide, block_size=16, stride=4,
                                     implementation="xla")[0])


@pytest.mark.parametrize("field,value", [("block_r", 8), ("block_c", 48), ("block_k", 8),
                                         ("num_warps", 6), ("num_stages", 0),
                                         ("scratch_bytes", 0)])
def test_config_refuses(field, value):
    with pytest.raises(ValueError, match=field):
        kernel.Config(**{field: value})


@pytest.mark.gpu
@pytest.mark.parametrize("stride", [8, 16])
def test_gpu_matches_reference(stride):
    gen = rng()
    q, k, lens = _problem(gen, 2, 4096, 8192, 8, 2, 128, [4096, 3000], [8192, 5000],
                          dtype=BF16)
    opts = dict(block_size=128, stride=stride, threshold=0.9, **lens)
    sums, mask = xattn_estimate(q, k, implementation="triton", **opts)
    exp_sums, exp_mask = xattn_estimate(_clean(q).astype(F32), _clean(k).astype(F32),
                                        implementation="xla", **opts)
    assert_close(sums, exp_sums, atol=1e-2, rtol=1e-2)
    agree = float(np.mean(np.asarray(mask) == np.asarray(exp_mask)))
    assert agree > 0.99, f"masks agree on {agree:.4f} of the blocks"


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SWEEP))
def test_gpu_sweep_configs(name):
    """Each configuration the sweep tries compiles and matches (a launch gate for the sweep)."""
    gen = rng()
    q, k, lens = _problem(gen, 1, 2048, 3000, 8, 2, 128, [2000], [2900], dtype=BF16)
    opts = dict(block_size=128, stride=16, threshold=0.9, **lens)
    sums, _ = kernel.xattn_estimate(q, k, config=SWEEP[name], **opts)
    exp_sums, _ = xattn_estimate(_clean(q).astype(F32), _clean(k).astype(F32),
                                 implementation="xla", **opts)
    assert_close(sums, exp_sums, atol=1e-2, rtol=1e-2)
