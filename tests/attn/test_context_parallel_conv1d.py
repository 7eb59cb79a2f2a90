"""The causal conv1d with the sequence sharded over 4 devices (`ring_causal_conv1d`) against the
whole-sequence conv (`attn.conv1d.reference.causal_conv1d`), and a GDN layer's conv + delta rule
(`ring_gdn_mixer`) against the model layer's single-device mix (`models.layers.gdn.gdn_mix`).

The sharded checks run in one subprocess with `--xla_force_host_platform_device_count=4` (this
module as a script: `_worker`), as in `test_context_parallel_gdn.py`. Gradient cases compare the
output, the final state(s) and the gradients of `sum(y cos(y)) + sum(sin(state))` with respect to
every input (x, taps, bias and initial state; the mixer: x, taps, g, beta and both states): a
halo whose cotangent did not return to the device owning its rows would show in `dx` at every
block boundary. Lengths do not split evenly (S = 61: padded); W = 1 (no halo) and W = 4; with
and without an initial state; blocks shorter than `W - 1` (S = 7 zig-zag: one-token chunks, the
halo crosses three devices; S = 3: the final state reaches back into the initial state). The
local entry points run on an explicit mesh with the padding poisoned with NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn.context_parallel import (
    ring_causal_conv1d,
    ring_causal_conv1d_local,
    ring_gdn_mixer,
    ring_gdn_mixer_local,
)
from attn.conv1d import reference
from tests.utils import assert_close, randn, report_verdicts, rng, run_worker

NUM_DEVICES = 4
# f32 gradients; the mixer's pass through D - 1 state products; measured ~2e-6.
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)
# name -> (layout, (B, S, C, W), dtype, initial state, bias, activation)
CONV_CASES = {
    "contiguous-W4-S61-init": ("contiguous", (2, 61, 6, 4), "float32", True, True, "silu"),
    "contiguous-W4-S61-zero": ("contiguous", (2, 61, 6, 4), "float32", False, False, None),
    "zigzag-W4-S61-init": ("zigzag", (2, 61, 6, 4), "float32", True, False, "silu"),
    "zigzag-W4-S61-zero": ("zigzag", (2, 61, 6, 4), "float32", False, True, None),
    "contiguous-W1-S61-zero": ("contiguous", (1, 61, 6, 1), "float32", False, True, "silu"),
    "zigzag-W1-S61-init": ("zigzag", (1, 61, 6, 1), "float32", True, False, None),
    "zigzag-W4-S7-init": ("zigzag", (1, 7, 3, 4), "float32", True, True, "silu"),
    "contiguous-W4-S3-init": ("contiguous", (1, 3, 3, 4), "float32", True, True, None),
    "contiguous-W4-S61-bf16": ("contiguous", (2, 61, 6, 4), "bfloat16", True, True, "silu"),
    "local-zigzag-explicit-NaN-pad-S61": ("local", (2, 61, 6, 4), "float32", True, True, "silu"),
}
# name -> (layout, (B, S, Nk, Nv, H, Hv, W), states)
MIXER_CASES = {
    "mixer-contiguous-S61-states": ("contiguous", (2, 61, 1, 2, 8, 4, 4), True),
    "mixer-zigzag-S61-states": ("zigzag", (2, 61, 1, 2, 8, 4, 4), True),
    "mixer-zigzag-S61-zero": ("zigzag", (1, 61, 2, 4, 4, 4, 4), False),
    "mixer-local-zigzag-explicit-NaN-pad-S61": ("local", (1, 61, 1, 2, 8, 4, 4), True),
}
CHUNK = 4


def conv_inputs(shape, dtype, with_state: bool, with_bias: bool, seed: int = 0):
    """Random x `[B, S, C]`, taps `[C, W]`, bias `[C]` (or None), initial state (or None)."""
    b, s, c, w = shape
    gen = rng(seed)
    dt = jnp.dtype(dtype)
    x, weight = randn(gen, (b, s, c), dt), randn(gen, (c, w), dt, scale=0.5)
    bias = randn(gen, (c,), dt) if with_bias else None
    state = randn(gen, (b, c, w - 1), dt) if with_state else None
    return x, weight, bias, state


def mixer_inputs(shape, with_states: bool, seed: int = 0):
    """Random pre-conv x, taps, g (<= 0), beta, conv and ssm states (or None), and the spec."""
    from models.layers.gdn import GDNSpec

    b, s, nk, nv, h, hv, w = shape
    spec = GDNSpec(layer=0, num_k_heads=nk, num_v_heads=nv, head_k_dim=h, head_v_dim=hv,
                   conv_width=w, scale=h ** -0.5, chunk_size=CHUNK)
    gen = rng(seed)
    x = randn(gen, (b, s, spec.conv_dim))
    weight = randn(gen, (spec.conv_dim, w), scale=0.5)
    g = -jax.nn.softplus(randn(gen, (b, s, nv))) * 0.1
    beta = jax.nn.sigmoid(randn(gen, (b, s, nv)))
    conv = randn(gen, (b, spec.conv_dim, w - 1)) if with_states else None
    ssm = randn(gen, (b, nv, h, hv)) if with_states else None
    return spec, (x, weight, g, beta, conv, ssm)


def _mixer_reference(spec):
    from models.layers.gdn import GDNInputs, GDNState, gdn_mix

    def run(x, weight, g, beta, conv, ssm):
        o, state = gdn_mix(spec, GDNInputs(x=x, z=None, g=g, beta=beta, conv_weight=weight),
                           GDNState(conv, ssm))
        return o, state.conv, state.ssm
    return run


def _loss(fn):
    def loss(*args):
        out, *states = fn(*args)
        o32 = out.astype(jnp.float32)
        return (jnp.sum(o32 * jnp.cos(o32)) + sum(jnp.sum(jnp.sin(s)) for s in states),
                (out, *states))
    return loss


def _without_none(ours_fn, ref_fn, args):
    """Both functions and the arguments with the None ones (absent bias or state) closed over."""
    keep = [i for i, a in enumerate(args) if a is not None]

    def close(fn):
        def run(*given):
            full = list(args)
            for i, a in zip(keep, given):
                full[i] = a
            return fn(*full)
        return run
    return close(ours_fn), close(ref_fn), tuple(args[i] for i in keep), keep


def _compare_grads(name, ours_fn, ref_fn, args, keep, labels):
    """Forward outputs and every gradient of `_loss` (with respect to `args`, the arguments at
    positions `keep` of `labels`) agree."""
    labels = [labels[i] for i in keep]
    grad = lambda f: jax.jit(jax.value_and_grad(_loss(f), argnums=tuple(range(len(args))),
                                                has_aux=True))
    (_, outs), ours = grad(ours_fn)(*args)
    (_, refs), ref = grad(ref_fn)(*args)
    for i, (a, e) in enumerate(zip(outs, refs)):
        assert_close(a, e, err_msg=f"{name} output {i}")
    for label, a, e in zip(labels, ours, ref):
        if a.size:  # W = 1: the state has no columns
            assert_close(a, e, err_msg=f"{name} {label}", **GRAD_TOL)


def _local_mesh_run(body, seq, rep, seq_len, num_states):
    """Run `body(*seq_blocks, *rep)` in a `shard_map` over an explicit 4-device mesh, `seq` in the
    zig-zag layout with its padding set to NaN; returns the per-token output in sequence order
    (padding dropped) and the `num_states` replicated ones."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    from attn.context_parallel import _layout, from_zigzag, to_zigzag

    mesh = jax.make_mesh((NUM_DEVICES,), ("sp",), axis_types=(AxisType.Explicit,))
    spec = P(None, "sp")
    padded = _layout.padded_length(seq_len, NUM_DEVICES)
    lay = lambda x: _layout.place(to_zigzag(jnp.pad(
        x, ((0, 0), (0, padded - seq_len)) + ((0, 0),) * (x.ndim - 2), constant_values=jnp.nan),
        NUM_DEVICES), mesh, spec, explicit=True)

    @jax.jit
    def run(seq, rep):
        out, *states = _layout.shard_map(body, mesh=mesh, in_specs=(spec,) * len(seq) + (
            P(),) * len(rep), out_specs=(spec,) + (P(),) * num_states)(
            *(lay(x) for x in seq), *rep)
        out = from_zigzag(_layout.place(out, mesh, P(), explicit=True), NUM_DEVICES)
        return (out[:, :seq_len], *states)

    return run(tuple(seq), tuple(rep))


