"""The row-walking conv1d prefill kernel (`Config(rows=True)`, with and without `rows_split`), with
the exact SiLU (`fast_silu=False`): bitwise the tile kernel's `y` and final state, and the
reference's within tolerance (interpreted on CPU; compiled on GPU against the compiled tile
kernel, with the default `Config()`, tanh SiLU, within bf16 tolerance of it). With `rows_split`
the B2-T13 and varlen problems below have blocks on both paths (blocks of 8 tokens: [16, 24) of
B2-T13 and [32, 38) of varlen hold no start).

Every case uses a C that is not a multiple of BLOCK_C and a token count that is not a multiple of
BLOCK_T (a masked last tile on both axes); varlen packs empty sequences and sequences shorter than
W, so block windows straddle sequence starts at every tap distance.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.conv1d import reference as ref
from attn.conv1d import triton_prefill as prefill
from tests.utils import assert_close, case_id, rng

ref_conv = jax.jit(ref.causal_conv1d, static_argnames=("activation",))
# The exact SiLU, token blocks fastest (the defaults are `fast_silu` and `channels_fastest`).
EXACT = dict(fast_silu=False, channels_fastest=False)
TILE = prefill.Config(block_t=8, block_c=16, rows=False, rows_split=False, **EXACT)
ROWS = prefill.Config(block_t=8, block_c=16, rows=True, rows_split=False, **EXACT)
SPLIT = prefill.Config(block_t=8, block_c=16, rows=True, rows_split=True, **EXACT)
# Empty, shorter than W, block-crossing; 38 tokens in all. Sequence starts at 16 (a block's first
# row: that block needs the zero fill, though its last row's sequence began at or before it) and 25.
LENS = [2, 0, 1, 3, 0, 10, 9, 13]


def _bits(x):
    x = np.asarray(x)
    return x.view({4: np.uint32, 2: np.uint16}[x.dtype.itemsize])


def _problem(gen, *, w, varlen, state, bias, dtype=jnp.bfloat16, c=40, lens=LENS, t=13):
    """`(x, weight, bias, h0, cu_seqlens)`: the packed `lens` with varlen, else B2 rows of `t`."""
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
    return prefill.causal_conv1d(x, weight, bias, initial_state=h0, activation=act,
                                 cu_seqlens=cu, config=config)


def _same(a, b):
    """Both outputs (y, final state) bit for bit."""
    for u, v in zip(a, b, strict=True):
        assert u.shape == v.shape and u.dtype == v.dtype
        np.testing.assert_array_equal(_bits(u), _bits(v))


def _check(rows, tile, expected, split=None):
    (y, final), (y_tile, final_tile), (exp_y, exp_final) = rows, tile, expected
    if split is not None:
        np.testing.assert_array_equal(_bits(split[0]), _bits(y_tile))
    assert y.shape == exp_y.shape and y.dtype == exp_y.dtype
    np.testing.assert_array_equal(_bits(y), _bits(y_tile))
    np.testing.assert_array_equal(_bits(final), _bits(final_tile))
    assert_close(y, exp_y, dtype=y.dtype)
    np.testing.assert_array_equal(_bits(final), _bits(exp_final))


# W3 is slow (~65 s of CPU CI): W2 (a one-column state) and W4 (the models' width) bracket the
# tap loop, and `tests/attn/test_conv1d_triton.py` runs the row kernel at W3 on varlen.
@pytest.mark.parametrize("w", [2, pytest.param(3, marks=pytest.mark.slow), 4])
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T13", "varlen"])
@pytest.mark.parametrize("state", [False, True], ids=["zero-state", "state"])
# Bias without the activation is slow (~96 s of CPU CI): bias-silu and plain take both branches.
@pytest.mark.parametrize("bias,act", [(True, "silu"), (False, None),
                                      pytest.param(True, None, marks=pytest.mark.slow)],
                         ids=["bias-silu", "plain", "bias"])
def test_rows_kernel_is_the_tile_kernel_bitwise(w, varlen, state, bias, act):
    gen = rng()
    args = _problem(gen, w=w, varlen=varlen, state=state, bias=bias)
    x, weight, b, h0, cu = args
    expected = ref_conv(x, weight, b, initial_state=h0, activation=act, cu_seqlens=cu)
    _check(_run(ROWS, *args, act), _run(TILE, *args, act), expected, _run(SPLIT, *args, act))


@pytest.mark.parametrize("cfg", [dict(block_t=4, block_c=32), dict(block_t=16, block_c=16),
                                 dict(block_t=2, block_c=64)],
                         ids=lambda c: case_id(T=c["block_t"], C=c["block_c"]))
def test_rows_kernel_block_shapes_f32(cfg):
    """Blocks shorter than the W - 1 halo (2 rows at W4), longer than whole sequences, one channel
    tile wider than C; float32 inputs, W4, varlen, state, bias, SiLU."""
    gen = rng()
    args = _problem(gen, w=4, varlen=True, state=True, bias=True, dtype=jnp.float32)
    x, weight, b, h0, cu = args
    expected = ref_conv(x, weight, b, initial_state=h0, activation="silu", cu_seqlens=cu)
    _check(_run(prefill.Config(**cfg, rows=True, rows_split=False, **EXACT), *args, "silu"),
           _run(prefill.Config(**cfg, rows=False, rows_split=False, **EXACT), *args, "silu"),
           expected,
           _run(prefill.Config(**cfg, rows=True, rows_split=True, **EXACT), *args, "silu"))


def test_rows_kernel_nan_before_a_sequence_start_stays_out():
    """A NaN in the last token of a sequence must not reach the next one's first W - 1 outputs
    (the zero fill is a select, not a multiply by zero); bitwise the tile kernel's."""
    gen = rng()
    args = list(_problem(gen, w=4, varlen=True, state=False, bias=False, dtype=jnp.float32))
    cu = np.asarray(args[4])
    ends = cu[1:][np.diff(cu) > 0] - 1  # the last token of every non-empty sequence
    args[0] = args[0].at[0, ends[:-1], :].set(jnp.nan)
    y, _ = _run(ROWS, *args, None)
    y_tile, _ = _run(TILE, *args, None)
    np.testing.assert_array_equal(_bits(y), _bits(y_tile))
    np.testing.assert_array_equal(_bits(_run(SPLIT, *args, None)[0]), _bits(y_tile))
    starts = np.setdiff1d(cu[:-1][np.diff(cu) > 0][1:], ends)  # one-token sequences hold a NaN
    assert starts.size and np.isfinite(np.asarray(y)[0, starts]).all()
    assert np.isnan(np.asarray(y)[0, ends[:-1]]).all()


