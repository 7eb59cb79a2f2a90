"""The Triton GDN kernels against the reference: interpreted on CPU, compiled on GPU.

Decode kernel on the slot pool: every case runs on a pool whose slots not carried by a live row
(the null slot 0, free slots and the slot of a fresh request) hold NaN: outputs must match the
reference on the clean pool, the live slots its new states, and every other slot must come back
bitwise unchanged.

Chunked prefill pipeline: lengths around the 64-token chunk, with and without initial states,
varlen with empty and one-token sequences, against the reference and a float64 recurrence;
outputs start as NaN in the interpreter, so an unwritten element fails.
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import gdn
from attn.gdn import reference as ref
from attn.gdn import triton as kernel
from attn.gdn import triton_chunk as chunk_kernel
from tests.utils import assert_close, case_id, rng

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


@pytest.mark.parametrize("flags", [{}, dict(early_state=True, stream_state=True)],
                         ids=["default", "early-stream"])
def test_nan_in_other_slots_changes_nothing_bitwise(flags):
    """A neighbour's NaN slot, a NaN null slot and a NaN stale slot of a fresh request: the same
    outputs and new states, bit for bit, as with finite old states there (also with the state
    loaded first and streamed)."""
    gen = rng()
    xs, pool = _problem(gen, nk=2, nv=4, h=16, hv=16)
    kw = dict(has_initial_state=jnp.asarray(HAS_INIT), use_qk_l2norm=True,
              config=kernel.Config(block_hv=16, **flags))
    o_a, p_a = kernel.gdn_decode_pool(*xs, jnp.asarray(pool), jnp.asarray(SLOT_IDS), **kw)
    o_b, p_b = kernel.gdn_decode_pool(*xs, jnp.asarray(_poisoned(pool, SLOT_IDS, HAS_INIT)),
                                      jnp.asarray(SLOT_IDS), **kw)
    np.testing.assert_array_equal(_bits(o_a), _bits(o_b))
    live = SLOT_IDS[SLOT_IDS > 0]
    np.testing.assert_array_equal(_bits(np.asarray(p_a)[live]), _bits(np.asarray(p_b)[live]))
    assert np.isfinite(np.asarray(o_b)).all()


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


def test_public_api_dispatches_to_the_kernel_under_jit():
    """bf16 q/k/v through `attn.gdn.gdn_decode_pool(implementation="triton")` under jit: output
    in q's dtype, float32 states."""
    gen = rng()
    xs, pool = _problem(gen, nk=2, nv=4, h=16, hv=16, dtype=jnp.bfloat16)
    kw = dict(has_initial_state=jnp.asarray(HAS_INIT), use_qk_l2norm=True)
    run = jax.jit(lambda *a: gdn.gdn_decode_pool(*a, **kw, implementation="triton"))
    o, new_pool = run(*xs, jnp.asarray(pool), jnp.asarray(SLOT_IDS))
    exp_o, exp_pool = ref.gdn_decode_pool(*xs, jnp.asarray(pool), jnp.asarray(SLOT_IDS), **kw)
    assert o.dtype == jnp.bfloat16 and new_pool.dtype == jnp.float32
    _check_pool_contract(o, new_pool, pool, exp_o, exp_pool, SLOT_IDS, dtype=jnp.bfloat16)


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


# Chunked prefill pipeline (`attn/gdn/triton_chunk.py`).

CHUNK_LENGTHS = (1, 63, 64, 65, 200)  # one token, around one chunk, several chunks with a tail
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


