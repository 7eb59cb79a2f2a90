"""Block-wise FP8 pages: quantise / dequantise edge values, error bounds, the per-token oracle, and
the read-modify-write token path."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kv import fp8
from tests.utils import assert_all_finite, assert_close, case_id, poison, randn, rng

K, NUM_PAGES, P, H = 2, 5, 16, 8
F32_MAX = float(np.finfo(np.float32).max)


def _bound(x, q, scales, sub_block):
    """Per-element round-trip bound: half an e4m3 ulp of |x| plus half a subnormal step, plus the
    floor (inputs below it may flush to 0)."""
    s = np.repeat(np.asarray(scales), sub_block, axis=-1)[..., None]
    return np.abs(np.asarray(x, np.float32)) / 16 * (1 + 1e-5) + s / 1024 + fp8.AMAX_FLOOR


def _edge_pages(gen, dtype):
    """[K, NUM_PAGES, P, H] pages whose sub-blocks of 4 tokens hold edge-heavy values."""
    big = float(jnp.finfo(dtype).max)
    x = np.array(randn(gen, (K, NUM_PAGES, P, H)), np.float32)
    x[0, 0, 0:4] = 0.0  # all-zero sub-block
    x[0, 0, 4:8] = 448.0 * np.sign(x[0, 0, 4:8])  # exactly at the e4m3 boundary
    x[0, 0, 8:12] = np.array([447.9, 448.1, 464.0, 465.0])[:, None]  # around it (465 -> NaN cast)
    x[0, 0, 12:16] = 1e-40 * np.sign(x[0, 0, 12:16])  # float32 subnormals only
    x[0, 1, 0:4, 0] = big  # huge outliers (dtype max) next to O(1) values
    x[0, 1, 4:8, 1] = -big
    x[0, 1, 8:12] *= 1e-30  # tiny but normal
    x[1, 2, 0:4] *= min(3e4, big / 16)  # large block (finite in float16 too)
    x[1, 2, 4:8, :2] = [1e-45, -3e-39]  # subnormal next to normal values
    x[1, 3, 0:4] = -0.0
    return jnp.asarray(x).astype(dtype)


@pytest.mark.parametrize(
    ("dtype", "sub_block"),
    [(jnp.float32, 1), (jnp.float32, 4), (jnp.float32, 16), (jnp.bfloat16, 1),
     (jnp.bfloat16, 4), (jnp.float16, 4)],
    ids=lambda v: case_id(sb=v) if isinstance(v, int) else jnp.dtype(v).name)
def test_edge_values_give_no_nan_and_stay_in_bound(sub_block, dtype):
    x = _edge_pages(rng(), dtype)
    q, scales = fp8.quantize(x, sub_block=sub_block)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape
    assert scales.dtype == jnp.float32 and scales.shape == (K, NUM_PAGES, P // sub_block)
    assert_all_finite(q, "q")
    assert_all_finite(scales, "scales")
    assert (np.asarray(scales) > 0).all()
    back = fp8.dequantize(q, scales, jnp.float32)
    assert_all_finite(back, "dequantised")
    err = np.abs(np.asarray(back) - np.asarray(x, np.float32))
    bound = _bound(x, q, scales, sub_block)
    assert (err <= bound).all(), f"max excess {np.max(err - bound)}"
    assert (np.asarray(back)[0, 0, 0:4] == 0).all(), "all-zero sub-block must stay 0"
    # The largest |value| of each sub-block lands exactly on ±448.
    amax_q = np.abs(np.asarray(q, np.float32)).reshape(K, NUM_PAGES, -1, sub_block * H).max(-1)
    nonzero = np.asarray(scales) > fp8.AMAX_FLOOR / 448 * 1.0001
    assert (amax_q[nonzero] == 448).all()


@pytest.mark.parametrize("sub_block", [1, 4, 16], ids=lambda s: case_id(sb=s))
def test_round_trip_error_relative_to_sub_block_amax(sub_block):
    gen = rng()
    x = randn(gen, (K, NUM_PAGES, P, H), scale=3.0)
    x = x * jnp.asarray(gen.uniform(0.01, 100, (K, NUM_PAGES, P, 1)), jnp.float32)  # token ranges
    q, scales = fp8.quantize(x, sub_block)
    back = np.asarray(fp8.dequantize(q, scales))
    xs = np.asarray(x)
    amax = np.abs(xs).reshape(K, NUM_PAGES, -1, sub_block * H).max(-1)
    np.testing.assert_allclose(np.asarray(scales), amax / 448, rtol=1e-6)
    amax_tok = np.repeat(amax, sub_block, axis=-1)[..., None]
    rel = np.abs(back - xs) / amax_tok
    assert rel.max() <= 1 / 16 + 1e-6, rel.max()
    assert np.median(rel) < 1 / 32  # and typically well inside the worst case


def test_per_token_oracle():
    """sub_block == 1 is FastDeploy's per-token layout; check it against a numpy formulation."""
    gen = rng()
    x = np.array(randn(gen, (K, NUM_PAGES, P, H), scale=5.0))
    x[1, 1, 3] = 0.0
    q, scales = fp8.quantize(jnp.asarray(x), 1)
    s = np.maximum(np.abs(x).max(-1), 448 * np.finfo(np.float32).tiny) / np.float32(448)
    np.testing.assert_allclose(np.asarray(scales), s, rtol=2e-7)  # XLA may divide by reciprocal
    scales = np.asarray(scales)
    expect = np.clip(x / scales[..., None], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), expect.view(np.uint8))
    # One scale per page and head: the page's amax.
    _, page_scales = fp8.quantize(jnp.asarray(x), P)
    np.testing.assert_allclose(np.asarray(page_scales)[..., 0], np.abs(x).max((-2, -1)) / 448,
                               rtol=3e-7)


