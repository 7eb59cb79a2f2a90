"""The Triton flash prefill kernel against the dense reference: interpreted on CPU, compiled on GPU.

The interpreter runs one numpy op per kernel op, so CPU cases are tiny and use 64-row x 32-key tiles
(several query tiles, sink / window-edge / full / diagonal key tiles all visited); one case uses
16 x 16 tiles and one the default 128 x 64. The expected values come from the public API with
`implementation="xla"`, which compiles once per shape for every option set. Keys past `kv_lengths`
are NaN-poisoned wherever lengths are given.
"""


import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn._harness import HOPPER_SHARED_MEMORY
from attn.dense import attention
from attn.dense import triton as kernel
from tests.utils import (
    AttentionTestBase,
    assert_close,
    case_id,
    compile_for_sm90,
    poison,
    randn,
    rng,
)

SMALL = kernel.Config(block_m=64, block_n=32)
B, T, S, K, G, H, HV = 2, 37, 130, 2, 5, 32, 24  # the shared CPU shape: 3 query tiles per head


def _qkv(gen, b=B, t=T, s=S, kh=K, g=G, h=H, hv=HV, dtype=jnp.float32):
    return (randn(gen, (b, t, kh * g, h), dtype), randn(gen, (b, s, kh, h), dtype),
            randn(gen, (b, s, kh, hv), dtype))


def _poison_tail(k, v, kv_lengths):
    """NaN in every key / value at or past its row's length: must never reach an output."""
    if kv_lengths is None:
        return k, v
    keep = jnp.arange(k.shape[1])[None, :] < jnp.asarray(kv_lengths)[:, None]  # [B, S]
    return poison(k, keep), poison(v, keep)


def _check(q, k, v, *, config, dtype=None, **options):
    """Kernel vs reference (on the clean K / V); masked rows exactly 0 / -inf; returns outputs."""
    kp, vp = _poison_tail(k, v, options.get("kv_lengths"))
    out, lse = kernel.attention(q, kp, vp, config=config, **options)
    exp_out, exp_lse = attention(q, k, v, implementation="xla", **options)
    tol = {} if dtype is not None else dict(atol=2e-5, rtol=2e-5)
    assert_close(out, exp_out, dtype=dtype, err_msg="out", **tol)
    assert_close(lse, exp_lse, dtype=dtype, allow_neg_inf=True, err_msg="lse")
    sees = np.isfinite(np.asarray(exp_lse))  # [B, T, N]: the reference's rows with a key
    AttentionTestBase.check_masked_rows(out, lse, sees)
    return out, lse, sees


