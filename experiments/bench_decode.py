"""Decode kernels against their anchors and the copy-bandwidth ceiling, in one process.

    python -m experiments.bench_decode            # the PERF.md shapes (needs a GPU)
    python -m experiments.bench_decode --quick    # small shapes, a smoke run

Writes `benchmarks/decode.json` and `benchmarks/decode.md`. Rows: `paged_decode` (bf16, every
group size, uniform tables) against the deprecated JAX Pallas `paged_attention` and
`decode_attention`; `paged_decode_headwise` (per-head tables, all full and half streaming) against
our own uniform-table time; `paged_decode_fp8` against our bf16 time; the XLA reference once;
`mla_decode` (experiments/bench_mla_rows.py) and `gdn_decode` / `causal_conv1d_update`
(experiments/bench_gdn_rows.py) with their anchors; `kv_write` (experiments/bench_kv_write_rows.py)
and `engine_decode` (experiments/bench_engine_rows.py; `--engine-batch`, `--engine-seq`).
"""

from __future__ import annotations

import argparse
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.paged_decode import reference as paged_ref
from attn.paged_decode import triton as paged_triton
from experiments import _bench
from kv import fp8

log = logging.getLogger("bench_decode")


def _tables(rng, batch, kv_heads, max_pages, num_pages, per_head):
    """Random page ids (never the null page 0); identical rows per head unless `per_head`."""
    def one():
        return rng.permutation(num_pages - 1)[: batch * max_pages].reshape(batch, max_pages) + 1
    if per_head:
        t = np.stack([one() for _ in range(kv_heads)], axis=1)
    else:
        t = np.repeat(one()[:, None], kv_heads, axis=1)
    return jnp.asarray(t, jnp.int32)


