"""The chunked GDN backward kernels (`attn/gdn/_chunk_bwd*.py`) against the XLA reference's VJP.

Every case differentiates `sum(o · dO) + sum(final · dS)` with random cotangents for both outputs
(or one of them zero) through `triton_chunk.gdn_chunked` (interpreted on CPU, compiled with `-m
gpu`) and through `reference.gdn_chunked` under `jax.grad`, for q, k, v, g, β and the initial
state: lengths around the 64-token chunk, several chunks with a tail, packed sequences with an
empty and a one-token one, GVA ratios 1, 2 and 3, l2-norm on and off, padded head dims. The
interpreter's outputs start as NaN, so a gradient element no program writes fails.

float32 inputs run the kernels' float32 path (3-pass TF32 dots): the gradients agree with the
reference's to 1e-6..5e-5 relative-norm error (two float32 chunked algorithms rounding
differently, more over more chunks; bound 1e-4, while a wrong sign, chunk, head or decay term
gives >= 1e-2). bf16 inputs round the intermediates and dot operands to bf16 as the forward does.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import gdn
from attn._op import device_facts
from attn.gdn import _chunk_config as cfg
from attn.gdn import reference as ref
from attn.gdn import triton_chunk as tc
from tests.utils import compile_for_sm90, rng

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
F32_TOL = 1e-4  # relative-norm error of float32 gradients against the reference's


def _problem(gen, *, b, t, nk, nv, h, hv, dtype=jnp.float32, init=True, n_state=None):
    """Random q/k/v, realistic gates (decay 0.4..0.99, beta 0.05..0.95), an initial state."""
    q, k = (jnp.asarray(gen.standard_normal((b, t, nk, h), np.float32), dtype) for _ in range(2))
    v = jnp.asarray(gen.standard_normal((b, t, nv, hv), np.float32), dtype)
    g = jnp.asarray(np.log(gen.uniform(0.4, 0.99, (b, t, nv))), jnp.float32)
    beta = jnp.asarray(gen.uniform(0.05, 0.95, (b, t, nv)), jnp.float32)
    h0 = None
    if init:
        h0 = jnp.asarray(0.5 * gen.standard_normal((n_state or b, nv, h, hv)), jnp.float32)
    return (q, k, v, g, beta), h0


def _cotangents(gen, v, n_state, h, cot):
    """dO `[B, T, Nv, Hv]` float32 and dS `[Ns, Nv, H, Hv]`; `cot` zeroes one of them."""
    do = gen.standard_normal(v.shape).astype(np.float32)
    ds = gen.standard_normal((n_state, v.shape[2], h, v.shape[3])).astype(np.float32)
    if cot == "output":
        ds[:] = 0
    elif cot == "state":
        do[:] = 0
    return jnp.asarray(do), jnp.asarray(ds)


def _grads(fn, xs, h0, do, ds, **kw):
    """`jax.grad` of `sum(o · dO) + sum(final · dS)` for q, k, v, g, β (and h0 when given)."""
    def loss(*a):
        o, final = fn(*a[:5], initial_state=a[5] if len(a) > 5 else None, **kw)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(final * ds)

    args = (*xs, h0) if h0 is not None else xs
    return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def _rel_norm(a, e) -> float:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def _check(got, exp, tol, err_msg="", overrides=None):
    """Every gradient within `tol` relative-norm error (`overrides`: per-name tolerances)."""
    assert len(got) == len(exp)
    for name, a, e in zip(NAMES, got, exp):
        a32 = np.asarray(jnp.asarray(a, jnp.float32))
        assert a.shape == e.shape and a.dtype == e.dtype, (name, a.shape, a.dtype, e.dtype)
        assert np.isfinite(a32).all(), f"{err_msg} {name}: non-finite gradient"
        e32 = np.asarray(jnp.asarray(e, jnp.float32))
        if not e32.any():  # e.g. dq with only the final state's cotangent
            assert not a32.any(), f"{err_msg} {name}: must be exactly 0"
            continue
        err, limit = _rel_norm(a32, e32), (overrides or {}).get(name, tol)
        assert err <= limit, f"{err_msg} {name}: relative error {err:.3g} > {limit}"


def _kernel(**kw):
    return lambda *a, **k: tc.gdn_chunked(*a, **k, **kw)


CASES = {  # (B, T, Nk, Nv, H, Hv, initial state, cotangents, l2-norm)
    "T1-gva2-state": (2, 1, 1, 2, 16, 16, True, "both", True),
    "T63-gva2-nostate": (1, 63, 1, 2, 16, 32, False, "both", True),
    "T64-gva1-state-outonly": (2, 64, 2, 2, 16, 16, True, "output", True),
    "T65-gva3-state": (1, 65, 1, 3, 16, 16, True, "both", True),
    # Only the final state's cotangent: gates near 1, or d(initial state) would be the product of
    # 200 decays (~1e-26), rounding noise in both implementations.
    "T200-gva2-state-stateonly": (1, 200, 2, 4, 32, 16, True, "state", True),
    "T130-raw-padded": (1, 130, 1, 2, 24, 20, True, "both", False),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_float32_gradients_match_reference(case):
    b, t, nk, nv, h, hv, init, cot, l2 = case
    gen = rng()
    xs, h0 = _problem(gen, b=b, t=t, nk=nk, nv=nv, h=h, hv=hv, init=init)
    if cot == "state":
        xs = (*xs[:3], jnp.asarray(np.log(gen.uniform(0.97, 0.999, xs[3].shape)), jnp.float32),
              xs[4])
    if not l2:  # keys of about unit norm, as the l2-norm would make them (a stable recurrence)
        xs = (xs[0], xs[1] * h**-0.5, *xs[2:])
    do, ds = _cotangents(gen, xs[2], b, h, cot)
    kw = dict(use_qk_l2norm=l2, scale=None if l2 else 0.3)
    got = _grads(_kernel(), xs, h0, do, ds, **kw)
    exp = _grads(ref.gdn_chunked, xs, h0, do, ds, **kw)
    _check(got, exp, F32_TOL)


def test_varlen_gradients_per_sequence():
    """Packed sequences of 1, 70, 0, 64 and 65 tokens with their own initial states (GVA 1 -> 2):
    the gradients equal the reference's on the packed row, an empty sequence passes its final
    state's cotangent to its initial state unchanged, and each sequence's gradients equal those
    of the kernel run on that sequence alone (nothing crosses a boundary)."""
    gen = rng()
    lens = [1, 70, 0, 64, 65]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    xs, h0 = _problem(gen, b=1, t=int(cu[-1]), nk=1, nv=2, h=16, hv=16, n_state=len(lens))
    do, ds = _cotangents(gen, xs[2], len(lens), 16, "both")
    kw = dict(use_qk_l2norm=True, cu_seqlens=jnp.asarray(cu))
    got = _grads(_kernel(), xs, h0, do, ds, **kw)
    _check(got, _grads(ref.gdn_chunked, xs, h0, do, ds, **kw), F32_TOL)
    np.testing.assert_array_equal(np.asarray(got[5][2]), np.asarray(ds[2]))
    for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
        if hi == lo:
            continue
        alone = _grads(_kernel(use_qk_l2norm=True), [x[:, lo:hi] for x in xs], h0[i:i + 1],
                       do[:, lo:hi], ds[i:i + 1])
        packed = [x[:, lo:hi] for x in got[:5]] + [got[5][i:i + 1]]
        _check(packed, alone, 1e-6, f"sequence {i}")


def test_bf16_gradients_and_public_op():
    """bf16 q/k/v through `gdn.gdn_chunked(implementation="triton")` under jit, GVA 1 -> 2, T 130,
    and `gdn_prefill_pool` with a NaN-poisoned null slot: gradients in the inputs' dtypes, within
    4e-2 relative-norm error of the float32 reference's on the same bf16 values (the interpreter's
    float32 -> bf16 casts truncate; the intermediates and dot operands are bf16, measured ~1e-2;
    dg, summed over a whole head of terms that cancel, within 6e-2: over random draws its median
    is 0.023 and its tail reaches 0.041); the pool's gradient reaches only the live rows' slots."""
    gen = rng()
    xs, h0 = _problem(gen, b=2, t=130, nk=1, nv=2, h=16, hv=16, dtype=jnp.bfloat16)
    do, ds = _cotangents(gen, xs[2], 2, 16, "both")
    op = lambda *a, **k: gdn.gdn_chunked(*a, **k, use_qk_l2norm=True, implementation="triton")
    got = _grads(op, xs, h0, do, ds)
    exp = _grads(ref.gdn_chunked, xs, h0, do, ds, use_qk_l2norm=True)
    _check(got, exp, 4e-2, overrides={"dg": 6e-2})

    slots = np.asarray([3, 0], np.int32)  # row 1 is padding: its tokens give 0, its slot is null
    pool = jnp.asarray(0.5 * gen.standard_normal((5, 2, 16, 16)), jnp.float32)
    pool = pool.at[0].set(jnp.nan)

    def loss(impl, q, k, v, pool):
        o, new_pool = gdn.gdn_prefill_pool(q, k, v, xs[3], xs[4], pool, jnp.asarray(slots),
                                           use_qk_l2norm=True, implementation=impl)
        return jnp.sum(o.astype(jnp.float32) * do) + jnp.sum(new_pool[1:] * 0.1)

    got = jax.jit(jax.grad(lambda *a: loss("triton", *a), argnums=(0, 1, 2, 3)))(*xs[:3], pool)
    clean = pool.at[0].set(0.0)
    exp = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1, 2, 3)))(*xs[:3], clean)
    for name, a, e in zip(("dq", "dk", "dv", "dpool"), got, exp):
        a, e = np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(e, jnp.float32))
        live = slice(None) if name != "dpool" else slice(1, None)
        assert np.isfinite(a[live]).all(), name
        assert _rel_norm(a[live], e[live]) <= 4e-2, name


def test_saving_forward_is_bitwise_the_forward():
    """The forward under differentiation (`state_save_kernel`) gives the plain forward's output
    and final states bit for bit (bf16, packed sequences, GVA 2 -> 4, two value slices), and its
    saved chunk states: the initial state at each sequence's first chunk, the state after chunk
    c at chunk c + 1."""
    gen = rng()
    lens = [70, 0, 64, 1]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    xs, h0 = _problem(gen, b=1, t=135, nk=2, nv=4, h=16, hv=32, dtype=jnp.bfloat16,
                      n_state=len(lens))
    config = dataclasses.replace(tc.default_config(4, 4, 32, nk=2), block_hv_state=16)
    kw = dict(scale=None, use_qk_l2norm=True, config=config)
    o, final = tc._forward(*xs, h0, cu, **kw)
    (o2, final2), saved = tc._forward_saving(*xs, h0, cu, **kw)
    for a, e in ((o2, o), (final2, final)):  # bf16 -> float32 is exact: equal means bitwise
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(e.astype(jnp.float32)))
    # Stored in bf16: within one bf16 unit (2^-7 relative; the interpreter's casts truncate).
    hs = np.asarray(saved["hs"].astype(jnp.float32))
    bf16_unit = dict(rtol=2.0**-7, atol=0)
    np.testing.assert_allclose(hs[0], np.asarray(h0[0]), **bf16_unit)
    np.testing.assert_allclose(hs[2], np.asarray(h0[2]), **bf16_unit)
    # Chunk slots 0, 1 are sequence 0's (70 tokens), 2 sequence 2's, 3 sequence 3's.
    one = tc._forward(*[x[:, :64] for x in xs], h0[:1], None, **kw)[1]
    np.testing.assert_allclose(hs[1], np.asarray(one[0]), **bf16_unit)
    assert np.abs(hs[1] - hs[0]).max() > 0.1  # the chunk moved the state


def test_backward_config_validation():
    for name in ("dqk_warps", "wy_warps", "dk_warps"):
        with pytest.raises(ValueError, match=f"{name}=3"):
            tc.Config(**{name: 3})
    with pytest.raises(ValueError, match="dqk_block_v=24"):
        tc.Config(dqk_block_v=24)


MODEL = dict(nk=16, nv=32, h=128, hv=128)


def _sm90_bwd_jobs(config, t_row):
    """The backward's kernels as `config` launches them at the model's heads, bf16, l2-norm."""
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    n_tok = 32768
    common = dict(F32=False, NK=16, NV=32, H=128, HV=128, BLOCK_H=128, BT=tc.CHUNK)
    state = dict(common, SCALE=128 ** -0.5, BLOCK_HV=config.block_hv_state, QN=True,
                 Q_OFF=n_tok * 16 * 128, **cfg.state_constexprs(config, t_row))
    launch = cfg.bwd_state_launch(config)
    return [
        dict(kernel="attn.gdn._chunk_bwd_state:state_save_kernel",
             pointers=dict(k_ptr=bf, w_ptr=bf, u_ptr=bf, gcum_ptr=f32, cstart_ptr=i32,
                           clen_ptr=i32, sfirst_ptr=i32, scount_ptr=i32, h0_ptr=f32, q_ptr=bf,
                           p_ptr=bf, final_ptr=f32, o_ptr=bf, hs_ptr=bf, vn_ptr=bf),
             constexprs=dict(state, HAS_INIT=True), **launch),
        dict(kernel="attn.gdn._chunk_bwd_state:dstate_kernel",
             pointers=dict(k_ptr=bf, w_ptr=bf, gcum_ptr=f32, cstart_ptr=i32, clen_ptr=i32,
                           sfirst_ptr=i32, scount_ptr=i32, q_ptr=bf, p_ptr=bf, do_ptr=bf,
                           dfinal_ptr=f32, dh_ptr=bf, dvn_ptr=bf, dh0_ptr=f32),
             constexprs=state, **launch),
        dict(kernel="attn.gdn._chunk_bwd_intra:dqk_kernel",
             pointers=dict(q_ptr=bf, k_ptr=bf, gcum_ptr=f32, cstart_ptr=i32, clen_ptr=i32,
                           hs_ptr=bf, dh_ptr=bf, vn_ptr=bf, dvn_ptr=bf, do_ptr=bf, p_ptr=bf,
                           o_ptr=bf, dq_ptr=bf, dk1_ptr=f32, dw_ptr=bf, dg1_ptr=f32),
             constexprs=dict(common, SCALE=128 ** -0.5, EPS=1e-6, L2NORM=True, BLOCK_HV=128,
                             BV=config.dqk_block_v, HEAD_MAJOR=config.intra_head_major),
             num_warps=config.dqk_warps, num_stages=config.dqk_stages),
        dict(kernel="attn.gdn._chunk_bwd_intra:wy_kernel",
             pointers=dict(kn_ptr=bf, v_ptr=bf, gcum_ptr=f32, beta_ptr=f32, cstart_ptr=i32,
                           clen_ptr=i32, dw_ptr=bf, dvn_ptr=bf, dg1_ptr=f32, dv_ptr=bf,
                           dbeta_ptr=f32, dg_ptr=f32, tb_ptr=bf, dkk_ptr=bf),
             constexprs=dict(common, BLOCK_HV=128, SUB=cfg.SUB,
                             HEAD_MAJOR=config.intra_head_major),
             num_warps=config.wy_warps, num_stages=1),
        dict(kernel="attn.gdn._chunk_bwd_intra:dk_kernel",
             pointers=dict(k_ptr=bf, kn_ptr=bf, cstart_ptr=i32, clen_ptr=i32, dw_ptr=bf,
                           tb_ptr=bf, dkk_ptr=bf, dk1_ptr=f32, dk_ptr=bf),
             constexprs={**{n: v for n, v in common.items() if n != "HV"}, "EPS": 1e-6,
                         "L2NORM": True, "HEAD_MAJOR": config.intra_head_major},
             num_warps=config.dk_warps, num_stages=1),
    ]


# Spill stores (bytes) the backward's defaults may have on sm_90a: the fastest measured launches
# of dqk_kernel (8 warps, 64-wide value steps), wy_kernel (4 warps) and the state passes at
# 64-wide slices spill a little (measured 28, 280, 64 and 128 bytes); heavy spilling (the
# per-key-head wy accumulator's 800+) fails.
SPILL_BOUND = 384


def test_backward_kernels_compile_for_sm90():
    """Triton's compiler (sm_90a, bundled ptxas, no GPU) on the backward's kernels as the B1 T32K
    and B8 T4K defaults launch them, bf16 at the model's heads: spills within `SPILL_BOUND`, and
    the sequential kernels' shared memory within `state_smem`'s estimate."""
    configs = [tc.default_config(b, MODEL["nv"], MODEL["hv"], nk=MODEL["nk"]) for b in (1, 8)]
    jobs = _sm90_bwd_jobs(configs[0], 32768) + _sm90_bwd_jobs(configs[1], 4096)[:2]
    results = compile_for_sm90(jobs)
    for r in results:
        assert r["spill_stores"] <= SPILL_BOUND, r
    for config, rs in ((configs[0], results[:2]), (configs[1], results[5:])):
        bound = cfg.state_smem(128, config.block_hv_state, 2, config.state_stages)
        for r in rs:
            assert r["shared"] <= bound <= device_facts().shared_memory, (config, r)


GPU_CASES = {
    "B2-T4K": dict(b=2, t=4096, cu=None),
    "varlen": dict(b=1, t=4096, cu=[0, 1, 1000, 1000, 3000, 4096]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES.values(), ids=GPU_CASES.keys())
def test_compiled_gradients_at_model_dims(case):
    """Nk16, Nv32, H = Hv = 128, bf16 q/k/v, l2-norm, initial states, both cotangents (B2 T4K,
    or 5 packed sequences, one empty, one of 1 token): every gradient within 2e-2 relative-norm
    error of the float32 reference's (bf16 intermediates and dot operands), finite."""
    gen = rng()
    cu = case["cu"]
    n_state = case["b"] if cu is None else len(cu) - 1
    xs, h0 = _problem(gen, b=case["b"], t=case["t"], **MODEL, dtype=jnp.bfloat16,
                      n_state=n_state)
    do, ds = _cotangents(gen, xs[2], n_state, MODEL["h"], "both")
    kw = dict(use_qk_l2norm=True, cu_seqlens=None if cu is None else jnp.asarray(cu, jnp.int32))
    got = _grads(_kernel(), xs, h0, do, ds, **kw)
    _check(got, _grads(ref.gdn_chunked, xs, h0, do, ds, **kw), 2e-2)
    for a, b in zip(got, _grads(_kernel(), xs, h0, do, ds, **kw)):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))