OPTIONS = {
    "causal-chunk-offset93": dict(q_offset=93),
    "causal-offsets-per-row": dict(q_offset=np.array([0, 50], np.int32)),
    "noncausal-scale": dict(causal=False, scale=0.37),
    "window-sinks-per-head": dict(q_offset=93, window=np.array([16, 0], np.int32),
                                  sinks=np.array([3, 5], np.int32)),
    "window-long-sink": dict(q_offset=np.array([93, 10], np.int32), window=9, sinks=40),
    "lengths-masked-rows": dict(q_offset=93, window=np.array([8, 8], np.int32),
                                sinks=np.array([2, 0], np.int32),
                                kv_lengths=np.array([100, 0], np.int32)),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_options_match_reference(name):
    q, k, v = _qkv(rng())
    _, _, sees = _check(q, k, v, config=SMALL, **OPTIONS[name])
    if name == "lengths-masked-rows":  # row 1 sees nothing; row 0 head 1 loses late queries
        assert not sees[1].any() and not sees[0, -1, G:].any() and sees[0, 0].all()


EDGES = [  # (shape, options, config)
    (dict(b=1, t=1, s=1, kh=1, g=1, h=16, hv=16), {}, SMALL),
    (dict(b=2, t=1, s=65, kh=1, g=4, h=16, hv=16), dict(q_offset=64), SMALL),
    (dict(b=1, t=65, s=65, kh=2, g=1, h=16, hv=16),
     dict(window=np.array([20, 0], np.int32), sinks=np.array([7, 0], np.int32)),
     kernel.Config(block_m=16, block_n=16)),
    (dict(b=1, t=33, s=70, kh=1, g=7, h=24, hv=40), dict(q_offset=np.array([37], np.int32)),
     SMALL),
    (dict(b=1, t=20, s=47, kh=2, g=2, h=16, hv=16),
     dict(causal=False, kv_lengths=np.array([31], np.int32)), SMALL),
]


@pytest.mark.parametrize("shape,options,config", EDGES, ids=[
    case_id(T=c[0]["t"], S=c[0]["s"], G=c[0]["g"], H=c[0]["h"], Hv=c[0]["hv"],
            M=c[2].block_m, N=c[2].block_n) for c in EDGES])
def test_edge_shapes_match_reference(shape, options, config):
    q, k, v = _qkv(rng(), **shape)
    _check(q, k, v, config=config, **options)


def test_bf16_default_config():
    q, k, v = _qkv(rng(), dtype=jnp.bfloat16)
    _check(q, k, v, config=None, dtype=jnp.bfloat16, q_offset=np.array([93, 20], np.int32),
           window=np.array([40, 0], np.int32), sinks=np.array([4, 0], np.int32))


def test_wide_rows_take_the_small_tiles():
    """Rows over 256 bytes (H > 128 in bf16, H > 64 in float32) take the 32-key, 2-stage tiles
    in every Triton kernel of the family; the op's default follows its inputs' dtype."""
    from attn.block_sparse import triton as sparse_triton
    from attn.dense import api, triton_paged

    for module in (kernel, triton_paged, sparse_triton):
        assert module.default_config(128, 128, 2).block_n > 32, module.__name__
        for h, itemsize in ((256, 2), (128, 4), (96, 4)):
            assert module.default_config(h, h, itemsize).block_n == 32, (module.__name__, h)
        # Rows over 512 bytes (float32 at H256): 64 query rows a forward program.
        assert module.default_config(256, 256, 4).block_m == 64, module.__name__
        assert module.default_config(256, 256, 2).block_m == 128, module.__name__
        # float32 at H64: the 16-bit tiles; the forward in 2 stages where 3 would not fit
        # (`test_float32_head_dim_64_forward_fits_shared_memory`).
        f32, bf16 = module.default_config(64, 64, 4), module.default_config(64, 64, 2)
        stages = 3 if module is triton_paged else 2
        assert f32 == dataclasses.replace(bf16, num_stages=stages), module.__name__
    q = jnp.zeros((1, 8, 2, 128), jnp.float32)
    args = dict(q=q, v=q)
    assert api._flash_config("triton")(args) == kernel.default_config(128, 128, 4)
    assert api._head_dims(args) == "H128-Hv128-float32"
    assert api._head_dims(dict(q=q.astype(jnp.bfloat16), v=q)) == "H128-Hv128"
    pages = jnp.zeros((2, 4, 16, 128), jnp.bfloat16)  # paged prefill: the wider element counts
    assert triton_paged.config_for(q, pages) == triton_paged.default_config(128, 128, 4)
    assert triton_paged.config_for(q.astype(jnp.bfloat16), pages) == triton_paged.Config()


def test_public_api_dispatch_and_auto_fallback(monkeypatch):
    q, k, v = _qkv(rng(), b=1, t=9, s=12, kh=1, g=3, h=16, hv=16)
    out, lse = attention(q, k, v, q_offset=3, implementation="triton")
    exp_out, exp_lse = attention(q, k, v, q_offset=3, implementation="xla")
    assert_close(out, exp_out, atol=2e-5, rtol=2e-5)
    assert_close(lse, exp_lse, allow_neg_inf=True)
    seg = dict(q_segment_ids=np.zeros((1, 9), np.int32), kv_segment_ids=np.zeros((1, 12), np.int32))
    with pytest.raises(NotImplementedError, match="segment ids"):
        attention(q, k, v, implementation="triton", **seg)
    # "auto" on a GPU picks the kernel; options it refuses fall back to XLA instead of raising.
    monkeypatch.setattr(attn._harness, "on_gpu", lambda: True)
    out, _ = attention(q, k, v, implementation="auto", **seg)
    monkeypatch.undo()
    assert_close(out, attention(q, k, v, implementation="xla", **seg)[0])


GRAD_CASES = {  # (shape, options): every masked path, odd head dims, poisoned tails, dead rows
    "window-sinks-lengths-G5-H24": (
        dict(b=2, t=33, s=70, kh=1, g=5, h=24, hv=40),
        dict(q_offset=np.array([37, 5], np.int32), window=9, sinks=3,
             kv_lengths=np.array([50, 0], np.int32))),
    "noncausal-G3": (dict(b=1, t=40, s=100, kh=2, g=3, h=16, hv=16), dict(causal=False)),
}


@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_gradients_match_reference(name):
    """dQ, dK, dV of a loss on both outputs (lse too) against the reference's autodiff."""
    shape, opts = GRAD_CASES[name]
    gen = rng()
    q, k, v = _qkv(gen, **shape)
    d_out = randn(gen, q.shape[:3] + (v.shape[-1],))
    d_lse = randn(gen, q.shape[:3])
    config = kernel.Config(block_m=32, block_n=16, dkv_block_m=16, dkv_block_n=32, dq_block_m=32,
                           dq_block_n=16)

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out * d_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
        return f

    kp, vp = _poison_tail(k, v, opts.get("kv_lengths"))
    got = jax.grad(loss(lambda *a: kernel.attention(*a, config=config, **opts)), (0, 1, 2))(
        q, kp, vp)
    exp = jax.grad(loss(lambda *a: attention(*a, implementation="xla", **opts)), (0, 1, 2))(
        q, k, v)
    for name, a, e in zip("qkv", got, exp):  # past a length the gradient is exactly 0
        assert_close(a, e, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")


def test_unsupported_and_config_validation():
    q, k, v = _qkv(rng(), b=1, t=2, s=2, kh=1, g=1, h=16, hv=16)
    assert attention.reasons("triton", q, k, v) == []
    wide = jnp.zeros((1, 2, 1, 512))
    assert attention.reasons("triton", wide, wide, wide) == ["head dims H=512, Hv=512 over 256"]
    with pytest.raises(NotImplementedError, match="head dims"):
        attention(wide, wide, wide, implementation="triton")
    with pytest.raises(ValueError, match="block_m"):
        kernel.Config(block_m=96)
    with pytest.raises(ValueError, match="block_n"):
        kernel.Config(block_n=8)
    with pytest.raises(ValueError, match="num_warps"):
        kernel.Config(num_warps=3)
    with pytest.raises(ValueError, match="num_stages"):
        kernel.Config(num_stages=0)


def _sm90_jobs(cfg=None, dtype="bf16", h=128):
    """The forward and both backward kernels at `cfg` (default: the bf16 default tiles), B1 S8K
    N32 / K8 causal, head dim `h`, `dtype` inputs (`compile_for_sm90` jobs)."""
    from attn.dense import _flash_bwd as kb

    cfg = cfg or kernel.default_config(h)
    dims = dict(B=1, T=8192, S=8192, K=8, G=4, H=h, HV=h, BLOCK_H=h, BLOCK_HV=h,
                PRECISION="ieee" if dtype == "fp32" else "tf32", CAUSAL=True)
    fwd = dict(SCALE_LOG2=0.13, NUM_M=-(-8192 * 4 // cfg.block_m), BLOCK_M=cfg.block_m,
               BLOCK_N=cfg.block_n, CAP=0.0)
    dq = dict(SCALE=0.09, BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n,
              NUM_M=-(-8192 * 4 // cfg.dq_block_m))
    dkv = dict(SCALE=0.09, BLOCK_M=cfg.dkv_block_m, BLOCK_N=cfg.dkv_block_n)
    jobs = []
    for module, fn, consts, warps, stages in (
            ("attn.dense.triton", kernel._flash_fwd_kernel, fwd, cfg.num_warps, cfg.num_stages),
            ("attn.dense._flash_bwd", kb._flash_bwd_dq_kernel, dq, cfg.bwd_num_warps,
             cfg.bwd_num_stages),
            ("attn.dense._flash_bwd", kb._flash_bwd_dkdv_kernel, dkv, cfg.bwd_num_warps,
             cfg.bwd_num_stages)):
        consts = consts | dims
        pointers = {}
        for n in fn.arg_names:
            if n not in consts:
                pointers[n] = ("*i32" if n.startswith(("offset", "len", "window", "sink"))
                               else "*fp32" if n.startswith(("lse", "delta")) else f"*{dtype}")
        jobs.append(dict(kernel=f"{module}:{fn.__name__}", constexprs=consts, pointers=pointers,
                         num_warps=warps, num_stages=stages, count=("wgmma.mma_async",)))
    return jobs


@pytest.mark.slow
def test_float32_default_tiles_fit_shared_memory():
    """float32 at H128 (FMA dots, big rows): the default tiles of the three kernels fit in an
    H100's 227 KiB of shared memory per block (the 16-bit tiles need 289-448 KiB)."""
    for r in compile_for_sm90(_sm90_jobs(kernel.default_config(128, 128, 4), "fp32")):
        assert r["shared"] <= HOPPER_SHARED_MEMORY, r


@pytest.mark.slow
def test_float32_head_dim_64_forward_fits_shared_memory():
    """float32 at H64 keeps the 128 x 128 forward tiles in 2 stages: 3 would ask the GPU for more
    shared memory than a Hopper block has, and the launch would fail."""
    cfg = kernel.default_config(64, 64, 4)
    forward = _sm90_jobs(cfg, "fp32", h=64)[:1]
    three_stages = [dict(forward[0], num_stages=3)]
    fits, too_big = compile_for_sm90(forward + three_stages)
    assert cfg.num_stages == 2 and fits["shared"] <= HOPPER_SHARED_MEMORY, fits
    assert too_big["shared"] > HOPPER_SHARED_MEMORY, too_big


@pytest.mark.slow
def test_kernels_compile_for_sm90_within_spill_limits():
    """Compile the three kernels for Hopper on any machine (no GPU needed): the default tiles use
    wgmma and spill no registers, but for a few bytes in dK / dV (ptxas -v)."""
    # dK / dV at 64 rows x 128 keys, 3 stages, holds two 128 x 128 f32 accumulators and spills a
    # few bytes; it still outruns the spill-free 32-row tiles (`default_config`).
    spill_limit = {"_flash_fwd_kernel": 0, "_flash_bwd_dq_kernel": 0, "_flash_bwd_dkdv_kernel": 64}
    results = compile_for_sm90(_sm90_jobs())
    assert [r["name"] for r in results] == list(spill_limit)
    for r in results:
        assert r["count"]["wgmma.mma_async"] > 0, f"{r['name']}: no wgmma"
        assert r["spill_stores"] <= spill_limit[r["name"]], r


# GPU: realistic shapes, bf16 kernel vs the reference on float32-upcast inputs.

GPU_CASES = {
    "causal-B2-S2K": (dict(b=2, t=2048, s=2048, kh=8, g=4), dict()),
    "window4K-sink64-S4K": (dict(b=1, t=4096, s=4096, kh=8, g=4),
                            dict(window=1024, sinks=64)),
    "chunk-offsets-lengths": (dict(b=2, t=1024, s=4096, kh=8, g=4),
                              dict(q_offset=np.array([3072, 1500], np.int32),
                                   kv_lengths=np.array([4096, 2300], np.int32))),
    "per-head-window": (dict(b=1, t=2048, s=2048, kh=8, g=4),
                        dict(window=np.array([256, 0, 1000, 64, 0, 2048, 128, 1], np.int32),
                             sinks=np.array([128, 0, 4, 0, 0, 1, 200, 16], np.int32))),
    "noncausal-S1K": (dict(b=1, t=1024, s=1536, kh=8, g=4), dict(causal=False)),
    "G1-H64": (dict(b=1, t=2048, s=2048, kh=8, g=1, h=64, hv=64), dict()),
    "G5-odd-lengths": (dict(b=2, t=1000, s=1999, kh=4, g=5), dict(q_offset=999)),
    "G16-H96": (dict(b=1, t=1024, s=1024, kh=2, g=16, h=96, hv=96), dict()),
}


def _gpu_check(shape, options, config=None):
    shape = dict(h=128, hv=128) | shape
    q, k, v = _qkv(rng(), dtype=jnp.bfloat16, **shape)
    kp, vp = _poison_tail(k, v, options.get("kv_lengths"))
    run = jax.jit(lambda q, k, v: kernel.attention(q, k, v, config=config, **options))
    out, lse = run(q, kp, vp)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    exp_out, exp_lse = attention(*f32, implementation="xla", **options)
    assert_close(out, exp_out, dtype=jnp.bfloat16, err_msg="out")
    assert_close(lse, exp_lse, atol=1e-2, rtol=1e-3, allow_neg_inf=True, err_msg="lse")
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - exp_out) / jnp.linalg.norm(exp_out))
    assert err < 1e-2, f"relative error {err:.2e}"
    return run, (q, kp, vp), out, lse


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_matches_reference(name):
    _gpu_check(*GPU_CASES[name])


@pytest.mark.gpu
@pytest.mark.parametrize("h", [64, 128, 256])
def test_gpu_float32_forward_and_backward(h):
    """float32 inputs through `attention(implementation="auto")` (the Triton kernels at their
    float32 tiles: 2 forward stages at H64, the wide-rows tiles at H128, with 64 query rows at
    H256): out and every gradient close to the XLA reference's."""
    q, k, v = _qkv(rng(), b=1, t=1000, s=1000, kh=4, g=4, h=h, hv=h, dtype=jnp.float32)
    d_out = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)

    def loss(impl):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(
            attention(q, k, v, implementation=impl, window=300, sinks=8)[0] * d_out),
            argnums=(0, 1, 2)))

    (got, grads), (exp, exp_grads) = loss("auto")(q, k, v), loss("xla")(q, k, v)
    np.testing.assert_allclose(got, exp, rtol=1e-4)
    for name, g, e in zip("qkv", grads, exp_grads, strict=True):
        err = float(jnp.linalg.norm(g - e) / jnp.linalg.norm(e))
        assert err < 1e-4, f"d{name}: relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["128-64-8-3", "128-64-8-2", "128-64-8-4", "128-128-8-2",
                                 "128-128-8-3", "128-32-8-4", "64-64-4-3", "256-64-16-2",
                                 "128-64-4-3"])
