"""The Triton causal conv1d update kernel on the slot pool against the reference: interpreted on
CPU, compiled on GPU.

Every case runs on a pool whose slots not carried by a live row (the null slot 0, free slots and
the slot of a fresh request) hold NaN: outputs must match the reference on the clean pool, the live
slots its new states, and every other slot must come back bitwise unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import conv1d
from attn.conv1d import reference as ref
from attn.conv1d import triton as kernel
from tests.utils import assert_close, case_id, rng

SLOTS = 9
SLOT_IDS = np.asarray([5, 0, 2, 7], np.int32)  # row 1 is padding
HAS_INIT = np.asarray([True, True, False, True])  # row 2 is a fresh request on a stale slot


def _problem(gen, *, b=4, c, w, bias, x_dtype, pool_dtype, slots=SLOTS):
    x = jnp.asarray(gen.standard_normal((b, c), np.float32), x_dtype)
    weight = jnp.asarray(gen.standard_normal((c, w), np.float32) * 0.5, x_dtype)
    b_ = jnp.asarray(gen.standard_normal((c,), np.float32), x_dtype) if bias else None
    pool = jnp.asarray(gen.standard_normal((slots, c, w - 1), np.float32), pool_dtype)
    return x, weight, b_, pool


def _poisoned(pool, slot_ids, has_init):
    """NaN in every slot that no row carries state from (slot 0 included)."""
    carried = slot_ids[(slot_ids > 0) & has_init]
    keep = np.isin(np.arange(pool.shape[0]), carried)[:, None, None]
    return jnp.where(keep, pool, jnp.asarray(jnp.nan, pool.dtype))


def _bits(x):
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


def _check_pool_contract(y, new_pool, pool_in, exp_y, exp_pool, slot_ids):
    dtype = y.dtype
    y, exp_y = np.asarray(y.astype(jnp.float32)), np.asarray(exp_y.astype(jnp.float32))
    live = slot_ids > 0
    assert_close(y[live], exp_y[live], dtype=dtype)
    assert (y[~live] == 0).all(), "padding rows must output exactly 0"
    written = slot_ids[live]
    np.testing.assert_array_equal(_bits(new_pool[written]), _bits(exp_pool[written]))
    others = ~np.isin(np.arange(pool_in.shape[0]), written)
    np.testing.assert_array_equal(_bits(new_pool[others]), _bits(pool_in[others]))


CASES = [
    dict(c=40, w=4, bias=True, act="silu", x=jnp.float32, pool=jnp.float32, block_c=16),
    dict(c=64, w=2, bias=False, act=None, x=jnp.bfloat16, pool=jnp.bfloat16, block_c=32),
    # An f32 input enters the bf16 state (and the convolution) rounded to bf16, as the reference.
    dict(c=24, w=3, bias=True, act="silu", x=jnp.float32, pool=jnp.bfloat16, block_c=16),
]


@pytest.mark.parametrize("c", CASES, ids=lambda c: case_id(
    C=c["c"], W=c["w"], bias=int(c["bias"]), act=c["act"], x=jnp.dtype(c["x"]).name,
    pool=jnp.dtype(c["pool"]).name))
def test_kernel_matches_reference(c):
    gen = rng()
    x, weight, bias, pool = _problem(gen, c=c["c"], w=c["w"], bias=c["bias"], x_dtype=c["x"],
                                     pool_dtype=c["pool"])
    dirty = _poisoned(pool, SLOT_IDS, HAS_INIT)
    init, ids = jnp.asarray(HAS_INIT), jnp.asarray(SLOT_IDS)
    y, new_pool = kernel.causal_conv1d_update_pool(
        x, dirty, ids, weight, bias, c["act"], has_initial_state=init,
        config=kernel.Config(block_c=c["block_c"]))
    exp_y, exp_pool = ref.causal_conv1d_update_pool(x, pool, ids, weight, bias, c["act"],
                                                    has_initial_state=init)
    assert y.dtype == exp_y.dtype and new_pool.dtype == pool.dtype
    # The states are raw inputs: bitwise equal to the reference's.
    _check_pool_contract(y, new_pool, dirty, exp_y, exp_pool, SLOT_IDS)


def test_nan_in_other_slots_changes_nothing_bitwise():
    gen = rng()
    x, weight, bias, pool = _problem(gen, c=32, w=4, bias=True, x_dtype=jnp.float32,
                                     pool_dtype=jnp.float32)
    kw = dict(has_initial_state=jnp.asarray(HAS_INIT), config=kernel.Config(block_c=32))
    ids = jnp.asarray(SLOT_IDS)
    y_a, p_a = kernel.causal_conv1d_update_pool(x, pool, ids, weight, bias, "silu", **kw)
    y_b, p_b = kernel.causal_conv1d_update_pool(x, _poisoned(pool, SLOT_IDS, HAS_INIT), ids,
                                                weight, bias, "silu", **kw)
    np.testing.assert_array_equal(_bits(y_a), _bits(y_b))
    live = SLOT_IDS[SLOT_IDS > 0]
    np.testing.assert_array_equal(_bits(p_a[live]), _bits(p_b[live]))
    assert np.isfinite(np.asarray(y_b)).all()


def test_stray_minus_one_is_padding_and_never_wraps():
    """-1 reads and writes nothing; NaN inputs of padding rows still give exactly 0; no
    has_initial_state means every real row carries its state."""
    gen = rng()
    x, weight, _, pool = _problem(gen, c=32, w=4, bias=False, x_dtype=jnp.float32,
                                  pool_dtype=jnp.float32)
    slot_ids = np.asarray([-1, 3, 0, SLOTS - 2], np.int32)
    x = x.at[0].set(jnp.nan).at[2].set(jnp.nan)
    ids = jnp.asarray(slot_ids)
    y, new_pool = kernel.causal_conv1d_update_pool(x, pool, ids, weight, None, "silu",
                                                   config=kernel.Config(block_c=16))
    exp_y, exp_pool = ref.causal_conv1d_update_pool(x, pool, ids, weight, None, "silu")
    _check_pool_contract(y, new_pool, pool, exp_y, exp_pool, slot_ids)


def test_public_api_dispatches_to_the_kernel_under_jit():
    gen = rng()
    x, weight, bias, pool = _problem(gen, c=48, w=4, bias=True, x_dtype=jnp.bfloat16,
                                     pool_dtype=jnp.bfloat16)
    init, ids = jnp.asarray(HAS_INIT), jnp.asarray(SLOT_IDS)
    run = jax.jit(lambda *a: conv1d.causal_conv1d_update_pool(
        *a, "silu", has_initial_state=init, implementation="triton"))
    y, new_pool = run(x, pool, ids, weight, bias)
    exp_y, exp_pool = ref.causal_conv1d_update_pool(x, pool, ids, weight, bias, "silu",
                                                    has_initial_state=init)
    _check_pool_contract(y, new_pool, pool, exp_y, exp_pool, SLOT_IDS)


def test_config_validation():
    with pytest.raises(ValueError, match="block_c"):
        kernel.Config(block_c=48)
    with pytest.raises(ValueError, match="num_warps"):
        kernel.Config(num_warps=0)


@pytest.mark.gpu
def test_compiled_on_gpu_at_model_dims():
    """B64, C = 8192 (Qwen3.5's conv_dim), W4, bf16, SiLU, padding rows and fresh requests, NaN
    in every slot not carried; the pool donated so the in-place path runs."""
    gen = rng()
    b, slots = 64, 80
    x, weight, _, pool = _problem(gen, b=b, c=8192, w=4, bias=False, x_dtype=jnp.bfloat16,
                                  pool_dtype=jnp.bfloat16, slots=slots)
    slot_ids = (gen.permutation(slots - 1)[:b] + 1).astype(np.int32)
    slot_ids[[3, 40]] = [0, -1]
    has_init = gen.uniform(size=b) > 0.2
    dirty = _poisoned(pool, slot_ids, has_init)
    init, ids = jnp.asarray(has_init), jnp.asarray(slot_ids)
    exp_y, exp_pool = jax.jit(lambda *a: ref.causal_conv1d_update_pool(
        *a, activation="silu", has_initial_state=init))(x, pool, ids, weight)
    run = jax.jit(lambda *a: kernel.causal_conv1d_update_pool(*a, activation="silu",
                                                              has_initial_state=init),
                  donate_argnums=(1,))
    y, new_pool = run(x, dirty, ids, weight)
    _check_pool_contract(y, new_pool, np.asarray(_poisoned(pool, slot_ids, has_init)), exp_y,
                         exp_pool, slot_ids)
