"""Paged chunked prefill and block-sparse prefill against dense anchors, in one process.

    python -m experiments.bench_sparse_prefill --out benchmarks   # the shapes below (needs a GPU)
    python -m experiments.bench_sparse_prefill --smoke            # tiny shapes, CPU interpreter

Writes `<out>/sparse_prefill.json` and `.md` (`--smoke`: `sparse_prefill_smoke.*`). Rows:

- `paged_prefill`: a chunk of `--chunk` queries over a cached prefix of `--prefixes` tokens, B1,
  N32/K8, H128, bf16, pages of `--page` tokens scattered at random (per-head tables). Ours reads the
  pages in the kernel (`attn.dense.paged_prefill_attention`, Triton). Anchor: our dense Triton
  flash on an already gathered dense copy (`attn.dense.triton.attention` with `q_offset`); the
  gather's own time is reported beside it (`gather_ms`). Also cuDNN
  (`jax.nn.dot_product_attention(implementation="cudnn")`) on the gathered copy, non-causal over
  all `prefix + chunk` keys (its causal mask aligns queries to the start of the keys, not to the
  end): it does `(prefix + chunk) / (prefix + chunk / 2)` times our pairs, reported as
  `cudnn_ms` and `cudnn_tflops_on_its_pairs`. TFLOP/s counted on the causally visible pairs.
  Goal: `speedup_vs_anchor >= 0.9` (reading through the tables costs <= 10%).
- `block_sparse_prefill`: causal self-attention at `--sparse-seq`, N32/K8, H128, bf16, block 128,
  every head in mode 1 with a random block mask keeping the given fraction of the causal blocks
  (the diagonal and the sink always kept), density measured on the effective mask. Anchor: our
  dense Triton flash (causal). Goal (PERF.md): `ms <= 1.15 * density * anchor_ms`, i.e. the
  speed-up approaches `1 / density`.
- `xattn_estimate`: the Triton XAttention estimate (stride 16, block sums + the XLA selection) at
  `--sparse-seq`; anchor our dense flash. TFLOP/s counted on the one causal reduced GEMM pass
  (`2 * N * H * S^2 / 2 / stride`). Goal (PERF.md: estimation <= 20% of the total at ~10%
  density): when the run also has a `block_sparse_prefill` row at density <= 0.15,
  `fraction_of_total = est / (est + sparse)` is set from it and `meets_goal = fraction <= 0.2`;
  otherwise the proxy `est <= 0.2 * 0.1 * dense / 0.8`.

The ceiling of every row is a bf16 matmul measured in the same process
(`experiments.bench_prefill.matmul_tflops`).
"""

from __future__ import annotations

import argparse
import logging

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.block_sparse import effective_block_mask
from attn.block_sparse import triton as sparse_triton
from attn.dense import triton as dense_triton
from attn.dense import triton_paged
from attn.paged_decode.reference import gather_pages
from experiments import _bench
from experiments.bench_prefill import matmul_tflops

log = logging.getLogger("bench_sparse_prefill")
_TIMING: dict = {}  # `--smoke`: one call per figure (the interpreter is slow)


def _time(fn, *args) -> float:
    return _bench.time_ms(fn, *args, **_TIMING)


