"""Orbax save / load of converted models: atomic save, strict restore.

Layout of a checkpoint directory:

    ckpt/LATEST              one line: the name of the current version ("v000002")
    ckpt/v000002/model.json  {"format", "family", "dtype", "config"}: enough to rebuild the module
    ckpt/v000002/state/      orbax (StandardCheckpointer) tree of every nnx variable
    ckpt/v000002/tokenizer/  optional: the tokenizer (`save_pretrained`), so that
                             `models.load_pretrained(ckpt)` returns model and tokenizer

`save` writes a new version into a hidden temporary directory, renames it into place, then
atomically replaces `LATEST` (`os.replace`) and only afterwards deletes older versions. An
interrupted save therefore leaves `LATEST` pointing at the previous, complete version; its
leftovers are removed by the next save. `load` rebuilds the model abstractly from `model.json`
and restores only if the stored tree has exactly the expected names, shapes and dtypes; a
`dtype=` other than the stored one then casts every parameter to the dtype the model built at
that dtype declares for it.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
from flax import nnx

from models.convert import registry
from models.convert.loader import abstract_model, flat_params, resolve_dtype
from models.convert.sources import CheckpointError

FORMAT = "longctx-model/1"
TOKENIZER = "tokenizer"  # subdirectory of a version holding the tokenizer, if one was saved
_VERSION = re.compile(r"v(\d{6})")
_TMP = re.compile(r"\.tmp-v\d{6}-.*")


def _nested(flat: dict[str, object]) -> dict:
    out: dict = {}
    for key, value in flat.items():
        node = out
        *head, last = key.split("/")
        for p in head:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _flatten(tree, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
        return out
    return {prefix[:-1]: tree}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _write_state(path: str, arrays: dict[str, jax.Array]) -> None:
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path, _nested(arrays))
    ckpt.wait_until_finished()
    ckpt.close()


def _versions(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if _VERSION.fullmatch(n))


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a directory written by `save` (it has a `LATEST` file)."""
    return os.path.isfile(os.path.join(os.fspath(path), "LATEST"))


def save(model: nnx.Module, directory: str | os.PathLike, *, tokenizer=None) -> str:
    """Save `model` (a registered family's module) atomically under `directory`.

    Args:
      model: a model built by `from_pretrained`, `load` or a family class.
      directory: created if needed; an existing checkpoint there is replaced atomically.
      tokenizer: optional tokenizer with `save_pretrained(dir)` (transformers), stored in the
        same version directory, so model and tokenizer are replaced together.

    Returns:
      The path of the version directory written.

    Raises:
      TypeError: `model` is not a registered family's module, or `tokenizer` has no
        `save_pretrained`.
      ValueError: `directory` exists and holds something other than a longctx checkpoint.
    """
    name = getattr(type(model), "family", "")
    if not name or name not in registry.families():
        raise TypeError(f"{type(model).__name__} is not a registered model family; "
                        f"known: {sorted(registry.families())}")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise TypeError(f"tokenizer of type {type(tokenizer).__name__} has no save_pretrained; "
                        f"pass a transformers tokenizer or None")
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    entries = os.listdir(directory)
    foreign = [e for e in entries if not (e == "LATEST" or _VERSION.fullmatch(e)
                                          or _TMP.fullmatch(e) or e == "LATEST.tmp")]
    if foreign:
        raise ValueError(f"{directory} holds {sorted(foreign)[:5]}, not a longctx checkpoint; "
                         f"refusing to write there")
    numbers = [int(m[1]) for e in entries if (m := re.search(r"v(\d{6})", e))]
    version = f"v{max(numbers, default=0) + 1:06d}"
    tmp = os.path.join(directory, f".tmp-{version}-{os.getpid()}")
    final = os.path.join(directory, version)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    arrays = {k: v[...] for k, v in flat_params(nnx.state(model)).items()}
    _write_state(os.path.join(tmp, "state"), arrays)
    _write_json(os.path.join(tmp, "model.json"), {
        "format": FORMAT, "family": name, "dtype": jnp.dtype(model.dtype).name,
        "config": model.cfg.to_dict()})
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(tmp, TOKENIZER))
    _fsync_dir(tmp)
    os.rename(tmp, final)
    latest_tmp = os.path.join(directory, "LATEST.tmp")
    with open(latest_tmp, "w") as f:
        f.write(version + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(directory, "LATEST"))
    _fsync_dir(directory)
    for entry in os.listdir(directory):  # previous versions and leftovers of interrupted saves
        if entry != version and (_VERSION.fullmatch(entry) or _TMP.fullmatch(entry)):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
    return final


