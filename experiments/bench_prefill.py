"""Every prefill kernel against its anchors and ceilings, in one process (issue 6, PERF.md).

    python -m experiments.bench_prefill --out benchmarks      # every row below (needs a GPU)
    python -m experiments.bench_prefill --smoke --out /tmp/b  # tiny shapes, CPU interpreter
    python -m experiments.bench_prefill --rows block_sparse_prefill,xattn_estimate
    python -m experiments.bench_prefill --sweep --configs 128-64-4-3,128-128-8-3
    python -m experiments.bench_prefill --sweep-bwd

Writes `<out>/prefill.json` and `<out>/prefill.md` (`--smoke`: `prefill_smoke.*`), rewritten after
every row so a time limit leaves what was measured. Row groups (`--rows`), in run order; shapes
B1, N32/K8, H = Hv = 128, bf16 unless said:

- `flash_prefill` (here): causal dense at S in `--seqs` (8K, 16K, 32K). TFLOP/s on the causal
  pairs (`4 * B * N * H * S^2 / 2`, FA's count); ceiling the bf16 matmul. Anchors: cuDNN through
  `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)` (K heads for K / V; K/V
  repeated to N heads if this jax refuses GQA) and tokamax's `dot_product_attention(is_causal=
  True)` with the implementation tokamax's default would pick (`tokamax_impl`; on an H100
  "mosaic", its Mosaic GPU kernel), as `tokamax_ms` / `speedup_vs_tokamax`. Goal
  `speedup_vs_anchor >= 0.9` (cuDNN).
- `window_prefill` (here): S64K, window 4K, sink 128. TFLOP/s on the visible pairs. Anchors:
  cuDNN's and tokamax's sliding window (`local_window_size=(window - 1, 0)`; neither has sinks,
  so our no-sink time is reported beside them). Goal `speedup_vs_anchor >= 0.9` (cuDNN).
- `block_sparse_prefill` (experiments/bench_sparse_prefill.py): causal, S in `--sparse-seqs`
  (64K, 128K), block 128, every head in mode 1 with a random block mask at density `--density`
  (0.1; plus 1.0 at `--full-density-seq`, 64K, for the per-block cost). Anchor and `dense_ms`: our
  dense flash at that S, same run. Goal (PERF.md) `ms <= goal_ms = 1.15 * density * dense_ms`.
- `xattn_estimate` (same module): the XAttention estimate (stride 16, block 128) at the same S.
  Goal `fraction_of_total = ms / (ms + sparse_ms) <= 0.2`, `sparse_ms` the block-sparse time at
  density ~0.1 at that S (same run).
- `gdn_chunk_prefill` (experiments/bench_gdn_prefill.py): GDN chunked prefill, Nk16 Nv32, against
  fla's `chunk_gated_delta_rule` (torch, same GPU). Goal `speedup_vs_anchor >= 1.5`.
- `causal_conv1d` (same module): causal conv1d prefill, T32K, C8192, W4; against copy bandwidth.
  Goal `fraction_of_ceiling >= 0.9`.
- `paged_prefill` (bench_sparse_prefill.py): a 2K chunk over an 8K / 32K paged prefix against our
  flash on a gathered copy. Goal `speedup_vs_anchor >= 0.9`.
- `flash_prefill_fwd_bwd` (here): forward + backward at the first two `--seqs` and with a window
  of `--window / 2`, against cuDNN's; FLOPs 3.5x the forward's (FA's count); information only.

Ceilings (bf16 8192^3 matmul; copy bandwidth for the conv rows) are measured once, in this
process, on first use. cuDNN, tokamax and fla are skipped, with a logged reason, when there is no
GPU or they fail; the row then records None. Long calls are timed with fewer repetitions
(`--budget-s`, 0.5 s of timed calls per figure; at least 3 trials), so an S128K figure costs about
a second after its compile.
`--sweep` times our forward under several launch configs at S = `--seqs[0]` (causal) and at
`--sweep-window-seq` with the window; `--sweep-bwd` times forward + backward under several
backward tile configs; both write nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.dense import attention
from attn.dense import mosaic as dense_mosaic
from attn.dense import triton as dense_triton
from experiments import _bench, bench_gdn_prefill, bench_sparse_prefill

log = logging.getLogger("bench_prefill")

# The markdown table's columns (the JSON has every field).
COLUMNS = ("kernel", "case", "impl", "ms", "achieved", "unit", "fraction_of_ceiling", "anchor",
           "anchor_ms", "speedup_vs_anchor", "tokamax_ms", "speedup_vs_tokamax", "tokamax_impl",
           "goal", "meets_goal")
_TOKAMAX: dict = {}  # the module, imported once, or None and why


def _ours(config, **options):
    """Our Triton kernel, jitted; every array is an argument (a closed-over array is baked in)."""
    return jax.jit(lambda q, k, v: dense_triton.attention(q, k, v, config=config, **options)[0])


def _ours_timed(ctx, q, k, v, **options):
    """Our dense forward as `attn.dense.attention(implementation="auto")` runs it: the Mosaic GPU
    kernel where it takes the shapes (a Hopper GPU), else the Triton one; the Triton kernel is
    timed beside it either way (`triton_ms`), with `--config` if given.

    Returns:
      `(ms, out, fields)`: the time and output of the kernel `fields["impl"]` names.
    """
    mosaic_fn = jax.jit(lambda q, k, v: dense_mosaic.attention(q, k, v, **options)[0])
    got = ctx.time_ours(_ours(ctx.config, **options), mosaic_fn, q, k, v)
    triton_config = _config_dict(ctx, q.shape[-1])
    fields = {"impl": got["impl"], "triton_ms": round(got["triton_ms"], 4),
              "triton_config": triton_config}
    if got["impl"] == "mosaic":
        fields["config"] = dataclasses.asdict(dense_mosaic.default_config(q.shape[-1]))
        fields["rel_err_triton_vs_mosaic"] = round(got["rel_err_triton_vs_mosaic"], 5)
    else:
        fields |= {"config": triton_config, "mosaic_note": got["mosaic_note"]}
    return got["ms"], got["out"], fields


def _cudnn(k_heads_ok: bool, **options):
    """cuDNN flash attention; repeats K/V per group if this jax refuses GQA heads."""
    def fn(q, k, v):
        if not k_heads_ok:
            g = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **options)
    return jax.jit(fn)


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


def _time_cudnn(ctx, q, k, v, **options):
    """`(ms, out, note)` of cuDNN with K heads, else repeated heads, else `(None, None, why)`."""
    if not _bench.on_gpu():
        log.warning("cuDNN anchor skipped: no GPU")
        return None, None, "skipped: no GPU"
    for gqa in (True, False):
        fn = _cudnn(gqa, **options)
        try:
            out = fn(q, k, v)
            return ctx.time(fn, q, k, v), out, "" if gqa else "K/V repeated to N heads"
        except Exception as e:  # an anchor that cannot run is reported, not fatal
            log.warning("cuDNN (gqa=%s): %s", gqa, _first_line(e))
    return None, None, "cuDNN failed"


def _tokamax():
    """tokamax, imported once, or None (the reason logged and kept in `_TOKAMAX["why"]`).

    tokamax 0.0.17 imports `xprof.cli.tools.get_kernel_stats_tool` at import time for its own
    xprof timer (unused here); the carried xprof wheel (2.22.1) lacks `xprof.cli`, so an empty
    stand-in module is registered when, and only when, the real one cannot be imported.
    """
    if "module" in _TOKAMAX:
        return _TOKAMAX["module"]
    _TOKAMAX["module"], _TOKAMAX["why"] = None, ""
    try:
        try:
            import xprof.cli.tools.get_kernel_stats_tool  # noqa: F401
        except ImportError:
            names = ("xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool")
            stubs = [sys.modules.setdefault(name, types.ModuleType(name)) for name in names]
            stubs[0].tools, stubs[1].get_kernel_stats_tool = stubs[1], stubs[2]
            _TOKAMAX["xprof_stub"] = True
        import tokamax

        _TOKAMAX["module"] = tokamax
        log.info("tokamax %s", getattr(tokamax, "__version__", "?"))
    except Exception as e:  # a missing or broken anchor is reported, not fatal
        _TOKAMAX["why"] = f"tokamax import failed: {_first_line(e)}"
        log.warning("tokamax anchor skipped: %s", _TOKAMAX["why"])
    return _TOKAMAX["module"]


def _tokamax_order() -> tuple[str, ...]:
    """tokamax's default `implementation=None` order (what it tries, first that traces wins)."""
    try:
        from tokamax._src.ops.attention import api  # private; read only, for the record

        return tuple(api._DEFAULT_IMPLEMENTATIONS)
    except Exception:  # another tokamax version: its documented backends, fastest first
        return ("mosaic", "triton", "xla")


