"""Context and expert parallelism on a real 2-GPU mesh, with the GPU kernels, against one GPU.

Every check takes the devices it runs on and the backend of its ops:

- `ring_gdn` (chunk state along the ring) against `attn.gdn.gdn_chunked` on the whole sequence,
  both layouts, lengths the device count does not divide (S = 333: padded), float32 and bf16;
- `ring_causal_conv1d` (halo rows by `ppermute`) against `attn.conv1d.causal_conv1d`, and
  `ring_gdn_mixer` (conv + delta rule of a GDN layer) against `models.layers.gdn.gdn_mix`;
- the tensor-parallel engine with split weights (every routed MoE layer expert parallel, `E / 2`
  experts a device) on tiny Qwen3-Next and DeepSeek-V3 models against the one-device engine:
  identical tokens (greedy and sampled rows), next-token logits within rounding.

Each op check compares the outputs, the final state(s) and the gradients of
`sum(y cos(y)) + sum(sin(state))` with respect to every input (the loss of the fake-device tests,
whose input builders this module imports). float32: relative-norm error at most `F32_TOL`
against the one-device op on the same backend. bf16: the error against the one-device op on
float32 copies of the inputs at most 2x (outputs) / 3x (gradients) that of the one-device op on
the bf16 inputs (QUALITY.md), plus `BF16_FLOOR`.

`pytest -m gpu` runs the checks on two GPUs with the Triton backends named explicitly (the GDN
chunk kernels, conv1d; a backend that cannot run a case raises instead of falling back to XLA)
and the engine's defaults. `test_checks_on_fake_cpu_devices` runs the same checks in one worker
on 2 fake CPU devices (`tests.utils.run_worker`, the XLA backends), so the bodies are known to
pass before they reach a GPU; the worker's `comparison-catches-a-lost-state` check shows they
fail when the state does not travel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.attn import test_context_parallel_conv1d as cp_conv
from tests.attn import test_context_parallel_gdn as cp_gdn
from tests.utils import report_verdicts, run_worker

NUM_DEVICES = 2
CHUNK = 64  # the Triton chunked GDN kernels take 64 only
# float32: both sides run the same kernels over differently cut sequences (the ring's value
# columns [v | 0] widen the pass, D - 1 state products at HIGHEST); the Triton float32 path (3-pass
# TF32) is within 5e-5 of the reference (tests/attn/test_gdn_chunk_bwd.py), a wrong chunk, state
# or halo row gives >= 1e-2.
F32_TOL = 1e-4
BF16_FLOOR = 1e-3  # relative-norm noise floor of the bf16 ratio rule
# name -> (layout, (B, S, Nk, Nv, H, Hv), dtype)
GDN_CASES = {
    "gdn-contiguous-S333-f32": ("contiguous", (1, 333, 2, 4, 32, 32), "float32"),
    "gdn-zigzag-S333-f32": ("zigzag", (1, 333, 2, 4, 32, 32), "float32"),
    "gdn-zigzag-S256-B2-gva1-f32": ("zigzag", (2, 256, 2, 2, 32, 16), "float32"),
    "gdn-contiguous-S333-bf16": ("contiguous", (1, 333, 2, 4, 32, 32), "bfloat16"),
    "gdn-zigzag-S333-bf16": ("zigzag", (1, 333, 2, 4, 32, 32), "bfloat16"),
}
# name -> (layout, (B, S, C, W), dtype, bias)
CONV_CASES = {
    "conv-contiguous-S333-W4-f32": ("contiguous", (2, 333, 48, 4), "float32", True),
    "conv-zigzag-S333-W4-f32": ("zigzag", (2, 333, 48, 4), "float32", False),
    "conv-zigzag-S333-W4-bf16": ("zigzag", (1, 333, 48, 4), "bfloat16", True),
}
# name -> (layout, (B, S, Nk, Nv, H, Hv, W))
MIXER_CASES = {
    "mixer-contiguous-S333-f32": ("contiguous", (1, 333, 2, 4, 16, 16, 4)),
    "mixer-zigzag-S333-f32": ("zigzag", (1, 333, 2, 4, 16, 16, 4)),
}
# name -> test_engine_tp config
ENGINE_CASES = {
    "engine-qwen3_next-gdn-moe": "qwen3_next",
    "engine-deepseek_v3-mla-moe": "deepseek_v3",
}
# float32 logits, |logit| ~ 10: split reductions reorder sums (CPU ~1e-7); on the GPU the two
# engines' kernels may round dot operands to TF32 at different points.
LOGIT_TOL = {"cpu": 1e-5, "gpu": 1e-3}


def _mesh(devices, axis: str):
    from jax.sharding import AxisType, Mesh

    return Mesh(np.array(devices), (axis,), axis_types=(AxisType.Auto,))


def _rel(a, e) -> float:
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    e = np.asarray(jnp.asarray(e, jnp.float32), np.float64)
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30))


def _value_and_grads(fn, args):
    grad = jax.value_and_grad(cp_conv._loss(fn), argnums=tuple(range(len(args))), has_aux=True)
    (_, outs), grads = jax.jit(grad)(*args)
    return outs, grads


def compare(name: str, ours_fn, one_fn, args, labels) -> dict[str, float]:
    """Outputs and gradients of `ours_fn` (sharded) against `one_fn` (one device) on `args`;
    raises AssertionError past the tolerances of the module docstring. Returns each error."""
    outs, grads = _value_and_grads(ours_fn, args)
    want_outs, want_grads = _value_and_grads(one_fn, args)
    got = {f"out{i}": a for i, a in enumerate(outs)} | dict(zip(labels, grads))
    same = {f"out{i}": a for i, a in enumerate(want_outs)} | dict(zip(labels, want_grads))
    for key, a in got.items():
        assert a.shape == same[key].shape and a.dtype == same[key].dtype, (
            f"{name} {key}: {a.shape} {a.dtype} vs {same[key].shape} {same[key].dtype}")
    low = any(jnp.dtype(a.dtype) == jnp.bfloat16 for a in args)
    if not low:
        errors = {key: _rel(a, same[key]) for key, a in got.items() if a.size}
        bad = {k: e for k, e in errors.items() if not e <= F32_TOL}
        assert not bad, f"{name}: relative errors {bad} > {F32_TOL}"
        return errors
    up = tuple(a.astype(jnp.float32) if jnp.dtype(a.dtype) == jnp.bfloat16 else a for a in args)
    exact_outs, exact_grads = _value_and_grads(one_fn, up)
    exact = {f"out{i}": a for i, a in enumerate(exact_outs)} | dict(zip(labels, exact_grads))
    errors = {}
    for key, a in got.items():
        if not a.size:
            continue
        ours, base = _rel(a, exact[key]), _rel(same[key], exact[key])
        factor = 2 if key.startswith("out") else 3
        errors[key] = ours
        assert ours <= factor * base + BF16_FLOOR, (
            f"{name} {key}: error {ours:.3g} > {factor} x one device's {base:.3g} + {BF16_FLOOR}")
    return errors


def check_ring_gdn(devices, name: str, implementation: str) -> None:
    """`ring_gdn` over `devices` equals `gdn_chunked` on one device (`GDN_CASES[name]`)."""
    from attn.context_parallel import ring_gdn
    from attn.gdn import gdn_chunked

    layout, shape, dtype = GDN_CASES[name]
    q, k, v, g, beta, state = cp_gdn.inputs(shape, dtype, True, seed=len(name))
    mesh = _mesh(devices, "sp")
    opts = dict(use_qk_l2norm=True, chunk_size=CHUNK, implementation=implementation)
    ours = lambda q, k, v, g, beta, s: ring_gdn(q, k, v, g, beta, mesh=mesh, axis_name="sp",
                                                initial_state=s, layout=layout, **opts)
    one = lambda q, k, v, g, beta, s: gdn_chunked(q, k, v, g, beta, initial_state=s, **opts)
    with jax.default_device(devices[0]):
        compare(name, ours, one, (q, k, v, g, beta, state),
                ("dq", "dk", "dv", "dg", "dbeta", "dstate"))


def check_ring_conv(devices, name: str, implementation: str) -> None:
    """`ring_causal_conv1d` over `devices` equals `causal_conv1d` on one device."""
    from attn.context_parallel import ring_causal_conv1d
    from attn.conv1d import causal_conv1d

    layout, shape, dtype, with_bias = CONV_CASES[name]
    x, weight, bias, state = cp_conv.conv_inputs(shape, dtype, True, with_bias, seed=len(name))
    mesh = _mesh(devices, "sp")
    ours = lambda x, w, b, s: ring_causal_conv1d(
        x, w, b, mesh=mesh, axis_name="sp", initial_state=s, activation="silu", layout=layout,
        implementation=implementation)
    one = lambda x, w, b, s: causal_conv1d(x, w, b, initial_state=s, activation="silu",
                                           implementation=implementation)
    ours, one, args, keep = cp_conv._without_none(ours, one, (x, weight, bias, state))
    labels = [("dx", "dweight", "dbias", "dstate")[i] for i in keep]
    with jax.default_device(devices[0]):
        compare(name, ours, one, args, labels)


def check_ring_mixer(devices, name: str, implementation: str) -> None:
    """`ring_gdn_mixer` over `devices` equals the model layer's `gdn_mix` on one device, which
    picks its backends itself (`"auto"`: Triton on a GPU, XLA on a CPU)."""
    from attn.context_parallel import ring_gdn_mixer

    layout, shape = MIXER_CASES[name]
    spec, args = cp_conv.mixer_inputs(shape, True, seed=len(name))
    spec = dataclasses.replace(spec, chunk_size=CHUNK)
    one = cp_conv._mixer_reference(spec)
    mesh = _mesh(devices, "sp")
    ours = lambda x, w, g, beta, conv, ssm: ring_gdn_mixer(
        x, w, g, beta, mesh=mesh, axis_name="sp", num_k_heads=spec.num_k_heads,
        head_k_dim=spec.head_k_dim, conv_state=conv, ssm_state=ssm, scale=spec.scale,
        chunk_size=CHUNK, layout=layout, implementation=implementation)
    with jax.default_device(devices[0]):
        compare(name, ours, one, args,
                ("dx", "dweight", "dg", "dbeta", "dconv_state", "dssm_state"))


def check_expert_parallel_engine(devices, name: str) -> None:
    """The engine on a mesh over `devices` (split weights: MoE layers expert parallel) gives the
    one-device engine's tokens; each device holds `E / D` experts of every routed stack."""
    from models.engine import Engine, sharding
    from tests.models import test_engine_tp as tp_test

    model = tp_test.build(ENGINE_CASES[name])
    shape = dict(tp_test.SHAPE, batch_slots=2, implementation="auto")
    with jax.default_matmul_precision("highest"), jax.default_device(devices[0]):
        want, want_logits = tp_test._run(Engine(model, **shape))
    with jax.default_matmul_precision("highest"):
        tp = Engine(model, mesh=_mesh(devices, "tp"), shard_weights=True, **shape)
        got, got_logits = tp_test._run(tp)
    assert got == want, f"{name}: tokens {got} != one device {want}"
    err = float(np.max(np.abs(got_logits - want_logits)))
    tol = LOGIT_TOL[devices[0].platform] * max(1.0, float(np.max(np.abs(want_logits))))
    assert err <= tol, f"{name}: logits differ by {err:.3g} > {tol:.3g}"
    layers = sharding.moe_layers(nnx.merge(tp._graphdef.graphdef, tp._params))
    assert layers, f"{name}: no MoE layer"
    for i, moe in layers.items():
        assert moe.expert_parallel is not None, f"{name}: layer {i} not expert parallel"
        for a in jax.tree.leaves(nnx.state(moe.experts)):
            local = a.addressable_shards[0].data.shape
            assert local == (a.shape[0] // len(devices), *a.shape[1:]), (
                f"{name}: layer {i} holds {local} of {a.shape} a device")
    tp.check_page_tables()
    assert not tp.kv_usage()["pages"].any(), f"{name}: pages left after the run"


