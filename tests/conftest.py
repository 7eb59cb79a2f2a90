"""Test configuration: deterministic XLA, GPU tests only on a GPU, CPU tests only on CPU builds."""

import os

# Deterministic reductions on the GPU; on the CPU one thread per op keeps 2-core CI responsive.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
os.environ.setdefault("JAX_ENABLE_X64", "0")
os.environ.setdefault("HOME", os.environ.get("HOME") or "/tmp")

import jax
import pytest


def pytest_collection_modifyitems(config, items):
    has_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the GPU machine")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