@pytest.mark.parametrize("init", [True, False], ids=["state", "zero-state"])
def test_chunked_kernel_matches_reference_and_float64(init):
    """f32, GVA 1 -> 2 value heads, H16 / Hv32, l2-norm (B2 with states, B1 without): within
    1e-5 of the float64 recurrence at every length, and (with a state) within 1e-4 of the
    float32 XLA reference at T = 65 (the reference compiles per shape: one length keeps the test
    fast)."""
    gen = rng()
    b = 2 if init else 1
    for t in CHUNK_LENGTHS:
        xs, h0 = _chunk_problem(gen, b=b, t=t, nk=1, nv=2, h=16, hv=32, init=init)
        o, final = chunk_kernel.gdn_chunked(*xs, initial_state=h0, use_qk_l2norm=True)
        assert o.shape == xs[2].shape and o.dtype == jnp.float32
        assert final.shape == (b, 2, 16, 32) and final.dtype == jnp.float32
        if t == 65 and init:
            exp_o, exp_final = ref_chunked(*xs, initial_state=h0, use_qk_l2norm=True)
            # Two float32 chunked algorithms round differently: 1e-4 against each other.
            assert_close(o, exp_o, atol=1e-4, rtol=1e-4, err_msg=f"T={t}")
            assert_close(final, exp_final, atol=1e-4, rtol=1e-4, err_msg=f"T={t}")
        o64, final64 = _recurrent64(*xs, h0)
        assert_close(o, o64, atol=1e-5, rtol=1e-5, err_msg=f"T={t} vs float64")
        assert_close(final, final64, atol=1e-5, rtol=1e-5, err_msg=f"T={t} vs float64")


def test_chunked_kernel_varlen_against_per_sequence_float64():
    """Packed sequences of 1, 63, 0, 65 and 64 tokens with their own states (GVA 1 -> 2): each
    sequence's outputs and final state equal the float64 recurrence run on it alone; the empty
    one keeps its initial state."""
    gen = rng()
    lens = [1, 63, 0, 65, 64]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    xs, h0 = _chunk_problem(gen, b=1, t=int(cu[-1]), nk=1, nv=2, h=16, hv=16,
                            n_state=len(lens))
    o, final = chunk_kernel.gdn_chunked(*xs, initial_state=h0, use_qk_l2norm=True,
                                        cu_seqlens=jnp.asarray(cu))
    assert final.shape == (len(lens), 2, 16, 16)
    for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
        o64, final64 = _recurrent64(*(x[:, lo:hi] for x in xs), h0[i:i + 1])
        assert_close(o[:, lo:hi], o64, atol=1e-5, rtol=1e-5, err_msg=f"sequence {i}")
        assert_close(final[i:i + 1], final64, atol=1e-5, rtol=1e-5, err_msg=f"sequence {i}")


def test_chunked_kernel_bf16_raw_keys_and_padded_dims():
    """bf16 q/k/v (bf16 intermediates, TF32 dots on a GPU), no l2-norm (keys scaled to unit size
    instead) with an explicit scale, H = 24 / Hv = 20 padded and masked, T = 70."""
    gen = rng()
    (q, k, v, g, beta), h0 = _chunk_problem(gen, b=1, t=70, nk=1, nv=2, h=24, hv=20,
                                            dtype=jnp.bfloat16)
    k = (k.astype(jnp.float32) * 24 ** -0.5).astype(jnp.bfloat16)
    o, final = chunk_kernel.gdn_chunked(q, k, v, g, beta, initial_state=h0, scale=0.3)
    # The float64 recurrence on the same bf16 values: what the f32 reference approximates.
    exp_o, exp_final = _recurrent64(q, k, v, g, beta, h0, scale=0.3, l2norm=False)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert_close(o, exp_o, dtype=jnp.bfloat16)
    assert_close(final, exp_final, dtype=jnp.bfloat16)


