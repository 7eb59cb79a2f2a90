"""Paged decode rows (`paged_decode`): our Triton kernel against the deprecated JAX Pallas kernels
and the copy-bandwidth ceiling.

- `paged_decode` bf16, every group size G of `groups`, uniform tables (the same random pages
  for every KV head): K + V bytes `2 B S K H 2` against the copy ceiling (goal PERF.md's 0.85).
  Anchor: the deprecated JAX Pallas `paged_attention` at its best of 128 / 256-token blocks;
  `decode_attention_ms`: the deprecated Pallas `decode_attention.gqa` on a contiguous copy.
- `paged_decode_fp8`: the same grid on e4m3 pages with float32 scales per `sub_block` tokens,
  against our bf16 time (goal >= 1.7x).
- `paged_decode_headwise`: per-head tables at G = `headwise_group`, all heads full against the
  uniform table (<= 1.05x), then half the heads streaming (sink + window) against all full
  (<= 0.55x; `bytes_ratio` is the ideal).
- the XLA reference once (`xla_reference`), as the "no kernel at all" anchor row.

The Pallas anchors need a GPU; without one their fields stay empty.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.paged_decode import reference as paged_ref
from attn.paged_decode import triton as paged_triton
from experiments.bench import core
from experiments.bench.registry import register
from kv import fp8

log = logging.getLogger("bench.decode")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedDecodeArgs:
    """B64, S32K, K8, H128, pages of 64 (PERF.md)."""

    batch: int = 64
    seq: int = 32768
    kv_heads: int = 8
    head_dim: int = 128
    page: int = 64
    groups: tuple[int, ...] = (1, 2, 4, 5, 7, 8, 16)
    headwise_group: int = 4
    window: int = 2048
    sink: int = 128
    sub_block: int = 16
    xla_reference: bool = True
    QUICK: ClassVar[dict] = dict(batch=2, seq=256, page=16, groups=(1, 4), window=64, sink=16)


def _tables(rng, batch, kv_heads, max_pages, num_pages, per_head):
    """Random page ids (never the null page 0); identical rows per head unless `per_head`."""
    def one():
        return rng.permutation(num_pages - 1)[: batch * max_pages].reshape(batch, max_pages) + 1
    if per_head:
        t = np.stack([one() for _ in range(kv_heads)], axis=1)
    else:
        t = np.repeat(one()[:, None], kv_heads, axis=1)
    return jnp.asarray(t, jnp.int32)


def g4_key(*, batch, seq, kv_heads, head_dim, page, sub_block) -> tuple:
    """The memo key of our G4 decode times `{"bf16": ms, "fp8": ms}` at a shape (the anchor of
    the `kv_write` rows)."""
    return ("paged_decode_g4", batch, seq, kv_heads, head_dim, page, sub_block)


@register("paged_decode", PagedDecodeArgs)
def paged_rows(a: PagedDecodeArgs, ctx: core.Context):
    """Paged decode bf16 / fp8 per group size, per-head tables, the XLA reference."""
    rng = np.random.default_rng(0)
    b, s, kh, h, p = a.batch, a.seq, a.kv_heads, a.head_dim, a.page
    max_pages = s // p
    num_pages = b * max_pages + 1
    key = jax.random.key(0)
    k_pages = jax.random.normal(key, (kh, num_pages, p, h), jnp.bfloat16)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), (kh, num_pages, p, h), jnp.bfloat16)
    uniform = _tables(rng, b, kh, max_pages, num_pages, per_head=False)
    per_head = _tables(rng, b, kh, max_pages, num_pages, per_head=True)
    lengths = jnp.full((b,), s, jnp.int32)
    full = jnp.zeros((kh,), jnp.int32)
    kv_bytes = 2 * b * s * kh * h * 2
    scale = h**-0.5
    ceiling = ctx.copy_tbs["ceiling"]
    fixed = dict(budget_s=None)  # fixed counts: every call here is a few ms

    @jax.jit
    def ours(q, kp, vp, table, window, sinks, ks=None, vs=None):
        # Every array is an argument: a closed-over array would be baked into the program.
        cfg = paged_triton.default_config(b, kh, s, fp8=ks is not None)
        return paged_triton.paged_decode(q, kp, vp, table, lengths, scale=scale, window=window,
                                         sinks=sinks, k_scales=ks, v_scales=vs, config=cfg)

    def best_pallas_paged(q):
        """The anchor at its best of a few tile sizes (some exceed shared memory):
        `(ms, output)`, or `(None, None)`."""
        from jax.experimental.pallas.ops.gpu import paged_attention

        best = (float("inf"), None)
        for tokens in (128, 256):
            fn = jax.jit(functools.partial(paged_attention.paged_attention, block_h=16,
                                           pages_per_compute_block=max(1, tokens // p)))
            try:
                got = ctx.time(fn, q, k_pages, v_pages, uniform[:, 0], lengths, **fixed)
            except Exception as e:  # too much shared memory at this tile: the next one
                log.warning("pallas paged_attention, %d-token blocks: %s", tokens,
                            core.first_line(e))
                continue
            best = min(best, (got, fn), key=lambda x: x[0])
        if best[1] is None:
            return None, None
        return best[0], best[1](q * scale, k_pages, v_pages, uniform[:, 0], lengths)

    if core.on_gpu():
        from jax.experimental.pallas.ops.gpu import decode_attention

        pallas_gqa = jax.jit(functools.partial(decode_attention.gqa, sm_scale=1.0))
        k_contig = jax.random.normal(jax.random.fold_in(key, 2), (b, s, kh, h), jnp.bfloat16)
        v_contig = jax.random.normal(jax.random.fold_in(key, 3), (b, s, kh, h), jnp.bfloat16)
    else:
        log.warning("Pallas anchors skipped: no GPU")

    q_pages, q_scales = fp8.quantize(k_pages, a.sub_block)
    qv_pages, qv_scales = fp8.quantize(v_pages, a.sub_block)

    for g in a.groups:
        n = kh * g
        q = jax.random.normal(jax.random.fold_in(key, 10 + g), (b, n, h), jnp.bfloat16)
        out, _ = ours(q, k_pages, v_pages, uniform, full, full)
        extra = {}
        anchor_ms = None
        if core.on_gpu():
            anchor_ms, anchor_out = best_pallas_paged(q)
            if anchor_out is not None:
                extra["rel_err_vs_anchor"] = round(core.rel_err(out, anchor_out), 5)
        ms = ctx.time(ours, q, k_pages, v_pages, uniform, full, full, **fixed)
        if core.on_gpu():
            gqa_ms = ctx.time(pallas_gqa, q, k_contig, v_contig, **fixed)
            extra |= dict(decode_attention_ms=round(gqa_ms, 4),
                          speedup_vs_decode_attention=round(gqa_ms / ms, 3))
        case = f"B{b}-S{core.kilo(s)}-K{kh}-G{g}-H{h}-P{p}-bf16"
        tbs = kv_bytes / ms / 1e9
        yield core.row(
            kernel="paged_decode", case=case, ms=ms, achieved=tbs, unit="TB/s", ceiling=ceiling,
            anchor="jax pallas paged_attention (deprecated)", anchor_ms=anchor_ms,
            goal="fraction_of_ceiling >= 0.85", meets_goal=tbs / ceiling >= 0.85, **extra)

        # FP8 pages, same grid: >= 1.7x our bf16 time, never slower.
        args8 = (q_pages, qv_pages, uniform, full, full, q_scales, qv_scales)
        out8, _ = ours(q, *args8)
        ms8 = ctx.time(ours, q, *args8, **fixed)
        if g == 4:  # the kv_write rows' anchor
            ctx.memo[g4_key(batch=b, seq=s, kv_heads=kh, head_dim=h, page=p,
                            sub_block=a.sub_block)] = {"bf16": ms, "fp8": ms8}
        yield core.row(
            kernel="paged_decode_fp8", case=case.replace("bf16", f"fp8-sub{a.sub_block}"),
            ms=ms8, achieved=kv_bytes / 2 / ms8 / 1e9, unit="TB/s", ceiling=ceiling,
            anchor="ours bf16", anchor_ms=ms, goal="speedup_vs_anchor >= 1.7",
            meets_goal=ms / ms8 >= 1.7, rel_err_vs_bf16=round(core.rel_err(out8, out), 5))

    # Per-head tables: all heads full vs the uniform table; half the heads streaming.
    g = a.headwise_group
    q = jax.random.normal(jax.random.fold_in(key, 99), (b, kh * g, h), jnp.bfloat16)
    ms_uniform = ctx.time(ours, q, k_pages, v_pages, uniform, full, full, **fixed)
    ms_headwise = ctx.time(ours, q, k_pages, v_pages, per_head, full, full, **fixed)
    case = f"B{b}-S{core.kilo(s)}-K{kh}-G{g}-H{h}-P{p}"
    yield core.row(
        kernel="paged_decode_headwise", case=case + "-all-full", ms=ms_headwise,
        achieved=kv_bytes / ms_headwise / 1e9, unit="TB/s", ceiling=ceiling,
        anchor="ours uniform table", anchor_ms=ms_uniform, goal="ms <= 1.05 x uniform",
        meets_goal=ms_headwise <= 1.05 * ms_uniform)
    window = jnp.where(jnp.arange(kh) < kh // 2, a.window, 0).astype(jnp.int32)
    sinks = jnp.where(jnp.arange(kh) < kh // 2, a.sink, 0).astype(jnp.int32)
    ms_stream = ctx.time(ours, q, k_pages, v_pages, per_head, window, sinks, **fixed)
    read = (kh - kh // 2) * s + (kh // 2) * (a.window + a.sink)
    stream_bytes = 2 * b * read * h * 2
    yield core.row(
        kernel="paged_decode_headwise",
        case=case + f"-half-streaming-sink{a.sink}-win{a.window}", ms=ms_stream,
        achieved=stream_bytes / ms_stream / 1e9, unit="TB/s", ceiling=ceiling,
        anchor="ours per-head all full", anchor_ms=ms_headwise,
        goal="ms <= 0.55 x all-full", meets_goal=ms_stream <= 0.55 * ms_headwise,
        bytes_ratio=round(read / (kh * s), 4))

    # The XLA reference once, as the floor anchor of "no kernel at all".
    if a.xla_reference:
        ref = jax.jit(functools.partial(paged_ref.paged_decode, scale=scale))
        try:
            ms_ref = ctx.time(ref, q, k_pages, v_pages, per_head, lengths, iters=3, trials=3,
                              warmup=1)
        except Exception as e:  # an OOM of the reference is a result too
            log.warning("XLA reference failed: %s", core.first_line(e))
        else:
            yield core.row(
                kernel="paged_decode", case=case + "-xla-reference", ms=ms_ref,
                achieved=kv_bytes / ms_ref / 1e9, unit="TB/s", ceiling=ceiling,
                anchor="ours per-head all full", anchor_ms=ms_headwise, goal="(anchor row)",
                meets_goal=None)


def g4_ms(ctx: core.Context, *, batch: int, seq: int, kv_heads: int, head_dim: int, page: int,
          sub_block: int) -> dict[str, float]:
    """Our paged decode at G4 (full heads, uniform tables) at this shape, bf16 and fp8:
    `{"bf16": ms, "fp8": ms}`, memoised (the `paged_decode` group leaves its own G4 times)."""
    def measure():
        max_pages = -(-seq // page)
        num_pages = batch * max_pages + 1
        key = jax.random.key(5)
        shape = (kv_heads, num_pages, page, head_dim)
        k = jax.random.normal(key, shape, jnp.bfloat16)
        v = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16)
        ids = 1 + np.arange(batch)[:, None] * max_pages + np.arange(max_pages)[None]
        table = jnp.asarray(np.repeat(ids[:, None], kv_heads, axis=1), jnp.int32)
        lengths = jnp.full((batch,), seq, jnp.int32)
        q = jax.random.normal(jax.random.fold_in(key, 2), (batch, kv_heads * 4, head_dim),
                              jnp.bfloat16)
        full = jnp.zeros((kv_heads,), jnp.int32)

        @jax.jit
        def run(q, k, v, table, lengths, ks, vs):
            # The kernel itself, as the `paged_decode` rows: at B64 / S32K / K8 / H128 the pool
            # (with its null page) has 2^31 + 2^20 elements, which the public op refuses for
            # int32 offsets (the kernel addresses pages in int64).
            return paged_triton.paged_decode(q, k, v, table, lengths, scale=head_dim**-0.5,
                                             window=full, sinks=full, k_scales=ks,
                                             v_scales=vs)[0]

        out = {"bf16": ctx.time(run, q, k, v, table, lengths, None, None, budget_s=None)}
        kq, ks = fp8.quantize(k, sub_block)
        vq, vs = fp8.quantize(v, sub_block)
        del k, v
        out["fp8"] = ctx.time(run, q, kq, vq, table, lengths, ks, vs, budget_s=None)
        return out
    return ctx.once(g4_key(batch=batch, seq=seq, kv_heads=kv_heads, head_dim=head_dim, page=page,
                           sub_block=sub_block), measure)
