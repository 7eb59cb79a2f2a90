"""Benchmark plumbing shared by `experiments/bench_*.py`.

Timing: warm up, then the median over several trials of back-to-back calls (one device sync per
trial), so launch gaps do not count and compilation never does; `budget_s=` shrinks the counts for
long calls. torch-side anchors (fla) are timed with CUDA events by `time_torch_ms`. Ceilings
(copy bandwidth, matmul rate) are measured in the same process as the kernels they judge, once per
process through `Context`. Rows follow PERF.md's JSON schema; `meets_goal` is computed from the
goal, never typed in. `run_groups` runs row groups, each guarded, and rewrites the JSON after each.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp


def parse_fields(cls, text: str):
    """`"name=value,..."` -> `cls(...)`, the other fields at their defaults (`parse_changes`)."""
    return cls(**parse_changes(cls, text))


def parse_changes(cls, text: str) -> dict:
    """`"name=value,..."` -> `{name: value}` for fields of the dataclass `cls` (int / bool / str /
    float: the type of each field's default; a bool as 0 / 1 / true / false), to apply with
    `dataclasses.replace`. ValueError names a bad item."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kw = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(f"{item!r}: expected name=value with name in {sorted(fields)}")
        kind = type(fields[name].default)
        if kind is bool:
            if value.lower() not in ("0", "1", "true", "false"):
                raise ValueError(f"{item!r}: a boolean is 0 / 1 / true / false")
            kw[name] = value.lower() in ("1", "true")
        else:
            kw[name] = kind(value)
    return kw


def describe_fields(config) -> str:
    """The fields of a dataclass instance that differ from its class's defaults (the inverse of
    `parse_fields`), or "default"."""
    base = type(config)()
    diff = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
            if getattr(config, f.name) != getattr(base, f.name)]
    return ",".join(diff) or "default"


def time_ms(fn: Callable, *args, iters: int = 10, trials: int = 5, warmup: int = 2,
            budget_s: float | None = None) -> float:
    """Median milliseconds per call of `fn(*args)`.

    Args:
      fn: the (jitted) function; its result is waited on once per trial.
      *args: its arguments.
      iters: back-to-back calls per trial.
      trials: trials; the median is reported.
      warmup: untimed calls first (the first one compiles).
      budget_s: if given, one more call is timed after the warm-up and `iters` / `trials` are cut
        so that the timed calls take about this many seconds (at least 3 trials of 1 call, or
        `trials` if fewer): a 300 ms call is not run 50 times.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    if budget_s is not None:
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        once = max(time.perf_counter() - start, 1e-6)
        trials = max(min(trials, 3), min(trials, int(budget_s / once)))
        iters = max(1, min(iters, int(budget_s / trials / once)))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) * 1e3 / iters)
    return statistics.median(times)


def time_torch_ms(fn: Callable[[], Any], *, iters: int = 10, trials: int = 5,
                  warmup: int = 3) -> tuple[float, Any]:
    """Median milliseconds per call of a torch CUDA callable, timed with CUDA events.

    The torch-side twin of `time_ms` for anchors such as fla: `warmup` untimed calls (autotuning
    and compiles happen there), then `trials` of `iters` back-to-back calls between two events.

    Args:
      fn: a no-argument callable launching torch CUDA work.
      iters: calls per trial.
      trials: trials; the median is reported.
      warmup: untimed calls first.

    Returns:
      `(ms, the last call's result)`.

    Raises:
      RuntimeError: torch has no CUDA device. Whatever `fn` raises propagates: callers log it.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch has no CUDA device")
    out = None
    for _ in range(warmup):
        out = fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times), out


def rel_err(a, b) -> float:
    """`||a - b|| / ||b||` in float32: the correctness figure every benchmark row carries."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def qkv(seed: int, b: int, s: int, n: int, kh: int, h: int, dtype=jnp.bfloat16):
    """Fresh normal q `[B, S, N, H]`, k and v `[B, S, K, H]` (self-attention prefill inputs)."""
    key = jax.random.key(seed)
    q = jax.random.normal(key, (b, s, n, h), dtype)
    k = jax.random.normal(jax.random.fold_in(key, 1), (b, s, kh, h), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 2), (b, s, kh, h), dtype)
    return q, k, v


def kilo(n: int) -> str:
    """`8192 -> "8K"` for case names; lengths that are not whole K stay as they are."""
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


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
            copy_ms, _ = time_torch_ms(lambda: b.copy_(a))
            result["cuda_memcpy"] = 2 * num_bytes / copy_ms / 1e9
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


TABLE_COLUMNS = ("kernel", "case", "ms", "achieved", "unit", "fraction_of_ceiling", "anchor",
                 "anchor_ms", "speedup_vs_anchor", "meets_goal")


def write(name: str, rows: list[dict], *, extra: dict | None = None,
          out_dir: str | os.PathLike = "benchmarks",
          cols: tuple[str, ...] = TABLE_COLUMNS) -> Path:
    """Write `benchmarks/<name>.json` and `<name>.md` (columns `cols`); return the markdown path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = device_info() | (extra or {})
    (out_dir / f"{name}.json").write_text(json.dumps(info | {"rows": rows}, indent=1) + "\n")
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


def matmul_tflops(n: int = 8192) -> float:
    """bf16 `n x n x n` matmul rate (TFLOP/s) through XLA: the compute ceiling of prefill rows."""
    key = jax.random.key(1)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    ms = time_ms(jax.jit(jnp.matmul), a, b, iters=20)
    return 2 * n**3 / ms / 1e9


def on_gpu() -> bool:
    """Whether JAX runs on a GPU (anchors that need one are skipped, with a log line, if not)."""
    return jax.default_backend() == "gpu"


