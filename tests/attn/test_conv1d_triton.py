"""The Triton causal conv1d kernels against the reference: interpreted on CPU, compiled on GPU.

Update kernel on the slot pool: every case runs on a pool whose slots not carried by a live row
(the null slot 0, free slots and the slot of a fresh request) hold NaN: outputs must match the
reference on the clean pool, the live slots its new states, and every other slot must come back
bitwise unchanged.

Prefill kernel: the edge lengths around W and the 64-token tiles, with and without a state,
f32 and bf16, packed sequences (empty ones, ones shorter than W), blocks on both the zero-fill
and the select-free path; outputs start as NaN in the interpreter, so an unwritten element fails;
final states are raw inputs and must match bitwise. The tanh SiLU (`Config.fast_silu`) is exact
in the interpreter: there the tests check its algebra and plumbing, and the compile check (any
machine) and the GPU tests check `tanh.approx.f32`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import conv1d
from attn.conv1d import reference as ref
from attn.conv1d import triton as kernel
from attn.conv1d import triton_prefill as prefill_kernel
from tests.utils import assert_close, case_id, compile_for_sm90, rng

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


# Prefill kernel (`attn/conv1d/triton_prefill.py`).

PREFILL_LENGTHS = (1, 3, 4, 5, 63, 64, 65, 200)  # shorter than, equal to, just past W; tiles of 64
# One compile per shape instead of op-by-op dispatch: about twice as fast on the CPU.
ref_conv = jax.jit(ref.causal_conv1d, static_argnames=("activation",))
# The exact SiLU on blocks of 8 tokens x 16 channels.
EXACT = prefill_kernel.Config(block_t=8, block_c=16, fast_silu=False)
# Empty, shorter than W, block-crossing; 38 tokens in all. Sequence starts at 16 (a block's first
# row: that block needs the zero fill, though its last row's sequence began at or before it) and
# 25. With blocks of 8 tokens, [32, 38) of these and [16, 24) of B2-T13 hold no start: both the
# zero-fill and the select-free path run.
LENS = [2, 0, 1, 3, 0, 10, 9, 13]


def _prefill_problem(gen, *, b, t, c, w=4, dtype, state, bias=True, state_dtype=None):
    x = jnp.asarray(gen.standard_normal((b, t, c), np.float32), dtype)
    weight = jnp.asarray(gen.standard_normal((c, w), np.float32) * 0.5, dtype)
    bias_ = jnp.asarray(gen.standard_normal((c,), np.float32), dtype) if bias else None
    h0 = None
    if state:
        h0 = jnp.asarray(gen.standard_normal((b, c, w - 1), np.float32), state_dtype or dtype)
    return x, weight, bias_, h0


def _packed_problem(gen, *, w, varlen, state, bias, dtype=jnp.bfloat16, c=40, lens=LENS, t=13):
    """`(x, weight, bias, h0, cu_seqlens)`: the packed `lens` with varlen, else B2 rows of `t`;
    C = 40 is not a multiple of the channel block and neither token count of the token block (a
    masked last block on both axes)."""
    if varlen:
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        b, t, ns = 1, int(cu[-1]), len(lens)
        cu = jnp.asarray(cu)
    else:
        b, ns, cu = 2, 2, None
    x = jnp.asarray(gen.standard_normal((b, t, c), np.float32), dtype)
    weight = jnp.asarray(gen.standard_normal((c, w), np.float32) * 0.5, dtype)
    bias_ = jnp.asarray(gen.standard_normal((c,), np.float32), dtype) if bias else None
    h0 = jnp.asarray(gen.standard_normal((ns, c, w - 1), np.float32), dtype) if state else None
    return x, weight, bias_, h0, cu


def _run(config, x, weight, bias, h0, cu, act):
    return prefill_kernel.causal_conv1d(x, weight, bias, initial_state=h0, activation=act,
                                        cu_seqlens=cu, config=config)


def _check_prefill(y, final, exp_y, exp_final):
    assert y.shape == exp_y.shape and y.dtype == exp_y.dtype
    assert final.shape == exp_final.shape and final.dtype == exp_final.dtype
    assert_close(y, exp_y, dtype=y.dtype)
    # The final state holds raw inputs: bitwise equal.
    np.testing.assert_array_equal(_bits(final), _bits(exp_final))


# Slow: float32 (`test_prefill_kernel_varlen[f32]` runs the same kernel on lengths 1, 3, 5, 64
# and 65 with and without states, `test_prefill_kernel_block_shapes_f32` the f32 SiLU with bias)
# and the zero state (no fix-up kernel: `test_prefill_kernel_varlen` runs it on those lengths, the
# exact-SiLU tests on B2 rows).
@pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow),
                                   jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("state", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["zero-state", "state"])
def test_prefill_kernel_matches_reference_on_edge_lengths(dtype, state):
    """B2, C40 (a masked channel tile), tiles of 32 tokens so a tile straddles the two rows."""
    gen = rng()
    cfg = prefill_kernel.Config(block_t=32, block_c=64)
    for t in PREFILL_LENGTHS:
        x, weight, bias, h0 = _prefill_problem(gen, b=2, t=t, c=40, dtype=dtype, state=state)
        y, final = prefill_kernel.causal_conv1d(x, weight, bias, initial_state=h0,
                                                activation="silu", config=cfg)
        exp_y, exp_final = ref_conv(x, weight, bias, initial_state=h0, activation="silu")
        _check_prefill(y, final, exp_y, exp_final)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_prefill_kernel_varlen(dtype):
    """Packed sequences of 2, 0, 1, 3, 5, 64, 65 and 60 tokens (shorter than W - 1, empty, one
    chunk, tile-crossing), each with its own state; no activation, W3, no bias."""
    gen = rng()
    lens = [2, 0, 1, 3, 5, 64, 65, 60]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    for state in (True, False):
        x = jnp.asarray(gen.standard_normal((1, int(cu[-1]), 24), np.float32), dtype)
        weight = jnp.asarray(gen.standard_normal((24, 3), np.float32), dtype)
        h0 = (jnp.asarray(gen.standard_normal((len(lens), 24, 2), np.float32), dtype)
              if state else None)
        y, final = prefill_kernel.causal_conv1d(
            x, weight, initial_state=h0, cu_seqlens=jnp.asarray(cu),
            config=prefill_kernel.Config(block_t=32, block_c=16))
        exp_y, exp_final = ref_conv(x, weight, initial_state=h0, cu_seqlens=jnp.asarray(cu))
        _check_prefill(y, final, exp_y, exp_final)


# W3 is slow: W2 (a one-column state) and W4 (the models' width) bracket the tap loop, and
# `test_prefill_kernel_varlen` runs W3. Bias without the activation is slow: bias-silu and plain
# take both branches.
@pytest.mark.parametrize("w", [2, pytest.param(3, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T13", "varlen"])
@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("bias,act", [(True, "silu"), (False, None),
                                      pytest.param(True, None, marks=pytest.mark.slow)],
                         ids=["bias-silu", "plain", "bias"])
def test_prefill_kernel_exact_silu_zero_fill_and_select_free_blocks(w, varlen, state, bias, act):
    """bf16, the exact SiLU, blocks of 8 tokens: blocks that hold a sequence start (taps before
    it read zero) and blocks that hold none (the select-free copy of the row loop) against the
    reference."""
    args = _packed_problem(rng(), w=w, varlen=varlen, state=state, bias=bias)
    x, weight, b, h0, cu = args
    _check_prefill(*_run(EXACT, *args, act),
                   *ref_conv(x, weight, b, initial_state=h0, activation=act, cu_seqlens=cu))


@pytest.mark.parametrize("cfg", [dict(block_t=4, block_c=32), dict(block_t=16, block_c=16),
                                 dict(block_t=2, block_c=64)],
                         ids=lambda c: case_id(T=c["block_t"], C=c["block_c"]))
def test_prefill_kernel_block_shapes_f32(cfg):
    """Blocks shorter than the W - 1 halo (2 rows at W4), longer than whole sequences, one channel
    tile wider than C; float32 inputs, W4, varlen, state, bias, SiLU."""
    args = _packed_problem(rng(), w=4, varlen=True, state=True, bias=True, dtype=jnp.float32)
    x, weight, b, h0, cu = args
    _check_prefill(*_run(prefill_kernel.Config(**cfg), *args, "silu"),
                   *ref_conv(x, weight, b, initial_state=h0, activation="silu", cu_seqlens=cu))


def test_prefill_kernel_nan_before_a_sequence_start_stays_out():
    """A NaN in the last token of a sequence must not reach the next one's first W - 1 outputs
    (the zero fill is a select, not a multiply by zero); every other output as the reference's."""
    args = list(_packed_problem(rng(), w=4, varlen=True, state=False, bias=False,
                                dtype=jnp.float32))
    cu = np.asarray(args[4])
    ends = cu[1:][np.diff(cu) > 0] - 1  # the last token of every non-empty sequence
    args[0] = args[0].at[0, ends[:-1], :].set(jnp.nan)
    y = np.asarray(_run(EXACT, *args, None)[0])
    starts = np.setdiff1d(cu[:-1][np.diff(cu) > 0][1:], ends)  # one-token sequences hold a NaN
    assert starts.size and np.isfinite(y[0, starts]).all()
    assert np.isnan(y[0, ends[:-1]]).all()
    exp_y = np.asarray(ref_conv(args[0], args[1], cu_seqlens=args[4])[0])
    np.testing.assert_array_equal(np.isnan(y), np.isnan(exp_y))
    finite = ~np.isnan(exp_y)
    assert_close(y[finite], exp_y[finite])