@pytest.mark.gpu
def test_compiled_bf16_head_dim_256_gradients():
    """bf16 at H = Hv = 256 (the state loop in one stage: two do not fit in shared memory),
    B1 T1000, GVA 2: every gradient within 2e-2 of the reference's on the same inputs."""
    gen = rng()
    xs, h0 = _problem(gen, b=1, t=1000, nk=2, nv=4, h=256, hv=256, dtype=jnp.bfloat16)
    do, ds = _cotangents(gen, xs[2], 1, 256, "both")
    kw = dict(use_qk_l2norm=True)
    _check(_grads(_kernel(), xs, h0, do, ds, **kw),
           _grads(ref.gdn_chunked, xs, h0, do, ds, **kw), 2e-2)


@pytest.mark.gpu
def test_compiled_float32_gradients():
    """float32 inputs at model heads (the 3-pass TF32 path), B1 T1000, GVA 2."""
    gen = rng()
    xs, h0 = _problem(gen, b=1, t=1000, nk=2, nv=4, h=128, hv=128)
    do, ds = _cotangents(gen, xs[2], 1, 128, "both")
    kw = dict(use_qk_l2norm=True)
    _check(_grads(_kernel(), xs, h0, do, ds, **kw),
           _grads(ref.gdn_chunked, xs, h0, do, ds, **kw), 1e-4)