def _current(directory: str) -> str:
    """Path of the version `LATEST` names."""
    try:
        with open(os.path.join(directory, "LATEST")) as f:
            version = f.read().strip()
    except OSError:
        raise CheckpointError(f"{directory}: no checkpoint (LATEST missing)") from None
    if not _VERSION.fullmatch(version):
        raise CheckpointError(f"{directory}/LATEST: invalid version name {version!r}")
    return os.path.join(directory, version)


def tokenizer_dir(directory: str | os.PathLike) -> str | None:
    """The tokenizer directory saved with the current version, or None if none was saved.

    Raises:
      CheckpointError: no checkpoint at `directory`.
    """
    path = os.path.join(_current(os.path.abspath(os.fspath(directory))), TOKENIZER)
    return path if os.path.isdir(path) else None


def load(directory: str | os.PathLike, *, dtype=None) -> nnx.Module:
    """Load the current version of a checkpoint written by `save`.

    Args:
      directory: the checkpoint directory.
      dtype: parameter and compute dtype (`jnp.bfloat16`, `"float32"`, ...); None keeps the
        stored one. Casting happens after the strict restore at the stored dtype.

    Returns:
      The model, parameters on the default device.

    Raises:
      CheckpointError: no checkpoint there, an unreadable `model.json`, an unknown format, or a
        stored tree whose names, shapes or dtypes differ from the model's (each named).
      ValueError: an unknown family.
      TypeError: a non-floating `dtype`.
    """
    target = None if dtype is None else resolve_dtype(dtype)
    directory = os.path.abspath(os.fspath(directory))
    path = _current(directory)
    try:
        with open(os.path.join(path, "model.json")) as f:
            meta = json.load(f)
        fmt, family_name = meta["format"], meta["family"]
        dtype_name, cfg_dict = meta["dtype"], meta["config"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}/model.json: unreadable: {e!r}") from None
    if fmt != FORMAT:
        raise CheckpointError(f"{path}/model.json: format={fmt!r}; expected {FORMAT!r}")
    family = registry.get_family(family_name)
    cfg = family.config_cls.from_dict(cfg_dict)
    model = abstract_model(family, cfg, jnp.dtype(dtype_name))
    graphdef, state = nnx.split(model)
    params = flat_params(state)
    restored = _restore_strict(os.path.join(path, "state"), params)
    if target is not None and target != jnp.dtype(dtype_name):
        model = abstract_model(family, cfg, target)
        graphdef, state = nnx.split(model)
        want = flat_params(state)
        restored = {k: v.astype(want[k].dtype) for k, v in restored.items()}
    flat = [(p, v.replace(value=restored["/".join(str(x) for x in p)]))
            for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _restore_strict(path: str, params: dict) -> dict[str, jax.Array]:
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    try:
        stored = _flatten(ckpt.metadata(path).item_metadata.tree)
    except Exception as e:  # orbax raises FileNotFoundError, ValueError, ... on damage
        raise CheckpointError(f"{path}: unreadable orbax metadata: {e!r}") from None
    problems = []
    for key in sorted(set(params) - set(stored)):
        problems.append(f"missing {key}")
    for key in sorted(set(stored) - set(params)):
        problems.append(f"unexpected {key}")
    for key in sorted(set(params) & set(stored)):
        want, got = params[key], stored[key]
        if tuple(got.shape) != tuple(want.shape) or jnp.dtype(got.dtype) != want.dtype:
            problems.append(f"{key}: stored {got.dtype}{list(got.shape)}, model needs "
                            f"{want.dtype}{list(want.shape)}")
    if problems:
        raise CheckpointError(f"{path}: stored tree does not match the model:\n  "
                              + "\n  ".join(problems[:25]))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = _nested({k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=device)
                      for k, v in params.items()})
    try:
        out = ckpt.restore(path, target)
    except Exception as e:
        raise CheckpointError(f"{path}: restore failed: {e!r}") from None
    finally:
        ckpt.close()
    return _flatten(out)
