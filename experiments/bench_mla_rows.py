"""MLA latent paged decode rows for the decode benchmark: our Triton kernel and its anchors.

`mla_rows(bw, rng)` times, in one process, at B64 / S32K / P64 / L512 + R64:

* N16 (memory-bound): bf16 against the copy-bandwidth ceiling (goal >= 0.85; bytes =
  B·S·(L+R)·2), fp8 latent against our bf16 (goal >= 1.5x);
* N128 (about 240 FLOP per latent byte, near the H100's ridge): TFLOP/s with
  FLOPs = 2·B·N·S·(L+R) + 2·B·N·S·L, against a bf16 matmul rate measured here; the row's
  `fraction_of_floor` is `max(bytes / copy, FLOPs / matmul) / ms`.

Anchors, measured in the same function: the XLA reference (`attn.mla.mla_paged_decode`,
`implementation="xla"`, jitted; an OOM is logged and skipped) is the row's anchor. The deprecated
JAX Pallas `decode_attention.mqa` cannot run this computation: it takes one head dim for q, k and v
(it reshapes v with q's), so not `Lv = L != Lk = L + R`, and its Triton lowering refuses loads
whose size is not a power of two, so not a 576-wide key even with `v = k` (it raises
"requires that all operations have array arguments and results whose size is a power of 2").
It is timed instead on a proxy of nearly the same bytes, contiguous `c_kv` only (`L = 512`, no
rope part; k = v = `[B, S, L]`), reported as `pallas_mqa_proxy_ms`: a reference point, not an
anchor of the same work.

    python -m experiments.bench_mla_rows            # rows only, writes benchmarks/mla.{json,md}
    python -m experiments.bench_mla_rows --sweep    # time launch configs of our kernel
"""

from __future__ import annotations

import argparse
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.mla import api as mla_api
from attn.mla import triton as mla_triton
from experiments import _bench
from kv import fp8

log = logging.getLogger("bench_mla")

SHAPE = dict(batch=64, seq=32768, page=64, kv_lora_rank=512, rope_dim=64)
SCALE = 192**-0.5  # DeepSeek-V3: (qk_nope + qk_rope) ** -0.5, mscale 1


def _latent(rng, *, batch, seq, page, kv_lora_rank, rope_dim, sub_block=16):
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


def _queries(n, *, batch, kv_lora_rank, rope_dim, seed):
    key = jax.random.fold_in(jax.random.key(1), seed)
    q_lat = jax.random.normal(key, (batch, n, kv_lora_rank), jnp.bfloat16)
    q_pe = jax.random.normal(jax.random.fold_in(key, 1), (batch, n, rope_dim), jnp.bfloat16)
    return q_lat, q_pe


def _matmul_tflops(size: int = 8192) -> float:
    """bf16 matmul rate through XLA, the compute ceiling of the N128 rows."""
    a = jax.random.normal(jax.random.key(2), (size, size), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(3), (size, size), jnp.bfloat16)
    ms = _bench.time_ms(jax.jit(jnp.matmul), a, b)
    return 2 * size**3 / ms / 1e9


def _ours(config: mla_triton.Config | None, kv_lora_rank: int):
    @jax.jit
    def run(q_lat, q_pe, pages, table, lengths, scales):
        # Every array is an argument: a closed-over array would be baked into the program.
        return mla_triton.mla_paged_decode(q_lat, q_pe, pages, table, lengths,
                                           kv_lora_rank=kv_lora_rank, scale=SCALE,
                                           latent_scales=scales, config=config)
    return run


def _xla_ms(q_lat, q_pe, pages, table, lengths, kv_lora_rank):
    """XLA reference time and output, or (None, None) if it fails (e.g. out of memory)."""
    ref = jax.jit(functools.partial(mla_api.mla_paged_decode, kv_lora_rank=kv_lora_rank,
                                    scale=SCALE, implementation="xla"))
    try:
        out, _ = ref(q_lat, q_pe, pages, table, lengths)
        return _bench.time_ms(ref, q_lat, q_pe, pages, table, lengths, iters=3, trials=3,
                              warmup=1), out
    except Exception as e:  # an OOM of the reference is a result too
        log.warning("XLA reference failed: %s", str(e).splitlines()[0])
        return None, None


