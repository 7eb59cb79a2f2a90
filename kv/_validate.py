"""Validation helpers for kv/: each raises with the offending value named.

kv/ depends on nothing else of ours (DESIGN.md), so it keeps its own small copy of the checks
instead of importing `attn._checks`. All checks read static facts (shapes, dtypes, Python ints), so
they also run under `jit`.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp

INT32_MAX = 2**31 - 1


def check_int(name: str, value) -> int:
    """Raise TypeError unless `value` is a Python int (not bool); return it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} must be an int")
    return int(value)


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """Raise unless `value` is an int `>= minimum`; return it."""
    value = check_int(name, value)
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum}")
    return value


def check_rank(name: str, x, rank: int, letters: str) -> None:
    """Raise ValueError unless `x.ndim == rank`; `letters` documents the expected shape."""
    if x.ndim != rank:
        raise ValueError(f"{name} must have shape [{letters}] (rank {rank}); got shape {x.shape}")


def check_shape(name: str, x, shape: tuple, letters: str) -> None:
    """Raise ValueError unless `x.shape == shape`."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be [{letters}]={tuple(shape)}")


def check_integer(name: str, x) -> None:
    """Raise TypeError unless `x` is an integer (not bool) array."""
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name}.dtype={x.dtype} must be an integer type")


def check_bool(name: str, x) -> None:
    """Raise TypeError unless `x` is a bool array."""
    if jnp.dtype(x.dtype) != jnp.dtype(bool):
        raise TypeError(f"{name}.dtype={x.dtype} must be bool")


def check_floating(name: str, x) -> None:
    """Raise TypeError unless `x` is a floating-point array."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name}.dtype={x.dtype} must be floating point")


def check_int32_slots(name: str, count: int) -> None:
    """Refuse pools whose flat token slots (`page * P + offset`) would overflow int32."""
    if count > INT32_MAX:
        raise ValueError(f"{name}={count} flat slots would overflow int32 slot ids "
                         f"(max {INT32_MAX}); use fewer or smaller pages")


def as_int_array(name: str, x, shape: tuple, letters: str):
    """An int32 array broadcast to `shape` from a Python int or an integer array.

    Raises:
      TypeError: not an int / integer array.
      ValueError: does not broadcast to `shape`.
    """
    if isinstance(x, bool):
        raise TypeError(f"{name}={x!r} must be an int or an integer array")
    x = jnp.asarray(x)
    check_integer(name, x)
    try:
        return jnp.broadcast_to(x.astype(jnp.int32), shape)
    except ValueError:
        raise ValueError(f"{name}.shape={tuple(x.shape)} must broadcast to "
                         f"[{letters}]={tuple(shape)}") from None
