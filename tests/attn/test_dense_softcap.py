"""Logit soft-capping on dense attention (`softcap`), on every backend through the shared base.

The reference is checked against an independent float64 formula; the Triton kernel soft-caps in
its forward and takes the reference's gradient (its backward kernels do not soft-cap: the
backend's `backward_supports` says so); the Mosaic GPU kernel refuses it with a reason.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import attention, mosaic
from attn.dense import triton as dense_triton
from tests.attn.dense_base import DenseAttentionTests, qkv, softcapped_attention_numpy
from tests.utils import assert_close


class TestXla(DenseAttentionTests):
    implementation = "xla"


class TestTriton(DenseAttentionTests):
    implementation = "triton"


class TestMosaic(DenseAttentionTests):
    implementation = "mosaic"
    config = mosaic.Config(interpret=True)


@pytest.mark.parametrize("softcap", [0.5, 2.0, 50.0])
def test_reference_matches_the_formula(softcap):
    q, k, v = qkv(3, (2, 6, 9, 4, 2, 8, 8))
    q = q * 4  # logits of a few units: the cap bites
    out, _ = attention(q, k, v, softcap=softcap, implementation="xla")
    exp = softcapped_attention_numpy(q, k, v, softcap, 8**-0.5)
    assert_close(out, exp.astype(np.float32), atol=1e-5, rtol=1e-5)
    plain, _ = attention(q, k, v, implementation="xla")
    if softcap < 50:  # the cap changes the result (a large cap is almost no cap)
        assert float(jnp.max(jnp.abs(out - plain))) > 1e-3


def test_capabilities_are_data():
    q, k, v = qkv(0, (1, 4, 4, 2, 1, 16, 16))
    assert attention.reasons("triton", q, k, v, softcap=5.0) == []
    args = attention.validate(q, k, v, softcap=5.0)
    assert dense_triton.backward_supports(args) == ["soft-capping (no softcap backward)"]
    assert dense_triton.backward_supports(attention.validate(q, k, v)) == []
    assert "soft-capping" in attention.reasons("mosaic", q, k, v, softcap=5.0,
                                               config=mosaic.Config(interpret=True))


@pytest.mark.parametrize("softcap,error,match", [
    (0.0, ValueError, "softcap=0.0 must be finite and positive"),
    (-1.0, ValueError, "softcap=-1.0 must be finite and positive"),
    (float("inf"), ValueError, "softcap=inf must be finite and positive"),
    ("big", TypeError, "softcap='big' must be None or a Python number"),
    (True, TypeError, "softcap=True must be None or a Python number"),
])
def test_bad_softcap_is_refused(softcap, error, match):
    q, k, v = qkv(0, (1, 4, 4, 2, 1, 16, 16))
    with pytest.raises(error, match=match):
        attention(q, k, v, softcap=softcap)


@pytest.mark.slow
def test_softcap_forward_compiles_to_the_tanh_instruction():
    """Compiled for Hopper (no GPU needed): the soft-capped forward at its default tiles uses the
    GPU's tanh instruction, keeps wgmma and spills no registers."""
    from tests.utils import compile_for_sm90

    fn, cfg = dense_triton._flash_fwd_kernel, dense_triton.default_config(128)
    consts = dict(B=1, T=8192, S=8192, K=8, G=4, H=128, HV=128, BLOCK_H=128, BLOCK_HV=128,
                  PRECISION="tf32", CAUSAL=True, SCALE_LOG2=0.13, NUM_M=8192 * 4 // cfg.block_m,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAP=50.0 / 0.088, FAST_TANH=True)
    pointers = {n: "*i32" if n.startswith(("offset", "len", "window", "sink"))
                else "*fp32" if n.startswith("lse") else "*bf16"
                for n in fn.arg_names if n not in consts}
    (result,) = compile_for_sm90([dict(
        kernel="attn.dense.triton:_flash_fwd_kernel", constexprs=consts, pointers=pointers,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        count=("tanh.approx.f32", "wgmma.mma_async"))])
    assert result["count"]["tanh.approx.f32"] > 0, result
    assert result["count"]["wgmma.mma_async"] > 0, result
    assert result["spill_stores"] == 0, result