def _gpu_problem(varlen):
    """T32K, C = 8192, W4, bf16, initial state (varlen: four sequences, one shorter than W - 1)."""
    gen = rng()
    t, c = 32768, 8192
    x = jnp.asarray(gen.standard_normal((1, t, c), np.float32), jnp.bfloat16)
    weight = jnp.asarray(gen.standard_normal((c, 4), np.float32) * 0.5, jnp.bfloat16)
    cu = jnp.asarray([0, 2, 1000, 20000, t], jnp.int32) if varlen else None
    h0 = jnp.asarray(gen.standard_normal((4 if varlen else 1, c, 3), np.float32), jnp.bfloat16)

    def run(config):
        return jax.jit(lambda x, w: prefill.causal_conv1d(
            x, w, initial_state=h0, activation="silu", cu_seqlens=cu, config=config))(x, weight)

    # The compiled tile kernel is the anchor: an XLA reference at T32K made these tests hang once.
    return run, run(prefill.Config(block_t=8, block_c=512, rows=False, rows_split=False, **EXACT))


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["B1-T32K", "varlen"])
@pytest.mark.parametrize("cfg", [dict(block_t=16, block_c=1024, num_warps=4),
                                 dict(block_t=32, block_c=1024, num_warps=8),
                                 dict(block_t=16, block_c=1024, num_warps=8, rows_split=True),
                                 dict(block_t=8, block_c=512, num_warps=4, rows_split=True,
                                      channels_fastest=True)],
                         ids=["16x1024w4", "32x1024w8", "16x1024w8-split", "8x512w4-split-cf"])
def test_rows_kernel_compiled_is_the_tile_kernel_bitwise(varlen, cfg):
    """SiLU, exact: the compiled row kernel's y and final state are bitwise the compiled tile
    kernel's (`_gpu_problem`)."""
    run, tile = _gpu_problem(varlen)
    rows = run(prefill.Config(**{**EXACT, "rows_split": False, **cfg, "rows": True}))
    for a, b in zip(rows, tile, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.gpu
@pytest.mark.parametrize("varlen", [False, True], ids=["B1-T32K", "varlen"])
def test_default_config_compiled_is_the_tile_kernel_within_bf16(varlen):
    """The default (`Config()`: 8 x 512, split, `fast_silu` through `tanh.approx.f32`, channels
    fastest): y within bf16 tolerance of the exact tile kernel's, the final state bitwise."""
    run, (y_tile, final_tile) = _gpu_problem(varlen)
    y, final = run(prefill.Config())
    assert y.shape == y_tile.shape and y.dtype == y_tile.dtype
    assert_close(y, y_tile, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(_bits(final), _bits(final_tile))


@pytest.mark.parametrize("base", [TILE, SPLIT], ids=["tile", "rows-split"])
@pytest.mark.parametrize("varlen", [False, True], ids=["B2-T13", "varlen"])
def test_channels_fastest_is_the_same_kernel_bitwise(base, varlen):
    """`Config.channels_fastest` only reorders the programs (a 1-D grid, channel blocks fastest):
    y and the final state bit for bit the 2-D grid's. C = 40 over blocks of 16 (three channel
    blocks, the last masked), so a wrong (token, channel) split of the program id shows."""
    args = _problem(rng(), w=4, varlen=varlen, state=True, bias=True)
    _same(_run(dataclasses.replace(base, channels_fastest=True), *args, "silu"),
          _run(base, *args, "silu"))
