"""Context-parallel attention (ring, all-gather) against the whole-sequence reference.

The sharded checks need several devices, and JAX fixes its CPU device count when it first starts,
so they run in one subprocess with `--xla_force_host_platform_device_count=4` (this module run
as a script: `_worker`); each pytest case reads that run's verdict for its own check. Each check
compares out, lse and the gradients dq / dk / dv of `sum(out * cos(out)) + sum(sin(lse))` (a
cotangent on both outputs) with `reference.attention`, from one compiled `value_and_grad`.

On the CPU the blocks run the XLA reference; the Triton / Mosaic kernels under `shard_map` are
checked by `experiments.bench_multigpu` on the GPU before it times anything (Triton's CPU
interpreter is not thread-safe, and the four fake devices call it concurrently).

The checks in this process (one device) cover the pieces: the block-skipping rule against a
brute-force mask, the merge's empty and NaN rows, the layout, and every `ValueError` /
`TypeError`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.context_parallel import (
    _layout,
    allgather_attention,
    from_zigzag,
    reference,
    ring_attention,
    ring_attention_local,
    to_zigzag,
)
from attn.context_parallel.ring import block_visible, merge
from tests.utils import assert_close, randn, report_verdicts, rng, run_worker

NUM_DEVICES = 4
# f32 gradients: a sum of D merged partials against one softmax; measured errors ~3e-5 on
# values of order 10 (dv sums many probabilities), so 1e-4 relative leaves margin without
# hiding a wrong block (which errs by O(1)).
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)

# name -> (variant, (B, S, N, K, H), dtype, options, grads). S = 61 is not a multiple of 2D = 8
# (padded); N = 10, K = 2 is G = 5; window [5, 0] and sinks [2, 0] are per KV head (head 1 full).
CASES = {
    f"{variant}-{tag}": (variant, shape, dtype, options, grads)
    for variant in ("ring", "allgather")
    for tag, shape, dtype, options, grads in (
        ("causal-S61-G5", (2, 61, 10, 2, 16), "float32", {}, True),
        ("window-sinks-S61-G5", (2, 61, 10, 2, 16), "float32",
         {"window": [5, 0], "sinks": [2, 0]}, True),
        ("noncausal-S61-G1", (1, 61, 4, 4, 16), "float32", {"causal": False}, True),
        ("causal-S64-G8-bf16", (1, 64, 8, 1, 32), "bfloat16", {}, False),
    )
}
CASES["ring-local-explicit-mesh-S64"] = ("ring_local", (1, 64, 4, 2, 16), "float32", {}, False)


def _loss_parts(fn):
    """`(loss, (out, lse))` of `fn(q, k, v)`, for `value_and_grad(..., has_aux=True)`."""
    def loss(q, k, v):
        out, lse = fn(q, k, v)
        o32 = out.astype(jnp.float32)
        return jnp.sum(o32 * jnp.cos(o32)) + jnp.sum(jnp.sin(lse)), (out, lse)
    return loss


def _check(name: str) -> None:
    """Run one case of `CASES` on the worker's mesh; raises AssertionError on a mismatch."""
    from jax.sharding import AxisType, Mesh

    variant, (b, s, n, kh, h), dtype, options, grads = CASES[name]
    options = {key: np.asarray(x, np.int32) if isinstance(x, list) else x
               for key, x in options.items()}
    gen = rng()
    q, k, v = (randn(gen, (b, s, heads, h), jnp.dtype(dtype)) for heads in (n, kh, kh))
    mesh = Mesh(np.array(jax.devices()), ("sp",), axis_types=(AxisType.Auto,))
    if variant == "ring_local":  # the caller's own shard_map on an explicit-axes mesh
        mesh = jax.make_mesh((NUM_DEVICES,), ("sp",), axis_types=(AxisType.Explicit,))
        spec = jax.sharding.PartitionSpec(None, "sp")

        def fn(q, k, v):
            local = _layout.shard_map(
                lambda q, k, v: ring_attention_local(q, k, v, axis_name="sp", **options),
                mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec))
            out, lse = local(*(_layout.place(to_zigzag(x, NUM_DEVICES), mesh, spec,
                                             explicit=True) for x in (q, k, v)))
            whole = jax.sharding.PartitionSpec()
            return (from_zigzag(_layout.place(out, mesh, whole, explicit=True), NUM_DEVICES),
                    from_zigzag(_layout.place(lse, mesh, whole, explicit=True), NUM_DEVICES))
    else:
        sharded = {"ring": ring_attention, "allgather": allgather_attention}[variant]
        fn = lambda q, k, v: sharded(q, k, v, mesh=mesh, axis_name="sp", **options)
    ref = lambda q, k, v: reference.attention(q, k, v, **options)
    if not grads:
        out, lse = jax.jit(fn)(q, k, v)
        if jnp.dtype(dtype) == jnp.float32:
            ref_out, ref_lse = ref(q, k, v)
            assert_close(out, ref_out, err_msg=f"{name} out")
            assert_close(lse, ref_lse, err_msg=f"{name} lse")
            return
        # Low precision: at most 2x the error of the same-precision reference (QUALITY.md), as
        # a root mean square. The ring merges partial outputs each rounded to q's dtype, so its
        # error is ~1.3x the reference's in RMS; in the largest element, a few rounding errors
        # may meet (up to 2.4x over 40 draws): that bound is 3x. A wrong block errs by O(1).
        exact, _ = ref(*(x.astype(jnp.float32) for x in (q, k, v)))
        same, _ = ref(q, k, v)
        for stat, bound, slack in ((lambda e: jnp.sqrt(jnp.mean(e * e)), 2, 0.0),
                                   (jnp.max, 3, 1e-3)):
            ours = float(stat(jnp.abs(out.astype(jnp.float32) - exact)))
            base = float(stat(jnp.abs(same.astype(jnp.float32) - exact)))
            assert np.isfinite(ours) and ours <= bound * base + slack, (name, ours, base)
        return
    grad = lambda f: jax.jit(jax.value_and_grad(_loss_parts(f), argnums=(0, 1, 2), has_aux=True))
    (_, (out, lse)), dqkv = grad(fn)(q, k, v)
    (_, (ref_out, ref_lse)), ref_dqkv = grad(ref)(q, k, v)
    assert_close(out, ref_out, err_msg=f"{name} out")
    assert_close(lse, ref_lse, err_msg=f"{name} lse")
    for label, actual, expected in zip(("dq", "dk", "dv"), dqkv, ref_dqkv):
        assert_close(actual, expected, err_msg=f"{name} {label}", **GRAD_TOL)