def _check_conv(name: str) -> None:
    from jax.sharding import AxisType, Mesh

    layout, shape, dtype, with_state, with_bias, activation = CONV_CASES[name]
    x, weight, bias, state = conv_inputs(shape, dtype, with_state, with_bias)
    mesh = Mesh(np.array(jax.devices()), ("sp",), axis_types=(AxisType.Auto,))
    ref = lambda x, weight, bias, state: reference.causal_conv1d(
        x, weight, bias, initial_state=state, activation=activation)
    if layout == "local":
        s = shape[1]

        def body(x, weight, bias, state):
            return ring_causal_conv1d_local(x, weight, bias, axis_name="sp", initial_state=state,
                                            activation=activation, seq_len=s,
                                            implementation="xla")
        y, final = _local_mesh_run(body, (x,), (weight, bias, state), s, 1)
        want_y, want_final = ref(x, weight, bias, state)
        assert_close(y, want_y, err_msg=f"{name} y")
        assert_close(final, want_final, err_msg=f"{name} final state")
        return
    ours = lambda x, weight, bias, state: ring_causal_conv1d(
        x, weight, bias, mesh=mesh, axis_name="sp", initial_state=state, activation=activation,
        layout=layout, implementation="xla")
    if jnp.dtype(dtype) != jnp.float32:  # at most 2x the error of the same-precision reference
        up = lambda a: None if a is None else a.astype(jnp.float32)
        exact, _ = ref(up(x), up(weight), up(bias), up(state))
        same, _ = ref(x, weight, bias, state)
        y, final = jax.jit(ours)(x, weight, bias, state)
        err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - exact)))
        base = float(jnp.max(jnp.abs(same.astype(jnp.float32) - exact)))
        assert np.isfinite(err) and err <= 2 * base + 1e-6, f"{name}: {err=} vs {base=}"
        assert_close(final, ref(x, weight, bias, state)[1], atol=0, rtol=0)  # raw inputs
        return
    _compare_grads(name, *_without_none(ours, ref, (x, weight, bias, state)),
                   ("dx", "dweight", "dbias", "dstate"))


