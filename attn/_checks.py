"""Validation shared by every public op (`attn/` and `kv/`): each check raises with the offending
value named, and the opt-in checked mode for values only known inside `jit`.

The input contract (README, "Input contract"):

* Static facts (ranks, shapes, dtypes, Python scalars) and concrete arrays are checked eagerly:
  `ValueError` / `TypeError` naming the value.
* Traced values (lengths, table ids, gates) cannot be checked under `jit`; they have one meaning
  on every backend (lengths clamped to `[0, capacity]`; a table id outside `[0, num_pages)` is an
  absent page, never read).
* `debug_checks()` turns those traced-value violations into errors at run time: while it is on,
  ops traced inside it add a host callback (`jax.debug.callback`) that raises the same
  `ValueError` the eager check would (surfacing as a `JaxRuntimeError` from the jitted call). It
  is read at trace time, so a function jitted before it was turned on stays unchecked.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def check_rank(name: str, x, rank: int, letters: str) -> None:
    """Raise ValueError unless `x.ndim == rank`; `letters` documents the expected shape."""
    if x.ndim != rank:
        raise ValueError(f"{name} must have shape [{letters}] (rank {rank}); got shape {x.shape}")


def check_dtype(name: str, x, allowed: Sequence) -> None:
    """Raise TypeError unless `x.dtype` is one of `allowed`."""
    allowed = tuple(jnp.dtype(d) for d in allowed)
    if jnp.dtype(x.dtype) not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{name}.dtype={x.dtype} must be one of ({names})")


def check_floating(name: str, x) -> None:
    """Raise TypeError unless `x` is a floating-point array."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}.dtype={x.dtype} must be floating point")


def check_float_dtype(name: str, dtype, *, min_bits: int = 8):
    """The `jnp.dtype` of `dtype`; TypeError unless it is floating with at least `min_bits`."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating) or 8 * dtype.itemsize < min_bits:
        raise TypeError(f"{name}={dtype} must be a floating dtype"
                        + (f" of at least {min_bits} bits" if min_bits > 8 else ""))
    return dtype


def check_flag(name: str, value) -> bool:
    """Raise TypeError unless `value` is a Python (or numpy) bool; return it as a bool."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}={value!r} must be a bool")
    return bool(value)


def check_instance(name: str, x, cls: type) -> None:
    """Raise TypeError unless `x` is a `cls` (a state pytree such as `kv.PagePool`)."""
    if not isinstance(x, cls):
        raise TypeError(f"{name} must be a {cls.__name__}; got {type(x).__name__}")


def check_integer(name: str, x) -> None:
    """Raise TypeError unless `x` is an integer array."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}.dtype={x.dtype} must be an integer type")


def check_same(name_a: str, a, name_b: str, b) -> None:
    """Raise ValueError unless two sizes agree."""
    if a != b:
        raise ValueError(f"{name_a}={a} must equal {name_b}={b}")


def check_divisible(name_a: str, a: int, name_b: str, b: int) -> None:
    """Raise ValueError unless `a % b == 0` (and b > 0)."""
    if b <= 0 or a % b:
        raise ValueError(f"{name_a}={a} must be divisible by {name_b}={b}")


def check_positive(name: str, value: int) -> None:
    """Raise ValueError unless `value > 0`."""
    if value <= 0:
        raise ValueError(f"{name}={value} must be positive")


def check_power_of_two(name: str, value: int) -> None:
    """Raise ValueError unless `value` is a positive power of two."""
    if value <= 0 or value & (value - 1):
        raise ValueError(f"{name}={value} must be a power of two")


def check_launch_config(config, *, tiles: Sequence[str], warps: Sequence[str] = ("num_warps",),
                        stages: Sequence[str] = ("num_stages",)) -> None:
    """Validate a kernel launch config dataclass: every field in `tiles` a power of two >= 16
    (a `tl.dot` operand side), `warps` in {1, 2, 4, 8, 16}, `stages` >= 1; ValueError names the
    field and its value."""
    for name in tiles:
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= 16")
    for name in warps:
        if getattr(config, name) not in (1, 2, 4, 8, 16):
            raise ValueError(f"{name}={getattr(config, name)} must be one of 1, 2, 4, 8, 16")
    for name in stages:
        if getattr(config, name) < 1:
            raise ValueError(f"{name}={getattr(config, name)} must be >= 1")


def check_int32_addressable(name: str, shape: Sequence[int]) -> None:
    """Refuse arrays whose flat element count would overflow int32 offsets in a kernel."""
    n = 1
    for d in shape:
        n *= int(d)
    if n > INT32_MAX:
        raise ValueError(f"{name} with shape {tuple(shape)} has {n} elements, more than int32 "
                         f"addressing allows ({INT32_MAX}); split it or use more pages")


def concrete(x) -> np.ndarray | None:
    """`x` as a numpy array, or None when it is traced (value checks then wait for run time)."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_int(name: str, value) -> int:
    """Raise TypeError unless `value` is a Python int (not bool); return it."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    return int(value)


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """Raise unless `value` is an int `>= minimum`; return it."""
    value = check_int(name, value)
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def check_int32_value(name: str, value: int) -> int:
    """Raise ValueError unless the Python int `value` fits int32 (it becomes an int32 array)."""
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"{name}={value} does not fit int32 [{INT32_MIN}, {INT32_MAX}]")
    return int(value)


def check_shape(name: str, x, shape: tuple, letters: str) -> None:
    """Raise ValueError unless `x.shape == shape`."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be [{letters}]={tuple(shape)}")


