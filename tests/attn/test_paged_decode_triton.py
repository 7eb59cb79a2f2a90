"""The Triton paged decode kernel against the reference: interpreted on CPU, compiled on GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.paged_decode import reference as ref
from attn.paged_decode import triton as kernel
from kv import fp8
from tests.utils import assert_close, case_id, poison, randn, rng


def _problem(gen, *, b, kh, g, h, hv, p, max_pages, dtype, per_head=True):
    """Random pages, per-head (or uniform) tables with -1 tails, mixed lengths incl. 0 and 1."""
    num_pages = b * max_pages + 2
    q = randn(gen, (b, kh * g, h), dtype)
    k_pages = randn(gen, (kh, num_pages, p, h), dtype)
    v_pages = randn(gen, (kh, num_pages, p, hv), dtype)
    lengths = gen.integers(1, max_pages * p + 1, b)
    lengths[0] = max_pages * p - 1 if max_pages * p > 1 else 1
    if b > 2:
        lengths[1], lengths[2] = 0, 1
    heads = kh if per_head else 1
    tables = np.full((b, heads, max_pages), -1, np.int32)
    for i in range(heads):
        ids = gen.permutation(num_pages - 1)[: b * max_pages].reshape(b, max_pages) + 1
        for r in range(b):
            used = -(-int(lengths[r]) // p)
            tables[r, i, :used] = ids[r, :used]
    tables = np.repeat(tables, kh // heads, axis=1)
    owned = np.zeros((kh, num_pages), bool)
    for r in range(b):
        for i in range(kh):
            owned[i, tables[r, i][tables[r, i] >= 0]] = True
    return q, k_pages, v_pages, jnp.asarray(tables), jnp.asarray(lengths, jnp.int32), owned


def _per_head(gen, kh, s):
    window = jnp.asarray(gen.integers(-1, s, kh), jnp.int32)
    sinks = jnp.asarray(gen.integers(0, 24, kh), jnp.int32)
    return window, sinks


CASES = [
    dict(kh=2, g=1, h=32, hv=32, p=16, max_pages=5, n=16, splits=1),
    dict(kh=1, g=5, h=64, hv=32, p=16, max_pages=6, n=32, splits=3),
    dict(kh=2, g=7, h=16, hv=24, p=32, max_pages=3, n=16, splits=2),
    dict(kh=1, g=16, h=48, hv=48, p=64, max_pages=2, n=64, splits=1),
    # Tiles inside one page, read token by token anyway (the gather path on large pages).
    dict(kh=2, g=2, h=32, hv=32, p=32, max_pages=4, n=16, splits=2, page_tiles=False),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: case_id(G=c["g"], H=c["h"], P=c["p"],
                                                         N=c["n"], J=c["splits"])
                         + ("" if c.get("page_tiles", True) else "-gather"))
@pytest.mark.parametrize("window", [False, True], ids=["full", "window-sink"])
def test_kernel_matches_reference(c, window):
    gen = rng()
    q, kp, vp, tables, lengths, owned = _problem(
        gen, b=4, kh=c["kh"], g=c["g"], h=c["h"], hv=c["hv"], p=c["p"],
        max_pages=c["max_pages"], dtype=jnp.float32)
    kp, vp = poison(kp, owned), poison(vp, owned)  # unowned pages must never leak in
    w, sk = _per_head(gen, c["kh"], c["max_pages"] * c["p"]) if window else (
        ref.per_head(None, c["kh"]), ref.per_head(None, c["kh"]))
    cfg = kernel.Config(block_n=c["n"], num_splits=c["splits"],
                        page_tiles=c.get("page_tiles", True))
    out, lse = kernel.paged_decode(q, kp, vp, tables, lengths, scale=0.3, window=w, sinks=sk,
                                   config=cfg)
    exp_out, exp_lse = ref.paged_decode(q, kp, vp, tables, lengths, scale=0.3, window=w, sinks=sk)
    assert_close(out, exp_out, atol=1e-5, rtol=1e-5)
    assert_close(lse, exp_lse, allow_neg_inf=True)
    assert (np.asarray(out)[1] == 0).all() and np.isneginf(np.asarray(lse)[1]).all()


def test_per_row_windows_match_row_by_row_decode():
    """`[B, K]` window / sinks (one policy per request, as the engine passes them) == each row
    decoded alone with its own `[K]` window / sinks."""
    gen = rng()
    b, kh = 4, 2
    q, kp, vp, tables, lengths, owned = _problem(gen, b=b, kh=kh, g=3, h=32, hv=32, p=16,
                                                 max_pages=5, dtype=jnp.float32)
    kp, vp = poison(kp, owned), poison(vp, owned)
    w = jnp.asarray(gen.integers(-1, 80, (b, kh)), jnp.int32)
    sk = jnp.asarray(gen.integers(0, 24, (b, kh)), jnp.int32)
    cfg = kernel.Config(block_n=16, num_splits=2)
    out, lse = kernel.paged_decode(q, kp, vp, tables, lengths, scale=0.3, window=w, sinks=sk,
                                   config=cfg)
    for r in range(b):
        one = slice(r, r + 1)
        exp_out, exp_lse = ref.paged_decode(q[one], kp, vp, tables[one], lengths[one], scale=0.3,
                                            window=w[r], sinks=sk[r])
        assert_close(out[one], exp_out, atol=1e-5, rtol=1e-5)
        assert_close(lse[one], exp_lse, allow_neg_inf=True)


@pytest.mark.parametrize("sub_block", [1, 4, 16])
def test_fp8_pages_match_their_dequantised_copy(sub_block):
    gen = rng()
    q, kp, vp, tables, lengths, _ = _problem(gen, b=3, kh=2, g=4, h=32, hv=32, p=16,
                                             max_pages=4, dtype=jnp.bfloat16)
    kq, ks = fp8.quantize(kp, sub_block)
    vq, vs = fp8.quantize(vp, sub_block)
    w, sk = _per_head(gen, 2, 64)
    out, lse = kernel.paged_decode(q, kq, vq, tables, lengths, scale=0.2, window=w, sinks=sk,
                                   k_scales=ks, v_scales=vs, config=kernel.Config(block_n=16,
                                                                                  num_splits=2))
    exp_out, exp_lse = ref.paged_decode(q, kq, vq, tables, lengths, scale=0.2, window=w,
                                        sinks=sk, k_scales=ks, v_scales=vs)
    assert_close(out, exp_out, dtype=jnp.bfloat16)
    assert_close(lse, exp_lse, dtype=jnp.bfloat16, allow_neg_inf=True)


def test_streaming_heads_never_read_recycled_pages():
    """A streaming head whose pages outside sink + window were given back (-1) reads none."""
    gen = rng()
    b, kh, g, h, p, max_pages = 2, 2, 2, 16, 16, 8
    q, kp, vp, tables, lengths, _ = _problem(gen, b=b, kh=kh, g=g, h=h, hv=h, p=p,
                                             max_pages=max_pages, dtype=jnp.float32)
    lengths = jnp.full((b,), max_pages * p - 5, jnp.int32)
    ids = 1 + np.arange(b)[:, None] * max_pages + np.arange(max_pages)[None]  # [B, max_pages]
    tables = jnp.asarray(np.repeat(ids[:, None], kh, axis=1), jnp.int32)
    window, sinks = jnp.asarray([32, 0], jnp.int32), jnp.asarray([16, 0], jnp.int32)
    # Head 0 keeps page 0 (sink) and the pages overlapping the window; the rest go back.
    recycled = tables.at[:, 0, 1:5].set(-1)
    kp_nan = kp.at[0, 2:6].set(jnp.nan).at[0, 10:14].set(jnp.nan)
    out, _ = kernel.paged_decode(q, kp_nan, vp, recycled, lengths, scale=0.25, window=window,
                                 sinks=sinks, config=kernel.Config(block_n=16, num_splits=2))
    exp, _ = ref.paged_decode(q, kp, vp, tables, lengths, scale=0.25, window=window, sinks=sinks)
    assert_close(out, exp)


def test_config_validation():
    with pytest.raises(ValueError, match="block_n"):
        kernel.Config(block_n=48)
    with pytest.raises(ValueError, match="num_splits"):
        kernel.Config(num_splits=0)


@pytest.mark.gpu
@pytest.mark.parametrize("g", [1, 2, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("p", [16, 64, 128])
def test_compiled_on_gpu(g, p):
    gen = rng()
    kh, h = 4, 128
    q, kp, vp, tables, lengths, owned = _problem(gen, b=6, kh=kh, g=g, h=h, hv=h, p=p,
                                                 max_pages=4096 // p, dtype=jnp.bfloat16)
    kp, vp = poison(kp, owned), poison(vp, owned)
    w, sk = _per_head(gen, kh, 4096)
    w = w.at[0].set(0)
    w = jnp.stack([w, jnp.roll(w, 1)] * 3)  # [B, K]: one policy per row, as the engine passes
    sk = jnp.stack([sk] * 6)
    run = jax.jit(lambda *a: kernel.paged_decode(*a, scale=h**-0.5, window=w, sinks=sk))
    out, lse = run(q, kp, vp, tables, lengths)
    exp_out, exp_lse = ref.paged_decode(q, kp, vp, tables, lengths, scale=h**-0.5, window=w,
                                        sinks=sk)
    assert_close(out, exp_out, dtype=jnp.bfloat16)
    assert_close(lse, exp_lse, dtype=jnp.bfloat16, allow_neg_inf=True)
    kq, ks = fp8.quantize(kp, 16)
    vq, vs = fp8.quantize(vp, 16)
    run8 = jax.jit(lambda q, kq, vq, t, n, ks, vs: kernel.paged_decode(
        q, kq, vq, t, n, scale=h**-0.5, window=w, sinks=sk, k_scales=ks, v_scales=vs))
    out8, _ = run8(q, kq, vq, tables, lengths, ks, vs)
    exp8, _ = ref.paged_decode(q, kq, vq, tables, lengths, scale=h**-0.5, window=w, sinks=sk,
                               k_scales=ks, v_scales=vs)
    assert_close(out8, exp8, dtype=jnp.bfloat16)


def test_public_api_dispatches_to_the_kernel():
    from attn.paged_decode import paged_decode

    gen = rng()
    q, kp, vp, tables, lengths, _ = _problem(gen, b=3, kh=2, g=3, h=16, hv=16, p=16,
                                             max_pages=3, dtype=jnp.float32)
    out, lse = paged_decode(q, kp, vp, tables, lengths, window=20, sinks=4,
                            implementation="triton")
    exp_out, exp_lse = paged_decode(q, kp, vp, tables, lengths, window=20, sinks=4,
                                    implementation="xla")
    assert_close(out, exp_out)
    assert_close(lse, exp_lse, allow_neg_inf=True)
