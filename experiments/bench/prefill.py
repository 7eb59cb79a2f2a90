"""Dense prefill rows: causal flash (`flash_prefill`), sliding window + sinks (`window_prefill`),
forward + backward (`flash_prefill_fwd_bwd`). Shapes B1, N32 / K8, H128, bf16.

- `flash_prefill`: causal at S in `seqs` (8K, 16K, 32K). Ours: the kernel
  `attn.dense.attention(implementation="auto")` runs (`impl`: Mosaic GPU on a Hopper GPU, else
  Triton; the Triton one timed beside it, `triton_ms`). TFLOP/s on the causal pairs
  (`4 * B * N * H * S^2 / 2`, FA's count); ceiling the bf16 matmul. Anchors: cuDNN through
  `jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)` (K heads for K / V; K/V
  repeated to N heads if this jax refuses GQA) and tokamax's `dot_product_attention` with the
  implementation tokamax's default would pick (`tokamax_impl`), as `tokamax_ms` /
  `speedup_vs_tokamax`. Goal `speedup_vs_anchor >= 0.9` (cuDNN).
- `window_prefill`: S64K, window 4K, sink 128. TFLOP/s on the visible pairs. Anchors: cuDNN's and
  tokamax's sliding window (`local_window_size=(window - 1, 0)`; neither has sinks, so our no-sink
  time is reported beside them). Goal `speedup_vs_anchor >= 0.9` (cuDNN).
- `flash_prefill_fwd_bwd`: forward + backward at `seqs` (causal) and with `window` + `sink` at
  `window_seqs` (the longer one shows whether the sink tiles, the longest backward programs, start
  first), through `attention(implementation="auto")`, against cuDNN's and tokamax's
  (`tokamax_ms`, the implementation its default picks; window without sinks for both); FLOPs 3.5x
  the forward's (FA's count; the anchor's on its own pairs, without sinks); the backward alone
  (`bwd_ms`, `bwd_tflops`, and the anchor's) is fwd+bwd minus the forward. With a window, our
  no-sink time too (`ours_no_sink_ms`, the anchors' exact function). Goal `speedup_vs_anchor >=
  1.0`, a parity: ours and cuDNN's are timed interleaved over rounds (`Context.time_rounds`);
  the row is the round with the median speed-up, every round's in `round_speedups`. On the
  GPU, `kernel_ms` lists the kernels of one call of ours and of cuDNN's, each with its time
  (`core.kernel_breakdown`, from a profiler trace). `long_seqs` (S128K): the step runs on one
  GPU.
- `softcap_prefill`: causal with logit soft-capping (`softcap`, Gemma 2's 50) at `seqs`, through
  `attention(implementation="auto")` (the Triton kernel: Mosaic GPU has no soft-capping); the
  anchor is the same call without `softcap`, so the row is the cost of the cap. Goal
  `speedup_vs_anchor >= 0.9`.

cuDNN and tokamax are skipped, with the reason in the row, when there is no GPU or they fail;
tokamax 0.0.17 needs `xprof.cli` at import (absent from xprof 2.22.1).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.dense import attention
from attn.dense import mosaic as dense_mosaic
from attn.dense import triton as dense_triton
from experiments.bench import core
from experiments.bench.registry import register

log = logging.getLogger("bench.prefill")

_TOKAMAX: dict = {}  # the module, imported once, or None and why
QUICK_HEADS = dict(heads=4, kv_heads=2, head_dim=32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlashArgs:
    """Causal self-attention, B1, N32 / K8, H128, S8K..32K (PERF.md)."""

    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seqs: tuple[int, ...] = (8192, 16384, 32768)
    QUICK: ClassVar[dict] = dict(QUICK_HEADS, seqs=(96,))


@dataclasses.dataclass(frozen=True, kw_only=True)
class WindowArgs:
    """Sliding window + sinks, S64K, window 4K, sink 128 (PERF.md)."""

    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seq: int = 65536
    window: int = 4096
    sink: int = 128
    QUICK: ClassVar[dict] = dict(QUICK_HEADS, seq=160, window=48, sink=8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BackwardArgs:
    """Forward + backward, causal at `seqs` and with `window` + `sink` at `window_seqs` (PERF.md);
    `long_seqs`: causal rows that show a step fits (no S x S buffer)."""

    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seqs: tuple[int, ...] = (8192, 16384, 32768)
    window: int = 2048
    sink: int = 64
    window_seqs: tuple[int, ...] = (8192, 32768)
    long_seqs: tuple[int, ...] = (131072,)
    QUICK: ClassVar[dict] = dict(QUICK_HEADS, seqs=(96,), window=24, sink=4, window_seqs=(96,),
                                 long_seqs=())


@dataclasses.dataclass(frozen=True, kw_only=True)
class SoftcapArgs:
    """Causal self-attention with logit soft-capping, B1, N32 / K8, H128, S8K / 16K."""

    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seqs: tuple[int, ...] = (8192, 16384)
    softcap: float = 50.0
    QUICK: ClassVar[dict] = dict(QUICK_HEADS, seqs=(96,))


def _ours(**options):
    """Our Triton kernel, jitted; every array is an argument (a closed-over array is baked in)."""
    return jax.jit(lambda q, k, v: dense_triton.attention(q, k, v, **options)[0])


def _ours_timed(ctx, q, k, v, **options):
    """Our dense forward as `attn.dense.attention(implementation="auto")` runs it: the Mosaic GPU
    kernel where it takes the shapes (a Hopper GPU), else the Triton one; the Triton kernel is
    timed beside it either way (`triton_ms`).

    Returns:
      `(ms, out, fields)`: the time and output of the kernel `fields["impl"]` names.
    """
    mosaic_fn = jax.jit(lambda q, k, v: attention(q, k, v, implementation="mosaic",
                                                  **options)[0])
    got = ctx.time_ours(_ours(**options), mosaic_fn, q, k, v)
    triton_config = dataclasses.asdict(dense_triton.default_config(q.shape[-1]))
    fields = {"impl": got["impl"], "triton_ms": round(got["triton_ms"], 4),
              "triton_config": triton_config}
    if got["impl"] == "mosaic":
        fields["config"] = dataclasses.asdict(dense_mosaic.default_config(q.shape[-1]))
        fields["rel_err_triton_vs_mosaic"] = round(got["rel_err_triton_vs_mosaic"], 5)
    else:
        fields |= {"config": triton_config, "mosaic_note": got["mosaic_note"]}
    return got["ms"], got["out"], fields


def cudnn(k_heads_ok: bool, **options):
    """cuDNN flash attention; repeats K/V per group if this jax refuses GQA heads."""
    def fn(q, k, v):
        if not k_heads_ok:
            g = q.shape[2] // k.shape[2]
            k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn", **options)
    return jax.jit(fn)


def time_cudnn(ctx, q, k, v, **options):
    """`(ms, out, note)` of cuDNN with K heads, else repeated heads, else `(None, None, why)`."""
    if not core.on_gpu():
        log.warning("cuDNN anchor skipped: no GPU")
        return None, None, "skipped: no GPU"
    for gqa in (True, False):
        fn = cudnn(gqa, **options)
        try:
            out = fn(q, k, v)
            return ctx.time(fn, q, k, v), out, "" if gqa else "K/V repeated to N heads"
        except Exception as e:  # an anchor that cannot run is reported, not fatal
            log.warning("cuDNN (gqa=%s): %s", gqa, core.first_line(e))
    return None, None, "cuDNN failed"


def _tokamax():
    """tokamax, imported once, or None (the reason logged and kept in `_TOKAMAX["why"]`)."""
    if "module" in _TOKAMAX:
        return _TOKAMAX["module"]
    _TOKAMAX["module"], _TOKAMAX["why"] = None, ""
    try:
        import tokamax

        _TOKAMAX["module"] = tokamax
        log.info("tokamax %s", getattr(tokamax, "__version__", "?"))
    except Exception as e:  # a missing or broken anchor is reported, not fatal
        _TOKAMAX["why"] = f"tokamax import failed: {core.first_line(e)}"
        log.warning("tokamax anchor skipped: %s", _TOKAMAX["why"])
    return _TOKAMAX["module"]


def _tokamax_order() -> tuple[str, ...]:
    """tokamax's default `implementation=None` order (what it tries, first that traces wins)."""
    try:
        from tokamax._src.ops.attention import api  # private; read only, for the record

        return tuple(api._DEFAULT_IMPLEMENTATIONS)
    except Exception:  # another tokamax version: its documented backends, fastest first
        return ("mosaic", "triton", "xla")


