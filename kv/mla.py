"""MLA latent page pool: one latent head of `[c_kv ‖ k_pe]` per token, written by slot mapping.

Layout (conventions): `pages: [num_pages, P, L + R]`, features `[:L]` the compressed KV `c_kv`,
`[L:]` the decoupled RoPE key `k_pe`; block tables `[B, max_pages]` int32 (-1 = unallocated).
Token `s` of row `b` has the flat slot `table[b, s // P] * P + s % P`; the write scatters by slot.

A latent pool has a single head, so it uses the page allocator with `K = 1`
(`create_allocator(num_kv_heads=1, ...)`, `create_block_tables(num_kv_heads=1, ...)`) and passes
`tables.table[:, 0]` here. It is replicated, not sharded: every query head reads the one latent.

Not supported: an FP8 latent cache (FlashMLA's `fp8_ds_mla`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Float, Int

from kv import _validate as v_
from kv.pages import UNALLOCATED


@struct.dataclass
class LatentPool:
    """Paged MLA latent cache.

    Attributes:
      pages: `[num_pages, P, L + R]`; page 0 is null (never written).
      kv_lora_rank: `L`, static; the rope part is the remaining `R` features.
    """

    pages: Float[Array, "num_pages P LR"]
    kv_lora_rank: int = struct.field(pytree_node=False)

    @property
    def num_pages(self) -> int:
        return self.pages.shape[0]

    @property
    def page_size(self) -> int:
        return self.pages.shape[1]

    @property
    def rope_dim(self) -> int:
        return self.pages.shape[2] - self.kv_lora_rank


def create_latent_pool(
    *, num_pages: int, page_size: int, kv_lora_rank: int, rope_dim: int, dtype=jnp.bfloat16
) -> LatentPool:
    """A zero-filled latent pool `[num_pages, P, L + R]`.

    Raises:
      TypeError: non-int sizes or a non-float dtype.
      ValueError: non-positive sizes, fewer than 2 pages, or `num_pages * P` beyond int32 (slot
        ids are int32).
    """
    num_pages = v_.check_positive_int("num_pages", num_pages, minimum=2)
    page_size = v_.check_positive_int("page_size", page_size)
    kv_lora_rank = v_.check_positive_int("kv_lora_rank", kv_lora_rank)
    rope_dim = v_.check_positive_int("rope_dim", rope_dim, minimum=0)
    dtype = v_.check_float_dtype("dtype", dtype, min_bits=16)
    v_.check_int32_slots("num_pages * page_size", num_pages * page_size)
    return LatentPool(pages=jnp.zeros((num_pages, page_size, kv_lora_rank + rope_dim), dtype),
                      kv_lora_rank=kv_lora_rank)


def latent_slot_mapping(
    table: Int[Array, "B max_pages"],
    offsets: Int[Array, "B"],  # noqa: F821
    num_new: Int[Array, "B"],  # noqa: F821
    *,
    num_tokens: int,
    page_size: int,
) -> Int[Array, "B T"]:
    """Flat slots of new token `t` of row `b` at position `offsets[b] + t`; -1 for padding.

    Tokens with `t >= num_new[b]`, negative positions, positions beyond the table, or an
    unallocated page get -1.
    """
    v_.check_rank("table", table, 2, "B max_pages")
    v_.check_integer("table", table)
    batch, max_pages = table.shape
    offsets = v_.as_int_array("offsets", offsets, (batch,), "B")
    num_new = v_.as_int_array("num_new", num_new, (batch,), "B")
    num_tokens = v_.check_positive_int("num_tokens", num_tokens)
    page_size = v_.check_positive_int("page_size", page_size)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    pos = offsets[:, None] + t[None, :]
    valid = (t[None, :] < num_new[:, None]) & (pos >= 0) & (pos < max_pages * page_size)
    logical = jnp.where(valid, pos // page_size, 0)
    page = jnp.take_along_axis(table.astype(jnp.int32), logical, axis=1)
    valid &= page >= 1
    return jnp.where(valid, page * page_size + pos % page_size, UNALLOCATED)


def write_latent(
    pool: LatentPool,
    c_kv: Float[Array, "*T L"],
    k_pe: Float[Array, "*T R"],
    slot_mapping: Int[Array, "*T"],
) -> LatentPool:
    """Scatter `[c_kv ‖ k_pe]` of each token into its flat slot.

    A slot outside `[P, num_pages * P)` — -1 padding, garbage, or the null page 0 — is dropped
    (its index becomes `num_pages` with `mode="drop"`): a negative slot never reaches the scatter,
    where it would wrap to the last page. Two real tokens must not share a slot.

    Args:
      pool: the latent pool. Donate it when jitting for an in-place update.
      c_kv: `[*T, L]` compressed KV (any leading token shape, e.g. `[B, T]`).
      k_pe: `[*T, R]` RoPE keys.
      slot_mapping: `[*T]` int flat slots (`latent_slot_mapping`).

    Returns:
      The updated `LatentPool`.

    Raises:
      TypeError: wrong dtypes.
      ValueError: shapes inconsistent with each other or the pool.
    """
    v_.check_instance("pool", pool, LatentPool)
    v_.check_floating("c_kv", c_kv)
    v_.check_floating("k_pe", k_pe)
    slot_mapping = jnp.asarray(slot_mapping)
    v_.check_integer("slot_mapping", slot_mapping)
    lead = slot_mapping.shape
    v_.check_shape("c_kv", c_kv, lead + (pool.kv_lora_rank,), "*T L")
    v_.check_shape("k_pe", k_pe, lead + (pool.rope_dim,), "*T R")
    size = pool.page_size
    slots = slot_mapping.reshape(-1).astype(jnp.int32)
    valid = (slots >= size) & (slots < pool.num_pages * size)
    page = jnp.where(valid, slots // size, pool.num_pages)  # out of bounds: dropped
    off = jnp.where(valid, slots % size, 0)
    rows = jnp.concatenate([c_kv.reshape(-1, pool.kv_lora_rank),
                            k_pe.reshape(-1, pool.rope_dim)], axis=-1)
    return pool.replace(
        pages=pool.pages.at[page, off].set(rows.astype(pool.pages.dtype), mode="drop"))


def gather_latent(pool: LatentPool, table: Int[Array, "B max_pages"]) -> Float[Array, "B S LR"]:
    """Dense `[B, S, L + R]` latent view, `S = max_pages * P`; -1 entries read the null page."""
    v_.check_instance("pool", pool, LatentPool)
    v_.check_rank("table", table, 2, "B max_pages")
    v_.check_integer("table", table)
    ok = (table >= 1) & (table < pool.num_pages)
    x = pool.pages[jnp.where(ok, table, 0)]  # [B, max_pages, P, L + R]
    return x.reshape(table.shape[0], -1, x.shape[-1])
