"""Ops and backends: one signature, one validation and one dispatch per public op.

An op is one object (`Op`), made from a validation function by the `op` decorator. The function
holds the op's signature and its only docstring; it checks the arguments and returns them
normalised, as a dict (the op's "args"). Its backends are `Backend` records, in the op's order of
preference; each says up front, as data, what it cannot do:

- `supports(args, config) -> list[str]`: the reasons it cannot run these args with this launch
  config (empty: it can);
- `platforms`: where `implementation="auto"` may pick it (a Triton kernel named explicitly also
  runs on a CPU, through Triton's interpreter: that is how CI tests it);
- `backward(args) -> list[str]`: the reasons its own backward cannot differentiate these args.
  Where there are some, the op gives it the reference's gradient (`attn._grad`), once, here.

Dispatch: `implementation="auto"` runs the first backend for this platform with no reasons;
a named backend with reasons raises `NotImplementedError` listing them. The `"xla"` backend (the
reference) is always last and supports everything the validation lets through. A `config=` names
its backend: with `"auto"`, the backend whose config type it is runs (or says why not).

Configs: a backend may carry a frozen config dataclass and a heuristic `default_config(args)`.
`config=` on the op overrides it; otherwise the heuristic's config, updated by the tuning cache
(a JSON file `{device kind: {"op/backend": {key: {field: value}}}}`, where the key is the
backend's `tuning_key(args)`) when one is set (`set_tuning_cache` or `$LONGCTX_TUNING_CACHE`).

Device facts (`device_facts()`: SM count, shared memory per block) come from the device; on a CPU,
where kernels run interpreted, they are an H100's, the GPU the heuristics are measured on.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from attn import _grad, _harness

IMPLEMENTATIONS = ("xla", "triton", "mosaic", "auto")
Args = dict[str, Any]


def _none(args: Args, config: Any = None) -> list[str]:
    del args, config
    return []


def _resolve(ref):
    """A callable, or `"module:attribute"` imported on first use (kernel modules import lazily:
    Mosaic GPU needs a GPU-enabled jaxlib)."""
    if not isinstance(ref, str):
        return ref
    module, attribute = ref.split(":")
    return getattr(importlib.import_module(module), attribute)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Backend:
    """One implementation of an op, with what it supports as data.

    `run(**args, config=...)` (or without `config` when `config_type` is None) returns the op's
    outputs. Callables may be given as `"module:attribute"` strings, imported on first use.
    """

    name: str
    run: Callable[..., Any] | str
    supports: Callable[[Args, Any], list[str]] | str = _none
    backward: Callable[[Args], list[str]] | str = _none
    platforms: tuple[str, ...] = ("gpu",)
    config_type: type | str | None = None
    default_config: Callable[[Args], Any] | str | None = None
    tuning_key: Callable[[Args], str] | str | None = None

    def __post_init__(self):
        if self.name not in IMPLEMENTATIONS or self.name == "auto":
            raise ValueError(f"backend name={self.name!r} must be one of {IMPLEMENTATIONS[:-1]}")
        if (self.config_type is None) != (self.default_config is None):
            raise ValueError(f"backend {self.name}: give config_type and default_config together")

    def reasons(self, args: Args, config: Any = None) -> list[str]:
        return list(_resolve(self.supports)(args, config))


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
    """What kernels' heuristics need to know about the device."""

    kind: str  # jax's `device_kind`, e.g. "NVIDIA H100 80GB HBM3"; "cpu" on a CPU
    num_sms: int  # streaming multiprocessors
    shared_memory: int  # bytes of shared memory a block may use (opt-in maximum)


_H100 = dict(num_sms=132, shared_memory=232448)


