"""The Triton causal conv1d backward (`attn/conv1d/_triton_bwd.py`) against `jax.grad` of the
reference: interpreted on CPU, compiled on GPU.

Every case draws fresh random inputs and cotangents for both outputs (y and the final state), so
dx carries the final state's term and dstate the one of sequences shorter than W - 1. Blocks of
4 tokens and programs of 8 (or 4) make several programs and steps per sequence, steps on the
masked and the select-free path, and the halo rows each program reads from the next one.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import conv1d
from attn.conv1d import _triton_bwd as bwd
from attn.conv1d import reference as ref
from attn.conv1d import triton_prefill as prefill_kernel
from tests.utils import assert_close, case_id, compile_for_sm90, rng

# Empty, shorter than W - 1, block-crossing, chunk-crossing; 38 tokens in all.
LENS = [2, 0, 1, 3, 0, 10, 9, 13]
SMALL = bwd.Config(block_t=4, chunk_t=8, block_c=32)


def _problem(gen, *, b, t, c, w, dtype, state, bias, lens=None):
    """Inputs and cotangents; `lens` packs sequences in one row (`b`, `t` ignored)."""
    cu = None
    if lens is not None:
        cu_np = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        b, t, cu = 1, int(cu_np[-1]), jnp.asarray(cu_np)
    ns = b if lens is None else len(lens)

    key = jax.random.key(int(gen.integers(2**31)))  # drawn on the device: T32K x C8192 is fast

    def draw(shape, scale=1.0):
        nonlocal key
        key, sub = jax.random.split(key)
        return (jax.random.normal(sub, shape, jnp.float32) * scale).astype(dtype)

    args = dict(x=draw((b, t, c)), weight=draw((c, w), 0.5), bias=draw((c,)) if bias else None,
                h0=draw((ns, c, w - 1)) if state else None, cu=cu)
    return args, (draw((b, t, c)), draw((ns, c, w - 1)))


def _grads(conv, args, cots, act):
    """`jax.grad` of `<y, dy> + <final, dfinal>` w.r.t. x, weight, bias, h0 (None stays None)."""
    dy, dfinal = cots

    def loss(x, weight, bias, h0):
        y, final = conv(x, weight, bias, initial_state=h0, activation=act,
                        cu_seqlens=args["cu"])
        return (jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
                + jnp.sum(final.astype(jnp.float32) * dfinal.astype(jnp.float32)))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(
        args["x"], args["weight"], args["bias"], args["h0"])


def _ours(config):
    return functools.partial(prefill_kernel.causal_conv1d, bwd_config=config)


def _check(got, expected, dtype=None):
    for name, a, e in zip(("dx", "dweight", "dbias", "dstate"), got, expected, strict=True):
        if e is None:
            assert a is None, name
            continue
        assert a.shape == e.shape and a.dtype == e.dtype, (name, a.shape, a.dtype, e.dtype)
        assert_close(a, e, dtype=dtype, err_msg=name)


def _channels(args, cots, grads, channels):
    """`(args, cots, grads)` restricted to `channels` (an index array; None: all). Channels of a
    depthwise conv are independent, so the references on a subset are the full ones there."""
    if channels is None:
        return args, cots, grads
    dy, dfinal = cots
    dx, dweight, dbias, dstate = grads
    args = dict(args, x=args["x"][..., channels], weight=args["weight"][channels],
                bias=None if args["bias"] is None else args["bias"][channels],
                h0=None if args["h0"] is None else args["h0"][:, channels])
    grads = (dx[..., channels], dweight[channels], None if dbias is None else dbias[channels],
             None if dstate is None else dstate[:, channels])
    return args, (dy[..., channels], dfinal[:, channels]), grads


def _check_within_3x_reference_error(args, cots, config, dtype, reference=ref.causal_conv1d,
                                     channels=None):
    """Each gradient's error against the float32 gradient of the same (upcast) values is at most
    3x the error of `reference` run in `dtype`, plus one unit of `dtype`'s rounding at the
    gradient's scale; ours runs on every channel, the check covers `channels` (None: all). The
    references run on the host CPU: XLA's GPU compile of the float32 reference gradient at the
    model dims takes over a minute."""
    host = functools.partial(jax.device_put, device=jax.devices("cpu")[0])
    ours = jax.device_put(_grads(_ours(config), args, cots, "silu"), jax.devices("cpu")[0])
    for name, a in zip(("dx", "dweight", "dbias", "dstate"), ours, strict=True):
        assert bool(jnp.isfinite(a).all()), name  # every channel, compared or not
    args, cots, ours = _channels(host(args), host(cots), ours, channels)
    up = {k: v if v is None or k == "cu" else v.astype(jnp.float32) for k, v in args.items()}
    oracle = _grads(reference, up, tuple(c.astype(jnp.float32) for c in cots), "silu")
    theirs = _grads(reference, args, cots, "silu")
    eps = float(jnp.finfo(dtype).eps)
    for name, a, r, o in zip(("dx", "dweight", "dbias", "dstate"), ours, theirs, oracle,
                             strict=True):
        assert a.dtype == r.dtype == dtype, name
        a, r = a.astype(jnp.float32), r.astype(jnp.float32)
        err, ref_err = float(jnp.abs(a - o).max()), float(jnp.abs(r - o).max())
        assert err <= 3 * ref_err + eps * float(jnp.abs(o).max()), (name, err, ref_err)


# W3 and bias-only are slow (W2 and W4 bracket the tap loop; bias-silu and plain take both
# branches of the activation and the bias).
@pytest.mark.parametrize("w", [2, pytest.param(3, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T13", "varlen"])
@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("bias,act", [(True, "silu"), (False, None),
                                      pytest.param(True, None, marks=pytest.mark.slow)],
                         ids=["bias-silu", "plain", "bias"])
def test_gradients_match_reference_f32(w, varlen, state, bias, act):
    """float32, C = 24 (a masked channel tile), odd lengths: every cotangent within float32
    tolerance of the reference's."""
    args, cots = _problem(rng(), b=2, t=13, c=24, w=w, dtype=jnp.float32, state=state,
                          bias=bias, lens=LENS if varlen else None)
    _check(_grads(_ours(SMALL), args, cots, act), _grads(ref.causal_conv1d, args, cots, act))


