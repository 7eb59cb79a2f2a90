"""The Triton XAttention estimate (scores, causal softmax, block sums) against the reference:
interpreted on CPU, compiled on GPU. Queries past `q_lengths` and keys past `kv_lengths` are
NaN-poisoned; the masks must match the reference's exactly (float32 sums agree to ~1e-7, so the
threshold selection sees the same order). Every tile shape of `SWEEP` (the configurations the GPU
sweep tries) runs in at least one interpreted case."""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn._harness import triton_call
from attn._op import device_facts
from attn.xattention import reference, xattn_estimate
from attn.xattention import triton as kernel
from tests.utils import assert_close, compile_for_sm90, poison, randn, rng

triton, tl = kernel.triton, kernel.tl  # imported by `attn` first (interpreter set-up)

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
    # e4m3 operands: a 128-feature slice is one 128-byte row per token (the wgmma's 128-byte
    # swizzle), the same shared memory as bf16 at 64; more stages fit at 64.
    "fp8-128x128x128-w8-s3": C(fp8=True, block_k=128),
    "fp8-128x128x64-w8-s4": C(fp8=True, num_stages=4),
    "fp8-128x256x128-w8-s3": C(fp8=True, block_c=256, block_k=128),
    "fp8-256x128x128-w8-s3": C(fp8=True, block_r=256, block_k=128),
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


def test_op_reasons_and_config():
    """The Triton backend says what it refuses (`xattn_estimate.reasons`), `auto` with a config
    runs the backend that config configures, and a config's rounding must be the call's."""
    gen = rng()
    q, k, _ = _problem(gen, 1, 64, 64, 2, 1, 16, None, None, dtype=F32)
    opts = dict(block_size=16, stride=4)
    cfg = C(block_r=16, block_c=16, block_k=16)
    assert xattn_estimate.reasons("triton", q, k, **opts) == []
    got = xattn_estimate(q, k, config=cfg, **opts)
    want = kernel.xattn_estimate(q, k, config=cfg, **opts)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    fp8_cfg = C(block_r=16, block_c=16, block_k=32, fp8=True)
    (reason,) = xattn_estimate.reasons("triton", q, k, config=fp8_cfg, **opts)
    assert "config.fp8=True with fp8=False" in reason
    with pytest.raises(NotImplementedError, match="config.fp8=True with fp8=False"):
        xattn_estimate(q, k, config=fp8_cfg, **opts)
    one = dict(block_size=16, stride=1, fp8=True)
    assert any("stride * H = 1 * 16" in r for r in xattn_estimate.reasons("triton", q, k, **one))
    with pytest.raises(TypeError, match="fp8=1 must be a bool"):
        xattn_estimate(q, k, fp8=1, **opts)


@pytest.mark.parametrize("field,value", [("block_r", 8), ("block_c", 48), ("block_k", 8),
                                         ("num_warps", 6), ("num_stages", 0),
                                         ("scratch_bytes", 0)])
def test_config_refuses(field, value):
    with pytest.raises(ValueError, match=field):
        kernel.Config(**{field: value})


def test_select_kernel_refuses_bad_warps():
    sums = jnp.ones((1, 1, 2, 2), jnp.float32)
    with pytest.raises(ValueError, match="num_warps=3 must be a power of two"):
        kernel.select_blocks_kernel(sums, jnp.zeros((1, 2), jnp.int32), 0.9, num_warps=3)


def test_config_refuses_fp8_below_one_mma_slice():
    with pytest.raises(ValueError, match="block_k=16 must be >= 32 with fp8"):
        kernel.Config(fp8=True, block_k=16)
    kernel.Config(fp8=True, block_k=32)


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
    """Each configuration the sweep tries compiles and matches (a launch gate for the sweep);
    fp8 ones against the reference on the same e4m3-rounded inputs."""
    gen = rng()
    q, k, lens = _problem(gen, 1, 2048, 3000, 8, 2, 128, [2000], [2900], dtype=BF16)
    opts = dict(block_size=128, stride=16, threshold=0.9, **lens)
    sums, _ = kernel.xattn_estimate(q, k, config=SWEEP[name], **opts)
    exp_sums, _ = xattn_estimate(_clean(q).astype(F32), _clean(k).astype(F32),
                                 implementation="xla", fp8=SWEEP[name].fp8, **opts)
    assert_close(sums, exp_sums, atol=1e-2, rtol=1e-2)


