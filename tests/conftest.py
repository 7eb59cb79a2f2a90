"""Test configuration: deterministic XLA, GPU tests only on a GPU, CPU tests only on CPU builds."""

import importlib.util
import os

# Deterministic reductions on the GPU.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
os.environ.setdefault("JAX_ENABLE_X64", "0")
os.environ.setdefault("HOME", os.environ.get("HOME") or "/tmp")
# Without a CUDA plugin every test runs on the CPU at tiny shapes, where XLA's compiling costs far
# more than running: its cheap compile mode (inherited by the workers and scripts the tests
# start; the notebooks, real-sized, opt out) takes about a fifth off the suite. GPU runs keep
# full optimisation.
if not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin")):
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    # XLA's CPU fusion emitters (the default) spend longer compiling each small fusion than its
    # classic elemental emitters, which run the same HLO: a quarter off the compile-bound tests.
    if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# Pallas's Mosaic GPU interpreter needs 4 threads in XLA's CPU pool, which XLA sizes from NPROC
# (else the cores: 2 in CI); see `attn.dense.mosaic.xla_cpu_threads`.
os.environ.setdefault("NPROC", "4")

import jax
import pytest

# Parametrisations whose coverage a sibling case of the same test keeps in CI: they run with
# `-m slow`, so the 2-core CI stays within its 15-minute budget. Node ids, parameters included.
SLOW_ON_CPU = (
    *(f"tests/attn/test_xattention_triton.py::test_select_blocks_kernel[{p}]"
      for p in ("0.0-11", "0.0-64", "0.3-11", "0.3-64", "0.5-11", "0.5-64", "0.9-11", "0.999-11",
                "0.999-64", "1.0-11", "1.0-64")),
    *(f"tests/attn/test_block_sparse_triton.py::test_flat_walk_steps_and_groups[{p}]"
      for p in ("4-bs64-4steps-2tiles", "4-bs32-2steps-bm-capped")),
    "tests/attn/test_gdn_triton.py::test_pairs_match_per_head_path_bf16_varlen[gva2-headmajor]",
    "tests/attn/test_xattention_triton.py::test_fp8_matches_dequantised_reference"
    "[st16-bs32-H16-scratch-bf16-128x256x128]",
    "tests/attn/test_xattention_triton.py::test_fp8_matches_dequantised_reference"
    "[st8-bs64-G5-lengths-bf16-64x64x32]",
    "tests/attn/test_xattention_triton.py::test_kernel_matches_reference"
    "[st16-bs32-scratch-bf16-128x256x64]",
    "tests/attn/test_xattention_triton.py::test_kernel_matches_reference"
    "[st4-bs32-H40-G2-norm-64x128x16]",
    "tests/attn/test_block_sparse_triton.py::test_heads_fastest_order_is_bitwise_the_default"
    "[bs64-4steps-2tiles]",
    "tests/kv/test_fp8.py::test_triton_write_equals_xla[sb1]",
    "tests/kv/test_fp8.py::test_triton_write_equals_xla[sb16]",
    # Shared-base cases a sibling keeps in CI: chunk borders T63 / T64 (T1, T65, T200 stay;
    # the XLA lengths also in test_gdn.py::test_chunked_recurrent_naive_agree), the middle fp8
    # sub-block, a middle group size, a second random MLA layout.
    *(f"tests/attn/test_gdn_triton.py::TestTriton::test_chunked_matches_float64[T{t}]"
      for t in (63, 64)),
    *(f"tests/attn/test_gdn.py::TestXla::test_chunked_matches_float64[T{t}]"
      for t in (1, 63, 64, 65, 200)),
    "tests/attn/test_paged_decode_triton.py::TestTriton::test_fp8_pages[sb4]",
    "tests/attn/test_block_sparse_triton.py::TestTriton::test_gqa_group_sizes[G5]",
    "tests/attn/test_mla_triton.py::TestTriton::test_matches_absorbed_attention"
    "[L48-R24-B3-P4-splits3-random]",
    "tests/models/test_engine_hybrid.py::test_greedy_equals_full_forward[deepseek_v2]",
    "tests/models/test_engine_hybrid.py::test_greedy_equals_full_forward[qwen3_5]",
    "tests/models/test_generate.py::test_bucketed_forward_equals_unbucketed[qwen3_next]",
    "tests/models/test_generate.py::test_custom_attend_is_used[qwen3_next]",
    # A key tile longer than the page always gathers (`Config.uses_page_tiles`, MLA's launch
    # alike): the gather case of such a page size / tile pair launches the same kernel as its
    # page-tiles sibling.
    *(f"tests/attn/test_paged_prefill_triton.py::test_page_tiles_grid[{p}-gather]"
      for p in ("P16-BN32", "P16-BN64", "P32-BN64")),
    "tests/attn/test_mla_triton.py::test_kernel_matches_reference"
    "[gather-L48-R24-N16-P32-J3-BN64-bfloat16]",
)


# The longest CPU tests (a notebook on real weights, a fake-device subprocess, the README on real
# weights), longest first. xdist hands tests to its workers in collection order, and these are
# collected late (tests/models, tests/notebooks): left there, one worker still runs them minutes
# after the other has run out of tests. Started first, they overlap the many short tests.
# Node id prefixes; only the order changes.
LONG_FIRST = (
    "tests/notebooks/test_notebooks.py::test_notebook_runs[heads]",
    "tests/models/test_engine_tp.py::test_tensor_parallel_equals_one_device",
    "tests/notebooks/test_notebooks.py::test_notebook_runs[quickstart]",
    "tests/models/test_context_parallel_forward.py::test_context_parallel_equals_one_device",
    "tests/models/test_readme.py::",
    "tests/notebooks/test_notebooks.py::test_notebook_runs",
)


def _long_first_rank(item) -> int:
    return next((i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)),
                len(LONG_FIRST))


def pytest_collection_modifyitems(config, items):
    items.sort(key=_long_first_rank)  # stable: the rest keeps its order
    has_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run `pytest -m gpu` on the GPU machine")
    slow = set(SLOW_ON_CPU)
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        if item.nodeid in slow:
            item.add_marker(pytest.mark.slow)