def test_chunked_public_api_and_pool_dispatch_to_the_kernel_under_jit():
    """`gdn_chunked` and `gdn_prefill_pool` with implementation="triton" under jit: the pool's
    NaN slots (null, free, a fresh request's stale slot) never leak in, padding rows give 0."""
    gen = rng()
    xs, _ = _chunk_problem(gen, b=4, t=9, nk=1, nv=2, h=16, hv=16, init=False)
    pool = 0.5 * gen.standard_normal((SLOTS, 2, 16, 16)).astype(np.float32)
    dirty = _poisoned(pool, SLOT_IDS, HAS_INIT)
    kw = dict(has_initial_state=jnp.asarray(HAS_INIT), use_qk_l2norm=True)
    run = jax.jit(lambda *a: gdn.gdn_prefill_pool(*a, **kw, implementation="triton"))
    o, new_pool = run(*xs, jnp.asarray(dirty), jnp.asarray(SLOT_IDS))
    exp_o, exp_pool = jax.jit(lambda *a: ref.gdn_prefill_pool(*a, **kw))(
        *xs, jnp.asarray(pool), jnp.asarray(SLOT_IDS))
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    live = SLOT_IDS > 0
    # Two float32 chunked algorithms (the reference's WY in XLA, the kernel's block solve) round
    # differently: 1e-4 against each other (the float64 tests above hold the kernel to 1e-5).
    tol = dict(atol=1e-4, rtol=1e-4)
    assert_close(o[live], np.asarray(exp_o)[live], **tol)
    assert (o[~live] == 0).all(), "padding rows must output exactly 0"
    assert_close(new_pool[SLOT_IDS[live]], np.asarray(exp_pool)[SLOT_IDS[live]], **tol)
    # As the reference, the padding row writes its state to the null slot 0; no other slot moves.
    untouched = ~np.isin(np.arange(SLOTS), SLOT_IDS)
    np.testing.assert_array_equal(_bits(new_pool[untouched]), _bits(dirty[untouched]))

    h0 = jnp.asarray(pool[1:5])
    run = jax.jit(lambda *a: gdn.gdn_chunked(*a, initial_state=h0, implementation="triton"))
    o, final = run(*xs)
    exp_o, exp_final = ref_chunked(*xs, initial_state=h0)
    assert_close(o, exp_o, **tol)
    assert_close(final, exp_final, **tol)


def test_chunked_kernel_gradient_is_the_references():
    """The kernels are forward-only; `jax.grad` through `gdn_chunked(implementation="triton")`
    gives the reference's VJP for every input and the initial state."""
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
    with pytest.raises(ValueError, match="block_hv_state"):
        chunk_kernel.Config(block_hv_state=8)
    with pytest.raises(ValueError, match="num_stages"):
        chunk_kernel.Config(num_stages=0)
    with pytest.raises(ValueError, match="intra_warps"):
        chunk_kernel.Config(intra_warps=3)


@pytest.mark.gpu
def test_chunked_compiled_on_gpu_float32_inputs():
    """float32 q/k/v take the float32 path (3-pass TF32 dots, float32 intermediates): within
    1e-5 relative-norm error of the XLA reference (HIGHEST precision)."""
    gen = rng()
    xs, h0 = _chunk_problem(gen, b=1, t=1000, nk=2, nv=4, h=128, hv=128)
    kw = dict(initial_state=h0, use_qk_l2norm=True)
    got = jax.jit(lambda *a: chunk_kernel.gdn_chunked(*a, **kw))(*xs)
    expected = jax.jit(lambda *a: ref.gdn_chunked(*a, **kw))(*xs)
    for name, a, e in zip(("o", "final"), got, expected, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        err = np.linalg.norm(a - e) / np.linalg.norm(e)
        assert err <= 1e-5, f"{name}: relative error {err:.3g}"


def _check_at_model_dims(varlen, config):
    """Nk16 Nv32 H = Hv = 128 bf16 with states (B2 T4K, or 5 packed sequences): o and the
    final states within 2e-2 (relative norm) of the float32 XLA reference."""
    gen = rng()
    cu = None
    if varlen:
        cu = np.asarray([0, 1, 1000, 1000, 3000, 4096], np.int32)
        xs, h0 = _chunk_problem(gen, b=1, t=4096, nk=16, nv=32, h=128, hv=128,
                                dtype=jnp.bfloat16, n_state=5)
        cu = jnp.asarray(cu)
    else:
        xs, h0 = _chunk_problem(gen, b=2, t=4096, nk=16, nv=32, h=128, hv=128,
                                dtype=jnp.bfloat16)
    kw = dict(initial_state=h0, use_qk_l2norm=True, cu_seqlens=cu)
    o, final = jax.jit(lambda *a: chunk_kernel.gdn_chunked(*a, **kw, config=config))(*xs)
    exp_o, exp_final = jax.jit(lambda *a: ref.gdn_chunked(*a, **kw))(*xs)
    for name, a, e in (("o", o, exp_o), ("final", final, exp_final)):
        a, e = np.asarray(a, np.float32), np.asarray(e, np.float32)
        assert np.isfinite(a).all(), name
        err = np.linalg.norm(a - e) / np.linalg.norm(e)
        assert err <= 2e-2, f"{name}: relative error {err:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T4K", "varlen"])
