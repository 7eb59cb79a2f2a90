"""MLA latent paged decode rows (`mla_decode`): our Triton kernel and its anchors, at B64 / S32K /
P64 / L512 + R64.

- N16 (memory-bound): bf16 against the copy-bandwidth ceiling (goal >= 0.85; bytes =
  B·S·(L+R)·2), fp8 latent against our bf16 (goal >= 1.5x);
- N128 (about 240 FLOP per latent byte, near the H100's ridge): TFLOP/s with
  FLOPs = 2·B·N·S·(L+R) + 2·B·N·S·L against the bf16 matmul rate; the row's
  `fraction_of_floor` is `max(bytes / copy, FLOPs / matmul) / ms`.

Anchor: the XLA reference (`attn.mla.mla_paged_decode(implementation="xla")`, jitted; an OOM is
logged and skipped). The deprecated JAX Pallas `decode_attention.mqa` cannot run this
computation: it takes one head dim for q, k and v (it reshapes v with q's), so not
`Lv = L != Lk = L + R`, and its Triton lowering refuses loads whose size is not a power of two,
so not a 576-wide key even with `v = k`. It is timed instead on a proxy of nearly the same bytes,
contiguous `c_kv` only (`L = 512`, no rope part; k = v = `[B, S, L]`), reported as
`pallas_mqa_proxy_ms`: a reference point, not an anchor of the same work.
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
from attn.mla import api as mla_api
from attn.mla import triton as mla_triton
from experiments.bench import core
from experiments.bench.registry import register
from kv import fp8

log = logging.getLogger("bench.mla")

SCALE = 192**-0.5  # DeepSeek-V3: (qk_nope + qk_rope) ** -0.5, mscale 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLADecodeArgs:
    """B64, S32K, pages of 64, latent 512 + rope 64; N16 and N128 (PERF.md)."""

    batch: int = 64
    seq: int = 32768
    page: int = 64
    kv_lora_rank: int = 512
    rope_dim: int = 64
    heads: tuple[int, ...] = (16, 128)
    sub_block: int = 16
    anchors: bool = True
    QUICK: ClassVar[dict] = dict(batch=2, seq=256, page=16, kv_lora_rank=64, rope_dim=16,
                                 heads=(16,))


def latent(rng, *, batch, seq, page, kv_lora_rank, rope_dim, sub_block=16):
    """bf16 pages `[num_pages, P, L+R]`, their fp8 copy + scales, random per-row tables."""
    max_pages = seq // page
    num_pages = batch * max_pages + 1
    key = jax.random.key(0)
    pages = jax.random.normal(key, (num_pages, page, kv_lora_rank + rope_dim), jnp.bfloat16)
    q8, scales = fp8.quantize(pages, sub_block)
    ids = rng.permutation(num_pages - 1)[: batch * max_pages].reshape(batch, max_pages) + 1
    table = jnp.asarray(ids, jnp.int32)
    lengths = jnp.full((batch,), seq, jnp.int32)
    return pages, q8, scales, table, lengths


def queries(n, *, batch, kv_lora_rank, rope_dim, seed):
    """bf16 `q_lat [B, N, L]`, `q_pe [B, N, R]`."""
    key = jax.random.fold_in(jax.random.key(1), seed)
    q_lat = jax.random.normal(key, (batch, n, kv_lora_rank), jnp.bfloat16)
    q_pe = jax.random.normal(jax.random.fold_in(key, 1), (batch, n, rope_dim), jnp.bfloat16)
    return q_lat, q_pe


def ours(config: mla_triton.Config | None, kv_lora_rank: int):
    """Our kernel, jitted, under `config` (None: its default)."""
    @jax.jit
    def run(q_lat, q_pe, pages, table, lengths, scales):
        # Every array is an argument: a closed-over array would be baked into the program.
        return mla_triton.mla_paged_decode(q_lat, q_pe, pages, table, lengths,
                                           kv_lora_rank=kv_lora_rank, scale=SCALE,
                                           latent_scales=scales, config=config)
    return run


def _xla_ms(ctx, q_lat, q_pe, pages, table, lengths, kv_lora_rank):
    """XLA reference time and output, or (None, None) if it fails (e.g. out of memory)."""
    ref = jax.jit(functools.partial(mla_api.mla_paged_decode, kv_lora_rank=kv_lora_rank,
                                    scale=SCALE, implementation="xla"))
    try:
        out, _ = ref(q_lat, q_pe, pages, table, lengths)
        return ctx.time(ref, q_lat, q_pe, pages, table, lengths, iters=3, trials=3,
                        warmup=1), out
    except Exception as e:  # an OOM of the reference is a result too
        log.warning("XLA reference failed: %s", core.first_line(e))
        return None, None


def _pallas_proxy_ms(ctx, q_lat, c_kv):
    """Deprecated Pallas `mqa` on contiguous `c_kv` only (the power-of-two proxy, see above),
    best of a few token tiles; None if no tile size runs (or no GPU)."""
    if not core.on_gpu():
        log.warning("Pallas mqa proxy skipped: no GPU")
        return None
    from jax.experimental.pallas.ops.gpu import decode_attention

    best = None
    for block_k in (32, 64, 128):
        fn = jax.jit(functools.partial(decode_attention.mqa, sm_scale=SCALE, block_h=16,
                                       block_k=block_k, k_splits=16))
        try:
            ms = ctx.time(fn, q_lat, c_kv, c_kv, budget_s=None)
        except Exception as e:
            log.warning("pallas mqa, block_k=%d: %s", block_k, core.first_line(e))
            continue
        best = ms if best is None else min(best, ms)
    return best


@register("mla_decode", MLADecodeArgs)
def mla_rows(a: MLADecodeArgs, ctx: core.Context):
    """MLA decode bf16 / fp8 latent at N16 (memory-bound) and N128 (compute-bound)."""
    rng = np.random.default_rng(0)
    b, s, p, l, r = a.batch, a.seq, a.page, a.kv_lora_rank, a.rope_dim
    pages, q8, scales, table, lengths = latent(rng, batch=b, seq=s, page=p, kv_lora_rank=l,
                                               rope_dim=r, sub_block=a.sub_block)
    c_kv = jax.random.normal(jax.random.key(4), (b, s, l), jnp.bfloat16) if a.anchors else None
    ceiling = ctx.copy_tbs["ceiling"]
    matmul = ctx.matmul_tflops
    bytes16 = b * s * (l + r) * 2
    bytes8 = b * s * (l + r) + scales.size // scales.shape[0] * b * (s // p) * 4
    fixed = dict(budget_s=None)
    for n in a.heads:
        q_lat, q_pe = queries(n, batch=b, kv_lora_rank=l, rope_dim=r, seed=n)
        run = ours(None, l)
        out, _ = run(q_lat, q_pe, pages, table, lengths, None)
        ms = ctx.time(run, q_lat, q_pe, pages, table, lengths, None, **fixed)
        out8, _ = run(q_lat, q_pe, q8, table, lengths, scales)
        ms8 = ctx.time(run, q_lat, q_pe, q8, table, lengths, scales, **fixed)
        xla_ms, xla_out = (_xla_ms(ctx, q_lat, q_pe, pages, table, lengths, l) if a.anchors
                           else (None, None))
        pallas_ms = _pallas_proxy_ms(ctx, q_lat, c_kv) if a.anchors else None
        extra = dict(xla_ms=None if xla_ms is None else round(xla_ms, 4),
                     speedup_vs_xla=None if xla_ms is None else round(xla_ms / ms, 3),
                     pallas_mqa_proxy_ms=None if pallas_ms is None else round(pallas_ms, 4),
                     pallas_mqa_proxy="jax pallas decode_attention.mqa (deprecated), contiguous "
                                      f"c_kv only: H={l}, no rope (L+R={l + r} unsupported)")
        if xla_out is not None:
            extra["rel_err_vs_xla"] = round(core.rel_err(out, xla_out), 5)
        case = f"B{b}-S{core.kilo(s)}-N{n}-L{l}-R{r}-P{p}"
        flops = 2 * b * n * s * (l + r) + 2 * b * n * s * l
        floor16 = max(bytes16 / ceiling / 1e9, flops / matmul / 1e9)
        floor8 = max(bytes8 / ceiling / 1e9, flops / matmul / 1e9)
        fp8_case = case + f"-fp8-sub{a.sub_block}"
        if n == 16:
            tbs = bytes16 / ms / 1e9
            yield core.row(
                kernel="mla_decode", case=case + "-bf16", ms=ms, achieved=tbs, unit="TB/s",
                ceiling=ceiling, anchor="xla reference", anchor_ms=xla_ms,
                goal="fraction_of_ceiling >= 0.85", meets_goal=tbs / ceiling >= 0.85,
                tflops=round(flops / ms / 1e9, 2), **extra)
            yield core.row(
                kernel="mla_decode_fp8", case=fp8_case, ms=ms8,
                achieved=bytes8 / ms8 / 1e9, unit="TB/s", ceiling=ceiling, anchor="ours bf16",
                anchor_ms=ms, goal="speedup_vs_anchor >= 1.5", meets_goal=ms / ms8 >= 1.5,
                rel_err_vs_bf16=round(core.rel_err(out8, out), 5))
        else:
            yield core.row(
                kernel="mla_decode", case=case + "-bf16", ms=ms, achieved=flops / ms / 1e9,
                unit="TFLOP/s", ceiling=matmul, anchor="xla reference", anchor_ms=xla_ms,
                goal="report (compute-bound: FLOPs / matmul rate >= bytes / copy)",
                meets_goal=None, fraction_of_floor=round(floor16 / ms, 4),
                tbs=round(bytes16 / ms / 1e9, 3), **extra)
            yield core.row(
                kernel="mla_decode_fp8", case=fp8_case, ms=ms8,
                achieved=flops / ms8 / 1e9, unit="TFLOP/s", ceiling=matmul, anchor="ours bf16",
                anchor_ms=ms, goal="report", meets_goal=None,
                fraction_of_floor=round(floor8 / ms8, 4),
                rel_err_vs_bf16=round(core.rel_err(out8, out), 5))
