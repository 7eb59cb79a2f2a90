"""`from_pretrained`: HF directory or GGUF file → a Flax NNX model, tensor by tensor.

1. Read the config (`config.json` or GGUF metadata), pick the family by architecture.
2. Build the model abstractly (`nnx.eval_shape`: shapes and dtypes, no memory).
3. Account before reading any data: every parameter is produced by exactly one rule, every
   checkpoint tensor is consumed by exactly one rule or ignored by name; shapes are checked by
   running each rule's transform under `jax.eval_shape` on the header shapes. Missing,
   unexpected and mis-shaped tensors are all reported, by name, in one `CheckpointError`.
4. Read, cast, transform and place one rule's tensors at a time (tqdm progress bar), so peak host
   memory stays near one copy of the largest tensor on top of the model itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ConfigError, HFConfig
from models.convert import registry
from models.convert.gguf_file import GGUFFile
from models.convert.sources import CheckpointError, GGUFSource, SafetensorsSource
from models.layers.linear import abstract_init

log = logging.getLogger(__name__)
_MAX_LISTED = 25


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """What a load did. `consumed[name]` is 1 for every tensor read; `ignored` were skipped."""

    family: str
    consumed: dict[str, int]
    ignored: tuple[str, ...]


def resolve_dtype(dtype) -> jnp.dtype:
    """A floating jnp dtype from a dtype or its name.

    Raises:
      TypeError: not a floating dtype.
    """
    try:
        d = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{dtype=} is not a dtype") from None
    if not jnp.issubdtype(d, jnp.floating):
        raise TypeError(f"{dtype=} must be a floating dtype (float32, bfloat16, float16)")
    return d


def abstract_model(family: registry.Family, cfg, dtype) -> nnx.Module:
    """The family's model with `ShapeDtypeStruct` parameters (see `layers.linear.weight`)."""
    with abstract_init():
        return family.model_cls(cfg, dtype=dtype, rngs=nnx.Rngs(0))


