"""MLA latent pool: slot mapping from a K = 1 block table, the write by slot (a -1 must never wrap
to the last page), and the dense gather."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kv
from tests.utils import rng

NUM_PAGES, P, L, R, B, M, T = 8, 4, 16, 8, 3, 4, 6

_grow = jax.jit(lambda a, t, lengths: kv.alloc_batch(a, t, kv.pages_needed(t, lengths)))
_slots = jax.jit(kv.latent_slot_mapping, static_argnames=("num_tokens", "page_size"))
_write = jax.jit(kv.write_latent)
_gather = jax.jit(kv.gather_latent)


@jax.jit
def _poison(pool):
    return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), pool)


def _pool():
    return kv.create_latent_pool(num_pages=NUM_PAGES, page_size=P, kv_lora_rank=L, rope_dim=R,
                                 dtype=jnp.float32)


def _bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint8)


def test_write_by_slot_mapping_matches_dense_reference():
    gen = rng()
    a = kv.create_allocator(num_kv_heads=1, num_pages=NUM_PAGES)
    t = kv.create_block_tables(batch_size=B, num_kv_heads=1, max_pages=M, page_size=P)
    pool = _poison(_pool())
    ref = np.full((B, M * P, L + R), np.nan, np.float32)
    lengths = np.zeros(B, np.int32)
    for num_new in np.array([(6, 0, 3), (1, 0, 1), (0, 5, 1)], np.int32):
        a, t, ok = _grow(a, t, lengths + num_new)
        assert bool(ok)
        c_kv = gen.standard_normal((B, T, L), dtype=np.float32)
        k_pe = gen.standard_normal((B, T, R), dtype=np.float32)
        slots = _slots(t.table[:, 0], lengths, num_new, num_tokens=T, page_size=P)
        slot_np = np.asarray(slots)
        assert (slot_np[np.arange(T)[None, :] >= num_new[:, None]] == -1).all()  # padding
        pool = _write(pool, c_kv, k_pe, slots)
        for b in range(B):
            ref[b, lengths[b]:lengths[b] + num_new[b]] = np.concatenate(
                [c_kv[b, :num_new[b]], k_pe[b, :num_new[b]]], -1)
        lengths = lengths + num_new  # a new array: jax may still read the old one (zero-copy)
    got = np.asarray(_gather(pool, t.table[:, 0]))
    for b in range(B):
        np.testing.assert_array_equal(got[b, :lengths[b]], ref[b, :lengths[b]])
    owned = np.asarray(a.owned[0])
    assert not owned[0] and not owned[-1]  # so the null page and the last page must stay NaN
    assert np.isnan(np.asarray(pool.pages)[~owned]).all()


def test_negative_null_and_out_of_range_slots_are_dropped():
    gen = rng()
    pool = _poison(_pool())
    c_kv = gen.standard_normal((5, L), dtype=np.float32)
    k_pe = gen.standard_normal((5, R), dtype=np.float32)
    slots = np.array([-1, -P, 2, NUM_PAGES * P, 2 * P + 1], np.int32)  # only the last is real
    out = np.asarray(_write(pool, c_kv, k_pe, slots).pages)
    written = ~np.isnan(out).all(-1)
    expect = np.zeros((NUM_PAGES, P), bool)
    expect[2, 1] = True
    np.testing.assert_array_equal(written, expect)
    np.testing.assert_array_equal(out[2, 1], np.concatenate([c_kv[4], k_pe[4]]))


def test_errors():
    pool = _pool()
    with pytest.raises(ValueError, match="num_pages=1 must be >= 2"):
        kv.create_latent_pool(num_pages=1, page_size=P, kv_lora_rank=L, rope_dim=R)
    with pytest.raises(TypeError, match="dtype=float8_e4m3fn must be a floating dtype of at least"):
        kv.create_latent_pool(num_pages=4, page_size=P, kv_lora_rank=L, rope_dim=R,
                              dtype=jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="flat slots would overflow int32"):
        kv.create_latent_pool(num_pages=2**28, page_size=8, kv_lora_rank=L, rope_dim=R)
    with pytest.raises(ValueError, match=r"c_kv.shape=\(3, 15\) must be \[\*T L\]"):
        kv.write_latent(pool, jnp.zeros((3, 15)), jnp.zeros((3, R)), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match=r"k_pe.shape=\(3, 7\) must be \[\*T R\]"):
        kv.write_latent(pool, jnp.zeros((3, L)), jnp.zeros((3, 7)), jnp.zeros(3, jnp.int32))
    with pytest.raises(TypeError, match="slot_mapping.dtype=float32 must be an integer"):
        kv.write_latent(pool, jnp.zeros((3, L)), jnp.zeros((3, R)), jnp.zeros(3))
    with pytest.raises(TypeError, match="pool must be a LatentPool"):
        kv.gather_latent(jnp.zeros(3), jnp.zeros((1, 2), jnp.int32))
    with pytest.raises(ValueError, match=r"table must have shape \[B max_pages\]"):
        kv.latent_slot_mapping(jnp.zeros((2, 1, 3), jnp.int32), 0, 1, num_tokens=2, page_size=P)