# ---- Config.fp8: q and k in e4m3, the GEMM on the fp8 tensor cores ----------------------------

E4M3_U = 2.0**-4  # e4m3 unit roundoff: 3 mantissa bits, round to nearest


@triton.jit
def _fp8_dot_kernel(a_ptr, b_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rn[:, None] * K + rk[None, :])  # K-major, as the estimate's k tiles
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, tl.trans(b)))


def test_interpreter_fp8_dot_is_exact():
    """What the CPU fp8 tests rest on: Triton's interpreter takes e4m3 `tl.dot` operands (it
    widens them to f16, which holds every e4m3 value) and the f32 result is the exact dot of
    the e4m3 values up to f32 summation. Every finite e4m3 value (both signs, subnormals, 448)
    appears as an operand. Not checked here: the GPU's fast fp8 accumulation (no promotion),
    which `test_gpu_fp8_*` cover."""
    values = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn)
    values = values[np.isfinite(values.astype(np.float32))]  # 254: all but the two NaNs
    gen = rng()
    a = np.resize(gen.permutation(values), 32 * 64).reshape(32, 64)
    b = np.resize(gen.permutation(values), 16 * 64).reshape(16, 64)
    got = triton_call(jnp.asarray(a), jnp.asarray(b), kernel=_fp8_dot_kernel,
                      out_shape=jax.ShapeDtypeStruct((32, 16), jnp.float32), grid=(1,),
                      M=32, N=16, K=64)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    err = np.abs(np.asarray(got) - a64 @ b64.T)
    assert np.all(err <= 64 * 2.0**-24 * (np.abs(a64) @ np.abs(b64).T)), err.max()


def test_quantize_e4m3():
    """Power-of-two scale per (request, head, `stride` tokens) with `amax / scale` in [224, 448);
    `x8` is `x / scale` rounded to nearest even (ml_dtypes), so `|x8·scale - x| <= 2^-4 |x| +
    2^-10 scale`; tokens past the length are 0 even when NaN; L off the stride grid, H 40
    (padded to 64 in the Triton pass), 3 heads (the pass takes 4 per program)."""
    gen = rng()
    x = randn(gen, (2, 22, 3, 40), scale=float(np.exp(gen.uniform(-8, 8))))
    x = x.at[:, :, 1].multiply(1e-3)  # a head far from the others' range
    lengths = jnp.asarray([22, 13], jnp.int32)
    x = poison(x, jnp.arange(22)[None, :] < lengths[:, None])
    x8, scale = kernel.quantize_e4m3(x, lengths, 4)
    assert x8.dtype == jnp.float8_e4m3fn and x8.shape == x.shape and scale.shape == (2, 3, 6)
    s = np.asarray(scale)
    assert np.all(np.frexp(s)[0] == 0.5), s  # powers of two
    clean = np.asarray(_clean(x)).astype(np.float64)
    grouped = np.pad(clean, ((0, 0), (0, 2), (0, 0), (0, 0))).reshape(2, 6, 4, 3, 40)
    ratio = np.abs(grouped).max(axis=(2, 4)).transpose(0, 2, 1) / s
    empty = ratio == 0  # groups wholly past the length
    assert empty.sum() == 2 * 3 and np.all(s[empty] == 1.0)
    assert np.all((ratio[~empty] >= 224) & (ratio[~empty] < 448)), ratio
    per_token = np.repeat(s.transpose(0, 2, 1), 4, axis=1)[:, :22, :, None]
    expect = (clean / per_token).astype(np.float32).astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(x8).view(np.uint8), expect.view(np.uint8))
    back = np.asarray(kernel.dequantize_e4m3(x8, scale, 4), np.float64)
    assert np.all(np.abs(back - clean) <= E4M3_U * np.abs(clean) + 2.0**-10 * per_token)
    assert not np.any(np.asarray(x8, np.float32)[1, 13:])
    # The Triton pass the kernel path uses: bit-equal, 8 groups (2 past the tokens: scale 1).
    got8, got_scale = kernel.quantize_e4m3_kernel(x, lengths, 4, 8)
    np.testing.assert_array_equal(np.asarray(got8).view(np.uint8), np.asarray(x8).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got_scale)[..., :6], s)
    np.testing.assert_array_equal(np.asarray(got_scale)[..., 6:], 1.0)


