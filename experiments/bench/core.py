"""The benchmark machinery: one timer, the ceilings, rows, tables and the group runner.

Timing (`time_ms`) is one clock for our kernels and every anchor, JAX or torch: warm up, then the
median over trials of back-to-back calls on the host clock, each trial closed by one device sync
(`jax.block_until_ready`, or `torch.cuda.synchronize` when the result holds torch tensors), so
launch gaps between calls do not count and compilation never does. CUDA events are not used:
they record on torch's stream, which does not order the work JAX queues on its own streams, so
they could time only one side. Ceilings (copy bandwidth, matmul rate) are measured in the same
process as the kernels they judge, once per process, through `Context`. Rows follow PERF.md's
JSON schema; `meets_goal` is computed from the goal, never typed in.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

log = logging.getLogger("bench")


def _sync(out) -> None:
    """Wait for the device work behind `out` (JAX arrays, or torch CUDA tensors)."""
    torch = sys.modules.get("torch")
    if torch is not None and any(isinstance(x, torch.Tensor) for x in jax.tree.leaves(out)):
        if torch.cuda.is_available():  # CPU tensors are ready when the call returns
            torch.cuda.synchronize()
    else:
        jax.block_until_ready(out)


def time_ms(fn: Callable, *args, iters: int = 10, trials: int = 5, warmup: int = 2,
            budget_s: float | None = None, carry: Callable[[Any, tuple], tuple] | None = None,
            steps: int = 1) -> float:
    """Median milliseconds per call (per step with `steps`) of `fn(*args)`.

    Args:
      fn: a jitted JAX function, or a torch callable launching CUDA work (then usually no args).
      *args: its arguments.
      iters: back-to-back calls per trial.
      trials: trials; the median is reported.
      warmup: untimed calls first (the first one compiles or autotunes).
      budget_s: if given, one more call is timed after the warm-up and `iters` / `trials` are cut
        so that the timed calls take about this many seconds (at least 3 trials of 1 call, or
        `trials` if fewer): a 300 ms call is not run 50 times.
      carry: `(out, args) -> args` of the next call, for state a call donates and returns (a
        pool, the engine state): every call then updates it in place.
      steps: steps one call runs (unrolled decode steps, writes in a loop): the time is per step.
    """
    def call(args):
        out = fn(*args)
        return out, (args if carry is None else carry(out, args))

    for _ in range(warmup):
        out, args = call(args)
        _sync(out)
    if budget_s is not None:
        start = time.perf_counter()
        out, args = call(args)
        _sync(out)
        once = max(time.perf_counter() - start, 1e-6)
        trials = max(min(trials, 3), min(trials, int(budget_s / once)))
        iters = max(1, min(iters, int(budget_s / trials / once)))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iters):
            out, args = call(args)
        _sync(out)
        times.append((time.perf_counter() - start) * 1e3 / (iters * steps))
    return statistics.median(times)


def kernel_ms(fn: Callable, *args, calls: int = 3) -> list[tuple[str, float]] | None:
    """The GPU kernels one call of the jitted `fn(*args)` launches, in launch order, each with its
    median time over `calls` back-to-back calls (ms), from a `jax.profiler` trace: `[(name,
    ms)]`, or None where the trace holds no GPU kernels (the CPU). For a figure's breakdown
    (which kernel of a fused op takes the time), not for the figure itself: `time_ms` times
    calls as a whole, gaps between kernels included."""
    import gzip
    import tempfile

    jax.block_until_ready(fn(*args))  # compiled before the trace
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                out = fn(*args)
            jax.block_until_ready(out)
        paths = sorted(Path(trace_dir).rglob("*.trace.json.gz"))
        if not paths:
            return None
        with gzip.open(paths[-1]) as f:
            trace = json.load(f)
    return kernels_of_trace(trace, calls)


def kernel_breakdown(fn: Callable, *args, calls: int = 3) -> list[list] | None:
    """`kernel_ms` as a row field: `[[name, ms], ...]` (names cut to 80 characters), or None on
    the CPU or where the trace cannot be read (logged: a breakdown is information, and its
    failure must not cost the row)."""
    try:
        kernels = kernel_ms(fn, *args, calls=calls)
    except Exception as e:
        log.warning("kernel breakdown: %s", first_line(e))
        return None
    return None if kernels is None else [[name[:80], round(ms, 4)] for name, ms in kernels]


def kernels_of_trace(trace, calls: int) -> list[tuple[str, float]] | None:
    """`kernel_ms` from a parsed Chrome trace (`{"traceEvents": [...]}`) of `calls` calls: the
    complete events on the GPU's stream threads, split into `calls` runs of equal length."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
            names[(e["name"], e["pid"], e.get("tid") if e["name"] == "thread_name" else None)] = (
                e["args"]["name"])
    kernels = sorted(
        (e for e in events
         if e.get("ph") == "X" and "dur" in e
         and "GPU" in names.get(("process_name", e["pid"], None), "")
         and "Stream" in names.get(("thread_name", e["pid"], e.get("tid")), "")),
        key=lambda e: e["ts"])
    if not kernels:
        return None
    if len(kernels) % calls:  # another stream's work, or a call that launched differently
        log.warning("trace: %d GPU kernels do not split into %d calls", len(kernels), calls)
        return None
    per_call = len(kernels) // calls
    return [(kernels[i]["name"],
             statistics.median(kernels[c * per_call + i]["dur"] for c in range(calls)) / 1e3)
            for i in range(per_call)]


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


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (its type if empty), at most `limit` chars."""
    return (str(e).splitlines() or [type(e).__name__])[0][:limit]


def on_gpu() -> bool:
    """Whether JAX runs on a GPU (anchors that need one are skipped, with a log line, if not)."""
    return jax.default_backend() == "gpu"


def copy_bandwidth_tbs(num_bytes: int = 4 << 30) -> dict[str, float]:
    """Measured device copy bandwidth in TB/s (bytes read + bytes written per second).

    Two ways, both reported: an XLA elementwise pass (`-x`) and, when torch with CUDA is in the
    process, a device-to-device `copy_` (cudaMemcpy), usually the faster. The ceiling is the max.
    """
    n = num_bytes // 2
    x = jnp.ones((n,), jnp.bfloat16)
    ms = time_ms(jax.jit(lambda a: -a), x)
    result = {"xla_elementwise": 2 * num_bytes / ms / 1e9}
    del x
    try:
        import torch

        if torch.cuda.is_available():
            a = torch.ones(n, dtype=torch.bfloat16, device="cuda")
            b = torch.empty_like(a)
            result["cuda_memcpy"] = 2 * num_bytes / time_ms(lambda: b.copy_(a), warmup=3) / 1e9
            del a, b
            torch.cuda.empty_cache()
    except ImportError:
        pass
    result["ceiling"] = max(result.values())
    return result


def matmul_tflops(n: int = 8192) -> float:
    """bf16 `n x n x n` matmul rate (TFLOP/s) through XLA: the compute ceiling."""
    key = jax.random.key(1)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    ms = time_ms(jax.jit(jnp.matmul), a, b, iters=20)
    return 2 * n**3 / ms / 1e9


def device_info() -> dict[str, str]:
    """Device name, jax version and the repository commit, for every JSON file; on a GPU with
    `nvidia-smi`, its power limit and top SM clock too (`GpuClocks`: what the rows ran at).

    `LONGCTX_COMMIT` overrides `git rev-parse` (a copied tree whose git metadata is older)."""
    dev = jax.devices()[0]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    info = {"device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__,
            "commit": os.environ.get("LONGCTX_COMMIT", commit)}
    limits = _nvidia_smi_once("power.limit,clocks.max.sm")
    if limits is not None:
        info |= {"power_limit_w": limits[0], "max_sm_mhz": limits[1]}
    return info


def _gpu_index() -> str:
    """`nvidia-smi -i` of the device JAX runs on: the first of `CUDA_VISIBLE_DEVICES`, else 0."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return visible or "0"


