"""Every paged / gathered kernel once on hostile inputs, for `compute-sanitizer --tool memcheck`.

    XLA_PYTHON_CLIENT_ALLOCATOR=platform compute-sanitizer --tool memcheck \
        python3 -m tests.attn.sanitize_paged_kernels

Tables hold ids at and far past `num_pages`, large negative ids and int32 max; lengths run past
the table (the longest on the last row, where a read past the table row leaves the table) and
below 0. Runs paged decode (bf16 and fp8 pages; page-tile and token-gather paths; 1 and 3 splits),
paged prefill (both paths, fp8), MLA decode (both paths, fp8), block-sparse prefill (traced
lengths past T / S and negative) and the fp8 KV write (ids outside the pool). XLA's platform
allocator gives every buffer its own allocation, so memcheck sees a read or write past any of
them (with the default pooled allocator a stray access inside the pool would go unseen). Prints
one line per call and whether its outputs are finite where the contract says they must be.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

import jax
import jax.numpy as jnp
import numpy as np

from attn.block_sparse import triton as bs_kernel
from attn.dense import triton_paged as prefill_kernel
from attn.mla import triton as mla_kernel
from attn.paged_decode import triton as decode_kernel
from kv import fp8

K, G, H, P, M, NUM_PAGES, B = 2, 4, 64, 64, 4, 9, 4
BAD_IDS = (NUM_PAGES, NUM_PAGES + 1, 10**6, 2**31 - 1, -2, -(2**31))


def _tables(gen, num_kv):
    """`[B, num_kv, M]`: valid ids mixed with every id of `BAD_IDS` and -1."""
    t = gen.integers(1, NUM_PAGES, (B, num_kv, M)).astype(np.int64)
    bad = np.array(BAD_IDS + (-1,), np.int64)
    mask = gen.random(t.shape) < 0.4
    t[mask] = gen.choice(bad, int(mask.sum()))
    t[:, :, 0] = gen.choice(bad, (B, num_kv))  # every row starts on a bad id
    return jnp.asarray(t.astype(np.int32))


LENGTHS = jnp.asarray([0, M * P + 7, -5, 10**6], jnp.int32)  # the longest on the last row


def _report(name, out, lse):
    out, lse = np.asarray(jnp.asarray(out, jnp.float32)), np.asarray(lse)
    print(f"{name}: ran; out finite {bool(np.isfinite(out).all())}, "
          f"lse finite or -inf {bool((np.isfinite(lse) | np.isneginf(lse)).all())}", flush=True)


def main():
    gen = np.random.default_rng(0)
    bf16 = jnp.bfloat16
    q = jnp.asarray(gen.standard_normal((B, K * G, H)), bf16)
    kp = jnp.asarray(gen.standard_normal((K, NUM_PAGES, P, H)), bf16)
    vp = jnp.asarray(gen.standard_normal((K, NUM_PAGES, P, H)), bf16)
    kq, ks = fp8.quantize(kp, 16)
    vq, vs = fp8.quantize(vp, 16)
    table = _tables(gen, K)
    window = jnp.asarray([[0, 40]] * B, jnp.int32)
    sinks = jnp.asarray([[0, 5]] * B, jnp.int32)
    calls = 0
    for block_n, splits in ((64, 1), (32, 3), (128, 2)):  # page tiles, page tiles, gather
        cfg = decode_kernel.Config(block_n=block_n, num_splits=splits)
        run = jax.jit(lambda *a, cfg=cfg: decode_kernel.paged_decode(
            *a, scale=H**-0.5, window=window, sinks=sinks, config=cfg))
        _report(f"paged_decode bf16 block_n={block_n} splits={splits}",
                *run(q, kp, vp, table, LENGTHS))
        run8 = jax.jit(lambda q, kq, vq, t, n, ks, vs, cfg=cfg: decode_kernel.paged_decode(
            q, kq, vq, t, n, scale=H**-0.5, window=window, sinks=sinks, k_scales=ks,
            v_scales=vs, config=cfg))
        _report(f"paged_decode fp8 block_n={block_n} splits={splits}",
                *run8(q, kq, vq, table, LENGTHS, ks, vs))
        calls += 2

    t = 8
    qp = jnp.asarray(gen.standard_normal((B, t, K * G, H)), bf16)
    offsets = jnp.asarray([0, M * P, -3, 10**6 - t], jnp.int32)
    for cfg in (prefill_kernel.Config(block_m=64, block_n=64, num_stages=2),
                prefill_kernel.Config(block_m=64, block_n=32, page_tiles=False)):
        run = jax.jit(lambda *a, cfg=cfg: prefill_kernel.paged_prefill_attention(
            *a, scale=H**-0.5, window=window, sinks=sinks, config=cfg))
        _report(f"paged_prefill bf16 page_tiles={cfg.page_tiles}",
                *run(qp, kp, vp, table, offsets, LENGTHS))
        run8 = jax.jit(lambda q, kq, vq, tb, o, n, ks, vs, cfg=cfg:
                       prefill_kernel.paged_prefill_attention(
                           q, kq, vq, tb, o, n, scale=H**-0.5, window=window, sinks=sinks,
                           k_scales=ks, v_scales=vs, config=cfg))
        _report(f"paged_prefill fp8 page_tiles={cfg.page_tiles}",
                *run8(qp, kq, vq, table, offsets, LENGTHS, ks, vs))
        calls += 2

    n, l, r = 16, 128, 32
    q_lat = jnp.asarray(gen.standard_normal((B, n, l)), bf16)
    q_pe = jnp.asarray(gen.standard_normal((B, n, r)), bf16)
    latent = jnp.asarray(gen.standard_normal((NUM_PAGES, P, l + r)), bf16)
    lq, lsc = fp8.quantize(latent, 16)
    mla_table = _tables(gen, 1)[:, 0]
    for cfg in (mla_kernel.Config(block_n=32, num_splits=2),
                mla_kernel.Config(block_n=32, num_splits=1, page_tiles=False)):
        run = jax.jit(lambda *a, cfg=cfg: mla_kernel.mla_paged_decode(
            *a, kv_lora_rank=l, scale=0.1, config=cfg))
        _report(f"mla_decode bf16 page_tiles={cfg.page_tiles}",
                *run(q_lat, q_pe, latent, mla_table, LENGTHS))
        run8 = jax.jit(lambda a, b_, c, d, e, s, cfg=cfg: mla_kernel.mla_paged_decode(
            a, b_, c, d, e, kv_lora_rank=l, scale=0.1, latent_scales=s, config=cfg))
        _report(f"mla_decode fp8 page_tiles={cfg.page_tiles}",
                *run8(q_lat, q_pe, lq, mla_table, LENGTHS, lsc))
        calls += 2

    tq, s = 192, 256
    qb = jnp.asarray(gen.standard_normal((B, tq, K * G, H)), bf16)
    kb = jnp.asarray(gen.standard_normal((B, s, K, H)), bf16)
    modes = jnp.asarray(np.tile(np.array([0, 0, -1, -1, 0, 0, -1, -1], np.int32), (B, 1)))
    run = jax.jit(lambda q, k, v, ql, kl: bs_kernel.block_sparse_attention(
        q, k, v, modes, None, block_size=64, sink_blocks=1, local_blocks=1, q_lengths=ql,
        kv_lengths=kl, config=bs_kernel.Config(block_m=64, block_n=64, num_stages=2)))
    _report("block_sparse traced lengths past T / S and negative",
            *run(qb, kb, kb, jnp.asarray([tq, 10**6, -4, 7], jnp.int32),
                 jnp.asarray([s, 10**6, 3, -9], jnp.int32)))
    calls += 1

    x = jnp.asarray(gen.standard_normal((6, K, H)), jnp.float32)
    ids = jnp.asarray([[NUM_PAGES, 1], [10**6, -2], [2**31 - 1, NUM_PAGES + 1], [-(2**31), 2],
                       [3, 10**6], [-1, -1]], jnp.int32)
    offs = jnp.asarray([0, 1, 2, P - 1, 5, P + 9], jnp.int32)
    new_k, _ = jax.jit(lambda *a: fp8.quantize_tokens(*a, implementation="triton"))(
        kq, ks, x, ids, offs)
    touched = np.zeros((K, NUM_PAGES), bool)
    touched[1, 1] = touched[1, 2] = touched[0, 3] = True
    same = (np.asarray(new_k).view(np.uint8)[~touched] == np.asarray(kq).view(np.uint8)[~touched])
    print(f"fp8 write ids outside the pool: ran; untouched pages bitwise equal {bool(same.all())}",
          flush=True)
    calls += 1
    print(f"done: {calls} kernel calls", flush=True)


if __name__ == "__main__":
    main()