FP8_CASES = {  # name: (B, T, S, N, K, H, block, stride, q_lengths, kv_lengths, norm, dtype, cfg)
    "st8-bs64-G5-lengths-bf16-64x64x32": (2, 200, 333, 5, 1, 32, 64, 8, [190, 77], [333, 200],
                                          1.0, BF16, C(fp8=True, block_r=64, block_c=64,
                                                       block_k=32)),
    # H40 padded to 64: 64-feature slices hold one stride's features (masked past 40); norm.
    "st4-bs32-H40-G2-norm-f32-64x128x64": (1, 130, 150, 4, 2, 40, 32, 4, [121], [150], 1.7,
                                           F32, C(fp8=True, block_r=64)),
    # H16: a 128-feature slice joins 8 strides; the scratch bound splits the launch.
    "st16-bs32-H16-scratch-bf16-128x256x128": (2, 100, 140, 2, 1, 16, 32, 16, [100, 37],
                                               [140, 90], 1.0, BF16,
                                               C(fp8=True, block_c=256, block_k=128,
                                                 scratch_bytes=1)),
}


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_matches_dequantised_reference(name):
    """The fp8 kernel is the reference on the dequantised `q8·scale, k8·scale` (the API's
    `implementation="xla", fp8=True`): e4m3 products and power-of-two scales are exact in f32,
    so only the summation order differs (1e-5, masks equal), as for the bf16 kernel. Lengths are
    NaN-poisoned past their ends."""
    b, t, s, n, kh, h, bs, st, ql, kl, norm, dtype, config = FP8_CASES[name]
    q, k, lens = _problem(rng(), b, t, s, n, kh, h, ql, kl, dtype)
    opts = dict(block_size=bs, stride=st, threshold=0.8, norm=norm, **lens)
    sums, mask = kernel.xattn_estimate(q, k, config=config, **opts)
    exp_sums, exp_mask = xattn_estimate(q, k, implementation="xla", fp8=True, **opts)
    assert_close(sums, exp_sums, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(exp_mask))
    plain, _ = xattn_estimate(_clean(q), _clean(k), implementation="xla", **opts)
    assert np.abs(np.asarray(sums) - np.asarray(plain)).max() > 0  # it did round
    assert not np.asarray(exp_mask).all()


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_fp8_block_sums_within_rounding_tolerance(dtype):
    """fp8 block sums against the unrounded reference (= the bf16 kernel's to 1e-5) within a
    tolerance derived from e4m3 rounding. Model: each of q_i, k_i is rounded with a relative
    error `δ`, `|δ| <= u = 2^-4`, independent and zero-mean, so `E δ² <= u²/3` (subnormals add
    at most `2^-10` of a group's scale; with unit-normal data that is below 1e-3 of the terms
    here and is neglected). A logit `a = c Σ q_i k_i` (`c = 1 / (sqrt(H) st)`) then moves by
    `c Σ q_i k_i (δ_i + ε_i + δ_i ε_i)`, std `σ <= c sqrt(2u²/3 + u⁴/9) sqrt(Σ q_i² k_i²)`;
    take `Δ = 6 max σ` over all (row, column) as the largest move (a 6σ excursion has
    probability ~2e-9 per score, ~2e4 scores here). A softmax probability with every logit of
    its row moved by at most Δ changes by a factor in `[e^-2Δ, e^2Δ]`, and so does any sum of
    them: `|sums8 - sums| <= (e^2Δ - 1) sums`. Here (H32, st16) Δ is about 0.09, a 20% bound;
    measured errors were <= 1.5% (three draws); a missing k scale or a doubled score scale
    breaks it (tried), a 1.25x one only the exact test above."""
    b, t, s, n, kh, h, bs, st = 1, 256, 256, 4, 2, 32, 32, 16
    q, k, _ = _problem(rng(), b, t, s, n, kh, h, None, None, dtype)
    opts = dict(block_size=bs, stride=st, threshold=0.9)
    sums, _ = kernel.xattn_estimate(q, k, config=C(fp8=True, block_r=16, block_c=16,
                                                   block_k=32), **opts)
    exp_sums, _ = xattn_estimate(q, k, implementation="xla", **opts)
    sq = reference.antidiagonal_scores(q.astype(F32) ** 2, k.astype(F32) ** 2, st)
    sigma = math.sqrt(2 * E4M3_U**2 / 3 + E4M3_U**4 / 9) / math.sqrt(h) / st
    delta = 6 * sigma * float(jnp.sqrt(sq).max())
    got, exp = np.asarray(sums), np.asarray(exp_sums)
    np.testing.assert_array_less(np.abs(got - exp), np.expm1(2 * delta) * exp + 1e-7)
    assert np.abs(got - exp).max() > 0


