"""Block-sparse, XAttention-estimate and paged prefill rows. B1, N32 / K8, H = Hv = 128, bf16,
causal self-attention unless said.

- `block_sparse_prefill`: at each S of `seqs` (64K, 128K), every head in mode 1
  (`attn.block_sparse.block_sparse_attention`; `impl`: Mosaic GPU on a Hopper GPU, else Triton,
  the Triton time beside it) with a random block mask `[1, N, Sb, Sb]` (block 128) keeping a
  fraction chosen so that the effective mask (the diagonal and the sink block always kept) has
  density `density` (0.1) of the causal blocks; at `full_density_seq` (64K) also density 1.0
  (the per-block cost against dense flash). `density` is measured on `effective_block_mask`.
  TFLOP/s on the visible pairs of the visited blocks (a diagonal block counts `bs (bs + 1) / 2`
  pairs); ceiling the bf16 matmul. Anchor: our dense flash (causal) at that S, the kernel
  `attn.dense.attention` picks (`dense_impl`), with the Triton one's time beside it. Goal
  (PERF.md): `ms <= goal_ms = 1.15 * density * dense_ms`.
- `xattn_estimate`: `attn.xattention.xattn_estimate(implementation="triton")` (stride 16, block
  128, threshold 0.9: reduced scores, softmax, block sums and the block selection) at the same S,
  exact and with `fp8=True` (e4m3 score GEMM; `scores`: which score kernel ran). TFLOP/s on the
  causal reduced GEMM, `2 * N * (S / st)^2 / 2 * H * st` FLOPs. Anchor: our dense flash. Goal
  (PERF.md, estimation <= 20% of the total): `fraction_of_total = ms / (ms + sparse_ms) <= 0.2`,
  `sparse_ms` the block-sparse time at density `density` at that S (shared with the
  `block_sparse_prefill` group, or measured here).
- `block_sparse_fwd_bwd`: forward + backward (`jax.grad` of `sum(out * dO)`) at each S of
  `seqs` (32K, 64K), every head in mode 1 with the `block_sparse_prefill` mask at density
  `density` (0.1): ours as `implementation="auto"` trains through it (on a Hopper GPU the
  Mosaic GPU forward and, at H128, the fused Mosaic backward; else Triton both ways; the
  all-Triton time beside it, `triton_ms`), and our forward alone (`fwd_ms`). FLOPs 3.5x the
  forward's on the visited pairs (FA's count). Anchor: our dense fwd + bwd
  (`attn.dense.attention`, causal, `jax.grad`) at that S; also cuDNN's dense fwd + bwd
  (`cudnn_ms`, `ratio_vs_cudnn_x_density = ms / (density * cudnn_ms)`, information). Goal
  (PERF.md): `ms <= goal_ms = 1.2 * density * dense_ms`. Information: the same op on
  `banded_like(mask)`, as many blocks in every row, the nearest ones (`banded_ms`,
  `banded_ratio_vs_density_x_dense`): what the random mask's scattered blocks cost, whose query
  tiles the backward's programs then share in L2 less often. On the GPU, `kernel_ms` splits one
  call of ours, the dense and the banded into the forward kernel, the backward kernel and the
  other kernels (`fwd_bwd_kernel_ms`, from a profiler trace), and
  `{fwd,bwd,banded_bwd}_kernel_ratio_vs_density_x_dense` compare the kernels alone. Ours, the
  dense, the banded and cuDNN's are timed interleaved over rounds (`Context.time_rounds`); the
  row is the round with the median `ms / (density * dense_ms)`, every round's in
  `round_ratios_vs_density_x_dense`.
  Correctness: at the first S, the gradients with every head in mode 0 (full causal, through the
  same kernels) against the dense ones (`rel_err_full_vs_dense_d{q,k,v}`).
- `paged_prefill`: a chunk of `chunk` (2K) queries over a cached prefix of `prefixes` (8K, 32K)
  tokens, pages of `page` (64) tokens scattered at random (per-head tables), through
  `attn.dense.paged_prefill_attention(implementation="triton")`. TFLOP/s on the causally visible
  pairs. Anchor: our dense Triton flash (`q_offset`) on an already gathered copy (the gather's own
  time is `gather_ms`); also cuDNN on the gathered copy, non-causal over all `prefix + chunk`
  keys (its causal mask aligns queries to the start of the keys, not the end), reported as
  `cudnn_ms` / `cudnn_tflops_on_its_pairs`. Goal `speedup_vs_anchor >= 0.9`.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.block_sparse import block_sparse_attention, effective_block_mask
from attn.block_sparse import triton as sparse_triton
from attn.dense import attention, paged_prefill_attention, triton_paged
from attn.dense import mosaic as dense_mosaic
from attn.dense import triton as dense_triton
from attn.paged_decode.reference import gather_pages
from attn.xattention import triton as xattn_triton
from attn.xattention import xattn_estimate
from experiments.bench import core
from experiments.bench.prefill import cudnn, grad_fn
from experiments.bench.registry import register

log = logging.getLogger("bench.sparse")

QUICK_HEADS = dict(heads=4, kv_heads=2, head_dim=32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSparseArgs:
    """S64K / S128K at density 0.1 (and 1.0 at 64K), blocks of 128 (PERF.md)."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seqs: tuple[int, ...] = (65536, 131072)
    density: float = 0.1
    full_density_seq: int = 65536
    block: int = 128
    # 0.1 is below the forced diagonal + sink blocks at 4-8 blocks a row
    QUICK: ClassVar[dict] = dict(QUICK_HEADS, seqs=(128, 256), full_density_seq=128, block=32,
                                 density=0.4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSparseBwdArgs:
    """Forward + backward at S32K / S64K, density 0.1, blocks of 128 (PERF.md)."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seqs: tuple[int, ...] = (32768, 65536)
    density: float = 0.1
    block: int = 128
    QUICK: ClassVar[dict] = dict(QUICK_HEADS, seqs=(128,), block=32, density=0.4)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EstimateArgs:
    """The block-sparse rows' lengths, stride 16; `density`: the sparse time it is part of."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    seqs: tuple[int, ...] = (65536, 131072)
    density: float = 0.1
    block: int = 128
    stride: int = 16
    QUICK: ClassVar[dict] = dict(QUICK_HEADS, seqs=(128, 256), block=32, density=0.4, stride=8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PagedPrefillArgs:
    """A 2K chunk over an 8K / 32K paged prefix, pages of 64 (PERF.md)."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    prefixes: tuple[int, ...] = (8192, 32768)
    chunk: int = 2048
    page: int = 64
    QUICK: ClassVar[dict] = dict(QUICK_HEADS, prefixes=(40,), chunk=24, page=16)


def _config_of(module, *args) -> dict | None:
    """The launch config `module` uses by default, as a dict (None if it cannot say)."""
    try:
        cfg = module.default_config(*args) if hasattr(module, "default_config") else module.Config()
        return dataclasses.asdict(cfg)
    except Exception:  # kernels change under us; the config is information only
        return None


def dense_time(a, ctx, s: int) -> dict:
    """Our dense causal flash at length `s` (memoised: the sparse and estimate rows share it):
    `ms` of the kernel `attn.dense.attention(implementation="auto")` runs (`impl`: the Mosaic
    GPU one on a Hopper GPU, else Triton) and `triton_ms` of the Triton one."""
    n, kh, h = a.heads, a.kv_heads, a.head_dim

    def measure():
        q, k, v = core.qkv(s, 1, s, n, kh, h)
        got = ctx.time_ours(
            jax.jit(lambda q, k, v: dense_triton.attention(q, k, v)[0]),
            jax.jit(lambda q, k, v: attention(q, k, v, implementation="mosaic")[0]), q, k, v)
        return {key: got[key] for key in ("ms", "impl", "triton_ms")}
    return ctx.once(("dense", s, n, kh, h), measure)


def sparse_mask(seed, n, s, bs, density: float):
    """`[1, N, Sb, Sb]` random block mask whose effective (causal) density is about `density`.

    The diagonal and the sink block (column 0) are always kept; the other causal blocks are kept
    with the probability that brings the total to `density`.
    """
    sb = -(-s // bs)
    causal = sb * (sb + 1) / 2
    forced = 2 * sb - 1
    keep = float(np.clip((density * causal - forced) / max(causal - forced, 1), 0.0, 1.0))
    gen = np.random.default_rng(seed)
    mask = gen.random((1, n, sb, sb), dtype=np.float32) < keep
    idx = np.arange(sb)
    mask[..., idx, idx] = True
    mask[..., 0] = True
    return jnp.asarray(mask)


def banded_like(mask):
    """A mask of `mask`'s shape keeping, in every row, as many causal blocks as `mask` does: the
    sink block and the nearest blocks up to the diagonal (the same work, neighbouring rows
    sharing their blocks)."""
    mask = np.asarray(mask)
    sb = mask.shape[-1]
    rows, cols = np.arange(sb)[:, None], np.arange(sb)[None, :]
    count = (mask & (cols <= rows)).sum(-1, keepdims=True)  # with the diagonal and the sink
    return jnp.asarray((cols == 0) | ((cols <= rows) & (cols >= rows - count + 2)))


def visited(modes, mask, s: int, bs: int) -> tuple[float, float]:
    """`(density, pairs)` of the effective mask: the fraction of the causal blocks visited, and
    the visible query-key pairs in them (a diagonal block counts `bs (bs + 1) / 2`)."""
    n = modes.shape[1]
    eff = np.asarray(effective_block_mask(modes, mask, num_q_tokens=s, num_kv_tokens=s,
                                          block_size=bs))
    tb, sb = eff.shape[-2:]
    diag = eff[..., np.arange(tb), np.arange(tb)].sum()
    pairs = float(eff.sum() - diag) * bs * bs + float(diag) * bs * (bs + 1) / 2
    return float(eff.sum() / (n * sb * (sb + 1) / 2)), pairs


def _sparse_case(a, ctx, s: int, density: float, q, k, v) -> dict:
    """Time block-sparse attention at `s` with a mask of about `density`; memoised by `(s,
    density)`. Returns `ms`, `density` (measured), `pairs`, and the output."""
    n, h, bs = a.heads, a.head_dim, a.block

    def measure():
        mask = sparse_mask(int(density * 1000) + s, n, s, bs, density)
        modes = jnp.ones((1, n), jnp.int32)
        got_density, pairs = visited(modes, mask, s, bs)
        def run(impl):
            return jax.jit(lambda q, k, v, mask: block_sparse_attention(
                q, k, v, modes, mask, block_size=bs, implementation=impl)[0])
        got = ctx.time_ours(run("triton"), run("mosaic"), q, k, v, mask)
        case = {key: got[key] for key in ("ms", "impl", "triton_ms", "rel_err_triton_vs_mosaic")
                if key in got}
        return case | dict(pairs=pairs, density=got_density,
                           out=got["out"] if density >= 1.0 else None)
    return ctx.once(("sparse", s, density, n, h, bs), measure)


@register("block_sparse_prefill", BlockSparseArgs)
def sparse_rows(a: BlockSparseArgs, ctx: core.Context):
    """Block-sparse prefill at density ~`density` (and 1.0 at `full_density_seq`)."""
    n, kh, h, bs = a.heads, a.kv_heads, a.head_dim, a.block
    for s in a.seqs:
        dense = dense_time(a, ctx, s)
        dense_ms = dense["ms"]
        q, k, v = core.qkv(s + 1, 1, s, n, kh, h)
        for density in [a.density] + ([1.0] if s == a.full_density_seq else []):
            case = _sparse_case(a, ctx, s, density, q, k, v)
            ms, got = case["ms"], case["density"]
            extra = {"impl": case["impl"], "triton_ms": round(case["triton_ms"], 4),
                     "density": round(got, 4), "target_density": density,
                     "dense_ms": round(dense_ms, 4), "dense_impl": dense["impl"],
                     "dense_triton_ms": round(dense["triton_ms"], 4),
                     "triton_ratio_vs_triton_dense": round(
                         case["triton_ms"] / (got * dense["triton_ms"]), 4),
                     "goal_ms": round(1.15 * got * dense_ms, 4),
                     "speedup_ideal": round(1 / got, 3),
                     "triton_config": _config_of(sparse_triton, h),
                     "config": (_config_of(dense_mosaic, h) if case["impl"] == "mosaic"
                                else _config_of(sparse_triton, h))}
            if "rel_err_triton_vs_mosaic" in case:
                extra["rel_err_triton_vs_mosaic"] = round(case["rel_err_triton_vs_mosaic"], 5)
            if case["out"] is not None:
                flash = jax.jit(lambda q, k, v: dense_triton.attention(q, k, v)[0])
                extra["rel_err_vs_dense"] = round(core.rel_err(case["out"], flash(q, k, v)), 5)
                case["out"] = None
            yield core.row(
                kernel="block_sparse_prefill",
                case=f"B1-S{core.kilo(s)}-N{n}-K{kh}-H{h}-bs{bs}-density{got:.2f}-bf16",
                ms=ms, achieved=4 * h * case["pairs"] / ms / 1e9, unit="TFLOP/s",
                ceiling=ctx.matmul_tflops, anchor=f"our dense flash (causal, {dense['impl']})",
                anchor_ms=dense_ms, goal="ms <= goal_ms = 1.15 * density * dense_ms",
                meets_goal=ms <= 1.15 * got * dense_ms, **extra)
        del q, k, v


def fwd_bwd_kernel_ms(fn, *args, calls: int = 3) -> dict | None:
    """`{"forward", "backward", "other"}`: ms of one fwd + bwd call's GPU kernels, the Mosaic GPU
    forward and backward (launched in that order) and all the others together (row statistics,
    dQ's cast, lists, schedule); None off the GPU or where the two are not Mosaic GPU kernels."""
    kernels = core.kernel_breakdown(fn, *args, calls=calls)
    mosaic = [ms for name, ms in kernels or () if name == "entry_mosaic_gpu_kernel"]
    if len(mosaic) != 2:
        return None
    other = sum(ms for _, ms in kernels) - sum(mosaic)
    return {"forward": round(mosaic[0], 4), "backward": round(mosaic[1], 4),
            "other": round(other, 4)}


def _sparse_fn(modes, mask, bs: int, impl: str, *, grad: bool = False):
    """Jitted `(q, k, v) -> out` of block-sparse attention, or with `grad` `(q, k, v, dO) ->
    (dq, dk, dv)` of `sum(out * dO)`."""
    def fn(q, k, v):
        return block_sparse_attention(q, k, v, modes, mask, block_size=bs,
                                      implementation=impl)[0]
    return grad_fn(fn) if grad else jax.jit(fn)


@register("block_sparse_fwd_bwd", BlockSparseBwdArgs)
def sparse_bwd_rows(a: BlockSparseBwdArgs, ctx: core.Context):
    """Block-sparse forward + backward at density ~`density` against our dense fwd + bwd."""
    n, kh, h, bs = a.heads, a.kv_heads, a.head_dim, a.block
    for i, s in enumerate(a.seqs):
        q, k, v = core.qkv(s + 7, 1, s, n, kh, h)
        d_out = jax.random.normal(jax.random.key(s + 8), q.shape, q.dtype)
        dense = grad_fn(lambda q, k, v: attention(q, k, v, causal=True)[0])
        dense_grads = dense(q, k, v, d_out) if i == 0 else None
        mask = sparse_mask(int(a.density * 1000) + s, n, s, bs, a.density)
        modes = jnp.ones((1, n), jnp.int32)
        density, pairs = visited(modes, mask, s, bs)
        banded = banded_like(mask)

        ours = _sparse_fn(modes, mask, bs, "triton", grad=True)
        triton_ms = ctx.time(ours, q, k, v, d_out)
        impl, extra = "triton", {"triton_ms": round(triton_ms, 4)}
        try:
            mosaic = _sparse_fn(modes, mask, bs, "mosaic", grad=True)
            jax.block_until_ready(mosaic(q, k, v, d_out))
            impl, ours = "mosaic", mosaic
        except NotImplementedError as e:  # Mosaic refuses: the Triton forward is ours
            extra["mosaic_note"] = core.first_line(e, 300)
        extra["fwd_ms"] = round(ctx.time(_sparse_fn(modes, mask, bs, impl), q, k, v), 4)
        calls = {"ours": (ours, q, k, v, d_out),
                 "dense": (dense, q, k, v, d_out),
                 "banded": (_sparse_fn(modes, banded, bs, impl, grad=True), q, k, v, d_out)}
        if core.on_gpu():
            for gqa in (True, False):
                try:
                    anchor = grad_fn(cudnn(gqa, is_causal=True))
                    jax.block_until_ready(anchor(q, k, v, d_out))
                except Exception as e:  # an anchor that cannot run is reported, not fatal
                    log.warning("cuDNN fwd+bwd (gqa=%s): %s", gqa, core.first_line(e))
                    continue
                calls["cudnn"] = (anchor, q, k, v, d_out)
                break
        else:
            extra["cudnn_note"] = "skipped: no GPU"
        # The goal is a ratio to our dense time: the two interleaved (`Context.time_rounds`).
        times, clocks = ctx.time_rounds(calls)
        i = core.median_round(times["ours"], times["dense"])
        extra["gpu_clocks"] = core.clocks_of_round(clocks, i, "ours", "dense")
        ms, dense_ms, banded_ms = times["ours"][i], times["dense"][i], times["banded"][i]
        extra |= {"round_ratios_vs_density_x_dense": core.round_ratios(
                      times["ours"], [density * t for t in times["dense"]]),
                  "banded_ms": round(banded_ms, 4), "banded_ratio_vs_density_x_dense": round(
                      banded_ms / (visited(modes, banded, s, bs)[0] * dense_ms), 4)}
        if "cudnn" in times:
            cudnn_ms = times["cudnn"][i]
            extra |= {"cudnn_ms": round(cudnn_ms, 4),
                      "ratio_vs_cudnn_x_density": round(ms / (density * cudnn_ms), 4)}
        if core.on_gpu() and not ctx.quick:  # which kernel the ratio's excess is in
            split = {name: fwd_bwd_kernel_ms(*calls[name]) for name in ("ours", "dense", "banded")}
            if all(split.values()):
                extra["kernel_ms"] = split
                extra |= {f"{kind}_kernel_ratio_vs_density_x_dense": round(
                    split[name][part] / (density * split["dense"][part]), 4)
                    for kind, name, part in (("fwd", "ours", "forward"),
                                             ("bwd", "ours", "backward"),
                                             ("banded_bwd", "banded", "backward"))}
        if dense_grads is not None:  # every head full: the dense gradients
            full = _sparse_fn(jnp.zeros((1, n), jnp.int32), None, bs, impl, grad=True)(
                q, k, v, d_out)
            extra |= {f"rel_err_full_vs_dense_d{x}": round(core.rel_err(g, r), 5)
                      for x, g, r in zip("qkv", full, dense_grads, strict=True)}
            del full, dense_grads
        yield core.row(
            kernel="block_sparse_fwd_bwd",
            case=f"B1-S{core.kilo(s)}-N{n}-K{kh}-H{h}-bs{bs}-density{density:.2f}-bf16",
            ms=ms, achieved=3.5 * 4 * h * pairs / ms / 1e9, unit="TFLOP/s",
            ceiling=ctx.matmul_tflops, anchor="our dense fwd+bwd (causal, attention auto)",
            anchor_ms=dense_ms, goal="ms <= goal_ms = 1.2 * density * dense_ms",
            meets_goal=ms <= 1.2 * density * dense_ms, impl=impl, density=round(density, 4),
            target_density=a.density, goal_ms=round(1.2 * density * dense_ms, 4),
            ratio_vs_density_x_dense=round(ms / (density * dense_ms), 4), **extra)
        del q, k, v, d_out


@register("xattn_estimate", EstimateArgs)
def estimate_rows(a: EstimateArgs, ctx: core.Context):
    """XAttention estimate at each length, as a fraction of estimate + sparse."""
    n, kh, h, bs, stride = a.heads, a.kv_heads, a.head_dim, a.block, a.stride
    for s in a.seqs:
        dense = dense_time(a, ctx, s)
        dense_ms = dense["ms"]
        q, k, v = core.qkv(s + 1, 1, s, n, kh, h)  # the sparse rows' inputs
        sparse = _sparse_case(a, ctx, s, a.density, q, k, v)
        bf16_mask = None
        for fp8 in (False, True):  # the exact estimate, then `fp8=True` (e4m3 GEMM)
            est = jax.jit(lambda q, k, fp8=fp8: xattn_estimate(
                q, k, block_size=bs, stride=stride, implementation="triton", fp8=fp8))
            _, mask = est(q, k)
            bf16_mask = mask if bf16_mask is None else bf16_mask
            sb = mask.shape[-1]
            selected = float(jnp.sum(mask)) / (n * sb * (sb + 1) / 2)
            ms = ctx.time(est, q, k)
            fraction = ms / (ms + sparse["ms"])
            extra = {}
            if fp8:  # which score kernel ran; the Triton one beside it
                try:
                    xattn_triton.mosaic_scores.check_supported(
                        q, k, block_size=bs, stride=stride, q_lengths=None, kv_lengths=None,
                        config=xattn_triton.FP8_CONFIG.mosaic)
                    extra["scores"] = "mosaic"
                except NotImplementedError:
                    extra["scores"] = "triton"
                triton_est = jax.jit(lambda q, k: xattn_triton.xattn_estimate(
                    q, k, block_size=bs, stride=stride,
                    config=dataclasses.replace(xattn_triton.FP8_CONFIG, mosaic=None)))
                extra["triton_scores_ms"] = round(ctx.time(triton_est, q, k), 4)
            flops = 2 * n * (s / stride) ** 2 / 2 * h * stride
            yield core.row(
                kernel="xattn_estimate",
                case=f"B1-S{core.kilo(s)}-N{n}-K{kh}-H{h}-bs{bs}-st{stride}-bf16"
                + ("-fp8-gemm" if fp8 else ""),
                ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
                anchor=f"our dense flash (causal, {dense['impl']})", anchor_ms=dense_ms,
                goal="fraction_of_total = ms / (ms + sparse_ms) <= 0.2",
                meets_goal=fraction <= 0.2, fraction_of_total=round(fraction, 4),
                sparse_ms=round(sparse["ms"], 4), sparse_density=round(sparse["density"], 4),
                dense_ms=round(dense_ms, 4),
                mask_density_on_random_inputs=round(selected, 4),
                mask_agreement_with_bf16=round(float(jnp.mean(mask == bf16_mask)), 5),
                **extra,
                config=(dataclasses.asdict(xattn_triton.FP8_CONFIG) if fp8
                        else _config_of(xattn_triton)))
        del q, k, v, mask, bf16_mask


def paged_problem(seed, *, prefix, chunk, n, kh, h, page, dtype=jnp.bfloat16):
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


@register("paged_prefill", PagedPrefillArgs)
def paged_rows(a: PagedPrefillArgs, ctx: core.Context):
    """Paged chunked prefill against our flash on a gathered copy (and cuDNN, non-causal)."""
    n, kh, h, chunk = a.heads, a.kv_heads, a.head_dim, a.chunk
    ours = jax.jit(lambda q, kp, vp, t, off, lens: paged_prefill_attention(
        q, kp, vp, t, off, lens, implementation="triton")[0])
    gather = jax.jit(lambda kp, vp, t: (gather_pages(kp, t), gather_pages(vp, t)))
    flash = jax.jit(lambda q, k, v, off: dense_triton.attention(q, k, v, q_offset=off)[0])
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v,
                                                                 implementation="cudnn"))
    for prefix in a.prefixes:
        problem = paged_problem(prefix, prefix=prefix, chunk=chunk, n=n, kh=kh, h=h,
                                 page=a.page)
        q, kp, vp, tables, off, _ = problem
        out = ours(*problem)
        ms = ctx.time(ours, *problem)
        k, v = gather(kp, vp, tables)
        gather_ms = ctx.time(gather, kp, vp, tables)
        s = prefix + chunk
        k, v = k[:, :s], v[:, :s]
        ref = flash(q, k, v, off)
        anchor_ms = ctx.time(flash, q, k, v, off)
        pairs = n * (chunk * prefix + chunk * (chunk + 1) / 2)
        flops = 4 * h * pairs
        extra = {"gather_ms": round(gather_ms, 4), "rel_err_vs_anchor": round(
            core.rel_err(out, ref), 5), "page": a.page,
            "config": _config_of(triton_paged, h)}
        if core.on_gpu():
            try:
                cudnn(q, k, v)
                cudnn_ms = ctx.time(cudnn, q, k, v)
                extra["cudnn_ms"] = round(cudnn_ms, 4)
                extra["cudnn_tflops_on_its_pairs"] = round(4 * h * n * chunk * s / cudnn_ms / 1e9,
                                                           2)
                extra["speedup_vs_cudnn_noncausal"] = round(cudnn_ms / ms, 4)
            except Exception as e:  # an anchor that cannot run (old cuDNN) is reported
                extra["cudnn_note"] = str(e).splitlines()[0][:160]
        else:
            log.warning("cuDNN (paged rows) skipped: no GPU")
            extra["cudnn_note"] = "skipped: no GPU"
        yield core.row(
            kernel="paged_prefill",
            case=f"B1-prefix{core.kilo(prefix)}-chunk{core.kilo(chunk)}-N{n}-K{kh}-H{h}"
                 f"-P{a.page}-bf16",
            ms=ms, achieved=flops / ms / 1e9, unit="TFLOP/s", ceiling=ctx.matmul_tflops,
            anchor="our dense Triton flash on a gathered copy", anchor_ms=anchor_ms,
            goal="speedup_vs_anchor >= 0.9", meets_goal=anchor_ms / ms >= 0.9, **extra)