def test_chunked_compiled_on_gpu_at_model_dims(varlen):
    """Nk16, Nv32, H = Hv = 128, bf16 q/k/v, l2-norm, initial states; varlen packs 5 sequences
    (one empty, one of 1 token). bf16 intermediates and bf16 dot operands (as fla's): the
    relative-norm error against the float32 XLA reference must stay <= 2e-2 for the output and
    the final state (the interpreter, whose f32 -> bf16 casts truncate, gives 1.05e-2 / 8.3e-3 at
    T256, H = Hv = 64); a wrong chunk, head or boundary gives O(1)."""
    _check_at_model_dims(varlen, None)


# The speed options of `triton_chunk.Config`, each alone on top of PLAIN (all off: the
# session-3 kernels) and together; `Config()` turns on all but fuse_output.
PLAIN = chunk_kernel.Config(solve="subst", solve_bf16=False, out_bf16=False, decay_on_v=False,
                            i32_offsets=False, store_kn=False, affine_state=False)
DEFAULT_OPTIONS = dict(solve="stacked", solve_bf16=True, out_bf16=True, decay_on_v=True,
                       i32_offsets=True, store_kn=True, affine_state=True)
SPEED_OPTIONS = [
    DEFAULT_OPTIONS,
    dict(solve="subst_hoist"), dict(solve="nested"), dict(solve="stacked"), dict(solve_bf16=True),
    dict(out_bf16=True), dict(decay_on_v=True), dict(i32_offsets=True), dict(store_kn=True),
    dict(store_kn=True, decay_on_v=True, out_bf16=True),  # normalised keys straight into dots
    dict(solve="nested", solve_bf16=True, out_bf16=True, decay_on_v=True, block_hv_out=16,
         i32_offsets=True, store_kn=True),
    dict(solve="stacked", out_bf16=True, decay_on_v=True, i32_offsets=True, store_kn=True,
         block_hv_state=16, affine_state=True, state_warps=4, state_stages=1),
    dict(affine_state=True),
    dict(fuse_output=True),  # the output from the state kernel, TF32 / P in bf16
    dict(fuse_output=True, out_bf16=True, store_kn=True, decay_on_v=True, i32_offsets=True,
         affine_state=True, block_hv_state=16),
]
SPEED_IDS = [case_id(**o) for o in SPEED_OPTIONS]


def _rel_norm(a, e) -> float:
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    return float(np.linalg.norm(a - e) / np.linalg.norm(e))


@pytest.mark.parametrize("opts", SPEED_OPTIONS, ids=SPEED_IDS)
def test_chunked_speed_options_float32_match_float64(opts):
    """float32 q/k/v: the bf16 options do not apply (3-pass TF32 stays), the others rearrange the
    same float32 algebra: within 1e-5 of the float64 recurrence, as PLAIN is; B2 with
    initial states, T = 130 (two full chunks and a 2-token tail)."""
    gen = rng()
    xs, h0 = _chunk_problem(gen, b=2, t=130, nk=1, nv=2, h=16, hv=32)
    o, final = chunk_kernel.gdn_chunked(*xs, initial_state=h0, use_qk_l2norm=True,
                                        config=dataclasses.replace(PLAIN, **opts))
    o64, final64 = _recurrent64(*xs, h0)
    assert_close(o, o64, atol=1e-5, rtol=1e-5)
    assert_close(final, final64, atol=1e-5, rtol=1e-5)