def _check_mixer(name: str) -> None:
    from jax.sharding import AxisType, Mesh

    layout, shape, with_states = MIXER_CASES[name]
    spec, (x, weight, g, beta, conv, ssm) = mixer_inputs(shape, with_states)
    ref = _mixer_reference(spec)
    common = dict(num_k_heads=spec.num_k_heads, head_k_dim=spec.head_k_dim, scale=spec.scale,
                  chunk_size=CHUNK, implementation="xla")
    if layout == "local":
        s = shape[1]

        def body(x, g, beta, weight, conv, ssm):
            return ring_gdn_mixer_local(x, weight, g, beta, axis_name="sp", conv_state=conv,
                                        ssm_state=ssm, seq_len=s, **common)
        o, conv_out, ssm_out = _local_mesh_run(body, (x, g, beta), (weight, conv, ssm), s, 2)
        for label, a, e in zip(("o", "conv state", "ssm state"), (o, conv_out, ssm_out),
                               ref(x, weight, g, beta, conv, ssm)):
            assert_close(a, e, err_msg=f"{name} {label}")
        return
    mesh = Mesh(np.array(jax.devices()), ("sp",), axis_types=(AxisType.Auto,))
    ours = lambda x, weight, g, beta, conv, ssm: ring_gdn_mixer(
        x, weight, g, beta, mesh=mesh, axis_name="sp", conv_state=conv, ssm_state=ssm,
        layout=layout, **common)
    _compare_grads(name, *_without_none(ours, ref, (x, weight, g, beta, conv, ssm)),
                   ("dx", "dweight", "dg", "dbeta", "dconv_state", "dssm_state"))


def _worker() -> None:
    report_verdicts({name: functools.partial(
        _check_conv if name in CONV_CASES else _check_mixer, name)
        for name in (*CONV_CASES, *MIXER_CASES)})


@pytest.fixture(scope="module")
def sharded_run():
    return run_worker("tests.attn.test_context_parallel_conv1d", NUM_DEVICES)


@pytest.mark.parametrize("name", [*CONV_CASES, *MIXER_CASES])
def test_sharded_equals_whole_sequence(sharded_run, name):
    assert sharded_run["devices"] == NUM_DEVICES
    assert sharded_run["verdicts"][name] == "ok", sharded_run["verdicts"][name]


def _one_device_mesh():
    from jax.sharding import AxisType, Mesh
    return Mesh(np.array(jax.devices()[:1]), ("sp",), axis_types=(AxisType.Auto,))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_one_device_equals_reference(layout):
    x, weight, bias, state = conv_inputs((2, 9, 5, 4), "float32", True, True, seed=1)
    y, final = ring_causal_conv1d(x, weight, bias, mesh=_one_device_mesh(), axis_name="sp",
                                  initial_state=state, activation="silu", layout=layout,
                                  implementation="xla")
    want_y, want_final = reference.causal_conv1d(x, weight, bias, initial_state=state,
                                                 activation="silu")
    assert_close(y, want_y)
    assert_close(final, want_final, atol=0, rtol=0)


