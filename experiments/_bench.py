"""Benchmark plumbing shared by `experiments/bench_*.py`.

Timing: warm up, then the median over several trials of back-to-back calls (one device sync per
trial), so launch gaps do not count and compilation never does. Ceilings (copy bandwidth, matmul
rate) are measured in the same process as the kernels they judge. Rows follow PERF.md's JSON
schema; `meets_goal` is computed from the goal, never typed in.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp


def time_ms(fn: Callable, *args, iters: int = 10, trials: int = 5, warmup: int = 2) -> float:
    """Median milliseconds per call of `fn(*args)`."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(times)


def rel_err(a, b) -> float:
    """`||a - b|| / ||b||` in float32: the correctness figure every benchmark row carries."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def copy_bandwidth_tbs(num_bytes: int = 4 << 30) -> dict[str, float]:
    """Measured device copy bandwidth in TB/s (bytes read + bytes written per second).

    Two ways, both reported: an XLA elementwise pass (`-x`) and, when torch with CUDA is in the
    process, a device-to-device `copy_` (cudaMemcpy), usually the faster. The ceiling is the max.
    """
    n = num_bytes // 2
    x = jnp.ones((n,), jnp.bfloat16)
    neg = jax.jit(lambda a: -a)
    ms = time_ms(neg, x, iters=10)
    result = {"xla_elementwise": 2 * num_bytes / ms / 1e9}
    del x
    try:
        import torch

        if torch.cuda.is_available():
            a = torch.ones(n, dtype=torch.bfloat16, device="cuda")
            b = torch.empty_like(a)
            for _ in range(3):
                b.copy_(a)
            torch.cuda.synchronize()
            trials = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(10):
                    b.copy_(a)
                torch.cuda.synchronize()
                trials.append((time.perf_counter() - start) * 1e3 / 10)
            result["cuda_memcpy"] = 2 * num_bytes / statistics.median(trials) / 1e9
            del a, b
            torch.cuda.empty_cache()
    except ImportError:
        pass
    result["ceiling"] = max(result.values())
    return result


def device_info() -> dict[str, str]:
    """Device name, jax version and the repository commit, for every JSON file."""
    dev = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    return {"device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
            "commit": os.environ.get("LONGCTX_COMMIT", commit)}


def row(*, kernel: str, case: str, ms: float, achieved: float, unit: str, ceiling: float | None,
        anchor: str | None, anchor_ms: float | None, goal: str, meets_goal: bool | None,
        **extra) -> dict:
    """One PERF.md row; fractions and speedups derived here."""
    out = {"kernel": kernel, "case": case, "ms": round(ms, 4), "achieved": round(achieved, 4),
           "unit": unit}
    if ceiling is not None:
        out["ceiling"] = round(ceiling, 4)
        out["fraction_of_ceiling"] = round(achieved / ceiling, 4)
    out["anchor"] = anchor
    out["anchor_ms"] = None if anchor_ms is None else round(anchor_ms, 4)
    out["speedup_vs_anchor"] = None if not anchor_ms else round(anchor_ms / ms, 4)
    out["goal"] = goal
    out["meets_goal"] = meets_goal
    out.update(extra)
    return out


def write(name: str, rows: list[dict], *, extra: dict | None = None,
          out_dir: str | os.PathLike = "benchmarks") -> Path:
    """Write `benchmarks/<name>.json` and `<name>.md`; return the markdown path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = device_info() | (extra or {})
    (out_dir / f"{name}.json").write_text(json.dumps(info | {"rows": rows}, indent=1) + "\n")
    cols = ["kernel", "case", "ms", "achieved", "unit", "fraction_of_ceiling", "anchor",
            "anchor_ms", "speedup_vs_anchor", "meets_goal"]
    lines = [f"# {name}", "", ", ".join(f"{k}: {v}" for k, v in info.items()), "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols)
                     + " |")
    md = out_dir / f"{name}.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def print_table(rows: list[dict], cols: tuple[str, ...] = ("kernel", "case", "ms", "achieved",
                "fraction_of_ceiling", "anchor_ms", "speedup_vs_anchor", "meets_goal")) -> None:
    """A short fixed-width table on stdout (the end of a GPU run's output)."""
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def writable_triton_cache() -> str:
    """Point Triton's kernel cache at a writable folder before a torch-side anchor (fla) compiles.

    On the GPU machine fla's first compile failed with "could not create or locate cache dir".
    `TRITON_CACHE_DIR` (kept if it already names a writable folder) and, where this Triton has
    it, `triton.knobs.cache.dir` both name the folder used.

    Returns:
      The folder used.
    """
    import tempfile

    path = os.environ.get("TRITON_CACHE_DIR", "")
    if not path or not os.access(path, os.W_OK):
        path = tempfile.mkdtemp(prefix="triton-cache-")
        os.environ["TRITON_CACHE_DIR"] = path
    try:
        import triton

        triton.knobs.cache.dir = path
    except (ImportError, AttributeError):
        pass
    return path
