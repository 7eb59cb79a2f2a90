"""Validation helpers for kv/: the shared checks of `attn._checks`, under the names kv/ uses.

One implementation of every check (`attn/_checks.py`), so an op in `attn/` and a writer in `kv/`
refuse the same input with the same message. All of them read static facts (shapes, dtypes, Python
ints), so they also run under `jit`.
"""

from attn._checks import (
    INT32_MAX,
    as_int_array,
    check_bool,
    check_dtype,
    check_float_dtype,
    check_floating,
    check_instance,
    check_int,
    check_int32_slots,
    check_integer,
    check_positive_int,
    check_range,
    check_rank,
    check_shape,
    check_table_ids,
)

__all__ = [
    "INT32_MAX",
    "as_int_array",
    "check_bool",
    "check_dtype",
    "check_float_dtype",
    "check_floating",
    "check_instance",
    "check_int",
    "check_int32_slots",
    "check_integer",
    "check_positive_int",
    "check_range",
    "check_rank",
    "check_shape",
    "check_table_ids",
]
