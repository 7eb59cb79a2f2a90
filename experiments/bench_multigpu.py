"""Several GPUs in one process: context-parallel causal prefill (ring vs all-gather vs one GPU) and
tensor-parallel engine decode (one GPU vs all of them).

    python -m experiments.bench_multigpu [--out benchmarks] [--budget-s 260]
    python -m experiments.bench_multigpu --suite tp [--out benchmarks]

Both suites write `<out>/multigpu.{json,md}`; each keeps the other's section of the JSON.

Tensor-parallel decode (`--suite tp`, section `tp_decode`): the engine's jitted decode step
(`Engine.step`'s, `decode=True`, `implementation="auto"`) for a Qwen3-0.6B-shaped model with
random bf16 weights (`experiments.bench.engine.QWEN3_0_6B`), B64 rows over S8K cached tokens,
pages of 64: random pages and tables as after S tokens (as `engine_decode`), the same values on
one GPU and split by head over all of them (`Engine(mesh=...)`, `shard_weights` True and False).
Each run decodes greedily `warmup + trials x steps` tokens per row, feeding its tokens back
(positions `S - n .. S - 1`). Steps are timed in steady state: the host keeps two steps queued
ahead of the one whose completion it waits for, and `ms` is the median over trials of the mean
completion-to-completion time of `steps` steps; `dispatch_ms` is the host's time inside one
step call (enqueueing, and waiting while the queue is full), below `ms`: the step is GPU-bound.
Rows: tokens/s (`B / step`), the speed-up over one GPU of the same process, whether every
generated token equals one GPU's (`tokens_identical`, and the share that do; a row whose token
differs decodes other tokens from then on), the first step's tokens and logits against one GPU's;
the floor is (weights + KV bytes per GPU) / the measured copy bandwidth of GPU 0. The last row
runs the first step on one GPU with `implementation="xla"` (the XLA paged attention instead of
the Triton kernel): how far two correct one-GPU backends agree on this random-weight model over
random pages. Goal (PERF.md): >= 1.7x one GPU on 2 GPUs, tokens identical.

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
import collections
import gc
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
        doc = load_doc(self.out)
        doc = self.info | {"checks": self.checks, "rows": self.rows} | (
            {"tp_decode": doc["tp_decode"]} if "tp_decode" in doc else {})
        write_doc(self.out, doc)


CP_COLS = ("case", "gpus", "S", "ms", "tflops", "ratio_to_D_x_one_gpu", "comm_ms", "compute_ms",
           "hidden_comm_ms", "kernel", "note")
TP_COLS = ("case", "gpus", "shard_weights", "ms", "dispatch_ms", "tokens_per_s",
           "speedup_vs_one_gpu", "floor_ms", "tokens_identical", "tokens_equal_share",
           "first_step_tokens_equal_share", "logits_rel_err", "recompiles", "goal", "meets_goal",
           "note")


def load_doc(out: Path) -> dict:
    """The JSON written so far (empty if none)."""
    path = Path(out) / "multigpu.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _table(rows: list[dict], cols: tuple[str, ...]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return lines + ["| " + " | ".join("" if r.get(c) is None else str(r.get(c)) for c in cols)
                    + " |" for r in rows]


def write_doc(out: Path, doc: dict) -> None:
    """`multigpu.json` and its markdown: the context-parallel section (top level) and the
    tensor-parallel decode section (`tp_decode`), each with the run that measured it."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multigpu.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = ["# multigpu", ""]
    if doc.get("rows"):
        info = {k: v for k, v in doc.items() if k not in ("checks", "rows", "tp_decode")}
        lines += ["## Context-parallel causal prefill", "", ", ".join(
            f"{k}: {v}" for k, v in info.items()), "",
            "Correctness (max |ours - f32 reference| / max |reference|, bf16 inputs):", ""]
        lines += [f"- {k}: {v}" for k, v in doc.get("checks", {}).items()]
        lines += [""] + _table(doc["rows"], CP_COLS) + [""]
    tp = doc.get("tp_decode")
    if tp:
        info = {k: v for k, v in tp.items() if k != "rows"}
        lines += ["## Tensor-parallel engine decode", "", ", ".join(
            f"{k}: {v}" for k, v in info.items()), ""] + _table(tp["rows"], TP_COLS) + [""]
    (out / "multigpu.md").write_text("\n".join(lines))


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