def flat_params(state) -> dict[str, nnx.Variable]:
    """`{"layers/0/mixer/q_proj/kernel": Variable}` for an nnx state."""
    return {"/".join(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = f"\n    ... and {len(items) - len(shown)} more" if len(items) > len(shown) else ""
    return f"  {title} ({len(items)}):\n" + "".join(f"    {s}\n" for s in shown) + more


def check_rules(rules, params: dict, family: str) -> None:
    """The family's rules produce every parameter exactly once and use each tensor once.

    Raises:
      RuntimeError: a family bug (a parameter with no rule or two, a tensor in two rules).
    """
    targets = Counter(r.target for r in rules)
    twice = sorted(t for t, c in targets.items() if c > 1)
    no_rule = sorted(set(params) - set(targets))
    no_param = sorted(set(targets) - set(params))
    used = Counter(s for r in rules for s in r.sources)
    reused = sorted(s for s, c in used.items() if c > 1)
    if twice or no_rule or no_param or reused:
        raise RuntimeError(
            f"family {family!r} name map is inconsistent with its model:\n"
            + (_listing("parameters with two rules", twice) if twice else "")
            + (_listing("parameters without a rule", no_rule) if no_rule else "")
            + (_listing("rules for no parameter", no_param) if no_param else "")
            + (_listing("checkpoint tensors used twice", reused) if reused else ""))


@functools.lru_cache(maxsize=4096)
def _converted_shape(transform, shapes: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    """Shape a rule's transform gives for these source shapes (None: it cannot apply)."""
    if transform is None:
        return shapes[0] if len(shapes) == 1 else None
    structs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    try:
        return tuple(jax.eval_shape(transform, *structs).shape)
    except (TypeError, ValueError):
        return None


def account(rules, params: dict, source, ignore: tuple[str, ...], where: str) -> tuple[str, ...]:
    """Check names and shapes before loading; returns the ignored checkpoint names.

    Raises:
      CheckpointError: missing, unexpected or mis-shaped tensors (all of them, by name).
    """
    available = set(source.names())
    needed = {s for r in rules for s in r.sources}
    missing = sorted(needed - available)
    patterns = [re.compile(p) for p in ignore]
    extra = sorted(available - needed)
    ignored = tuple(n for n in extra if any(p.fullmatch(n) for p in patterns))
    skip = set(ignored)
    unexpected = [source.describe(n) for n in extra if n not in skip]
    misshaped = []
    for r in rules:
        if any(s not in available for s in r.sources):
            continue
        want = params[r.target]
        shapes = tuple(tuple(source.shape(s)) for s in r.sources)
        got = _converted_shape(r.transform, shapes)
        if got != tuple(want.shape):
            shapes = ", ".join(f"{source.describe(s)} {list(source.shape(s))}"
                               for s in r.sources[:4])
            if len(r.sources) > 4:
                shapes += f", ... ({len(r.sources)} tensors)"
            made = "cannot be converted" if got is None else f"gives {list(got)}"
            misshaped.append(f"{shapes}: {made}; parameter {r.target} needs "
                             f"{list(want.shape)}")
    if missing or unexpected or misshaped:
        raise CheckpointError(
            f"{where}: checkpoint does not match the model:\n"
            + (_listing("missing tensors", missing) if missing else "")
            + (_listing("unexpected tensors", unexpected) if unexpected else "")
            + (_listing("mis-shaped tensors", misshaped) if misshaped else ""))
    return ignored


def load_state(model: nnx.Module, family: registry.Family, cfg, source, *, where: str,
               progress: bool = True) -> tuple[nnx.Module, LoadReport]:
    """Fill an abstract model's parameters from `source` with the family's rules."""
    from tqdm.auto import tqdm

    graphdef, state = nnx.split(model)
    params = flat_params(state)
    rules = family.rules(cfg)
    check_rules(rules, params, family.name)
    ignored = account(rules, params, source, family.ignore_patterns(cfg), where)
    consumed: Counter = Counter()
    values = {}
    bar = tqdm(rules, desc=f"loading {os.path.basename(where.rstrip('/'))}", unit="tensor",
               disable=not progress, leave=False)
    for r in bar:
        want = params[r.target]
        arrays = []
        for s in r.sources:
            arrays.append(jnp.asarray(np.asarray(source.read(s), dtype=want.dtype)))
            consumed[s] += 1
        value = r.apply(*arrays)
        del arrays
        if value.shape != tuple(want.shape):  # header shapes lied about the data
            raise CheckpointError(f"{where}: parameter {r.target} came out {value.shape}, "
                                  f"expected {tuple(want.shape)}")
        values[r.target] = value.astype(want.dtype)
    bar.close()
    flat = [(path, var.replace(value=values["/".join(str(p) for p in path)]))
            for path, var in nnx.to_flat_state(state)]
    loaded = nnx.merge(graphdef, nnx.from_flat_state(flat))
    return loaded, LoadReport(family.name, dict(consumed), ignored)


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found (an HF checkpoint directory needs "
                              f"config.json)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def _open_hf(directory: str):
    cfg_path = os.path.join(directory, "config.json")
    hf = HFConfig(_read_json(cfg_path), source=cfg_path)
    archs = hf.get("architectures")
    if not archs or not isinstance(archs, list) or not isinstance(archs[0], str):
        raise ConfigError(f"{cfg_path}: field 'architectures' must be a non-empty list of "
                          f"class names; got {hf.data.get('architectures')!r}; supported: "
                          f"{registry.supported_architectures()['hf']}")
    family = registry.family_for_hf(archs[0], source=cfg_path)
    cfg = family.config_from_hf(hf)
    return family, cfg, SafetensorsSource(directory)


def _open_gguf(path: str):
    gfile = GGUFFile(path)
    meta = gfile.metadata
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{path}: GGUF metadata field 'general.architecture' is missing")
    family = registry.family_for_gguf(arch, source=path)
    shapes = {name: info.shape for name, info in gfile.tensors.items()}
    hf = HFConfig(family.gguf_config(meta, shapes), source=f"{path} (GGUF metadata)")
    cfg = family.config_from_hf(hf)
    fixup = None
    if family.gguf_fixup is not None:
        fixup = functools.partial(_fixup, family.gguf_fixup, cfg)
    return family, cfg, GGUFSource(gfile, to_hf=family.gguf_to_hf, fixup=fixup)


def _fixup(fn, cfg, name, arr):
    return fn(name, arr, cfg)


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.float32, progress: bool = True,
                    return_report: bool = False):
    """Load an HF checkpoint directory or a `.gguf` file as a model of its family.

    Args:
      path: a directory with `config.json` and `model.safetensors` (or a sharded
        `model.safetensors.index.json`), or a `.gguf` file.
      dtype: parameter and compute dtype (`jnp.float32`, `jnp.bfloat16`, or their names).
        Quantised GGUF tensors are dequantised, then cast.
      progress: show a tqdm progress bar.
      return_report: also return a `LoadReport` (tensors consumed, names ignored).

    Returns:
      The model (`model(input_ids) -> logits`), or `(model, report)`.

    Raises:
      FileNotFoundError: `path` does not exist.
      ConfigError: a missing or invalid config field (named).
      ValueError: an unsupported architecture (the supported ones listed).
      CheckpointError: unreadable / corrupt files; missing, unexpected or mis-shaped tensors.
      TypeError: a non-floating `dtype`.
    """
    dtype = resolve_dtype(dtype)
    path = os.fspath(path)
    if os.path.isdir(path):
        family, cfg, source = _open_hf(path)
    elif os.path.isfile(path):
        family, cfg, source = _open_gguf(path)
    else:
        raise FileNotFoundError(f"{path}: no such checkpoint directory or GGUF file")
    model = abstract_model(family, cfg, dtype)
    model, report = load_state(model, family, cfg, source, where=path, progress=progress)
    log.info("loaded %s (%s): %d tensors, %d ignored", path, family.name,
             len(report.consumed), len(report.ignored))
    return (model, report) if return_report else model