def test_token_axis_of_a_dense_layout():
    """axis=1 on [B, S, K, H] gives per-head scales [B, S // sub_block, K], as head-major pages."""
    x = randn(rng(), (2, 32, 3, H))
    q, scales = fp8.quantize(x, 8, axis=1)
    assert scales.shape == (2, 4, 3)
    q_hm, scales_hm = fp8.quantize(x.transpose(0, 2, 1, 3), 8)
    np.testing.assert_array_equal(np.asarray(scales), np.asarray(scales_hm).transpose(0, 2, 1))
    np.testing.assert_array_equal(np.asarray(q, np.float32),
                                  np.asarray(q_hm, np.float32).transpose(0, 2, 1, 3))
    back = fp8.dequantize(q, scales, jnp.bfloat16, axis=1)
    assert back.dtype == jnp.bfloat16
    # e4m3: 3 mantissa bits (rtol 2^-4, plus bf16); subnormals: an absolute step of scale * 2^-9.
    assert_close(back, x, atol=float(jnp.max(scales)) * 2.0**-9, rtol=0.07)


def _bytes(x):
    return np.asarray(x).view(np.uint8)


T_CHUNK = 2 * P + 3  # every quantize_tokens call pads to this many tokens: one compile


IMPLEMENTATIONS = ("xla", "triton")  # the XLA scatters and kv.fp8_triton (interpreted on a CPU)


def _write(pages, scales, x, page_ids, offsets, gen, implementation="xla"):
    """quantize_tokens with the call padded to T_CHUNK tokens by -1 (do not write) entries whose
    offsets and values are random."""
    pad = T_CHUNK - x.shape[0]
    x = jnp.concatenate([jnp.asarray(x, jnp.float32), randn(gen, (pad, K, H), scale=1e3)])
    page_ids = np.concatenate([np.asarray(page_ids, np.int32), np.full((pad, K), -1, np.int32)])
    offsets = np.concatenate([np.asarray(offsets, np.int32),
                              gen.integers(-2, P + 2, pad).astype(np.int32)])
    perm = gen.permutation(T_CHUNK)  # padding anywhere in the chunk
    return fp8.quantize_tokens(pages, scales, x[perm], jnp.asarray(page_ids[perm]),
                               jnp.asarray(offsets[perm]), implementation=implementation)


