"""Launch-config sweeps: one op's kernel under several configs at one shape, timed with the
benchmarks' timer (`experiments.bench.core.time_ms`) against the first config and the op's anchor.
Prints a table per case; writes nothing.

    python -m experiments.tools.sweep <target> [--config name=value,...]... [--set ...] [--quick]
    python -m experiments.tools.sweep --list

A `--config` (repeatable; default: the target's `defaults`) changes fields of the kernel's
`Config` on top of the config the kernel uses by default at the case's shape, in the config
syntax of `experiments.bench.registry` (`block_n=64,num_warps=4`; "" is the default itself).
`--set` changes the target's shape (the bench row group's argument dataclass, same syntax).
Columns: ms, the rate on the case's bytes or FLOPs, the speed-up over the first config, over
the anchor, and the relative error of the output against the first config's.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.block_sparse import reference as sparse_ref
from attn.block_sparse import triton as sparse_triton
from attn.conv1d import _triton_bwd as conv_bwd
from attn.conv1d import reference as conv_ref
from attn.conv1d import triton as conv_triton
from attn.conv1d import triton_prefill as conv_prefill
from attn.dense import triton as dense_triton
from attn.dense import triton_paged
from attn.gdn import triton as gdn_triton
from attn.mla import triton as mla_triton
from attn.paged_decode import triton as paged_triton
from attn.paged_decode.reference import gather_pages
from attn.xattention import triton as xattn_triton
from experiments.bench import core, decode, gdn, mla, prefill, registry, sparse
from kv import fp8


@dataclasses.dataclass(frozen=True)
class Case:
    """One problem of a sweep: `make(config)` is the jitted kernel, called on `args`."""

    label: str
    base: Any  # the kernel's default config at this shape
    make: Callable[[Any], Callable]
    args: tuple
    work: float  # bytes or FLOPs of one call (per step with `knobs["steps"]`)
    unit: str  # "TB/s" or "TFLOP/s"
    anchor: tuple[str, Callable, tuple] | None = None  # (name, jitted fn, args)
    knobs: dict = dataclasses.field(default_factory=dict)  # time_ms's carry / steps


@dataclasses.dataclass(frozen=True)
class Target:
    spec: type  # the bench row group's argument dataclass
    cases: Callable[[Any, core.Context], Iterator[Case]]
    defaults: tuple[str, ...]
    quick: tuple[str, ...] = ("",)


def _paged_decode(a: decode.PagedDecodeArgs, ctx) -> Iterator[Case]:
    b, s, kh, h, p = a.batch, a.seq, a.kv_heads, a.head_dim, a.page
    max_pages, num_pages = s // p, b * (s // p) + 1
    key = jax.random.key(0)
    k_pages = jax.random.normal(key, (kh, num_pages, p, h), jnp.bfloat16)
    v_pages = jax.random.normal(jax.random.fold_in(key, 1), (kh, num_pages, p, h), jnp.bfloat16)
    kq, ks = fp8.quantize(k_pages, a.sub_block)
    vq, vs = fp8.quantize(v_pages, a.sub_block)
    table = decode._tables(np.random.default_rng(0), b, kh, max_pages, num_pages, per_head=True)
    lengths = jnp.full((b,), s, jnp.int32)
    full = jnp.zeros((kh,), jnp.int32)
    kv_bytes = 2 * b * s * kh * h * 2

    def make(cfg):
        return jax.jit(lambda q, kp, vp, kss, vss: paged_triton.paged_decode(
            q, kp, vp, table, lengths, scale=h**-0.5, window=full, sinks=full, k_scales=kss,
            v_scales=vss, config=cfg)[0])
    for g in a.groups:
        q = jax.random.normal(jax.random.fold_in(key, g), (b, kh * g, h), jnp.bfloat16)
        for name, pages in (("bf16", (k_pages, v_pages, None, None)), ("fp8", (kq, vq, ks, vs))):
            yield Case(f"G{g} {name}", paged_triton.default_config(b, kh, s, fp8=name == "fp8"),
                       make, (q, *pages), kv_bytes / (2 if name == "fp8" else 1), "TB/s")


def _mla_decode(a: mla.MLADecodeArgs, ctx) -> Iterator[Case]:
    b, s, p, l, r = a.batch, a.seq, a.page, a.kv_lora_rank, a.rope_dim
    pages, q8, scales, table, lengths = mla.latent(np.random.default_rng(0), batch=b, seq=s,
                                                   page=p, kv_lora_rank=l, rope_dim=r,
                                                   sub_block=a.sub_block)
    for n in a.heads:
        q_lat, q_pe = mla.queries(n, batch=b, kv_lora_rank=l, rope_dim=r, seed=n)
        for name, pg, sc in (("bf16", pages, None), ("fp8", q8, scales)):
            base = mla_triton.default_config(b, n, s, fp8=sc is not None)
            yield Case(f"N{n} {name}", base, lambda cfg: mla.ours(cfg, l),
                       (q_lat, q_pe, pg, table, lengths, sc),
                       b * s * (l + r) * (1 if sc is not None else 2), "TB/s")


def _gdn_decode(a: gdn.GDNDecodeArgs, ctx) -> Iterator[Case]:
    rng = np.random.default_rng(0)
    h = a.head_dim
    q, k, v, g, beta, pool, slot_ids = gdn.gdn_decode_inputs(rng, batch=a.batch, nk=a.nk,
                                                             nv=a.nv, h=h, hv=h)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)
    args = (jnp.asarray(pool), bf(v), bf(q), bf(k), jnp.asarray(g), jnp.asarray(beta),
            jnp.asarray(slot_ids))
    make = lambda cfg: gdn.stepper(gdn.gdn_step("triton", cfg))
    yield Case(f"B{a.batch} Nv{a.nv} H{h}", gdn_triton.default_config(h), make, args,
               2 * a.batch * a.nv * h * h * 4, "TB/s",
               knobs=dict(carry=gdn.thread_pool, steps=gdn.STEPS))


def _conv_update(a: gdn.ConvUpdateArgs, ctx) -> Iterator[Case]:
    b, c, w = a.batch, a.channels, a.width
    x, weight, pool, slot_ids = gdn.conv_update_inputs(np.random.default_rng(0), batch=b,
                                                       channels=c, width=w)
    make = lambda cfg: gdn.stepper(gdn.conv_step("triton", cfg))
    yield Case(f"B{b} C{c} W{w}", conv_triton.Config(), make,
               (jnp.asarray(pool, jnp.bfloat16), x, slot_ids, weight),
               2 * b * c * (w - 1) * 2 + 2 * b * c * 2 + c * w * 2, "TB/s",
               knobs=dict(carry=gdn.thread_pool, steps=gdn.STEPS))


def _flash(a: prefill.FlashArgs, ctx) -> Iterator[Case]:
    b, n, kh, h, s = a.batch, a.heads, a.kv_heads, a.head_dim, a.seqs[0]
    q, k, v = core.qkv(0, b, s, n, kh, h)
    make = lambda cfg: jax.jit(lambda q, k, v: dense_triton.attention(q, k, v, config=cfg)[0])
    anchor = (("cuDNN", prefill.cudnn(True, is_causal=True), (q, k, v)) if core.on_gpu()
              else None)
    yield Case(f"causal S{core.kilo(s)}", dense_triton.default_config(h), make, (q, k, v),
               4 * prefill.causal_pairs(b, s, n) * h, "TFLOP/s", anchor)


def _window(a: prefill.WindowArgs, ctx) -> Iterator[Case]:
    b, n, kh, h, s, w, sink = a.batch, a.heads, a.kv_heads, a.head_dim, a.seq, a.window, a.sink
    q, k, v = core.qkv(1, b, s, n, kh, h)
    make = lambda cfg: jax.jit(lambda q, k, v: dense_triton.attention(
        q, k, v, window=w, sinks=sink, config=cfg)[0])
    anchor = (("cuDNN (no sink)", prefill.cudnn(True, is_causal=True,
                                                local_window_size=(w - 1, 0)), (q, k, v))
              if core.on_gpu() else None)
    yield Case(f"S{core.kilo(s)} W{core.kilo(w)} sink{sink}", dense_triton.default_config(h),
               make, (q, k, v), 4 * b * n * h * prefill.window_pairs(s, w, sink), "TFLOP/s",
               anchor)


def _backward(a: prefill.BackwardArgs, ctx) -> Iterator[Case]:
    b, n, kh, h, s = a.batch, a.heads, a.kv_heads, a.head_dim, a.seqs[0]
    q, k, v = core.qkv(0, b, s, n, kh, h)
    d_out = jax.random.normal(jax.random.key(5), q.shape, q.dtype)
    make = lambda cfg: prefill.grad_fn(
        lambda q, k, v: dense_triton.attention(q, k, v, config=cfg)[0])
    anchor = (("cuDNN fwd+bwd", prefill.grad_fn(prefill.cudnn(True, is_causal=True)),
               (q, k, v, d_out)) if core.on_gpu() else None)
    yield Case(f"causal fwd+bwd S{core.kilo(s)}", dense_triton.default_config(h), make,
               (q, k, v, d_out), 3.5 * 4 * prefill.causal_pairs(b, s, n) * h, "TFLOP/s",
               anchor)


def _paged_prefill(a: sparse.PagedPrefillArgs, ctx) -> Iterator[Case]:
    n, kh, h = a.heads, a.kv_heads, a.head_dim
    flash = jax.jit(lambda q, k, v, o: dense_triton.attention(q, k, v, q_offset=o)[0])
    make = lambda cfg: jax.jit(lambda *x: triton_paged.paged_prefill_attention(
        *x, config=cfg)[0])
    for prefix in a.prefixes:
        problem = sparse.paged_problem(prefix, prefix=prefix, chunk=a.chunk, n=n, kh=kh, h=h,
                                       page=a.page)
        q, kp, vp, table, off, _ = problem
        k = gather_pages(kp, table)[:, :prefix + a.chunk]
        v = gather_pages(vp, table)[:, :prefix + a.chunk]
        pairs = n * (a.chunk * prefix + a.chunk * (a.chunk + 1) / 2)
        yield Case(f"prefix {core.kilo(prefix)} chunk {core.kilo(a.chunk)} P{a.page}",
                   triton_paged.default_config(h), make, problem, 4 * h * pairs, "TFLOP/s",
                   ("flash on a gathered copy", flash, (q, k, v, off)))


def _block_sparse(a: sparse.BlockSparseArgs, ctx) -> Iterator[Case]:
    n, kh, h, bs = a.heads, a.kv_heads, a.head_dim, a.block
    modes = jnp.ones((1, n), jnp.int32)
    make = lambda cfg: jax.jit(lambda q, k, v, md, m: sparse_triton.block_sparse_attention(
        q, k, v, md, m, block_size=bs, config=cfg)[0])
    dense = jax.jit(lambda q, k, v: dense_triton.attention(q, k, v)[0])
    for s in a.seqs:
        q, k, v = core.qkv(s + 1, 1, s, n, kh, h)
        for d in [a.density] + ([1.0] if s == a.full_density_seq else []):
            mask = sparse.sparse_mask(int(d * 1000) + s, n, s, bs, d)
            eff = np.asarray(sparse_ref.effective_block_mask(modes, mask, num_q_tokens=s,
                                                             num_kv_tokens=s, block_size=bs))
            tb = eff.shape[-2]
            diag = eff[..., np.arange(tb), np.arange(tb)].sum()
            pairs = float(eff.sum() - diag) * bs * bs + float(diag) * bs * (bs + 1) / 2
            real = float(eff.sum()) / (n * tb * (tb + 1) / 2)
            # The anchor is dense flash; the label says the speed-up over it the goal asks.
            yield Case(f"S{core.kilo(s)} density {real:.3f} (goal: x{1 / (1.15 * real):.2f} "
                       "vs dense)", sparse_triton.default_config(h), make,
                       (q, k, v, modes, mask), 4 * h * pairs, "TFLOP/s",
                       ("dense flash", dense, (q, k, v)))


def _conv_prefill(a: gdn.ConvPrefillArgs, ctx) -> Iterator[Case]:
    c, w, t = a.channels, a.width, a.tokens
    gen = np.random.default_rng(0)
    x = jnp.asarray(gen.standard_normal((1, t, c), np.float32), jnp.bfloat16)
    weight = jnp.asarray(gen.standard_normal((c, w), np.float32) * 0.5, jnp.bfloat16)
    h0 = jnp.asarray(gen.standard_normal((1, c, w - 1), np.float32), jnp.bfloat16)
    make = lambda cfg: jax.jit(lambda x, wt, s: conv_prefill.causal_conv1d(
        x, wt, initial_state=s, activation="silu", config=cfg)[0])
    yield Case(f"B1 T{core.kilo(t)} C{c} W{w}", conv_prefill.Config(), make, (x, weight, h0),
               2 * t * c * 2 + 2 * c * (w - 1) * 2 + c * w * 2, "TB/s")


def _conv_bwd(a: gdn.ConvBwdArgs, ctx) -> Iterator[Case]:
    c, w, t = a.channels, a.width, a.tokens
    shapes = ((1, t, c), (c, w), (1, c, w - 1), (1, t, c), (1, c, w - 1))
    x, weight, h0, dy, dfinal = (
        (jax.random.normal(jax.random.key(i), shape) * (0.5 if i == 1 else 1.0))
        .astype(jnp.bfloat16) for i, shape in enumerate(shapes))
    make = lambda cfg: jax.jit(lambda x, wt, s, dy, df: conv_bwd.backward(
        x, wt, None, s, None, dy, df, activation="silu", config=cfg)[0])
    xla = gdn.conv_vjp(conv_ref.causal_conv1d)
    yield Case(f"B1 T{core.kilo(t)} C{c} W{w} backward", conv_bwd.Config(), make,
               (x, weight, h0, dy, dfinal), 3 * t * c * 2 + 3 * c * (w - 1) * 2 + 2 * c * w * 2,
               "TB/s", ("xla reference jax.vjp", jax.jit(lambda *a: xla(*a)[2]),
                        (x, weight, h0, None, dy, dfinal)))


def _estimate(a: sparse.EstimateArgs, ctx) -> Iterator[Case]:
    n, kh, h, bs, st = a.heads, a.kv_heads, a.head_dim, a.block, a.stride
    make = lambda cfg: jax.jit(lambda q, k: xattn_triton.xattn_estimate(
        q, k, block_size=bs, stride=st, threshold=0.9, config=cfg)[1])
    for s in a.seqs:
        q, k, _ = core.qkv(s + 7, 1, s, n, kh, h)
        yield Case(f"S{core.kilo(s)} stride {st}", xattn_triton.Config(), make, (q, k),
                   2 * n * (s / st) ** 2 / 2 * h * st, "TFLOP/s")


# Default lists: the measured candidates around each kernel's default.
TARGETS = {
    "paged_decode": Target(decode.PagedDecodeArgs, _paged_decode, (
        "", "block_n=64,num_warps=4,num_stages=2,num_splits=2",
        "block_n=128,num_warps=4,num_stages=2,num_splits=2",
        "block_n=128,num_warps=4,num_stages=3,num_splits=2",
        "block_n=128,num_warps=4,num_stages=2,num_splits=4")),
    "mla_decode": Target(mla.MLADecodeArgs, _mla_decode, (
        "", "block_n=32,block_heads=16,num_warps=4,num_stages=2,num_splits=8,reload_value=1",
        "block_n=64,block_heads=64,num_warps=8,num_stages=2")),
    "gdn_decode": Target(gdn.GDNDecodeArgs, _gdn_decode, tuple(
        f"block_hv={bh},num_warps={w}" for bh, w in ((8, 1), (8, 2), (16, 1), (16, 2), (16, 4),
                                                     (32, 2), (32, 4), (32, 8), (64, 4), (64, 8),
                                                     (128, 8)))),
    "causal_conv1d_update": Target(gdn.ConvUpdateArgs, _conv_update, tuple(
        f"block_c={bc},num_warps={w}" for bc, w in ((64, 2), (128, 4), (256, 4), (512, 4),
                                                    (1024, 8)))),
    "flash_prefill": Target(prefill.FlashArgs, _flash, tuple(
        f"block_m={m},block_n={n},num_warps={w},num_stages={st}"
        for m, n, w, st in ((128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 128, 8, 2),
                            (128, 128, 8, 3), (128, 32, 8, 4), (64, 64, 4, 3), (256, 64, 16, 2),
                            (128, 64, 4, 3))), ("", "block_m=16,block_n=16,num_warps=4")),
    "window_prefill": Target(prefill.WindowArgs, _window, (
        "", "block_m=128,block_n=64,num_warps=8,num_stages=3",
        "block_m=128,block_n=128,num_warps=8,num_stages=2"),
        ("", "block_m=16,block_n=16,num_warps=4")),
    "flash_prefill_bwd": Target(prefill.BackwardArgs, _backward, tuple(
        f"dq_block_m={qm},dq_block_n={qn},dkv_block_m={km},dkv_block_n={kn},bwd_num_warps={w},"
        f"bwd_num_stages={st}"
        for qm, qn, km, kn, w, st in ((128, 64, 64, 128, 8, 3), (128, 64, 32, 128, 8, 3),
                                      (128, 64, 64, 128, 8, 2), (128, 128, 64, 128, 8, 3),
                                      (64, 64, 64, 64, 8, 2))),
        ("", "dq_block_m=16,dq_block_n=16,dkv_block_m=16,dkv_block_n=16,bwd_num_warps=4")),
    "paged_prefill": Target(sparse.PagedPrefillArgs, _paged_prefill, (
        "", "block_m=128,block_n=64,num_warps=8,num_stages=3,warp_specialize=0",
        "block_m=128,block_n=128,num_warps=8,num_stages=3",
        "block_m=128,block_n=128,num_warps=8,num_stages=2"),
        ("", "block_m=16,block_n=16,num_warps=4,num_stages=2")),
    "block_sparse_prefill": Target(sparse.BlockSparseArgs, _block_sparse, (
        "", "kv_head_major=0", "warp_specialize=1", "block_n=64")),
    "causal_conv1d": Target(gdn.ConvPrefillArgs, _conv_prefill, (
        "", "block_t=16,block_c=1024", "block_t=8,block_c=1024,num_warps=8", "fast_silu=0")),
    "causal_conv1d_bwd": Target(gdn.ConvBwdArgs, _conv_bwd, (
        "", "prefetch=1", "block_t=8", "block_c=512,num_warps=8", "chunk_t=256", "fast_silu=0"),
        ("", "block_t=4,chunk_t=8,block_c=16")),
    "xattn_estimate": Target(sparse.EstimateArgs, _estimate, (
        "", "fp8=1,block_k=128", "fp8=1,block_k=128,block_c=256")),
}


def fresh(case: Case) -> tuple:
    """`case.args`, its arrays copied when a call donates them (`carry`)."""
    if "carry" not in case.knobs:
        return case.args
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if isinstance(x, jax.Array) else x,
                        case.args)


def sweep(target: str, configs: list[str] | None = None, *, settings: str = "",
          quick: bool = False) -> list[dict]:
    """Time `target`'s kernel under each of `configs` (default: the target's list) at every case
    of its shape; print a table per case and return one dict per (case, config).

    A config that names a field the kernel's `Config` lacks, or that fails to compile or run,
    is reported in its row and the next one runs.

    Raises:
      ValueError: an unknown target, or a bad `--set` item (before anything is timed).
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose from {sorted(TARGETS)}")
    t = TARGETS[target]
    spec = registry.parse_fields(t.spec, settings, t.spec(**t.spec.QUICK) if quick else None)
    configs = list(configs or (t.quick if quick else t.defaults))
    ctx = core.Context(quick=quick)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}  {target}: {spec}", flush=True)
    for case in t.cases(spec, ctx):
        print(case.label, flush=True)
        anchor_ms = None
        if case.anchor is not None:
            name, fn, args = case.anchor
            try:
                anchor_ms = ctx.time(fn, *args)
                print(f"  anchor, {name}: {anchor_ms:.4f} ms", flush=True)
            except Exception as e:  # an anchor that cannot run is reported, not fatal
                print(f"  anchor, {name}: failed: {core.first_line(e)}", flush=True)
        print(f"  {'config':60} {'ms':>9} {case.unit:>8} {'vs first':>8} {'vs anchor':>9} "
              f"{'err':>8}", flush=True)
        first = None
        for text in configs:
            label = text or "default"
            try:
                cfg = registry.parse_fields(type(case.base), text, case.base)
                label = registry.describe_fields(cfg, case.base) if text else "default"
                fn = case.make(cfg)
                out = jax.tree.leaves(fn(*fresh(case)))[0]
                ms = ctx.time(fn, *fresh(case), **case.knobs)
            except Exception as e:  # a field this Config lacks, out of shared memory: go on
                print(f"  {label:60} failed: {core.first_line(e, 120)}", flush=True)
                continue
            first = first or (ms, out)
            err = core.rel_err(out, first[1])
            vs_anchor = f"{anchor_ms / ms:9.3f}" if anchor_ms else " " * 9
            print(f"  {label:60} {ms:9.4f} {case.work / ms / 1e9:8.3f} {first[0] / ms:8.3f} "
                  f"{vs_anchor} {err:8.1e}", flush=True)
            rows.append(dict(case=case.label, config=label, ms=ms, rate=case.work / ms / 1e9,
                             unit=case.unit, anchor_ms=anchor_ms, rel_err_vs_first=err))
    return rows


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m experiments.tools.sweep",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("target", nargs="?", choices=sorted(TARGETS))
    p.add_argument("--config", action="append", default=None,
                   help="kernel Config fields changed from the default, e.g. block_n=64,"
                        "num_warps=4 (repeatable: a row each)")
    p.add_argument("--set", dest="settings", default="", help="shape changes, name=value,...")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the CPU interpreter)")
    p.add_argument("--list", action="store_true", help="targets and their default configs")
    args = p.parse_args(argv)
    if args.list or args.target is None:
        for name, t in TARGETS.items():
            print(f"{name} ({t.spec.__name__}):", *[f"  {c or 'default'}" for c in t.defaults],
                  sep="\n")
        return []
    try:
        return sweep(args.target, args.config, settings=args.settings, quick=args.quick)
    except ValueError as e:
        p.error(str(e))


if __name__ == "__main__":
    main()
