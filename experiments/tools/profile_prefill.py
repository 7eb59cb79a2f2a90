"""Profiles of two prefill kernels, launch by launch (GPU; `--quick`: tiny shapes through the CPU
interpreter). Prints tables; writes nothing. Launch-config sweeps are `experiments.tools.sweep`.

    python -m experiments.tools.profile_prefill xattn
    python -m experiments.tools.profile_prefill conv1d [--tile block_t=8,block_c=512,...]...

- xattn: the XAttention estimate at S64K and S128K (N32 / K8 / H128 bf16, stride 16, block 128):
  the exact (bf16) score kernel and the e4m3 variants (wider tiles, the public op's
  `FP8_CONFIG`, the Mosaic GPU score kernel at a few tile / stage counts), each with its block
  mask's agreement with the bf16 one; then its launches one by one (the e4m3 pass over q and k
  against the copy bandwidth of their bytes; the scores + block sums) and the block selection
  alone (the reference's XLA sorts against the selection kernel at 1-8 warps).
- conv1d: causal conv1d prefill's data-movement bound: `y = x` moved exactly as the row kernel
  moves it (a program's `block_t` rows of `block_c` channels all loaded, then stored, programs
  in its order), B1 T32K C = 8192 bf16, against the copy bandwidth; one row per `--tile`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import attn  # noqa: F401  (sets up Triton before its first import)

# isort: split
import triton
import triton.language as tl

from attn._harness import triton_call
from attn.block_sparse import reference as sparse_ref
from attn.xattention import reference as xattn_ref
from attn.xattention import triton as xattn_triton
from experiments.bench import core, registry

N, KH, H = 32, 8, 128


def _time(fn, *args, quick):
    return core.time_ms(fn, *args, **(dict(iters=1, trials=1, warmup=1) if quick
                                      else dict(budget_s=1.0)))


def xattn(quick):
    seqs = (256,) if quick else (65536, 131072)
    n, kh, h = (4, 2, 32) if quick else (N, KH, H)
    C, MC = xattn_triton.Config, xattn_triton.mosaic_scores.Config
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
        q, k, _ = core.qkv(s + 7, 1, s, n, kh, h)
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
                  f"{agree:.4f}  block-sum rel err {core.rel_err(sums, base[1]):.1e}",
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
    ceiling = core.copy_bandwidth_tbs(1 << 20 if quick else 1 << 30)["ceiling"]
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
    if C_FASTEST:  # one grid axis, channel blocks side by side
        tb = tl.program_id(0) // NC
        cb = tl.program_id(0) % NC
    else:
        tb = tl.program_id(0)
        cb = tl.program_id(1)
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class CopyTile:
    """A program's tile of the conv1d row kernel: `block_t` rows x `block_c` channels."""

    block_t: int = 8
    block_c: int = 512
    num_warps: int = 4
    channels_fastest: bool = True


def conv1d(tiles: list[str], quick: bool) -> None:
    """The row kernel's loads and stores alone (`y = x`) per tile, against the copy ceiling."""
    t, c = (40, 32) if quick else (32768, 8192)
    gen = np.random.default_rng(0)
    x = jnp.asarray(gen.standard_normal((1, t, c), np.float32), jnp.bfloat16)
    ceiling = core.copy_bandwidth_tbs(1 << 20 if quick else 4 << 30)["ceiling"]
    print(f"copy ceiling {ceiling:.3f} TB/s; B1 T{t} C{c} bf16", flush=True)
    for text in tiles:
        tile = registry.parse_fields(CopyTile, text)
        fn = jax.jit(functools.partial(_copy_rows, block_t=tile.block_t, block_c=tile.block_c,
                                       num_warps=tile.num_warps,
                                       c_fastest=tile.channels_fastest))
        ms = _time(fn, x, quick=quick)
        tbs = 2 * x.size * x.dtype.itemsize / ms / 1e9
        print(f"  {registry.describe_fields(tile):40} {ms:9.4f} ms  {tbs:6.3f} TB/s = "
              f"{tbs / ceiling:.3f} of copy", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.tools.profile_prefill",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("kernel", choices=("xattn", "conv1d"))
    parser.add_argument("--tile", action="append", default=None,
                        help="conv1d: CopyTile fields, e.g. block_t=8,block_c=1024 (repeatable)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU interpreter)")
    args = parser.parse_args(argv)
    if args.kernel == "xattn":
        return xattn(args.quick)
    tiles = args.tile or (["block_c=16", "block_c=16,channels_fastest=0"] if args.quick
                          else ["", "block_c=1024", "channels_fastest=0"])
    for text in tiles:  # a bad field fails here, before anything is timed
        registry.parse_fields(CopyTile, text)
    conv1d(tiles, args.quick)


if __name__ == "__main__":
    main()