def _assert_quantized_equal(got, want, impl):
    """Bit for bit from the XLA path; from the kernel up to XLA's division rounding (see
    `_assert_same_write`): at most one e4m3 step, in under 1% of the bytes."""
    if impl == "xla":
        np.testing.assert_array_equal(_bytes(got), _bytes(want))
        return
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    differ = got != want
    assert differ.mean() <= 1e-2, f"{differ.sum()} of {differ.size} bytes differ"
    assert (np.abs(got[differ] - want[differ]) <= np.abs(want[differ]) * 2.0**-3
            + 2.0**-9 * np.abs(want).max()).all()


def _stale_pool():
    """fp8 pool whose every byte is NaN (stale memory) and scales that are NaN."""
    pages = jnp.full((K, NUM_PAGES, P, H), jnp.nan, jnp.float8_e4m3fn)
    return pages, jnp.full((K, NUM_PAGES, P // 4), jnp.nan, jnp.float32)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_write_whole_pages_in_one_call_equals_quantize(impl):
    """A chunk filling pages (tokens in random order, -1 padding mixed in) equals `quantize`;
    padding touches nothing, the null page 0 included; page ids collide across heads."""
    gen = rng()
    pages, scales = _stale_pool()
    ids = np.array([[1, 3], [4, 1]], np.int32)  # [page slot, K]: head 0 -> 1, 4; head 1 -> 3, 1
    tokens = randn(gen, (2 * P, K, H), scale=4.0)
    page_ids = np.repeat(ids, P, axis=0)  # [2P, K]
    offsets = np.tile(np.arange(P, dtype=np.int32), 2)
    out_pages, out_scales = map(np.asarray, _write(pages, scales, tokens, page_ids, offsets, gen,
                                                   impl))
    dense = tokens.reshape(2, P, K, H).transpose(2, 0, 1, 3)  # [K, 2, P, H]
    q, s = map(np.asarray, fp8.quantize(dense, 4))
    for k in range(K):
        for j in range(2):
            _assert_quantized_equal(out_pages[k, ids[j, k]], q[k, j], impl)
            np.testing.assert_array_equal(out_scales[k, ids[j, k]], s[k, j])
    written = np.zeros((K, NUM_PAGES), bool)
    for k in range(K):
        written[k, ids[:, k]] = True
    np.testing.assert_array_equal(_bytes(out_pages)[~written], _bytes(pages)[~written])
    assert np.isnan(out_scales[~written]).all()


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_partial_write_zeroes_the_stale_tail_of_its_sub_block(impl):
    gen = rng()
    pages, scales = _stale_pool()
    n = 6  # sub-blocks of 4: [0, 4) full, [4, 8) half written, [8, 16) untouched
    x = randn(gen, (n, K, H))
    out_pages, out_scales = map(np.asarray, _write(pages, scales, x, np.full((n, K), 2),
                                                   np.arange(n), gen, impl))
    expect = np.zeros((K, 2, P, H), np.float32)  # the pool's shape is compiled already
    expect[:, 0, :n] = np.asarray(x).transpose(1, 0, 2)
    q, s = map(np.asarray, fp8.quantize(jnp.asarray(expect), 4))
    _assert_quantized_equal(out_pages[:, 2, :8], q[:, 0, :8], impl)
    np.testing.assert_array_equal(out_scales[:, 2, :2], s[:, 0, :2])
    assert np.isnan(out_pages[:, 2, 8:].astype(np.float32)).all()
    assert np.isnan(out_scales[:, 2, 2:]).all()


# The interpreted kernel takes ~1.6 s an append on the CPU: 7 appends (two sub-blocks of one
# page) in CI; the XLA case's P + 7 (two pages, a page switch) for the kernel is slow.
@pytest.mark.parametrize("impl,n", [("xla", P + 7), ("triton", 7),
                                    pytest.param("triton", P + 7, marks=pytest.mark.slow)],
                         ids=["xla", "triton", "triton-two-pages"])
def test_token_by_token_appends(impl, n):
    """Decode appends: error stays within one e4m3 rounding per scale increase, the final scale is
    the sub-block's amax / 448, and appends that do not raise the amax keep old bytes."""
    gen = rng()
    sub_block = 4
    pages = poison(jnp.zeros((K, NUM_PAGES, P, H), jnp.float8_e4m3fn),
                   jnp.zeros((K, NUM_PAGES), bool))
    scales = jnp.full((K, NUM_PAGES, P // sub_block), jnp.nan, jnp.float32)
    table = np.array([[3, 1], [1, 4]], np.int32)  # [page index, K]; id 1 used by both heads
    x = np.array(randn(gen, (n, K, H))) * gen.uniform(0.1, 3.0, (n, 1, 1)).astype(np.float32)
    x[n - 1] *= 1e-3  # the last append raises no amax
    for t in range(n):
        before = pages
        pages, scales = _write(pages, scales, x[t:t + 1], table[t // P][None], [t % P], gen, impl)
    pages, before, scales = np.asarray(pages), np.asarray(before), np.asarray(scales)
    kept = [(k, table[(n - 1) // P, k]) for k in range(K)]
    for k, pid in kept:  # the last append re-wrote its sub-block with an unchanged scale
        start = (n - 1) % P // sub_block * sub_block
        np.testing.assert_array_equal(_bytes(pages[k, pid, start:(n - 1) % P]),
                                      _bytes(before[k, pid, start:(n - 1) % P]))
    back = np.asarray(fp8.dequantize(jnp.asarray(pages), jnp.asarray(scales)))
    for k in range(K):
        got = np.concatenate([back[k, table[j, k]] for j in range(2)])[:n]  # [n, H]
        for start in range(0, n, sub_block):
            blk = x[start:start + sub_block, k]
            amax = np.abs(blk).max()
            tok_amax = np.abs(blk).max(-1)
            rises = tok_amax > np.maximum.accumulate(np.concatenate([[0], tok_amax[:-1]]))
            later_rises = np.cumsum(rises[::-1])[::-1] - rises  # scale increases after each token
            growth = (17 / 16) ** later_rises[:, None]  # a re-rounded value may have grown
            bound = (1 + later_rises[:, None]) * (np.abs(blk) * growth / 16 + amax / 448 / 1024)
            assert (np.abs(got[start:start + sub_block] - blk) <= bound).all()
            sb_idx = start % P // sub_block
            np.testing.assert_allclose(scales[k, table[start // P, k], sb_idx], amax / 448,
                                       rtol=1e-5)


def _assert_same_write(tri, xla, max_share=1e-2):
    """Scales bit for bit; pages too, except bytes one e4m3 step apart where XLA's float32
    division is not correctly rounded (on the CPU a third of XLA's quotients are one float32 ulp
    off, measured; the kernel divides with `div_rn`), which flips a byte when the exact quotient
    is an e4m3 rounding tie: rare, as the bound `max_share` of differing bytes says."""
    np.testing.assert_array_equal(np.asarray(tri[1]), np.asarray(xla[1]))
    got, want = (np.asarray(a, np.float32) for a in (tri[0], xla[0]))
    differ = (got != want) & ~(np.isnan(got) & np.isnan(want))
    assert differ.mean() <= max_share, f"{differ.sum()} of {differ.size} bytes differ"
    step = np.abs(want[differ]) * 2.0**-3 + 2.0**-9 * np.max(np.abs(want[~np.isnan(want)]))
    assert (np.abs(got[differ] - want[differ]) <= step).all(), (got[differ], want[differ])


@pytest.mark.parametrize("sub_block", [1, 4, 16], ids=lambda s: case_id(sb=s))
def test_triton_write_equals_xla(sub_block):
    """Random chunks over a filled pool (writes into the middle of sub-blocks, several tokens per
    sub-block in any order, page ids shared across heads, padding and out-of-page offsets mixed
    in): the kernel's scales equal the XLA scatters' bit for bit, its bytes up to XLA's division
    rounding (`_assert_same_write`)."""
    gen = rng()
    pages, scales = fp8.quantize(randn(gen, (K, NUM_PAGES, P, H), scale=3.0), sub_block)
    for _ in range(3):
        n = int(gen.integers(1, 2 * P))
        offsets = gen.integers(0, P, n).astype(np.int32)
        # Per head, the tokens that share a slot get distinct pages (page ids 1.. also collide
        # across heads); a slot wanted more often than there are pages is not written.
        page_ids = np.full((n, K), -1, np.int32)
        for k in range(K):
            for off in np.unique(offsets):
                (tok,) = np.nonzero(offsets == off)
                pages_k = gen.permutation(np.arange(1, NUM_PAGES))[:len(tok)]
                page_ids[tok[:len(pages_k)], k] = pages_k
        page_ids[gen.random((n, K)) < 0.15] = -1
        offsets[gen.random(n) < 0.1] = P + 1  # outside the page: not written
        x = randn(gen, (n, K, H), scale=float(gen.uniform(0.1, 10.0))).astype(jnp.bfloat16)
        args = (x, jnp.asarray(page_ids), jnp.asarray(offsets))
        xla = fp8.quantize_tokens(pages, scales, *args, implementation="xla")
        tri = fp8.quantize_tokens(pages, scales, *args, implementation="triton")
        _assert_same_write(tri, xla)
        pages, scales = xla


def test_bad_input():
    # numpy inputs: validation reads shapes and dtypes only, and nothing compiles.
    x = np.ones((K, NUM_PAGES, P, H), np.float32)
    with pytest.raises(ValueError, match="sub_block=5"):
        fp8.quantize(x, 5)
    with pytest.raises(ValueError, match="sub_block=0"):
        fp8.quantize(x, 0)
    with pytest.raises(TypeError, match="sub_block=2.0"):
        fp8.quantize(x, 2.0)
    with pytest.raises(TypeError, match="x.dtype=int32"):
        fp8.quantize(x.astype(np.int32), 4)
    with pytest.raises(TypeError, match="already an 8-bit float"):
        fp8.quantize(x.astype(ml_dtypes.float8_e5m2), 4)
    with pytest.raises(ValueError, match="axis=-1"):
        fp8.quantize(x, 4, axis=-1)
    with pytest.raises(ValueError, match="axis=4"):
        fp8.quantize(x, 4, axis=4)
    with pytest.raises(TypeError, match="axis=1.0"):
        fp8.quantize(x, 4, axis=1.0)
    with pytest.raises(ValueError, match="axis=-2"):
        fp8.quantize(np.ones((4,), np.float32), 4)
    q = x.astype(ml_dtypes.float8_e4m3fn)
    s = np.ones((K, NUM_PAGES, P // 4), np.float32)
    with pytest.raises(TypeError, match="q.dtype=float32"):
        fp8.dequantize(x, s)
    with pytest.raises(TypeError, match="scales.dtype=bfloat16"):
        fp8.dequantize(q, s.astype(ml_dtypes.bfloat16))
    with pytest.raises(ValueError, match="scales.shape"):
        fp8.dequantize(q, s[..., :3])
    with pytest.raises(ValueError, match="scales.shape"):
        fp8.dequantize(q, s[0])
    with pytest.raises(TypeError, match="dtype="):
        fp8.dequantize(q, s, np.int8)
    tok = np.ones((3, K, H), np.float32)
    ids, off = np.ones((3, K), np.int32), np.zeros((3,), np.int32)
    with pytest.raises(TypeError, match="pages.dtype=float32"):
        fp8.quantize_tokens(x, s, tok, ids, off)
    with pytest.raises(TypeError, match="scales.dtype=bfloat16"):
        fp8.quantize_tokens(q, s.astype(ml_dtypes.bfloat16), tok, ids, off)
    with pytest.raises(TypeError, match="x.dtype=int32"):
        fp8.quantize_tokens(q, s, tok.astype(np.int32), ids, off)
    with pytest.raises(TypeError, match="page_ids.dtype=int16"):
        fp8.quantize_tokens(q, s, tok, ids.astype(np.int16), off)
    with pytest.raises(TypeError, match="offsets.dtype=float32"):
        fp8.quantize_tokens(q, s, tok, ids, off.astype(np.float32))
    with pytest.raises(ValueError, match="pages must have shape"):
        fp8.quantize_tokens(q[0], s, tok, ids, off)
    with pytest.raises(ValueError, match="scales.shape"):
        fp8.quantize_tokens(q, np.ones((K, NUM_PAGES, 3), np.float32), tok, ids, off)
    with pytest.raises(ValueError, match="x.shape"):
        fp8.quantize_tokens(q, s, tok[..., :4], ids, off)
    with pytest.raises(ValueError, match="page_ids.shape"):
        fp8.quantize_tokens(q, s, tok, ids[:2], off)
    with pytest.raises(ValueError, match="offsets.shape"):
        fp8.quantize_tokens(q, s, tok, ids, off[:2])
    with pytest.raises(ValueError, match="implementation='cuda'"):
        fp8.quantize_tokens(q, s, tok, ids, off, implementation="cuda")
    with pytest.raises(NotImplementedError, match="'mosaic' is not a backend"):
        fp8.quantize_tokens(q, s, tok, ids, off, implementation="mosaic")
    huge = jax.ShapeDtypeStruct((8, 2**26, 16, 128), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="int32"):
        fp8.quantize_tokens(huge, jax.ShapeDtypeStruct((8, 2**26, 1), jnp.float32),
                            np.ones((1, 8, 128), np.float32), np.ones((1, 8), np.int32),
                            np.zeros((1,), np.int32))


def test_cast_clips_before_e4m3():
    """A plain cast of 465 gives NaN in e4m3; the quantiser's cast saturates at ±448."""
    x = jnp.asarray([465.0, -1e6, 448.0, 1e-3])
    assert np.isnan(np.asarray(x.astype(jnp.float8_e4m3fn), np.float32)[0])
    np.testing.assert_array_equal(np.asarray(fp8.to_fp8(x, 1.0), np.float32),
                                  [448.0, -448.0, 448.0, np.float32(ml_dtypes.float8_e4m3fn(1e-3))])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 100], ids=["decode", "chunk"])
def test_triton_write_compiled_on_gpu_equals_xla(tokens):
    """Engine shapes (K8, H128, pages of 64, sub-blocks of 16, B64 rows at their own pages): one
    decode token per row, or a 100-token chunk per row starting mid sub-block; the pool donated
    so the aliased in-place path runs. Scales equal the XLA scatters' bit for bit, pages up to
    XLA's division rounding (`_assert_same_write`; one byte of 1.7e7 differed in one of two H100
    runs)."""
    num_kv, page, head_dim, batch, max_pages = 8, 64, 128, 64, 4
    gen = rng()
    pool = randn(gen, (num_kv, batch * max_pages + 1, page, head_dim), scale=2.0)
    pages, scales = fp8.quantize(pool, 16)
    pos = 37 + np.arange(tokens)  # [T] positions of every row's new tokens
    rows = np.arange(batch)
    page_ids = 1 + rows[:, None] * max_pages + pos[None, :] // page  # [B, T]
    page_ids = np.broadcast_to(page_ids[..., None], (batch, tokens, num_kv)).reshape(-1, num_kv)
    offsets = np.broadcast_to(pos % page, (batch, tokens)).reshape(-1).astype(np.int32)
    x = randn(gen, (batch * tokens, num_kv, head_dim), scale=5.0).astype(jnp.bfloat16)
    args = (x, jnp.asarray(page_ids, jnp.int32), jnp.asarray(offsets))
    xla = fp8.quantize_tokens(pages, scales, *args, implementation="xla")
    write = jax.jit(functools.partial(fp8.quantize_tokens, implementation="triton"),
                    donate_argnums=(0, 1))
    tri = write(jnp.copy(pages), jnp.copy(scales), *args)
    _assert_same_write(tri, xla, max_share=1e-5)


def test_auto_picks_the_kernel_on_a_gpu_only(monkeypatch):
    """`quantize_tokens` is an op (`attn._op`): `auto` is the Triton kernel on a GPU only."""
    import attn._harness

    assert fp8.quantize_tokens.select("auto", {})[0].name == "xla"
    monkeypatch.setattr(attn._harness, "on_gpu", lambda: True)
    assert fp8.quantize_tokens.select("auto", {})[0].name == "triton"