def _time_tokamax(ctx, q, k, v, **options) -> tuple[float | None, jax.Array | None, str | None,
                                                    str]:
    """tokamax `dot_product_attention` with the implementation its default would pick.

    Walks tokamax's default order: an implementation that raises NotImplementedError while
    tracing is skipped, as tokamax's own `implementation=None` does; the first that traces is
    timed with that implementation named explicitly (so the row knows which ran). One that then
    fails to compile or run is noted and the next one tried.

    Returns:
      `(ms, out, implementation, note)`; `(None, None, None, why)` if none ran.
    """
    if not _bench.on_gpu():
        log.warning("tokamax anchor skipped: no GPU")
        return None, None, None, "skipped: no GPU"
    tk = _tokamax()
    if tk is None:
        return None, None, None, _TOKAMAX["why"]
    notes = ["xprof.cli stubbed"] if _TOKAMAX.get("xprof_stub") else []
    for impl in _tokamax_order():
        fn = jax.jit(functools.partial(tk.dot_product_attention, implementation=impl, **options))
        try:
            jax.eval_shape(fn, q, k, v)
        except NotImplementedError as e:
            notes.append(f"{impl}: not implemented ({_first_line(e)[:80]})")
            continue
        except Exception as e:  # tokamax's default would raise here; the record says so
            notes.append(f"{impl}: trace failed ({_first_line(e)[:80]})")
            continue
        try:
            out = fn(q, k, v)
            return ctx.time(fn, q, k, v), out, impl, "; ".join(notes)
        except Exception as e:  # compile / run failure: note it, try the next
            log.warning("tokamax %s: %s", impl, _first_line(e))
            notes.append(f"{impl}: failed ({_first_line(e)[:80]})")
    log.warning("tokamax anchor: nothing ran (%s)", "; ".join(notes))
    return None, None, None, "; ".join(notes) or "no implementation"