def _time_tokamax(ctx, *args, wrap: Callable = jax.jit, **options) -> tuple[
        float | None, object, str | None, str]:
    """tokamax `dot_product_attention` with the implementation its default would pick.

    Walks tokamax's default order: an implementation that raises NotImplementedError while
    tracing is skipped, as tokamax's own `implementation=None` does; the first that traces is
    timed with that implementation named explicitly (so the row knows which ran). One that then
    fails to compile or run is noted and the next one tried. What is timed is
    `wrap(attention)(*args)`: `args` `(q, k, v)` with `jax.jit`, `(q, k, v, d_out)` with
    `grad_fn` (forward + backward).

    Returns:
      `(ms, out, implementation, note)`; `(None, None, None, why)` if none ran.
    """
    if not core.on_gpu():
        log.warning("tokamax anchor skipped: no GPU")
        return None, None, None, "skipped: no GPU"
    tk = _tokamax()
    if tk is None:
        return None, None, None, _TOKAMAX["why"]
    notes = []
    for impl in _tokamax_order():
        fn = wrap(functools.partial(tk.dot_product_attention, implementation=impl, **options))
        try:
            jax.eval_shape(fn, *args)
        except NotImplementedError as e:
            notes.append(f"{impl}: not implemented ({core.first_line(e)[:80]})")
            continue
        except Exception as e:  # tokamax's default would raise here; the record says so
            notes.append(f"{impl}: trace failed ({core.first_line(e)[:80]})")
            continue
        try:
            out = fn(*args)
            return ctx.time(fn, *args), out, impl, "; ".join(notes)
        except Exception as e:  # compile / run failure: note it, try the next
            log.warning("tokamax %s: %s", impl, core.first_line(e))
            notes.append(f"{impl}: failed ({core.first_line(e)[:80]})")
    log.warning("tokamax anchor: nothing ran (%s)", "; ".join(notes))
    return None, None, None, "; ".join(notes) or "no implementation"


