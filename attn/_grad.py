"""The gradient of forward-only kernels: the VJP of their pure-jnp reference.

The Triton kernel of the dense paged prefill op has no backward of its own;
`with_reference_gradient` keeps that op differentiable when `implementation="auto"` picks the
kernel on a GPU.
"""

import jax


def with_reference_gradient(kernel_fn, reference_fn):
    """`kernel_fn` forward, the VJP of `reference_fn` (same arguments, same outputs) backward.

    The backward recomputes the pure-jnp reference, so it costs the reference's memory and time.
    Integer and bool arguments get `float0` cotangents, as `jax.vjp` gives them; None arguments
    (an absent bias or state) are empty pytrees.
    """

    @jax.custom_vjp
    def fn(*args):
        return kernel_fn(*args)

    def fwd(*args):
        return kernel_fn(*args), args

    def bwd(args, cotangents):
        _, vjp = jax.vjp(reference_fn, *args)
        return vjp(cotangents)

    fn.defvjp(fwd, bwd)
    return fn
