"""Where the block-sparse prefill's time goes: the op as the `block_sparse_prefill` bench rows time
it, its work before the launch alone (the effective block mask and the per-row block lists: `lists`
as the op makes them, on a GPU the Triton lists kernel; `lis_xla` the XLA form the CPU uses), and
the kernel alone on lists made beforehand (for each `--config`), next to our dense flash at the
same length (the goal's anchor).

    python -m experiments.tools.profile_sparse          # S64K, density 0.1 (GPU)
    python -m experiments.tools.profile_sparse --seqs 65536,131072 --density 0.1
    python -m experiments.tools.profile_sparse --config warp_specialize=1 --config num_stages=2
    python -m experiments.tools.profile_sparse --quick  # tiny, CPU interpreter

Shapes and masks are the `block_sparse_prefill` rows' (N32 / K8 / H128 bf16, blocks of 128,
a random mask of about `--density` with the diagonal and the sink column kept). Times: median
of `experiments.bench.core.time_ms` trials. `ms / (density x dense)` is the goal's ratio (<= 1.15).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

if "--quick" in sys.argv:  # before jax is imported: the interpreter on the CPU
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

import attn  # noqa: F401  (sets up Triton before its first import)
from attn.block_sparse import reference as sparse_ref
from attn.block_sparse import triton as sparse_triton
from attn.block_sparse.api import block_sparse_attention
from attn.dense import triton as dense_triton
from experiments.bench import core, registry
from experiments.bench.sparse import sparse_mask

HEADS = dict(n=32, kh=8, h=128)
QUICK_HEADS = dict(n=4, kh=2, h=32)


def parts(s: int, density: float, configs: list[str], *, n: int, kh: int, h: int, bs: int,
          timing: dict) -> list[dict]:
    """At length `s`: the op, its XLA lists and dense flash (ms) once, then the kernel alone per
    config (`default_config`'s fields changed by each `"name=value,..."`; "" is the default),
    with the measured density and whether the kernel's output is the op's bit for bit."""
    q, k, v = core.qkv(s + 1, 1, s, n, kh, h)
    mask = sparse_mask(int(density * 1000) + s, n, s, bs, density)
    modes = jnp.ones((1, n), jnp.int32)
    lengths = jnp.full((1,), s, jnp.int32)
    base = sparse_triton.default_config(h)

    op = jax.jit(lambda q, k, v, mask: block_sparse_attention(
        q, k, v, modes, mask, block_size=bs, implementation="triton")[0])

    @functools.partial(jax.jit, static_argnames="use_kernel")
    def lists(mask, use_kernel=None):
        eff = sparse_ref.effective_block_mask(modes, mask, num_q_tokens=s, num_kv_tokens=s,
                                              block_size=bs)
        return sparse_triton.block_lists(eff, lengths, lengths, bs, use_kernel=use_kernel)

    dense = jax.jit(lambda q, k, v: dense_triton.attention(q, k, v)[0])
    blocks, count, whole = lists(mask)
    sb = mask.shape[-1]
    got = float(jnp.sum(count)) / (n * sb * (sb + 1) / 2)
    expected = op(q, k, v, mask)
    shared = dict(s=s, density=got, op=core.time_ms(op, q, k, v, mask, **timing),
                  lists=core.time_ms(lists, mask, **timing),
                  lists_xla=core.time_ms(functools.partial(lists, use_kernel=False), mask,
                                           **timing),
                  dense=core.time_ms(dense, q, k, v, **timing))
    rows = []
    for text in configs:
        config = dataclasses.replace(base, **registry.parse_changes(sparse_triton.Config, text))
        kernel = jax.jit(lambda q, k, v, blocks, count, whole, config=config: sparse_triton._launch(
            q, k, v, blocks, count, whole, lengths, lengths, scale=h**-0.5, block_size=bs,
            config=config)[0])
        out = kernel(q, k, v, blocks, count, whole)
        rows.append(dict(shared, config=text or "default",
                         kernel=core.time_ms(kernel, q, k, v, blocks, count, whole, **timing),
                         same=bool(jnp.array_equal(out, expected)),
                         err=core.rel_err(out, expected),
                         steps=int(jnp.sum(count)) * (bs // min(config.block_n, bs)),
                         programs=n * -(-s // min(config.block_m, bs))))
    return rows


def format_row(r: dict) -> str:
    ideal = r["density"] * r["dense"]
    return (f"S{r['s']:<7d} {r['config'][:34]:34s} {r['density']:.4f} {r['op']:8.3f} "
            f"{r['lists']:7.3f} {r['lists_xla']:7.3f} {r['kernel']:8.3f} {r['dense']:9.3f} "
            f"{r['op'] / ideal:7.3f} {(r['kernel'] + r['lists']) / ideal:9.3f} "
            f"{r['steps']:8d} {r['same']!s:5s} {r['err']:.1e}")


HEADER = ("S        config                             density       op   lists lis_xla   kernel"
          "     dense op/goal k+l/goal    steps same  rel_err")


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default=None, help="comma list of lengths (default 65536)")
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--config", action="append", default=[],
                   help="kernel Config fields changed from default_config's, e.g. "
                        "warp_specialize=1 (repeatable: a row each, after the default's)")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--quick", action="store_true", help="tiny shapes, CPU interpreter")
    args = p.parse_args(argv)
    heads = QUICK_HEADS if args.quick else HEADS
    bs = 16 if args.quick else args.block
    seqs = [int(x) for x in args.seqs.split(",")] if args.seqs else (
        [96] if args.quick else [65536])
    timing = dict(iters=1, trials=1, warmup=1) if args.quick else dict(iters=5, trials=5)
    print(f"device: {jax.devices()[0].device_kind}  heads: {heads}  block: {bs}", flush=True)
    configs = [""] + args.config
    for text in args.config:  # a bad field fails here, before anything is timed
        registry.parse_fields(sparse_triton.Config, text)
    rows = [r for s in seqs for r in parts(s, args.density, configs, bs=bs, timing=timing,
                                           **heads)]
    print("(ms; goal = density x dense, <= 1.15 to meet it; k+l: the kernel alone plus the lists; "
          "`same`: the kernel's output is the op's bit for bit)")
    print(HEADER)
    for r in rows:
        print(format_row(r), flush=True)
    return rows


if __name__ == "__main__":
    main()