def _tokamax_fields(ctx, ms, out, q, k, v, **options) -> dict:
    """`tokamax_ms`, `speedup_vs_tokamax`, `tokamax_impl`, `rel_err_vs_tokamax`, note."""
    tk_ms, tk_out, impl, note = _time_tokamax(ctx, q, k, v, **options)
    extra = {"tokamax_ms": None if tk_ms is None else round(tk_ms, 4),
             "speedup_vs_tokamax": None if tk_ms is None else round(tk_ms / ms, 4),
             "tokamax_impl": impl}
    if tk_out is not None:
        extra["rel_err_vs_tokamax"] = round(core.rel_err(out, tk_out), 5)
    if note:
        extra["tokamax_note"] = note
    return extra


def causal_pairs(b, t, n) -> float:
    """Query-key pairs of causal attention, counted as FA does (`S^2 / 2` per head)."""
    return b * n * t * t / 2


def window_pairs(s, window, sink) -> float:
    """Visible pairs per head under a causal window of `window` keys plus `sink` leading keys."""
    p = np.arange(s, dtype=np.float64)
    in_window = np.minimum(p + 1, window)
    extra_sinks = np.clip(p - window + 1, 0, sink)  # sink keys older than the window
    return float((in_window + extra_sinks).sum())


@register("flash_prefill", FlashArgs)
def flash_rows(a: FlashArgs, ctx: core.Context):
    """Causal dense prefill against cuDNN and tokamax at each sequence length."""
    b, n, kh, h = a.batch, a.heads, a.kv_heads, a.head_dim
    for s in a.seqs:
        q, k, v = core.qkv(s, b, s, n, kh, h)
        ms, out, extra = _ours_timed(ctx, q, k, v)
        anchor_ms, anchor_out, note = time_cudnn(ctx, q, k, v, is_causal=True)
        flops = 4 * causal_pairs(b, s, n) * h
        extra |= _tokamax_fields(ctx, ms, out, q, k, v, is_causal=True)
        if anchor_out is not None:
            extra["rel_err_vs_anchor"] = round(core.rel_err(out, anchor_out), 5)
            extra["anchor_tflops"] = round(flops / anchor_ms / 1e9, 2)
            extra["speedup_triton_vs_anchor"] = round(anchor_ms / extra["triton_ms"], 4)
        if note:
            extra["anchor_note"] = note
        yield core.row(
            kernel="flash_prefill", case=f"B{b}-S{core.kilo(s)}-N{n}-K{kh}-H{h}-bf16-causal",
            ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
            anchor="cuDNN jax.nn.dot_product_attention", anchor_ms=anchor_ms,
            goal="speedup_vs_anchor >= 0.9",
            meets_goal=None if anchor_ms is None else anchor_ms / ms >= 0.9, **extra)
        del q, k, v, out, anchor_out


