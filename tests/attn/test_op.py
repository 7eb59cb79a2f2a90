"""The op layer (`attn._op`): dispatch by declared reasons, configs, the tuning cache, the
reference gradient, device facts."""

import dataclasses
import inspect
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
from attn import _op
from attn.dense import attention
from attn.dense import triton as dense_triton


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tiles:
    block: int = 16
    stages: int = 2


def _double(*, x, config=None):
    del config
    return x * 2.0


def _square_reference(*, x):
    return x * x


def _make_op(calls: list, *, refuse=(), backward=()):
    def kernel(*, x, config):
        calls.append(("kernel", config))
        return jax.lax.stop_gradient(x * x) + 0 * x  # a "kernel" without the true gradient

    def reference(*, x):
        calls.append(("xla", None))
        return x * x

    def validate(x):
        """Square `x`."""
        if not isinstance(x, jax.Array | np.ndarray):
            raise TypeError(f"x={x!r} must be an array")
        return dict(x=x)

    backends = (
        _op.Backend(name="triton", run=kernel, supports=lambda args, config: list(refuse),
                    backward=lambda args: list(backward), platforms=("cpu", "gpu"),
                    config_type=Tiles, default_config=lambda args: Tiles(),
                    tuning_key=lambda args: f"n{args['x'].shape[0]}"),
        _op.Backend(name="xla", run=reference, platforms=("cpu", "gpu")),
    )
    return _op.op(name="square", backends=backends)(validate)


def test_auto_runs_the_first_backend_without_reasons():
    calls = []
    square = _make_op(calls)
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(square(x), x * x)
    assert calls == [("kernel", Tiles())]
    calls.clear()
    refusing = _make_op(calls, refuse=["odd sizes"])
    np.testing.assert_array_equal(refusing(x), x * x)  # falls back to the reference
    assert calls == [("xla", None)]
    assert refusing.reasons("triton", x) == ["odd sizes"]
    with pytest.raises(NotImplementedError, match="square: the triton backend does not support "
                                                  "odd sizes"):
        refusing(x, implementation="triton")
    with pytest.raises(NotImplementedError, match="'mosaic' is not a backend"):
        square(x, implementation="mosaic")
    with pytest.raises(ValueError, match="implementation='cuda'"):
        square(x, implementation="cuda")


def test_signature_and_docstring_are_the_validation_functions():
    square = _make_op([])
    assert square.__doc__ == "Square `x`."
    assert list(inspect.signature(square).parameters) == [
        "x", "implementation", "config"]
    with pytest.raises(TypeError, match="x=3 must be an array"):
        square(3)


def test_config_names_its_backend_and_is_checked():
    calls = []
    square = _make_op(calls)
    x = jnp.arange(3.0)
    square(x, config=Tiles(block=32))
    assert calls == [("kernel", Tiles(block=32))]
    with pytest.raises(TypeError, match="config of type int configures none of its backends"):
        square(x, config=7)
    with pytest.raises(TypeError, match="does not configure the triton backend"):
        square(x, implementation="triton", config=7)


def test_tuning_cache_updates_the_heuristic(tmp_path):
    calls = []
    square = _make_op(calls)
    x = jnp.arange(5.0)
    path = tmp_path / "tuned.json"
    try:
        _op.set_tuning_cache(path)
        square(x)
        assert calls[-1] == ("kernel", Tiles())  # no file yet: the heuristic
        _op.save_tuned("square", "triton", "n5", Tiles(block=64, stages=3))
        cache = json.loads(path.read_text())
        assert cache[_op.device_facts().kind]["square/triton"]["n5"] == {"block": 64,
                                                                          "stages": 3}
        square(x)
        assert calls[-1] == ("kernel", Tiles(block=64, stages=3))
        square(jnp.arange(6.0))  # another key: the heuristic
        assert calls[-1] == ("kernel", Tiles())
    finally:
        _op.set_tuning_cache(None)
    square(x)
    assert calls[-1] == ("kernel", Tiles())


def test_backward_reasons_give_the_reference_gradient():
    x = jnp.arange(1.0, 4.0)
    own = jax.grad(lambda x: _make_op([])(x).sum())(x)
    np.testing.assert_array_equal(own, np.zeros(3))  # the kernel's own (here: no) gradient
    ref = jax.grad(lambda x: _make_op([], backward=["no backward"])(x).sum())(x)
    np.testing.assert_array_equal(ref, 2 * x)


def test_backends_must_end_with_the_reference():
    with pytest.raises(ValueError, match="must be distinct and end with 'xla'"):
        _op.Op(lambda x: dict(x=x), name="bad", backends=(
            _op.Backend(name="triton", run=_square_reference),))
    with pytest.raises(ValueError, match="config_type and default_config together"):
        _op.Backend(name="triton", run=_double, config_type=Tiles)


def test_device_facts_on_this_device():
    facts = _op.device_facts()
    if jax.default_backend() == "gpu":
        assert facts.num_sms == jax.devices()[0].core_count
    else:  # the H100 the heuristics are measured on
        assert (facts.num_sms, facts.shared_memory) == (132, 232448)
    assert facts.kind == jax.devices()[0].device_kind


def test_auto_on_a_gpu_picks_the_kernel_that_takes_the_arguments(monkeypatch):
    q = jnp.ones((1, 8, 2, 16))
    k = jnp.ones((1, 8, 1, 16))
    monkeypatch.setattr(attn._harness, "on_gpu", lambda: True)
    args = attention.validate(q, k, k)
    backend, config = attention.select("auto", args)  # Mosaic refuses float32 / H16 / no Hopper
    assert (backend.name, config) == ("triton", dense_triton.default_config(16, 16, 4))
    seg = np.zeros((1, 8), np.int32)
    backend, _ = attention.select("auto", attention.validate(q, k, k, q_segment_ids=seg,
                                                             kv_segment_ids=seg))
    assert backend.name == "xla"
