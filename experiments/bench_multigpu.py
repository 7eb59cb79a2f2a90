"""Context-parallel causal prefill on several GPUs: ring vs all-gather vs one GPU.

    python -m experiments.bench_multigpu [--out benchmarks] [--budget-s 260]

One process drives every GPU of the host (a 1-D mesh `sp` over all of them). First it checks the
sharded ops against the whole-sequence reference at a small size on the GPU kernels (ring's
balanced path, ring's windowed path, all-gather; forward and gradients); a variant that fails is
not timed. Then, for causal N32 / K8, H128, bf16, B1:

- one GPU: `attn.dense.attention` (Mosaic GPU kernel) at the largest S it runs here, forward;
- D GPUs at S = 512K and 1M: ring and all-gather forward on inputs already in the zig-zag layout
  (`*_attention_local` under `shard_map`, as a model that keeps the layout calls them), and ring
  forward + backward;
- the communication alone (the ring's D - 1 `ppermute`s of K/V; the all-gather of K/V) and the
  ring's compute alone (the same blocks with the `ppermute` replaced by the identity), so that
  `hidden_comm_ms = comm_ms + compute_ms - total_ms` is the transfer time the compute hides.

FLOPs follow FlashAttention's count: causal forward `4 B N H S^2 / 2`, forward + backward 3.5x
that. `ratio_to_D_x_one_gpu` = aggregate TFLOP/s / (D x the one-GPU TFLOP/s of this run). Each
item runs under a time budget; what does not fit is recorded as skipped. Results go to
`<out>/multigpu.{json,md}` after every item, so a crash keeps what was measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from attn import dense
from attn.context_parallel import (
    _layout,
    allgather_attention,
    allgather_attention_local,
    reference,
    ring_attention,
    ring_attention_local,
)
from attn.context_parallel.ring import ring_attention_shard

N, KH, H, DTYPE = 32, 8, 128, jnp.bfloat16
K512, M1 = 512 * 1024, 1024 * 1024


def causal_flops(s: int, b: int = 1) -> float:
    return 4 * b * N * H * s * s / 2


def timed(fn, *args, reps: int = 3, warmup: int = 1) -> float:
    """Median seconds of `reps` calls after `warmup` untimed ones (the first compiles)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Run:
    """Rows, the time budget, and the output files (rewritten after every item)."""

    def __init__(self, out_dir: str, budget_s: float):
        self.out, self.budget, self.start = Path(out_dir), budget_s, time.perf_counter()
        self.rows: list[dict] = []
        self.checks: dict[str, dict] = {}
        self.info = self._info()

    @staticmethod
    def _info() -> dict:
        devs = jax.devices()
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=False).stdout.strip()
        except OSError:
            commit = ""
        return {"device": devs[0].device_kind, "gpus": len(devs), "jax": jax.__version__,
                "commit": os.environ.get("LONGCTX_COMMIT", commit or "unknown"),
                "shape": f"B1 N{N} K{KH} H{H} bf16 causal"}

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.start)

    def item(self, name: str, estimate_s: float, fn) -> dict | None:
        """Run `fn() -> dict` if `estimate_s` fits the budget; record its row (or why not)."""
        if self.left() < estimate_s:
            row = {"case": name, "note": f"skipped: {self.left():.0f} s left < {estimate_s} s"}
        else:
            t0 = time.perf_counter()
            try:
                row = {"case": name} | fn()
            except Exception as e:  # an OOM or a kernel refusal is a result here
                row = {"case": name, "note": f"failed: {type(e).__name__}: {str(e)[:300]}"}
            row["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
        self.rows.append(row)
        self.write()
        return row

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        doc = self.info | {"checks": self.checks, "rows": self.rows}
        (self.out / "multigpu.json").write_text(json.dumps(doc, indent=1) + "\n")
        cols = ("case", "gpus", "S", "ms", "tflops", "ratio_to_D_x_one_gpu", "comm_ms",
                "compute_ms", "hidden_comm_ms", "kernel", "note")
        lines = ["# multigpu", "", ", ".join(f"{k}: {v}" for k, v in self.info.items()), "",
                 "Correctness (max |ours - f32 reference| / max |reference|, bf16 inputs):", ""]
        lines += [f"- {k}: {v}" for k, v in self.checks.items()]
        lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in self.rows:
            lines.append("| " + " | ".join("" if r.get(c) is None else str(r.get(c))
                                          for c in cols) + " |")
        (self.out / "multigpu.md").write_text("\n".join(lines) + "\n")


def rel_err(a, b) -> float:
    a, b = (np.asarray(jnp.asarray(x, jnp.float32)) for x in (a, b))
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def check_small(run: Run, mesh: Mesh, s: int) -> dict[str, str]:
    """Forward and gradients of each variant vs the f32 reference at length `s`; returns
    variant -> the first implementation that passed (on a GPU "mosaic", which refuses blocks
    with offsets, then "triton"), so each timed row names the kernel its blocks ran."""
    gen = np.random.default_rng(0)
    b, n, kh, h = 1, 8, 2, 128
    q, k, v = (jnp.asarray(gen.standard_normal((b, s, m, h)), DTYPE) for m in (n, kh, kh))
    g_out = jnp.asarray(gen.standard_normal((b, s, n, h)), jnp.float32)
    g_lse = jnp.asarray(gen.standard_normal((b, s, n)), jnp.float32)
    window = {"window": np.array([s // 8, 0], np.int32), "sinks": np.array([s // 64, 0], np.int32)}

    def grads(fn, *xs):
        def loss(q, k, v):
            out, lse = fn(q, k, v)
            return jnp.sum(out.astype(jnp.float32) * g_out) + jnp.sum(lse * g_lse)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*xs)

    chosen = {}
    for name, fn, opts in (("ring", ring_attention, {}), ("ring_window", ring_attention, window),
                           ("allgather", allgather_attention, {})):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        ref_out, ref_lse = reference.attention(*f32, **opts)
        ref_grads = grads(lambda q, k, v, o=opts: reference.attention(q, k, v, **o), *f32)
        for impl in ("mosaic", "triton") if jax.default_backend() == "gpu" else ("xla",):
            sharded = lambda q, k, v, f=fn, o=opts, i=impl: f(
                q, k, v, mesh=mesh, axis_name="sp", implementation=i, **o)
            try:
                out, lse = jax.jit(sharded)(q, k, v)
                errs = {"out": rel_err(out, ref_out), "lse": rel_err(lse, ref_lse)}
                for label, a, e in zip(("dq", "dk", "dv"), grads(sharded, q, k, v), ref_grads):
                    errs[label] = rel_err(a, e)
                ok = all(x < 2e-2 for x in errs.values())
                run.checks[f"{name}[{impl}]"] = {key: f"{x:.2e}" for key, x in errs.items()} | {
                    "ok": ok}
            except Exception as e:
                ok = False
                run.checks[f"{name}[{impl}]"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(name, impl, run.checks[f"{name}[{impl}]"], flush=True)
            if ok:
                chosen[name] = impl
                break
    run.write()
    return chosen


def sharded_inputs(mesh: Mesh, s: int, with_cotangent: bool = False):
    """Random q, k, v (taken as already in the zig-zag layout), sharded over `sp`."""
    spec = NamedSharding(mesh, P(None, "sp"))
    shapes = [(1, s, N, H), (1, s, KH, H), (1, s, KH, H)] + ([(1, s, N, H)] * with_cotangent)
    keys = jax.random.split(jax.random.key(0), len(shapes))
    return [jax.jit(lambda key, sh=sh: jax.random.normal(key, sh, DTYPE), out_shardings=spec)(kk)
            for kk, sh in zip(keys, shapes)]


def local_fn(mesh: Mesh, body, n_in: int = 3, n_out: int = 2):
    """`body` on the local blocks under `shard_map` over `sp`, jitted."""
    spec = P(None, "sp")
    return jax.jit(_layout.shard_map(body, mesh=mesh, in_specs=(spec,) * n_in,
                                     out_specs=(spec,) * n_out))


def one_gpu(s: int) -> dict:
    """Forward of the whole sequence on the first GPU, through the fastest kernel that runs it."""
    dev = jax.devices()[0]
    q, k, v = (jax.device_put(jax.random.normal(jax.random.key(i), (1, s, m, H), DTYPE), dev)
               for i, m in enumerate((N, KH, KH)))
    impls = ("mosaic", "triton") if dev.platform == "gpu" else ("xla",)
    for impl in impls:
        try:
            fn = jax.jit(lambda q, k, v, i=impl: dense.attention(q, k, v, causal=True,
                                                                  implementation=i))
            secs = timed(fn, q, k, v, reps=2 if s > K512 // 2 else 3)
            break
        except NotImplementedError:
            continue
    else:
        raise RuntimeError(f"no flash kernel runs S={s} on one GPU")
    return {"gpus": 1, "S": s, "ms": round(secs * 1e3, 2),
            "tflops": round(causal_flops(s) / secs / 1e12, 1), "kernel": impl}


def tag(s: int) -> str:
    return f"S{s // 1024}K" if s >= 1024 else f"S{s}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--budget-s", type=float, default=260.0)
    parser.add_argument("--sizes", default=f"{K512},{M1}",
                        help="lengths on all GPUs, ascending; forward + backward at the last "
                             "(or the next smaller if it does not fit)")
    parser.add_argument("--one-gpu-sizes", default=f"{K512 // 2},{K512}",
                        help="one-GPU lengths: the first is timed first and is the baseline; a "
                             "later one that runs replaces it (timed last: it may not fit)")
    parser.add_argument("--check-s", type=int, default=2048, help="length of the parity check")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    one_sizes = [int(x) for x in args.one_gpu_sizes.split(",")]
    run = Run(args.out, args.budget_s)
    devices = jax.devices()
    num = len(devices)
    print(run.info, flush=True)
    mesh = Mesh(np.array(devices), ("sp",), axis_types=(AxisType.Auto,))
    chosen = check_small(run, mesh, args.check_s)
    print("variants to time:", chosen, flush=True)
    impl_ring, impl_ag = chosen.get("ring"), chosen.get("allgather")
    perm = [(i, (i + 1) % num) for i in range(num)]
    spec = P(None, "sp")
    baseline = {}
    ring_secs = {}

    def ratio(row: dict) -> dict:
        if baseline.get("tflops") and row.get("tflops"):
            row["ratio_to_D_x_one_gpu"] = round(row["tflops"] / (num * baseline["tflops"]), 3)
        return row

    def one(s):
        row = run.item(f"one_gpu_fwd_{tag(s)}", 15 * (s / K512) ** 2 + 8, lambda: one_gpu(s))
        if row.get("tflops"):  # the largest one-GPU length that ran is the baseline
            baseline.update(row)
            run.info["one_gpu_baseline"] = row["case"]
            for other in run.rows:
                if other.get("gpus") == num and "fwd_bwd" not in other["case"]:
                    ratio(other)

    def fwd_estimate(s) -> float:
        """Seconds of one ring forward at `s`: scaled from the largest length timed, else from
        ~0.6 PFLOP/s (4 GPUs)."""
        if ring_secs:
            done = max(ring_secs)
            return ring_secs[done] * (s / done) ** 2
        return causal_flops(s) / (150e12 * num)

    def ring_fwd(s):
        reps = 3 if s <= K512 else 1
        ring = local_fn(mesh, lambda q, k, v: ring_attention_local(
            q, k, v, axis_name="sp", implementation=impl_ring))
        compute = local_fn(mesh, lambda q, k, v: ring_attention_shard(
            q, k, v, axis_name="sp", seq_len=s, causal=True, scale=H**-0.5, window=None,
            sinks=jnp.zeros((KH,), jnp.int32), implementation=impl_ring, permute=lambda x: x))

        def comm_body(k, v):
            kv = (k, v)
            for _ in range(num - 1):
                kv = jax.tree.map(lambda x: lax.ppermute(x, "sp", perm), kv)
            return kv
        comm = local_fn(mesh, comm_body, n_in=2)

        def measure():
            q, k, v = sharded_inputs(mesh, s)
            total = timed(ring, q, k, v, reps=reps)
            ring_secs[s] = total
            comp = timed(compute, q, k, v, reps=reps)
            comm_s = timed(comm, k, v, reps=3)
            return ratio({"gpus": num, "S": s, "ms": round(total * 1e3, 2),
                          "tflops": round(causal_flops(s) / total / 1e12, 1),
                          "comm_ms": round(comm_s * 1e3, 2), "compute_ms": round(comp * 1e3, 2),
                          "hidden_comm_ms": round((comm_s + comp - total) * 1e3, 2),
                          "kernel": impl_ring})
        run.item(f"ring_fwd_{tag(s)}", 2 * (reps + 1) * fwd_estimate(s) + 15, measure)

    def allgather_fwd(s):
        reps = 3 if s <= K512 else 1
        ag = local_fn(mesh, lambda q, k, v: allgather_attention_local(
            q, k, v, axis_name="sp", implementation=impl_ag))
        gather = local_fn(mesh, lambda k, v: tuple(
            lax.all_gather(x, "sp", axis=1, tiled=True) for x in (k, v)), n_in=2)

        def measure():
            q, k, v = sharded_inputs(mesh, s)
            secs = timed(ag, q, k, v, reps=reps)
            return ratio({"gpus": num, "S": s, "ms": round(secs * 1e3, 2),
                          "tflops": round(causal_flops(s) / secs / 1e12, 1),
                          "comm_ms": round(timed(gather, k, v) * 1e3, 2), "kernel": impl_ag})
        run.item(f"allgather_fwd_{tag(s)}", 1.3 * (reps + 1) * fwd_estimate(s) + 12, measure)

    def ring_fwd_bwd(s) -> bool:
        def body(q, k, v, do):
            _, vjp = jax.vjp(lambda q, k, v: ring_attention_local(
                q, k, v, axis_name="sp", implementation=impl_ring)[0], q, k, v)
            return vjp(do)
        step = jax.jit(_layout.shard_map(body, mesh=mesh, in_specs=(spec,) * 4,
                                         out_specs=(spec,) * 3))

        def measure():
            q, k, v, do = sharded_inputs(mesh, s, with_cotangent=True)
            compiled = step.lower(q, k, v, do).compile()
            secs = timed(compiled, q, k, v, do, reps=1, warmup=0)
            return {"gpus": num, "S": s, "ms": round(secs * 1e3, 1),
                    "tflops": round(3.5 * causal_flops(s) / secs / 1e12, 1),
                    "kernel": impl_ring, "note": "forward + backward (3.5x the forward FLOPs), "
                    "one timed call after compiling"}
        return bool(run.item(f"ring_fwd_bwd_{tag(s)}", 12 * fwd_estimate(s) + 20,
                             measure).get("ms"))

    one(one_sizes[0])
    for s in sizes[:-1]:
        if impl_ring:
            ring_fwd(s)
        if impl_ag:
            allgather_fwd(s)
    if impl_ring:
        ring_fwd(sizes[-1])
        for s in sizes[::-1]:  # the largest length whose forward + backward fits
            if ring_fwd_bwd(s):
                break
    if impl_ag:
        allgather_fwd(sizes[-1])
    for s in one_sizes[1:]:
        one(s)
    run.write()
    cols = ("case", "S", "ms", "tflops", "ratio_to_D_x_one_gpu", "comm_ms", "compute_ms",
            "hidden_comm_ms", "kernel", "note")
    print("\n" + " | ".join(cols))
    for r in run.rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
