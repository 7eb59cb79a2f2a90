"""The fused Mosaic GPU flash backward: its query-tile ranges and routing on the CPU, the kernel in
Pallas's Mosaic GPU interpreter on the CPU and compiled on the GPU, against the reference's
gradients (and the Triton backward's on the GPU)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import attention, mosaic, mosaic_bwd
from tests.attn.test_dense_mosaic import RANGE_CASES as FORWARD_RANGE_CASES
from tests.attn.test_dense_mosaic import _visible
from tests.utils import randn, rng

# The forward's visibility cases (lengths, windows, sinks), at the backward's fixed tiles: key
# tiles of 128, query tiles of 64; and a window one short of a key tile (its diagonal run keeps
# the window rule).
RANGE_CASES = sorted({(t, 128, 64, causal, window, sinks)
                      for t, _, _, causal, window, sinks in FORWARD_RANGE_CASES}
                     | {(1024, 128, 64, True, 127, 3)})


@pytest.mark.parametrize("t,keys,bq,causal,window,sinks", RANGE_CASES)
def test_query_ranges_match_brute_force(t, keys, bq, causal, window, sinks):
    """Per key tile: `[lo, hi)` is exactly the query tiles that see any of its keys;
    `[full_lo, full_hi)` only tiles that see all of them (run unmasked), and exactly those unless
    the tile holds both sink and window keys (then the tiles are run masked: slower, not
    wrong); each masked run's rule (`run_visible`) is the token rule on its tiles."""
    vis = _visible(np.arange(t), np.arange(t), causal=causal, window=window, sinks=sinks)
    for k0 in range(0, t, keys):
        lo, full_lo, full_hi, sinks_lo, hi = (int(x) for x in mosaic_bwd.query_ranges(
            k0, keys, block_q=bq, q_len=t, causal=causal, window=window, sinks=sinks))
        tiles = vis[:, k0:k0 + keys].reshape(t // bq, bq, keys)
        any_, all_ = np.flatnonzero(tiles.any((1, 2))), np.flatnonzero(tiles.all((1, 2)))
        assert (lo, hi) == ((any_[0], any_[-1] + 1) if any_.size else (lo, lo)), k0
        assert lo <= full_lo <= full_hi <= sinks_lo <= hi, k0
        assert set(range(full_lo, full_hi)) <= set(all_), k0
        pos, key = np.arange(t).reshape(t // bq, bq, 1), k0 + np.arange(keys)
        for run, a, z in (("diagonal", lo, full_lo), ("edge", full_hi, sinks_lo),
                          ("sinks", sinks_lo, hi)):
            rule = np.broadcast_to(mosaic_bwd.run_visible(
                run, pos[a:z], key, causal=causal, window=window, sinks=sinks, keys=keys,
                block_q=bq), tiles[a:z].shape)
            np.testing.assert_array_equal(rule, tiles[a:z], err_msg=f"{run} run, k0={k0}")
        sinks_only = (tiles == (key < sinks)).all((1, 2))
        if k0 >= sinks or k0 + keys <= sinks:
            assert list(range(full_lo, full_hi)) == list(all_), k0
            assert sinks_lo == hi, k0
        else:  # and from the first such tile on
            assert sinks_lo in (full_hi, hi) or not sinks_only[sinks_lo - 1], k0


def test_stats_kernel_matches_xla_and_zeroes_dq():
    """`_stats_kernel` (the compiled backward's one pass, here in Triton's interpreter) gives
    `row_stats` (rows that see nothing, lse -inf, and non-finite lse: +inf) and a zeroed dQ
    accumulator (the CPU harness starts outputs as NaN)."""
    gen = rng()
    b, t, n, h, bq = 2, 192, 3, 128, 64
    out, d_out = (randn(gen, (b, t, n, h), jnp.bfloat16) for _ in range(2))
    lse = randn(gen, (b, t, n)).reshape(-1).at[jnp.array([0, 7, 100])].set(
        jnp.array([-jnp.inf, jnp.inf, jnp.nan])).reshape(b, t, n)
    d_lse = randn(gen, (b, t, n))
    stats, zeros = mosaic_bwd.stats_and_zeroed_dq(out, lse, d_out, d_lse, block_q=bq)
    want = mosaic_bwd.row_stats(out, lse, d_out, d_lse, block_q=bq)
    assert stats.shape == want.shape == (b, n, t // bq, 2, bq)
    np.testing.assert_allclose(np.asarray(stats), np.asarray(want), rtol=1e-5, atol=1e-4)
    assert zeros.shape == (b, n, t // bq, bq * h) and not np.asarray(zeros).any()


def test_routing_names_what_keeps_the_triton_backward():
    cfg = mosaic.Config()
    assert mosaic.fused_backward_reasons((1, 256, 4, 128), (1, 256, 2, 128), cfg) == []
    assert "H=64" in mosaic.fused_backward_reasons((1, 256, 4, 64), (1, 256, 2, 64), cfg)[0]
    assert "S=192" in mosaic.fused_backward_reasons((1, 192, 4, 128), (1, 192, 2, 128), cfg)[0]
    off = dataclasses.replace(cfg, fused_backward=False)
    assert mosaic.fused_backward_reasons((1, 256, 4, 128), (1, 256, 2, 128), off) == [
        "Config(fused_backward=False)"]


def _grads(impl, q, k, v, d_out, config=None, **options):
    """Gradients of a loss that uses both outputs (out and lse: the lse cotangent)."""
    def loss(q, k, v):
        if impl == "mosaic":
            out, lse = mosaic.attention(q, k, v, config=config, **options)
        else:
            out, lse = attention(q, k, v, implementation=impl, **options)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(jnp.sin(lse))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def _inputs(seed, b, t, s, kh, g, h=128, dtype=jnp.bfloat16):
    gen = rng(seed)
    q = randn(gen, (b, t, kh * g, h), dtype)
    k, v = randn(gen, (b, s, kh, h), dtype), randn(gen, (b, s, kh, h), dtype)
    return q, k, v, randn(gen, q.shape, jnp.float32)


def _check(got, want, tol):
    for name, a, b in zip("qkv", got, want):
        a = a.astype(jnp.float32)
        assert bool(jnp.all(jnp.isfinite(a))), f"d{name} not finite"
        err = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert err < tol, f"d{name}: relative L2 error {err:.2e} >= {tol}"


# CPU: the kernel in Pallas's Mosaic GPU interpreter (TMA copies, barriers and masks simulated;
# the products as jnp products of the same shared-memory tiles). A program is 128 keys.
INTERPRET_CASES = {
    "causal-G3": (dict(b=1, t=256, s=256, kh=1, g=3), dict(causal=True)),
    # Sinks that end inside a tile, a window edge inside another: masked steps at both ends.
    "window100-sink17": (dict(b=1, t=384, s=384, kh=1, g=1), dict(window=100, sinks=17)),
    "full-T!=S-B2": (dict(b=2, t=128, s=256, kh=1, g=2), dict(causal=False)),
    "causal-f16": (dict(b=1, t=256, s=256, kh=2, g=1, dtype=jnp.float16), dict(causal=True)),
}
# 10-13 s each on 2 cores: kept out of CI's time (the GPU tests cover the full case).
SLOW_INTERPRET = {"full-T!=S-B2", "causal-f16"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_INTERPRET
                                  else c for c in INTERPRET_CASES])
def test_interpreted_backward_matches_reference(case):
    dims, options = INTERPRET_CASES[case]
    q, k, v, d_out = _inputs(11, **dims)
    options = dict(causal=True) | options
    got = _grads("mosaic", q, k, v, d_out, mosaic.Config(interpret=True), **options)
    want = _grads("xla", *(x.astype(jnp.float32) for x in (q, k, v)), d_out, **options)
    _check(got, want, 1e-2)


def _both_launch_orders(interpret, t):
    """The backward with programs launched KV head fastest and key tile fastest (the order
    `Config.key_tiles_fastest_from` picks at long S), on a small causal GQA case of `t` tokens
    (two KV heads: from two key tiles on, the two orders launch the programs differently)."""
    q, k, v, d_out = _inputs(13, b=1, t=t, s=t, kh=2, g=2)
    out, lse = attention(q, k, v, implementation="xla")
    grads = []
    for first in (t + 1, t):
        config = mosaic_bwd.Config(interpret=interpret, key_tiles_fastest_from=first)
        backward = jax.jit(functools.partial(mosaic_bwd.backward, causal=True, scale=128 ** -0.5,
                                             window=0, sinks=0, config=config))
        grads.append(backward(q, k, v, out, lse, d_out.astype(q.dtype), jnp.zeros_like(lse)))
    return grads


def test_interpreted_launch_orders_agree_exactly():
    # The interpreter sums each program's dQ in key-tile order either way: equal bits.
    # Two key tiles: the interpreter's time grows with the causal tile pairs.
    heads_first, keys_first = _both_launch_orders(interpret=True, t=256)
    for name, a, b in zip("qkv", heads_first, keys_first):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                      err_msg=f"d{name}")


# GPU: compiled; G in {1, 3, 8}, causal / window + sinks / full, several requests.
GPU_CASES = {
    "causal-G1": (dict(b=1, t=1024, s=1024, kh=4, g=1), dict()),
    "causal-B2-G3": (dict(b=2, t=768, s=768, kh=2, g=3), dict()),
    "causal-G8": (dict(b=1, t=1024, s=1024, kh=1, g=8), dict()),
    "window256-sink64": (dict(b=1, t=2048, s=2048, kh=2, g=4), dict(window=256, sinks=64)),
    "window100-sink200": (dict(b=1, t=1024, s=1024, kh=2, g=2), dict(window=100, sinks=200)),
    "full-T!=S": (dict(b=2, t=256, s=1024, kh=2, g=3), dict(causal=False)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_compiled_backward_matches_reference_and_triton(case):
    dims, options = GPU_CASES[case]
    q, k, v, d_out = _inputs(12, **dims)
    options = dict(causal=True) | options
    got = _grads("mosaic", q, k, v, d_out, mosaic.Config(), **options)
    triton = _grads("mosaic", q, k, v, d_out, mosaic.Config(fused_backward=False), **options)
    want = _grads("xla", *(x.astype(jnp.float32) for x in (q, k, v)), d_out, **options)
    _check(got, want, 1e-2)
    _check(got, [x.astype(jnp.float32) for x in triton], 1e-2)


@pytest.mark.gpu
def test_compiled_launch_orders_agree():
    # dQ's reduce-adds land in another order: equal up to float32 rounding.
    heads_first, keys_first = _both_launch_orders(interpret=False, t=384)
    _check(keys_first, [x.astype(jnp.float32) for x in heads_first], 1e-3)


def test_sink_tiles_launch_first():
    # A key tile holding sinks is the longest program by far: with sinks the launch stays KV
    # head fastest (every sink tile starts first) at any length; causal goes key tile fastest
    # from the threshold on.
    config = mosaic_bwd.Config(key_tiles_fastest_from=16384)
    assert not mosaic_bwd.key_tiles_fastest(8192, 0, config)
    assert mosaic_bwd.key_tiles_fastest(16384, 0, config)
    for s in (8192, 16384, 131072):
        assert not mosaic_bwd.key_tiles_fastest(s, 64, config)
