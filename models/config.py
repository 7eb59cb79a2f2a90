"""Frozen config dataclasses shared by every model family: JSON round trip and field checks.

A family's config is a `@dataclasses.dataclass(frozen=True, kw_only=True)` subclass of
`ConfigBase`, validated in `__post_init__` with the helpers below so that every error names the
offending field and value. `to_dict` / `from_dict` give the JSON form stored next to orbax
checkpoints (nested configs become nested dicts, tuples become lists and come back as tuples).

HF `config.json` parsing lives with each family (`models/families/*.py`); `HFConfig` wraps the raw
dict so that a missing or ill-typed field is reported by name.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Self


class ConfigError(ValueError):
    """A checkpoint config is missing a field, has an ill-typed one, or is inconsistent."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConfigBase:
    """Base of every model config: JSON round trip; subclasses validate in `__post_init__`."""

    def to_dict(self) -> dict[str, Any]:
        """Nested plain-Python form (dicts, lists, numbers, strings, None)."""
        out = {}
        for f in dataclasses.fields(self):
            out[f.name] = _to_plain(getattr(self, f.name))
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Self:
        """Inverse of `to_dict`.

        Raises:
          ConfigError: unknown or missing keys (named).
        """
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"{cls.__name__}: unknown config fields {unknown}")
        kwargs = {k: _from_plain(hints[k], v) for k, v in data.items()}
        try:
            return cls(**kwargs)
        except TypeError as e:  # a missing required field
            raise ConfigError(f"{cls.__name__}: {e}") from e


def _to_plain(v):
    if isinstance(v, ConfigBase):
        return v.to_dict()
    if isinstance(v, tuple | list):
        return [_to_plain(x) for x in v]
    return v


def _from_plain(hint, v):
    """Rebuild nested configs and tuples from their JSON form, guided by the field's type hint."""
    if v is None:
        return None
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) \
        else (hint,)
    for opt in options:
        if isinstance(opt, type) and issubclass(opt, ConfigBase) and isinstance(v, Mapping):
            return opt.from_dict(v)
        if typing.get_origin(opt) is tuple and isinstance(v, list | tuple):
            args = typing.get_args(opt)
            inner = args[0] if args else Any
            return tuple(_from_plain(inner, x) for x in v)
    return v


def check_positive(cls_name: str, **fields) -> None:
    """Raise ConfigError unless every given field is a positive int."""
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{cls_name}.{name}={value!r} must be a positive int")


def check_divisible(cls_name: str, a: str, va: int, b: str, vb: int) -> None:
    """Raise ConfigError unless `va % vb == 0`."""
    if vb <= 0 or va % vb:
        raise ConfigError(f"{cls_name}.{a}={va} must be divisible by {cls_name}.{b}={vb}")


def check_choice(cls_name: str, name: str, value, choices) -> None:
    """Raise ConfigError unless `value in choices`."""
    if value not in choices:
        raise ConfigError(f"{cls_name}.{name}={value!r} must be one of {tuple(choices)}")


class HFConfig:
    """Read-only view of an HF `config.json` dict whose errors name the field.

    Args:
      data: the parsed JSON.
      source: where it came from (a path), used in messages.
    """

    def __init__(self, data: Mapping[str, Any], source: str = "config.json"):
        self.data = dict(data)
        self.source = source

    def __contains__(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default=None):
        """The value, or `default` when the key is absent or null."""
        v = self.data.get(key)
        return default if v is None else v

    def require(self, key: str, kind: type | tuple[type, ...] = int):
        """The value of a required field of the given Python type(s).

        Raises:
          ConfigError: the field is absent, null or of the wrong type.
        """
        if self.data.get(key) is None:
            raise ConfigError(f"{self.source}: required field {key!r} is missing")
        return self._typed(key, self.data[key], kind)

    def optional(self, key: str, kind: type | tuple[type, ...], default):
        """The value of an optional typed field, `default` if absent or null."""
        if self.data.get(key) is None:
            return default
        return self._typed(key, self.data[key], kind)

    def _typed(self, key, value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, bool) and bool not in kinds:
            raise ConfigError(f"{self.source}: field {key}={value!r} must be {_names(kinds)}")
        if not isinstance(value, kinds):
            raise ConfigError(f"{self.source}: field {key}={value!r} must be {_names(kinds)}")
        return value


def _names(kinds) -> str:
    return " or ".join(k.__name__ for k in kinds)
