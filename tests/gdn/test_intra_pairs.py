"""`triton_chunk.Config.intra_pairs` (interpreted on CPU): one intra-chunk program per pair of
value heads of a key head, both heads' 16 x 16 diagonal blocks solved as one batch of 3-D dots.

The pair path computes K Kᵀ once and applies β to its rows after the dot (the per-head path
multiplies K by β before it), so W and U round differently in bf16 (~1e-3 relative norm), the
rest of the intra kernel's outputs (G, P, the normalised keys / queries) are bitwise the per-head
path's. Every problem draws its own g and β per value head (`_chunk_problem`), so a pair program
that wrote a head's W / U / G / P under the other head's index fails: the checks below also
assert that swapping the two heads is far outside their bounds.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.gdn import reference as ref
from attn.gdn import triton_chunk as tc
from tests.attn.test_gdn_triton import (
    _check_at_model_dims,
    _chunk_problem,
    _recurrent64,
    _rel_norm,
    check_option_bf16_varlen_with_states,
)
from tests.utils import assert_close, rng

LENS = [1, 70, 0, 100]  # one token, a chunk and a tail, an empty sequence, a chunk and a tail
# (Nk, Nv, config changes on top of `default_config`): GVA 2 on the defaults (fused, stored
# normalised keys and queries, head-major grid); GVA 4 (two pairs per key head: only the first
# stores the keys) unfused, chunk-major.
LAYOUTS = {
    "gva2-fused-headmajor": (2, 4, dict(intra_head_major=True)),
    "gva4-unfused-chunkmajor": (1, 4, dict(fuse_output=False, store_qn=False,
                                           intra_head_major=False)),
}
# Pair against per-head path (relative norm, bf16): measured ~5e-4 (W), ~1e-3 (U, o), ~3e-4
# (final state) at these shapes; the two heads swapped give >= 0.6.
PAIR_TOL = 5e-3


def _varlen(dtype, nk, nv, seed=None):
    cu = np.concatenate([[0], np.cumsum(LENS)]).astype(np.int32)
    xs, h0 = _chunk_problem(rng(seed), b=1, t=int(cu[-1]), nk=nk, nv=nv, h=32, hv=32,
                            dtype=dtype, n_state=len(LENS))
    return xs, h0, jnp.asarray(cu)


def _intra(xs, h0, cu, config):
    intra, _, _, x = tc.stages(*xs, h0, cu, use_qk_l2norm=True, config=config)
    return intra(x["q2"], x["k2"], x["v2"], x["g2"], x["beta2"], x["cstart"], x["clen"])


def _whole(xs, h0, cu, config):
    return tc.gdn_chunked(*xs, initial_state=h0, use_qk_l2norm=True, cu_seqlens=cu,
                          config=config)


def _f32(x):
    return np.asarray(x, np.float32)


def _swap_pairs(x):
    """x `[N_TOK, Nv, ...]` with value heads 2j and 2j + 1 exchanged."""
    nv = x.shape[1]
    return x[:, np.arange(nv) ^ 1]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pairs_match_per_head_path_bf16_varlen(layout):
    """bf16 packed sequences of 1, 70, 0 and 100 tokens with initial states: the intra kernel's
    G, normalised keys / queries and P bit for bit the per-head path's, W and U per value head
    within PAIR_TOL (and the heads swapped far outside it); the whole op's output and final
    states within PAIR_TOL of the per-head path's and, per sequence, as close to the float64
    recurrence as it is. Outputs start as NaN in the interpreter: a row no program writes
    fails the finiteness check."""
    nk, nv, opts = LAYOUTS[layout]
    xs, h0, cu = _varlen(jnp.bfloat16, nk, nv)
    base = dataclasses.replace(tc.default_config(len(LENS), nv, 32), **opts)
    pairs = dataclasses.replace(base, intra_pairs=True)
    assert not base.intra_pairs
    got, exp = _intra(xs, h0, cu, pairs), _intra(xs, h0, cu, base)
    for name, a, e in zip(("gcum", "w", "u", "kn", "p"), got, exp, strict=True):
        a, e = _f32(a), _f32(e)
        assert a.shape == e.shape, name
        if name == "p" and not base.fuse_output:
            continue  # a (1,) dummy neither path writes
        assert np.isfinite(a).all(), name
        if name in ("w", "u"):
            for h in range(nv):
                err = _rel_norm(a[:, h], e[:, h])
                assert err <= PAIR_TOL, f"{name} head {h}: {err:.3g}"
            assert _rel_norm(_swap_pairs(e), e) > 20 * PAIR_TOL, name  # heads told apart
        else:
            np.testing.assert_array_equal(a, e, err_msg=name)
    # G (and P) differ per head, so their bitwise checks fail for a swapped head.
    outs = (exp[0], exp[4]) if base.fuse_output else (exp[0],)
    for e in outs:
        assert (_swap_pairs(_f32(e)) != _f32(e)).mean() > 0.3  # P: 0.43 (zeros above diagonal)
    if base.fuse_output:
        assert got[4].shape == (int(cu[-1]), nv, tc.CHUNK)

    (o, final), (o0, final0) = _whole(xs, h0, cu, pairs), _whole(xs, h0, cu, base)
    assert o.dtype == jnp.bfloat16 and np.isfinite(_f32(o)).all()
    assert _rel_norm(_f32(o), _f32(o0)) <= PAIR_TOL
    assert _rel_norm(final, final0) <= PAIR_TOL
    assert _rel_norm(_swap_pairs(_f32(o0)[0]), _f32(o0)[0]) > 20 * PAIR_TOL
    for i, (lo, hi) in enumerate(itertools.pairwise(np.asarray(cu))):
        if hi == lo:  # an empty sequence keeps its state exactly
            np.testing.assert_array_equal(np.asarray(final[i]), np.asarray(h0[i]))
            continue
        o64, final64 = _recurrent64(*(x[:, lo:hi] for x in xs), h0[i:i + 1])
        for name, a, a0, e in (("o", o[:, lo:hi], o0[:, lo:hi], o64),
                               ("final", final[i:i + 1], final0[i:i + 1], final64)):
            err, base_err = _rel_norm(_f32(a), e), _rel_norm(_f32(a0), e)
            assert err <= 1.25 * base_err + 2e-3, (
                f"sequence {i} {name}: {err:.3g} against the per-head path's {base_err:.3g}")


def test_pairs_float32_varlen_match_reference():
    """float32 (3-pass TF32 dots): GVA 2 packed sequences with states within 1e-5 of the
    per-head path and of the float64 recurrence, and within 1e-4 of the float32 XLA reference
    (`test_chunked_kernel_matches_reference_and_float64`'s bound: two float32 chunked
    algorithms)."""
    xs, h0, cu = _varlen(jnp.float32, 2, 4)
    base = tc.default_config(len(LENS), 4, 32)
    o, final = _whole(xs, h0, cu, dataclasses.replace(base, intra_pairs=True))
    o0, final0 = _whole(xs, h0, cu, base)
    assert o.dtype == jnp.float32
    assert_close(o, o0, atol=1e-5, rtol=1e-5)
    assert_close(final, final0, atol=1e-5, rtol=1e-5)
    exp_o, exp_final = ref.gdn_chunked(*xs, initial_state=h0, use_qk_l2norm=True, cu_seqlens=cu,
                                       chunk_size=tc.CHUNK)
    assert_close(o, exp_o, atol=1e-4, rtol=1e-4)
    assert_close(final, exp_final, atol=1e-4, rtol=1e-4)
    for i, (lo, hi) in enumerate(itertools.pairwise(np.asarray(cu))):
        o64, final64 = _recurrent64(*(x[:, lo:hi] for x in xs), h0[i:i + 1])
        assert_close(o[:, lo:hi], o64, atol=1e-5, rtol=1e-5, err_msg=f"sequence {i}")
        assert_close(final[i:i + 1], final64, atol=1e-5, rtol=1e-5, err_msg=f"sequence {i}")


def test_pairs_raw_keys_padded_dims_rows():
    """bf16 without l2-norm (no stored keys), an explicit scale, H = 24 / Hv = 20 padded and
    masked, B2 rows of T = 70 (table-free state addressing) from a zero state, GVA 2: within
    1e-2 of the per-head path, per value head (measured <= 2e-3 per head; the heads swapped
    give ~1.4)."""
    (q, k, v, g, beta), _ = _chunk_problem(rng(), b=2, t=70, nk=2, nv=4, h=24, hv=20,
                                           dtype=jnp.bfloat16, init=False)
    k = (k.astype(jnp.float32) * 24 ** -0.5).astype(jnp.bfloat16)
    base = tc.default_config(2, 4, 20)
    run = lambda config: tc.gdn_chunked(q, k, v, g, beta, scale=0.3, config=config)
    (o, final), (o0, final0) = run(dataclasses.replace(base, intra_pairs=True)), run(base)
    assert np.isfinite(_f32(o)).all() and np.isfinite(_f32(final)).all()
    for h in range(4):
        assert _rel_norm(_f32(o[:, :, h]), _f32(o0[:, :, h])) <= 1e-2, h
        assert _rel_norm(final[:, h], final0[:, h]) <= 1e-2, h


def test_pairs_bf16_varlen_with_states_on_plain():
    """On top of PLAIN (unfused, TF32 solve and output; the pairs need the "stacked" solve):
    the shared bf16 accuracy check against the float64 recurrence (GVA 1 -> 2)."""
    check_option_bf16_varlen_with_states(dict(solve="stacked", intra_pairs=True))


def test_pairs_validation():
    with pytest.raises(ValueError, match="stacked"):
        tc.Config(intra_pairs=True, solve="subst")

    def build(nk, nv, config):
        shapes = [jax.ShapeDtypeStruct((1, 70, nk, 16), jnp.bfloat16)] * 2 + [
            jax.ShapeDtypeStruct((1, 70, nv, 16), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 70, nv), jnp.float32),
            jax.ShapeDtypeStruct((1, 70, nv), jnp.float32)]

        def fn(q, k, v, g, beta):
            tc.stages(q, k, v, g, beta, config=config)
            return g

        return jax.eval_shape(fn, *shapes)

    config = tc.Config(intra_pairs=True)
    build(2, 4, config)  # GVA 2
    build(1, 4, config)  # GVA 4: two pairs per key head
    for nk, nv in ((1, 1), (1, 3), (2, 2), (2, 6)):
        build(nk, nv, tc.Config())  # the per-head path takes any Nk | Nv
        with pytest.raises(ValueError, match=f"Nv={nv}, Nk={nk}"):
            build(nk, nv, config)


def test_profile_pairs_variants_quick():
    """`profile_gdn_chunk --quick --variants no-pairs,pairs-w8` (interpreter, GVA 2 so the
    case's default_config takes the pairs): timed per kernel and whole, the per-head path's
    output within PAIR_TOL of the pairs'."""
    from experiments import profile_gdn_chunk as prof

    assert prof.QUICK_HEADS["nv"] // prof.QUICK_HEADS["nk"] == 2
    rows = prof.main(["--quick", "--cases", "1x70", "--variants", "no-pairs,pairs-w8"])
    wholes = [r for r in rows if r["kernel"] == "whole"]
    assert [r["variant"] for r in wholes] == ["default_config", "no-pairs", "pairs-w8"]
    for r in wholes[1:]:
        assert r["rel_err_o"] <= PAIR_TOL and r["rel_err_final"] <= PAIR_TOL and r["ms"] > 0, r


def test_profile_cost_counts_pairs():
    """`profile_gdn_chunk.cost` with `intra_pairs`: the same HBM bytes (the outputs are the
    per-head kernel's), k / q re-read once per pair instead of per value head, K Kᵀ and the
    fused Q Kᵀ once per pair, and the solve on the diagonal blocks (15 steps of four 16 x 16
    blocks instead of 15 [C, C] x [C, 16] ones); the state kernel's counts unchanged."""
    from experiments import profile_gdn_chunk as prof

    b, t, c, heads = 2, 128, tc.CHUNK, dict(nk=2, nv=4, h=16, hv=32)
    base = dataclasses.replace(tc.default_config(b, 4, 32), store_kn=True)  # fused, store_qn
    per_head = prof.cost(b, t, config=base, **heads)
    pairs = prof.cost(b, t, config=dataclasses.replace(base, intra_pairs=True), **heads)
    heads_chunks = b * (t // c) * heads["nv"]
    k_heads = b * t * heads["nv"] * heads["h"] * 2  # bf16 k per value head
    assert pairs["intra"]["GB"] == per_head["intra"]["GB"]
    assert (per_head["intra"]["GB_rr"] - pairs["intra"]["GB_rr"]) * 1e9 == pytest.approx(
        k_heads)  # k and q: half of the per-head re-reads each
    kk_qk = heads_chunks * 2 * c * c * heads["h"] / 2 * 2  # K Kᵀ and Q Kᵀ, half of them
    solve = heads_chunks * (15 / 4 - 15 / 16) * 2 * c**3
    assert (per_head["intra"]["GFLOP"] - pairs["intra"]["GFLOP"]) * 1e9 == pytest.approx(
        kk_qk + solve)
    assert pairs["state"] == per_head["state"]


def test_pairs_compile_for_sm90():
    """Triton's compiler (not the interpreter) on the pair kernel at the model's heads, bf16,
    4 and 8 warps: `profile_gdn_chunk --ptxas` (sm_90a, Triton's bundled ptxas, no GPU)."""
    from experiments import profile_gdn_chunk as prof

    base = "fuse_output=1,block_hv_state=32,state_warps=4,store_qn=1,intra_head_major=1"
    configs = [f"{base},intra_pairs=1,intra_warps={w}" for w in (4, 8)]
    done = prof.ptxas_report(configs, capture=True)
    if "No such file" in done.stderr or "FileNotFoundError" in done.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("  _intra_pair_kernel ") == len(configs), done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["no-pairs", "pairs-w8"])
@pytest.mark.parametrize("b", [1, 8], ids=["B1-defaults", "B8-defaults"])
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T4K", "varlen"])
def test_pairs_compiled_on_gpu_at_model_dims(variant, b, varlen):
    """The pair variants compiled on the GPU (sm_90a) on top of the B1 / B8 `default_config`:
    Nk16 Nv32 H = Hv = 128 bf16 with states, within 2e-2 (relative norm) of the float32 XLA
    reference (`_check_at_model_dims`)."""
    from experiments import profile_gdn_chunk as prof

    config = dataclasses.replace(tc.default_config(b, 32, 128, nk=16), **prof.VARIANTS[variant])
    _check_at_model_dims(varlen, config)


def test_default_config_takes_pairs_only_for_even_ratios():
    """`default_config` turns on the pair kernel only where every key head has an even number of
    value heads (it would raise otherwise), and only when told Nk."""
    assert tc.default_config(1, 32, 128, nk=16).intra_pairs
    assert tc.default_config(8, 32, 128, nk=8).intra_pairs
    for nk in (32, None):  # Nv // Nk = 1, or Nk unknown
        assert not tc.default_config(1, 32, 128, nk=nk).intra_pairs
    assert not tc.default_config(1, 24, 128, nk=8).intra_pairs  # Nv // Nk = 3