def _check_catches_lost_state(devices) -> None:
    """`compare` fails when the sharded side drops the carried state (the second device's block
    starting from zeros): the comparisons can fail."""
    from jax.sharding import PartitionSpec as P

    from attn.context_parallel._layout import shard_map
    from attn.gdn import gdn_chunked

    q, k, v, g, beta, state = cp_gdn.inputs((1, 128, 1, 2, 16, 16), "float32", True)
    mesh = _mesh(devices, "sp")
    opts = dict(use_qk_l2norm=True, chunk_size=CHUNK, implementation="xla")

    def lost(q, k, v, g, beta, s):  # each device runs its block alone from `s`
        local = lambda *xs: gdn_chunked(*xs[:5], initial_state=xs[5], **opts)
        o, final = shard_map(local, mesh=mesh, in_specs=(P(None, "sp"),) * 5 + (P(),),
                             out_specs=(P(None, "sp"), P()))(q, k, v, g, beta, s)
        return o, final

    one = lambda q, k, v, g, beta, s: gdn_chunked(q, k, v, g, beta, initial_state=s, **opts)
    try:
        compare("lost-state", lost, one, (q, k, v, g, beta, state),
                ("dq", "dk", "dv", "dg", "dbeta", "dstate"))
    except AssertionError:
        return
    raise AssertionError("compare passed a ring that drops the state between devices")