@pytest.mark.parametrize("cfg", [dict(block_t=2, chunk_t=2, block_c=16),
                                 dict(block_t=8, chunk_t=16, block_c=64, prefetch=False),
                                 dict(block_t=1, chunk_t=4, block_c=32)],
                         ids=lambda c: case_id(T=c["block_t"], K=c["chunk_t"], C=c["block_c"]))
def test_block_shapes(cfg):
    """Steps shorter than the W - 1 halo (one program per 2 tokens or per token), steps longer
    than whole sequences, no prefetch; W4, varlen, state, bias, SiLU, float32."""
    args, cots = _problem(rng(), b=1, t=1, c=24, w=4, dtype=jnp.float32, state=True, bias=True,
                          lens=LENS)
    _check(_grads(_ours(bwd.Config(**cfg)), args, cots, "silu"),
           _grads(ref.causal_conv1d, args, cots, "silu"))


@pytest.mark.parametrize("t", [1, 2, 5])
def test_sequences_shorter_than_the_kernel(t):
    """B3 rows of 1, 2 and 5 tokens (W4: the final state keeps part of the initial one)."""
    args, cots = _problem(rng(), b=3, t=t, c=16, w=4, dtype=jnp.float32, state=True,
                          bias=True)
    _check(_grads(_ours(SMALL), args, cots, "silu"),
           _grads(ref.causal_conv1d, args, cots, "silu"))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
def test_half_precision_within_three_times_the_references_error(dtype):
    """Half-precision inputs and cotangents, varlen, state, bias, SiLU: within 3x the error of
    the reference run in that dtype."""
    args, cots = _problem(rng(), b=1, t=1, c=40, w=4, dtype=dtype, state=True, bias=True,
                          lens=LENS + [17])
    _check_within_3x_reference_error(args, cots, bwd.Config(block_t=4, chunk_t=8, block_c=64),
                                     dtype)


