"""Split-KV merge: reference vs one-pass softmax, and the Triton kernel through the harness."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.merge import merge_partials
from attn.merge import reference as ref
from tests.utils import assert_close, randn, rng


def _partials(gen, scores, values, splits):
    """Split softmax attention over the last axis of `scores` into `splits` pieces."""
    o, lse = [], []
    for idx in np.array_split(np.arange(scores.shape[-1]), splits):
        s = scores[..., idx]
        lse_s = jax.nn.logsumexp(s, axis=-1) if idx.size else jnp.full(s.shape[:-1], -jnp.inf)
        p = jnp.exp(s - lse_s[..., None]) if idx.size else s
        o.append(jnp.einsum("rs,rsh->rh", p, values[:, idx]) if idx.size
                 else jnp.full(s.shape[:-1] + (values.shape[-1],), jnp.nan))
        lse.append(lse_s)
    return jnp.stack(o, -2), jnp.stack(lse, -1)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("hv", [16, 40])
def test_reference_equals_one_pass_softmax(splits, hv):
    gen = rng()
    scores, values = randn(gen, (6, 50)), randn(gen, (6, 50, hv))
    o, lse = _partials(gen, scores, values, splits)
    out, out_lse = ref.merge_partials(o, lse)
    expected = jnp.einsum("rs,rsh->rh", jax.nn.softmax(scores, -1), values)
    assert_close(out, expected)
    assert_close(out_lse, jax.nn.logsumexp(scores, -1))


def _cases(gen, hv, dtype):
    o = randn(gen, (3, 5, 7, hv), dtype)
    lse = randn(gen, (3, 5, 7))
    lse = lse.at[0, 0].set(-jnp.inf)  # a row with no key anywhere
    lse = lse.at[1, :, 3].set(-jnp.inf)  # empty splits ...
    o = o.at[1, :, 3].set(jnp.nan)  # ... whose partial is garbage
    return o, lse


@pytest.mark.parametrize("hv", [1, 64, 100])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("implementation", ["xla", "triton"])
def test_masked_rows_and_empty_splits(hv, dtype, implementation):
    o, lse = _cases(rng(), hv, dtype)
    out, out_lse = merge_partials(o, lse, implementation=implementation)
    assert (np.asarray(out[0, 0]) == 0).all() and np.isneginf(np.asarray(out_lse[0, 0]))
    assert np.isfinite(np.asarray(out)).all()
    clean_o = jnp.where(jnp.isfinite(lse)[..., None], o, 0)
    exp_out, exp_lse = ref.merge_partials(clean_o, lse)
    assert_close(out, exp_out)
    assert_close(out_lse, exp_lse, allow_neg_inf=True)


def test_triton_kernel_matches_reference_under_jit():
    o, lse = _cases(rng(), 128, jnp.float32)
    fn = jax.jit(lambda o, l: merge_partials(o, l, implementation="triton"))
    out, out_lse = fn(o, lse)
    exp_out, exp_lse = ref.merge_partials(o, lse)
    assert_close(out, exp_out)
    assert_close(out_lse, exp_lse, allow_neg_inf=True)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 16, 32])
def test_triton_compiled_on_gpu(splits):
    gen = rng()
    o = randn(gen, (64, 32, splits, 512), jnp.float32)
    lse = randn(gen, (64, 32, splits)).at[:, :, -1].set(-jnp.inf)
    out, out_lse = jax.jit(lambda o, l: merge_partials(o, l, implementation="triton"))(o, lse)
    exp_out, exp_lse = ref.merge_partials(o, lse)
    assert_close(out, exp_out)
    assert_close(out_lse, exp_lse, allow_neg_inf=True)


def test_bad_input():
    o = jnp.zeros((2, 3, 4))
    with pytest.raises(ValueError, match="lse.shape"):
        merge_partials(o, jnp.zeros((2, 4)))
    with pytest.raises(TypeError, match="o.dtype"):
        merge_partials(o.astype(jnp.int32), jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="implementation="):
        merge_partials(o, jnp.zeros((2, 3)), implementation="cuda")
    with pytest.raises(ValueError, match="o must have shape"):
        merge_partials(jnp.zeros((3,)), jnp.zeros(()))
