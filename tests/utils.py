"""Shared test helpers: one comparison, NaN poisoning, random inputs, the edge grid.

Every kernel and reference test compares through `assert_close`: it checks `isfinite` first (a NaN
never equals a NaN here), then compares with a tolerance keyed by dtype.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# (atol, rtol) by the dtype of the result being checked.
TOLERANCE = {
    jnp.dtype(jnp.float32): (2e-5, 2e-5),
    jnp.dtype(jnp.bfloat16): (2e-2, 2e-2),
    jnp.dtype(jnp.float16): (2e-3, 2e-3),
    jnp.dtype(jnp.float8_e4m3fn): (1.25e-1, 1.25e-1),
}

# The edge grid of QUALITY.md, shared by every attention variant.
GROUP_SIZES = (1, 2, 3, 4, 5, 7, 8, 16)
EDGE_LENGTHS = (1, 7, 63, 64, 65, 129, 200)  # length 1, around a block of 64, several blocks


def rng(seed: int | None = None) -> np.random.Generator:
    """A numpy generator; fresh entropy unless a seed is given (tests must not rely on one draw)."""
    return np.random.default_rng(seed)


def randn(gen: np.random.Generator, shape: Sequence[int], dtype=jnp.float32,
          scale: float = 1.0) -> jax.Array:
    """Standard-normal array of `shape`, cast to `dtype`."""
    return jnp.asarray(gen.standard_normal(tuple(shape), dtype=np.float32) * scale).astype(dtype)


def assert_close(
    actual,
    expected,
    *,
    dtype=None,
    atol: float | None = None,
    rtol: float | None = None,
    allow_neg_inf: bool = False,
    err_msg: str = "",
) -> None:
    """Assert `actual` matches `expected` elementwise within a dtype-keyed tolerance.

    Args:
      actual, expected: arrays of equal shape.
      dtype: the dtype whose tolerance applies; default the lower-precision of the two inputs.
      atol, rtol: override the table.
      allow_neg_inf: accept `-inf` where the expected value is `-inf` too (log-sum-exp of masked
        rows). NaN and `+inf` are never accepted.
      err_msg: prefixed to the failure message.
    """
    a = np.asarray(jnp.asarray(actual).astype(jnp.float32))
    e = np.asarray(jnp.asarray(expected).astype(jnp.float32))
    if a.shape != e.shape:
        raise AssertionError(f"{err_msg} shape {a.shape} != expected {e.shape}")
    if dtype is None:
        dtypes = [jnp.dtype(jnp.asarray(x).dtype) for x in (actual, expected)]
        dtype = max(dtypes, key=lambda d: TOLERANCE.get(d, (0, 0))[0])
    d_atol, d_rtol = TOLERANCE.get(jnp.dtype(dtype), TOLERANCE[jnp.dtype(jnp.float32)])
    atol = d_atol if atol is None else atol
    rtol = d_rtol if rtol is None else rtol
    for name, x in (("actual", a), ("expected", e)):
        bad = np.isnan(x) | np.isposinf(x) | (np.isneginf(x) & (not allow_neg_inf))
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise AssertionError(f"{err_msg} {name} has {int(bad.sum())} non-finite values, "
                                 f"first at {idx}: {x[idx]}")
    a_inf, e_inf = np.isneginf(a), np.isneginf(e)
    if (a_inf != e_inf).any():
        idx = tuple(int(i) for i in np.argwhere(a_inf != e_inf)[0])
        raise AssertionError(f"{err_msg} -inf pattern differs at {idx}: {a[idx]} vs {e[idx]}")
    finite = ~e_inf
    with np.errstate(invalid="ignore"):
        err = np.where(finite, np.abs(a - e), 0.0)
    bound = atol + rtol * np.abs(e)
    over = (err > bound) & finite
    if over.any():
        idx = tuple(int(i) for i in np.argwhere(over)[0])
        raise AssertionError(
            f"{err_msg} {int(over.sum())}/{over.size} elements differ beyond atol={atol} "
            f"rtol={rtol}; max abs err {float(err[finite].max()):.3g}; first at {idx}: "
            f"{a[idx]} vs {e[idx]}"
        )


def assert_all_finite(x, err_msg: str = "") -> None:
    """Assert every value is finite (no NaN, no ±inf)."""
    x = np.asarray(jnp.asarray(x).astype(jnp.float32))
    if not np.isfinite(x).all():
        raise AssertionError(f"{err_msg} {int((~np.isfinite(x)).sum())} non-finite values")


def poison(x: jax.Array, keep: jax.Array, value: float = float("nan")) -> jax.Array:
    """Overwrite every element of `x` where `keep` is False with `value` (NaN by default).

    `keep` broadcasts against the leading axes of `x` (e.g. a `[K, num_pages]` ownership mask
    against pages `[K, num_pages, P, H]`). Use it to prove unowned pages and padding never leak in.
    """
    keep = jnp.asarray(keep, bool)
    keep = keep.reshape(keep.shape + (1,) * (x.ndim - keep.ndim))
    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.where(keep, x, jnp.asarray(value, x.dtype))
    return jnp.where(keep, x, jnp.asarray(-1, x.dtype))


def case_id(**kw) -> str:
    """Readable parametrisation ids: case_id(T=65, K=2) -> 'T65-K2'."""
    return "-".join(f"{k}{v}" for k, v in kw.items())


class AttentionTestBase:
    """Checks every attention variant reuses.

    A variant's test class subclasses this and calls the `check_*` methods on its own outputs; the
    shared grids (`GROUP_SIZES`, `EDGE_LENGTHS`) parametrise its tests.
    """

    group_sizes = GROUP_SIZES
    edge_lengths = EDGE_LENGTHS

    @staticmethod
    def check_output(out, lse, ref_out, ref_lse, *, dtype=None, err_msg: str = "") -> None:
        """Output and log-sum-exp match the reference; masked rows are 0 / -inf on both sides."""
        assert_close(out, ref_out, dtype=dtype, err_msg=f"{err_msg} out")
        if lse is not None:
            assert_close(lse, ref_lse, dtype=jnp.float32 if dtype is None else dtype,
                         allow_neg_inf=True, err_msg=f"{err_msg} lse")

    @staticmethod
    def check_masked_rows(out, lse, visible_count) -> None:
        """Rows with no visible key have output exactly 0 and lse exactly -inf; others finite.

        Args:
          out: `[..., Hv]` attention output.
          lse: `[...]` log-sum-exp, or None.
          visible_count: `[...]` number of visible keys per row.
        """
        out = np.asarray(jnp.asarray(out).astype(jnp.float32))
        visible = np.asarray(visible_count) > 0
        assert np.isfinite(out).all(), "non-finite attention output"
        assert (out[~visible] == 0).all(), "fully masked rows must give exactly 0"
        if lse is not None:
            lse = np.asarray(lse)
            assert np.isneginf(lse[~visible]).all(), "fully masked rows must give lse -inf"
            assert np.isfinite(lse[visible]).all(), "visible rows must give a finite lse"

    @staticmethod
    def check_deterministic(fn, *args, **kwargs) -> None:
        """Two calls give bitwise identical results."""
        a = jax.tree.leaves(fn(*args, **kwargs))
        b = jax.tree.leaves(fn(*args, **kwargs))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def grid(**axes) -> list[dict]:
    """Cartesian product of named axes, as a list of dicts (for parametrize with ids)."""
    keys = list(axes)
    return [dict(zip(keys, values)) for values in itertools.product(*axes.values())]


# Compiled for sm_90a in a fresh process: the test process switched Triton to its interpreter (no
# GPU), and Triton decides at import time. Reads one JSON job list on stdin, prints one JSON line a
# job.
_SM90_SCRIPT = r"""
import importlib, json, os, sys
os.environ["TRITON_INTERPRET"] = "0"
from attn._harness import compile_for_hopper, ptxas_usage

