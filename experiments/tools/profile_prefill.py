"""Launch-config sweeps of the paged prefill, block-sparse prefill and XAttention estimate kernels
(GPU), each against its anchor from the same process. Prints tables; writes nothing.

    python -m experiments.sweep_prefill_kernels paged  [--configs 128-64-8-3,128-64-8-3-ws,...]
    python -m experiments.sweep_prefill_kernels sparse [--configs ...]
    python -m experiments.sweep_prefill_kernels xattn
    python -m experiments.sweep_prefill_kernels conv1d [--configs 8-512-4-1-rows-split-fast-cf,...]

A config is `block_m-block_n-warps-stages`, `-ws` appended for a warp-specialised unmasked loop
(block-sparse also `-hf`: programs heads fastest).
- paged: a 2K chunk over 8K and 32K prefixes, N32/K8/H128 bf16, pages of 64; anchor: our dense
  flash on a gathered copy (the `paged_prefill` row of `experiments.bench_prefill`).
- sparse: N32/K8/H128 bf16, blocks of 128, S64K at density 0.1 and 1.0 and S128K at 0.1; anchor:
  our dense flash (the goal: <= 1.15 x density x dense).
- xattn: the estimate at S64K and S128K (stride 16), bf16 and `Config(fp8=True)` variants.
- conv1d: causal conv1d prefill, B1 T32K, C = 8192, W4, bf16, SiLU, an initial state, against
  the copy bandwidth; a config is `block_t-block_c-warps[-stream_store][-rows[-split]][-fast]
  [-cf]` (every flag spelled out: a missing one is off, whatever `Config()`'s default), `-rows`
  for the row-walking kernel (`Config(rows=True)`; the others are the tile kernel), `-split` for
  its select-free path for blocks without a sequence start (`rows_split=True`), `-fast` for the
  tanh SiLU (`fast_silu=True`), `-cf` for programs channel blocks fastest
  (`channels_fastest=True`); `copy-T-C-warps[-cf]`: the row kernel's loads and stores alone at
  that tile (`y = x`), its data-movement bound. Default list: the measured candidates around the
  default (`8-512-4-1-rows-split-fast-cf`).
`--quick`: tiny shapes through the interpreter (for CI).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn._harness import triton_call
from attn.block_sparse import reference as sparse_ref
from attn.block_sparse import triton as sparse_triton
from attn.conv1d import triton_prefill as conv_triton
from attn.dense import triton as dense_triton
from attn.dense import triton_paged
from attn.paged_decode.reference import gather_pages
from attn.xattention import reference as xattn_ref
from attn.xattention import triton as xattn_triton
from experiments import _bench
from experiments.bench_sparse_prefill import _paged_problem, _sparse_mask

triton, tl = conv_triton.triton, conv_triton.tl  # imported after `attn` (interpreter set-up)
N, KH, H = 32, 8, 128


# Config suffixes: `-ws` warp-specialised unmasked loop; block-sparse only: `-hf` programs heads
# fastest (`kv_head_major=False`).
_FLAGS = {"ws": ("warp_specialize", True), "hf": ("kv_head_major", False)}


def _parse(text: str, cls):
    parts = text.split("-")
    bm, bn, warps, stages = (int(x) for x in parts[:4])
    flags = dict(_FLAGS[f] for f in parts[4:])
    return cls(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages, **flags)


def _time(fn, *args, quick):
    return _bench.time_ms(fn, *args, **(dict(iters=1, trials=1, warmup=1) if quick
                                        else dict(budget_s=1.0)))


def _report(name, fn, args, ref, anchor_ms, quick, note=""):
    try:
        out = fn(*args)
        ms = _time(fn, *args, quick=quick)
    except Exception as e:  # e.g. a config that does not compile: report and go on
        print(f"  {name:18} failed: {str(e).splitlines()[0][:120]}", flush=True)
        return
    err = _bench.rel_err(out, ref) if ref is not None else float("nan")
    print(f"  {name:18} {ms:9.3f} ms  {anchor_ms / ms:6.3f}x anchor  err {err:.1e} {note}",
          flush=True)


def paged(configs, quick):
    chunk, prefixes, page = (32, (64,), 16) if quick else (2048, (8192, 32768), 64)
    n, kh, h = (4, 2, 32) if quick else (N, KH, H)
    flash = jax.jit(lambda q, k, v, o: dense_triton.attention(q, k, v, q_offset=o)[0])
    for prefix in prefixes:
        problem = _paged_problem(prefix, prefix=prefix, chunk=chunk, n=n, kh=kh, h=h, page=page)
        q, kp, vp, table, off, _ = problem
        k = gather_pages(kp, table)[:, :prefix + chunk]
        v = gather_pages(vp, table)[:, :prefix + chunk]
        ref = flash(q, k, v, off)
        anchor = _time(flash, q, k, v, off, quick=quick)
        print(f"prefix {prefix} chunk {chunk} P{page}: flash on a gathered copy {anchor:.3f} ms",
              flush=True)
        for text in configs:
            cfg = _parse(text, triton_paged.Config)
            fn = jax.jit(lambda *a, cfg=cfg: triton_paged.paged_prefill_attention(
                *a, config=cfg)[0])
            _report(text, fn, problem, ref, anchor, quick,
                    f"page_tiles={cfg.uses_page_tiles(page)}")


def sparse(configs, quick):
    bs = 16 if quick else 128
    cases = ((256, (0.3, 1.0)),) if quick else ((65536, (0.1, 1.0)), (131072, (0.1,)))
    n, kh, h = (4, 2, 32) if quick else (N, KH, H)
    for s, densities in cases:
        q, k, v = _bench.qkv(s + 1, 1, s, n, kh, h)
        modes = jnp.ones((1, n), jnp.int32)
        dense = jax.jit(lambda q, k, v: dense_triton.attention(q, k, v)[0])
        dense_ms = _time(dense, q, k, v, quick=quick)
        print(f"S{s}: dense flash {dense_ms:.3f} ms", flush=True)
        for d in densities:
            mask = _sparse_mask(int(d * 1000) + s, n, s, bs, d)
            eff = sparse_ref.effective_block_mask(modes, mask, num_q_tokens=s, num_kv_tokens=s,
                                                  block_size=bs)
            real = float(jnp.mean(eff[..., jnp.tril(jnp.ones(eff.shape[-2:], bool))]))
            goal = 1.15 * real * dense_ms
            print(f" density {real:.3f}: goal <= {goal:.3f} ms", flush=True)
            ref = None
            for text in configs:
                cfg = _parse(text, sparse_triton.Config)
                fn = jax.jit(lambda q, k, v, md, m, cfg=cfg: sparse_triton.block_sparse_attention(
                    q, k, v, md, m, block_size=bs, config=cfg)[0])
                if ref is None:
                    ref = fn(q, k, v, modes, mask)
                _report(text, fn, (q, k, v, modes, mask), ref, goal, quick, "(anchor: the goal)")
        del q, k, v


def xattn(quick):
    seqs = (256,) if quick else (65536, 131072)
    n, kh, h = (4, 2, 32) if quick else (N, KH, H)
    C, MC = xattn_triton.Config, xattn_triton.mosaic_scores.Config
    # (Session 5 also timed warp specialisation, bf16 k128 s2, fp8 256 x 128, 4 stages and the
    # XLA selection, session 6 an f16 scratch: all slower or equal; benchmarks/NOTES.md.)
    variants = [("bf16", C()),
                ("fp8 k128 s3", C(fp8=True, block_k=128)),
                # Wider tiles: more FLOPs per byte of the q / k slices read from L2.
                ("fp8 128x256", C(fp8=True, block_k=128, block_c=256)),
                ("fp8 api", xattn_triton.FP8_CONFIG),
                # The Mosaic GPU score kernel (TMA-fed e4m3 wgmma; full lengths only).
                *((f"fp8 mosaic {bc} s{st}", C(fp8=True, block_k=128, mosaic=MC(
                    block_c=bc, stages=st)))
                  for bc, st in ((256, 4), (256, 3), (128, 4)))]
    for s in seqs:
        q, k, _ = _bench.qkv(s + 7, 1, s, n, kh, h)
        base = None
        for name, cfg in variants:
            fn = jax.jit(lambda q, k, cfg=cfg: xattn_triton.xattn_estimate(
                q, k, block_size=128 if not quick else 16, stride=16 if not quick else 4,
                threshold=0.9, config=cfg))
            try:
                sums, mask = fn(q, k)
                ms = _time(fn, q, k, quick=quick)
            except Exception as e:  # a variant that does not compile: report and go on
                print(f"S{s} {name:12} failed: {str(e).splitlines()[0][:200]}", flush=True)
                continue
            base = base or (ms, sums, mask)
            agree = float(jnp.mean(mask == base[2]))
            print(f"S{s} {name:12} {ms:8.3f} ms  {base[0] / ms:5.2f}x bf16  mask agreement "
                  f"{agree:.4f}  block-sum rel err {_bench.rel_err(sums, base[1]):.1e}",
                  flush=True)
        _xattn_parts(q, k, s, quick)
        # The selection alone (on the bf16 sums): the reference's XLA sorts vs the kernel.
        sums = base[1]
        tb = sums.shape[2]
        diag = sparse_ref.diagonal_blocks(tb, jnp.full((1,), s, jnp.int32),
                                          jnp.full((1,), s, jnp.int32), 128 if not quick else 16)
        kernel = xattn_triton.select_blocks_kernel
        for name, select in (("find_blocks", xattn_ref.find_blocks), ("kernel", kernel),
                             *((f"kernel {w} warps", functools.partial(kernel, num_warps=w))
                               for w in (1, 2, 4, 8))):
            fn = jax.jit(lambda x, d, select=select: select(x, d, 0.9))
            agree = float(jnp.mean(fn(sums, diag) == base[2]))
            print(f"S{s} selection {name:14} {_time(fn, sums, diag, quick=quick):8.3f} ms  "
                  f"mask agreement {agree:.4f}", flush=True)
        del q, k


def _xattn_parts(q, k, s, quick):
    """The fp8 estimate's launches one by one: the e4m3 pass over q and over k (against the copy
    bandwidth of their bytes) and the scores + block sums (`block_sums`, quantisation included)."""
    st, bs = (4, 16) if quick else (16, 128)
    lengths = jnp.full((1,), s, jnp.int32)
    ceiling = _bench.copy_bandwidth_tbs(1 << 20 if quick else 1 << 30)["ceiling"]
    cols = -(-s // st)  # reduced rows / columns; k's scales padded to whole 128-column tiles
    for name, x, groups in (("q", q, cols), ("k", k, -(-cols // 128) * 128)):
        fn = jax.jit(lambda x, n, groups=groups: xattn_triton.quantize_e4m3_kernel(x, n, st,
                                                                                   groups))
        ms = _time(fn, x, lengths, quick=quick)
        tbs = x.size * (x.dtype.itemsize + 1) / ms / 1e9
        print(f"S{s} parts quantize {name}   {ms:8.3f} ms  {tbs:5.2f} TB/s = "
              f"{tbs / ceiling:.2f} of copy", flush=True)
    for name, cfg in (("bf16", xattn_triton.Config()),
                      ("fp8", xattn_triton.Config(fp8=True, block_k=128)),
                      ("fp8 api", xattn_triton.FP8_CONFIG),
                      ("fp8 mosaic", dataclasses.replace(xattn_triton.FP8_CONFIG,
                                                         mosaic=xattn_triton.mosaic_scores.Config()))):
        if cfg.mosaic is not None and quick:
            continue  # full lengths and aligned shapes only
        fn = jax.jit(lambda q, k, n, cfg=cfg: xattn_triton.block_sums(
            q, k, 1.0, n, n, block_size=bs, stride=st, config=cfg))
        try:
            ms = _time(fn, q, k, lengths, quick=quick)
        except Exception as e:
            print(f"S{s} parts block_sums {name:8} failed: {str(e).splitlines()[0][:200]}")
            continue
        print(f"S{s} parts block_sums {name:8} {ms:8.3f} ms", flush=True)


@triton.jit
def _copy_rows_kernel(x_ptr, y_ptr, N_TOK: tl.constexpr, C: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, C_FASTEST: tl.constexpr,
                      NC: tl.constexpr):
    """`y = x` moved as the conv1d row kernel moves it: a program's `BLOCK_T` rows of `BLOCK_C`
    channels all loaded first (1-D rows), then stored (streaming), programs in its order."""
    tb, cb = conv_triton._block_ids(C_FASTEST, NC)
    t0 = tb * BLOCK_T
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    base = t0.to(tl.int64) * C + offs_c
    xs = ()
    for i in tl.static_range(BLOCK_T):
        xs = xs + (tl.load(x_ptr + base + i * C, mask=(offs_c < C) & (t0 + i < N_TOK)),)
    for i in tl.static_range(BLOCK_T):
        tl.store(y_ptr + base + i * C, xs[i], mask=(offs_c < C) & (t0 + i < N_TOK),
                 eviction_policy="evict_first")


def _copy_rows(x, *, block_t, block_c, num_warps, c_fastest):
    n_tok, c = x.shape[0] * x.shape[1], x.shape[2]
    tb, nc = triton.cdiv(n_tok, block_t), triton.cdiv(c, block_c)
    return triton_call(x.reshape(n_tok, c), kernel=_copy_rows_kernel,
                       out_shape=jax.ShapeDtypeStruct((n_tok, c), x.dtype),
                       grid=(tb * nc,) if c_fastest else (tb, nc), num_warps=num_warps,
                       N_TOK=n_tok, C=c, BLOCK_T=block_t, BLOCK_C=block_c, C_FASTEST=c_fastest,
                       NC=nc)


def conv1d(configs, quick):
    t, c, w = (40, 32, 4) if quick else (32768, 8192, 4)
    gen = np.random.default_rng(0)
    x = jnp.asarray(gen.standard_normal((1, t, c), np.float32), jnp.bfloat16)
    weight = jnp.asarray(gen.standard_normal((c, w), np.float32) * 0.5, jnp.bfloat16)
    h0 = jnp.asarray(gen.standard_normal((1, c, w - 1), np.float32), jnp.bfloat16)
    ceiling = _bench.copy_bandwidth_tbs(1 << 20 if quick else 4 << 30)["ceiling"]
    num_bytes = 2 * t * c * 2 + 2 * c * (w - 1) * 2 + c * w * 2
    print(f"copy ceiling {ceiling:.3f} TB/s; B1 T{t} C{c} W{w} bf16 silu state", flush=True)
    ref = None
    for text in configs:
        parts = text.split("-")
        if parts[0] == "copy":  # the row kernel's loads and stores alone: its data-movement bound
            bt, bc, warps = (int(v) for v in parts[1:4])
            fn = jax.jit(functools.partial(_copy_rows, block_t=bt, block_c=bc, num_warps=warps,
                                           c_fastest="cf" in parts))
            ms = _time(fn, x, quick=quick)
            tbs = 2 * x.size * x.dtype.itemsize / ms / 1e9
            print(f"  {text:18} {ms:9.4f} ms  {tbs:6.3f} TB/s = {tbs / ceiling:.3f} of copy",
                  flush=True)
            continue
        # `Config.rows`, `.rows_split`, `.fast_silu`, `.channels_fastest`
        flags = [p for p in parts if p in ("rows", "split", "fast", "cf")]
        bt, bc, warps, *stream = (int(v) for v in parts if v not in flags)
        cfg = conv_triton.Config(block_t=bt, block_c=bc, num_warps=warps,
                                 stream_store=bool(stream and stream[0]), rows="rows" in flags,
                                 rows_split="split" in flags, fast_silu="fast" in flags,
                                 channels_fastest="cf" in flags)
        fn = jax.jit(lambda x, wt, s, cfg=cfg: conv_triton.causal_conv1d(
            x, wt, initial_state=s, activation="silu", config=cfg)[0])
        try:
            out = fn(x, weight, h0)
            ms = _time(fn, x, weight, h0, quick=quick)
        except Exception as e:  # a config that does not compile: report and go on
            print(f"  {text:18} failed: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        ref = out if ref is None else ref
        tbs = num_bytes / ms / 1e9
        print(f"  {text:18} {ms:9.4f} ms  {tbs:6.3f} TB/s = {tbs / ceiling:.3f} of copy  "
              f"err {_bench.rel_err(out, ref):.1e}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=("paged", "sparse", "xattn", "conv1d"))
    parser.add_argument("--configs", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="ignored (the gpu-check convention)")
    args = parser.parse_args(argv)
    if args.kernel == "xattn":
        return xattn(args.quick)
    default = {"paged": "128-64-8-3,128-64-8-3-ws,128-128-8-3-ws,128-128-8-2",
               "sparse": "128-128-8-3,128-128-8-3-hf,128-128-8-3-ws,128-64-8-3",
               "conv1d": "8-512-4-1-rows-split-fast-cf,16-1024-4-1-rows-split-fast-cf,"
                         "8-512-4-1-rows-split-cf,16-1024-4-1-rows-split,copy-8-512-4-cf,"
                         "copy-8-1024-4-cf"}
    configs = (args.configs or default[args.kernel]).split(",")
    if args.quick:
        configs = (["8-16-4-1", "16-16-2", "8-16-4-1-rows", "8-16-4-1-rows-split",
                    "8-16-4-1-rows-split-fast-cf", "8-16-4-1-rows-fast", "copy-8-16-4",
                    "8-16-4-1-rows-split-cf", "8-16-4-1-cf", "copy-8-16-4-cf"]
                   if args.kernel == "conv1d" else ["16-16-4-2"])
    {"paged": paged, "sparse": sparse, "conv1d": conv1d}[args.kernel](configs, args.quick)


if __name__ == "__main__":
    main()