@dataclasses.dataclass
class Context:
    """What the row functions of one process share: ceilings (measured once, on first use),
    timing knobs and memoised figures (e.g. our dense time at a length, reused by the sparse rows).

    Attributes:
      smoke: tiny shapes on a CPU: one call per figure, small ceilings, GPU anchors skipped.
      config: a launch config under test (`--config` of bench_prefill), or None.
      matmul_n: side of the ceiling matmul.
      copy_bytes: bytes of the ceiling copy.
      budget_s: about how long the timed calls of one figure take (`time_ms(budget_s=)`): only
        calls over `budget_s / 50` run fewer than 5 trials of 10.
      memo: figures measured once per process, keyed by the caller.
    """

    smoke: bool = False
    config: Any = None
    budget_s: float = 0.5
    matmul_n: int = 8192
    copy_bytes: int = 4 << 30
    memo: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.smoke:
            self.matmul_n, self.copy_bytes = 256, 1 << 20

    @property
    def matmul_tflops(self) -> float:
        return self.once("matmul_tflops", lambda: matmul_tflops(self.matmul_n))

    @property
    def copy_tbs(self) -> dict[str, float]:
        """`copy_bandwidth_tbs()` of this process; `["ceiling"]` is the one rows use."""
        return self.once("copy_tbs", lambda: copy_bandwidth_tbs(self.copy_bytes))

    def ceilings(self) -> dict:
        """The ceilings measured so far (for the JSON header)."""
        out = {}
        if "matmul_tflops" in self.memo:
            out["matmul_tflops"] = round(self.memo["matmul_tflops"], 2)
        if "copy_tbs" in self.memo:
            out["copy_bandwidth_tbs"] = {k: round(v, 4) for k, v in self.memo["copy_tbs"].items()}
        return out

    def once(self, key, compute: Callable[[], Any]) -> Any:
        """`compute()` the first time `key` is asked for, the memoised value after."""
        if key not in self.memo:
            self.memo[key] = compute()
        return self.memo[key]

    def time(self, fn: Callable, *args, **knobs) -> float:
        """`time_ms` with this context's knobs: one call in smoke mode, else `budget_s`."""
        if self.smoke:
            return time_ms(fn, *args, iters=1, trials=1, warmup=1)
        return time_ms(fn, *args, **({"budget_s": self.budget_s} | knobs))

    def time_ours(self, triton_fn: Callable, mosaic_fn: Callable, *args) -> dict:
        """Our kernel as `implementation="auto"` picks it: `mosaic_fn(*args)` where it runs (a
        Hopper GPU and options it takes), else `triton_fn(*args)`; the Triton one is timed
        either way. Returns `ms`, `out` and `impl` of ours, `triton_ms` / `triton_out`, and
        `mosaic_note` (why not Mosaic) or `rel_err_triton_vs_mosaic`."""
        triton_out = triton_fn(*args)
        triton_ms = self.time(triton_fn, *args)
        got = dict(ms=triton_ms, out=triton_out, impl="triton", triton_ms=triton_ms,
                   triton_out=triton_out)
        try:
            out = mosaic_fn(*args)
        except NotImplementedError as e:  # Mosaic refuses: the Triton kernel is ours
            return got | dict(mosaic_note=str(e).splitlines()[0])
        return got | dict(ms=self.time(mosaic_fn, *args), out=out, impl="mosaic",
                          rel_err_triton_vs_mosaic=rel_err(triton_out, out))

    def time_torch(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """`time_torch_ms` with this context's knobs."""
        if self.smoke:
            return time_torch_ms(fn, iters=1, trials=1, warmup=1)
        return time_torch_ms(fn)


def run_groups(name: str, groups: dict[str, Callable], selected: list[str], args, ctx: Context,
               *, out_dir: str | os.PathLike, cols: tuple[str, ...] = TABLE_COLUMNS,
               log: logging.Logger | None = None) -> list[dict]:
    """Run the row groups `selected` of `groups` (each `(args, ctx) -> rows`) in order.

    A group may return a list or yield its rows one by one. A group that raises is logged and the
    next one runs (rows it yielded before are kept); `<out_dir>/<name>.json` / `.md` are rewritten
    after every row, so a time limit that stops the process still leaves the rows measured so far.
    Progress goes to stdout, flushed.

    Returns:
      All rows.

    Raises:
      ValueError: a name in `selected` that is not a group.
    """
    log = log or logging.getLogger("bench")
    unknown = [g for g in selected if g not in groups]
    if unknown:
        raise ValueError(f"unknown row groups {unknown}; choose from {list(groups)}")
    rows: list[dict] = []
    t0 = time.perf_counter()
    for group in selected:
        start = time.perf_counter()
        print(f"[{start - t0:7.1f} s] {group} ...", flush=True)
        count = 0
        try:
            for r in groups[group](args, ctx):  # a list, or a generator yielding row by row
                rows.append(r)
                count += 1
                write(name, rows, extra=ctx.ceilings(), out_dir=out_dir, cols=cols)
                print(f"[{time.perf_counter() - t0:7.1f} s]   {r['kernel']} {r['case']}: "
                      f"{r['ms']} ms, meets_goal={r.get('meets_goal')}", flush=True)
        except Exception:  # one broken row group must not lose the others
            log.exception("row group %s failed", group)
        write(name, rows, extra=ctx.ceilings(), out_dir=out_dir, cols=cols)
        now = time.perf_counter()
        print(f"[{now - t0:7.1f} s] {group}: {count} rows in {now - start:.1f} s", flush=True)
    return rows