def _pallas_proxy_ms(q_lat, c_kv):
    """Deprecated Pallas `mqa` on contiguous `c_kv` only (the power-of-two proxy, see above),
    best of a few token tiles; None if no tile size runs.
    """
    from jax.experimental.pallas.ops.gpu import decode_attention

    best = None
    for block_k in (32, 64, 128):
        fn = jax.jit(functools.partial(decode_attention.mqa, sm_scale=SCALE, block_h=16,
                                       block_k=block_k, k_splits=16))
        try:
            ms = _bench.time_ms(fn, q_lat, c_kv, c_kv)
        except Exception as e:
            log.warning("pallas mqa, block_k=%d: %s", block_k, str(e).splitlines()[0][:200])
            continue
        best = ms if best is None else min(best, ms)
    return best


def mla_rows(bw: dict, rng, *, shape: dict | None = None, heads=(16, 128),
             anchors: bool = True) -> list[dict]:
    """PERF.md rows for MLA decode; `bw` is `_bench.copy_bandwidth_tbs()` of this process."""
    sh = dict(SHAPE, **(shape or {}))
    b, s, p, l, r = sh["batch"], sh["seq"], sh["page"], sh["kv_lora_rank"], sh["rope_dim"]
    pages, q8, scales, table, lengths = _latent(rng, batch=b, seq=s, page=p, kv_lora_rank=l,
                                                rope_dim=r)
    c_kv = jax.random.normal(jax.random.key(4), (b, s, l), jnp.bfloat16) if anchors else None
    ceiling = bw["ceiling"]
    matmul = _matmul_tflops()
    log.info("bf16 matmul: %.1f TFLOP/s", matmul)
    bytes16 = b * s * (l + r) * 2
    bytes8 = b * s * (l + r) + scales.size // scales.shape[0] * b * (s // p) * 4
    rows = []
    for n in heads:
        q_lat, q_pe = _queries(n, batch=b, kv_lora_rank=l, rope_dim=r, seed=n)
        ours = _ours(None, l)
        out, _ = ours(q_lat, q_pe, pages, table, lengths, None)
        ms = _bench.time_ms(ours, q_lat, q_pe, pages, table, lengths, None)
        out8, _ = ours(q_lat, q_pe, q8, table, lengths, scales)
        ms8 = _bench.time_ms(ours, q_lat, q_pe, q8, table, lengths, scales)
        xla_ms, xla_out = (_xla_ms(q_lat, q_pe, pages, table, lengths, l) if anchors
                           else (None, None))
        pallas_ms = _pallas_proxy_ms(q_lat, c_kv) if anchors else None
        anchor, anchor_ms = "xla reference", xla_ms
        extra = dict(xla_ms=None if xla_ms is None else round(xla_ms, 4),
                     speedup_vs_xla=None if xla_ms is None else round(xla_ms / ms, 3),
                     pallas_mqa_proxy_ms=None if pallas_ms is None else round(pallas_ms, 4),
                     pallas_mqa_proxy="jax pallas decode_attention.mqa (deprecated), contiguous "
                                      f"c_kv only: H={l}, no rope (L+R={l + r} unsupported)")
        if xla_out is not None:
            extra["rel_err_vs_xla"] = round(_bench.rel_err(out, xla_out), 5)
        case = f"B{b}-S{s // 1024}K-N{n}-L{l}-R{r}-P{p}"
        flops = 2 * b * n * s * (l + r) + 2 * b * n * s * l
        floor16 = max(bytes16 / ceiling / 1e9, flops / matmul / 1e9)
        floor8 = max(bytes8 / ceiling / 1e9, flops / matmul / 1e9)
        if n == 16:
            tbs = bytes16 / ms / 1e9
            rows.append(_bench.row(
                kernel="mla_decode", case=case + "-bf16", ms=ms, achieved=tbs, unit="TB/s",
                ceiling=ceiling, anchor=anchor, anchor_ms=anchor_ms,
                goal="fraction_of_ceiling >= 0.85", meets_goal=tbs / ceiling >= 0.85,
                tflops=round(flops / ms / 1e9, 2), **extra))
            rows.append(_bench.row(
                kernel="mla_decode_fp8", case=case + "-fp8-sub16", ms=ms8,
                achieved=bytes8 / ms8 / 1e9, unit="TB/s", ceiling=ceiling, anchor="ours bf16",
                anchor_ms=ms, goal="speedup_vs_anchor >= 1.5", meets_goal=ms / ms8 >= 1.5,
                rel_err_vs_bf16=round(_bench.rel_err(out8, out), 5)))
        else:
            tf = flops / ms / 1e9
            rows.append(_bench.row(
                kernel="mla_decode", case=case + "-bf16", ms=ms, achieved=tf, unit="TFLOP/s",
                ceiling=matmul, anchor=anchor, anchor_ms=anchor_ms,
                goal="report (compute-bound: FLOPs / matmul rate >= bytes / copy)",
                meets_goal=None, fraction_of_floor=round(floor16 / ms, 4),
                tbs=round(bytes16 / ms / 1e9, 3), **extra))
            rows.append(_bench.row(
                kernel="mla_decode_fp8", case=case + "-fp8-sub16", ms=ms8,
                achieved=flops / ms8 / 1e9, unit="TFLOP/s", ceiling=matmul, anchor="ours bf16",
                anchor_ms=ms, goal="report", meets_goal=None,
                fraction_of_floor=round(floor8 / ms8, 4),
                rel_err_vs_bf16=round(_bench.rel_err(out8, out), 5)))
    return rows