def slow_if_inside_another(options, ids):
    """`options` as params, those that a larger entry of `options` contains marked slow: for the
    bf16 accuracy checks on top of PLAIN (~6 s each on the CPU), whose float32 checks keep every
    entry alone."""
    return [pytest.param(o, id=i, marks=[pytest.mark.slow] if any(
        o.items() < other.items() for other in options) else [])
        for o, i in zip(options, ids, strict=True)]


@pytest.mark.parametrize("opts", slow_if_inside_another(SPEED_OPTIONS, SPEED_IDS))
def test_chunked_speed_options_bf16_varlen_with_states(opts):
    """bf16 q/k/v, packed sequences of 1, 70, 0 and 64 tokens with their own initial states:
    each sequence's output and final state against the float64 recurrence on the same bf16
    values, by relative-norm error.

    Tolerance 3e-2: bf16 keeps 8 significant bits and the interpreter's float32 -> bf16 casts
    truncate (unit error 2^-8 = 3.9e-3, twice a GPU's rounding). PLAIN already rounds the
    intermediates (W, U, V_new, the per-chunk states) and the `K Kᵀ`, W / U, `W S` and `Kᵀ V_new`
    operands to bf16: ~1e-2 here. The options add one more truncation to the solve's or the
    output's operands; out_bf16 measured 1.8e-2 (the docstring's "doubled"), so 3e-2 leaves ~1.6x
    headroom, about 8 truncation units; a wrong chunk, head, boundary or decay gives O(1). The
    option must also stay within 2.5x PLAIN's error on the same data (+ 2e-3 for the
    one-token sequence's noise)."""
    check_option_bf16_varlen_with_states(opts)


def check_option_bf16_varlen_with_states(opts):
    """`test_chunked_speed_options_bf16_varlen_with_states` for the options `opts` on top of
    PLAIN (also used by tests/gdn for later options)."""
    gen = rng()
    lens = [1, 70, 0, 64]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    xs, h0 = _chunk_problem(gen, b=1, t=int(cu[-1]), nk=1, nv=2, h=16, hv=32,
                            dtype=jnp.bfloat16, n_state=len(lens))
    run = lambda config: chunk_kernel.gdn_chunked(
        *xs, initial_state=h0, use_qk_l2norm=True, cu_seqlens=jnp.asarray(cu), config=config)
    (o, final), (o_base, final_base) = run(dataclasses.replace(PLAIN, **opts)), run(PLAIN)
    assert o.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
        o64, final64 = _recurrent64(*(x[:, lo:hi] for x in xs), h0[i:i + 1])
        pairs = [("final", final[i:i + 1], final_base[i:i + 1], final64)]
        if hi > lo:
            pairs.append(("o", o[:, lo:hi], o_base[:, lo:hi], o64))
        else:  # an empty sequence keeps its state exactly
            np.testing.assert_array_equal(np.asarray(final[i]), np.asarray(h0[i]))
        for name, got, base, exp in pairs:
            err, base_err = _rel_norm(got, exp), _rel_norm(base, exp)
            assert err <= 3e-2, f"sequence {i} {name}: relative error {err:.3g}"
            assert err <= 2.5 * base_err + 2e-3, (
                f"sequence {i} {name}: {err:.3g} against PLAIN's {base_err:.3g}")


def test_chunked_config_rejects_unknown_solve():
    with pytest.raises(ValueError, match="solve"):
        chunk_kernel.Config(solve="cholesky")
    with pytest.raises(ValueError, match="state_warps"):
        chunk_kernel.Config(state_warps=3)
    with pytest.raises(ValueError, match="state_stages"):
        chunk_kernel.Config(state_stages=-1)


