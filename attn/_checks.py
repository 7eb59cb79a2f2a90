"""Validation helpers shared by the public ops: each raises with the offending value named."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = 2**31 - 1


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