def _paged_problem(seed, *, prefix, chunk, n, kh, h, page, dtype=jnp.bfloat16):
    """q `[1, chunk, N, H]`, pages with the row's `prefix + chunk` tokens on random pages."""
    gen = np.random.default_rng(seed)
    length = prefix + chunk
    max_pages = -(-length // page)
    num_pages = max_pages + 1  # + the null page 0
    tables = np.stack([gen.permutation(num_pages - 1)[:max_pages] + 1 for _ in range(kh)])
    key = jax.random.key(seed)
    q = jax.random.normal(key, (1, chunk, n, h), dtype)
    k_pages = jax.random.normal(jax.random.fold_in(key, 1), (kh, num_pages, page, h), dtype)
    v_pages = jax.random.normal(jax.random.fold_in(key, 2), (kh, num_pages, page, h), dtype)
    return (q, k_pages, v_pages, jnp.asarray(tables[None], jnp.int32),
            jnp.asarray([prefix], jnp.int32), jnp.asarray([length], jnp.int32))


def paged_rows(args, ceiling: float) -> list[dict]:
    n, kh, h, chunk = args.heads, args.kv_heads, args.head_dim, args.chunk
    rows = []
    ours = jax.jit(lambda q, kp, vp, t, off, lens: triton_paged.paged_prefill_attention(
        q, kp, vp, t, off, lens)[0])
    gather = jax.jit(lambda kp, vp, t: (gather_pages(kp, t), gather_pages(vp, t)))
    flash = jax.jit(lambda q, k, v, off: dense_triton.attention(q, k, v, q_offset=off)[0])

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
    cudnn = jax.jit(cudnn)

    for prefix in args.prefixes:
        problem = _paged_problem(prefix, prefix=prefix, chunk=chunk, n=n, kh=kh, h=h,
                                 page=args.page)
        q, kp, vp, tables, off, _ = problem
        out = ours(*problem)
        ms = _time(ours, *problem)
        k, v = gather(kp, vp, tables)
        gather_ms = _time(gather, kp, vp, tables)
        s = prefix + chunk
        k, v = k[:, :s], v[:, :s]
        ref = flash(q, k, v, off)
        anchor_ms = _time(flash, q, k, v, off)
        pairs = n * (chunk * prefix + chunk * (chunk + 1) / 2)
        flops = 4 * h * pairs
        extra = {"gather_ms": round(gather_ms, 4), "rel_err_vs_anchor": round(
            _bench.rel_err(out, ref), 5), "page": args.page,
            "config": str(triton_paged.default_config(h))}
        try:
            cudnn(q, k, v)
            cudnn_ms = _time(cudnn, q, k, v)
            extra["cudnn_ms"] = round(cudnn_ms, 4)
            extra["cudnn_tflops_on_its_pairs"] = round(4 * h * n * chunk * s / cudnn_ms / 1e9, 2)
            extra["speedup_vs_cudnn_noncausal"] = round(cudnn_ms / ms, 4)
        except Exception as e:  # an anchor that cannot run (CPU, old cuDNN) is reported
            extra["cudnn_note"] = str(e).splitlines()[0][:160]
        rows.append(_bench.row(
            kernel="paged_prefill",
            case=f"B1-prefix{prefix}-chunk{chunk}-N{n}-K{kh}-H{h}-P{args.page}-bf16",
            ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ceiling,
            anchor="our dense Triton flash on a gathered copy", anchor_ms=anchor_ms,
            goal="speedup_vs_anchor >= 0.9", meets_goal=anchor_ms / ms >= 0.9, **extra))
    return rows


def _sparse_mask(seed, n, s, bs, keep: float):
    """`[1, N, Sb, Sb]` block mask keeping about `keep` of the causal blocks (+ sink, diagonal)."""
    gen = np.random.default_rng(seed)
    sb = -(-s // bs)
    mask = gen.random((1, n, sb, sb)) < keep
    idx = np.arange(sb)
    mask[..., idx, idx] = True
    mask[..., 0] = True
    return jnp.asarray(mask)


def sparse_rows(args, ceiling: float) -> list[dict]:
    n, kh, h, s, bs = args.heads, args.kv_heads, args.head_dim, args.sparse_seq, args.block
    key = jax.random.key(3)
    q = jax.random.normal(key, (1, s, n, h), jnp.bfloat16)
    k = jax.random.normal(jax.random.fold_in(key, 1), (1, s, kh, h), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 2), (1, s, kh, h), jnp.bfloat16)
    flash = jax.jit(lambda q, k, v: dense_triton.attention(q, k, v)[0])
    dense_out = flash(q, k, v)
    anchor_ms = _time(flash, q, k, v)
    modes = jnp.ones((1, n), jnp.int32)
    ours = jax.jit(lambda q, k, v, mask: sparse_triton.block_sparse_attention(
        q, k, v, modes, mask, block_size=bs)[0])
    rows = []
    for sparsity in args.sparsities:
        mask = _sparse_mask(int(sparsity * 100), n, s, bs, 1.0 - sparsity)
        eff = np.asarray(effective_block_mask(modes, mask, num_q_tokens=s, num_kv_tokens=s,
                                              block_size=bs))
        sb = eff.shape[-1]
        causal_blocks = n * sb * (sb + 1) / 2
        density = float(eff.sum() / causal_blocks)
        out = ours(q, k, v, mask)
        ms = _time(ours, q, k, v, mask)
        flops = 4 * h * float(eff.sum()) * bs * bs  # visited blocks (diagonal counted whole)
        extra = {"density": round(density, 4), "target_sparsity": sparsity,
                 "speedup_ideal": round(1 / density, 3)}
        if sparsity == 0.0:
            extra["rel_err_vs_dense"] = round(_bench.rel_err(out, dense_out), 5)
        rows.append(_bench.row(
            kernel="block_sparse_prefill",
            case=f"B1-S{s}-N{n}-K{kh}-H{h}-bs{bs}-density{density:.2f}-bf16",
            ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ceiling,
            anchor="our dense Triton flash (causal)", anchor_ms=anchor_ms,
            goal="ms <= 1.15 * density * anchor_ms",
            meets_goal=ms <= 1.15 * density * anchor_ms, **extra))
    return rows


def estimate_rows(args, ceiling: float) -> list[dict]:
    """XAttention estimate (Triton scores + block sums, XLA selection) against dense flash."""
    from attn.xattention import triton as xattn_triton

    n, kh, h, s, bs = args.heads, args.kv_heads, args.head_dim, args.sparse_seq, args.block
    stride = max(1, min(16, bs // 4))
    key = jax.random.key(4)
    q = jax.random.normal(key, (1, s, n, h), jnp.bfloat16)
    k = jax.random.normal(jax.random.fold_in(key, 1), (1, s, kh, h), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 2), (1, s, kh, h), jnp.bfloat16)
    flash = jax.jit(lambda q, k, v: dense_triton.attention(q, k, v)[0])
    anchor_ms = _time(flash, q, k, v)
    est = jax.jit(lambda q, k: xattn_triton.xattn_estimate(q, k, block_size=bs, stride=stride))
    ms = _time(est, q, k)
    flops = 2 * n * h * s * s / 2 / stride  # one pass of the causal reduced GEMM
    return [_bench.row(
        kernel="xattn_estimate", case=f"B1-S{s}-N{n}-K{kh}-H{h}-bs{bs}-st{stride}-bf16",
        ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ceiling,
        anchor="our dense Triton flash (causal)", anchor_ms=anchor_ms,
        goal="ms <= 0.2 * 0.1 * anchor_ms / 0.8 (<= 20% of a 10%-density sparse prefill)",
        meets_goal=ms <= 0.2 * 0.1 * anchor_ms / 0.8)]


def _estimate_share(rows: list[dict]) -> None:
    """Judge the estimate by its share of estimate + sparse prefill at ~10% density, in place."""
    sparse = [r for r in rows if r["kernel"] == "block_sparse_prefill"
              and r.get("density", 1.0) <= 0.15]
    for r in rows:
        if r["kernel"] == "xattn_estimate" and sparse:
            total = r["ms"] + sparse[0]["ms"]
            r["sparse_ms"] = sparse[0]["ms"]
            r["fraction_of_total"] = round(r["ms"] / total, 4)
            r["goal"] = f"est / (est + sparse at density {sparse[0]['density']}) <= 0.2"
            r["meets_goal"] = r["fraction_of_total"] <= 0.2


ROWS = {"paged_prefill": paged_rows, "block_sparse_prefill": sparse_rows,
        "xattn_estimate": estimate_rows}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)

    def ints(text):
        return [int(x) for x in text.split(",")]

    parser.add_argument("--rows", default=",".join(ROWS),
                        help=f"comma-separated row groups of {list(ROWS)}")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prefixes", type=ints, default=[8192, 32768])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--page", type=int, default=64)
    parser.add_argument("--sparse-seq", type=int, default=32768)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--sparsities", type=lambda t: [float(x) for x in t.split(",")],
                        default=[0.0, 0.5, 0.9])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes (runs on a CPU through Triton's interpreter)")
    parser.add_argument("--out", default="benchmarks")
    args = parser.parse_args(argv)
    name = "sparse_prefill"
    matmul_n = 8192
    if args.smoke:
        args.heads, args.kv_heads, args.head_dim = 4, 2, 32
        args.prefixes, args.chunk, args.page = [40], 24, 16
        args.sparse_seq, args.block = 96, 32
        name, matmul_n = "sparse_prefill_smoke", 256
        _TIMING.update(iters=1, trials=1, warmup=1)
    logging.basicConfig(level=logging.INFO)
    log.info("device: %s", _bench.device_info())
    ceiling = matmul_tflops(matmul_n)
    rows = []
    for group in args.rows.split(","):
        try:
            rows += ROWS[group](args, ceiling)
        except Exception:  # one broken row group must not lose the others
            log.exception("row group %s failed", group)
    _estimate_share(rows)
    md = _bench.write(name, rows, extra={"matmul_tflops": round(ceiling, 2)}, out_dir=args.out)
    _bench.print_table(rows)
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