def paged_rows(args, bw, rng) -> list[dict]:
    b, s, kh, h, p = args.batch, args.seq, args.kv_heads, args.head_dim, args.page
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
    ceiling = bw["ceiling"]
    rows = []

    @jax.jit
    def ours(q, kp, vp, table, window, sinks, ks=None, vs=None):
        # Every array is an argument: a closed-over array would be baked into the program.
        cfg = paged_triton.default_config(b, kh, s, fp8=ks is not None)
        return paged_triton.paged_decode(q, kp, vp, table, lengths, scale=scale, window=window,
                                         sinks=sinks, k_scales=ks, v_scales=vs, config=cfg)

    from jax.experimental.pallas.ops.gpu import decode_attention, paged_attention

    def best_pallas_paged(q):
        """The anchor at its best of a few tile sizes (some exceed shared memory)."""
        best = (float("inf"), None)
        for tokens in (128, 256):
            fn = jax.jit(functools.partial(paged_attention.paged_attention, block_h=16,
                                           pages_per_compute_block=max(1, tokens // p)))
            try:
                best = min(best, (_bench.time_ms(fn, q, k_pages, v_pages, uniform[:, 0],
                                                 lengths), tokens), key=lambda x: x[0])
            except Exception as e:
                log.warning("pallas paged_attention, %d-token blocks: %s", tokens,
                            str(e).splitlines()[0])
        return best

    pallas_gqa = jax.jit(functools.partial(decode_attention.gqa, sm_scale=1.0))
    k_contig = jax.random.normal(jax.random.fold_in(key, 2), (b, s, kh, h), jnp.bfloat16)
    v_contig = jax.random.normal(jax.random.fold_in(key, 3), (b, s, kh, h), jnp.bfloat16)

    q_pages, q_scales = fp8.quantize(k_pages, args.sub_block)
    qv_pages, qv_scales = fp8.quantize(v_pages, args.sub_block)

    for g in tqdm(args.groups, desc="paged decode, group sizes"):
        n = kh * g
        q = jax.random.normal(jax.random.fold_in(key, 10 + g), (b, n, h), jnp.bfloat16)
        out, _ = ours(q, k_pages, v_pages, uniform, full, full)
        anchor_ms, anchor_tokens = best_pallas_paged(q)
        anchor_fn = functools.partial(paged_attention.paged_attention, block_h=16,
                                      pages_per_compute_block=max(1, (anchor_tokens or 128) // p))
        err = _bench.rel_err(out, jax.jit(anchor_fn)(q * scale, k_pages, v_pages, uniform[:, 0],
                                                lengths))
        ms = _bench.time_ms(ours, q, k_pages, v_pages, uniform, full, full)
        gqa_ms = _bench.time_ms(pallas_gqa, q, k_contig, v_contig)
        case = f"B{b}-S{s // 1024}K-K{kh}-G{g}-H{h}-P{p}-bf16"
        tbs = kv_bytes / ms / 1e9
        rows.append(_bench.row(
            kernel="paged_decode", case=case, ms=ms, achieved=tbs, unit="TB/s", ceiling=ceiling,
            anchor="jax pallas paged_attention (deprecated)", anchor_ms=anchor_ms,
            goal="fraction_of_ceiling >= 0.85", meets_goal=tbs / ceiling >= 0.85,
            rel_err_vs_anchor=round(err, 5), decode_attention_ms=round(gqa_ms, 4),
            speedup_vs_decode_attention=round(gqa_ms / ms, 3)))

        # FP8 pages, same grid: >= 1.7x our bf16 time, never slower.
        args8 = (q_pages, qv_pages, uniform, full, full, q_scales, qv_scales)
        out8, _ = ours(q, *args8)
        ms8 = _bench.time_ms(ours, q, *args8)
        rows.append(_bench.row(
            kernel="paged_decode_fp8", case=case.replace("bf16", f"fp8-sub{args.sub_block}"),
            ms=ms8, achieved=kv_bytes / 2 / ms8 / 1e9, unit="TB/s", ceiling=ceiling,
            anchor="ours bf16", anchor_ms=ms, goal="speedup_vs_anchor >= 1.7",
            meets_goal=ms / ms8 >= 1.7, rel_err_vs_bf16=round(_bench.rel_err(out8, out), 5)))

    # Per-head tables: all heads full vs the uniform table; half the heads streaming.
    g = args.headwise_group
    q = jax.random.normal(jax.random.fold_in(key, 99), (b, kh * g, h), jnp.bfloat16)
    ms_uniform = _bench.time_ms(ours, q, k_pages, v_pages, uniform, full, full)
    ms_headwise = _bench.time_ms(ours, q, k_pages, v_pages, per_head, full, full)
    case = f"B{b}-S{s // 1024}K-K{kh}-G{g}-H{h}-P{p}"
    rows.append(_bench.row(
        kernel="paged_decode_headwise", case=case + "-all-full", ms=ms_headwise,
        achieved=kv_bytes / ms_headwise / 1e9, unit="TB/s", ceiling=ceiling,
        anchor="ours uniform table", anchor_ms=ms_uniform, goal="ms <= 1.05 x uniform",
        meets_goal=ms_headwise <= 1.05 * ms_uniform))
    window = jnp.where(jnp.arange(kh) < kh // 2, args.window, 0).astype(jnp.int32)
    sinks = jnp.where(jnp.arange(kh) < kh // 2, args.sink, 0).astype(jnp.int32)
    ms_stream = _bench.time_ms(ours, q, k_pages, v_pages, per_head, window, sinks)
    read = (kh - kh // 2) * s + (kh // 2) * (args.window + args.sink)
    stream_bytes = 2 * b * read * h * 2
    rows.append(_bench.row(
        kernel="paged_decode_headwise",
        case=case + f"-half-streaming-sink{args.sink}-win{args.window}", ms=ms_stream,
        achieved=stream_bytes / ms_stream / 1e9, unit="TB/s", ceiling=ceiling,
        anchor="ours per-head all full", anchor_ms=ms_headwise,
        goal="ms <= 0.55 x all-full", meets_goal=ms_stream <= 0.55 * ms_headwise,
        bytes_ratio=round(read / (kh * s), 4)))

    # The XLA reference once, as the floor anchor of "no kernel at all".
    if not args.skip_xla:
        ref = jax.jit(functools.partial(paged_ref.paged_decode, scale=scale))
        try:
            ms_ref = _bench.time_ms(ref, q, k_pages, v_pages, per_head, lengths, iters=3,
                                    trials=3, warmup=1)
            rows.append(_bench.row(
                kernel="paged_decode", case=case + "-xla-reference", ms=ms_ref,
                achieved=kv_bytes / ms_ref / 1e9, unit="TB/s", ceiling=ceiling,
                anchor="ours per-head all full", anchor_ms=ms_headwise, goal="(anchor row)",
                meets_goal=None))
        except Exception as e:  # an OOM of the reference is a result too
            log.warning("XLA reference failed: %s", str(e).splitlines()[0])
    return rows


def sweep(args, rng) -> None:
    """Time a few launch configurations of our kernel (bf16 and fp8) and print them."""
    b, s, kh, h, p = args.batch, args.seq, args.kv_heads, args.head_dim, args.page
    max_pages, num_pages = s // p, b * (s // p) + 1
    key = jax.random.key(0)
    k_pages = jax.random.normal(key, (kh, num_pages, p, h), jnp.bfloat16)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), (kh, num_pages, p, h), jnp.bfloat16)
    kq, ks = fp8.quantize(k_pages, args.sub_block)
    vq, vs = fp8.quantize(v_pages, args.sub_block)
    table = _tables(rng, b, kh, max_pages, num_pages, per_head=True)
    lengths = jnp.full((b,), s, jnp.int32)
    full = jnp.zeros((kh,), jnp.int32)
    kv_bytes = 2 * b * s * kh * h * 2
    for g in args.groups:
        q = jax.random.normal(jax.random.fold_in(key, g), (b, kh * g, h), jnp.bfloat16)
        for fp, (kp, vp, kss, vss) in (("bf16", (k_pages, v_pages, None, None)),
                                       ("fp8", (kq, vq, ks, vs))):
            default = paged_triton.default_config(b, kh, s, fp8=kss is not None)
            for bn, warps, stages, splits, *tiles in args.configs:
                cfg = paged_triton.Config(block_n=bn, num_warps=warps, num_stages=stages,
                                          num_splits=splits or default.num_splits,
                                          page_tiles=bool(tiles[0]) if tiles else True)
                fn = jax.jit(functools.partial(paged_triton.paged_decode, scale=h**-0.5,
                                               window=full, sinks=full, config=cfg))
                try:
                    ms = _bench.time_ms(lambda q, kp, vp, kss, vss, fn=fn: fn(
                        q, kp, vp, table, lengths, k_scales=kss, v_scales=vss),
                        q, kp, vp, kss, vss)
                except Exception as e:
                    print(f"G{g} {fp} {cfg}: {str(e).splitlines()[0][:80]}")
                    continue
                read = kv_bytes / (2 if fp == "fp8" else 1)
                print(f"G{g:<3} {fp:5} n{bn:<4} w{warps} s{stages} j{cfg.num_splits} "
                      f"{'tiles' if cfg.page_tiles else 'gather'} {ms:7.4f} ms "
                      f"{read / ms / 1e9:6.3f} TB/s")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32768)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--groups", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 2, 4, 5, 7, 8, 16])
    parser.add_argument("--headwise-group", type=int, default=4)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--sink", type=int, default=128)
    parser.add_argument("--sub-block", type=int, default=16)
    parser.add_argument("--skip-xla", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    parser.add_argument("--sweep", action="store_true", help="time launch configs, write nothing")
    parser.add_argument("--configs", default="64-4-2-2,128-4-2-2,128-4-3-2,128-4-2-4",
                        type=lambda s: [tuple(int(x) for x in c.split("-")) for c in s.split(",")],
                        help="sweep configs block_n-warps-stages-splits[-page_tiles], comma "
                        "separated (splits 0: default_config's)")
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--engine-batch", type=int, default=64, help="engine rows: batch rows")
    parser.add_argument("--engine-seq", type=int, default=8192,
                        help="engine rows: cached tokens per row (decode token included)")
    parser.add_argument("--only", default="paged,mla,gdn,kv_write",
                        type=lambda s: set(s.split(",")),
                        help="row groups to run (engine: not by default, ~60 GB of KV)")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.seq, args.groups = 4, 4096, [1, 4, 7]
    logging.basicConfig(level=logging.INFO)
    rng = np.random.default_rng(0)
    if args.sweep:
        return sweep(args, rng)
    bw = _bench.copy_bandwidth_tbs(64 << 20 if args.quick else 4 << 30)
    log.info("copy bandwidth: %s", bw)
    rows = []
    if "paged" in args.only:
        rows += paged_rows(args, bw, rng)
    if "mla" in args.only:
        from experiments.bench_mla_rows import mla_rows

        rows += mla_rows(bw, rng)
    if "gdn" in args.only:
        from experiments.bench_gdn_rows import gdn_rows

        rows += gdn_rows(bw)
    if "kv_write" in args.only:
        from experiments.bench_kv_write_rows import kv_write_rows

        g4 = {("fp8" if r["kernel"] == "paged_decode_fp8" else "bf16"): r["ms"] for r in rows
              if r["kernel"] in ("paged_decode", "paged_decode_fp8") and "-G4-" in r["case"]
              and "xla" not in r["case"]}
        shape = dict(batch=args.batch, kv_heads=args.kv_heads, head_dim=args.head_dim,
                     page=args.page, seq=args.seq, sub_block=args.sub_block)
        if args.quick:
            shape.update(batch=2, seq=256, page=16)
        if "bf16" not in g4:  # the paged rows did not run: measure the anchor here
            from experiments.bench_engine_rows import paged_decode_ms

            g4 = paged_decode_ms(**shape)
        rows += kv_write_rows(bw, **shape, chunk=min(2048, shape["seq"] // 2), decode_ms=g4)
    if "engine" in args.only:
        from experiments.bench_engine_rows import engine_rows

        eb, es, ep = ((2, 256, 16) if args.quick
                      else (args.engine_batch, args.engine_seq, args.page))
        rows += engine_rows(bw, batch=eb, seq=es, page=ep, quick=args.quick,
                            skip_xla=args.skip_xla)
    md = _bench.write("decode", rows, extra={"copy_bandwidth_tbs": bw}, out_dir=args.out)
    _bench.print_table(rows)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