def test_prefill_kernel_f32_state_into_bf16_input_and_width_two():
    """The state is rounded to x's dtype as in the reference; W2 keeps a one-column state."""
    gen = rng()
    x, weight, bias, h0 = _prefill_problem(gen, b=2, t=5, c=16, w=2, dtype=jnp.bfloat16,
                                           state=True, state_dtype=jnp.float32)
    y, final = prefill_kernel.causal_conv1d(x, weight, bias, initial_state=h0)
    exp_y, exp_final = ref_conv(x, weight, bias, initial_state=h0)
    _check_prefill(y, final, exp_y, exp_final)


def test_fast_silu_is_the_default():
    cfg = prefill_kernel.Config()
    assert cfg.fast_silu and (cfg.block_t, cfg.block_c, cfg.num_warps) == (8, 512, 4)


@pytest.mark.parametrize("dtype,block_t", [(jnp.bfloat16, 8), (jnp.float16, 4)],
                         ids=["bf16-T8", "f16-T4"])
def test_fast_silu_within_half_precision_of_the_reference(dtype, block_t):
    """B2 rows of 45 and packed sequences (empty, shorter than W, starting mid-block), W4, state,
    bias: y within half-precision tolerance, the final state still the exact one."""
    gen = rng()
    cfg = prefill_kernel.Config(block_t=block_t, block_c=16)
    assert cfg.fast_silu
    for varlen in (False, True):
        x, weight, b, h0, cu = _packed_problem(gen, w=4, varlen=varlen, state=True, bias=True,
                                               dtype=dtype, lens=LENS + [17], t=45)
        y, final = _run(cfg, x, weight, b, h0, cu, "silu")
        exp_y, exp_final = ref_conv(x, weight, b, initial_state=h0, activation="silu",
                                    cu_seqlens=cu)
        assert y.dtype == exp_y.dtype
        assert_close(y, exp_y, dtype=dtype)
        np.testing.assert_array_equal(_bits(final), _bits(exp_final))


