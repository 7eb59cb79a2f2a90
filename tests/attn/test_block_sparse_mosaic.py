"""The Mosaic GPU block-sparse kernel: refusals and the kernel in Pallas's Mosaic GPU interpreter on
the CPU, compiled on the GPU (the Triton kernel's seed geometry: blocks of 128, bf16), against the
reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.block_sparse import block_sparse_attention
from attn.block_sparse import mosaic as kernel
from tests.attn.block_sparse_base import BlockSparseTests, problem
from tests.utils import AttentionTestBase, assert_close, rng


class TestMosaic(BlockSparseTests):
    """The interpreted kernel (`Config(interpret=True)`) under the shared base: its float32 and
    ragged cases are refused with the kernel's reasons (the interpreter itself runs in
    `test_interpreted_kernel_matches_reference`)."""

    implementation = "mosaic"
    config = kernel.Config(interpret=True)


REFUSED = [
    (dict(bs=64), {}, "block_size=64"),
    (dict(h=96, hv=96), {}, "H=96"),
    (dict(dtype=jnp.float32), {}, "dtype"),
    (dict(t=256, s=384), {}, "T=256, S=384"),
    ({}, dict(kv_lengths=np.array([200], np.int32)), "kv_lengths"),
    ({}, {}, "Mosaic GPU kernels compile"),  # everything else fits: no Hopper GPU here
]


@pytest.mark.parametrize("shape,options,match", REFUSED, ids=[r[2] for r in REFUSED])
def test_refusals_name_the_value(shape, options, match):
    if match.startswith("Mosaic GPU kernels") and jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    dims = dict(b=1, t=256, s=256, n=4, kh=2, bs=128, h=64, hv=64, dtype=jnp.bfloat16) | shape
    q, k, v, modes, bm, _ = problem(rng(0), **dims)
    with pytest.raises(NotImplementedError, match=match):
        block_sparse_attention(q, k, v, modes, bm, block_size=dims["bs"], implementation="mosaic",
                               **options)


# (The interpreter needs a CPU thread per warp group: tests/conftest.py sets NPROC.)
def test_interpreted_kernel_matches_reference():
    """Pallas's Mosaic GPU interpreter on the CPU: every mode, an empty list row and the
    diagonal's masked step (blocks of 128: two query tiles of two heads)."""
    q, k, v, modes, bm, _ = problem(rng(3), b=1, t=256, s=256, n=2, kh=1, bs=128, h=64, hv=64,
                                     dtype=jnp.bfloat16, density=0.5)
    modes = jnp.asarray([[1, -1]], jnp.int32)
    bm = bm.at[0, 0, 0].set(False)  # head 0, tile 0: nothing (0 and -inf)
    bm = bm.at[0, 0, 1].set(jnp.asarray([False, True]))  # head 0, tile 1: the diagonal only
    opts = dict(block_size=128, sink_blocks=1, local_blocks=1)
    out, lse = kernel.block_sparse_attention(q, k, v, modes, bm, config=kernel.Config(
        interpret=True), **opts)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    exp_out, exp_lse = block_sparse_attention(*f32, modes, bm, implementation="xla", **opts)
    assert_close(out, exp_out, dtype=jnp.bfloat16)
    assert_close(lse, exp_lse, atol=1e-2, rtol=1e-3, allow_neg_inf=True)


@pytest.mark.gpu
@pytest.mark.parametrize("density", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("g", [1, 4])
def test_gpu_matches_reference(density, g):
    kh = 2
    q, k, v, modes, bm, _ = problem(rng(), b=2, t=2048, s=2048, n=kh * g, kh=kh, bs=128, h=128,
                                     hv=128, dtype=jnp.bfloat16, density=density)
    opts = dict(block_size=128, sink_blocks=1, local_blocks=4)
    out, lse = jax.jit(lambda *a: kernel.block_sparse_attention(*a, **opts))(q, k, v, modes, bm)
    f32 = [x.astype(jnp.float32) for x in (q, k, v)]
    exp_out, exp_lse = block_sparse_attention(*f32, modes, bm, implementation="xla", **opts)
    assert_close(out, exp_out, dtype=jnp.bfloat16)
    assert_close(lse, exp_lse, atol=1e-2, rtol=1e-3, allow_neg_inf=True)
    AttentionTestBase.check_masked_rows(out, lse, np.isfinite(np.asarray(exp_lse)))


@pytest.mark.gpu
def test_gpu_auto_picks_mosaic_and_falls_back():
    """auto runs the Mosaic kernel where it fits (bit for bit the explicit call) and the Triton
    kernel where it does not (shorter lengths)."""
    q, k, v, modes, bm, _ = problem(rng(), b=1, t=1024, s=1024, n=4, kh=2, bs=128, h=128,
                                     hv=128, dtype=jnp.bfloat16, density=0.3)
    opts = dict(block_size=128, sink_blocks=1, local_blocks=2)
    auto = block_sparse_attention(q, k, v, modes, bm, implementation="auto", **opts)
    mosaic = block_sparse_attention(q, k, v, modes, bm, implementation="mosaic", **opts)
    np.testing.assert_array_equal(np.asarray(auto[0]), np.asarray(mosaic[0]))
    lengths = dict(q_lengths=jnp.asarray([900]), kv_lengths=jnp.asarray([900]))
    out, _ = block_sparse_attention(q, k, v, modes, bm, implementation="auto", **opts, **lengths)
    want, _ = block_sparse_attention(q, k, v, modes, bm, implementation="triton", **opts,
                                     **lengths)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
