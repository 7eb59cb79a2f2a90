"""Prefill kernels against cuDNN and the matmul ceiling, in one process.

    python -m experiments.bench_prefill --out benchmarks      # the PERF.md shapes (needs a GPU)
    python -m experiments.bench_prefill --quick               # small shapes, a smoke run
    python -m experiments.bench_prefill --sweep --configs 128-64-4-3,128-128-8-3

Writes `<out>/prefill.json` and `<out>/prefill.md`. Rows:

- `flash_prefill`: causal dense, B1, N32/K8, H128, bf16, S in {8K, 16K, 32K}; TFLOP/s counted on
  the causal pairs (`2 * 2 * B * N * H * S^2 / 2`); anchor cuDNN through
  `jax.nn.dot_product_attention(..., implementation="cudnn", is_causal=True)` (GQA: K heads for
  key / value); goal `speedup_vs_anchor >= 0.9`.
- `window_prefill`: S64K, window 4K, sink 128, N32/K8; TFLOP/s on the visible pairs; anchor cuDNN
  sliding window `local_window_size=(window - 1, 0)` (no sink: cuDNN has none); goal >= 0.9x.
- `flash_prefill_fwd_bwd`: forward + backward (gradient of `sum(out * d_out)`) at the first two
  lengths and with a window of `--window / 2`, against cuDNN's; FLOPs 3.5x the forward's (FA
  convention); for information (PERF.md has no backward goal).

The ceiling of every row is an 8192^3 bf16 matmul measured in the same process. More row
functions (tokamax, block-sparse, GDN) append to `ROWS`: each takes `(args, ctx)` and returns rows.
`--sweep` times our forward under several launch configs at S8K (causal) and at S32K with the
window; `--sweep-bwd` times forward + backward under several backward tile configs; both write
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.dense import triton as dense_triton
from experiments import _bench

log = logging.getLogger("bench_prefill")


@dataclasses.dataclass
class Context:
    """What every row function shares: the measured ceiling and the launch config under test."""

    matmul_tflops: float
    config: dense_triton.Config | None


def matmul_tflops(n: int = 8192) -> float:
    """bf16 `n x n x n` matmul rate (TFLOP/s), the compute ceiling of attention prefill."""
    key = jax.random.key(1)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.bfloat16)
    ms = _bench.time_ms(jax.jit(jnp.matmul), a, b, iters=20)
    return 2 * n**3 / ms / 1e9


def _qkv(seed, b, s, n, kh, h, dtype=jnp.bfloat16):
    key = jax.random.key(seed)
    q = jax.random.normal(key, (b, s, n, h), dtype)
    k = jax.random.normal(jax.random.fold_in(key, 1), (b, s, kh, h), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 2), (b, s, kh, h), dtype)
    return q, k, v


def _ours(config, **options):
    """Our kernel, jitted; every array is an argument (a closed-over array is baked in)."""
    return jax.jit(lambda q, k, v: dense_triton.attention(q, k, v, config=config, **options)[0])


def _cudnn(k_heads_ok: bool, **options):
    """cuDNN flash attention; repeats K/V per group if this jax refuses GQA heads."""
    def fn(q, k, v):
        if not k_heads_ok:
            g = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **options)
    return jax.jit(fn)


def _time_anchor(q, k, v, **options):
    """`(ms, out, note)` of cuDNN with K heads, else repeated heads, else `(None, None, why)`."""
    for gqa in (True, False):
        fn = _cudnn(gqa, **options)
        try:
            out = fn(q, k, v)
            return _bench.time_ms(fn, q, k, v), out, "" if gqa else "K/V repeated to N heads"
        except Exception as e:  # an anchor that cannot run is reported, not fatal
            log.warning("cuDNN (gqa=%s): %s", gqa, str(e).splitlines()[0][:200])
    return None, None, "cuDNN failed"


def _causal_pairs(b, t, n) -> float:
    """Query-key pairs of causal attention, counted as FA does (`S^2 / 2` per head)."""
    return b * n * t * t / 2


def _window_pairs(s, window, sink) -> float:
    """Visible pairs per head under a causal window of `window` keys plus `sink` leading keys."""
    p = np.arange(s, dtype=np.float64)
    in_window = np.minimum(p + 1, window)
    extra_sinks = np.clip(p - window + 1, 0, sink)  # sink keys older than the window
    return float((in_window + extra_sinks).sum())


def flash_rows(args, ctx: Context) -> list[dict]:
    """Causal dense prefill against cuDNN at each sequence length."""
    b, n, kh, h = args.batch, args.heads, args.kv_heads, args.head_dim
    rows = []
    ours = _ours(ctx.config)
    for s in args.seqs:
        q, k, v = _qkv(s, b, s, n, kh, h)
        out = ours(q, k, v)
        ms = _bench.time_ms(ours, q, k, v)
        anchor_ms, anchor_out, note = _time_anchor(q, k, v, is_causal=True)
        flops = 4 * _causal_pairs(b, s, n) * h
        tflops = flops / ms / 1e9
        extra = {"config": dataclasses.asdict(ctx.config or dense_triton.default_config(h))}
        if anchor_out is not None:
            extra["rel_err_vs_anchor"] = round(_bench.rel_err(out, anchor_out), 5)
            extra["anchor_tflops"] = round(flops / anchor_ms / 1e9, 2)
        if note:
            extra["anchor_note"] = note
        rows.append(_bench.row(
            kernel="flash_prefill", case=f"B{b}-S{s // 1024}K-N{n}-K{kh}-H{h}-bf16-causal",
            ms=ms, achieved=tflops, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
            anchor="cuDNN jax.nn.dot_product_attention", anchor_ms=anchor_ms,
            goal="speedup_vs_anchor >= 0.9",
            meets_goal=None if anchor_ms is None else anchor_ms / ms >= 0.9, **extra))
        del q, k, v, out, anchor_out
    return rows


def window_rows(args, ctx: Context) -> list[dict]:
    """Sliding window + sinks prefill against cuDNN's sliding window (no sink)."""
    b, n, kh, h = args.batch, args.heads, args.kv_heads, args.head_dim
    s, w, sink = args.window_seq, args.window, args.sink
    q, k, v = _qkv(7, b, s, n, kh, h)
    ours = _ours(ctx.config, window=w, sinks=sink)
    ms = _bench.time_ms(ours, q, k, v)
    anchor_ms, anchor_out, note = _time_anchor(q, k, v, is_causal=True,
                                               local_window_size=(w - 1, 0))
    flops = 4 * b * n * h * _window_pairs(s, w, sink)
    tflops = flops / ms / 1e9
    extra = {"config": dataclasses.asdict(ctx.config or dense_triton.default_config(h)),
             "visible_fraction": round(_window_pairs(s, w, sink) / (s * s / 2), 5)}
    no_sink = _ours(ctx.config, window=w)  # cuDNN's exact function: like for like
    no_sink_ms = _bench.time_ms(no_sink, q, k, v)
    extra["ours_no_sink_ms"] = round(no_sink_ms, 4)
    if anchor_out is not None:
        extra["rel_err_vs_anchor_no_sink"] = round(_bench.rel_err(no_sink(q, k, v), anchor_out), 5)
        extra["speedup_no_sink_vs_anchor"] = round(anchor_ms / no_sink_ms, 4)
        extra["anchor_tflops_on_its_pairs"] = round(
            4 * b * n * h * _window_pairs(s, w, 0) / anchor_ms / 1e9, 2)
    if note:
        extra["anchor_note"] = note
    return [_bench.row(
        kernel="window_prefill",
        case=f"B{b}-S{s // 1024}K-W{w // 1024}K-sink{sink}-N{n}-K{kh}-H{h}-bf16",
        ms=ms, achieved=tflops, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
        anchor="cuDNN local_window_size (no sink)", anchor_ms=anchor_ms,
        goal="speedup_vs_anchor >= 0.9",
        meets_goal=None if anchor_ms is None else anchor_ms / ms >= 0.9, **extra)]


