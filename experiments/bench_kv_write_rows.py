"""KV writes into head-major pages (`kv.write_kv`), bf16 and fp8, on the GPU.

Rows (`bench_decode --only kv_write`):

- `kv_write`: one decode token per row written into the paged cache, B64, K8, H128, pages of 64,
  a pool sized for S32K per row, every row at position S - 1 (a page in the middle of the pool).
  bf16: an XLA scatter; bytes = the new K and V read + written. fp8: `write_kv` re-quantises the
  touched sub-block (`fp8.quantize_tokens`, on the GPU the Triton read-modify-write kernel of
  `kv.fp8_triton`): per token and head it reads and rewrites the sub-block's `sub_block` tokens
  of K and V plus their scales, and reads the new token; those bytes count. Ceiling: the copy
  bandwidth measured in the process. Anchor: our paged decode kernel at the same shape (G4, from
  the same run); goal: the write costs <= 5% of the decode step it feeds ("an XLA scatter is fine
  if it keeps up"). The fp8 rows also time the XLA scatter version (`xla_ms`).
- `kv_write_prefill`: a 2K-token chunk of one row written (bf16 and fp8), for information.

Timing: one jitted call runs `STEPS` writes in a `fori_loop` with the pool donated, so every
write updates the pool in place as in the engine; reported `ms` is per write.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import kv
from experiments import _bench

STEPS = 20


def _pool_and_tables(*, batch, kv_heads, head_dim, page, seq, fp8, sub_block):
    max_pages = seq // page
    pool = kv.create_page_pool(num_kv_heads=kv_heads, num_pages=batch * max_pages + 1,
                               page_size=page, head_dim=head_dim,
                               dtype=jnp.float8_e4m3fn if fp8 else jnp.bfloat16,
                               sub_block=sub_block if fp8 else None)
    ids = 1 + np.arange(batch)[:, None] * max_pages + np.arange(max_pages)[None]  # [B, M]
    table = jnp.asarray(np.repeat(ids[:, None], kv_heads, axis=1), jnp.int32)
    tables = kv.BlockTables(table=table, extent=jnp.full((batch, kv_heads), max_pages, jnp.int32),
                            cursor=jnp.zeros((batch, kv_heads), jnp.int32), page_size=page)
    return pool, tables


def _time_write(pool, tables, k, v, offsets, num_new, *, implementation: str = "auto",
                trials: int = 5) -> float:
    """Median ms per `write_kv`, the pool donated and carried from call to call."""
    def steps(pool, k, v):
        return jax.lax.fori_loop(
            0, STEPS, lambda i, p: kv.write_kv(p, tables, k, v, offsets, num_new,
                                               implementation=implementation), pool)

    run = jax.jit(steps, donate_argnums=0)
    pool = jax.tree.map(jnp.copy, pool)  # distinct buffers: the pool's zeros may be shared
    pool = jax.block_until_ready(run(pool, k, v))  # compile + warm up
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        pool = jax.block_until_ready(run(pool, k, v))
        times.append((time.perf_counter() - start) * 1e3 / STEPS)
    return statistics.median(times)


def _case(*, batch, tokens, kv_heads, head_dim, page, seq, fp8, sub_block, implementation="auto"):
    pool, tables = _pool_and_tables(batch=batch, kv_heads=kv_heads, head_dim=head_dim, page=page,
                                    seq=seq, fp8=fp8, sub_block=sub_block)
    key = jax.random.key(7)
    k = jax.random.normal(key, (batch, tokens, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), (batch, tokens, kv_heads, head_dim),
                          jnp.bfloat16)
    offsets = jnp.full((batch,), seq - tokens, jnp.int32)
    num_new = jnp.full((batch,), tokens, jnp.int32)
    ms = _time_write(pool, tables, k, v, offsets, num_new, implementation=implementation)
    new = 2 * batch * tokens * kv_heads * head_dim  # K and V elements written
    if fp8:  # new tokens read (bf16), touched sub-blocks read + rewritten (fp8), scales
        blocks = 2 * batch * kv_heads * -(-tokens // sub_block)
        moved = new * 2 + 2 * blocks * sub_block * head_dim + 2 * blocks * 4
    else:  # new tokens read and written
        moved = new * 2 * 2
    return ms, moved


def kv_write_rows(bw: dict, *, batch: int = 64, kv_heads: int = 8, head_dim: int = 128,
                  page: int = 64, seq: int = 32768, sub_block: int = 16, chunk: int = 2048,
                  decode_ms: dict | None = None) -> list[dict]:
    """`kv_write` (decode token, bf16 / fp8) and `kv_write_prefill` rows.

    `decode_ms`: `{"bf16": ms, "fp8": ms}` of our paged decode at this shape (the anchor).
    """
    rows = []
    decode_ms = decode_ms or {}
    ceiling = bw["ceiling"]
    shape = dict(kv_heads=kv_heads, head_dim=head_dim, page=page, seq=seq, sub_block=sub_block)
    for name, fp8 in (("bf16", False), ("fp8", True)):
        ms, moved = _case(batch=batch, tokens=1, fp8=fp8, **shape)
        xla_ms = _case(batch=batch, tokens=1, fp8=fp8, implementation="xla", **shape)[0] if fp8 \
            else None
        anchor_ms = decode_ms.get(name)
        suffix = f"-sub{sub_block}" if fp8 else ""
        rows.append(_bench.row(
            kernel="kv_write", case=f"B{batch}-S{seq // 1024}K-K{kv_heads}-H{head_dim}-P{page}-"
            f"decode-token-{name}{suffix}", ms=ms, achieved=moved / ms / 1e9, unit="TB/s",
            ceiling=ceiling, anchor=None if anchor_ms is None else f"ours paged decode G4 {name}",
            anchor_ms=anchor_ms, goal="ms <= 0.05 * decode ms (same shape)",
            meets_goal=None if anchor_ms is None else ms <= 0.05 * anchor_ms,
            write_share_of_decode=None if anchor_ms is None else round(ms / anchor_ms, 4),
            xla_ms=xla_ms))
    for name, fp8 in (("bf16", False), ("fp8", True)):
        ms, moved = _case(batch=1, tokens=chunk, fp8=fp8, **shape)
        xla_ms = _case(batch=1, tokens=chunk, fp8=fp8, implementation="xla", **shape)[0] if fp8 \
            else None
        rows.append(_bench.row(
            kernel="kv_write_prefill", case=f"B1-chunk{chunk}-K{kv_heads}-H{head_dim}-P{page}-"
            f"{name}", ms=ms, achieved=moved / ms / 1e9, unit="TB/s", ceiling=ceiling,
            anchor=None, anchor_ms=None, goal="information", meets_goal=None, xla_ms=xla_ms))
    return rows
