"""The Mosaic GPU XAttention score kernel (`attn/xattention/mosaic.py`): its tile table against
brute-force reachability, its refusals, the whole fp8 estimate through it in Pallas's Mosaic GPU
interpreter (CPU) against the reference on the same e4m3 rounding, and compiled on a Hopper GPU
against the Triton fp8 path."""

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
import pytest

from attn._op import device_facts
from attn.xattention import mosaic, xattn_estimate
from attn.xattention import triton as kernel
from tests.utils import randn, rng

BF16 = jnp.bfloat16


def _inputs(t, s, n, kh):
    gen = rng()
    return randn(gen, (1, t, n, 128), BF16), randn(gen, (1, s, kh, 128), BF16)


@pytest.mark.parametrize("rows,cols,block_r,block_c", [
    (128, 128, 128, 128), (256, 512, 128, 256), (384, 512, 128, 128), (128, 1024, 128, 256),
    (256, 256, 192, 256), (448, 768, 192, 128), (512, 512, 192, 256)])
def test_tile_table_lists_exactly_the_reachable_tiles(rows, cols, block_r, block_c):
    shift = cols - rows
    m, c = np.arange(rows)[:, None], np.arange(cols)[None, :]
    visible = c <= m + shift
    want = {(i, j) for i in range(-(-rows // block_r)) for j in range(cols // block_c)
            if visible[i * block_r:(i + 1) * block_r, j * block_c:(j + 1) * block_c].any()}
    table = mosaic.tile_table(rows, cols, block_r, block_c)
    assert len(table) == len(want) and {tuple(x) for x in table} == want
    assert list(table[:, 0]) == sorted(table[:, 0], reverse=True)  # longest row tiles first


def test_block_matrix_sums_each_key_block():
    e = mosaic.block_matrix(256)
    assert e.shape == (256, 32) and e.dtype == np.float16
    np.testing.assert_array_equal(np.arange(256) @ e, [sum(range(8 * j, 8 * j + 8))
                                                       for j in range(32)])


@pytest.mark.parametrize("shapes,options,match", [
    (((2048, 64), (4096, 64)), {}, "H=64"),
    (((2048, 128), (4096, 128)), {"block_size": 64}, "block_size / stride"),
    (((1536, 128), (4096, 128)), {}, "T=1536"),
    (((2048, 128), (2048, 128)), {}, "S=2048"),
    (((8192, 128), (4096, 128)), {}, "T <= S"),
    (((2048, 128), (4096, 128)), {"kv_lengths": jnp.array([2000])}, "kv_lengths"),
    (((2048, 128), (4096, 128)), {"q_lengths": jnp.array([2048])}, None),  # full: accepted
    # Interpreted, a last row tile past T / st (192 reduced rows) would copy out of bounds.
    (((3072, 128), (4096, 128)), {}, "T=3072: interpreted"),
])
def test_refusals_name_the_value(shapes, options, match):
    (t, h), (s, hk) = shapes
    q, k = jnp.zeros((1, t, 2, h), BF16), jnp.zeros((1, s, 1, hk), BF16)
    kw = dict(block_size=128, stride=16, q_lengths=None, kv_lengths=None,
              config=mosaic.Config(interpret=True)) | options
    if match is None:
        mosaic.check_supported(q, k, **kw)
    else:
        with pytest.raises(NotImplementedError, match=match):
            mosaic.check_supported(q, k, **kw)


@pytest.mark.parametrize("kw,match", [({"block_c": 64}, "block_c=64"),
                                      ({"stages": 1}, "stages=1")])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        mosaic.Config(**kw)
    with pytest.raises(ValueError, match="programs=0"):
        mosaic.Config(programs=0)
    with pytest.raises(ValueError, match="fp8"):
        kernel.Config(mosaic=mosaic.Config())


def test_shared_memory_is_the_devices():
    """5 slots at 256 columns take 262144 bytes, more than the device's shared memory (an
    H100's on a CPU): a reason, and the estimate runs the Triton score kernel instead."""
    q, k = jnp.zeros((1, 2048, 2, 128), BF16), jnp.zeros((1, 4096, 1, 128), BF16)
    kw = dict(block_size=128, stride=16, q_lengths=None, kv_lengths=None)
    big = mosaic.Config(stages=5, interpret=True)
    assert big.smem_bytes == 262144 > device_facts().shared_memory
    (reason,) = mosaic.reasons(q, k, config=big, **kw)
    assert re.search(r"stages=5 .* 262144 bytes .* the device's \d+", reason), reason
    assert mosaic.reasons(q, k, config=mosaic.Config(stages=4, interpret=True), **kw) == []


# (A last row tile running past T / st, e.g. T = 3072, is left to the GPU tests: TMA fills its
# rows with zeros there, the interpreter's copies fail out of bounds.)
# (The interpreter needs a CPU thread per warp group: tests/conftest.py sets NPROC.)
@pytest.mark.parametrize("t,s,block_c,programs", [
    # Keys ahead of the queries (128 reduced columns); one tile a pair, one program walking both
    # pairs' tiles through one ring of slots.
    (2048, 4096, 256, 1),
    # Three tiles a pair (two row tiles, two column tiles, the causal corner skipped), six items
    # over two programs.
    pytest.param(4096, 4096, 128, 2, marks=pytest.mark.slow),
])
def test_interpreted_estimate_matches_reference(t, s, block_c, programs):
    q, k = _inputs(t, s, n=2, kh=1)
    config = kernel.Config(fp8=True, block_k=128, mosaic=mosaic.Config(
        block_c=block_c, stages=2, programs=programs, interpret=True))
    # The Mosaic kernel runs (the estimate would fall back to Triton's if it refused).
    mosaic.check_supported(q, k, block_size=128, stride=16, q_lengths=None, kv_lengths=None,
                           config=config.mosaic)
    sums, mask = kernel.xattn_estimate(q, k, config=config)
    want_sums, want_mask = xattn_estimate(q, k, implementation="xla", fp8=True)
    # p enters the block-sum product in f16: ~2^-11 relative per entry.
    np.testing.assert_allclose(sums, want_sums, rtol=2e-3, atol=1e-5)
    assert np.mean(np.asarray(mask) == np.asarray(want_mask)) > 0.99


def test_unsupported_lengths_fall_back_to_triton():
    q, k = _inputs(2048, 2048, n=2, kh=1)
    lengths = jnp.array([1500])
    config = kernel.Config(fp8=True, block_k=128, mosaic=mosaic.Config(block_c=128,
                                                                       interpret=True))
    sums, _ = kernel.xattn_estimate(q, k, q_lengths=lengths, kv_lengths=lengths, config=config)
    want, _ = kernel.xattn_estimate(q, k, q_lengths=lengths, kv_lengths=lengths,
                                    config=dataclasses.replace(config, mosaic=None))
    np.testing.assert_array_equal(sums, want)


@pytest.mark.gpu
@pytest.mark.parametrize("t,s,n,kh,block_c,stages,programs", [
    (8192, 8192, 8, 2, 256, 3, None),  # one program per SM
    (8192, 8192, 8, 2, 256, 3, 7),
    (4096, 8192, 4, 4, 128, 4, None),
    (8192, 16384, 6, 1, 256, 2, 1000),  # more programs than tiles
    (3072, 4096, 4, 2, 128, 3, None),  # 192 reduced rows: the last row tile half past them
])
def test_gpu_matches_triton_fp8(t, s, n, kh, block_c, stages, programs):
    q, k = _inputs(t, s, n, kh)
    config = dataclasses.replace(kernel.FP8_CONFIG, mosaic=mosaic.Config(
        block_c=block_c, stages=stages, programs=programs))
    mosaic.check_supported(q, k, block_size=128, stride=16, q_lengths=None, kv_lengths=None,
                           config=config.mosaic)
    sums, mask = kernel.xattn_estimate(q, k, config=config)
    want_sums, want_mask = kernel.xattn_estimate(
        q, k, config=dataclasses.replace(kernel.FP8_CONFIG, mosaic=None))  # Triton's scores
    np.testing.assert_allclose(sums, want_sums, rtol=3e-3, atol=1e-5)
    assert np.mean(np.asarray(mask) == np.asarray(want_mask)) > 0.999
