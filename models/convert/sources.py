"""Checkpoint tensor sources: HF safetensors (single file or sharded index) and GGUF.

A source lists tensor names (HF naming) with their shapes from file headers alone and reads one
tensor at a time, so a load holds at most one host copy of one tensor besides the model.

* `SafetensorsSource`: a small reader of the safetensors format (8-byte header length, JSON
  header, raw little-endian data), using `ml_dtypes` for bf16 / fp8, which numpy lacks. Corrupt
  headers, offsets past the end of the file and size mismatches are reported with the file name.
* `GGUFSource`: a parsed `GGUFFile` (`gguf_file.py`); quantised tensors are dequantised with
  `gguf.quants.dequantize`; names are translated to HF names by the family's table; the family's
  fix-up hook undoes llama.cpp's tensor permutations (the Llama q/k rotary permutation).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import ml_dtypes
import numpy as np


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: unreadable file, or tensors missing / unexpected /
    mis-shaped (each named in the message)."""


_ST_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_MAX_HEADER = 100 * 2**20


class _SafetensorsFile:
    """Header of one `.safetensors` file; `read` returns one tensor as a fresh numpy array."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise ValueError(f"file has {size} bytes, too short for a header")
                n = int.from_bytes(head, "little")
                if n > min(size - 8, _MAX_HEADER):
                    raise ValueError(f"header length {n} exceeds the file ({size} bytes)")
                header = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors file: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors file: header is not a JSON object")
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.entries: dict[str, tuple[Any, tuple[int, ...], int]] = {}
        for name, info in header.items():
            try:
                dtype = np.dtype(_ST_DTYPES[info["dtype"]])
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{path}: corrupt safetensors entry for tensor {name!r}: "
                                      f"{e!r}") from None
            if end - begin != math.prod(shape) * dtype.itemsize or self.base + end > size:
                raise CheckpointError(
                    f"{path}: corrupt safetensors entry for tensor {name!r}: bytes "
                    f"[{begin}, {end}) do not hold {info['dtype']}{list(shape)} within the "
                    f"file's {size - self.base} data bytes (truncated file?)")
            self.entries[name] = (dtype, shape, begin)

    def read(self, name: str) -> np.ndarray:
        dtype, shape, begin = self.entries[name]
        count = math.prod(shape)
        arr = np.fromfile(self.path, dtype=dtype, count=count, offset=self.base + begin)
        if arr.size != count:
            raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
        return arr.reshape(shape)


class SafetensorsSource:
    """An HF directory's weights: `model.safetensors` or `model.safetensors.index.json` + shards.

    Raises:
      CheckpointError: no weights file, an unreadable index, a corrupt shard, an index entry
        whose shard lacks it, or a tensor present in two shards.
    """

    def __init__(self, directory: str):
        self.path = directory
        index = os.path.join(directory, "model.safetensors.index.json")
        single = os.path.join(directory, "model.safetensors")
        self._where: dict[str, _SafetensorsFile] = {}
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: unreadable index: {e!r}") from None
            files = {}
            for shard in sorted(set(weight_map.values())):
                files[shard] = _SafetensorsFile(os.path.join(directory, shard))
            for sf in files.values():
                for name in sf.entries:
                    if name in self._where:
                        raise CheckpointError(f"{directory}: tensor {name!r} appears in two "
                                              f"shards ({self._where[name].path}, {sf.path})")
                    self._where[name] = sf
            for name, shard in weight_map.items():
                if name not in files[shard].entries:
                    raise CheckpointError(f"{index}: tensor {name!r} is listed in {shard} but "
                                          f"that shard does not contain it")
        elif os.path.exists(single):
            sf = _SafetensorsFile(single)
            self._where = dict.fromkeys(sf.entries, sf)
        else:
            raise CheckpointError(f"{directory}: no model.safetensors or "
                                  f"model.safetensors.index.json")

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._where[name].entries[name][1]

    def describe(self, name: str) -> str:
        return f"{name!r} ({os.path.basename(self._where[name].path)})"

    def read(self, name: str) -> np.ndarray:
        return self._where[name].read(name)


class GGUFSource:
    """Tensors of a `.gguf` file under HF names, dequantised to float32 on read.

    Args:
      gguf_file: the parsed file (`models.convert.gguf_file.GGUFFile`).
      to_hf: GGUF tensor name → HF name (None: keep the GGUF name, so it is reported as such).
      fixup: `(hf_name, array) -> array` applied after dequantisation (permutations).
    """

    def __init__(self, gguf_file, *, to_hf: Callable[[str], str | None],
                 fixup: Callable[[str, np.ndarray], np.ndarray] | None = None):
        self.file = gguf_file
        self.path = gguf_file.path
        self._fixup = fixup
        self._gguf_name: dict[str, str] = {}
        for name in gguf_file.tensors:
            hf = to_hf(name) or name
            if hf in self._gguf_name:
                raise CheckpointError(f"{self.path}: tensors {self._gguf_name[hf]!r} and "
                                      f"{name!r} both map to {hf!r}")
            self._gguf_name[hf] = name

    def names(self) -> list[str]:
        return list(self._gguf_name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.tensors[self._gguf_name[name]].shape

    def describe(self, name: str) -> str:
        g = self._gguf_name[name]
        return f"{name!r}" if g == name else f"{name!r} (GGUF {g!r})"

    def read(self, name: str) -> np.ndarray:
        arr = self.file.read(self._gguf_name[name])
        if self._fixup is not None:
            arr = self._fixup(name, arr)
        return arr


def unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation for rotate-half RoPE.

    llama.cpp's converter reorders each head's rows from the rotate-half order (view `[2, H/2]`)
    to adjacent pairs (view `[H/2, 2]`) so that its GPT-J-style RoPE applies. The inverse views
    each head's rows as `[H/2, 2]` and transposes back to `[2, H/2]`.

    Args:
      w: `[num_heads * H, ...]` q or k projection weight (or bias) in GGUF row order.
      num_heads: heads of this projection (N for q, K for k).
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise CheckpointError(f"cannot un-permute a tensor with {rows} rows for {num_heads=}")
    half = rows // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config_from_gguf(meta: Mapping[str, Any], arch: str, table: Mapping[str, str]) -> dict:
    """HF config fields from `{arch}.{key}` GGUF metadata through `table` (GGUF key → HF key)."""
    out = {}
    for gkey, hkey in table.items():
        full = f"{arch}.{gkey}"
        if full in meta:
            out[hkey] = meta[full]
    return out