@functools.cache
def device_facts() -> DeviceFacts:
    """The default device's facts; an H100's SM count and shared memory on a CPU (kernels run
    interpreted there, with the launch configs measured on the H100)."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return DeviceFacts(kind=device.device_kind, **_H100)
    num_sms = getattr(device, "core_count", None) or _H100["num_sms"]
    shared_memory = _H100["shared_memory"]
    try:  # Triton's driver reads the CUDA device attributes
        from triton.runtime import driver

        props = driver.active.utils.get_device_properties(device.local_hardware_id or 0)
        shared_memory = int(props["max_shared_mem"])
        num_sms = int(props.get("multiprocessor_count", num_sms))
    except (ImportError, RuntimeError, KeyError, AttributeError):  # no driver: JAX's count
        pass
    return DeviceFacts(kind=device.device_kind, num_sms=int(num_sms), shared_memory=shared_memory)


_tuning_path: str | None = None


def set_tuning_cache(path: str | os.PathLike | None) -> None:
    """Use the tuning cache at `path` (None: the heuristics only, unless $LONGCTX_TUNING_CACHE)."""
    global _tuning_path
    _tuning_path = None if path is None else os.fspath(path)
    _load_cache.cache_clear()


def dtype_tag(x) -> str:
    """The dtype part of a tuning key: empty for 1- and 2-byte inputs (what the heuristics are
    measured on), `-float32` for wider ones (their tiles differ)."""
    dtype = jnp.dtype(x.dtype)
    return f"-{dtype.name}" if dtype.itemsize > 2 else ""


def _cache_path() -> str | None:
    return _tuning_path or os.environ.get("LONGCTX_TUNING_CACHE") or None


@functools.cache
def _load_cache(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def save_tuned(op_name: str, backend: str, key: str, config: Any, *, path=None) -> None:
    """Record `config` (a config dataclass) for `(op, backend, key)` on this device kind."""
    path = os.fspath(path or _cache_path() or "")
    if not path:
        raise ValueError("no tuning cache: pass path= or call set_tuning_cache first")
    cache = dict(_load_cache(path))
    entry = cache.setdefault(device_facts().kind, {}).setdefault(f"{op_name}/{backend}", {})
    entry[key] = dataclasses.asdict(config)
    with open(path, "w") as f:
        json.dump(cache, f, indent=1, sort_keys=True)
    _load_cache.cache_clear()


class Op:
    """A public op: `op(*args, implementation="auto", config=None, **kwargs)`.

    Validates once (the wrapped function), picks a backend (see the module docstring), resolves
    its config, and runs it. `reasons(name, ...)` says why a backend would not run a call.
    """

    def __init__(self, validate: Callable[..., Args], *, name: str, backends: Sequence[Backend]):
        names = [b.name for b in backends]
        if not backends or names[-1] != "xla" or len(set(names)) != len(names):
            raise ValueError(f"{name}: backends {names} must be distinct and end with 'xla'")
        self.name = name
        self.validate = validate
        self.backends = {b.name: b for b in backends}
        functools.update_wrapper(self, validate)
        sig = inspect.signature(validate)
        extra = [inspect.Parameter("implementation", inspect.Parameter.KEYWORD_ONLY,
                                   default="auto", annotation="str")]
        if any(b.config_type is not None for b in backends):
            extra.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY,
                                           default=None, annotation="Any"))
        self.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])

    def __repr__(self) -> str:
        return f"<op {self.name}: {', '.join(self.backends)}>"

    def reasons(self, implementation: str, *args, config: Any = None, **kwargs) -> list[str]:
        """Why backend `implementation` would not run this call (empty: it would)."""
        bound = self.validate(*args, **kwargs)
        backend = self.backends[implementation]
        return backend.reasons(bound, self.config_for(backend, bound, config))

    def select(self, implementation: str, args: Args, config: Any = None) -> tuple[Backend, Any]:
        """The backend that runs `args` and its config: by name, by `config`'s type, or the first
        that can (`"auto"`)."""
        if implementation not in IMPLEMENTATIONS:
            raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
        if implementation == "auto" and config is not None:
            implementation = next(
                (b.name for b in self.backends.values() if b.config_type is not None
                 and isinstance(config, _resolve(b.config_type))), None)
            if implementation is None:
                raise TypeError(f"{self.name}: config of type {type(config).__name__} "
                                f"configures none of its backends {tuple(self.backends)}")
        if implementation == "auto":
            platform = "gpu" if _harness.on_gpu() else jax.default_backend()
            for backend in self.backends.values():
                if backend.name == "xla":
                    return backend, self.config_for(backend, args, config)
                if platform in backend.platforms:
                    chosen = self.config_for(backend, args)
                    if not backend.reasons(args, chosen):
                        return backend, chosen
        if implementation not in self.backends:
            raise NotImplementedError(f"{self.name}: {implementation=} is not a backend of this "
                                      f"op; it has {tuple(self.backends)}")
        backend = self.backends[implementation]
        chosen = self.config_for(backend, args, config)
        reasons = backend.reasons(args, chosen)
        if reasons:
            raise NotImplementedError(f"{self.name}: the {implementation} backend does not "
                                      f"support {'; '.join(reasons)}")
        return backend, chosen

    def config_for(self, backend: Backend, args: Args, config: Any = None) -> Any:
        """`config` checked against the backend, else its heuristic updated by the tuning cache."""
        config_type = _resolve(backend.config_type)
        if config is not None:
            if config_type is None or not isinstance(config, config_type):
                raise TypeError(f"{self.name}: config of type {type(config).__name__} does not "
                                f"configure the {backend.name} backend (it takes "
                                f"{getattr(config_type, '__name__', 'no config')})")
            return config
        if config_type is None:
            return None
        config = _resolve(backend.default_config)(args)
        path = _cache_path()
        if path and backend.tuning_key is not None:
            tuned = _load_cache(path).get(device_facts().kind, {}).get(
                f"{self.name}/{backend.name}", {}).get(_resolve(backend.tuning_key)(args))
            if tuned:
                config = dataclasses.replace(config, **tuned)
        return config

    def __call__(self, *args, implementation: str = "auto", config: Any = None, **kwargs):
        if implementation not in IMPLEMENTATIONS:  # before the arguments: the call itself is wrong
            raise ValueError(f"{implementation=} must be one of {IMPLEMENTATIONS}")
        bound = self.validate(*args, **kwargs)
        backend, config = self.select(implementation, bound, config)
        run = _resolve(backend.run)
        if backend.config_type is not None:
            run = functools.partial(run, config=config)
        if backend.name != "xla" and _resolve(backend.backward)(bound):
            return _with_reference_gradient(run, _resolve(self.backends["xla"].run), bound)
        return run(**bound)


def _is_array(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _with_reference_gradient(run, reference, args: Args):
    """`run(**args)` forward, the VJP of `reference(**args)` backward (`attn._grad`)."""
    arrays = {k: v for k, v in args.items() if _is_array(v)}
    static = {k: v for k, v in args.items() if k not in arrays}
    fn = _grad.with_reference_gradient(lambda a: run(**static, **a),
                                       lambda a: reference(**static, **a))
    return fn(arrays)


def op(*, name: str, backends: Sequence[Backend]) -> Callable[[Callable[..., Args]], Op]:
    """Decorator: the validation function (signature, docstring, checks) becomes the `Op`."""
    return lambda validate: Op(validate, name=name, backends=backends)