def _tokamax_fields(ctx, ms, out, q, k, v, **options) -> dict:
    """`tokamax_ms`, `speedup_vs_tokamax`, `tokamax_impl`, `rel_err_vs_tokamax`, note."""
    tk_ms, tk_out, impl, note = _time_tokamax(ctx, q, k, v, **options)
    extra = {"tokamax_ms": None if tk_ms is None else round(tk_ms, 4),
             "speedup_vs_tokamax": None if tk_ms is None else round(tk_ms / ms, 4),
             "tokamax_impl": impl}
    if tk_out is not None:
        extra["rel_err_vs_tokamax"] = round(_bench.rel_err(out, tk_out), 5)
    if note:
        extra["tokamax_note"] = note
    return extra


def _causal_pairs(b, t, n) -> float:
    """Query-key pairs of causal attention, counted as FA does (`S^2 / 2` per head)."""
    return b * n * t * t / 2


def _window_pairs(s, window, sink) -> float:
    """Visible pairs per head under a causal window of `window` keys plus `sink` leading keys."""
    p = np.arange(s, dtype=np.float64)
    in_window = np.minimum(p + 1, window)
    extra_sinks = np.clip(p - window + 1, 0, sink)  # sink keys older than the window
    return float((in_window + extra_sinks).sum())