def test_repeated_calls_reuse_the_compiled_program():
    """The global entry points key their jit by module-level functions and hashable options:
    a second call with fresh arrays of the same shapes compiles nothing."""
    from attn.context_parallel._layout import _run_global

    mesh = _one_device_mesh()
    x, weight, bias, state = conv_inputs((1, 9, 5, 4), "float32", True, True, seed=3)
    _, args = mixer_inputs((1, 9, 1, 2, 8, 4, 4), True, seed=3)
    conv = lambda x: ring_causal_conv1d(x, weight, bias, mesh=mesh, axis_name="sp",
                                        initial_state=state, implementation="xla")
    mix = lambda x: ring_gdn_mixer(x, *args[1:4], mesh=mesh, axis_name="sp", num_k_heads=1,
                                   head_k_dim=8, conv_state=args[4], ssm_state=args[5],
                                   chunk_size=CHUNK, implementation="xla")
    conv(x), mix(args[0])
    size = _run_global._cache_size()
    conv(x + 1), mix(args[0] + 1)
    assert _run_global._cache_size() == size


def test_conv_errors_name_the_value():
    x, weight, bias, state = conv_inputs((1, 8, 4, 3), "float32", True, True)
    mesh = _one_device_mesh()
    call = lambda *xs, **kw: ring_causal_conv1d(*(xs or (x, weight, bias)), **{
        "mesh": mesh, "axis_name": "sp", **kw})
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis"):
        call(axis_name="tp")
    with pytest.raises(TypeError, match="must be a jax.sharding.Mesh"):
        call(mesh="sp")
    with pytest.raises(ValueError, match="layout='striped' must be one of"):
        call(layout="striped")
    with pytest.raises(ValueError, match="implementation='cuda'"):
        call(implementation="cuda")
    with pytest.raises(ValueError, match="activation='gelu' must be one of"):
        call(activation="gelu")
    with pytest.raises(ValueError, match=r"x must have shape \[B S C\]"):
        call(x[0], weight, bias)
    with pytest.raises(ValueError, match=r"weight.shape\[0\]=3 must equal channels C=4"):
        call(x, weight[:3], bias)
    with pytest.raises(ValueError, match="conv width W=0 must be >= 1"):
        call(x, weight[:, :0], bias)
    with pytest.raises(ValueError, match=r"bias.shape=\(3,\) must be \(4,\)"):
        call(x, weight, bias[:3])
    with pytest.raises(ValueError, match=r"initial_state.shape=\(1, 4, 1\) must be \(1, 4, 2\)"):
        call(initial_state=state[..., :1])
    with pytest.raises(TypeError, match="x"):
        call(x.astype(jnp.int32), weight, bias)
    with pytest.raises(ValueError, match="axis_name='sp' is not bound"):
        ring_causal_conv1d_local(x, weight, bias, axis_name="sp")
    with pytest.raises(ValueError, match="T=7 must be even"):
        ring_causal_conv1d_local(x[:, :7], weight, bias, axis_name="sp")


def test_mixer_errors_name_the_value():
    _, (x, weight, g, beta, conv, ssm) = mixer_inputs((1, 8, 1, 2, 8, 4, 4), True)
    call = lambda **kw: ring_gdn_mixer(*kw.pop("args", (x, weight, g, beta)), **{
        "mesh": _one_device_mesh(), "axis_name": "sp", "num_k_heads": 1, "head_k_dim": 8,
        "conv_state": conv, "ssm_state": ssm, **kw})
    with pytest.raises(ValueError, match="channels C=24 must be 2 \\* Nk \\* H = 32"):
        call(num_k_heads=2)
    with pytest.raises(ValueError, match=r"num_v_heads Nv=2 must be divisible by num_k_heads Nk=3"):
        call(num_k_heads=3, head_k_dim=2)
    with pytest.raises(ValueError, match=r"ssm_state.shape=\(1, 2, 8, 3\) must equal"):
        call(ssm_state=ssm[..., :3])
    with pytest.raises(ValueError, match=r"g.shape=\(1, 8, 2\) must equal beta.shape"):
        call(args=(x, weight, g, beta[..., :1]))
    with pytest.raises(ValueError, match="axis_name='tp' is not an axis"):
        call(axis_name="tp")
    with pytest.raises(ValueError, match="axis_name='sp' is not bound"):
        ring_gdn_mixer_local(x, weight, g, beta, axis_name="sp", num_k_heads=1, head_k_dim=8)


if __name__ == "__main__":
    _worker()
