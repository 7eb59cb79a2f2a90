"""Gated DeltaNet with the sequence sharded over 4 devices (`ring_gdn`) against the whole-sequence
chunked delta rule (`attn.gdn.gdn_chunked`).

The sharded checks run in one subprocess with `--xla_force_host_platform_device_count=4` (this
module as a script: `_worker`), as in `test_context_parallel.py`. Each compares the output, the
final state and the gradients of `sum(o * cos(o)) + sum(sin(final_state))` with respect to q, k,
v, g, beta and the initial state, in both layouts, at a length that does not split evenly
(S = 61: padded) and several chunks per device block (chunk size 4). The in-process tests cover
the block transfer itself (one device) and every error.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.context_parallel import ring_gdn, ring_gdn_local
from attn.context_parallel.gdn import block_transfer
from attn.gdn import gdn_chunked
from tests.utils import assert_close, randn, report_verdicts, rng, run_worker

NUM_DEVICES = 4
# f32 gradients through D - 1 state products and a 2x wider chunked pass; measured ~1e-6.
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
# name -> (layout, (B, S, Nk, Nv, H, Hv), dtype, initial state, grads)
CASES = {
    "contiguous-S61-init": ("contiguous", (2, 61, 2, 4, 8, 16), "float32", True, True),
    "zigzag-S61-init": ("zigzag", (2, 61, 2, 4, 8, 16), "float32", True, True),
    "zigzag-S64-zero": ("zigzag", (1, 64, 1, 2, 16, 8), "float32", False, False),
    "contiguous-S40-bf16": ("contiguous", (1, 40, 2, 2, 16, 16), "bfloat16", False, False),
    "local-zigzag-explicit-mesh-S61": ("local", (1, 61, 2, 4, 8, 8), "float32", True, False),
}
CHUNK = 4


def inputs(shape, dtype, with_state: bool, seed: int = 0):
    """Random q, k, v, g (<= 0), beta (in (0, 1)) and an initial state (or None)."""
    b, s, nk, nv, h, hv = shape
    gen = rng(seed)
    dt = jnp.dtype(dtype)
    q, k = randn(gen, (b, s, nk, h), dt), randn(gen, (b, s, nk, h), dt)
    v = randn(gen, (b, s, nv, hv), dt)
    g = -jax.nn.softplus(randn(gen, (b, s, nv))) * 0.1  # decay ~0.93: the state carries far
    beta = jax.nn.sigmoid(randn(gen, (b, s, nv)))
    state = randn(gen, (b, nv, h, hv)) if with_state else None
    return q, k, v, g, beta, state


def _reference(q, k, v, g, beta, state):
    return gdn_chunked(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True,
                       chunk_size=CHUNK, implementation="xla")


def _loss(fn):
    def loss(q, k, v, g, beta, state):
        o, final = fn(q, k, v, g, beta, state)
        o32 = o.astype(jnp.float32)
        return jnp.sum(o32 * jnp.cos(o32)) + jnp.sum(jnp.sin(final)), (o, final)
    return loss


def _check(name: str) -> None:
    from jax.sharding import AxisType, Mesh
    from jax.sharding import PartitionSpec as P

    from attn.context_parallel import _layout, from_zigzag, to_zigzag

    layout, shape, dtype, with_state, grads = CASES[name]
    q, k, v, g, beta, state = inputs(shape, dtype, with_state)
    if state is None:
        state = jnp.zeros((shape[0], shape[3], shape[4], shape[5]), jnp.float32)
    mesh = Mesh(np.array(jax.devices()), ("sp",), axis_types=(AxisType.Auto,))
    if layout == "local":  # the caller's own shard_map on an explicit mesh, zig-zag blocks
        mesh = jax.make_mesh((NUM_DEVICES,), ("sp",), axis_types=(AxisType.Explicit,))
        spec, s = P(None, "sp"), shape[1]
        padded = _layout.padded_length(s, NUM_DEVICES)

        def fn(q, k, v, g, beta, state):
            body = _layout.shard_map(
                lambda *xs: ring_gdn_local(*xs[:5], initial_state=xs[5], axis_name="sp",
                                           seq_len=s, use_qk_l2norm=True, chunk_size=CHUNK,
                                           implementation="xla"),
                mesh=mesh, in_specs=(spec,) * 5 + (P(),), out_specs=(spec, P()))
            lay = lambda x: _layout.place(to_zigzag(jnp.pad(
                x, ((0, 0), (0, padded - s)) + ((0, 0),) * (x.ndim - 2)), NUM_DEVICES), mesh,
                spec, explicit=True)
            o, final = body(*(lay(x) for x in (q, k, v, g, beta)), state)
            o = from_zigzag(_layout.place(o, mesh, P(), explicit=True), NUM_DEVICES)
            return o[:, :s], final
    else:
        def fn(q, k, v, g, beta, state):
            return ring_gdn(q, k, v, g, beta, mesh=mesh, axis_name="sp", initial_state=state,
                            use_qk_l2norm=True, chunk_size=CHUNK, layout=layout,
                            implementation="xla")
    if jnp.dtype(dtype) != jnp.float32:  # at most 2x the error of the same-precision reference
        exact, _ = _reference(*(x.astype(jnp.float32) for x in (q, k, v)), g, beta, state)
        same, _ = _reference(q, k, v, g, beta, state)
        out, _ = jax.jit(fn)(q, k, v, g, beta, state)
        ours = float(jnp.max(jnp.abs(out.astype(jnp.float32) - exact)))
        base = float(jnp.max(jnp.abs(same.astype(jnp.float32) - exact)))
        assert np.isfinite(ours) and ours <= 2 * base + 1e-3, f"{name}: {ours=} vs {base=}"
        return
    if not grads:
        out, final = jax.jit(fn)(q, k, v, g, beta, state)
        ref_out, ref_final = _reference(q, k, v, g, beta, state)
        assert_close(out, ref_out, err_msg=f"{name} o")
        assert_close(final, ref_final, err_msg=f"{name} final state")
        return
    grad = lambda f: jax.jit(jax.value_and_grad(_loss(f), argnums=tuple(range(6)),
                                                has_aux=True))
    (_, (out, final)), ours = grad(fn)(q, k, v, g, beta, state)
    (_, (ref_out, ref_final)), ref = grad(_reference)(q, k, v, g, beta, state)
    assert_close(out, ref_out, err_msg=f"{name} o")
    assert_close(final, ref_final, err_msg=f"{name} final state")
    for label, a, e in zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), ours, ref):
        assert_close(a, e, err_msg=f"{name} {label}", **GRAD_TOL)


def _worker() -> None:
    report_verdicts({name: functools.partial(_check, name) for name in CASES})


@pytest.fixture(scope="module")
def sharded_run():
    return run_worker("tests.attn.test_context_parallel_gdn", NUM_DEVICES)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_whole_sequence(sharded_run, name):
    assert sharded_run["devices"] == NUM_DEVICES
    assert sharded_run["verdicts"][name] == "ok", sharded_run["verdicts"][name]


def test_block_transfer_is_the_affine_state_map():
    """From any entry state `s0`, the block's output and final state are `o0 + s0ᵀ oi` and
    `p s0 + q0`: the identity the ring relies on."""
    q, k, v, g, beta, s0 = inputs((1, 13, 2, 4, 8, 4), "float32", True, seed=1)
    o0, oi, p, q0 = block_transfer(q, k, v, g, beta, scale=None, use_qk_l2norm=True,
                                   chunk_size=CHUNK, implementation="xla")
    want_o, want_s = _reference(q, k, v, g, beta, s0)
    assert_close(o0 + jnp.einsum("btnj,bnjv->btnv", oi, s0), want_o)
    assert_close(jnp.einsum("bnij,bnjv->bniv", p, s0) + q0, want_s)


def _one_device_mesh():
    from jax.sharding import AxisType, Mesh
    return Mesh(np.array(jax.devices()[:1]), ("sp",), axis_types=(AxisType.Auto,))


def test_one_device_equals_reference():
    q, k, v, g, beta, s0 = inputs((1, 9, 1, 2, 8, 8), "float32", True, seed=2)
    out, final = ring_gdn(q, k, v, g, beta, mesh=_one_device_mesh(), axis_name="sp",
                          initial_state=s0, use_qk_l2norm=True, chunk_size=CHUNK,
                          layout="zigzag", implementation="xla")
    ref_out, ref_final = _reference(q, k, v, g, beta, s0)
    assert_close(out, ref_out)
    assert_close(final, ref_final)


def test_errors_name_the_value():
    q, k, v, g, beta, s0 = inputs((1, 8, 2, 4, 8, 8), "float32", True)
    mesh = _one_device_mesh()
    call = lambda *xs, **kw: ring_gdn(*(xs or (q, k, v, g, beta)), **{
        "mesh": mesh, "axis_name": "sp", **kw})
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis"):
        call(axis_name="tp")
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        call(mesh="sp")
    with pytest.raises(ValueError, match="layout='striped' must be one of"):
        call(layout="striped")
    with pytest.raises(ValueError, match="implementation='cuda'"):
        call(implementation="cuda")
    with pytest.raises(ValueError, match=r"num_v_heads Nv=3 must be divisible by num_k_heads"):
        call(q, k, v[:, :, :3], g[..., :3], beta[..., :3])
    with pytest.raises(ValueError, match=r"v must have shape \[B, S, Nv, Hv\]"):
        call(q, k, v[..., 0], g, beta)
    with pytest.raises(ValueError, match=r"initial_state.shape=\(1, 4, 8, 4\) must equal"):
        call(initial_state=s0[..., :4])
    with pytest.raises(ValueError, match="axis_name='sp' is not bound"):
        ring_gdn_local(q, k, v, g, beta, axis_name="sp")
    with pytest.raises(ValueError, match="T=7 must be even"):
        ring_gdn_local(q[:, :7], k[:, :7], v[:, :7], g[:, :7], beta[:, :7], axis_name="sp")


if __name__ == "__main__":
    _worker()
