"""Gated DeltaNet decode-step rows for the decode benchmark: our Triton kernels and their anchors.

`gdn_rows(bw)` times, in one process:

* `gdn_decode` at B64, Nk16, Nv32, H = Hv = 128 (Qwen3.5), bf16 q/k/v, float32 states in a slot
  pool of B + 1 slots, l2-norm in the kernel. Floor: the state read + write, `2·B·Nv·H·Hv·4`
  bytes (268 MB; q/k/v/o add 1.6 MB), against the copy bandwidth measured in this process (goal
  >= 0.85). Anchors: the XLA reference (`implementation="xla"`: gather, step, scatter) with the
  pool donated as well, and fla's `fused_recurrent_gated_delta_rule` (torch) on the same shapes.
  fla has no slot pool and no in-place state: it reads `initial_state [B, Nv, H, Hv]` and writes
  a fresh final state, the same state bytes as ours.
* `causal_conv1d_update` at B64, C = 8192, W4, bf16 pool and input, SiLU, no bias (Qwen3.5's
  conv): about 8.4 MB per step, so a few microseconds; anchor the XLA reference.

Timing: each jitted call runs `STEPS` unrolled decode steps, feeding each step's output back as
the next step's input (o → v, y → x) so no step is dead code, and threads the donated pool from
call to call: what is timed is the in-place path. Reported `ms` is per step. fla is timed with
CUDA events over back-to-back calls (`_bench.time_torch_ms`).

    python -m experiments.bench_gdn_rows            # rows only, writes benchmarks/gdn.{json,md}
    python -m experiments.bench_gdn_rows --sweep    # time launch configs of our kernels
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.conv1d import reference as conv_ref
from attn.conv1d import triton as conv_triton
from attn.gdn import reference as gdn_ref
from attn.gdn import triton as gdn_triton
from experiments import _bench

log = logging.getLogger("bench_gdn")

GDN_SHAPE = dict(batch=64, nk=16, nv=32, h=128, hv=128)
CONV_SHAPE = dict(batch=64, channels=8192, width=4)
STEPS = 8


def _gdn_inputs(rng, *, batch, nk, nv, h, hv):
    """numpy float32 q, k, v, realistic gates, a pool of B + 1 slots (slot 0 null) and a
    permutation of the real slots."""
    q = rng.standard_normal((batch, 1, nk, h), np.float32)
    k = rng.standard_normal((batch, 1, nk, h), np.float32)
    v = rng.standard_normal((batch, 1, nv, hv), np.float32)
    g = np.log(rng.uniform(0.4, 0.95, (batch, 1, nv))).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (batch, 1, nv)).astype(np.float32)
    pool = 0.5 * rng.standard_normal((batch + 1, nv, h, hv), np.float32)
    pool[0] = 0.0
    slot_ids = (rng.permutation(batch) + 1).astype(np.int32)
    return q, k, v, g, beta, pool, slot_ids


def _stepper(step, steps: int = STEPS):
    """jit of `steps` unrolled `step(pool, x, *args) -> (x_next, pool)` calls; pool donated.

    Every array is an argument: a closed-over array would be baked into the program.
    """
    def run(pool, x, *args):
        for _ in range(steps):
            x, pool = step(pool, x, *args)
        return x, pool
    return jax.jit(run, donate_argnums=(0,))


def _time_donated(fn, pool, *args, steps: int = STEPS, iters: int = 10, trials: int = 5,
                  warmup: int = 2) -> tuple[float, jax.Array]:
    """Median ms per step of `fn(pool, *args) -> (out, pool)`, the pool threaded call to call."""
    for _ in range(warmup):
        out, pool = fn(pool, *args)
    jax.block_until_ready(pool)
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(iters):
            out, pool = fn(pool, *args)
        jax.block_until_ready((out, pool))
        times.append((time.perf_counter() - start) * 1e3 / (iters * steps))
    return statistics.median(times), pool


def _gdn_step(impl: str, config: gdn_triton.Config | None = None):
    def step(pool, v, q, k, g, beta, slot_ids):
        if impl == "triton":
            o, pool = gdn_triton.gdn_decode_pool(q, k, v, g, beta, pool, slot_ids,
                                                 use_qk_l2norm=True, config=config)
        else:
            o, pool = gdn_ref.gdn_decode_pool(q, k, v, g, beta, pool, slot_ids,
                                              use_qk_l2norm=True)
        return o.astype(v.dtype), pool
    return step


def _fla_ms(q, k, v, g, beta, h0, *, iters: int = 20, trials: int = 5):
    """fla `fused_recurrent_gated_delta_rule` ms per call and its `(o, final_state)`, or
    `(None, None)` when fla or CUDA torch is missing or the call fails."""
    _bench.writable_triton_cache()
    try:
        import torch
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError as e:
        log.warning("fla anchor skipped: %s", e)
        return None, None
    if not torch.cuda.is_available():
        log.warning("fla anchor skipped: torch has no CUDA device")
        return None, None
    dev = torch.device("cuda")
    t = {name: torch.from_numpy(x).to(dev) for name, x in
         (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta), ("h0", h0))}
    for name in ("q", "k", "v"):
        t[name] = t[name].to(torch.bfloat16)

    def call():
        return fused_recurrent_gated_delta_rule(
            t["q"], t["k"], t["v"], g=t["g"], beta=t["beta"], initial_state=t["h0"],
            output_final_state=True, use_qk_l2norm_in_kernel=True)
    try:
        ms, out = _bench.time_torch_ms(call, iters=iters, trials=trials)
    except Exception as e:  # an anchor that fails is logged, not fatal
        log.warning("fla anchor failed: %s", str(e).splitlines()[0])
        return None, None
    o, final = (x.float().cpu().numpy() for x in out)
    t.clear()
    del out
    torch.cuda.empty_cache()
    return ms, (o, final)


def gdn_decode_row(bw: dict, rng, *, shape: dict | None = None, anchors: bool = True,
                   config: gdn_triton.Config | None = None) -> dict:
    sh = dict(GDN_SHAPE, **(shape or {}))
    b, nk, nv, h, hv = sh["batch"], sh["nk"], sh["nv"], sh["h"], sh["hv"]
    q, k, v, g, beta, pool_np, slot_ids = _gdn_inputs(rng, **sh)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    args = (bf(q), bf(k), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(slot_ids))
    vj = bf(v)
    cfg = gdn_triton.default_config(hv) if config is None else config

    # One step of each, on fresh copies of the pool (the calls donate it).
    ours1, ref1 = _stepper(_gdn_step("triton", cfg), 1), _stepper(_gdn_step("xla"), 1)
    o, new_pool = ours1(jnp.asarray(pool_np), vj, *args)
    o_ref, pool_ref = ref1(jnp.asarray(pool_np), vj, *args)
    live = np.asarray(slot_ids)
    o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
    state, state_ref = np.asarray(new_pool)[live], np.asarray(pool_ref)[live]
    extra = dict(rel_err_o_vs_xla=round(_bench.rel_err(o, o_ref), 7),
                 rel_err_state_vs_xla=round(_bench.rel_err(state, state_ref), 7),
                 config=f"block_hv={cfg.block_hv} warps={cfg.num_warps}",
                 programs=b * nv * -(-hv // cfg.block_hv))
    del new_pool, pool_ref

    ms, _ = _time_donated(_stepper(_gdn_step("triton", cfg)), jnp.asarray(pool_np), vj, *args)
    xla_ms = fla_ms = None
    if anchors:
        try:
            xla_ms, _ = _time_donated(_stepper(_gdn_step("xla")), jnp.asarray(pool_np), vj, *args,
                                      iters=3, trials=3, warmup=1)
        except Exception as e:  # an OOM of the reference is a result too
            log.warning("XLA reference failed: %s", str(e).splitlines()[0])
        fla_ms, fla_out = _fla_ms(q, k, v, g, beta, pool_np[slot_ids])
        if fla_out is not None:
            extra["fla_rel_err_o_vs_ours"] = round(_bench.rel_err(fla_out[0], o), 7)
            extra["fla_rel_err_state_vs_ours"] = round(_bench.rel_err(fla_out[1], state), 7)
    extra["xla_ms"] = None if xla_ms is None else round(xla_ms, 4)
    extra["speedup_vs_xla"] = None if xla_ms is None else round(xla_ms / ms, 3)
    extra["fla_ms"] = None if fla_ms is None else round(fla_ms, 4)

    state_bytes = 2 * b * nv * h * hv * 4
    io_bytes = 2 * (2 * b * nk * h + 2 * b * nv * hv) + 2 * 4 * b * nv
    tbs = state_bytes / ms / 1e9
    ceiling = bw["ceiling"]
    anchor, anchor_ms = ("fla fused_recurrent_gated_delta_rule (torch, same GPU)", fla_ms)
    if fla_ms is None:
        anchor, anchor_ms = "xla reference (gather, step, scatter; pool donated)", xla_ms
    return _bench.row(
        kernel="gdn_decode", case=f"B{b}-Nk{nk}-Nv{nv}-H{h}-Hv{hv}-f32state-l2norm", ms=ms,
        achieved=tbs, unit="TB/s", ceiling=ceiling, anchor=anchor, anchor_ms=anchor_ms,
        goal="fraction_of_ceiling >= 0.85 (state read + write)",
        meets_goal=tbs / ceiling >= 0.85, state_bytes=state_bytes, io_bytes=io_bytes, **extra)


def _conv_step(impl: str, config: conv_triton.Config | None = None):
    def step(pool, x, slot_ids, weight):
        if impl == "triton":
            return conv_triton.causal_conv1d_update_pool(x, pool, slot_ids, weight, None, "silu",
                                                         config=config)
        return conv_ref.causal_conv1d_update_pool(x, pool, slot_ids, weight, None, "silu")
    return step


def conv_update_row(bw: dict, rng, *, shape: dict | None = None, anchors: bool = True,
                    config: conv_triton.Config | None = None) -> dict:
    sh = dict(CONV_SHAPE, **(shape or {}))
    b, c, w = sh["batch"], sh["channels"], sh["width"]
    x = jnp.asarray(rng.standard_normal((b, c), np.float32), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((c, w), np.float32) * 0.5, jnp.bfloat16)
    pool_np = rng.standard_normal((b + 1, c, w - 1), np.float32)
    slot_ids = jnp.asarray(rng.permutation(b) + 1, jnp.int32)
    pool = lambda: jnp.asarray(pool_np, jnp.bfloat16)
    cfg = conv_triton.Config() if config is None else config

    y, new_pool = _stepper(_conv_step("triton", cfg), 1)(pool(), x, slot_ids, weight)
    y_ref, pool_ref = _stepper(_conv_step("xla"), 1)(pool(), x, slot_ids, weight)
    live = np.asarray(slot_ids)
    extra = dict(rel_err_y_vs_xla=round(_bench.rel_err(y, y_ref), 6),
                 state_bitwise_equal_to_xla=bool(
                     (np.asarray(new_pool)[live] == np.asarray(pool_ref)[live]).all()),
                 config=f"block_c={cfg.block_c} warps={cfg.num_warps}")
    del new_pool, pool_ref

    ms, _ = _time_donated(_stepper(_conv_step("triton", cfg)), pool(), x, slot_ids, weight)
    xla_ms = None
    if anchors:
        try:
            xla_ms, _ = _time_donated(_stepper(_conv_step("xla")), pool(), x, slot_ids, weight)
        except Exception as e:
            log.warning("XLA reference failed: %s", str(e).splitlines()[0])
    num_bytes = 2 * b * c * (w - 1) * 2 + 2 * b * c * 2 + c * w * 2
    tbs = num_bytes / ms / 1e9
    return _bench.row(
        kernel="causal_conv1d_update", case=f"B{b}-C{c}-W{w}-bf16-silu", ms=ms, achieved=tbs,
        unit="TB/s", ceiling=bw["ceiling"], anchor="xla reference (pool donated)",
        anchor_ms=xla_ms,
        goal="speedup_vs_anchor >= 1 (launch-bound: ~8 MB a step; fraction reported)",
        meets_goal=None if xla_ms is None else xla_ms / ms >= 1.0, bytes=num_bytes, **extra)


def gdn_rows(bw: dict, *, anchors: bool = True, gdn_shape: dict | None = None,
             conv_shape: dict | None = None) -> list[dict]:
    """PERF.md rows for the GDN decode step; `bw` is `_bench.copy_bandwidth_tbs()` of this
    process."""
    rng = np.random.default_rng(0)
    return [gdn_decode_row(bw, rng, shape=gdn_shape, anchors=anchors),
            conv_update_row(bw, rng, shape=conv_shape, anchors=anchors)]


def sweep(gdn_configs, conv_configs) -> None:
    """Time launch configs of both kernels at the row shapes; print, write nothing."""
    rng = np.random.default_rng(0)
    sh = GDN_SHAPE
    q, k, v, g, beta, pool_np, slot_ids = _gdn_inputs(rng, **sh)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    args = (bf(q), bf(k), jnp.asarray(g), jnp.asarray(beta), jnp.asarray(slot_ids))
    state_bytes = 2 * sh["batch"] * sh["nv"] * sh["h"] * sh["hv"] * 4
    for block_hv, warps in gdn_configs:
        cfg = gdn_triton.Config(block_hv=block_hv, num_warps=warps)
        try:
            ms, _ = _time_donated(_stepper(_gdn_step("triton", cfg)), jnp.asarray(pool_np),
                                  bf(v), *args)
        except Exception as e:
            print(f"gdn {cfg}: {str(e).splitlines()[0][:100]}", flush=True)
            continue
        print(f"gdn  block_hv={block_hv:<4} w{warps}  {ms * 1e3:8.2f} us  "
              f"{state_bytes / ms / 1e9:6.3f} TB/s", flush=True)
    b, c, w = CONV_SHAPE["batch"], CONV_SHAPE["channels"], CONV_SHAPE["width"]
    x = jnp.asarray(rng.standard_normal((b, c), np.float32), jnp.bfloat16)
    weight = jnp.asarray(rng.standard_normal((c, w), np.float32) * 0.5, jnp.bfloat16)
    pool_np = rng.standard_normal((b + 1, c, w - 1), np.float32)
    ids = jnp.asarray(rng.permutation(b) + 1, jnp.int32)
    num_bytes = 2 * b * c * (w - 1) * 2 + 2 * b * c * 2 + c * w * 2
    for block_c, warps in conv_configs:
        cfg = conv_triton.Config(block_c=block_c, num_warps=warps)
        ms, _ = _time_donated(_stepper(_conv_step("triton", cfg)),
                              jnp.asarray(pool_np, jnp.bfloat16), x, ids, weight)
        print(f"conv block_c={block_c:<5} w{warps}  {ms * 1e3:8.2f} us  "
              f"{num_bytes / ms / 1e9:6.3f} TB/s", flush=True)


def _pairs(s: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in c.split("-")) for c in s.split(",")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time launch configs, write nothing")
    parser.add_argument("--gdn-configs", type=_pairs,
                        default="8-1,8-2,16-1,16-2,16-4,32-2,32-4,32-8,64-4,64-8,128-8",
                        help="block_hv-warps, comma separated")
    parser.add_argument("--conv-configs", type=_pairs, default="64-2,128-4,256-4,512-4,1024-8",
                        help="block_c-warps, comma separated")
    parser.add_argument("--no-anchors", action="store_true")
    parser.add_argument("--out", default="benchmarks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.sweep:
        return sweep(args.gdn_configs, args.conv_configs)
    bw = _bench.copy_bandwidth_tbs()
    log.info("copy bandwidth: %s", bw)
    rows = gdn_rows(bw, anchors=not args.no_anchors)
    md = _bench.write("gdn", rows, extra={"copy_bandwidth_tbs": bw}, out_dir=args.out)
    _bench.print_table(rows)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