def _checks(devices, implementations) -> dict:
    """Every check on `devices`, the op checks once per backend in `implementations`."""
    checks = {}
    for impl in implementations:
        tag = "" if impl == implementations[0] else f"[{impl}]"
        for table, fn in ((GDN_CASES, check_ring_gdn), (CONV_CASES, check_ring_conv),
                          (MIXER_CASES, check_ring_mixer)):
            for name in table:
                checks[name + tag] = functools.partial(fn, devices, name, impl)
    for name in ENGINE_CASES:
        checks[name] = functools.partial(check_expert_parallel_engine, devices, name)
    checks["comparison-catches-a-lost-state"] = functools.partial(_check_catches_lost_state,
                                                                  devices)
    return checks


# On the fake CPU devices the XLA backends: the Triton interpreter's callbacks, entered by both
# devices at once, hang in the torch conversion.
CPU_IMPLEMENTATIONS = ("xla",)
CPU_CHECKS = list(_checks([None] * NUM_DEVICES, CPU_IMPLEMENTATIONS))


def _worker() -> None:
    report_verdicts(_checks(jax.devices()[:NUM_DEVICES], CPU_IMPLEMENTATIONS))


@pytest.fixture(scope="module")
def fake_run():
    return run_worker("tests.multigpu.test_gpu_mesh", NUM_DEVICES, timeout=300)