def sweep(rng, configs, *, heads=(16, 128), shape: dict | None = None) -> None:
    """Time launch configs `(block_n, block_heads, warps, stages, splits[, reload_value])`.

    Splits 0 and a missing reload_value take `default_config`'s.
    """
    sh = dict(SHAPE, **(shape or {}))
    b, s, p, l, r = sh["batch"], sh["seq"], sh["page"], sh["kv_lora_rank"], sh["rope_dim"]
    pages, q8, scales, table, lengths = _latent(rng, batch=b, seq=s, page=p, kv_lora_rank=l,
                                                rope_dim=r)
    for n in heads:
        q_lat, q_pe = _queries(n, batch=b, kv_lora_rank=l, rope_dim=r, seed=n)
        flops = 2 * b * n * s * (2 * l + r)
        for name, pg, sc in (("bf16", pages, None), ("fp8", q8, scales)):
            for bn, bh, warps, stages, splits, *reload in configs:
                default = mla_triton.default_config(b, n, s, fp8=sc is not None)
                cfg = mla_triton.Config(block_n=bn, block_heads=bh, num_warps=warps,
                                        num_stages=stages,
                                        num_splits=splits or default.num_splits,
                                        reload_value=bool(reload[0]) if reload
                                        else default.reload_value)
                try:
                    ms = _bench.time_ms(_ours(cfg, l), q_lat, q_pe, pg, table, lengths, sc)
                except Exception as e:
                    print(f"N{n} {name} {cfg}: {str(e).splitlines()[0][:100]}", flush=True)
                    continue
                read = b * s * (l + r) * (1 if sc is not None else 2)
                print(f"N{n:<4} {name:5} n{bn:<3} h{bh:<3} w{warps} s{stages} "
                      f"j{cfg.num_splits:<3} {ms:7.4f} ms {read / ms / 1e9:6.3f} TB/s "
                      f"{flops / ms / 1e9:6.1f} TFLOP/s", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time launch configs, write nothing")
    parser.add_argument("--configs", default="32-16-4-2-0,32-16-4-2-8-1,64-64-8-2-0,64-64-8-2-1",
                        type=lambda s: [tuple(int(x) for x in c.split("-")) for c in s.split(",")],
                        help="block_n-block_heads-warps-stages-splits[-reload] (splits 0: default)")
    parser.add_argument("--heads", default="16,128",
                        type=lambda s: tuple(int(x) for x in s.split(",")))
    parser.add_argument("--no-anchors", action="store_true")
    parser.add_argument("--out", default="benchmarks")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    rng = np.random.default_rng(0)
    if args.sweep:
        return sweep(rng, args.configs, heads=args.heads)
    bw = _bench.copy_bandwidth_tbs()
    log.info("copy bandwidth: %s", bw)
    rows = mla_rows(bw, rng, heads=args.heads, anchors=not args.no_anchors)
    md = _bench.write("mla", rows, extra={"copy_bandwidth_tbs": bw}, out_dir=args.out)
    _bench.print_table(rows)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