def test_nan_before_a_sequence_start_stays_out():
    """NaN in the last token of every sequence: dx is NaN exactly where the reference's is (the
    NaN token and the W - 1 before it in its own sequence), never in the next sequence; dstate
    finite for sequences that hold no NaN."""
    gen = rng()
    lens = [5, 7, 6]
    args, cots = _problem(gen, b=1, t=1, c=16, w=4, dtype=jnp.float32, state=True, bias=False,
                          lens=lens)
    ends = np.cumsum(lens)[:-1] - 1
    args["x"] = args["x"].at[0, ends].set(jnp.nan)
    got = _grads(_ours(SMALL), args, cots, "silu")
    exp = _grads(ref.causal_conv1d, args, cots, "silu")
    dx, dx_ref = np.asarray(got[0]), np.asarray(exp[0])
    np.testing.assert_array_equal(np.isnan(dx), np.isnan(dx_ref))
    starts = np.cumsum(lens)[:-1]
    assert np.isfinite(dx[0, starts]).all() and np.isnan(dx[0, ends]).all()
    assert_close(dx[~np.isnan(dx_ref)], dx_ref[~np.isnan(dx_ref)])
    assert np.isfinite(np.asarray(got[3])).all()
    assert_close(got[3], exp[3])


def test_run_to_run_identical():
    """Two calls give bitwise equal gradients (the weight sums are reduced without atomics)."""
    args, cots = _problem(rng(), b=1, t=1, c=32, w=4, dtype=jnp.float32, state=True, bias=True,
                          lens=LENS)
    a = _grads(_ours(SMALL), args, cots, "silu")
    b = _grads(_ours(SMALL), args, cots, "silu")
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_public_api_and_pool_gradients_under_jit():
    """`jax.grad` through `conv1d.causal_conv1d` and `conv1d.causal_conv1d_prefill_pool` with
    implementation="triton" equals implementation="xla": the pool's gradient (state read from
    slots, final state scattered back) included."""
    gen = rng()
    args, cots = _problem(gen, b=4, t=7, c=32, w=4, dtype=jnp.float32, state=True, bias=True)

    def api(impl):
        return functools.partial(conv1d.causal_conv1d, implementation=impl)

    _check(_grads(api("triton"), args, cots, "silu"), _grads(api("xla"), args, cots, "silu"))

    slots = 9
    slot_ids = jnp.asarray([5, 0, 2, 7], jnp.int32)
    init = jnp.asarray([True, True, False, True])
    pool = jnp.asarray(gen.standard_normal((slots, 32, 3), np.float32))
    dy, dpool = cots[0], jnp.asarray(gen.standard_normal((slots, 32, 3), np.float32))

    def pool_grads(impl):
        def loss(x, weight, bias, pool):
            y, new_pool = conv1d.causal_conv1d_prefill_pool(
                x, pool, slot_ids, weight, bias, activation="silu", has_initial_state=init,
                implementation=impl)
            return jnp.sum(y * dy) + jnp.sum(new_pool * dpool)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(args["x"], args["weight"],
                                                             args["bias"], pool)

    for a, e in zip(pool_grads("triton"), pool_grads("xla"), strict=True):
        assert_close(a, e)


def test_config_validation():
    with pytest.raises(ValueError, match="block_t"):
        bwd.Config(block_t=6)
    with pytest.raises(ValueError, match="chunk_t"):
        bwd.Config(block_t=8, chunk_t=12)
    with pytest.raises(ValueError, match="block_c"):
        bwd.Config(block_c=8)
    with pytest.raises(ValueError, match="num_warps"):
        bwd.Config(num_warps=3)


