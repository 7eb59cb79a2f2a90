"""Differentiating a forward-only Triton kernel raises a `TypeError` naming the op.

`attn._harness.triton_call` wraps every launch in a `custom_jvp` whose rule raises; kernels with
their own `custom_vjp` (dense flash) never reach it. On the CPU the kernels run in Triton's
interpreter, so the same wrapper is exercised as on the GPU; `implementation="auto"` is XLA on
the CPU and differentiates normally.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.dense import attention
from attn.merge import merge_partials
from attn.paged_decode import paged_decode
from tests.utils import assert_close, randn, rng

KH, G, H, P, MAX_PAGES = 2, 2, 16, 8, 3


def _paged(gen):
    """One query per row over per-head pages: `(q, k_pages, v_pages, tables, lengths)`."""
    b, num_pages = 2, 2 * MAX_PAGES + 1
    q = randn(gen, (b, KH * G, H))
    k_pages = randn(gen, (KH, num_pages, P, H))
    v_pages = randn(gen, (KH, num_pages, P, H))
    tables = np.arange(1, 1 + b * MAX_PAGES, dtype=np.int32).reshape(b, 1, MAX_PAGES)
    tables = np.repeat(tables, KH, axis=1)
    lengths = jnp.asarray([MAX_PAGES * P - 3, 5], jnp.int32)
    return q, k_pages, v_pages, jnp.asarray(tables), lengths


def _decode_loss(implementation):
    def loss(q, k_pages, v_pages, tables, lengths):
        o, _ = paged_decode(q, k_pages, v_pages, tables, lengths, implementation=implementation)
        return jnp.sum(o ** 2)
    return loss


def test_paged_decode_triton_grad_names_the_op():
    q, kp, vp, tables, lengths = _paged(rng())
    loss = _decode_loss("triton")
    assert np.isfinite(float(loss(q, kp, vp, tables, lengths)))  # the forward is unaffected
    with pytest.raises(TypeError, match=r"attn\.paged_decode.*forward-only.*implementation='xla'"):
        jax.grad(loss, argnums=(0, 1, 2))(q, kp, vp, tables, lengths)
    with pytest.raises(TypeError, match=r"attn\.paged_decode.*forward-only"):
        jax.jit(jax.grad(loss))(q, kp, vp, tables, lengths)


def test_merge_partials_triton_grad_names_the_op():
    gen = rng()
    o, lse = randn(gen, (3, 4, 16)), randn(gen, (3, 4))

    def loss(o, lse):
        return jnp.sum(merge_partials(o, lse, implementation="triton")[0])

    with pytest.raises(TypeError, match=r"attn\.merge.*forward-only"):
        jax.grad(loss)(o, lse)
    with pytest.raises(TypeError, match=r"attn\.merge.*forward-only"):
        jax.jvp(loss, (o, lse), (o, lse))


def test_triton_forward_only_kernel_under_stop_gradient_is_fine():
    """No tangent reaches the launch: the guard stays silent and the gradient is the XLA one."""
    q, kp, vp, tables, lengths = _paged(rng())

    def loss(implementation):
        def f(q):
            o, _ = paged_decode(jax.lax.stop_gradient(q), kp, vp, tables, lengths,
                                implementation=implementation)
            return jnp.sum(o * q[..., :H])
        return f

    assert_close(jax.grad(loss("triton"))(q), jax.grad(loss("xla"))(q), atol=1e-5, rtol=1e-5)


def test_paged_decode_auto_grad_on_cpu_matches_reference():
    """`implementation="auto"` is XLA on the CPU: its gradient is the reference's."""
    if jax.default_backend() == "gpu":
        pytest.skip("auto picks the Triton kernel on a GPU (test_paged_decode_auto_grad_gpu)")
    from attn.paged_decode import reference

    q, kp, vp, tables, lengths = _paged(rng())

    def ref_loss(q, kp, vp):
        o, _ = reference.paged_decode(q, kp, vp, tables, lengths, scale=H ** -0.5,
                                      window=reference.per_head(None, KH),
                                      sinks=reference.per_head(None, KH))
        return jnp.sum(o ** 2)

    got = jax.grad(_decode_loss("auto"), argnums=(0, 1, 2))(q, kp, vp, tables, lengths)
    exp = jax.grad(ref_loss, argnums=(0, 1, 2))(q, kp, vp)
    for name, a, e in zip(("q", "k_pages", "v_pages"), got, exp):
        assert np.abs(np.asarray(a)).max() > 0, name
        assert_close(a, e, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


@pytest.mark.gpu
def test_paged_decode_auto_grad_gpu():
    q, kp, vp, tables, lengths = _paged(rng())
    with pytest.raises(TypeError, match=r"attn\.paged_decode.*forward-only"):
        jax.grad(_decode_loss("auto"))(q, kp, vp, tables, lengths)


def test_dense_triton_custom_vjp_unaffected():
    """The dense flash kernel's own backward runs (the guard sits inside its custom_vjp)."""
    gen = rng()
    q, k, v = randn(gen, (1, 20, 4, 16)), randn(gen, (1, 20, 2, 16)), randn(gen, (1, 20, 2, 16))

    def loss(implementation):
        return lambda q, k, v: jnp.sum(attention(q, k, v, implementation=implementation)[0] ** 2)

    got = jax.grad(loss("triton"), argnums=(0, 1, 2))(q, k, v)
    exp = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    for name, a, e in zip("qkv", got, exp):
        assert_close(a, e, atol=5e-5, rtol=5e-5, err_msg=f"d{name}")