def _config_dict(ctx, h) -> dict:
    return dataclasses.asdict(ctx.config or dense_triton.default_config(h))


def flash_rows(args, ctx):
    """Causal dense prefill against cuDNN and tokamax at each sequence length."""
    b, n, kh, h = args.batch, args.heads, args.kv_heads, args.head_dim
    for s in args.seqs:
        q, k, v = _bench.qkv(s, b, s, n, kh, h)
        ms, out, extra = _ours_timed(ctx, q, k, v)
        anchor_ms, anchor_out, note = _time_cudnn(ctx, q, k, v, is_causal=True)
        flops = 4 * _causal_pairs(b, s, n) * h
        extra |= _tokamax_fields(ctx, ms, out, q, k, v, is_causal=True)
        if anchor_out is not None:
            extra["rel_err_vs_anchor"] = round(_bench.rel_err(out, anchor_out), 5)
            extra["anchor_tflops"] = round(flops / anchor_ms / 1e9, 2)
            extra["speedup_triton_vs_anchor"] = round(anchor_ms / extra["triton_ms"], 4)
        if note:
            extra["anchor_note"] = note
        yield _bench.row(
            kernel="flash_prefill", case=f"B{b}-S{_bench.kilo(s)}-N{n}-K{kh}-H{h}-bf16-causal",
            ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
            anchor="cuDNN jax.nn.dot_product_attention", anchor_ms=anchor_ms,
            goal="speedup_vs_anchor >= 0.9",
            meets_goal=None if anchor_ms is None else anchor_ms / ms >= 0.9, **extra)
        del q, k, v, out, anchor_out


def window_rows(args, ctx):
    """Sliding window + sinks prefill against cuDNN's and tokamax's sliding window (no sink)."""
    b, n, kh, h = args.batch, args.heads, args.kv_heads, args.head_dim
    s, w, sink = args.window_seq, args.window, args.sink
    q, k, v = _bench.qkv(7, b, s, n, kh, h)
    ms, _, extra = _ours_timed(ctx, q, k, v, window=w, sinks=sink)
    window_opts = dict(is_causal=True, local_window_size=(w - 1, 0))
    anchor_ms, anchor_out, note = _time_cudnn(ctx, q, k, v, **window_opts)
    flops = 4 * b * n * h * _window_pairs(s, w, sink)
    extra["visible_fraction"] = round(_window_pairs(s, w, sink) / (s * s / 2), 5)
    # The anchors' exact function (no sink), like for like, by the same kernel.
    no_sink_ms, no_sink_out, no_sink = _ours_timed(ctx, q, k, v, window=w)
    extra["ours_no_sink_ms"] = round(no_sink_ms, 4)
    extra["triton_no_sink_ms"] = no_sink["triton_ms"]
    if anchor_ms is not None:
        extra["speedup_triton_vs_anchor"] = round(anchor_ms / extra["triton_ms"], 4)
    tk = _tokamax_fields(ctx, no_sink_ms, no_sink_out, q, k, v, **window_opts)
    if tk["tokamax_ms"] is not None:  # the row's speed-up is of the row's `ms`, as for cuDNN
        tk["speedup_no_sink_vs_tokamax"] = tk["speedup_vs_tokamax"]
        tk["speedup_vs_tokamax"] = round(tk["tokamax_ms"] / ms, 4)
    tk = {key.replace("rel_err_vs", "rel_err_no_sink_vs"): x for key, x in tk.items()}
    extra |= tk
    if anchor_out is not None:
        extra["rel_err_no_sink_vs_anchor"] = round(_bench.rel_err(no_sink_out, anchor_out), 5)
        extra["speedup_no_sink_vs_anchor"] = round(anchor_ms / no_sink_ms, 4)
        extra["anchor_tflops_on_its_pairs"] = round(
            4 * b * n * h * _window_pairs(s, w, 0) / anchor_ms / 1e9, 2)
    if note:
        extra["anchor_note"] = note
    yield _bench.row(
        kernel="window_prefill",
        case=f"B{b}-S{_bench.kilo(s)}-W{_bench.kilo(w)}-sink{sink}-N{n}-K{kh}-H{h}-bf16",
        ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
        anchor="cuDNN local_window_size (no sink)", anchor_ms=anchor_ms,
        goal="speedup_vs_anchor >= 0.9",
        meets_goal=None if anchor_ms is None else anchor_ms / ms >= 0.9, **extra)