def _grad_fn(fn):
    """`(q, k, v, d_out) -> (dq, dk, dv)` of `sum(fn(q, k, v) * d_out)`, jitted."""
    def loss(q, k, v, d_out):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def backward_rows(args, ctx: Context) -> list[dict]:
    """Causal (and windowed) forward + backward against cuDNN's, at the first two lengths."""
    b, n, kh, h = args.batch, args.heads, args.kv_heads, args.head_dim
    rows = []
    cases = [(s, None) for s in args.seqs[:2]] + [(args.seqs[0], args.window // 2)]
    for s, w in cases:
        q, k, v = _qkv(s + 3, b, s, n, kh, h)
        d_out = jax.random.normal(jax.random.key(s), q.shape, q.dtype)
        opts = {} if w is None else dict(window=w)
        ours = _grad_fn(lambda q, k, v, opts=opts: dense_triton.attention(
            q, k, v, config=ctx.config, **opts)[0])
        grads = ours(q, k, v, d_out)
        ms = _bench.time_ms(ours, q, k, v, d_out)
        cudnn_opts = dict(is_causal=True)
        if w is not None:
            cudnn_opts["local_window_size"] = (w - 1, 0)
        anchor_ms, extra = None, {}
        for gqa in (True, False):
            try:
                anchor = _grad_fn(_cudnn(gqa, **cudnn_opts))
                ref = anchor(q, k, v, d_out)
                anchor_ms = _bench.time_ms(anchor, q, k, v, d_out)
            except Exception as e:  # an anchor that cannot run is reported, not fatal
                log.warning("cuDNN backward (gqa=%s): %s", gqa, str(e).splitlines()[0][:200])
                continue
            extra = {f"rel_err_d{x}_vs_anchor": round(_bench.rel_err(a, r), 5)
                     for x, a, r in zip("qkv", grads, ref)}
            if not gqa:
                extra["anchor_note"] = "K/V repeated to N heads"
            break
        pairs = _causal_pairs(b, s, n) if w is None else b * n * _window_pairs(s, w, 0)
        flops = 3.5 * 4 * pairs * h  # forward + backward (2.5x the forward), the FA convention
        rows.append(_bench.row(
            kernel="flash_prefill_fwd_bwd",
            case=f"B{b}-S{s // 1024}K-N{n}-K{kh}-H{h}-bf16-" + ("causal" if w is None else
                                                                f"window{w}"),
            ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
            anchor="cuDNN jax.nn.dot_product_attention fwd+bwd", anchor_ms=anchor_ms,
            goal="none (information; PERF.md has no backward row)", meets_goal=None, **extra))
    return rows


ROWS = {"flash_prefill": flash_rows, "window_prefill": window_rows,
        "flash_prefill_fwd_bwd": backward_rows}


def _config(text: str) -> dense_triton.Config:
    bm, bn, warps, stages = (int(x) for x in text.split("-"))
    return dense_triton.Config(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)


def sweep_backward(args) -> None:
    """Time forward + backward under each `--bwd-configs` entry (bwd tiles) at S = `--seqs[0]`."""
    b, n, kh, h, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.seqs[0]
    q, k, v = _qkv(0, b, s, n, kh, h)
    d_out = jax.random.normal(jax.random.key(5), q.shape, q.dtype)
    flops = 3.5 * 4 * _causal_pairs(b, s, n) * h
    base = args.config or dense_triton.default_config(h)
    print(f"{'bwd config':16} {'fwd+bwd ms':>10} {'TFLOP/s':>8}")
    for bm, bn, warps, stages in args.bwd_configs:
        cfg = dataclasses.replace(base, bwd_block_m=bm, bwd_block_n=bn, bwd_num_warps=warps,
                                  bwd_num_stages=stages)
        name = f"{bm}-{bn}-{warps}-{stages}"
        try:
            fn = _grad_fn(lambda q, k, v, cfg=cfg: dense_triton.attention(q, k, v, config=cfg)[0])
            ms = _bench.time_ms(fn, q, k, v, d_out)
        except Exception as e:
            print(f"{name:16} failed: {str(e).splitlines()[0][:100]}")
            continue
        print(f"{name:16} {ms:10.4f} {flops / ms / 1e9:8.1f}")


def sweep(args) -> None:
    """Time our kernel under each `--configs` entry at the first `--seqs` length; print a table."""
    b, n, kh, h, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.seqs[0]
    q, k, v = _qkv(0, b, s, n, kh, h)
    flops = 4 * _causal_pairs(b, s, n) * h
    anchor_ms, anchor_out, _ = _time_anchor(q, k, v, is_causal=True)
    if anchor_ms is not None:
        print(f"cuDNN causal S{s}: {anchor_ms:.4f} ms {flops / anchor_ms / 1e9:6.1f} TFLOP/s")
    wq, wk, wv = _qkv(1, 1, args.sweep_window_seq, n, kh, h)
    wflops = 4 * n * h * _window_pairs(args.sweep_window_seq, args.window, args.sink)
    print(f"{'config':16} {'causal ms':>10} {'TFLOP/s':>8} {'vs cuDNN':>8} {'err':>8}"
          f" {'window ms':>10} {'TFLOP/s':>8}")
    for cfg in args.configs:
        name = f"{cfg.block_m}-{cfg.block_n}-{cfg.num_warps}-{cfg.num_stages}"
        try:
            fn = _ours(cfg)
            out = fn(q, k, v)
            ms = _bench.time_ms(fn, q, k, v)
            wfn = _ours(cfg, window=args.window, sinks=args.sink)
            wms = _bench.time_ms(wfn, wq, wk, wv)
        except Exception as e:  # e.g. out of shared memory: report and go on
            print(f"{name:16} failed: {str(e).splitlines()[0][:100]}")
            continue
        ratio = f"{anchor_ms / ms:8.3f}" if anchor_ms else " " * 8
        err = f"{_bench.rel_err(out, anchor_out):8.1e}" if anchor_out is not None else " " * 8
        print(f"{name:16} {ms:10.4f} {flops / ms / 1e9:8.1f} {ratio} {err} {wms:10.4f} "
              f"{wflops / wms / 1e9:8.1f}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    def ints(text):
        return [int(x) for x in text.split(",")]

    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated row groups of {list(ROWS)}")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqs", type=ints, default=[8192, 16384, 32768])
    parser.add_argument("--window-seq", type=int, default=65536)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--sink", type=int, default=128)
    parser.add_argument("--config", type=_config, default=None,
                        help="our launch config BLOCK_M-BLOCK_N-warps-stages (default: "
                             "dense_triton.default_config)")
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    parser.add_argument("--sweep", action="store_true", help="time launch configs, write nothing")
    parser.add_argument("--configs", type=lambda s: [_config(c) for c in s.split(",")],
                        default="128-64-8-3,128-64-8-2,128-64-8-4,128-128-8-2,128-128-8-3,"
                                "128-32-8-4,64-64-4-3,256-64-16-2,128-64-4-3",
                        help="sweep configs BLOCK_M-BLOCK_N-warps-stages, comma separated")
    parser.add_argument("--sweep-bwd", action="store_true",
                        help="sweep the backward tiles (--bwd-configs) instead, write nothing")
    parser.add_argument("--bwd-configs", default="64-64-4-2,64-64-8-2,32-64-4-2,64-128-8-2,"
                        "32-128-4-2,64-32-4-3",
                        type=lambda s: [tuple(int(x) for x in c.split("-")) for c in s.split(",")],
                        help="backward configs BWD_BLOCK_M-BWD_BLOCK_N-warps-stages")
    parser.add_argument("--sweep-window-seq", type=int, default=32768,
                        help="sequence length of the window column of the sweep")
    parser.add_argument("--out", default="benchmarks")
    args = parser.parse_args(argv)
    if args.quick:
        args.seqs, args.window_seq, args.sweep_window_seq = [2048], 8192, 8192
        args.window = min(args.window, 2048)
    logging.basicConfig(level=logging.INFO)
    log.info("device: %s", _bench.device_info())
    if args.sweep_bwd:
        return sweep_backward(args)
    if args.sweep:
        return sweep(args)
    ctx = Context(matmul_tflops=matmul_tflops(), config=args.config)
    log.info("bf16 matmul 8192^3: %.1f TFLOP/s", ctx.matmul_tflops)
    rows = []
    for name in args.rows.split(","):
        try:
            rows += ROWS[name](args, ctx)
        except Exception:  # one broken row group must not lose the others
            log.exception("row group %s failed", name)
    md = _bench.write("prefill", rows, extra={"matmul_tflops": round(ctx.matmul_tflops, 2)},
                      out_dir=args.out)
    _bench.print_table(rows)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