def test_chunked_speed_options_compile_for_sm90():
    """The interpreter runs Python semantics; Triton's compiler traces more (e.g. the statements
    after a constexpr-taken `return`). Every option must compile for sm_90a (Triton's bundled
    ptxas, no GPU) at the model's heads: `profile_gdn_chunk --ptxas` on two configs that
    together set every option."""
    from experiments import profile_gdn_chunk as prof

    configs = ["solve=nested,solve_bf16=1,out_bf16=1,decay_on_v=1,i32_offsets=1,store_kn=1",
               "solve=stacked,affine_state=1,state_warps=4,state_stages=1",
               "fuse_output=1,out_bf16=1,store_kn=1,decay_on_v=1"]  # no output kernel
    done = prof.ptxas_report(configs, capture=True)
    if "No such file" in done.stderr or "FileNotFoundError" in done.stderr:
        pytest.skip("Triton's bundled ptxas is missing")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("registers") == 3 * len(configs) - 1, done.stdout


def test_profile_gdn_chunk_quick_runs_and_counts():
    """`experiments.profile_gdn_chunk --quick` (interpreter) times the three kernels and the
    whole op for `Config()` and a `--config` and reports errors against the baseline and the
    reference; its byte counts equal the real tensors' sizes and its FLOPs, the solve left out,
    `bench_gdn_prefill.gdn_flops`."""
    from experiments import bench_gdn_prefill
    from experiments import profile_gdn_chunk as prof

    rows = prof.main(["--quick", "--cases", "1x70", "--config", "solve=nested,out_bf16=0"])
    assert [r["kernel"] for r in rows] == ["intra", "state", "output", "sum", "whole"] * 2
    assert {r["config"] for r in rows} == {"default", "solve=nested,out_bf16=False"}
    other = rows[-1]
    assert other["rel_err_o"] < 3e-2 and other["ref_err_o"] < 3e-2 and other["ms"] > 0
    with pytest.raises(ValueError, match="name=value"):
        prof.parse_config("no_such_field=1")
    assert prof.parse_config("intra_warps=8,decay_on_v=1") == chunk_kernel.Config(
        intra_warps=8, decay_on_v=True)

    b, t, heads = 2, 70, dict(nk=1, nv=2, h=16, hv=32)
    gen = rng()
    xs, h0 = _chunk_problem(gen, b=b, t=t, **heads, dtype=jnp.bfloat16)
    config = dataclasses.replace(PLAIN, block_hv_state=32, block_hv_out=32, solve="nested",
                                 store_kn=True)
    intra, state, output, x = chunk_kernel.stages(*xs, h0, use_qk_l2norm=True, config=config)
    tables = (x["cstart"], x["clen"])
    ins = {"intra": (x["k2"], x["v2"], x["g2"], x["beta2"])}
    gcum, w, u, kn, p = intra(x["q2"], *ins["intra"], *tables)
    assert kn.shape == x["k2"].shape and kn is not x["k2"] and p.shape == (1,)
    outs = {"intra": (gcum, w, u, kn)}
    ins["state"] = (kn, w, u, gcum, x["h0"])
    hbuf, v_new, final, o_dummy = state(kn, w, u, gcum, *tables, x["sfirst"], x["scount"],
                                        x["h0"], x["q2"], p)
    assert o_dummy.shape == (1,)
    outs["state"] = (hbuf, v_new, final)
    ins["output"] = (x["q2"], kn, gcum, hbuf, v_new)
    outs["output"] = (output(*ins["output"], *tables),)
    counts = prof.cost(b, t, config=config, has_init=True, **heads)
    for name in ("intra", "state", "output"):
        nbytes = sum(a.nbytes for a in ins[name] + outs[name])
        assert counts[name]["GB"] * 1e9 == pytest.approx(nbytes), name
        assert counts[name]["GB_rr"] >= counts[name]["GB"]
    # Fused: q in / P out of the intra kernel; the state kernel reads q and P and writes o (no
    # per-chunk states or V_new); no output kernel.
    fused = dataclasses.replace(PLAIN, fuse_output=True)
    intra, state, output, x = chunk_kernel.stages(*xs, h0, use_qk_l2norm=True, config=fused)
    assert output is None
    gcum, w, u, kn, p = intra(x["q2"], *ins["intra"], *tables)
    assert p.shape == (b * t, 2, chunk_kernel.CHUNK) and kn is ins["intra"][0]
    hbuf, v_new, final, o = state(kn, w, u, gcum, *tables, x["sfirst"], x["scount"], x["h0"],
                                  x["q2"], p)
    assert hbuf.shape == v_new.shape == (1,)
    fcounts = prof.cost(b, t, config=fused, has_init=True, **heads)
    nbytes = {"intra": (x["q2"], *ins["intra"], gcum, w, u, p),
              "state": (kn, w, u, gcum, x["h0"], x["q2"], p, final, o)}
    for name, arrays in nbytes.items():
        assert fcounts[name]["GB"] * 1e9 == pytest.approx(sum(a.nbytes for a in arrays)), name
    assert fcounts["output"]["GB"] == fcounts["output"]["GFLOP"] == 0
    # One value tile per output program (block_hv_out = Hv): the same matmuls either way.
    chunks_heads = b * 2 * heads["nv"]
    for cnt, solve in ((counts, "nested"), (fcounts, "subst")):
        solve_flops = chunks_heads * prof.SOLVE_DOTS[solve] * 2 * chunk_kernel.CHUNK**3
        total = sum(c["GFLOP"] for c in cnt.values()) * 1e9 - solve_flops
        assert total == pytest.approx(bench_gdn_prefill.gdn_flops(b, t, 2, 16, 32)), solve