def _worker() -> None:
    report_verdicts({name: functools.partial(_check, name) for name in CASES})


@pytest.fixture(scope="module")
def sharded_run():
    return run_worker("tests.attn.test_context_parallel", NUM_DEVICES)


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_reference(sharded_run, name):
    assert sharded_run["devices"] == NUM_DEVICES
    assert sharded_run["verdicts"][name] == "ok", sharded_run["verdicts"][name]


def _brute_visible(q_start, k_start, chunk, window, sinks):
    q = np.arange(q_start, q_start + chunk)[:, None, None]
    s = np.arange(k_start, k_start + chunk)[None, :, None]
    w, sk = np.asarray(window)[None, None], np.asarray(sinks)[None, None]
    return bool(np.any((s <= q) & ((w <= 0) | (q - w < s) | (s < sk))))


def test_block_visible_equals_brute_force():
    gen = rng()
    fn = jax.jit(block_visible, static_argnums=2)
    for _ in range(300):
        chunk = int(gen.integers(1, 9))
        qs, ks = (int(x) * chunk for x in gen.integers(0, 8, 2))
        window = gen.integers(-1, 3 * chunk, 2).astype(np.int32)
        sinks = gen.integers(0, 3 * chunk, 2).astype(np.int32)
        expected = _brute_visible(qs, ks, chunk, window, sinks)
        assert bool(fn(qs, ks, chunk, window, sinks)) == expected, (qs, ks, chunk, window, sinks)


