"""The Triton GDN decode kernel on the slot pool against the reference: interpreted on CPU,
compiled on GPU.

Every case runs on a pool whose slots not carried by a live row (the null slot 0, free slots and
the slot of a fresh request) hold NaN: outputs must match the reference on the clean pool, the live
slots its new states, and every other slot must come back bitwise unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import gdn
from attn.gdn import reference as ref
from attn.gdn import triton as kernel
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


def test_nan_in_other_slots_changes_nothing_bitwise():
    """A neighbour's NaN slot, a NaN null slot and a NaN stale slot of a fresh request: the same
    outputs and new states, bit for bit, as with finite old states there."""
    gen = rng()
    xs, pool = _problem(gen, nk=2, nv=4, h=16, hv=16)
    kw = dict(has_initial_state=jnp.asarray(HAS_INIT), use_qk_l2norm=True,
              config=kernel.Config(block_hv=16))
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