GPU_SPEED_OPTIONS = {
    "solve-nested": dict(solve="nested"), "solve-stacked": dict(solve="stacked"),
    "solve-bf16": dict(solve_bf16=True), "out-bf16": dict(out_bf16=True),
    "kn-decayv-i32-affine": dict(store_kn=True, decay_on_v=True, i32_offsets=True,
                                 affine_state=True),
    "fused": dict(fuse_output=True),
    "fused-all": dict(fuse_output=True, out_bf16=True, store_kn=True, decay_on_v=True,
                      i32_offsets=True, affine_state=True, solve="stacked", state_warps=4),
}


@pytest.mark.gpu
@pytest.mark.parametrize("opts", GPU_SPEED_OPTIONS.values(), ids=GPU_SPEED_OPTIONS.keys())
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T4K", "varlen"])
def test_chunked_speed_options_compiled_on_gpu(opts, varlen):
    """`test_chunked_compiled_on_gpu_at_model_dims` for the speed options: the same inputs and
    the same 2e-2 relative-norm bound against the float32 XLA reference (bf16 rounds at 2^-9:
    the options move the error by at most one more rounding of the output's or the solve's
    operands, 1.8e-2 worst in the interpreter whose casts truncate)."""
    _check_at_model_dims(varlen, dataclasses.replace(PLAIN, **opts))


def test_bench_gdn_prefill_smoke_runs_on_cpu(tmp_path):
    """`python -m experiments.bench_gdn_prefill --smoke` (tiny shapes, interpreter) writes its
    rows, with our outputs close to the XLA reference's."""
    from experiments import bench_gdn_prefill

    rows = bench_gdn_prefill.main(["--smoke", "--out", str(tmp_path)])
    assert {r["kernel"] for r in rows} == {"causal_conv1d", "gdn_chunk_prefill"}
    assert (tmp_path / "gdn_prefill_smoke.json").exists()
    for r in rows:
        err = r.get("rel_err_y_vs_xla", r.get("rel_err_o_vs_xla"))
        assert err is not None and err < 2e-2, r
