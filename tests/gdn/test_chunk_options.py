"""The session-5 `triton_chunk.Config` options (interpreted on CPU): `state_prefetch`,
`state_slice_major`, `intra_head_major`, `qk_in_state`, `store_qn`.

Each rearranges the same arithmetic (loads issued earlier, programs launched in another order, P
or the normalised queries computed in another kernel from the same values), so on top of the
per-shape defaults the outputs must be bitwise those of the defaults in the interpreter; on top
of PLAIN (the session-3 kernels) each must also keep PLAIN's accuracy against the float64
recurrence (float32 within 1e-5; bf16 varlen with states, the PLAIN-relative bound of
`tests/attn/test_gdn_triton.py`).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.gdn import triton_chunk as tc
from tests.attn.test_gdn_triton import (
    PLAIN,
    _check_at_model_dims,
    _chunk_problem,
    _recurrent64,
    check_option_bf16_varlen_with_states,
    slow_if_inside_another,
)
from tests.utils import assert_close, case_id, rng

FUSED = dict(fuse_output=True)
OPTIONS = [
    dict(state_prefetch=True),
    dict(state_slice_major=True, block_hv_state=16),  # two value slices per head
    dict(intra_head_major=True),
    dict(FUSED, qk_in_state=True),
    dict(FUSED, store_kn=True, store_qn=True),
    dict(FUSED, store_kn=True, qk_in_state=True, store_qn=True, state_slice_major=True,
         intra_head_major=True, block_hv_state=16),
    dict(state_prefetch=True, state_slice_major=True, block_hv_state=16),  # unfused
    dict(state_gates_ahead=True),
    dict(fuse_output=False, state_gates_ahead=True),
    dict(state_u_ahead=True),
    dict(state_u_ahead=True, state_gates_ahead=True),
    dict(fuse_output=False, state_u_ahead=True),
]
IDS = [case_id(**o) for o in OPTIONS]
LENS = [1, 70, 0, 64]  # one token, a chunk and a tail, an empty sequence, one full chunk


def _varlen_problem(dtype, *, nk=1, nv=2):
    gen = rng()
    cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    xs, h0 = _chunk_problem(gen, b=1, t=int(cu[-1]), nk=nk, nv=nv, h=16, hv=32, dtype=dtype,
                            n_state=len(LENS))
    return xs, h0, cu


def _run(xs, h0, config, cu=None):
    return tc.gdn_chunked(*xs, initial_state=h0, use_qk_l2norm=True, config=config,
                          cu_seqlens=None if cu is None else jnp.asarray(cu))


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _bitwise_configs(opts):
    """(baseline, baseline with `opts`) on top of `default_config` for the bitwise test."""
    base = tc.default_config(2, 4, 32)
    extra = {k: v for k, v in opts.items() if k not in ("store_kn", "fuse_output")}
    if "block_hv_state" in extra:  # the baseline on the same slices
        base = dataclasses.replace(base, block_hv_state=extra.pop("block_hv_state"))
    if not opts.get("fuse_output", True):  # without the options that need the fused output
        base = dataclasses.replace(base, fuse_output=False, store_qn=False, qk_in_state=False)
    return base, dataclasses.replace(base, **extra)


# Row-layout singletons that also run, bitwise, inside a combination of OPTIONS in the same layout
# (prefetch + slice-major, the qk_in_state / store_qn / majors one, u-ahead + gates-ahead); each
# keeps its varlen case here and its float32 row-layout case against float64 below.
ROWS_IN_A_COMBINATION = [dict(state_prefetch=True), dict(FUSED, qk_in_state=True),
                         dict(state_gates_ahead=True), dict(state_u_ahead=True)]


def _bitwise_cases():
    """OPTIONS x {B2-T130, varlen}. Slow (CPU CI time, ~14 s each): options `default_config`
    already sets (majors, store_qn: the defaults against themselves, a determinism check only)
    and ROWS_IN_A_COMBINATION in the row layout."""
    cases = []
    for varlen, layout in ((False, "B2-T130"), (True, "varlen")):
        for opts, name in zip(OPTIONS, IDS, strict=True):
            base, config = _bitwise_configs(opts)
            slow = config == base or (not varlen and opts in ROWS_IN_A_COMBINATION)
            cases.append(pytest.param(opts, varlen, id=f"{layout}-{name}",
                                      marks=[pytest.mark.slow] if slow else []))
    return cases


@pytest.mark.parametrize("opts,varlen", _bitwise_cases())
def test_option_is_bitwise_the_defaults(opts, varlen):
    """bf16, GVA 2 -> 4 value heads, with initial states, on top of `default_config` (fused,
    out_bf16, store_kn, ...): the same output and final state bit for bit, rows of B tokens
    (table-free chunk addressing) and packed sequences (chunk tables) alike. Outputs start as
    NaN in the interpreter, so an element a launch order or a prefetch skips fails."""
    if varlen:
        xs, h0, cu = _varlen_problem(jnp.bfloat16, nk=2, nv=4)
    else:
        xs, h0 = _chunk_problem(rng(), b=2, t=130, nk=2, nv=4, h=16, hv=32, dtype=jnp.bfloat16)
        cu = None
    base, config = _bitwise_configs(opts)
    o0, f0 = _run(xs, h0, base, cu)
    o, f = _run(xs, h0, config, cu)
    assert np.isfinite(np.asarray(o, np.float32)).all()
    np.testing.assert_array_equal(_bits(o), _bits(o0))
    np.testing.assert_array_equal(_bits(f), _bits(f0))


@pytest.mark.parametrize("opts", OPTIONS, ids=IDS)
def test_option_float32_matches_float64(opts):
    """float32 q/k/v on top of PLAIN: within 1e-5 of the float64 recurrence, as PLAIN is; B2
    with initial states, T = 130 (two full chunks and a 2-token tail)."""
    xs, h0 = _chunk_problem(rng(), b=2, t=130, nk=1, nv=2, h=16, hv=32)
    o, final = _run(xs, h0, dataclasses.replace(PLAIN, **opts))
    o64, final64 = _recurrent64(*xs, h0)
    assert_close(o, o64, atol=1e-5, rtol=1e-5)
    assert_close(final, final64, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("opts", slow_if_inside_another(OPTIONS, IDS))
def test_option_bf16_varlen_with_states(opts):
    """bf16 packed sequences of 1, 70, 0 and 64 tokens with their own initial states, on top of
    PLAIN: each sequence against the float64 recurrence by relative-norm error, <= 3e-2 and
    <= 2.5x PLAIN's own error + 2e-3 (the bounds and their reasoning:
    `test_chunked_speed_options_bf16_varlen_with_states`). `store_qn` rounds the normalised
    queries to bf16 where PLAIN's TF32 output dots kept them float32: one more rounding of one
    operand. An empty sequence keeps its state exactly."""
    check_option_bf16_varlen_with_states(opts)


def test_option_validation():
    for name in ("qk_in_state", "store_qn"):
        with pytest.raises(ValueError, match=name):
            tc.Config(**{name: True})
    # The head-major intra grid puts the chunks on the grid's y axis (<= 65535).
    n = 65536 * tc.CHUNK
    shapes = [jax.ShapeDtypeStruct((1, n, 1, 16), jnp.bfloat16)] * 2 + [
        jax.ShapeDtypeStruct((1, n, 1, 16), jnp.bfloat16),
        jax.ShapeDtypeStruct((1, n, 1), jnp.float32), jax.ShapeDtypeStruct((1, n, 1), jnp.float32)]

    def build(config):
        def fn(q, k, v, g, beta):
            tc.stages(q, k, v, g, beta, config=config)
            return g
        return jax.eval_shape(fn, *shapes)

    build(tc.Config())  # the default order takes it
    with pytest.raises(ValueError, match="65535"):
        build(tc.Config(intra_head_major=True))
    # The slice-major state grid puts the sequences on its z axis (<= 65535).
    small = [jax.ShapeDtypeStruct((1, 8, *x.shape[2:]), x.dtype) for x in shapes]
    cu = jax.ShapeDtypeStruct((65537,), jnp.int32)

    def build_varlen(config):
        def fn(q, k, v, g, beta, cu):
            tc.stages(q, k, v, g, beta, cu_seqlens=cu, config=config)
            return g
        return jax.eval_shape(fn, *small, cu)

    build_varlen(tc.Config())
    with pytest.raises(ValueError, match="65535"):
        build_varlen(tc.Config(state_slice_major=True))


def test_profile_counts_qk_and_qn_bytes():
    """`profile_gdn_chunk.cost` with qk_in_state and store_qn: its intra / state bytes equal the
    real tensors' sizes (no P anywhere with qk_in_state; the normalised queries after the keys
    in `kn` with store_qn), and the matmul FLOPs move Q Kᵀ into the state kernel, once per
    value slice."""
    from experiments import profile_gdn_chunk as prof

    b, t, heads = 2, 70, dict(nk=1, nv=2, h=16, hv=32)
    xs, h0 = _chunk_problem(rng(), b=b, t=t, **heads, dtype=jnp.bfloat16)
    for opts in (dict(qk_in_state=True), dict(store_qn=True),
                 dict(qk_in_state=True, store_qn=True, block_hv_state=16)):
        config = dataclasses.replace(PLAIN, fuse_output=True, store_kn=True, **opts)
        intra, state, output, x = tc.stages(*xs, h0, use_qk_l2norm=True, config=config)
        assert output is None
        tables = (x["cstart"], x["clen"])
        gcum, w, u, kn, p = intra(x["q2"], x["k2"], x["v2"], x["g2"], x["beta2"], *tables)
        qn = config.store_qn
        assert kn.shape == ((1 + qn) * b * t, 1, 16)
        assert p.shape == ((1,) if config.qk_in_state else (b * t, 2, tc.CHUNK))
        hbuf, v_new, final, o = state(kn, w, u, gcum, *tables, x["sfirst"], x["scount"],
                                      x["h0"], x["q2"], p)
        assert hbuf.shape == v_new.shape == (1,)  # fused: neither reaches HBM
        q_in = () if config.qk_in_state and not qn else (x["q2"],)
        p_io = () if config.qk_in_state else (p,)
        q_state = () if qn else (x["q2"],)  # else the queries come with the keys in kn
        nbytes = {"intra": (*q_in, x["k2"], x["v2"], x["g2"], x["beta2"], gcum, w, u, kn, *p_io),
                  "state": (kn, w, u, gcum, x["h0"], *q_state, *p_io, final, o)}
        counts = prof.cost(b, t, config=config, has_init=True, **heads)
        for name, arrays in nbytes.items():
            assert counts[name]["GB"] * 1e9 == pytest.approx(sum(a.nbytes for a in arrays)), (
                opts, name)
        tiles = 32 // min(config.block_hv_state, 32)
        qk_flops = b * 2 * heads["nv"] * 2 * tc.CHUNK**2 * heads["h"]  # chunks x heads x 2C²H
        base = prof.cost(b, t, config=dataclasses.replace(config, qk_in_state=False), **heads)
        if config.qk_in_state:
            assert (base["intra"]["GFLOP"] - counts["intra"]["GFLOP"]) * 1e9 == pytest.approx(
                qk_flops)
            assert (counts["state"]["GFLOP"] - base["state"]["GFLOP"]) * 1e9 == pytest.approx(
                tiles * qk_flops)


def test_profile_variants_quick_runs_bitwise():
    """`profile_gdn_chunk --quick --variants ...` (interpreter): each variant on top of the
    case's default_config, timed per kernel and whole, with outputs bitwise the default's (these
    variants only rearrange the same arithmetic); an unknown name is refused."""
    from experiments import profile_gdn_chunk as prof

    rows = prof.main(["--quick", "--cases", "1x70", "--variants", "prefetch,qk-qn-majors"])
    wholes = [r for r in rows if r["kernel"] == "whole"]
    assert [r["variant"] for r in wholes] == ["default_config", "prefetch", "qk-qn-majors"]
    for r in wholes[1:]:
        assert r["rel_err_o"] == 0 and r["rel_err_final"] == 0 and r["ms"] > 0, r
    assert "qk-qn-majors" in prof.format_summary(rows)
    with pytest.raises(ValueError, match="unknown variants"):
        prof.main(["--quick", "--variants", "no-such-variant"])


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["qn-majors", "qk-qn-majors", "qk-qn-v16", "qk-qn-v32",
                                     "prefetch", "stages3", "gates", "no-pairs", "u-ahead",
                                     "u-gates"])
@pytest.mark.parametrize("b", [1, 8], ids=["B1-defaults", "B8-defaults"])
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T4K", "varlen"])
def test_variants_compiled_on_gpu_at_model_dims(variant, b, varlen):
    """The profile's `--variants` on the GPU (compiled, sm_90a): on top of the B1 and the B8
    `default_config`, Nk16 Nv32 H = Hv = 128 bf16 with states, within the 2e-2 relative-norm
    bound of `test_chunked_compiled_on_gpu_at_model_dims` against the float32 XLA reference."""
    from experiments import profile_gdn_chunk as prof

    config = dataclasses.replace(tc.default_config(b, 32, 128, nk=16), **prof.VARIANTS[variant])
    _check_at_model_dims(varlen, config)