def tp_state(engine, seq: int, *, seed: int = 0):
    """`EngineKV` of `engine` with `B` rows x `seq` cached tokens: random pages generated in the
    engine's layout (split by head on its mesh; the same values on any layout), tables and
    allocator as after `seq` tokens (`experiments.bench.engine.engine_state`'s rows)."""
    import kv
    from models.engine import EngineKV

    b, p = engine.batch_slots, engine.page_size
    pages_per_row = -(-seq // p)
    num_pages = b * pages_per_row + 1
    key = jax.random.key(seed)
    pools, draws = [], {}
    for i, pool in enumerate(engine.states.pools):
        shape = (pool.num_kv_heads, num_pages, pool.page_size, pool.head_dim)
        # The engine's layout of this layer (split by head or not); one compile per layout.
        layout = (shape, pool.k.dtype, pool.k.sharding)
        if layout not in draws:
            draws[layout] = jax.jit(
                lambda k, sh=shape, dt=pool.k.dtype: jax.random.normal(k, sh, dt),
                out_shardings=pool.k.sharding)
        draw = draws[layout]
        pools.append(kv.PagePool(k=draw(jax.random.fold_in(key, 2 * i)),
                                 v=draw(jax.random.fold_in(key, 2 * i + 1))))
    heads = len(engine.paged_layers) * engine.num_kv_heads
    tables = kv.create_block_tables(batch_size=b, num_kv_heads=heads,
                                    max_pages=engine.max_pages, page_size=p)
    allocator = kv.create_allocator(num_kv_heads=heads, num_pages=num_pages)
    allocator, tables, ok = jax.jit(kv.alloc_batch)(
        allocator, tables, kv.pages_needed(tables, jnp.full((b,), seq, jnp.int32)))
    if not bool(ok):
        raise RuntimeError(f"could not allocate {pages_per_row} pages x {b} rows")
    tables, allocator = jax.tree.map(lambda x: jnp.array(x, copy=True), (tables, allocator))
    return engine.place_state(EngineKV(pools, tables, allocator))


_IN_FLIGHT = 2  # decode steps the timing loop keeps queued ahead of the one it waits for


def tp_decode(model, *, mesh, shard_weights: bool, batch: int, seq: int, page: int,
              warmup: int, trials: int, steps: int, implementation: str = "auto",
              span: int | None = None) -> dict:
    """Greedy decode of `warmup + trials * steps` tokens per row through the engine's jitted
    decode step (on one GPU if `mesh` is None); see the module docstring. `ms` is None without
    timed trials. Decoding starts at position `seq - span` (default: the tokens decoded here),
    so runs of different lengths decode the same first steps."""
    from models import engine as engine_mod
    from models.engine import Engine

    engine = Engine(model, batch_slots=batch, max_len=seq, page_size=page, num_pages=2,
                    implementation=implementation, mesh=mesh, shard_weights=shard_weights)
    states = tp_state(engine, seq)
    checksum = float(jnp.sum(states.pools[0].k[:, :64].astype(jnp.float32)))
    layers, heads = engine.num_layers, engine.num_kv_heads
    zeros = np.zeros((batch, layers, heads), np.int32)
    fixed = (np.ones(batch, np.int32), zeros, zeros, np.zeros(batch, np.uint32),
             np.zeros(batch, np.float32), np.zeros(batch, np.int32), np.ones(batch, np.float32))
    total = warmup + trials * steps
    start_pos = seq - (span or total)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, model.cfg.vocab_size, (batch, 1)),
                      jnp.int32)
    tokens, first_logits, first_call_s, traces = [], None, 0.0, None
    # Steady state: the host keeps `_IN_FLIGHT` steps queued ahead of the one it waits for and
    # stamps each step's completion, so a step's time is completion to completion, without the
    # host's enqueueing of the first step of a burst in it.
    pending, done_at, dispatch = collections.deque(), [], []
    for i in range(total):
        if i == warmup:
            traces = engine_mod.TRACES["decode"]
        offsets = np.full(batch, start_pos + i, np.int32)
        t0 = time.perf_counter()
        out, logits, states, _ = engine._step(engine._graphdef, engine._params, states, ids,
                                              offsets, fixed[0], *fixed[1:], decode=True,
                                              draw=False)
        dispatch.append(time.perf_counter() - t0)
        if first_logits is None:
            first_logits = np.asarray(logits)
            first_call_s = time.perf_counter() - t0
        tokens.append(out)
        ids = out[:, None]
        pending.append(out)
        while len(pending) > (_IN_FLIGHT if i < total - 1 else 0):
            pending.popleft().block_until_ready()
            done_at.append(time.perf_counter())
    times = [(done_at[warmup - 1 + (t + 1) * steps] - done_at[warmup - 1 + t * steps]) / steps
             for t in range(trials)]
    recompiles = engine_mod.TRACES["decode"] - traces if trials else None
    pool = states.pools[0]
    kv_bytes = len(states.pools) * batch * seq * 2 * pool.num_kv_heads * pool.head_dim * 2
    weights = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(engine._params))
    gpus = 1 if mesh is None else mesh.size
    result = {"ms": statistics.median(times) * 1e3 if times else None,
              "dispatch_ms": statistics.median(dispatch[warmup:] or dispatch) * 1e3,
              "tokens": np.asarray(jnp.stack(tokens)),
              "logits": first_logits, "first_call_s": first_call_s, "recompiles": recompiles,
              "weight_bytes_per_gpu": int(weights), "kv_bytes_per_gpu": kv_bytes // gpus,
              "checksum": checksum, "gpus": gpus}
    del states, engine
    gc.collect()
    return result