@pytest.mark.slow
def test_compiles_for_sm90_without_spills():
    """The default config compiled for Hopper on any machine (T32K C8192 W4 bf16 SiLU, state;
    one row and packed): no spills (ptxas -v), the fast SiLU derivative emits
    `tanh.approx.f32`."""
    cfg = bwd.Config()
    types = dict(x_ptr="*bf16", dy_ptr="*bf16", w_ptr="*bf16", bias_ptr="*fp32",
                 cu_ptr="*i32", state_ptr="*bf16", dx_ptr="*bf16", part_ptr="*fp32")
    jobs = [dict(kernel="attn.conv1d._triton_bwd:_conv_bwd_kernel", pointers=types,
                 constexprs=dict(N_TOK=32768, T_ROW=32768, C=8192, W=4, HAS_BIAS=False,
                                 HAS_STATE=True, VARLEN=ns > 1, NS=ns, LOG_NS=ns.bit_length(),
                                 LOG_NS1=(ns + 1).bit_length(), SILU=True,
                                 BLOCK_T=cfg.block_t, STEPS=cfg.chunk_t // cfg.block_t,
                                 BLOCK_C=cfg.block_c, PREFETCH=cfg.prefetch, FAST_SILU=True,
                                 HW_TANH=True, NC=8192 // cfg.block_c),
                 num_warps=cfg.num_warps, num_stages=2, count=["tanh.approx.f32"])
            for ns in (1, 4)]
    for r in compile_for_sm90(jobs):
        assert r["spill_stores"] == 0 and r["count"]["tanh.approx.f32"] > 0, r


@pytest.mark.slow
def test_bench_rows_quick_on_cpu(tmp_path):
    """`python -m experiments.bench gdn --rows causal_conv1d_bwd --quick`: the backward and the
    forward + backward rows, gradients close to the XLA reference's, ratios derived."""
    from experiments.bench import cli

    rows = cli.main(["gdn", "--rows", "causal_conv1d_bwd", "--quick", "--out", str(tmp_path)])
    assert [r["kernel"] for r in rows] == ["causal_conv1d_bwd", "causal_conv1d_fwd_bwd"]
    for r in rows:
        assert r["rel_err_dx_vs_xla"] < 2e-2 and r["rel_err_dstate_vs_xla"] < 2e-2, r
        assert r["rel_err_dweight_vs_xla"] < 2e-2 and r["anchor_ms"] > 0, r
        assert r["fraction_of_ceiling"] == pytest.approx(r["achieved"] / r["ceiling"], abs=1e-3)


def _split_reference(lens):
    """The reference with `cu_seqlens` as one call per sequence (static `lens`): the packed
    semantics from the one-row formulation, without the varlen reference's gathers."""
    cu = np.concatenate([[0], np.cumsum(lens)])

    def conv(x, weight, bias=None, *, initial_state, activation, cu_seqlens):
        del cu_seqlens
        outs = [ref.causal_conv1d(x[:, lo:hi], weight, bias,
                                  initial_state=initial_state[i : i + 1], activation=activation)
                for i, (lo, hi) in enumerate(itertools.pairwise(cu))]
        return (jnp.concatenate([y for y, _ in outs], axis=1),
                jnp.concatenate([f for _, f in outs], axis=0))
    return conv


def test_split_reference_is_the_varlen_reference():
    args, cots = _problem(rng(), b=1, t=1, c=16, w=4, dtype=jnp.float32, state=True, bias=True,
                          lens=[3, 1, 9])
    _check(_grads(_split_reference([3, 1, 9]), args, cots, "silu"),
           _grads(ref.causal_conv1d, args, cots, "silu"))


@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T13", "varlen"])
def test_reference_on_a_channel_subset_is_the_full_one_there(varlen):
    """What `_check_within_3x_reference_error(channels=...)` relies on: the reference gradients
    of the inputs restricted to some channels are the full problem's gradients there."""
    args, cots = _problem(rng(), b=2, t=13, c=40, w=4, dtype=jnp.float32, state=True,
                          bias=True, lens=LENS if varlen else None)
    channels = np.r_[0:3, 17:21, 39:40]
    full = _grads(ref.causal_conv1d, args, cots, "silu")
    args, cots, expected = _channels(args, cots, full, channels)
    _check(_grads(ref.causal_conv1d, args, cots, "silu"), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["B1-T32K", "varlen"])
def test_compiled_on_gpu_at_model_dims(varlen):
    """T32K, C = 8192, W4, bf16, SiLU, initial state, bias; varlen: four packed sequences (one
    shorter than W - 1, against the reference run per sequence): within 3x the error of the bf16
    XLA reference (the default config, the tanh SiLU derivative) on the first, a middle (across
    a 512-channel block edge) and the last 256 channels, as the host references on all 8192
    take minutes."""
    c = 8192
    lens = [2, 998, 19000, 12768] if varlen else None
    args, cots = _problem(rng(), b=1, t=32768, c=c, w=4, dtype=jnp.bfloat16, state=True,
                          bias=True, lens=lens)
    channels = np.r_[0:256, 3968:4224, c - 256:c]
    _check_within_3x_reference_error(args, cots, None, jnp.bfloat16,
                                     _split_reference(lens) if varlen else ref.causal_conv1d,
                                     channels=channels)