for job in json.load(sys.stdin):
    module, name = job["kernel"].split(":")
    fn = getattr(importlib.import_module(module), name)
    k = compile_for_hopper(fn, job["pointers"], job["constexprs"], num_warps=job["num_warps"],
                           num_stages=job["num_stages"])
    ptx = k.asm["ptx"]
    print(json.dumps(dict(name=name, shared=k.metadata.shared, **ptxas_usage(k),
                          count={s: ptx.count(s) for s in job.get("count", ())})), flush=True)
"""


def report_verdicts(checks: Mapping[str, Callable[[], None]]) -> None:
    """The fake-device worker's entry: run each check and print one JSON line, the device count
    and each check's verdict ("ok", or the error's type and message), for `run_worker`.

    Checks named on the command line run alone (all of them if none is named).
    """
    import json
    import sys

    only = set(sys.argv[1:])
    verdicts = {}
    for name, check in checks.items():
        if only and name not in only:
            continue
        try:
            check()
            verdicts[name] = "ok"
        except Exception as e:  # reported per check to the pytest process
            verdicts[name] = f"{type(e).__name__}: {e}"
    print(json.dumps({"devices": jax.device_count(), "verdicts": verdicts}))


def run_worker(module: str, num_devices: int, names: Sequence[str] = (), *,
               timeout: int = 600) -> dict:
    """Run test module `module` as a script on `num_devices` fake CPU devices and return its
    `report_verdicts` line (`{"devices": D, "verdicts": {name: verdict}}`).

    JAX fixes its CPU device count when it starts, so sharded checks run in a process of their
    own (`--xla_force_host_platform_device_count`). Fails the calling test if the worker dies.
    """
    import json
    import os
    import subprocess
    import sys

    import pytest

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=(
        os.environ.get("XLA_FLAGS", "") +
        f" --xla_force_host_platform_device_count={num_devices}").strip())
    proc = subprocess.run([sys.executable, "-m", module, *names], env=env, capture_output=True,
                          text=True, timeout=timeout,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        pytest.fail(f"worker {module} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def compile_for_sm90(jobs: Sequence[dict]) -> list[dict]:
    """Compile Triton kernels for Hopper (sm_90a) on any machine: Triton's compiler and its
    bundled ptxas, no GPU. The interpreter runs Python semantics; the compiler traces more (e.g.
    the statements after a constexpr-taken `return`) and allocates registers and shared memory.

    Args:
      jobs: one dict a kernel: `kernel` (`"module:function"`), `pointers` (the Triton pointer
        type of every argument not in `constexprs`, e.g. `"*bf16"`), `constexprs`, `num_warps`,
        `num_stages`, optional `count` (PTX substrings to count, e.g. `"tanh.approx.f32"`).

    Returns:
      Per job: `name`, `registers`, `spill_stores` / `spill_loads` (bytes), `shared` (bytes of
      shared memory), `count` (substring -> occurrences in the PTX).

    Skips the calling test where Triton's bundled ptxas is missing.
    """
    import json
    import os
    import subprocess
    import sys

    import pytest
    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                       "bin", "ptxas")):
        pytest.skip("Triton's bundled ptxas is missing")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    done = subprocess.run([sys.executable, "-c", _SM90_SCRIPT], input=json.dumps(list(jobs)),
                          env=env, cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(jobs), done.stdout
    return results