def check_bool(name: str, x) -> None:
    """Raise TypeError unless `x` is a bool array."""
    if jnp.dtype(x.dtype) != jnp.dtype(bool):
        raise TypeError(f"{name}.dtype={x.dtype} must be bool")


def check_int32_slots(name: str, count: int) -> None:
    """Refuse pools whose flat token slots (`page * P + offset`) would overflow int32."""
    if count > INT32_MAX:
        raise ValueError(f"{name}={count} flat slots would overflow int32 slot ids "
                         f"(max {INT32_MAX}); use fewer or smaller pages")


def as_int_array(name: str, x, shape: tuple, letters: str):
    """An int32 array broadcast to `shape` from a Python int or an integer array.

    Raises:
      TypeError: not an int / integer array.
      ValueError: does not broadcast to `shape`, or a Python int outside int32.
    """
    if isinstance(x, bool):
        raise TypeError(f"{name}={x!r} must be an int or an integer array")
    if isinstance(x, numbers.Integral):
        check_int32_value(name, int(x))
    x = jnp.asarray(x)
    check_integer(name, x)
    try:
        return jnp.broadcast_to(x.astype(jnp.int32), shape)
    except ValueError:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must broadcast to "
                         f"[{letters}]={tuple(shape)}") from None


def check_scale(scale, *, allow_none: bool = True, allow_traced: bool = False):
    """The softmax scale rule of every op: None (the op's default), or a finite number > 0.

    Returns the scale as a Python float (or None, or the traced scalar when `allow_traced`).

    Raises:
      TypeError: not a real number (or a non-scalar array).
      ValueError: not finite or not positive, on every backend alike.
    """
    if scale is None and allow_none:
        return None
    if allow_traced and isinstance(scale, jax.Array | np.ndarray):
        if scale.ndim:
            raise ValueError(f"scale must be a scalar; got shape {scale.shape}")
        value = concrete(scale)
        if value is None:
            return scale  # traced: its value cannot be checked here
        scale = float(value)
    if isinstance(scale, bool | np.bool_) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale={scale!r} (type {type(scale).__name__}) must be a real number")
    if not (np.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale} must be positive and finite")
    return float(scale)


# -- checked mode -------------------------------------------------------------------------------

_DEBUG_CHECKS = [False]


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
    """Check traced values inside `jit` while the context is open (see the module docstring).

    Ops traced inside the context check, at run time, the values they can only see traced: block
    table ids in `[-1, num_pages)`, lengths in `[0, capacity]`, offsets and sinks `>= 0`, GDN
    gates (`g <= 0`, `beta` in `[0, 1]`). A violation raises a `ValueError` naming the values in a
    host callback; the jitted call then fails with a `JaxRuntimeError` carrying that message.
    Costs a device -> host copy of the checked arrays per call: a debugging tool, off by default.

    Example:
      with attn.debug_checks():
          out = jax.jit(step)(...)  # traced here: checked
    """
    previous = _DEBUG_CHECKS[0]
    _DEBUG_CHECKS[0] = bool(enabled)
    try:
        yield
    finally:
        _DEBUG_CHECKS[0] = previous


def debug_checks_enabled() -> bool:
    """Whether ops traced now add the checked mode's run-time checks."""
    return _DEBUG_CHECKS[0]


def _range_error(name: str, values: np.ndarray, lo, hi) -> ValueError | None:
    bad = np.zeros(values.shape, bool)
    if lo is not None:
        bad |= values < lo
    if hi is not None:
        bad |= values > hi
    if not bad.any():
        return None
    where = [int(i) for i in np.argwhere(bad)[0]]
    if hi is None:
        rule = f"must be >= {lo}"
    elif lo is None:
        rule = f"must be <= {hi}"
    else:
        rule = f"must lie in [{lo}, {hi}]"
    if values.size <= 16:
        shown = values.tolist()
    else:
        shown = f"(shape {values.shape}: {int(bad.sum())} bad, first at {where}: " \
            f"{values[tuple(where)]})"
    return ValueError(f"{name}={shown} {rule}")


def check_range(name: str, x, lo=None, hi=None, *, eager: bool = True) -> None:
    """Values of `x` in `[lo, hi]` (either bound may be None).

    Concrete `x` and `eager`: checked now (ValueError naming the values). Traced `x` (or `eager`
    False): checked at run time only in the checked mode (`debug_checks`); otherwise the op's
    documented traced-value semantics apply. A bound may be a float (gates).
    """
    if eager:
        values = concrete(x)
        if values is not None:
            error = _range_error(name, values, lo, hi)
            if error is not None:
                raise error
            return
    if not debug_checks_enabled():
        return

    def host_check(values):
        error = _range_error(name, np.asarray(values), lo, hi)
        if error is not None:
            raise error

    jax.debug.callback(host_check, x)


def check_table_ids(name: str, table, num_pages: int) -> None:
    """Checked mode only: block-table ids in `[-1, num_pages)`.

    Outside the checked mode an id outside `[0, num_pages)` is an absent page on every backend
    (invisible, never read); tables are data, so they are not checked eagerly (that would copy the
    table to the host on every eager call).
    """
    check_range(name, table, -1, num_pages - 1, eager=False)