def tp_suite(args) -> None:
    """One GPU, then all GPUs with split and with whole weights; rows into `tp_decode`."""
    from experiments.bench import core
    from experiments.bench.engine import QUICK_MODEL, QWEN3_0_6B, build_model

    devices = jax.devices()
    num = len(devices)
    info = Run._info()
    info.pop("shape")
    info["shape"] = (f"Qwen3-0.6B shape (28 layers, N16 / K8, H128), random bf16 weights, "
                     f"B{args.tp_batch} S{args.tp_seq} P{args.tp_page}, greedy decode")
    x = jax.device_put(jnp.ones((1 << 30,), jnp.bfloat16), devices[0])  # 2 GB
    copy_tbs = 2 * x.nbytes / core.time_ms(jax.jit(lambda a: -a), x) / 1e9
    del x
    info["copy_tbs_gpu0"] = round(copy_tbs, 3)
    if args.tp_tiny:
        info["shape"] = info["shape"].replace("Qwen3-0.6B shape (28 layers", "tiny (2 layers")
    section = dict(info, rows=[])
    doc = load_doc(Path(args.out))
    model = build_model(QUICK_MODEL if args.tp_tiny else QWEN3_0_6B)
    case = (f"{'qwen3-tiny' if args.tp_tiny else 'qwen3-0.6b'}-B{args.tp_batch}-{tag(args.tp_seq)}"
            f"-P{args.tp_page}-bf16")
    knobs = dict(batch=args.tp_batch, seq=args.tp_seq, page=args.tp_page, warmup=2,
                 trials=args.tp_trials, steps=args.tp_steps)
    mesh = Mesh(np.array(devices), ("tp",), axis_types=(AxisType.Auto,))
    goal = f">= 1.7x one GPU on {num} GPUs, tokens identical"
    base = None
    runs = (("one_gpu", None, True, {}), (f"tp{num}", mesh, True, {}),
            (f"tp{num}_whole_weights", mesh, False, {}),
            ("one_gpu_xla_first_step", None, True,
             dict(implementation="xla", warmup=1, trials=0,
                  span=2 + args.tp_trials * args.tp_steps)))
    for label, m, sw, extra in runs:
        row = {"case": f"tp_decode_{label}", "shape": case}
        t0 = time.perf_counter()
        try:
            r = tp_decode(model, mesh=m, shard_weights=sw, **(knobs | extra))
        except Exception as e:  # an OOM or a compile failure is a result here
            row["note"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
            r = None
        if r is not None and r["ms"] is None:  # the numerics anchor: one step, XLA attention
            row |= {"gpus": 1, "note": "implementation=xla, first step only: how far two "
                    "one-GPU backends agree on this model",
                    "first_step_tokens_equal_share": round(float(np.mean(
                        r["tokens"][0] == base["tokens"][0])), 4),
                    "logits_rel_err": round(core.rel_err(r["logits"], base["logits"]), 6)}
        elif r is not None:
            floor = (r["weight_bytes_per_gpu"] + r["kv_bytes_per_gpu"]) / copy_tbs / 1e9
            row |= {"gpus": r["gpus"], "shard_weights": sw if m is not None else None,
                    "ms": round(r["ms"], 3), "dispatch_ms": round(r["dispatch_ms"], 3),
                    "tokens_per_s": round(args.tp_batch * 1e3 / r["ms"], 1),
                    "floor_ms": round(floor, 3), "recompiles": r["recompiles"],
                    "first_call_s": round(r["first_call_s"], 1),
                    "weight_bytes_per_gpu": r["weight_bytes_per_gpu"],
                    "kv_bytes_per_gpu": r["kv_bytes_per_gpu"], "pages_checksum": r["checksum"],
                    "decoded_tokens_per_row": int(r["tokens"].shape[0])}
            if base is None:
                base = r
                row["goal"] = "(anchor row)"
            else:
                same = r["tokens"] == base["tokens"]  # [steps, B]
                first_bad = np.flatnonzero(~same.all(axis=1))
                row |= {"speedup_vs_one_gpu": round(base["ms"] / r["ms"], 3),
                        "tokens_identical": bool(same.all()),
                        "tokens_equal_share": round(float(same.mean()), 4),
                        "first_step_tokens_equal_share": round(float(same[0].mean()), 4),
                        "first_differing_step": int(first_bad[0]) if len(first_bad) else None,
                        "logits_rel_err": round(core.rel_err(r["logits"], base["logits"]), 6),
                        "goal": goal,
                        "meets_goal": bool(base["ms"] / r["ms"] >= 1.7 and same.all())}
        row["wall_s"] = round(time.perf_counter() - t0, 1)
        print(json.dumps(row), flush=True)
        section["rows"].append(row)
        doc["tp_decode"] = section
        write_doc(Path(args.out), doc)
    print("\n" + " | ".join(TP_COLS))
    for r in section["rows"]:
        print(" | ".join(str(r.get(c, "")) for c in TP_COLS))


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
    parser.add_argument("--suite", choices=("cp", "tp"), default="cp",
                        help="cp: context-parallel prefill; tp: tensor-parallel engine decode")
    parser.add_argument("--tp-batch", type=int, default=64)
    parser.add_argument("--tp-seq", type=int, default=8192)
    parser.add_argument("--tp-page", type=int, default=64)
    parser.add_argument("--tp-trials", type=int, default=5)
    parser.add_argument("--tp-steps", type=int, default=10)
    parser.add_argument("--tp-tiny", action="store_true",
                        help="the 2-layer QUICK_MODEL (a CPU smoke run on fake devices)")
    args = parser.parse_args()
    if args.suite == "tp":
        tp_suite(args)
        return
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
