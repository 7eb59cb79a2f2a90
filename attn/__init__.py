"""Attention ops: one subpackage per variant, each with a pure-JAX reference and GPU kernels."""

import os as _os
import sys as _sys

import jax as _jax

# Triton decides at decoration time whether `@triton.jit` compiles or interprets, so on a machine
# without a CUDA GPU the interpreter must be switched on before `triton` is first imported. It is
# what lets CI run the very kernels the GPU compiles.
if "triton" not in _sys.modules and "TRITON_INTERPRET" not in _os.environ:
    if _jax.default_backend() != "gpu":
        _os.environ["TRITON_INTERPRET"] = "1"

# Imported after the switch above: it imports jax only, never triton.
from attn._checks import debug_checks, debug_checks_enabled

__all__ = ["debug_checks", "debug_checks_enabled"]
