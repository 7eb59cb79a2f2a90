"""Model-family registry: HF `architectures` / GGUF `general.architecture` → a `Family`.

A family module (`models/families/*.py`) builds one `Family` and calls `register(family)` at
import; `models/families/__init__.py` imports every family module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from models.config import ConfigBase, HFConfig
from models.convert.mapping import Rule


@dataclasses.dataclass(frozen=True)
class Family:
    """Everything conversion needs to know about one model family.

    Attributes:
      name: short name, stored in orbax checkpoints (`"llama"`).
      model_cls: the `nnx.Module` class, constructed as `model_cls(cfg, dtype=..., rngs=...)`.
      config_cls: its frozen config dataclass (`ConfigBase` subclass).
      config_from_hf: HF `config.json` (as `HFConfig`) → config; raises `ConfigError`.
      rules: config → list of `Rule` covering every parameter exactly once.
      hf_architectures: HF `architectures[0]` values handled.
      ignore: regexes (full match) of checkpoint names that are not weights (rotary buffers,
        MTP heads) and are skipped; a function of the config gives config-dependent ones.
      gguf_architectures: GGUF `general.architecture` values handled.
      gguf_config: `(metadata, tensor_shapes) -> HF config dict` for GGUF files.
      gguf_to_hf: GGUF tensor name → HF name, or None if unknown.
      gguf_fixup: `(hf_name, array, cfg) -> array` after dequantisation (q/k un-permutation).
    """

    name: str
    model_cls: type
    config_cls: type[ConfigBase]
    config_from_hf: Callable[[HFConfig], ConfigBase]
    rules: Callable[[Any], list[Rule]]
    hf_architectures: tuple[str, ...] = ()
    ignore: Callable[[Any], tuple[str, ...]] | tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    gguf_config: Callable[[Mapping[str, Any], Mapping[str, tuple]], dict] | None = None
    gguf_to_hf: Callable[[str], str | None] | None = None
    gguf_fixup: Callable[[str, np.ndarray, Any], np.ndarray] | None = None

    def ignore_patterns(self, cfg) -> tuple[str, ...]:
        """The ignore regexes for this config."""
        return tuple(self.ignore(cfg) if callable(self.ignore) else self.ignore)


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add a family; its name and architecture strings must be new.

    Raises:
      ValueError: a name or architecture is already registered.
    """
    if family.name in _FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    for other in _FAMILIES.values():
        for kind in ("hf_architectures", "gguf_architectures"):
            dup = set(getattr(family, kind)) & set(getattr(other, kind))
            if dup:
                raise ValueError(f"{kind} {sorted(dup)} of {family.name!r} already belong to "
                                 f"{other.name!r}")
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    """All registered families by name."""
    return dict(_FAMILIES)


def supported_architectures() -> dict[str, list[str]]:
    """`{"hf": [...], "gguf": [...]}`: every architecture string a checkpoint may declare."""
    hf = sorted(a for f in _FAMILIES.values() for a in f.hf_architectures)
    gg = sorted(a for f in _FAMILIES.values() for a in f.gguf_architectures)
    return {"hf": hf, "gguf": gg}


def get_family(name: str) -> Family:
    """The family called `name` (as stored in orbax checkpoints).

    Raises:
      ValueError: unknown name (the known ones listed).
    """
    if name not in _FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {sorted(_FAMILIES)}")
    return _FAMILIES[name]


def family_for_hf(architecture: str, source: str = "config.json") -> Family:
    """The family handling an HF `architectures[0]` value.

    Raises:
      ValueError: unsupported architecture (the supported ones listed).
    """
    for f in _FAMILIES.values():
        if architecture in f.hf_architectures:
            return f
    raise ValueError(f"{source}: unsupported architecture {architecture!r}; supported: "
                     f"{supported_architectures()['hf']}")


def family_for_gguf(architecture: str, source: str = "GGUF file") -> Family:
    """The family handling a GGUF `general.architecture` value.

    Raises:
      ValueError: unsupported architecture (the supported ones listed).
    """
    for f in _FAMILIES.values():
        if architecture in f.gguf_architectures:
            return f
    raise ValueError(f"{source}: unsupported GGUF architecture {architecture!r}; supported: "
                     f"{supported_architectures()['gguf']}")
