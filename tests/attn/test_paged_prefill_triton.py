"""Chunked prefill over paged KV, Triton kernel (interpreted on CPU, compiled on GPU): the shared
base (`paged_prefill_base`) on 32-row x 16-key tiles with 16-token pages, so tiles span pages and
the sink / window-edge / full / diagonal ranges are all visited; then what is the kernel's own:
the default config, page tiles against the gather path on every page size, skipped pages, the
public dispatch, its refusals and config checks, compiled runs on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn._harness import triton_call
from attn.dense import paged_prefill_attention
from attn.dense import triton_paged as kernel
from kv import fp8
from tests.attn.paged_prefill_base import PagedPrefillTests, owned_tokens, problem, window_sinks
from tests.utils import AttentionTestBase, assert_close, case_id, poison, rng

SMALL = kernel.Config(block_m=32, block_n=16)


class TestTriton(PagedPrefillTests):
    implementation = "triton"
    config = SMALL


def _check(q, kp, vp, tables, q_offset, kv_lengths, owned, *, config=SMALL, dtype=None, **opts):
    """Kernel on the poisoned pool vs reference on the clean one; masked rows exactly 0 / -inf."""
    out, lse = kernel.paged_prefill_attention(
        q, poison(kp, owned), poison(vp, owned), tables, q_offset, kv_lengths, config=config,
        **opts)
    exp_out, exp_lse = paged_prefill_attention(q, kp, vp, tables, q_offset, kv_lengths,
                                               implementation="xla", **opts)
    tol = {} if dtype is not None else dict(atol=2e-5, rtol=2e-5)
    assert_close(out, exp_out, dtype=dtype, err_msg="out", **tol)
    assert_close(lse, exp_lse, dtype=dtype, allow_neg_inf=True, err_msg="lse")
    sees = np.isfinite(np.asarray(exp_lse))
    AttentionTestBase.check_masked_rows(out, lse, sees)
    return sees


# Page tiles: every page size against every key tile, both load paths. P % BLOCK_N == 0 takes
# the one-id-per-tile block loads (unless page_tiles=False); BLOCK_N > P always gathers.
TILE_GRID = [(p, bn) for p in (16, 32, 64, 128) for bn in (16, 32, 64)]


def _launch_recording(monkeypatch, *args, **kw):
    """`kernel._launch` (un-jitted, so it traces every time) and the PAGE_TILES it launched."""
    seen = []

    def spy(*a, **meta):
        seen.append(meta["PAGE_TILES"])
        return triton_call(*a, **meta)

    monkeypatch.setattr(kernel, "triton_call", spy)
    out = kernel._launch(*args, **kw)
    assert len(seen) == 1
    return out, seen[0]


@pytest.mark.parametrize("page_tiles", [True, False], ids=["page-tiles", "gather"])
@pytest.mark.parametrize("p,bn", TILE_GRID, ids=[case_id(P=p, BN=bn) for p, bn in TILE_GRID])
def test_page_tiles_grid(monkeypatch, p, bn, page_tiles):
    """Window + sinks per (row, head), G in {1, 4, 5}, prefixes off the page and tile grid."""
    gen = rng()
    kh, g = 2, (1, 4, 5)[TILE_GRID.index((p, bn)) % 3]
    q, kp, vp, tables, off, lens, owned = problem(gen, t=19, prefixes=(150, 37), kh=kh, g=g, p=p)
    window = np.array([[40, 0], [9, 70]], np.int32)  # row 0 head 0 skips the middle tiles
    sinks = gen.integers(0, 24, (2, kh)).astype(np.int32)
    # A -1 hole in row 0's full head, in tiles every query sees (the unmasked range): masked.
    tables = np.asarray(tables).copy()
    owned[1, tables[0, 1, 1]] = False
    tables[0, 1, 1] = -1
    tables = jnp.asarray(tables)
    cfg = kernel.Config(block_m=32, block_n=bn, page_tiles=page_tiles)
    keep = owned_tokens(owned, tables, lens, p)
    (out, lse), used = _launch_recording(
        monkeypatch, q, poison(kp, keep), poison(vp, keep), tables, off, lens, window, sinks,
        None, None, scale=0.3, config=cfg)
    assert used == (page_tiles and p % bn == 0)
    exp_out, exp_lse = paged_prefill_attention(q, kp, vp, tables, off, lens, scale=0.3,
                                               window=window, sinks=sinks, implementation="xla")
    assert_close(out, exp_out, atol=2e-5, rtol=2e-5, err_msg="out")
    assert_close(lse, exp_lse, allow_neg_inf=True, err_msg="lse")


FP8_GRID = [(16, 16, True), (16, 32, True), (32, 16, False), (64, 64, True), (64, 32, True),
            (128, 64, False), (128, 16, True)]


@pytest.mark.parametrize("p,bn,page_tiles", FP8_GRID,
                         ids=[case_id(P=p, BN=bn) + ("-page-tiles" if pt else "-gather")
                              for p, bn, pt in FP8_GRID])
def test_page_tiles_fp8(monkeypatch, p, bn, page_tiles):
    """FP8 pages with 8-token scale sub-blocks, so every key tile holds several: each of its
    rows takes its own sub-block's scale, on both load paths; NaN scales of unowned pages stay
    out."""
    gen = rng()
    kh, g = 2, 5 if page_tiles else 4
    q, kp, vp, tables, off, lens, owned = problem(gen, t=13, prefixes=(140, 29), kh=kh, g=g, p=p,
                                                   dtype=jnp.bfloat16)
    kq, ks = fp8.quantize(poison(kp, owned, 0.0), 8)
    vq, vs = fp8.quantize(poison(vp, owned, 0.0), 8)
    window, sinks = np.array([[33, 0], [0, 12]], np.int32), np.array([[4, 0], [0, 17]], np.int32)
    cfg = kernel.Config(block_m=32, block_n=bn, page_tiles=page_tiles)
    (out, lse), used = _launch_recording(
        monkeypatch, q, kq, vq, tables, off, lens, window, sinks, poison(ks, owned),
        poison(vs, owned), scale=0.25, config=cfg)
    assert used == (page_tiles and p % bn == 0)
    exp_out, exp_lse = paged_prefill_attention(q, kq, vq, tables, off, lens, scale=0.25,
                                               window=window, sinks=sinks, k_scales=ks,
                                               v_scales=vs, implementation="xla")
    assert_close(out, exp_out, dtype=jnp.bfloat16)
    assert_close(lse, exp_lse, dtype=jnp.bfloat16, allow_neg_inf=True)


@pytest.mark.parametrize("p", [16, 64])
def test_page_tiles_leading_hole_with_very_negative_scores(p):
    """A -1 page first in the unmasked range, then keys whose scores are all about -360 (base 2):
    the hole must leave the running max at -inf, or 2^(-360 - 0) underflows every later p."""
    gen = rng()
    q, kp, vp, tables, off, lens, owned = problem(gen, t=5, prefixes=(3 * p,), kh=1, g=2, p=p)
    u = jnp.full((16,), 0.25, jnp.float32)  # |u| = 1
    kp = jnp.broadcast_to(u, kp.shape)
    q = jnp.broadcast_to(-250.0 * u, q.shape)
    tables = np.asarray(tables).copy()
    owned[0, tables[0, 0, 0]] = False
    tables[0, 0, 0] = -1
    tables = jnp.asarray(tables)
    sees = _check(q, kp, vp, tables, off, lens, owned, config=kernel.Config(block_m=32,
                                                                            block_n=16),
                  scale=1.0)
    assert sees.all()


SKIP_GRID = [(32, 16), (32, 32), (64, 16), (64, 64), (128, 32), (128, 64)]


@pytest.mark.parametrize("p,bn", SKIP_GRID, ids=[case_id(P=p, BN=bn) for p, bn in SKIP_GRID])
def test_page_tiles_skip_whole_pages_outside_sink_and_window(p, bn):
    """Pages of a streaming head that hold no key any query sees are NaN but keep their table ids
    (stricter than the contract, which only promises -1 entries are masked). A visited tile's
    masked V would still multiply p = 0 by NaN, so a finite output proves those tiles, hence
    those whole pages, were never loaded: only sink and window tiles are."""
    gen = rng()
    t, prefix, kh = 12, 5 * p + 7, 2
    q, kp, vp, tables, off, lens, owned = problem(gen, t=t, prefixes=(prefix,), kh=kh, g=4, p=p)
    window = np.array([[p // 2 + 3, 0]], np.int32)  # head 1: full, all its pages stay finite
    sinks = np.array([[5, 0]], np.int32)
    c = np.arange(int(lens[0]))
    seen = (c <= prefix + t - 1) & ((c < sinks[0, 0]) | (c > prefix - window[0, 0]))
    keep = owned.copy()
    t0 = np.asarray(tables)[0, 0]
    for j in range(-(-int(lens[0]) // p)):
        keep[0, t0[j]] = seen[j * p:(j + 1) * p].any()
    assert (~keep[0] & owned[0]).sum() >= 3  # the middle pages really are poisoned
    cfg = kernel.Config(block_m=32, block_n=bn)
    out, lse = kernel.paged_prefill_attention(q, poison(kp, keep), poison(vp, keep), tables, off,
                                              lens, scale=0.3, window=window, sinks=sinks,
                                              config=cfg)
    exp_out, exp_lse = paged_prefill_attention(q, kp, vp, tables, off, lens, scale=0.3,
                                               window=window, sinks=sinks, implementation="xla")
    assert_close(out, exp_out)
    assert_close(lse, exp_lse)


def test_public_api_dispatch_gradient_and_auto_fallback(monkeypatch):
    gen = rng()
    q, kp, vp, tables, off, lens, _ = problem(gen, t=5, prefixes=(11, 2), kh=1, g=2)
    args = (q, kp, vp, tables, off, lens)
    opts = dict(window=np.array([6], np.int32), sinks=2)
    out, lse = paged_prefill_attention(*args, implementation="triton", **opts)
    exp_out, exp_lse = paged_prefill_attention(*args, implementation="xla", **opts)
    assert_close(out, exp_out)
    assert_close(lse, exp_lse)

    # The kernel path is differentiable (the reference's VJP) in q and the pages.
    def loss(impl):
        return lambda q, kp, vp: jnp.sum(paged_prefill_attention(
            q, kp, vp, tables, off, lens, implementation=impl, **opts)[0] ** 2)
    got = jax.grad(loss("triton"), (0, 1, 2))(q, kp, vp)
    exp = jax.grad(loss("xla"), (0, 1, 2))(q, kp, vp)
    for a, e in zip(got, exp):
        assert_close(a, e)

    wide = problem(gen, t=2, prefixes=(3,), kh=1, g=1, h=272, hv=16)[:6]
    with pytest.raises(NotImplementedError, match="head dims"):
        paged_prefill_attention(*wide, implementation="triton")
    monkeypatch.setattr(attn._harness, "on_gpu", lambda: True)
    out, _ = paged_prefill_attention(*wide, implementation="auto")  # falls back to XLA
    monkeypatch.undo()
    assert_close(out, paged_prefill_attention(*wide, implementation="xla")[0])


def test_kernel_refusals_and_config_validation():
    gen = rng()
    q, kp, vp, tables, off, lens, _ = problem(gen, t=3, prefixes=(4, 1), kh=2, g=2)
    call = paged_prefill_attention
    assert call.reasons("triton", q, kp, vp, tables, off, lens) == []
    with pytest.raises(NotImplementedError, match="q's dtype"):
        call(q.astype(jnp.bfloat16), kp, vp, tables, off, lens, implementation="triton")
    with pytest.raises(ValueError, match="block_m"):
        kernel.Config(block_m=48)
    with pytest.raises(ValueError, match="num_warps"):
        kernel.Config(num_warps=3)
    with pytest.raises(ValueError, match="gather_num_stages=0"):
        kernel.Config(gather_num_stages=0)


# GPU: realistic shapes, bf16 / fp8 pages against the float32 reference.

GPU_CASES = {
    "prefix4K-chunk1K-P16": dict(t=1024, prefixes=(4096, 1500), p=16, window=False),
    "prefix4K-chunk1K-P64-window": dict(t=1024, prefixes=(4096, 3000), p=64, window=True),
    "prefix2K-chunk2K-P128": dict(t=2048, prefixes=(2048,), p=128, window=False),
    "chunk1-P32": dict(t=1, prefixes=(5000, 17), p=32, window=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("g", [1, 4, 7])
def test_gpu_matches_reference(name, g):
    c = GPU_CASES[name]
    gen = rng()
    kh = 4
    q, kp, vp, tables, off, lens, owned = problem(
        gen, t=c["t"], prefixes=c["prefixes"], kh=kh, g=g, h=128, hv=128, p=c["p"],
        dtype=jnp.bfloat16)
    opts = dict(scale=128**-0.5)
    if c["window"]:
        window, sinks = window_sinks(gen, len(c["prefixes"]), kh, int(lens.max()))
        opts |= dict(window=window, sinks=sinks)
    run = jax.jit(lambda *a: kernel.paged_prefill_attention(*a, **opts))
    out, lse = run(q, poison(kp, owned), poison(vp, owned), tables, off, lens)
    f32 = dict(q=q.astype(jnp.float32), kp=kp.astype(jnp.float32), vp=vp.astype(jnp.float32))
    exp_out, exp_lse = paged_prefill_attention(f32["q"], f32["kp"], f32["vp"], tables, off, lens,
                                               implementation="xla", **opts)
    assert_close(out, exp_out, dtype=jnp.bfloat16)
    assert_close(lse, exp_lse, atol=1e-2, rtol=1e-3, allow_neg_inf=True)
    kq, ks = fp8.quantize(kp, 16)
    vq, vs = fp8.quantize(vp, 16)
    out8, _ = kernel.paged_prefill_attention(q, kq, vq, tables, off, lens, k_scales=ks,
                                             v_scales=vs, **opts)
    exp8, _ = paged_prefill_attention(f32["q"], kq, vq, tables, off, lens, k_scales=ks,
                                      v_scales=vs, implementation="xla", **opts)
    assert_close(out8, exp8, dtype=jnp.bfloat16)


# (page size, config): the default (page tiles, 3 stages), the gather path at the same size, key
# tiles of a whole page, tiles of half a page, a wide-page pool.
GPU_TILE_CASES = {
    "P64-default": (64, None),
    "P64-gather": (64, kernel.Config(page_tiles=False)),
    "P128-BN128": (128, kernel.Config(block_n=128, num_stages=2)),
    "P64-BN32": (64, kernel.Config(block_n=32)),
    "P256-default": (256, None),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_TILE_CASES))
def test_gpu_page_tiles(name):
    """Both load paths compiled: bf16 and fp8 pages, window + sinks, G = 5, lengths off the grid."""
    p, cfg = GPU_TILE_CASES[name]
    gen = rng()
    kh, g = 2, 5
    q, kp, vp, tables, off, lens, owned = problem(
        gen, t=700, prefixes=(3001, 130), kh=kh, g=g, h=128, hv=128, p=p, dtype=jnp.bfloat16)
    keep = owned_tokens(owned, tables, lens, p)
    window, sinks = np.array([[900, 0], [0, 64]], np.int32), np.array([[7, 0], [0, 3]], np.int32)
    opts = dict(scale=128**-0.5, window=window, sinks=sinks)
    out, lse = kernel.paged_prefill_attention(q, poison(kp, keep), poison(vp, keep), tables, off,
                                              lens, config=cfg, **opts)
    f32 = [x.astype(jnp.float32) for x in (q, kp, vp)]
    exp_out, exp_lse = paged_prefill_attention(*f32, tables, off, lens, implementation="xla",
                                               **opts)
    assert_close(out, exp_out, dtype=jnp.bfloat16)
    assert_close(lse, exp_lse, atol=1e-2, rtol=1e-3, allow_neg_inf=True)
    kq, ks = fp8.quantize(poison(kp, keep, 0.0), 16)
    vq, vs = fp8.quantize(poison(vp, keep, 0.0), 16)
    out8, _ = kernel.paged_prefill_attention(q, kq, vq, tables, off, lens, k_scales=ks,
                                             v_scales=vs, config=cfg, **opts)
    exp8, _ = paged_prefill_attention(f32[0], kq, vq, tables, off, lens, k_scales=ks,
                                      v_scales=vs, implementation="xla", **opts)
    assert_close(out8, exp8, dtype=jnp.bfloat16)