@register("window_prefill", WindowArgs)
def window_rows(a: WindowArgs, ctx: core.Context):
    """Sliding window + sinks prefill against cuDNN's and tokamax's sliding window (no sink)."""
    b, n, kh, h = a.batch, a.heads, a.kv_heads, a.head_dim
    s, w, sink = a.seq, a.window, a.sink
    q, k, v = core.qkv(7, b, s, n, kh, h)
    ms, _, extra = _ours_timed(ctx, q, k, v, window=w, sinks=sink)
    window_opts = dict(is_causal=True, local_window_size=(w - 1, 0))
    anchor_ms, anchor_out, note = time_cudnn(ctx, q, k, v, **window_opts)
    flops = 4 * b * n * h * window_pairs(s, w, sink)
    extra["visible_fraction"] = round(window_pairs(s, w, sink) / (s * s / 2), 5)
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
        extra["rel_err_no_sink_vs_anchor"] = round(core.rel_err(no_sink_out, anchor_out), 5)
        extra["speedup_no_sink_vs_anchor"] = round(anchor_ms / no_sink_ms, 4)
        extra["anchor_tflops_on_its_pairs"] = round(
            4 * b * n * h * window_pairs(s, w, 0) / anchor_ms / 1e9, 2)
    if note:
        extra["anchor_note"] = note
    yield core.row(
        kernel="window_prefill",
        case=f"B{b}-S{core.kilo(s)}-W{core.kilo(w)}-sink{sink}-N{n}-K{kh}-H{h}-bf16",
        ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
        anchor="cuDNN local_window_size (no sink)", anchor_ms=anchor_ms,
        goal="speedup_vs_anchor >= 0.9",
        meets_goal=None if anchor_ms is None else anchor_ms / ms >= 0.9, **extra)


def grad_fn(fn):
    """`(q, k, v, d_out) -> (dq, dk, dv)` of `sum(fn(q, k, v) * d_out)`, jitted."""
    def loss(q, k, v, d_out):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * d_out.astype(jnp.float32))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