def _grad_fn(fn):
    """`(q, k, v, d_out) -> (dq, dk, dv)` of `sum(fn(q, k, v) * d_out)`, jitted."""
    def loss(q, k, v, d_out):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def backward_rows(args, ctx):
    """Causal (and windowed) forward + backward against cuDNN's, at the first two lengths."""
    b, n, kh, h = args.batch, args.heads, args.kv_heads, args.head_dim
    cases = [(s, None) for s in args.seqs[:2]] + [(args.seqs[0], args.window // 2)]
    for s, w in cases:
        q, k, v = _bench.qkv(s + 3, b, s, n, kh, h)
        d_out = jax.random.normal(jax.random.key(s), q.shape, q.dtype)
        opts = {} if w is None else dict(window=w)
        if ctx.config is None:  # what `attention(implementation="auto")` trains through
            ours = _grad_fn(lambda q, k, v, opts=opts: attention(q, k, v, **opts)[0])
        else:
            ours = _grad_fn(lambda q, k, v, opts=opts: dense_triton.attention(
                q, k, v, config=ctx.config, **opts)[0])
        grads = ours(q, k, v, d_out)
        ms = ctx.time(ours, q, k, v, d_out)
        cudnn_opts = dict(is_causal=True)
        if w is not None:
            cudnn_opts["local_window_size"] = (w - 1, 0)
        anchor_ms, extra = None, {}
        for gqa in (True, False) if _bench.on_gpu() else ():
            try:
                anchor = _grad_fn(_cudnn(gqa, **cudnn_opts))
                ref = anchor(q, k, v, d_out)
                anchor_ms = ctx.time(anchor, q, k, v, d_out)
            except Exception as e:  # an anchor that cannot run is reported, not fatal
                log.warning("cuDNN backward (gqa=%s): %s", gqa, _first_line(e))
                continue
            extra = {f"rel_err_d{x}_vs_anchor": round(_bench.rel_err(a, r), 5)
                     for x, a, r in zip("qkv", grads, ref, strict=True)}
            if not gqa:
                extra["anchor_note"] = "K/V repeated to N heads"
            break
        pairs = _causal_pairs(b, s, n) if w is None else b * n * _window_pairs(s, w, 0)
        flops = 3.5 * 4 * pairs * h  # forward + backward (2.5x the forward), the FA convention
        yield _bench.row(
            kernel="flash_prefill_fwd_bwd",
            case=f"B{b}-S{_bench.kilo(s)}-N{n}-K{kh}-H{h}-bf16-"
                 + ("causal" if w is None else f"window{w}"),
            ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
            anchor="cuDNN jax.nn.dot_product_attention fwd+bwd", anchor_ms=anchor_ms,
            goal="none (information; PERF.md has no backward row)", meets_goal=None, **extra)


# Run order: the PERF.md rows first, the extra kernels (paged, backward) last.
ROWS = {"flash_prefill": flash_rows, "window_prefill": window_rows,
        "block_sparse_prefill": bench_sparse_prefill.sparse_rows,
        "xattn_estimate": bench_sparse_prefill.estimate_rows,
        "gdn_chunk_prefill": bench_gdn_prefill.gdn_rows,
        "causal_conv1d": bench_gdn_prefill.conv_rows,
        "paged_prefill": bench_sparse_prefill.paged_rows,
        "flash_prefill_fwd_bwd": backward_rows}


def _config(text: str) -> dense_triton.Config:
    """`bm-bn-warps-stages`, then `-ws` for a warp-specialised unmasked key loop, `-wsall` for
    every key loop warp-specialised, nothing for none."""
    bm, bn, warps, stages, *ws = text.split("-")
    return dense_triton.Config(block_m=int(bm), block_n=int(bn), num_warps=int(warps),
                               num_stages=int(stages), warp_specialize=bool(ws),
                               warp_specialize_masked=ws == ["wsall"])


def sweep_backward(args, ctx) -> None:
    """Time forward + backward under each `--bwd-configs` entry (bwd tiles) at S = `--seqs[0]`."""
    b, n, kh, h, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.seqs[0]
    q, k, v = _bench.qkv(0, b, s, n, kh, h)
    d_out = jax.random.normal(jax.random.key(5), q.shape, q.dtype)
    flops = 3.5 * 4 * _causal_pairs(b, s, n) * h
    base = ctx.config or dense_triton.default_config(h)
    print(f"{'bwd config':16} {'fwd+bwd ms':>10} {'TFLOP/s':>8}", flush=True)
    for bm, bn, warps, stages in args.bwd_configs:
        cfg = dataclasses.replace(base, bwd_block_m=bm, bwd_block_n=bn, bwd_num_warps=warps,
                                  bwd_num_stages=stages)
        name = f"{bm}-{bn}-{warps}-{stages}"
        try:
            fn = _grad_fn(lambda q, k, v, cfg=cfg: dense_triton.attention(q, k, v, config=cfg)[0])
            ms = ctx.time(fn, q, k, v, d_out)
        except Exception as e:
            print(f"{name:16} failed: {_first_line(e)[:100]}", flush=True)
            continue
        print(f"{name:16} {ms:10.4f} {flops / ms / 1e9:8.1f}", flush=True)


def sweep(args, ctx) -> None:
    """Time our kernel under each `--configs` entry at the first `--seqs` length; print a table."""
    b, n, kh, h, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.seqs[0]
    q, k, v = _bench.qkv(0, b, s, n, kh, h)
    flops = 4 * _causal_pairs(b, s, n) * h
    anchor_ms, anchor_out, _ = _time_cudnn(ctx, q, k, v, is_causal=True)
    if anchor_ms is not None:
        print(f"cuDNN causal S{s}: {anchor_ms:.4f} ms {flops / anchor_ms / 1e9:6.1f} TFLOP/s")
    ws = args.sweep_window_seq
    wq, wk, wv = _bench.qkv(1, 1, ws, n, kh, h)
    wflops = 4 * n * h * _window_pairs(ws, args.window, args.sink)
    print(f"{'config':16} {'causal ms':>10} {'TFLOP/s':>8} {'vs cuDNN':>8} {'err':>8}"
          f" {'window ms':>10} {'TFLOP/s':>8}", flush=True)
    for cfg in args.configs:
        name = f"{cfg.block_m}-{cfg.block_n}-{cfg.num_warps}-{cfg.num_stages}"
        name += "-wsall" if cfg.warp_specialize_masked else "-ws" if cfg.warp_specialize else ""
        try:
            fn = _ours(cfg)
            out = fn(q, k, v)
            ms = ctx.time(fn, q, k, v)
            wfn = _ours(cfg, window=args.window, sinks=args.sink)
            wms = ctx.time(wfn, wq, wk, wv)
        except Exception as e:  # e.g. out of shared memory: report and go on
            print(f"{name:16} failed: {_first_line(e)[:100]}", flush=True)
            continue
        ratio = f"{anchor_ms / ms:8.3f}" if anchor_ms else " " * 8
        err = f"{_bench.rel_err(out, anchor_out):8.1e}" if anchor_out is not None else " " * 8
        print(f"{name:16} {ms:10.4f} {flops / ms / 1e9:8.1f} {ratio} {err} {wms:10.4f} "
              f"{wflops / wms / 1e9:8.1f}", flush=True)


def _smoke(args) -> None:
    """Tiny shapes every group runs through Triton's interpreter on a CPU in seconds."""
    args.batch, args.heads, args.kv_heads, args.head_dim = 1, 4, 2, 32
    args.seqs, args.window_seq, args.window, args.sink = [96], 160, 48, 8
    args.sweep_window_seq = 160
    args.sparse_seqs, args.full_density_seq, args.block, args.stride = [128, 256], 128, 32, 8
    args.density = 0.4  # 0.1 is below the forced diagonal + sink blocks at 4-8 blocks a row
    args.prefixes, args.chunk, args.page = [40], 24, 16
    args.configs = args.configs[:1]
    args.bwd_configs = args.bwd_configs[:1]


def parse_args(argv=None, *, rows=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)

    def ints(text):
        return [int(x) for x in text.split(",")]

    parser.add_argument("--rows", default=",".join(rows or ROWS),
                        help=f"comma-separated row groups of {list(ROWS)}")
    parser.add_argument("--name", default="prefill", help="file name: <out>/<name>.json")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seqs", type=ints, default=[8192, 16384, 32768])
    parser.add_argument("--window-seq", type=int, default=65536)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--sink", type=int, default=128)
    parser.add_argument("--sparse-seqs", type=ints, default=[65536, 131072],
                        help="lengths of the block-sparse and estimate rows")
    parser.add_argument("--density", type=float, default=0.1,
                        help="block density of the block-sparse rows")
    parser.add_argument("--full-density-seq", type=int, default=65536,
                        help="the length that also gets a density-1.0 block-sparse row (0: none)")
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--stride", type=int, default=16, help="XAttention estimate stride")
    parser.add_argument("--prefixes", type=ints, default=[8192, 32768])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--config", type=_config, default=None,
                        help="our launch config BLOCK_M-BLOCK_N-warps-stages (default: "
                             "dense_triton.default_config)")
    parser.add_argument("--smoke", "--quick", action="store_true",
                        help="tiny shapes, one call per figure (runs on a CPU through Triton's "
                             "interpreter); writes <name>_smoke.*")
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
    parser.add_argument("--budget-s", type=float, default=0.5,
                        help="seconds of timed calls per figure (long calls run fewer times)")
    parser.add_argument("--out", default="benchmarks")
    args = parser.parse_args(argv)
    if args.smoke:
        _smoke(args)
        args.name += "_smoke"
    bench_gdn_prefill.configure(args)
    return args


def main(argv=None, *, rows=None) -> list[dict] | None:
    """Run the selected row groups (or a sweep); returns the rows.

    Args:
      argv: command-line arguments (default `sys.argv[1:]`).
      rows: the default `--rows` (the row libraries' own `main`s pass their groups).
    """
    args = parse_args(argv, rows=rows)
    logging.basicConfig(level=logging.INFO)
    log.info("device: %s", _bench.device_info())
    ctx = _bench.Context(smoke=args.smoke, config=args.config, budget_s=args.budget_s)
    if args.sweep_bwd:
        return sweep_backward(args, ctx)
    if args.sweep:
        return sweep(args, ctx)
    rows = _bench.run_groups(args.name, ROWS, args.rows.split(","), args, ctx, out_dir=args.out,
                             cols=COLUMNS, log=log)
    _bench.print_table(rows)
    print(f"wrote {args.out}/{args.name}.md", flush=True)
    return rows


if __name__ == "__main__":
    main()