def test_fast_silu_is_ignored_for_float32():
    """float32 outputs keep the exact SiLU: bit for bit the `fast_silu=False` results."""
    args = _packed_problem(rng(), w=4, varlen=True, state=True, bias=True, dtype=jnp.float32)
    fast = prefill_kernel.Config(block_t=4, block_c=16)
    exact = dataclasses.replace(fast, fast_silu=False)
    for a, b in zip(_run(fast, *args, "silu"), _run(exact, *args, "silu"), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_prefill_public_api_and_pool_dispatch_to_the_kernel_under_jit():
    """`causal_conv1d` and `causal_conv1d_prefill_pool` with implementation="triton" under jit
    give the reference's outputs; the pool keeps its NaN slots bitwise and padding rows give 0."""
    gen = rng()
    x, weight, bias, h0 = _prefill_problem(gen, b=4, t=7, c=32, dtype=jnp.bfloat16, state=True)
    run = jax.jit(lambda *a: conv1d.causal_conv1d(*a[:3], initial_state=a[3], activation="silu",
                                                  implementation="triton"))
    _check_prefill(*run(x, weight, bias, h0),
                   *ref_conv(x, weight, bias, initial_state=h0, activation="silu"))

    pool = jnp.asarray(gen.standard_normal((SLOTS, 32, 3), np.float32), jnp.bfloat16)
    dirty = _poisoned(pool, SLOT_IDS, HAS_INIT)
    init, ids = jnp.asarray(HAS_INIT), jnp.asarray(SLOT_IDS)
    run_pool = jax.jit(lambda *a: conv1d.causal_conv1d_prefill_pool(
        *a, activation="silu", has_initial_state=init, implementation="triton"))
    y, new_pool = run_pool(x, dirty, ids, weight, bias)
    exp_y, exp_pool = ref.causal_conv1d_prefill_pool(x, pool, ids, weight, bias,
                                                     activation="silu", has_initial_state=init)
    live = SLOT_IDS > 0
    assert_close(np.asarray(y)[live], np.asarray(exp_y)[live], dtype=jnp.bfloat16)
    assert (np.asarray(y.astype(jnp.float32))[~live] == 0).all()
    written = SLOT_IDS[live]
    np.testing.assert_array_equal(_bits(new_pool[written]), _bits(exp_pool[written]))
    others = ~np.isin(np.arange(SLOTS), SLOT_IDS)
    np.testing.assert_array_equal(_bits(new_pool[others]), _bits(dirty[others]))


def test_prefill_config_validation():
    with pytest.raises(ValueError, match="block_t"):
        prefill_kernel.Config(block_t=48)
    with pytest.raises(ValueError, match="block_c"):
        prefill_kernel.Config(block_c=8)
    with pytest.raises(ValueError, match="num_warps"):
        prefill_kernel.Config(num_warps=3)


def test_prefill_kernel_gradient_is_the_references():
    """The kernel is forward-only; `jax.grad` through it gives the reference's VJP (varlen, state,
    bias)."""
    gen = rng()
    cu = jnp.asarray([0, 2, 7], jnp.int32)
    x, weight, bias, _ = _prefill_problem(gen, b=1, t=7, c=16, dtype=jnp.float32, state=False)
    h0 = jnp.asarray(gen.standard_normal((2, 16, 3), np.float32))
    cot = jnp.asarray(gen.standard_normal((1, 7, 16), np.float32))

    def loss(conv, *a):
        y, final = conv(*a[:3], initial_state=a[3], activation="silu", cu_seqlens=cu)
        return jnp.sum(y * cot) + jnp.sum(final)

    argnums = (0, 1, 2, 3)
    grads = jax.jit(jax.grad(functools.partial(loss, prefill_kernel.causal_conv1d),
                             argnums=argnums))(x, weight, bias, h0)
    expected = jax.jit(jax.grad(functools.partial(loss, ref.causal_conv1d), argnums=argnums))(
        x, weight, bias, h0)
    for a, e in zip(grads, expected, strict=True):
        assert_close(a, e)


# Compiled for sm_90 (T32K C8192 W4 bf16 SiLU, no bias, no varlen): the default and two others,
# `(block_t, block_c, warps, fast_silu)`.
COMPILED = [(8, 512, 4, True), (16, 1024, 4, True), (8, 512, 4, False)]


@pytest.mark.slow
def test_prefill_kernel_compiles_for_sm90_without_spills():
    """The default config and two others compiled for Hopper on any machine: no spills (ptxas
    -v), and the fast SiLU emits `tanh.approx.f32` (absent from the exact one)."""
    default = prefill_kernel.Config()
    assert (default.block_t, default.block_c, default.num_warps, default.fast_silu) == COMPILED[0]
    types = dict(x_ptr="*bf16", w_ptr="*bf16", bias_ptr="*fp32", seq_ptr="*i32", cu_ptr="*i32",
                 y_ptr="*bf16")
    jobs = [dict(kernel="attn.conv1d.triton_prefill:_conv_prefill_kernel", pointers=types,
                 constexprs=dict(N_TOK=32768, T_ROW=32768, C=8192, W=4, HAS_BIAS=False,
                                 VARLEN=False, SILU=True, BLOCK_T=bt, BLOCK_C=bc, FAST_SILU=fast,
                                 HW_TANH=True, NC=8192 // bc),
                 num_warps=warps, num_stages=2, count=["tanh.approx.f32"])
            for bt, bc, warps, fast in COMPILED]
    for (*_, fast), r in zip(COMPILED, compile_for_sm90(jobs), strict=True):
        assert (r["count"]["tanh.approx.f32"] > 0) == fast, r
        assert r["spill_stores"] == 0, r


# On the GPU: the default config, the exact SiLU and two wider blocks against the XLA reference.
GPU_PREFILL_CONFIGS = {"default": {}, "exact-silu": dict(fast_silu=False),
                       "16x1024w4": dict(block_t=16, block_c=1024),
                       "32x1024w8": dict(block_t=32, block_c=1024, num_warps=8)}


@pytest.mark.gpu
@pytest.mark.parametrize("opts", GPU_PREFILL_CONFIGS.values(), ids=GPU_PREFILL_CONFIGS.keys())
@pytest.mark.parametrize("varlen", [False, True], ids=["B1-T32K", "varlen"])
def test_prefill_compiled_on_gpu_at_model_dims(varlen, opts):
    """T32K, C = 8192 (Qwen3.5's conv_dim), W4, bf16, SiLU, initial state; varlen: four packed
    sequences (one shorter than W - 1): y within bf16 tolerance of the XLA reference (the tanh
    SiLU's 2^-11 relative error is below bf16's rounding), the final state bitwise."""
    gen = rng()
    x, weight, _, h0 = _prefill_problem(gen, b=1, t=32768, c=8192, dtype=jnp.bfloat16,
                                        state=True, bias=False)
    cu = None
    if varlen:
        cu = jnp.asarray([0, 2, 1000, 20000, 32768], jnp.int32)
        h0 = jnp.asarray(gen.standard_normal((4, 8192, 3), np.float32), jnp.bfloat16)
    config = prefill_kernel.Config(**opts)
    y, final = jax.jit(lambda *a: prefill_kernel.causal_conv1d(
        *a, initial_state=h0, activation="silu", cu_seqlens=cu, config=config))(x, weight)
    exp_y, exp_final = jax.jit(lambda *a: ref.causal_conv1d(
        *a, initial_state=h0, activation="silu", cu_seqlens=cu))(x, weight)
    _check_prefill(y, final, exp_y, exp_final)