def test_merge_empty_and_nan_rows():
    gen = rng()
    o1, o2 = randn(gen, (3, 4)), randn(gen, (3, 4))
    l1 = jnp.asarray([0.5, -jnp.inf, -jnp.inf])
    l2 = jnp.asarray([1.0, 2.0, -jnp.inf])
    o2 = o2.at[2].set(jnp.nan)  # garbage behind an empty partial: must not leak
    out, lse = merge([(o1, l1), (o2, l2)])
    w1 = np.exp(0.5) / (np.exp(0.5) + np.exp(1.0))
    assert_close(out[0], w1 * o1[0] + (1 - w1) * o2[0])
    assert_close(out[1], o2[1])
    assert (np.asarray(out[2]) == 0).all() and np.isneginf(float(lse[2]))
    assert_close(lse[:2], jnp.asarray([np.logaddexp(0.5, 1.0), 2.0]))
    out_nan, _ = merge([(o1, l1.at[0].set(jnp.nan)), (o2, l2)])
    assert np.isnan(np.asarray(out_nan[0])).all() and np.isfinite(np.asarray(out_nan[1])).all()
    grads = jax.grad(lambda l1, l2: jnp.sum(merge([(o1, l1), (o2, l2)])[0]), (0, 1))(l1, l2)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_zigzag_layout():
    x = jnp.arange(2 * 16).reshape(2, 16)
    z = to_zigzag(x, 4)
    # device d holds chunks d and 7 - d of 2 tokens: [0, 7, 1, 6, 2, 5, 3, 4]
    np.testing.assert_array_equal(np.asarray(z[0]).reshape(8, 2)[:, 0] // 2,
                                  [0, 7, 1, 6, 2, 5, 3, 4])
    np.testing.assert_array_equal(np.asarray(from_zigzag(z, 4)), np.asarray(x))
    assert _layout.padded_length(61, 4) == 64 and _layout.padded_length(64, 4) == 64


def _one_device_mesh():
    from jax.sharding import AxisType, Mesh
    return Mesh(np.array(jax.devices()[:1]), ("sp",), axis_types=(AxisType.Auto,))


@pytest.mark.parametrize("fn", [ring_attention, allgather_attention], ids=["ring", "allgather"])
def test_one_device_equals_reference(fn):
    gen = rng()
    q, k, v = randn(gen, (1, 9, 4, 8)), randn(gen, (1, 9, 2, 8)), randn(gen, (1, 9, 2, 8))
    out, lse = fn(q, k, v, mesh=_one_device_mesh(), axis_name="sp", window=3, sinks=1)
    ref_out, ref_lse = reference.attention(q, k, v, window=3, sinks=1)
    assert_close(out, ref_out)
    assert_close(lse, ref_lse)


def test_errors_name_the_value():
    gen = rng()
    q, k, v = randn(gen, (1, 8, 4, 8)), randn(gen, (1, 8, 2, 8)), randn(gen, (1, 8, 2, 8))
    mesh = _one_device_mesh()
    call = lambda **kw: ring_attention(*kw.pop("qkv", (q, k, v)), **{
        "mesh": mesh, "axis_name": "sp", **kw})
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis"):
        call(axis_name="tp")
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        call(mesh="sp")
    with pytest.raises(ValueError, match="window=4 needs causal=True"):
        call(window=4, causal=False)
    with pytest.raises(ValueError, match="sinks"):
        call(window=4, sinks=-1)
    with pytest.raises(ValueError, match=r"window.shape=\(3,\) must broadcast"):
        call(window=np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="implementation='cuda'"):
        call(implementation="cuda")
    with pytest.raises(ValueError, match=r"q.shape\[:2\]"):
        call(qkv=(q[:, :6], k, v))
    with pytest.raises(ValueError, match="num_heads N=4.*num_kv_heads K=3"):
        call(qkv=(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)))
    with pytest.raises(TypeError, match="must agree"):
        call(qkv=(q, k.astype(jnp.bfloat16), v))
    with pytest.raises(ValueError, match="scale"):
        call(scale=-1.0)
    with pytest.raises(ValueError, match="axis_name='sp' is not bound"):
        ring_attention_local(q, k, v, axis_name="sp")
    with pytest.raises(ValueError, match="T2=7 must be even"):
        ring_attention_local(q[:, :7], k[:, :7], v[:, :7], axis_name="sp")
    with pytest.raises(ValueError, match=r"length 10 \(axis 1\) must be a multiple of"):
        to_zigzag(jnp.zeros((1, 10)), 4)
    spec = jax.sharding.PartitionSpec(None, "sp")
    local = _layout.shard_map(lambda q, k, v: ring_attention_local(q, k, v, axis_name="sp",
                                                                   seq_len=9),
                              mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec, spec))
    with pytest.raises(ValueError, match=r"seq_len=9 must be an int in \[1, D \* T2 = 8\]"):
        local(q, k, v)


if __name__ == "__main__":
    _worker()
