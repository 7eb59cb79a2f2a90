"""KV writes into head-major pages (`kv.write_kv`), bf16 and fp8 (`kv_write`).

- `kv_write`: one decode token per row written into the paged cache, B64, K8, H128, pages of 64,
  a pool sized for S32K per row, every row at position S - 1 (a page in the middle of the pool).
  bf16: an XLA scatter; bytes = the new K and V read + written. fp8: `write_kv` re-quantises the
  touched sub-block (on the GPU the Triton read-modify-write kernel of `kv.fp8_triton`): per
  token and head it reads and rewrites the sub-block's `sub_block` tokens of K and V plus their
  scales, and reads the new token; those bytes count. Ceiling: the copy bandwidth. Anchor: our
  paged decode at the same shape (G4; the `paged_decode` group's time when it ran in the same
  process, else measured here); goal: the write costs <= 5% of the decode step it feeds. The fp8
  rows also time the XLA scatter version (`xla_ms`).
- `kv_write_prefill`: a `chunk`-token chunk of one row written (bf16 and fp8), for information.

Timing: one jitted call runs `STEPS` writes in a `fori_loop` with the pool donated, so every
write updates the pool in place as in the engine; `ms` is per write.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import kv
from experiments.bench import core, decode
from experiments.bench.registry import register

STEPS = 20


@dataclasses.dataclass(frozen=True, kw_only=True)
class KVWriteArgs:
    """The paged decode rows' shape: B64, S32K, K8, H128, pages of 64; a 2K prefill chunk."""

    batch: int = 64
    seq: int = 32768
    kv_heads: int = 8
    head_dim: int = 128
    page: int = 64
    sub_block: int = 16
    chunk: int = 2048
    QUICK: ClassVar[dict] = dict(batch=2, seq=256, page=16, chunk=128)


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


def _case(ctx, *, batch, tokens, kv_heads, head_dim, page, seq, fp8, sub_block,
          implementation="auto"):
    """`(ms per write, bytes moved per write)` of `tokens` new tokens per row."""
    pool, tables = _pool_and_tables(batch=batch, kv_heads=kv_heads, head_dim=head_dim, page=page,
                                    seq=seq, fp8=fp8, sub_block=sub_block)
    key = jax.random.key(7)
    k = jax.random.normal(key, (batch, tokens, kv_heads, head_dim), jnp.bfloat16)
    v = jax.random.normal(jax.random.fold_in(key, 1), (batch, tokens, kv_heads, head_dim),
                          jnp.bfloat16)
    offsets = jnp.full((batch,), seq - tokens, jnp.int32)
    num_new = jnp.full((batch,), tokens, jnp.int32)

    def steps(pool, k, v):
        return jax.lax.fori_loop(
            0, STEPS, lambda i, p: kv.write_kv(p, tables, k, v, offsets, num_new,
                                               implementation=implementation), pool)

    run = jax.jit(steps, donate_argnums=0)
    pool = jax.tree.map(jnp.copy, pool)  # distinct buffers: the pool's zeros may be shared
    ms = ctx.time(run, pool, k, v, iters=1, trials=5, warmup=1, budget_s=None, steps=STEPS,
                  carry=lambda out, args: (out, *args[1:]))
    new = 2 * batch * tokens * kv_heads * head_dim  # K and V elements written
    if fp8:  # new tokens read (bf16), touched sub-blocks read + rewritten (fp8), scales
        blocks = 2 * batch * kv_heads * -(-tokens // sub_block)
        moved = new * 2 + 2 * blocks * sub_block * head_dim + 2 * blocks * 4
    else:  # new tokens read and written
        moved = new * 2 * 2
    return ms, moved


@register("kv_write", KVWriteArgs)
def kv_write_rows(a: KVWriteArgs, ctx: core.Context):
    """KV writes of a decode token (against our paged decode) and of a prefill chunk."""
    ceiling = ctx.copy_tbs["ceiling"]
    shape = dict(kv_heads=a.kv_heads, head_dim=a.head_dim, page=a.page, seq=a.seq,
                 sub_block=a.sub_block)
    decode_ms = decode.g4_ms(ctx, batch=a.batch, **shape)
    for name, fp8 in (("bf16", False), ("fp8", True)):
        ms, moved = _case(ctx, batch=a.batch, tokens=1, fp8=fp8, **shape)
        xla_ms = (_case(ctx, batch=a.batch, tokens=1, fp8=fp8, implementation="xla", **shape)[0]
                  if fp8 else None)
        anchor_ms = decode_ms[name]
        suffix = f"-sub{a.sub_block}" if fp8 else ""
        yield core.row(
            kernel="kv_write", case=f"B{a.batch}-S{core.kilo(a.seq)}-K{a.kv_heads}-"
            f"H{a.head_dim}-P{a.page}-decode-token-{name}{suffix}", ms=ms,
            achieved=moved / ms / 1e9, unit="TB/s", ceiling=ceiling,
            anchor=f"ours paged decode G4 {name}", anchor_ms=anchor_ms,
            goal="ms <= 0.05 * decode ms (same shape)", meets_goal=ms <= 0.05 * anchor_ms,
            write_share_of_decode=round(ms / anchor_ms, 4), xla_ms=xla_ms)
    for name, fp8 in (("bf16", False), ("fp8", True)):
        ms, moved = _case(ctx, batch=1, tokens=a.chunk, fp8=fp8, **shape)
        xla_ms = (_case(ctx, batch=1, tokens=a.chunk, fp8=fp8, implementation="xla", **shape)[0]
                  if fp8 else None)
        yield core.row(
            kernel="kv_write_prefill", case=f"B1-chunk{a.chunk}-K{a.kv_heads}-H{a.head_dim}-"
            f"P{a.page}-{name}", ms=ms, achieved=moved / ms / 1e9, unit="TB/s", ceiling=ceiling,
            anchor=None, anchor_ms=None, goal="information", meets_goal=None, xla_ms=xla_ms)
