"""A fast reader of GGUF (v2 / v3) headers and tensors; dequantisation by `gguf.quants`.

`gguf.GGUFReader` builds numpy views of every metadata item, which takes tens of seconds on a
file with a 50k-token vocabulary. The loader only needs the scalar metadata, the tensor table and
one tensor's bytes at a time, so this reader walks the header with `struct` over an `mmap`,
skips long arrays (tokenizer vocabularies) without materialising them, and reads tensor bytes on
demand. The GGUF layout (little-endian):

    "GGUF" | u32 version | u64 n_tensors | u64 n_kv
    n_kv    × (string key | u32 value_type | value)       string = u64 length + utf-8 bytes
    n_tensors × (string name | u32 n_dims | u64 dims[n_dims] (fastest first) | u32 type
                 | u64 offset)
    padding to `general.alignment` (default 32) | tensor data (offsets relative to here)
"""

from __future__ import annotations

import dataclasses
import math
import mmap
import os
import struct
from typing import Any

import numpy as np

from models.convert.sources import CheckpointError

# GGUF metadata value types → struct format (scalars).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_ARRAY_KEPT = 256


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF file.

    Attributes:
      name: GGUF tensor name.
      shape: numpy order (slowest first: GGUF's dims reversed).
      qtype: `gguf.GGMLQuantizationType` value.
      offset: absolute byte offset of its data in the file.
      nbytes: size of its data.
    """

    name: str
    shape: tuple[int, ...]
    qtype: int
    offset: int
    nbytes: int


class _Cursor:
    """Little-endian reads from a buffer, with the position checked against its size."""

    def __init__(self, buf, size: int):
        self.buf, self.size, self.pos = buf, size, 0

    def unpack(self, fmt: str):
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.unpack("<Q")
        if self.pos + n > self.size:
            raise ValueError(f"string of {n} bytes at offset {self.pos} runs past the file end")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return s

    def value(self, vtype: int, keep: bool = True):
        """One metadata value; long arrays are walked over and returned as None."""
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype} at offset {self.pos}")
        etype, count = self.unpack("<I"), self.unpack("<Q")
        keep = keep and count <= _MAX_ARRAY_KEPT
        if etype in _SCALARS:  # fixed width: read in one go, or jump over
            fmt = _SCALARS[etype]
            items = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos)) \
                if keep else None
            self.pos += struct.calcsize(fmt) * count
            return items
        items = [self.value(etype, keep) for _ in range(count)]
        return items if keep else None


class GGUFFile:
    """Metadata and tensor table of a GGUF file; `read(name)` dequantises one tensor to float32.

    Attributes:
      metadata: scalar, string and short-array fields (arrays longer than 256 are left out).
      tensors: `TensorInfo` by GGUF name, in file order.

    Raises:
      CheckpointError: not a GGUF file, unsupported version, a truncated header, an unknown
        tensor type, or tensor data past the end of the file (the tensor named).
    """

    def __init__(self, path: str):
        self.path = path
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, TensorInfo] = {}
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                if size < 24 or f.read(4) != b"GGUF":
                    raise CheckpointError(f"{path}: not a GGUF file (bad magic)")
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    self._parse(_Cursor(mm, size))
        except CheckpointError:
            raise
        except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError) as e:
            raise CheckpointError(f"{path}: not a readable GGUF file: {type(e).__name__}: {e}") \
                from None

    def _parse(self, cur: _Cursor) -> None:
        import gguf

        cur.pos = 4
        version = cur.unpack("<I")
        if version not in (2, 3):
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        for _ in range(n_kv):
            key = cur.string()
            v = cur.value(cur.unpack("<I"))
            if v is not None:
                self.metadata[key] = v
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = [cur.unpack("<Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-cur.pos // align) * align
        for name, dims, qtype, offset in infos:
            try:
                qt = gguf.GGMLQuantizationType(qtype)
                block, type_size = gguf.GGML_QUANT_SIZES[qt]
            except (ValueError, KeyError):
                raise CheckpointError(f"{self.path}: tensor {name!r} has unknown GGML type "
                                      f"{qtype}") from None
            n = math.prod(dims)
            if n % block:
                raise CheckpointError(f"{self.path}: tensor {name!r} has {n} elements, not a "
                                      f"multiple of its block size {block}")
            nbytes = n // block * type_size
            if data_start + offset + nbytes > cur.size:
                raise CheckpointError(f"{self.path}: data of tensor {name!r} runs past the end "
                                      f"of the file (truncated file?)")
            self.tensors[name] = TensorInfo(name, tuple(int(d) for d in reversed(dims)), qt,
                                            data_start + offset, nbytes)

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 (quantised types dequantised by `gguf.quants`)."""
        import gguf

        info = self.tensors[name]
        raw = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if raw.size != info.nbytes:
            raise CheckpointError(f"{self.path}: tensor {name!r} is truncated")
        raw = raw.reshape(*info.shape[:-1], -1)
        try:
            arr = gguf.quants.dequantize(raw, info.qtype)
        except NotImplementedError as e:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from None
        return np.asarray(arr, dtype=np.float32).reshape(info.shape)