def _planted(gen, dtype, maps, *, t=256, block=32, h=32, kh=1, strength=6.0, noise=0.3):
    """q, k with block `maps[n](r)` of query tile r of head n carrying ~99% of each row's mass:
    key block j's tokens are `strength·e_j + noise`, query tile r's `strength·e_maps[n](r)`."""
    tb = t // block
    eye = np.eye(h, dtype=np.float32)
    k = np.repeat(eye[:tb], block, axis=0)[None, :, None] * strength  # [1, S, 1, H]
    q = np.stack([np.repeat(eye[[f(r) for r in range(tb)]], block, axis=0) for f in maps],
                 axis=1)[None] * strength  # [1, T, N, H]
    q = q + noise * gen.standard_normal(q.shape, dtype=np.float32)
    k = np.broadcast_to(k, (1, t, kh, h)) + noise * gen.standard_normal((1, t, kh, h),
                                                                        dtype=np.float32)
    return jnp.asarray(q).astype(dtype), jnp.asarray(k).astype(dtype)


def test_fp8_selects_planted_blocks():
    """A clear-cut pattern: query tile r of head 0 puts ~99% of every row's mass (logit margin
    about strength²/sqrt(H) = 6.4 over 7 other blocks of noise) on key block r // 2, head 1 on
    block r - 1. With τ = 0.9 both the fp8 kernel and the bf16 kernel select exactly the sink,
    the diagonal and the planted block (rows 0, 1: only the forced blocks)."""
    maps = (lambda r: max(r // 2, 0), lambda r: max(r - 1, 0))
    q, k = _planted(rng(), BF16, maps)
    opts = dict(block_size=32, stride=4, threshold=0.9)
    cfg = C(block_r=32, block_c=32, block_k=32)
    _, mask8 = kernel.xattn_estimate(q, k, config=dataclasses.replace(cfg, fp8=True), **opts)
    _, mask16 = kernel.xattn_estimate(q, k, config=cfg, **opts)
    expect = np.zeros((1, 2, 8, 8), bool)
    for n, f in enumerate(maps):
        for r in range(8):
            expect[0, n, r, [0, r, f(r)]] = True
    np.testing.assert_array_equal(np.asarray(mask16), expect)
    np.testing.assert_array_equal(np.asarray(mask8), expect)
    _, public = xattn_estimate(q, k, implementation="triton", fp8=True, **opts)  # Config(fp8)
    np.testing.assert_array_equal(np.asarray(public), expect)


def _sm90_jobs():
    """The score kernel at S32K N32 / K8 H128 stride 16 for each tiling (and the block-sum kernel
    on its scratch), then the e4m3 quantisation pass (`compile_for_sm90` jobs)."""
    t = s = 32768
    jobs = []
    for name, cfg in (("bf16", kernel.Config()), ("fp8", kernel.Config(fp8=True, block_k=128)),
                      ("fp8-s4", kernel.Config(fp8=True, num_stages=4)),
                      ("fp8-api", kernel.FP8_CONFIG)):
        nt = s // 16 // cfg.block_c
        consts = dict(T=t, S=s, K=8, G=4, H=128, ST=16, R=8, RT=t // 16, SB=s // 128,
                      BLOCK_R=cfg.block_r, BLOCK_C=cfg.block_c, BLOCK_K=cfg.block_k,
                      BLOCK_H=128, PRECISION="tf32", FP8=cfg.fp8, WARP_SPECIALIZE=False, NT=nt)
        operand = "*fp8e4nv" if cfg.fp8 else "*bf16"
        types = dict(q_ptr=operand, k_ptr=operand, scale_ptr="*fp32", lse_ptr="*fp32",
                     tile_lse_ptr="*fp32", q_scale_ptr="*fp32", k_scale_ptr="*fp32")
        jobs.append(dict(
            kernel="attn.xattention.triton:_tile_lse_kernel", num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, constexprs=consts, label=name,
            pointers={n: types.get(n, "*i32") for n in kernel._tile_lse_kernel.arg_names
                      if n not in consts},
            count=("wgmma.mma_async", ".f32.e4m3.e4m3", ".f32.bf16.bf16")))
        bconsts = dict(N=32, R=8, RT=t // 16, TB=t // 128, SB=s // 128, QB=8, BLOCK_J=64, NT=nt,
                       BLOCK_NT=nt, TILE_COLS=cfg.block_c, TILE_ROW_STRIDE=nt, TILE_STRIDE=1)
        jobs.append(dict(
            kernel="attn.xattention.triton:_block_sums_kernel", num_warps=4, num_stages=1,
            constexprs=bconsts, label=f"{name}-block-sums",
            pointers={n: "*fp32" if n in ("lse_ptr", "tile_lse_ptr", "sums_ptr") else "*i32"
                      for n in kernel._block_sums_kernel.arg_names if n not in bconsts}))
    qconsts = dict(L=t, NH=32, H=128, ST=16, MP=t // 16, BLOCK_N=2, BLOCK_H=128, NHB=16)
    jobs.append(dict(kernel="attn.xattention.triton:_quantize_kernel", num_warps=4, num_stages=1,
                     constexprs=qconsts, label="quantize",
                     pointers=dict(x_ptr="*bf16", len_ptr="*i32", x8_ptr="*fp8e4nv",
                                   scale_ptr="*fp32"),
                     count=("cvt.rn.satfinite.e4m3x2.f32",)))
    return jobs


@pytest.mark.slow
def test_score_kernel_compiles_for_sm90():
    """Compile the score kernel for Hopper on any machine (no GPU): the fp8 configuration issues
    e4m3 x e4m3 wgmma (both operands K-major from shared memory: no transpose needed), spills
    nothing, and fits two programs per SM like bf16 (<= 128 registers x 256 threads, <= 113 KiB
    shared memory). The quantisation pass rounds with `cvt.rn.satfinite` (what the interpreter
    fix emulates). The API's fp8 tiles (`FP8_CONFIG`, 128 x 256) run one program per SM (within
    the device's shared memory, no spills); the block-sum kernel compiles for each tiling."""
    jobs = _sm90_jobs()
    results = {job["label"]: r for job, r in zip(jobs, compile_for_sm90(jobs), strict=True)}
    quantize = results.pop("quantize")  # the e4m3 pass: the GPU's rounding, no spills
    assert quantize["count"]["cvt.rn.satfinite.e4m3x2.f32"] > 0 and not quantize["spill_stores"]
    for name in ("bf16", "fp8", "fp8-s4", "fp8-api"):
        r = results[name]
        mma = r["count"]["wgmma.mma_async"]
        dtype = ".f32.e4m3.e4m3" if name.startswith("fp8") else ".f32.bf16.bf16"
        assert mma > 0 and r["count"][dtype] == mma, (name, r)
        assert r["spill_stores"] == 0, (name, r)
        if name == "fp8-api":  # 128 x 256: one program per SM
            assert r["shared"] <= device_facts().shared_memory, r
            continue
        assert r["registers"] <= 128 and r["shared"] <= 113 * 1024, (name, r)


@pytest.mark.gpu
def test_gpu_fp8_matches_dequantised_reference():
    """Compiled fp8 path (with the tensor cores' fast fp8 accumulation) against the f32
    reference on the dequantised inputs: the accumulation error only (the rounding is shared)."""
    q, k, lens = _problem(rng(), 2, 4096, 8192, 8, 2, 128, [4096, 3000], [8192, 5000],
                          dtype=BF16)
    opts = dict(block_size=128, stride=16, threshold=0.9, **lens)
    sums, mask = xattn_estimate(q, k, implementation="triton", fp8=True, **opts)
    exp_sums, exp_mask = xattn_estimate(q, k, implementation="xla", fp8=True, **opts)
    assert_close(sums, exp_sums, atol=1e-2, rtol=1e-2)
    agree = float(np.mean(np.asarray(mask) == np.asarray(exp_mask)))
    assert agree > 0.99, f"masks agree on {agree:.4f} of the blocks"


@pytest.mark.gpu
@pytest.mark.parametrize("name", [name for name in SWEEP if SWEEP[name].fp8])
def test_gpu_fp8_mask_agreement_32k(name):
    """S = T = 32K, N 8 over K 2, H 128, stride 16, τ 0.9, unit-normal bf16 q and k: the fp8
    path's masks against the bf16 kernel's. Random q and k are the hard case: every row's block
    masses are near-uniform, so blocks near the threshold cut differ by ~1e-4 of the row mass
    and the fp8 rounding (per-score std ~0.05/sqrt(st) = 0.013 logits, ~1e-3 relative on a
    block sum) reorders them. The XLA emulation of the same rounding on a CPU (`fp8=True,
    implementation="xla"`, one draw, S 32K, N 4) gave 0.9967 identical entries (0.9934 of the
    causal ones), block sums 1e-3 off on average (max 6e-3) and every row still covering 0.9000
    of the bf16 mass; the GPU adds the fast fp8 accumulation (~2^-13 relative per add, far below
    e4m3's 2^-4). Asserted: identical entries >= 0.98 (six times the emulated flip rate) and
    every query tile's fp8 mask covering >= τ - 0.01 of the bf16 row mass (what the sparse pass
    needs). Prints the agreement (run with -s)."""
    q, k, _ = _problem(rng(), 1, 32768, 32768, 8, 2, 128, None, None, dtype=BF16)
    opts = dict(block_size=128, stride=16, threshold=0.9)
    sums16, mask16 = kernel.xattn_estimate(q, k, config=C(), **opts)
    _, mask8 = kernel.xattn_estimate(q, k, config=SWEEP[name], **opts)
    m8, m16, s16 = np.asarray(mask8), np.asarray(mask16), np.asarray(sums16)
    agree = float(np.mean(m8 == m16))
    visible = np.tril(np.ones(m16.shape[-2:], bool))
    agree_visible = float(np.mean((m8 == m16)[..., visible]))
    covered = (s16 * m8).sum(-1) / s16.sum(-1)
    print(f"{name}: masks agree on {agree:.5f} of all entries, {agree_visible:.5f} of the "
          f"causal ones; fp8 kept {m8.sum()} blocks, bf16 {m16.sum()}; min covered mass "
          f"{covered.min():.4f}")
    assert agree >= 0.98, f"masks agree on {agree:.4f} of the blocks"
    assert covered.min() >= 0.9 - 0.01


@pytest.mark.parametrize("sb", [11, 64])
@pytest.mark.parametrize("tau", [0.0, 0.3, 0.5, 0.9, 0.999, 1.0])
def test_select_blocks_kernel(sb, tau):
    """The in-kernel selection: bit for bit the reference where the sums are exact (integer
    masses, ties everywhere), and nearly always with random float masses (summation order)."""
    gen = rng()
    b, n, tb = 2, 3, 5
    ints = gen.integers(0, 4, (b, n, tb, sb)).astype(np.float32)
    ints[0, 0, 0] = 0.0
    ints[1, 2, :, 0] = 1e3
    diag = jnp.asarray(gen.integers(0, sb + 2, (b, tb)), jnp.int32)
    for sums in (jnp.asarray(ints), jnp.asarray(gen.random((b, n, tb, sb), np.float32) ** 4)):
        got = np.asarray(kernel.select_blocks_kernel(sums, diag, tau))
        want = np.asarray(reference.find_blocks(sums, diag, tau))
        if sums.dtype == jnp.float32 and np.all(np.asarray(sums) == ints):
            np.testing.assert_array_equal(got, want)
        elif tau < 1.0:  # at tau = 1 every block's fate is decided by rounding
            assert np.mean(got == want) > 0.995, np.mean(got == want)
        assert want.any() and (tau == 1.0 or not want.all())


@pytest.mark.gpu
def test_gpu_select_kernel_matches_xla_selection_64k():
    """S64K-shaped sums (N 32, 512 x 512 blocks, random near-uniform masses: the hard case):
    the compiled selection kernel against XLA's, entry agreement >= 0.999 and every row's kept
    mass >= τ - 1e-4 of its total."""
    gen = np.random.default_rng(0)
    tb = sb = 512
    sums = jnp.asarray(gen.random((1, 32, tb, sb), np.float32) + 0.5) * jnp.tril(
        jnp.ones((tb, sb), jnp.float32))
    diag = jnp.arange(tb, dtype=jnp.int32)[None]
    got = np.asarray(jax.jit(kernel.select_blocks_kernel)(sums, diag, 0.9))
    want = np.asarray(jax.jit(reference.find_blocks)(sums, diag, 0.9))
    s = np.asarray(sums)
    assert np.mean(got == want) >= 0.999, np.mean(got == want)
    assert ((s * got).sum(-1) / s.sum(-1)).min() >= 0.9 - 1e-4