def test_gpu_sweep_configs_are_correct(cfg):
    bm, bn, warps, stages = (int(x) for x in cfg.split("-"))
    config = kernel.Config(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
    _gpu_check(dict(b=1, t=1536, s=2048, kh=8, g=4),
               dict(q_offset=512, window=700, sinks=100), config)


@pytest.mark.gpu
def test_gpu_deterministic_batch_rows_and_auto():
    run, (q, k, v), out, lse = _gpu_check(*GPU_CASES["chunk-offsets-lengths"])
    again, lse_again = run(q, k, v)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse_again), np.asarray(lse))
    opts = GPU_CASES["chunk-offsets-lengths"][1]
    one, _ = kernel.attention(q[1:], k[1:], v[1:], q_offset=opts["q_offset"][1:],
                              kv_lengths=opts["kv_lengths"][1:])
    np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(out[1]))
    auto, _ = attention(q, k, v, implementation="auto", **opts)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(out))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal-B2-S2K", "chunk-offsets-lengths", "per-head-window",
                                  "G5-odd-lengths"])
def test_gpu_gradients_match_reference(name):
    """bf16 dQ, dK, dV (loss on out and lse) within 2e-2 relative norm of the float32 reference."""
    shape, opts = GPU_CASES[name]
    gen = rng()
    q, k, v = _qkv(gen, dtype=jnp.bfloat16, **(dict(h=128, hv=128) | shape))
    d_out = randn(gen, q.shape[:3] + (v.shape[-1],), jnp.bfloat16)
    d_lse = randn(gen, q.shape[:3])
    kp, vp = _poison_tail(k, v, opts.get("kv_lengths"))

    def loss(fn):
        def f(q, k, v):
            out, lse = fn(q, k, v)
            return (jnp.sum(out.astype(jnp.float32) * d_out)
                    + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse))
        return f

    got = jax.jit(jax.grad(loss(lambda *a: kernel.attention(*a, **opts)), (0, 1, 2)))(q, kp, vp)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    exp = jax.grad(loss(lambda *a: attention(*a, implementation="xla", **opts)), (0, 1, 2))(*f32)
    for name, a, e in zip("qkv", got, exp):
        a = a.astype(jnp.float32)
        assert np.isfinite(np.asarray(a)).all(), f"d{name} not finite"
        err = float(jnp.linalg.norm(a - e) / jnp.linalg.norm(e))
        assert err < 2e-2, f"d{name} relative error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", ["128-64-64-128-8-3", "128-64-32-128-8-3", "64-64-64-64-8-2",
                                 "64-32-32-64-4-2", "128-128-128-128-8-2"])
def test_gpu_backward_configs_are_correct(cfg):
    qm, qn, km, kn, warps, stages = (int(x) for x in cfg.split("-"))
    config = kernel.Config(dq_block_m=qm, dq_block_n=qn, dkv_block_m=km, dkv_block_n=kn,
                           bwd_num_warps=warps, bwd_num_stages=stages)
    gen = rng()
    q, k, v = _qkv(gen, b=1, t=1000, s=1536, kh=4, g=4, h=128, hv=128, dtype=jnp.bfloat16)
    d_out = randn(gen, q.shape, jnp.bfloat16)
    opts = dict(q_offset=536, window=700, sinks=100)

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v)[0].astype(jnp.float32) * d_out)

    got = jax.jit(jax.grad(loss(lambda *a: kernel.attention(*a, config=config, **opts)),
                           (0, 1, 2)))(q, k, v)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    exp = jax.grad(loss(lambda *a: attention(*a, implementation="xla", **opts)), (0, 1, 2))(*f32)
    for name, a, e in zip("qkv", got, exp):
        err = float(jnp.linalg.norm(a.astype(jnp.float32) - e) / jnp.linalg.norm(e))
        assert err < 2e-2, f"d{name} relative error {err:.2e}"
