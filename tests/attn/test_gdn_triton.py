"""The Triton GDN kernels: the shared base through the ops (`gdn_base`, interpreted on a CPU),
then what is the kernels' own, against the reference, compiled on a GPU.

Decode kernel on the slot pool: launch configs on a pool whose slots not carried by a live row
(the null slot 0, free slots and the slot of a fresh request) hold NaN: outputs must match the
reference on the clean pool, the live slots its new states, and every other slot must come back
bitwise unchanged.

Chunked prefill pipeline: bf16 varlen with states, raw keys and padded dims against a float64
recurrence; outputs start as NaN in the interpreter, so an unwritten element fails. Launch
configurations: the grid orders bitwise the defaults', the pair intra kernel against the
per-head one, `default_config`'s picks, both kernels compiled for sm_90a.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import _op, gdn
from attn._op import device_facts
from attn.gdn import _chunk_config as cfg
from attn.gdn import reference as ref
from attn.gdn import triton as kernel
from attn.gdn import triton_chunk as tc
from tests.attn.gdn_base import GdnTests
from tests.utils import assert_close, case_id, compile_for_sm90, rng


class TestTriton(GdnTests):
    """The shared base through the ops on the Triton kernels (decode pool; the chunked pipeline
    for `gdn_chunked` and `gdn_prefill_pool`), interpreted on a CPU."""

    implementation = "triton"
    float64_tol = 1e-5

SLOTS = 9
SLOT_IDS = np.asarray([5, 0, 2, 7], np.int32)  # row 1 is padding
HAS_INIT = np.asarray([True, True, False, True])  # row 2 is a fresh request on a stale slot


def _problem(gen, *, b=4, nk, nv, h, hv, slots=SLOTS, dtype=jnp.float32):
    """Random q/k/v, realistic gates (decay 0.4..0.95), a pool of old states (numpy, f32)."""
    q, k = (jnp.asarray(gen.standard_normal((b, 1, nk, h), np.float32), dtype) for _ in range(2))
    v = jnp.asarray(gen.standard_normal((b, 1, nv, hv), np.float32), dtype)
    g = jnp.asarray(np.log(gen.uniform(0.4, 0.95, (b, 1, nv))), jnp.float32)
    beta = jnp.asarray(gen.uniform(0.05, 0.95, (b, 1, nv)), jnp.float32)
    pool = 0.5 * gen.standard_normal((slots, nv, h, hv), np.float32)
    return (q, k, v, g, beta), pool


def _poisoned(pool, slot_ids, has_init):
    """NaN in every slot that no row carries state from (slot 0 included)."""
    carried = slot_ids[(slot_ids > 0) & has_init]
    out = pool.copy()
    out[~np.isin(np.arange(pool.shape[0]), carried)] = np.nan
    return out


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint32 if x.dtype.itemsize == 4 else np.uint16)


def _check_pool_contract(o, new_pool, pool_in, exp_o, exp_pool, slot_ids, *, dtype=None,
                         pool_tol=None):
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    live = slot_ids > 0
    assert_close(o[live], np.asarray(exp_o)[live], dtype=dtype)
    assert (o[~live] == 0).all(), "padding rows must output exactly 0"
    written = slot_ids[live]
    assert_close(new_pool[written], np.asarray(exp_pool)[written], atol=pool_tol, rtol=pool_tol)
    others = ~np.isin(np.arange(pool_in.shape[0]), written)
    np.testing.assert_array_equal(_bits(new_pool[others]), _bits(pool_in[others]))


CASES = [
    dict(nk=2, nv=2, h=16, hv=16, l2norm=True, scale=None, block_hv=16),
    dict(nk=2, nv=4, h=32, hv=32, l2norm=False, scale=0.3, block_hv=16),
    dict(nk=1, nv=3, h=24, hv=20, l2norm=True, scale=None, block_hv=8),  # padded, masked dims
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: case_id(
    NK=c["nk"], NV=c["nv"], H=c["h"], HV=c["hv"], L2=int(c["l2norm"]), BHV=c["block_hv"]))
def test_kernel_matches_reference(c):
    gen = rng()
    xs, pool = _problem(gen, nk=c["nk"], nv=c["nv"], h=c["h"], hv=c["hv"])
    dirty = _poisoned(pool, SLOT_IDS, HAS_INIT)
    kw = dict(has_initial_state=jnp.asarray(HAS_INIT), scale=c["scale"],
              use_qk_l2norm=c["l2norm"])
    o, new_pool = kernel.gdn_decode_pool(*xs, jnp.asarray(dirty), jnp.asarray(SLOT_IDS),
                                         config=kernel.Config(block_hv=c["block_hv"]), **kw)
    exp_o, exp_pool = ref.gdn_decode_pool(*xs, jnp.asarray(pool), jnp.asarray(SLOT_IDS), **kw)
    assert o.shape == exp_o.shape and o.dtype == exp_o.dtype
    _check_pool_contract(o, new_pool, dirty, exp_o, exp_pool, SLOT_IDS)


def test_stray_minus_one_is_padding_and_never_wraps():
    """-1 reads and writes nothing (in JAX it would wrap to the last slot); NaN inputs of padding
    rows still give exactly 0; no has_initial_state means every real row carries its state."""
    gen = rng()
    (q, k, v, g, beta), pool = _problem(gen, nk=2, nv=2, h=16, hv=16)
    slot_ids = np.asarray([-1, 3, 0, SLOTS - 2], np.int32)
    q = q.at[0].set(jnp.nan).at[2].set(jnp.nan)
    o, new_pool = kernel.gdn_decode_pool(q, k, v, g, beta, jnp.asarray(pool),
                                         jnp.asarray(slot_ids), use_qk_l2norm=True,
                                         config=kernel.Config(block_hv=8))
    exp_o, exp_pool = ref.gdn_decode_pool(q, k, v, g, beta, jnp.asarray(pool),
                                          jnp.asarray(slot_ids), use_qk_l2norm=True)
    _check_pool_contract(o, new_pool, pool, exp_o, exp_pool, slot_ids)


def test_config_validation():
    with pytest.raises(ValueError, match="block_hv"):
        kernel.Config(block_hv=24)
    with pytest.raises(ValueError, match="num_warps"):
        kernel.Config(num_warps=3)


@pytest.mark.gpu
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
def test_compiled_on_gpu_at_model_dims(l2norm):
    """B64, Nk16, Nv32, H = Hv = 128, two padding rows and a fresh request, NaN in every slot not
    carried; the pool donated so the in-place path runs."""
    gen = rng()
    b, slots = 64, 80
    xs, pool = _problem(gen, b=b, nk=16, nv=32, h=128, hv=128, slots=slots, dtype=jnp.bfloat16)
    slot_ids = (gen.permutation(slots - 1)[:b] + 1).astype(np.int32)
    slot_ids[[3, 40]] = [0, -1]
    has_init = gen.uniform(size=b) > 0.2
    dirty = _poisoned(pool, slot_ids, has_init)
    kw = dict(has_initial_state=jnp.asarray(has_init), use_qk_l2norm=l2norm)
    exp_o, exp_pool = jax.jit(lambda *a: ref.gdn_decode_pool(*a, **kw))(
        *xs, jnp.asarray(pool), jnp.asarray(slot_ids))
    run = jax.jit(lambda *a: kernel.gdn_decode_pool(*a, **kw), donate_argnums=(5,))
    o, new_pool = run(*xs, jnp.asarray(dirty), jnp.asarray(slot_ids))
    assert o.dtype == jnp.bfloat16
    # The states are float32 end to end; GPU exp / rsqrt are a few ulp off XLA's and the sums
    # over H = 128 run in another order, hence 1e-4 rather than 2e-5.
    _check_pool_contract(o, new_pool, dirty, exp_o, exp_pool, slot_ids, dtype=jnp.bfloat16,
                         pool_tol=1e-4)


# Chunked prefill (`attn/gdn/triton_chunk.py`).

CHUNK_LENGTHS = (1, 63, 64, 65, 200)  # one token, around one chunk, several chunks with a tail
LENS = [1, 70, 0, 64]  # packed: one token, a chunk and a tail, an empty sequence, one full chunk
# One compile per shape instead of op-by-op dispatch: much faster on the CPU.
ref_chunked = jax.jit(ref.gdn_chunked, static_argnames=("scale", "use_qk_l2norm", "chunk_size"))


def _chunk_problem(gen, *, b, t, nk, nv, h, hv, dtype=jnp.float32, init=True, n_state=None):
    """Random q/k/v, realistic gates (decay 0.4..0.99, beta 0.05..0.95), an initial state."""
    q, k = (jnp.asarray(gen.standard_normal((b, t, nk, h), np.float32), dtype) for _ in range(2))
    v = jnp.asarray(gen.standard_normal((b, t, nv, hv), np.float32), dtype)
    g = jnp.asarray(np.log(gen.uniform(0.4, 0.99, (b, t, nv))), jnp.float32)
    beta = jnp.asarray(gen.uniform(0.05, 0.95, (b, t, nv)), jnp.float32)
    h0 = None
    if init:
        h0 = jnp.asarray(0.5 * gen.standard_normal((n_state or b, nv, h, hv)), jnp.float32)
    return (q, k, v, g, beta), h0


def _varlen_problem(gen, *, nk, nv, h=16, hv=32, dtype=jnp.bfloat16, lens=LENS):
    """`_chunk_problem` packed as `lens` (one state per sequence); returns `(xs, h0, cu)`."""
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    xs, h0 = _chunk_problem(gen, b=1, t=int(cu[-1]), nk=nk, nv=nv, h=h, hv=hv, dtype=dtype,
                            n_state=len(lens))
    return xs, h0, jnp.asarray(cu)


def _recurrent64(q, k, v, g, beta, h0, *, scale=None, l2norm=True):
    """Float64 token loop of the gated delta rule (numpy), the oracle of both implementations."""
    q, k, v, g, beta = (np.asarray(jnp.asarray(x, jnp.float32), np.float64)
                        for x in (q, k, v, g, beta))
    if l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    ratio = v.shape[2] // q.shape[2]
    q, k = np.repeat(q, ratio, axis=2), np.repeat(k, ratio, axis=2)
    b, t, nv, hv = v.shape
    s = np.zeros((b, nv, q.shape[-1], hv)) if h0 is None else np.asarray(h0, np.float64).copy()
    o = np.zeros(v.shape)
    for i in range(t):
        s = s * np.exp(g[:, i])[..., None, None]
        u = beta[:, i, :, None] * (v[:, i] - np.einsum("bnhv,bnh->bnv", s, k[:, i]))
        s = s + np.einsum("bnh,bnv->bnhv", k[:, i], u)
        o[:, i] = np.einsum("bnhv,bnh->bnv", s, q[:, i])
    return o, s


def _rel_norm(a, e) -> float:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _run(xs, h0, config=None, cu=None):
    return tc.gdn_chunked(*xs, initial_state=h0, use_qk_l2norm=True, config=config,
                          cu_seqlens=cu)


def test_chunked_kernel_bf16_varlen_with_states():
    """bf16 packed sequences of 1, 70, 0 and 64 tokens with their own initial states (GVA 1 ->
    2): each sequence against the float64 recurrence on the same bf16 values, by relative-norm
    error <= 3e-2; an empty sequence keeps its state exactly.

    bf16 keeps 8 significant bits and the interpreter's float32 -> bf16 casts truncate (unit error
    2^-8 = 3.9e-3, twice a GPU's rounding); the intermediates (W, U, P, V_new, the normalised
    keys / queries) and every dot operand are rounded to bf16, which measures up to ~2e-2 here;
    a wrong chunk, head, boundary or decay gives O(1)."""
    xs, h0, cu = _varlen_problem(rng(), nk=1, nv=2)
    o, final = _run(xs, h0, cu=cu)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    for i, (lo, hi) in enumerate(itertools.pairwise(np.asarray(cu))):
        if hi == lo:
            np.testing.assert_array_equal(np.asarray(final[i]), np.asarray(h0[i]))
            continue
        o64, final64 = _recurrent64(*(x[:, lo:hi] for x in xs), h0[i:i + 1])
        for name, got, exp in (("o", o[:, lo:hi], o64), ("final", final[i:i + 1], final64)):
            err = _rel_norm(_f32(got), exp)
            assert err <= 3e-2, f"sequence {i} {name}: relative error {err:.3g}"


def test_chunked_kernel_bf16_raw_keys_and_padded_dims():
    """bf16 q/k/v, no l2-norm (keys scaled to unit size instead) with an explicit scale, H = 24 /
    Hv = 20 padded and masked, T = 70."""
    gen = rng()
    (q, k, v, g, beta), h0 = _chunk_problem(gen, b=1, t=70, nk=1, nv=2, h=24, hv=20,
                                            dtype=jnp.bfloat16)
    k = (k.astype(jnp.float32) * 24 ** -0.5).astype(jnp.bfloat16)
    o, final = tc.gdn_chunked(q, k, v, g, beta, initial_state=h0, scale=0.3)
    # The float64 recurrence on the same bf16 values: what the f32 reference approximates.
    exp_o, exp_final = _recurrent64(q, k, v, g, beta, h0, scale=0.3, l2norm=False)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert_close(o, exp_o, dtype=jnp.bfloat16)
    assert_close(final, exp_final, dtype=jnp.bfloat16)


def test_chunked_kernel_gradient_is_the_references():
    """`jax.grad` through `gdn_chunked(implementation="triton")` (the Triton backward,
    tests/attn/test_gdn_chunk_bwd.py) equals the reference's VJP for every input and the initial
    state."""
    gen = rng()
    xs, h0 = _chunk_problem(gen, b=1, t=5, nk=1, nv=2, h=16, hv=16)
    cot = jnp.asarray(gen.standard_normal((1, 5, 2, 16), np.float32))

    def loss(impl, *a):
        o, final = gdn.gdn_chunked(*a[:5], initial_state=a[5], use_qk_l2norm=True,
                                   implementation=impl)
        return jnp.sum(o * cot) + jnp.sum(final)

    argnums = tuple(range(6))
    grads = jax.jit(jax.grad(lambda *a: loss("triton", *a), argnums=argnums))(*xs, h0)
    expected = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=argnums))(*xs, h0)
    for a, e in zip(grads, expected, strict=True):
        assert_close(a, e)


def test_chunked_triton_needs_chunk_64_and_config_validation():
    gen = rng()
    xs, _ = _chunk_problem(gen, b=1, t=3, nk=1, nv=1, h=16, hv=16, init=False)
    with pytest.raises(NotImplementedError, match="chunk_size=32"):
        gdn.gdn_chunked(*xs, chunk_size=32, implementation="triton")
    # Rows past 512 bytes (float32 at H256, bf16 at H512) do not fit a Hopper block: refused by
    # name, and `auto` runs XLA; bf16 at H256 runs.
    q, k, v, g, beta = (jnp.zeros(s, d) for s, d in (
        ((1, 3, 1, 256), jnp.float32), ((1, 3, 1, 256), jnp.float32), ((1, 3, 1, 16), jnp.float32),
        ((1, 3, 1), jnp.float32), ((1, 3, 1), jnp.float32)))
    with pytest.raises(NotImplementedError, match="H=256, Hv=16 with 32-bit"):
        gdn.gdn_chunked(q, k, v, g, beta, implementation="triton")
    assert gdn.gdn_chunked.reasons("triton", q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                                   v.astype(jnp.bfloat16), g, beta) == []
    with pytest.raises(ValueError, match="block_hv_state=8"):
        tc.Config(block_hv_state=8)
    with pytest.raises(ValueError, match="state_stages=0"):
        tc.Config(state_stages=0)
    for name in ("intra_warps", "state_warps"):
        with pytest.raises(ValueError, match=f"{name}=3"):
            tc.Config(**{name: 3})


# Launch configurations (`Config`): the grid orders reorder programs only, the pair intra kernel
# rounds W and U differently; `default_config`'s picks.


@pytest.mark.parametrize("layout,dtype", [("B2-T130", jnp.bfloat16), ("varlen", jnp.float32)],
                         ids=["B2-T130-bf16", "varlen-f32"])
def test_grid_orders_are_bitwise_the_defaults(layout, dtype):
    """GVA 2 -> 4 value heads with initial states, two value slices per head: the chunk-major
    intra grid and the sequence-major state grid give the same output and final state bit for bit
    as `default_config`'s head-major / slice-major grids, rows of B tokens (table-free chunk
    addressing) and packed sequences (chunk tables) alike. Outputs start as NaN in the
    interpreter, so an element a launch order skips fails."""
    gen = rng()
    if layout == "varlen":
        xs, h0, cu = _varlen_problem(gen, nk=2, nv=4, dtype=dtype)
    else:
        xs, h0 = _chunk_problem(gen, b=2, t=130, nk=2, nv=4, h=16, hv=32, dtype=dtype)
        cu = None
    base = dataclasses.replace(tc.default_config(4, 4, 32, nk=2), block_hv_state=16)
    assert base.intra_head_major and base.state_slice_major and base.intra_pairs
    other = dataclasses.replace(base, intra_head_major=False, state_slice_major=False)
    (o0, f0), (o, f) = _run(xs, h0, base, cu), _run(xs, h0, other, cu)
    assert np.isfinite(_f32(o)).all()
    np.testing.assert_array_equal(_bits(o), _bits(o0))
    np.testing.assert_array_equal(_bits(f), _bits(f0))


def test_grid_limits():
    """The head-major intra grid puts the chunks on the grid's y axis, the slice-major state grid
    the sequences on its z axis (<= 65535 each): refused beyond, with the count in the message;
    `Config()` (chunk-major, sequence-major) takes both."""
    n = 65536 * tc.CHUNK
    shapes = [jax.ShapeDtypeStruct((1, n, 1, 16), jnp.bfloat16)] * 3 + [
        jax.ShapeDtypeStruct((1, n, 1), jnp.float32)] * 2

    def build(config, shapes, cu=None):
        def fn(q, k, v, g, beta, *cu):
            tc.stages(q, k, v, g, beta, cu_seqlens=cu[0] if cu else None, config=config)
            return g
        return jax.eval_shape(fn, *shapes, *([cu] if cu is not None else []))

    build(tc.Config(), shapes)
    with pytest.raises(ValueError, match="65536 chunks > 65535"):
        build(tc.Config(intra_head_major=True), shapes)
    small = [jax.ShapeDtypeStruct((1, 8, *x.shape[2:]), x.dtype) for x in shapes]
    cu = jax.ShapeDtypeStruct((65537,), jnp.int32)
    build(tc.Config(), small, cu)
    with pytest.raises(ValueError, match="65536 sequences > 65535"):
        build(tc.Config(state_slice_major=True), small, cu)


# The pair intra kernel against the per-head one (Nk, Nv, config changes on top of
# `default_config`): GVA 2 head-major (the default); GVA 4 (two pairs per key head: only the
# first stores the keys and queries) chunk-major.
PAIR_LAYOUTS = {"gva2-headmajor": (2, 4, {}), "gva4-chunkmajor": (1, 4, dict(
    intra_head_major=False, state_slice_major=False))}
# Pair against per-head path (relative norm, bf16): measured ~5e-4 (W), ~1e-3 (U, o), ~3e-4
# (final state); the two heads swapped give >= 0.6.
PAIR_TOL = 5e-3


def _swap_pairs(x):
    """x `[N_TOK, Nv, ...]` with value heads 2j and 2j + 1 exchanged."""
    return x[:, np.arange(x.shape[1]) ^ 1]


@pytest.mark.parametrize("layout", list(PAIR_LAYOUTS))
def test_pairs_match_per_head_path_bf16_varlen(layout):
    """bf16 packed sequences of 1, 70, 0 and 64 tokens with initial states: the intra kernel's
    G, normalised keys / queries and P bit for bit the per-head kernel's, W and U per value head
    within PAIR_TOL (and the heads swapped far outside it); the whole op's output and final states
    within PAIR_TOL of the per-head path's and, per sequence, as close to the float64 recurrence
    as it is. Every problem draws its own g and β per value head, so a pair program that wrote a
    head's outputs under the other head's index fails."""
    nk, nv, opts = PAIR_LAYOUTS[layout]
    xs, h0, cu = _varlen_problem(rng(), nk=nk, nv=nv)
    pairs = dataclasses.replace(tc.default_config(len(LENS), nv, 32, nk=nk), **opts)
    base = dataclasses.replace(pairs, intra_pairs=False)
    assert pairs.intra_pairs

    def intra(config):
        intra_fn, _, x = tc.stages(*xs, h0, cu, use_qk_l2norm=True, config=config)
        return intra_fn(x["q2"], x["k2"], x["v2"], x["g2"], x["beta2"], x["cstart"], x["clen"])

    got, exp = intra(pairs), intra(base)
    for name, a, e in zip(("gcum", "w", "u", "kn", "p"), got, exp, strict=True):
        a, e = _f32(a), _f32(e)
        assert a.shape == e.shape and np.isfinite(a).all(), name
        if name in ("w", "u"):
            for h in range(nv):
                err = _rel_norm(a[:, h], e[:, h])
                assert err <= PAIR_TOL, f"{name} head {h}: {err:.3g}"
            assert _rel_norm(_swap_pairs(e), e) > 20 * PAIR_TOL, name  # heads told apart
        else:
            np.testing.assert_array_equal(a, e, err_msg=name)
    for e in (exp[0], exp[4]):  # G and P differ per head: a swapped head fails bitwise
        assert (_swap_pairs(_f32(e)) != _f32(e)).mean() > 0.3

    (o, final), (o0, final0) = _run(xs, h0, pairs, cu), _run(xs, h0, base, cu)
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


def test_pairs_need_an_even_ratio():
    def build(nk, nv, config):
        shapes = [jax.ShapeDtypeStruct((1, 70, nk, 16), jnp.bfloat16)] * 2 + [
            jax.ShapeDtypeStruct((1, 70, nv, 16), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 70, nv), jnp.float32),
            jax.ShapeDtypeStruct((1, 70, nv), jnp.float32)]

        def fn(q, k, v, g, beta):
            tc.stages(q, k, v, g, beta, config=config)
            return g

        return jax.eval_shape(fn, *shapes)

    pairs = tc.Config(intra_pairs=True)
    build(2, 4, pairs)  # GVA 2
    build(1, 4, pairs)  # GVA 4: two pairs per key head
    for nk, nv in ((1, 1), (1, 3), (2, 2), (2, 6)):
        build(nk, nv, tc.Config())  # the per-head kernel takes any Nk | Nv
        with pytest.raises(ValueError, match=f"Nv={nv}, Nk={nk}"):
            build(nk, nv, pairs)


def test_default_config_takes_pairs_only_for_even_ratios():
    """The pair kernel only where every key head has an even number of value heads (it would
    raise otherwise), and only when told Nk."""
    assert tc.default_config(1, 32, 128, nk=16).intra_pairs
    assert tc.default_config(8, 32, 128, nk=8).intra_pairs
    for nk in (32, None):  # Nv // Nk = 1, or Nk unknown
        assert not tc.default_config(1, 32, 128, nk=nk).intra_pairs
    assert not tc.default_config(1, 24, 128, nk=8).intra_pairs  # Nv // Nk = 3


MODEL = dict(nv=32, hv=128, nk=16)  # Qwen3-Next's GDN heads


@pytest.mark.parametrize(("b", "width"), [(1, 32), (2, 64), (8, 64), (64, 64)])
def test_default_config_width_makes_fewest_waves(b, width):
    """B1: 32 chains x 4 slices = 128 programs, one wave either way, so the shorter 32-wide step;
    from B2 on, 64-wide slices halve the waves (2 -> 1 at B2, 8 -> 4 at B8)."""
    config = tc.default_config(b, MODEL["nv"], MODEL["hv"], nk=MODEL["nk"])
    assert (config.block_hv_state, config.state_stages, config.state_warps) == (width, 3, 4)
    assert config.intra_pairs and config.intra_head_major and config.state_slice_major


def test_default_config_shared_memory_decides_the_stages():
    """bf16 at H = 128: three stages fit at both widths; float32 intermediates or H = 256 do not
    fit three, and where no estimate fits, 32-wide slices in two stages for float32 (the estimate
    overstates it) and one for bf16 at H = 256 (two compile to 236 KiB)."""
    for width in (32, 64):
        assert cfg.state_smem(128, width, 2, 3) <= device_facts().shared_memory
    f32 = tc.default_config(1, 4, 128, nk=2, itemsize=4)
    wide = tc.default_config(1, 32, 128, nk=16, h=256)
    assert (f32.block_hv_state, f32.state_stages) == (32, 2)
    assert (wide.block_hv_state, wide.state_stages) == (32, 1)
    assert cfg.state_smem(256, 32, 2, 2) > device_facts().shared_memory
    small = tc.default_config(2, 4, 32, nk=2, h=32)  # Hv 32: one slice whatever the width
    assert small.state_stages == 3
    # The backward's dqk value steps: 64 wide, 32 where rows pass 256 bytes (64-wide steps ask
    # for 288 KiB at float32 H128; `experiments.tools.hopper_fit` compiles and measures them).
    assert tc.default_config(1, 32, 128, nk=16).dqk_block_v == 64
    assert tc.default_config(1, 4, 64, nk=2, h=64, itemsize=4).dqk_block_v == 64
    for config in (f32, wide):
        assert config.dqk_block_v == 32


def test_default_config_reads_the_device(monkeypatch):
    """The heuristic's SM count and shared memory are the device's (`attn._op.device_facts`):
    with less shared memory than three stages take, two."""
    h100 = tc.default_config(1, 32, 128, nk=16)
    small = _op.DeviceFacts(kind="test", num_sms=132, shared_memory=150_000)
    monkeypatch.setattr(cfg, "device_facts", lambda: small)
    assert cfg.state_smem(128, 32, 2, 2) <= small.shared_memory < cfg.state_smem(128, 32, 2, 3)
    assert (h100.state_stages, tc.default_config(1, 32, 128, nk=16).state_stages) == (3, 2)


def _sm90_jobs(config, nk, t_row):
    """Both kernels as `config` launches them at Nk `nk`, Nv32 H = Hv = 128, bf16, l2-norm."""
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    n_tok = 32768
    common = dict(F32=False, NK=nk, NV=32, H=128, HV=128, BLOCK_H=128, BT=tc.CHUNK,
                  SCALE=128 ** -0.5)
    name = "intra_pair_kernel" if config.intra_pairs else "intra_kernel"
    intra = dict(
        kernel=f"attn.gdn._chunk_intra:{name}",
        pointers=dict(q_ptr=bf, k_ptr=bf, v_ptr=bf, g_ptr=f32, beta_ptr=f32, cstart_ptr=i32,
                      clen_ptr=i32, gcum_ptr=f32, w_ptr=bf, u_ptr=bf, kn_ptr=bf, p_ptr=bf),
        constexprs=dict(common, EPS=1e-6, L2NORM=True, BLOCK_HV=128, STORE_KN=True,
                        STORE_QN=True, QN_OFF=n_tok * nk * 128, **cfg.intra_constexprs(config)),
        num_warps=config.intra_warps, num_stages=1)
    state = dict(
        kernel="attn.gdn._chunk_state:state_kernel",
        pointers=dict(k_ptr=bf, w_ptr=bf, u_ptr=bf, gcum_ptr=f32, cstart_ptr=i32, clen_ptr=i32,
                      sfirst_ptr=i32, scount_ptr=i32, h0_ptr=f32, q_ptr=bf, p_ptr=bf,
                      final_ptr=f32, o_ptr=bf),
        constexprs=dict(common, HAS_INIT=True, BLOCK_HV=config.block_hv_state, QN=True,
                        Q_OFF=n_tok * nk * 128, **cfg.state_constexprs(config, t_row)),
        **cfg.state_launch(config))
    return [intra, state]


def test_kernels_compile_for_sm90():
    """Triton's compiler (sm_90a, bundled ptxas, no GPU) on both kernels as the B1 and B8 T32K
    defaults launch them (the pair intra kernel) and on the per-head intra kernel (GVA 1), bf16
    at the model's heads: they compile without spills, and the state kernel's shared memory is
    within `state_smem`'s estimate and the per-program limit (a default launch would fail on the
    GPU otherwise)."""
    configs = [tc.default_config(b, MODEL["nv"], MODEL["hv"], nk=MODEL["nk"]) for b in (1, 8)]
    per_head = tc.default_config(1, 32, 128, nk=32)
    jobs = (_sm90_jobs(configs[0], 16, 32768) + _sm90_jobs(configs[1], 16, 4096)[1:]
            + _sm90_jobs(per_head, 32, 32768)[:1])
    results = compile_for_sm90(jobs)
    assert [r["name"] for r in results] == ["intra_pair_kernel", "state_kernel", "state_kernel",
                                            "intra_kernel"]
    for r in results:
        assert r["spill_stores"] == 0, r
    for config, r in zip(configs, results[1:3], strict=True):
        bound = cfg.state_smem(128, config.block_hv_state, 2, config.state_stages)
        assert r["shared"] <= bound <= device_facts().shared_memory, (config, r)


# GPU: compiled at the model's heads.


@pytest.mark.gpu
def test_chunked_compiled_on_gpu_float32_inputs():
    """float32 q/k/v take the float32 path (3-pass TF32 dots, float32 intermediates): within
    1e-5 relative-norm error of the XLA reference (HIGHEST precision)."""
    gen = rng()
    xs, h0 = _chunk_problem(gen, b=1, t=1000, nk=2, nv=4, h=128, hv=128)
    kw = dict(initial_state=h0, use_qk_l2norm=True)
    got = jax.jit(lambda *a: tc.gdn_chunked(*a, **kw))(*xs)
    expected = jax.jit(lambda *a: ref.gdn_chunked(*a, **kw))(*xs)
    for name, a, e in zip(("o", "final"), got, expected, strict=True):
        err = _rel_norm(a, e)
        assert err <= 1e-5, f"{name}: relative error {err:.3g}"


# Launch configs on the GPU on top of the B1 default (varlen: 5 sequences): the B8 default
# (64-wide slices), the per-head intra kernel, the grid orders reversed at two stages.
GPU_CONFIGS = {
    "default": {},
    "B8-default": dict(block_hv_state=64),
    "per-head-intra": dict(intra_pairs=False),
    "orders-reversed-2-stages": dict(intra_head_major=False, state_slice_major=False,
                                     state_stages=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("opts", GPU_CONFIGS.values(), ids=GPU_CONFIGS.keys())
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T4K", "varlen"])
def test_chunked_compiled_on_gpu_at_model_dims(varlen, opts):
    """Nk16, Nv32, H = Hv = 128, bf16 q/k/v, l2-norm, initial states (B2 T4K, or 5 packed
    sequences, one empty, one of 1 token): the relative-norm error against the float32 XLA
    reference must stay <= 2e-2 for the output and the final state (bf16 intermediates and dot
    operands; the interpreter, whose f32 -> bf16 casts truncate, gives ~1e-2 at smaller heads); a
    wrong chunk, head or boundary gives O(1)."""
    gen = rng()
    cu = None
    if varlen:
        cu = jnp.asarray([0, 1, 1000, 1000, 3000, 4096], jnp.int32)
        xs, h0 = _chunk_problem(gen, b=1, t=4096, nk=16, nv=32, h=128, hv=128,
                                dtype=jnp.bfloat16, n_state=5)
    else:
        xs, h0 = _chunk_problem(gen, b=2, t=4096, nk=16, nv=32, h=128, hv=128,
                                dtype=jnp.bfloat16)
    config = dataclasses.replace(tc.default_config(1, 32, 128, nk=16), **opts)
    kw = dict(initial_state=h0, use_qk_l2norm=True, cu_seqlens=cu)
    o, final = jax.jit(lambda *a: tc.gdn_chunked(*a, **kw, config=config))(*xs)
    exp_o, exp_final = jax.jit(lambda *a: ref.gdn_chunked(*a, **kw))(*xs)
    for name, a, e in (("o", o, exp_o), ("final", final, exp_final)):
        a = _f32(a)
        assert np.isfinite(a).all(), name
        err = _rel_norm(a, _f32(e))
        assert err <= 2e-2, f"{name}: relative error {err:.3g}"