def _has_nvidia_smi() -> bool:
    """Whether JAX runs on a GPU that `nvidia-smi` can be asked about."""
    return on_gpu() and shutil.which("nvidia-smi") is not None


def _nvidia_smi_once(fields: str) -> list[float] | None:
    """One `nvidia-smi --query-gpu=fields` sample as numbers; None off the GPU, without
    `nvidia-smi`, or where a field is not a number."""
    if not _has_nvidia_smi():
        return None
    try:
        line = subprocess.run(["nvidia-smi", "-i", _gpu_index(), f"--query-gpu={fields}",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True,
                              check=False, timeout=30).stdout.strip()
        return [float(x) for x in line.split(",")]
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


@functools.cache
def _power_field() -> str:
    """The instantaneous power draw where this driver reports it: `power.draw` is an average
    over the last second, which lags a half-second timing by most of its length."""
    return "power.draw.instant" if _nvidia_smi_once("power.draw.instant") else "power.draw"


SW_POWER_CAP = 0x4  # nvidia-smi's throttle reason bit: clocks lowered to hold the power limit


def summarize_gpu_samples(lines: Iterable[str]) -> dict | None:
    """`GpuClocks`' lines (`sm MHz, W, reasons`) as `{"sm_mhz", "power_w"}` medians and
    `power_capped`, the fraction of samples whose clocks the power limit was holding down;
    None without a readable sample."""
    sm, power, capped = [], [], []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            mhz, watts, reasons = float(fields[0]), float(fields[1]), int(fields[2], 16)
        except (IndexError, ValueError):
            continue  # a torn line as the sampler stops
        sm.append(mhz)
        power.append(watts)
        capped.append(bool(reasons & SW_POWER_CAP))
    if not sm:
        return None
    return {"sm_mhz": statistics.median(sm), "power_w": round(statistics.median(power), 1),
            "power_capped": round(sum(capped) / len(capped), 2)}


class GpuClocks:
    """Samples the SM clock, the power draw and the throttle reasons with `nvidia-smi` every
    `interval_ms` while the `with` block runs; `summary()` is `summarize_gpu_samples` of them
    (None off the GPU or without `nvidia-smi`).

    Why rows carry it: an H100 under attention kernels runs at its power limit, so its SM clock
    is the limit's doing and moves from second to second; two figures near parity are compared
    at the clocks each ran at."""

    def __init__(self, interval_ms: int = 20):
        self.interval_ms, self.lines, self._proc = interval_ms, [], None

    def __enter__(self) -> GpuClocks:
        if _has_nvidia_smi():
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", _gpu_index(),
                 f"--query-gpu=clocks.sm,{_power_field()},clocks_throttle_reasons.active",
                 "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self._reader = threading.Thread(target=self._read, daemon=True)
            self._reader.start()
        return self

    def _read(self) -> None:
        for line in self._proc.stdout:
            self.lines.append(line)

    def __exit__(self, *exc) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait()
            self._reader.join(timeout=5)

    def summary(self) -> dict | None:
        return summarize_gpu_samples(self.lines)


def writable_triton_cache() -> str:
    """Point Triton's kernel cache at a writable folder before a torch-side anchor (fla) compiles.

    jax-triton clears `TRITON_CACHE_DIR` on import, and fla's first compile then fails with
    "could not create or locate cache dir". `TRITON_CACHE_DIR` (kept if it already names a
    writable folder) and, where this Triton has it, `triton.knobs.cache.dir` name the folder.

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


def row(*, kernel: str, case: str, ms: float, achieved: float, unit: str, ceiling: float | None,
        anchor: str | None, anchor_ms: float | None, goal: str, meets_goal: bool | None,
        **extra) -> dict:
    """One PERF.md row; the fraction of the ceiling and the speed-up are derived here."""
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


@dataclasses.dataclass
class Context:
    """What the row groups of one process share: ceilings (measured once, on first use), timing
    knobs and memoised figures (e.g. our dense time at a length, reused by the sparse rows).

    Attributes:
      quick: tiny shapes (`--quick`): one call per figure, small ceilings.
      budget_s: about how long the timed calls of one figure take (`time_ms(budget_s=)`); a
        group passes `budget_s=None` to `time` for fixed counts.
      matmul_n: side of the ceiling matmul.
      copy_bytes: bytes of the ceiling copy.
      memo: figures measured once per process, keyed by the caller.
    """

    quick: bool = False
    budget_s: float = 0.5
    matmul_n: int = 8192
    copy_bytes: int = 4 << 30
    memo: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.quick:
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
        """`time_ms` with this context's knobs: one call (after one warm-up) when `quick`, else
        `budget_s` unless `knobs` say otherwise (`carry` / `steps` are kept either way)."""
        if self.quick:
            kept = {k: v for k, v in knobs.items() if k in ("carry", "steps")}
            return time_ms(fn, *args, iters=1, trials=1, warmup=1, **kept)
        return time_ms(fn, *args, **({"budget_s": self.budget_s} | knobs))

    def time_rounds(self, calls: dict[str, tuple], rounds: int = 5
                    ) -> tuple[dict[str, list[float]], dict[str, list[dict | None]]]:
        """Each `name: (fn, *args)` of `calls` timed by `time` once a round, in turn, for
        `rounds` rounds (one when `quick`): `({name: [ms of each round]}, {name: [GpuClocks
        summary of each round]})`.

        For goals that compare figures near parity: the same call on an H100 drifts by a few
        percent from one second to the next (its SM clock follows the power limit, `GpuClocks`),
        so two figures timed one after the other can differ by that much for no reason of their
        own. Interleaved, each round times the figures under about the same conditions: rows
        report the round whose ratio is the median (`median_round`), so that a row's figures
        and its ratio come from one round, and keep every round's ratio (`round_ratios`) to
        show the spread, and the clocks the round's figures ran at."""
        times = {name: [] for name in calls}
        clocks = {name: [] for name in calls}
        for _ in range(1 if self.quick else rounds):
            for name, (fn, *args) in calls.items():
                with GpuClocks() as sampled:
                    times[name].append(self.time(fn, *args))
                clocks[name].append(sampled.summary())
        return times, clocks

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
            return got | dict(mosaic_note=first_line(e, 1000))
        return got | dict(ms=self.time(mosaic_fn, *args), out=out, impl="mosaic",
                          rel_err_triton_vs_mosaic=rel_err(triton_out, out))


def clocks_of_round(clocks: dict[str, list[dict | None]], i: int, *names: str) -> dict | None:
    """`{name: GpuClocks summary}` of round `i` of `Context.time_rounds` for those of `names`
    that have one (a row's `gpu_clocks`); None where none has (the CPU)."""
    got = {name: clocks[name][i] for name in names if name in clocks and clocks[name][i]}
    return got or None


def round_ratios(num: list[float], den: list[float]) -> list[float]:
    """`num[i] / den[i]` of each round of `Context.time_rounds`, rounded for a row."""
    return [round(a / b, 4) for a, b in zip(num, den, strict=True)]


def median_round(num: list[float], den: list[float]) -> int:
    """The round of `Context.time_rounds` whose `num[i] / den[i]` is the median (of an even
    count, the lower middle one)."""
    ratios = [a / b for a, b in zip(num, den, strict=True)]
    return sorted(range(len(ratios)), key=ratios.__getitem__)[(len(ratios) - 1) // 2]


# The markdown table's columns (the JSON has every field); OPTIONAL ones only when a row has one.
COLUMNS = ("kernel", "case", "impl", "ms", "achieved", "unit", "ceiling", "fraction_of_ceiling",
           "anchor", "anchor_ms", "speedup_vs_anchor", "tokamax_ms", "speedup_vs_tokamax",
           "goal", "meets_goal")
OPTIONAL = ("impl", "tokamax_ms", "speedup_vs_tokamax")


def _fmt(value) -> str:
    """A table cell: floats at 4 decimals at most, None empty, `|` escaped."""
    if value is None:
        return ""
    if isinstance(value, float):
        return str(round(value, 4))
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    return str(value).replace("|", "\\|")


def render(name: str, data: dict, command: str) -> str:
    """The markdown table of one JSON file: header (command, device, commit, ceilings), then a
    row per measured case with the fixed `COLUMNS`."""
    info = {k: v for k, v in data.items() if k != "rows"}
    rows = data["rows"]
    cols = [c for c in COLUMNS
            if c not in OPTIONAL or any(r.get(c) is not None for r in rows)]
    lines = [f"# {name}", "", f"Reproduce: `{command}` (every field: `{name}.json`).", "",
             ", ".join(f"{k}: {_fmt(v)}" for k, v in info.items()), "",
             "fraction_of_ceiling = achieved / ceiling (same process); speedup_vs_anchor = "
             "anchor_ms / ms (> 1: ours is faster).", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def write(name: str, rows: list[dict], *, info: dict, command: str,
          out_dir: str | os.PathLike = "benchmarks") -> Path:
    """Write `<out_dir>/<name>.json` (`info` + rows) and `<name>.md`; return the markdown path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = info | {"rows": rows}
    (out_dir / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    md = out_dir / f"{name}.md"
    md.write_text(render(name, data, command))
    return md


def print_table(rows: list[dict], cols: tuple[str, ...] = ("kernel", "case", "ms", "achieved",
                "fraction_of_ceiling", "anchor_ms", "speedup_vs_anchor", "meets_goal")) -> None:
    """A short fixed-width table on stdout (the end of a run's output)."""
    if not rows:
        return
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def run_groups(name: str, groups: dict[str, Callable[[Context], Iterable[dict]]], ctx: Context,
               *, out_dir: str | os.PathLike, command: str) -> list[dict]:
    """Run `groups` (each `ctx -> rows`, a list or a generator) in order.

    A group that raises is logged and the next one runs (rows it yielded before are kept);
    `<out_dir>/<name>.json` / `.md` are rewritten after every row, so a time limit that stops
    the process still leaves the rows measured so far. Progress goes to stdout, flushed.

    Returns:
      All rows.
    """
    info = device_info()
    rows: list[dict] = []
    t0 = time.perf_counter()

    def save():
        write(name, rows, info=info | ctx.ceilings(), command=command, out_dir=out_dir)

    for group, run in groups.items():
        start = time.perf_counter()
        print(f"[{start - t0:7.1f} s] {group} ...", flush=True)
        count = 0
        try:
            for r in run(ctx):
                rows.append(r)
                count += 1
                save()
                print(f"[{time.perf_counter() - t0:7.1f} s]   {r['kernel']} {r['case']}: "
                      f"{r.get('ms')} ms, meets_goal={r.get('meets_goal')}", flush=True)
        except Exception:  # one broken row group must not lose the others
            log.exception("row group %s failed", group)
        save()
        now = time.perf_counter()
        print(f"[{now - t0:7.1f} s] {group}: {count} rows in {now - start:.1f} s", flush=True)
    return rows