# slow (not in CI): on a 2-core host the 2-fake-device worker sometimes stalls, idle, inside
# XLA's CPU collectives. CI checks the same ops on 4 fake devices in their own modules.
@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_CHECKS)
def test_checks_on_fake_cpu_devices(fake_run, name):
    assert fake_run["devices"] == NUM_DEVICES
    assert fake_run["verdicts"][name] == "ok", fake_run["verdicts"][name]


def _gpus() -> list:
    return [d for d in jax.devices() if d.platform == "gpu"][:NUM_DEVICES]


two_gpus = pytest.mark.skipif(len(_gpus()) < NUM_DEVICES, reason="needs 2 GPUs")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("name", list(GDN_CASES))
def test_ring_gdn_equals_one_gpu(name):
    check_ring_gdn(_gpus(), name, "triton")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("name", list(CONV_CASES))
def test_ring_conv_equals_one_gpu(name):
    check_ring_conv(_gpus(), name, "triton")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("name", list(MIXER_CASES))
def test_ring_mixer_equals_one_gpu(name):
    check_ring_mixer(_gpus(), name, "triton")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("name", list(ENGINE_CASES))
def test_expert_parallel_engine_equals_one_gpu(name):
    check_expert_parallel_engine(_gpus(), name)


if __name__ == "__main__":
    _worker()
