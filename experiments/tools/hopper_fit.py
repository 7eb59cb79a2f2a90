"""Shared memory (and registers, spills) of the Triton launches, compiled for Hopper (sm_90) on any
machine: whether each op's default tiles fit in an H100 / H200 block's 227 KiB at a dtype and head
dim, without a GPU.

    python -m experiments.tools.hopper_fit [--ops dense,block_sparse,...]
        [--dtypes bfloat16,float32] [--heads 64,128,256]

Each op is traced (`jax.eval_shape`, forward and, where it has one, gradient) at a small shape
with `attn._harness.recorded_launches`; each distinct launch is compiled by Triton's compiler and
ptxas (`attn._harness.hopper_resources`, a few seconds each). Prints one row per launch (or
the reason the op's Triton backend refuses the case) and exits 1 if any launch needs more than
`attn._harness.HOPPER_SHARED_MEMORY` (the GPU would refuse it: "Shared memory requested ...
exceeds device resources"). Tile choices depend on the dtype
and head dim (`attn.dense._flash_tiles.wide_rows`), not on the sequence lengths.

Triton must compile here, not interpret: the tool sets `TRITON_INTERPRET=0` before anything
imports triton, so run it as its own process (`tests/attn/test_hopper_fit.py` does).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # before `attn` decides for the CPU interpreter

import argparse
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp

from attn import _harness
from attn.block_sparse import block_sparse_attention
from attn.conv1d import causal_conv1d
from attn.dense import attention, paged_prefill_attention
from attn.gdn import gdn_chunked, gdn_decode_pool
from attn.mla import mla_paged_decode
from attn.paged_decode import paged_decode
from attn.xattention import xattn_estimate

_T, _N, _K, _PAGE = 512, 8, 2, 64  # shapes to trace at: the tiles do not depend on them


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _dense(dtype, h):
    def fn(q, k, v):
        return attention(q, k, v, causal=True, implementation="triton")[0]
    return fn, (_sds((1, _T, _N, h), dtype), *[_sds((1, _T, _K, h), dtype)] * 2), True


def _block_sparse(dtype, h):
    modes = jnp.ones((1, _N), jnp.int32)
    mask = jnp.ones((1, _N, _T // 128, _T // 128), bool)

    def fn(q, k, v):
        return block_sparse_attention(q, k, v, modes, mask, block_size=128,
                                      implementation="triton")[0]
    return fn, (_sds((1, _T, _N, h), dtype), *[_sds((1, _T, _K, h), dtype)] * 2), True


def _paged_prefill(dtype, h):
    pages = _T // _PAGE
    tables = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32), (1, _K, pages))

    def fn(q, k_pages, v_pages):
        return paged_prefill_attention(q, k_pages, v_pages, tables, 0,
                                       jnp.full((1,), _T, jnp.int32),
                                       implementation="triton")[0]
    # Its gradient is the reference's: no Triton launch.
    return fn, (_sds((1, _T, _N, h), dtype), *[_sds((_K, pages, _PAGE, h), dtype)] * 2), False


def _paged_decode(dtype, h):  # forward only; 4 splits: the partials and their merge
    pages = _T // _PAGE
    tables = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32), (2, _K, pages))

    def fn(q, k_pages, v_pages):
        return paged_decode(q, k_pages, v_pages, tables, jnp.asarray([_T, _T // 2], jnp.int32),
                            num_splits=4, implementation="triton")[0]
    return fn, (_sds((2, _N, h), dtype), *[_sds((_K, pages, _PAGE, h), dtype)] * 2), False


def _fp8_pools(h):
    """K / V e4m3 page pools with their float32 scales (sub-blocks of 16 tokens)."""
    pages = _T // _PAGE
    pool = _sds((_K, pages, _PAGE, h), jnp.float8_e4m3fn)
    return pool, _sds((_K, pages, _PAGE // 16), jnp.float32)


def _paged_prefill_fp8(dtype, h):  # forward only
    pages = _T // _PAGE
    tables = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32), (1, _K, pages))

    def fn(q, k_pages, v_pages, k_scales, v_scales):
        return paged_prefill_attention(q, k_pages, v_pages, tables, 0,
                                       jnp.full((1,), _T, jnp.int32), k_scales=k_scales,
                                       v_scales=v_scales, implementation="triton")[0]
    pool, scales = _fp8_pools(h)
    return fn, (_sds((1, _T, _N, h), dtype), pool, pool, scales, scales), False


def _paged_decode_fp8(dtype, h):  # forward only
    pages = _T // _PAGE
    tables = jnp.broadcast_to(jnp.arange(pages, dtype=jnp.int32), (2, _K, pages))

    def fn(q, k_pages, v_pages, k_scales, v_scales):
        return paged_decode(q, k_pages, v_pages, tables, jnp.asarray([_T, _T // 2], jnp.int32),
                            k_scales=k_scales, v_scales=v_scales, num_splits=4,
                            implementation="triton")[0]
    pool, scales = _fp8_pools(h)
    return fn, (_sds((2, _N, h), dtype), pool, pool, scales, scales), False


def _gdn_decode(dtype, h):  # one decode step on the state slot pool; forward only
    f32, slots = jnp.float32, 4
    slot_ids = jnp.asarray([1, 3], jnp.int32)

    def fn(q, k, v, g, beta, pool):
        return gdn_decode_pool(q, k, v, g, beta, pool, slot_ids, use_qk_l2norm=True,
                               implementation="triton")[0]
    return fn, (*[_sds((2, 1, _K, h), dtype)] * 2, _sds((2, 1, _N, h), dtype),
                *[_sds((2, 1, _N), f32)] * 2, _sds((slots, _N, h, h), f32)), False


def _xattn_estimate(dtype, h):  # forward only (a block mask)
    def fn(q, k):
        return xattn_estimate(q, k, implementation="triton")[0]
    return fn, (_sds((1, _T, _N, h), dtype), _sds((1, _T, _K, h), dtype)), False


def _gdn_chunked(dtype, h):
    f32 = jnp.float32

    def fn(q, k, v, g, beta):
        return gdn_chunked(q, k, v, g, beta, use_qk_l2norm=True, implementation="triton")[0]
    return fn, (*[_sds((1, _T, _K, h), dtype)] * 2, _sds((1, _T, _N, h), dtype),
                *[_sds((1, _T, _N), f32)] * 2), True


def _mla_decode(dtype, h):  # DeepSeek's latent 512 + rope 64 at every head dim; forward only
    del h
    latent, rope, pages = 512, 64, _T // _PAGE
    tables = jnp.arange(2 * pages, dtype=jnp.int32).reshape(2, pages)

    def fn(q_lat, q_pe, latent_pages):
        return mla_paged_decode(q_lat, q_pe, latent_pages, tables,
                                jnp.asarray([_T, _T // 2], jnp.int32), kv_lora_rank=latent,
                                num_splits=4, implementation="triton")[0]
    return fn, (_sds((2, _N, latent), dtype), _sds((2, _N, rope), dtype),
                _sds((2 * pages + 1, _PAGE, latent + rope), dtype)), False


def _conv1d(dtype, h):  # 16 h channels, width 4, silu (the GDN models' short conv)
    channels = 16 * h

    def fn(x, weight, bias):
        return causal_conv1d(x, weight, bias, activation="silu", implementation="triton")[0]
    return fn, (_sds((1, _T, channels), dtype), _sds((channels, 4), dtype),
                _sds((channels,), dtype)), True


OPS: dict[str, Callable] = {"dense": _dense, "block_sparse": _block_sparse,
                            "paged_prefill": _paged_prefill, "paged_decode": _paged_decode,
                            "xattn_estimate": _xattn_estimate, "gdn_chunked": _gdn_chunked,
                            "mla_decode": _mla_decode, "conv1d": _conv1d,
                            "paged_prefill_fp8": _paged_prefill_fp8,
                            "paged_decode_fp8": _paged_decode_fp8, "gdn_decode": _gdn_decode}


def launches(op: str, dtype, h: int, *, grad: bool = True) -> list[_harness.Launch]:
    """The distinct Triton launches of `op`'s forward (and with `grad` its gradient's) at
    `dtype` and head dim `h`, in trace order."""
    fn, args, differentiable = OPS[op](dtype, h)

    def with_grad(*primals):  # a custom VJP's forward may launch other kernels than inference's
        out, vjp = jax.vjp(fn, *primals)
        return out, vjp(jnp.ones_like(out))

    with _harness.recorded_launches() as recorded:
        jax.eval_shape(fn, *args)
        if grad and differentiable:
            jax.eval_shape(with_grad, *args)
    return list(dict.fromkeys(recorded))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--heads", default="64,128,256")
    args = parser.parse_args(argv)
    limit = _harness.HOPPER_SHARED_MEMORY
    print(f"{'op':18s} {'dtype':9s} {'H':>4s}  {'kernel':28s} {'warps':>5s} {'stages':>6s} "
          f"{'regs':>4s} {'spills B':>8s} {'shared KiB':>10s}  fits ({limit // 1024} KiB)",
          flush=True)
    over = 0
    for op in args.ops.split(","):
        if op not in OPS:
            parser.error(f"--ops: {op!r} is not one of {sorted(OPS)}")
        for dtype_name in args.dtypes.split(","):
            dtype = jnp.dtype(dtype_name)
            for h in (int(x) for x in args.heads.split(",")):
                try:
                    found = launches(op, dtype, h)
                except NotImplementedError as e:  # the Triton backend refuses: XLA runs it
                    print(f"{op:18s} {dtype_name:9s} {h:4d}  refused: "
                          f"{str(e).splitlines()[0][:140]}", flush=True)
                    continue
                for launch in found:
                    use = _harness.hopper_resources(launch)
                    over += use["shared"] > limit
                    print(f"{op:18s} {dtype_name:9s} {h:4d}  {launch.name:28s} "
                          f"{launch.num_warps:5d} {launch.num_stages:6d} {use['registers']:4d} "
                          f"{use['spill_stores']:8d} {use['shared'] / 1024:10.1f}  "
                          f"{'yes' if use['shared'] <= limit else 'NO'}", flush=True)
    if over:
        print(f"{over} launch(es) need more shared memory than a Hopper block has")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
