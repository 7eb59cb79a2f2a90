"""The fused Mosaic block-sparse backward (`attn/block_sparse/mosaic_bwd.py`) through the Mosaic
forward: interpreted on the CPU and compiled on the GPU, against the reference's gradients, with
key blocks that no query selects and programs cut into float32 partial sums."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.block_sparse import _triton_bwd, effective_block_mask, mosaic_bwd
from attn.block_sparse import mosaic as sparse_mosaic
from tests.attn.test_block_sparse_bwd import _clean, _grads, _problem, _rel
from tests.utils import assert_close, rng


def _cut_programs(modes, bm, opts, t, kh, num_sms):
    """How many programs the fused backward's schedule cuts for this problem."""
    eff = effective_block_mask(modes, bm, num_q_tokens=t, num_kv_tokens=t, **opts)
    lengths = jnp.full((modes.shape[0],), t, jnp.int32)
    _, count, _ = _triton_bwd.transposed_lists(eff, lengths, lengths, 128, kh)
    _, cut = _triton_bwd.dkv_schedule(count, t // 128, 128, 128, 64, num_sms)
    return int(jnp.sum(cut[0] >= 0))


def test_routing_names_what_keeps_the_triton_backward():
    assert mosaic_bwd.supports((1, 256, 4, 128), 128) == []
    assert any("H=64" in r for r in mosaic_bwd.supports((1, 256, 4, 64), 128))
    assert any("block_size=64" in r for r in mosaic_bwd.supports((1, 256, 4, 128), 64))


def test_interpreted_backward_matches_reference():
    """Every mode over two GQA groups (full and streaming heads on KV head 0, block-mask heads
    on KV head 1, whose key block 1 no query selects: zero dK / dV rows); the fair share of 2 SMs
    cuts the long programs (the sink block's), whose partial sums are added afterwards."""
    t, kh = 256, 2
    qkv, _, bm, _, cot = _problem(rng(5), b=1, t=t, s=t, n=4, kh=kh, bs=128, h=128, hv=128,
                                  dtype=jnp.bfloat16, density=0.5)
    modes = jnp.asarray([[0, -1, 1, 1]], jnp.int32)
    bm = bm.at[0, 2:, :, 1].set(False)
    opts = dict(block_size=128, sink_blocks=1, local_blocks=1)
    assert _cut_programs(modes, bm, opts, t, kh, num_sms=2) > 0
    config = sparse_mosaic.Config(interpret=True, backward_sms=2)
    got, _ = _grads(qkv, modes, bm, cot, implementation="mosaic", config=config, **opts)
    exp, _ = _grads([x.astype(jnp.float32) for x in qkv], modes, bm, cot,
                    implementation="xla", **opts)
    for name, a, e in zip(("dq", "dk", "dv"), got, exp, strict=True):
        assert_close(a, e, dtype=jnp.bfloat16, err_msg=name)
    unselected = np.asarray(got[1][0, 128:256, 1], np.float32)
    np.testing.assert_array_equal(unselected, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("density", [0.1, 0.6])
def test_gpu_fused_matches_reference_and_triton(density):
    """Compiled at T2K, G4: cut programs present; gradients as close to the float32 reference
    as the bf16 reference is (QUALITY.md's 3x) and close to the Triton backward's."""
    t, kh, g = 2048, 4, 4
    qkv, modes, bm, _, cot = _problem(rng(), b=2, t=t, s=t, n=kh * g, kh=kh, bs=128, h=128,
                                      hv=128, dtype=jnp.bfloat16, density=density)
    opts = dict(block_size=128, sink_blocks=1, local_blocks=4)
    assert _cut_programs(modes, bm, opts, t, kh, num_sms=132) > 0

    def grads(config):
        return jax.jit(lambda *x: _grads(x, modes, bm, cot, implementation="mosaic",
                                         config=config, **opts)[0])(*qkv)

    got = grads(sparse_mosaic.Config(backward_sms=132))
    triton = grads(sparse_mosaic.Config(fused_backward=False))
    clean = [_clean(x) for x in qkv]
    exp, _ = _grads([x.astype(jnp.float32) for x in clean], modes, bm, cot,
                    implementation="xla", **opts)
    same_precision, _ = _grads(clean, modes, bm, cot, implementation="xla", **opts)
    for name, a, tr, e, r in zip(("dq", "dk", "dv"), got, triton, exp, same_precision,
                                 strict=True):
        assert np.isfinite(np.asarray(a, np.float32)).all(), name
        assert _rel(a, e) <= 3 * _rel(r, e) + 1e-3, (name, _rel(a, e), _rel(r, e))
        assert _rel(a, tr) <= 1e-2, (name, _rel(a, tr))