@register("flash_prefill_fwd_bwd", BackwardArgs)
def backward_rows(a: BackwardArgs, ctx: core.Context):
    """Causal and windowed forward + backward against cuDNN's; the backward alone is the
    difference to each one's forward, timed in the same process."""
    b, n, kh, h = a.batch, a.heads, a.kv_heads, a.head_dim
    cases = ([(s, None) for s in a.seqs] + [(s, a.window) for s in a.window_seqs]
             + [(s, None) for s in a.long_seqs])
    for s, w in cases:
        q, k, v = core.qkv(s + 3, b, s, n, kh, h)
        d_out = jax.random.normal(jax.random.key(s), q.shape, q.dtype)
        opts = {} if w is None else dict(window=w, sinks=a.sink)
        # what `attention(implementation="auto")` trains through
        forward = jax.jit(lambda q, k, v, opts=opts: attention(q, k, v, **opts)[0])
        ours = grad_fn(lambda q, k, v, opts=opts: attention(q, k, v, **opts)[0])
        grads = ours(q, k, v, d_out)
        calls = {"ours": (ours, q, k, v, d_out), "ours_fwd": (forward, q, k, v)}
        if w is not None:  # the anchors' exact function (no sink), like for like
            no_sink = grad_fn(lambda q, k, v, w=w: attention(q, k, v, window=w)[0])
            calls["ours_no_sink"] = (no_sink, q, k, v, d_out)
        cudnn_opts = dict(is_causal=True)
        if w is not None:
            cudnn_opts["local_window_size"] = (w - 1, 0)
        extra = {}
        for gqa in (True, False) if core.on_gpu() else ():
            try:
                anchor, anchor_fwd = grad_fn(cudnn(gqa, **cudnn_opts)), cudnn(gqa, **cudnn_opts)
                ref = anchor(q, k, v, d_out)
                jax.block_until_ready(anchor_fwd(q, k, v))
            except Exception as e:  # an anchor that cannot run is reported, not fatal
                log.warning("cuDNN backward (gqa=%s): %s", gqa, core.first_line(e))
                continue
            calls |= {"anchor": (anchor, q, k, v, d_out), "anchor_fwd": (anchor_fwd, q, k, v)}
            extra = {f"rel_err_d{x}_vs_anchor": round(core.rel_err(g, r), 5)
                     for x, g, r in zip("qkv", grads, ref, strict=True)}
            if not gqa:
                extra["anchor_note"] = "K/V repeated to N heads"
            break
        # The goal is parity with cuDNN: ours and cuDNN's interleaved (`Context.time_rounds`).
        times, clocks = ctx.time_rounds(calls)
        i = core.median_round(times.get("anchor", times["ours"]), times["ours"])
        extra["gpu_clocks"] = core.clocks_of_round(clocks, i, "ours", "anchor")
        ms, fwd_ms = times["ours"][i], times["ours_fwd"][i]
        anchor_ms = anchor_fwd_ms = None
        if "anchor" in times:
            anchor_ms, anchor_fwd_ms = times["anchor"][i], times["anchor_fwd"][i]
            extra["round_speedups"] = core.round_ratios(times["anchor"], times["ours"])
        if "ours_no_sink" in times:
            no_sink_ms = times["ours_no_sink"][i]
            extra["ours_no_sink_ms"] = round(no_sink_ms, 4)
            if anchor_ms is not None:
                extra["speedup_no_sink_vs_anchor"] = round(anchor_ms / no_sink_ms, 4)
        tk_ms, tk_grads, tk_impl, tk_note = _time_tokamax(ctx, q, k, v, d_out, wrap=grad_fn,
                                                          **cudnn_opts)
        extra |= {"tokamax_ms": None if tk_ms is None else round(tk_ms, 4),
                  "speedup_vs_tokamax": None if tk_ms is None else round(tk_ms / ms, 4),
                  "tokamax_impl": tk_impl}
        if tk_grads is not None:
            extra |= {f"rel_err_d{x}_vs_tokamax": round(core.rel_err(g, r), 5)
                      for x, g, r in zip("qkv", grads, tk_grads, strict=True)}
        if tk_note:
            extra["tokamax_note"] = tk_note
        if w is not None:
            extra["anchor_note"] = (extra.get("anchor_note", "")
                                    + " cuDNN and tokamax window without sinks").strip()
        pairs = causal_pairs(b, s, n) if w is None else b * n * window_pairs(s, w, a.sink)
        flops = 4 * pairs * h  # the forward's; the backward counts 2.5x it (the FA convention)
        extra |= dict(bwd_ms=round(ms - fwd_ms, 4),
                      bwd_tflops=round(2.5 * flops / (ms - fwd_ms) / 1e9, 1))
        if anchor_fwd_ms is not None:  # cuDNN's own pairs: its window has no sinks
            anchor_flops = flops if w is None else 4 * b * n * window_pairs(s, w, 0) * h
            extra |= dict(anchor_bwd_ms=round(anchor_ms - anchor_fwd_ms, 4),
                          anchor_bwd_tflops=round(
                              2.5 * anchor_flops / (anchor_ms - anchor_fwd_ms) / 1e9, 1))
        if core.on_gpu() and not ctx.quick:  # which kernel a gap to cuDNN is in
            extra["kernel_ms"] = {name: core.kernel_breakdown(*calls[name])
                                  for name in ("ours", "anchor") if name in calls}
        long = s in a.long_seqs and w is None
        yield core.row(
            kernel="flash_prefill_fwd_bwd",
            case=f"B{b}-S{core.kilo(s)}-N{n}-K{kh}-H{h}-bf16-"
                 + ("causal" if w is None else f"window{w}-sink{a.sink}"),
            ms=ms, achieved=3.5 * flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
            anchor="cuDNN jax.nn.dot_product_attention fwd+bwd", anchor_ms=anchor_ms,
            goal="runs on one GPU (no S x S buffer)" if long else "speedup_vs_anchor >= 1.0",
            meets_goal=True if long else (None if anchor_ms is None else anchor_ms / ms >= 1.0),
            **extra)


@register("softcap_prefill", SoftcapArgs)
def softcap_rows(a: SoftcapArgs, ctx: core.Context):
    """Causal prefill with soft-capped logits against the same call without the cap."""
    b, n, kh, h = a.batch, a.heads, a.kv_heads, a.head_dim
    for s in a.seqs:
        q, k, v = core.qkv(s + 5, b, s, n, kh, h)
        capped = jax.jit(lambda q, k, v: attention(q, k, v, softcap=a.softcap)[0])
        plain = jax.jit(lambda q, k, v: attention(q, k, v)[0])
        out = capped(q, k, v)
        ms = ctx.time(capped, q, k, v)
        anchor_ms = ctx.time(plain, q, k, v)
        ref = attention(q, k, v, softcap=a.softcap, implementation="xla")[0] if s <= 8192 else None
        extra = {"impl": "triton" if core.on_gpu() else "xla", "softcap": a.softcap}
        if ref is not None:
            extra["rel_err_vs_xla"] = round(core.rel_err(out, ref), 5)
        flops = 4 * causal_pairs(b, s, n) * h
        yield core.row(
            kernel="softcap_prefill",
            case=f"B{b}-S{core.kilo(s)}-N{n}-K{kh}-H{h}-bf16-causal-cap{a.softcap:g}",
            ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
            anchor="ours without softcap", anchor_ms=anchor_ms, goal="speedup_vs_anchor >= 0.9",
            meets_goal=anchor_ms / ms >= 0.9, **extra)
        del q, k, v, out, ref
