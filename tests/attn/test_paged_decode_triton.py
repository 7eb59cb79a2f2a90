"""The Triton paged decode kernel: the shared base through the op (`paged_decode_base`,
interpreted on a CPU), its launch configs against the reference, compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.paged_decode import reference as ref
from attn.paged_decode import triton as kernel
from kv import fp8
from tests.attn.paged_decode_base import PagedDecodeTests
from tests.utils import assert_close, case_id, poison, randn, rng


class TestTriton(PagedDecodeTests):
    """The interpreter is slow: four rows (padding, 1, P - 1, P + 1; the streaming case has a
    full table) and group sizes 1 and 7 (`test_launch_configs_match_reference` has 2, 5 and
    16)."""

    implementation = "triton"
    config = kernel.Config(block_n=16, num_splits=2)
    fp8_tolerance = (2e-2, 2e-2)  # tiles and probabilities in float16 (`Config.fp8_compute`)
    batch = 4
    group_sizes = (1, 7)


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
    dict(kh=1, g=5, h=64, hv=32, p=16, max_pages=6, n=32, splits=3),
    dict(kh=1, g=16, h=48, hv=48, p=64, max_pages=2, n=64, splits=1),
    # Tiles inside one page, read token by token anyway (the gather path on large pages).
    dict(kh=2, g=2, h=32, hv=32, p=32, max_pages=4, n=16, splits=2, page_tiles=False),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: case_id(G=c["g"], H=c["h"], P=c["p"],
                                                         N=c["n"], J=c["splits"])
                         + ("" if c.get("page_tiles", True) else "-gather"))
def test_launch_configs_match_reference(c):
    """Tile widths, split counts and the token-by-token gather, per-head window / sinks (full
    attention where a drawn window is <= 0), odd head dims, against the reference."""
    gen = rng()
    q, kp, vp, tables, lengths, owned = _problem(
        gen, b=4, kh=c["kh"], g=c["g"], h=c["h"], hv=c["hv"], p=c["p"],
        max_pages=c["max_pages"], dtype=jnp.float32)
    kp, vp = poison(kp, owned), poison(vp, owned)  # unowned pages must never leak in
    w, sk = _per_head(gen, c["kh"], c["max_pages"] * c["p"])
    cfg = kernel.Config(block_n=c["n"], num_splits=c["splits"],
                        page_tiles=c.get("page_tiles", True))
    out, lse = kernel.paged_decode(q, kp, vp, tables, lengths, scale=0.3, window=w, sinks=sk,
                                   config=cfg)
    exp_out, exp_lse = ref.paged_decode(q, kp, vp, tables, lengths, scale=0.3, window=w, sinks=sk)
    assert_close(out, exp_out, atol=1e-5, rtol=1e-5)
    assert_close(lse, exp_lse, allow_neg_inf=True)
    assert (np.asarray(out)[1] == 0).all() and np.isneginf(np.asarray(lse)[1]).all()


def test_default_tiles_follow_the_row_width():
    """64-token tiles where K / V rows pass 512 bytes (float32 pages at H256: 128-token tiles
    ask for 280 KiB of shared memory, `experiments.tools.hopper_fit`); the row width is the
    wider of the two pools'."""
    k16 = jnp.zeros((2, 4, 16, 256), jnp.bfloat16)
    k32 = k16.astype(jnp.float32)
    assert kernel.row_bytes(k16, k32[..., :64]) == 512
    assert kernel.row_bytes(k16, k32) == 1024
    for pages, block_n in ((k16, 128), (k32, 64)):
        config = kernel.default_config(4, 2, 4096, row_bytes=kernel.row_bytes(pages, pages))
        assert config.block_n == block_n


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
