"""The Mosaic GPU flash forward: its step ranges and refusals on the CPU, the kernel in Pallas's
Mosaic GPU interpreter on the CPU and compiled on the GPU, against the dense reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import attention, mosaic
from tests.utils import assert_close, randn, rng


def _visible(rows, keys, *, causal, window, sinks):
    """[rows, keys] bool: the dense API's rule at positions = token indices."""
    p, c = rows[:, None], keys[None, :]
    vis = np.ones((rows.size, keys.size), bool)
    if causal:
        vis &= c <= p
        if window > 0:
            vis &= (c > p - window) | (c < sinks)
    return vis


RANGE_CASES = [
    # (S, block_kv, block_q, causal, window, sinks)
    (1024, 128, 64, True, 0, 0),
    (1024, 128, 64, True, 256, 64),
    (1024, 128, 64, True, 300, 0),
    (1024, 128, 64, True, 128, 200),
    (1024, 64, 64, True, 100, 17),
    (1024, 64, 128, True, 64, 0),
    (1024, 64, 64, True, 1, 0),
    (1024, 128, 64, True, 4096, 128),
    (512, 128, 64, False, 0, 0),
]


@pytest.mark.parametrize("s,bkv,bq,causal,window,sinks", RANGE_CASES)
def test_step_ranges_cover_exactly_what_is_visible(s, bkv, bq, causal, window, sinks):
    """Per program and per compute group, against brute-force visibility: every visible pair lies
    in a listed step the group does not skip; the skipped steps hold none; the whole steps hold
    only visible pairs; the list is ascending and inside the keys."""
    ranges = dict(block_kv=bkv, seq_len=s, causal=causal, window=window, sinks=sinks)
    keys = np.arange(s)
    for r0 in range(0, s, 2 * bq):
        n_sink, w_lo, _, _, w_hi = (int(x) for x in mosaic.step_ranges(r0, 2 * bq, **ranges))
        assert 0 <= n_sink <= w_lo <= w_hi <= s // bkv
        listed = set(range(n_sink)) | set(range(w_lo, w_hi))
        for q0 in (r0, r0 + bq):
            rows = np.arange(q0, q0 + bq)
            vis = _visible(rows, keys, causal=causal, window=window, sinks=sinks)
            per_step = vis.reshape(bq, s // bkv, bkv)
            seen = per_step.any(axis=(0, 2))  # [steps] any visible pair
            whole = per_step.all(axis=(0, 2))
            lo, full_lo, full_hi, hi = (int(x) for x in mosaic.group_ranges(
                (w_lo, w_hi), mosaic.step_ranges(q0, bq, **ranges)))
            assert w_lo <= lo <= full_lo <= full_hi <= hi <= w_hi, (r0, q0)
            done = set(range(n_sink)) | set(range(lo, hi))
            assert set(np.flatnonzero(seen)) <= done, (r0, q0, np.flatnonzero(seen))
            assert done <= listed
            assert not seen[w_lo:lo].any() and not seen[hi:w_hi].any(), (r0, q0)
            assert whole[full_lo:full_hi].all(), (r0, q0, full_lo, full_hi)


def test_step_ranges_window_is_tight():
    """A 4K window at S64K: ~33 steps a program, not the causal 512 (the work the window saves)."""
    n_sink, w_lo, _, _, w_hi = (int(x) for x in mosaic.step_ranges(
        65536 - 128, 128, block_kv=128, seq_len=65536, causal=True, window=4096, sinks=128))
    assert n_sink == 1 and w_hi - w_lo == 33


def _qkv(gen, b, t, s, kh, g, h, dtype=jnp.bfloat16):
    return (randn(gen, (b, t, kh * g, h), dtype), randn(gen, (b, s, kh, h), dtype),
            randn(gen, (b, s, kh, h), dtype))


REFUSED = [
    (dict(dtype=jnp.float32), {}, "dtype"),
    (dict(h=96), {}, "H=96"),
    (dict(t=100, s=100), {}, "multiple"),
    (dict(t=128, s=256), {}, "T=128 != S=256"),
    ({}, dict(q_offset=np.array([0, 128], np.int32)), "q_offset"),
    ({}, dict(window=np.array([64, 128], np.int32)), "window"),
    ({}, dict(kv_lengths=np.array([256, 100], np.int32)), "kv_lengths"),
    ({}, dict(softcap=30.0), "soft-capping"),
]


@pytest.mark.parametrize("shape,options,match", REFUSED, ids=[r[2] for r in REFUSED])
def test_refusals_name_the_value(shape, options, match):
    dims = dict(b=2, t=256, s=256, kh=2, g=2, h=64) | shape
    dtype = dims.pop("dtype", jnp.bfloat16)
    q, k, v = _qkv(rng(0), dtype=dtype, **dims)
    with pytest.raises(NotImplementedError, match=match):
        attention(q, k, v, causal=True, implementation="mosaic",
                  config=mosaic.Config(interpret=True), **options)


def test_config_validation():
    with pytest.raises(ValueError, match="block_q"):
        mosaic.Config(block_q=32)
    with pytest.raises(ValueError, match="block_kv"):
        mosaic.Config(block_kv=96)
    with pytest.raises(ValueError, match="stages"):
        mosaic.Config(stages=1)


def test_interpreter_refuses_a_thread_pool_it_would_hang_in(monkeypatch):
    """Fewer than 4 XLA CPU threads: a clear error naming the count and its source, not a hang."""
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("NPROC", "2")
    with pytest.raises(RuntimeError, match=r"has 2 threads \(NPROC=2\).*NPROC=4"):
        mosaic._interpret_params()
    monkeypatch.delenv("NPROC")
    monkeypatch.setattr(mosaic.os, "cpu_count", lambda: 2)
    assert mosaic.xla_cpu_threads() == (2, "2 cores, NPROC unset")
    monkeypatch.setenv("NPROC", "4")
    assert mosaic.xla_cpu_threads() == (4, "NPROC=4")
    mosaic._interpret_params()


def test_window_sinks_become_static():
    assert mosaic.static_window_sinks(True, np.array([64, 64]), np.array([8, 8]), 2) == (64, 8)
    assert mosaic.static_window_sinks(True, 0, 8, 2) == (0, 0)
    assert mosaic.static_window_sinks(True, None, 0, 2) == (0, 0)
    assert mosaic.static_window_sinks(False, 64, 8, 2) == (0, 0)


# CPU: the kernel in Pallas's Mosaic GPU interpreter (TMA copies, barriers, the ping-pong and
# skipped steps simulated; the two products as jnp), small shapes: a program is 128 rows.

INTERPRET_CASES = {
    "causal-G2": (dict(b=1, t=256, s=256, kh=1, g=2, h=64), dict(), mosaic.Config()),
    # 64-key steps: the two compute groups' windows start and end in different steps, so both
    # skip steps; sinks that end inside a step.
    "window100-sink17-skips": (dict(b=1, t=384, s=384, kh=1, g=1, h=64),
                               dict(window=100, sinks=17), mosaic.Config(block_kv=64, stages=3)),
    "full-S!=T": (dict(b=1, t=128, s=384, kh=1, g=2, h=64), dict(causal=False), mosaic.Config()),
}


# (The interpreter needs a CPU thread per warp group: tests/conftest.py sets NPROC.)
@pytest.mark.parametrize("case", list(INTERPRET_CASES))
def test_interpreted_kernel_matches_reference(case):
    dims, options, config = INTERPRET_CASES[case]
    q, k, v = _qkv(rng(7), **dims)
    options = dict(causal=True) | options
    got = mosaic.attention(q, k, v, config=dataclasses.replace(config, interpret=True), **options)
    want = attention(*(x.astype(jnp.float32) for x in (q, k, v)), implementation="xla",
                     **options)
    assert_close(got[0].astype(jnp.float32), want[0], atol=2e-2, rtol=2e-2, err_msg="out")
    assert_close(got[1], want[1], atol=2e-3, rtol=2e-3, err_msg="lse")


# GPU: compiled, against the reference (float32 math on the bf16 inputs).

GPU_CASES = {
    "causal-B2-S1K-G4": (dict(b=2, t=1024, s=1024, kh=2, g=4, h=128), dict()),
    "causal-S2K-H64-G1": (dict(b=1, t=2048, s=2048, kh=4, g=1, h=64), dict()),
    "window256-sink64": (dict(b=1, t=2048, s=2048, kh=2, g=4, h=128), dict(window=256, sinks=64)),
    "window300": (dict(b=1, t=2048, s=2048, kh=2, g=2, h=128), dict(window=300)),
    "window100-sink200": (dict(b=1, t=1024, s=1024, kh=2, g=2, h=128),
                          dict(window=100, sinks=200)),
    "window1": (dict(b=1, t=512, s=512, kh=1, g=2, h=64), dict(window=1)),
    "full": (dict(b=2, t=256, s=1024, kh=2, g=2, h=128), dict(causal=False)),
    "scale": (dict(b=1, t=512, s=512, kh=2, g=2, h=128), dict(scale=0.3)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GPU_CASES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_kernel_matches_reference(case, dtype):
    dims, options = GPU_CASES[case]
    q, k, v = _qkv(rng(1), dtype=jnp.dtype(dtype), **dims)
    options = dict(causal=True) | options
    out, lse = attention(q, k, v, implementation="mosaic", **options)
    want_out, want_lse = attention(*(x.astype(jnp.float32) for x in (q, k, v)),
                                   implementation="xla", **options)
    assert out.dtype == q.dtype and lse.shape == q.shape[:3]
    assert_close(out.astype(jnp.float32), want_out, atol=2e-2, rtol=2e-2)
    assert_close(lse, want_lse, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
def test_configs_agree():
    """64-key steps with 3 / 4 slots give the default's output (same math, other schedule; 3
    slots of 128 keys do not fit in shared memory at H128)."""
    q, k, v = _qkv(rng(2), 1, 1024, 1024, 2, 4, 128)
    base = mosaic.attention(q, k, v, window=384, sinks=64)
    for cfg in (mosaic.Config(block_kv=64, stages=3), mosaic.Config(block_kv=64, stages=4)):
        out = mosaic.attention(q, k, v, window=384, sinks=64, config=cfg)
        assert_close(out[0].astype(jnp.float32), base[0].astype(jnp.float32), atol=1e-2,
                     rtol=1e-2)
        assert_close(out[1], base[1], atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [dict(), dict(window=256, sinks=64)], ids=["causal", "window"])
def test_gradients_match_reference(options):
    q, k, v = _qkv(rng(3), 1, 512, 512, 2, 2, 128)
    d_out = randn(rng(4), q.shape, jnp.float32)

    def loss(impl, q, k, v):
        out, lse = attention(q, k, v, implementation=impl, **options)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(jnp.sin(lse))

    got = jax.grad(loss, argnums=(1, 2, 3))("mosaic", q, k, v)
    want = jax.grad(loss, argnums=(1, 2, 3))("xla", *(x.astype(jnp.float32) for x in (q, k, v)))
    for name, a, b in zip("qkv", got, want):
        assert_close(a.astype(jnp.float32), b, atol=5e-2, rtol=5e-2, err_msg=f"d{name}")


@pytest.mark.gpu
def test_auto_falls_back_where_mosaic_refuses():
    """`implementation="auto"` with options only Triton handles (an offset) still runs."""
    q, k, v = _qkv(rng(5), 1, 256, 512, 2, 2, 128)
    out, _ = attention(q, k, v, q_offset=256, implementation="auto")
    want, _ = attention(*(x.astype(jnp.float32) for x in (q, k, v)), q_offset=256,
                        implementation="xla")
    assert_close(out.astype(jnp.float32), want, atol=2e-2, rtol=2e-2)

