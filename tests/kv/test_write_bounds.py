"""KV writes never leave the pool, whatever the ids: an id outside `[0, num_pages)` writes nothing
(the null page and the other heads' pools included), on every backend, and the checked mode turns
such ids into run-time errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn
import kv
from kv import fp8
from tests.utils import randn, rng

K, NUM_PAGES, P, H = 2, 4, 16, 8


@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_fp8_write_ids_outside_the_pool_write_nothing(impl):
    gen = rng()
    pages, scales = fp8.quantize(randn(gen, (K, NUM_PAGES, P, H)), 4)
    x = randn(gen, (5, K, H), scale=3.0)
    # Head 0: ids num_pages (would be head 1's page 0 in a flat index), num_pages + 3, -2, 10**6
    # and one valid id; head 1: all out of range.
    page_ids = jnp.asarray([[NUM_PAGES, NUM_PAGES + 1], [NUM_PAGES + 3, -2], [-2, 10**6],
                            [10**6, NUM_PAGES], [2, -1]], jnp.int32)
    offsets = jnp.asarray([0, 1, 2, 3, 5], jnp.int32)
    run = jax.jit(lambda *a: fp8.quantize_tokens(*a, implementation=impl))
    new_pages, new_scales = run(pages, scales, x, page_ids, offsets)
    untouched = np.ones((K, NUM_PAGES), bool)
    untouched[0, 2] = False  # the one valid write
    a, b = np.asarray(new_pages).view(np.uint8), np.asarray(pages).view(np.uint8)
    np.testing.assert_array_equal(a[untouched], b[untouched])
    np.testing.assert_array_equal(np.asarray(new_scales)[untouched], np.asarray(scales)[untouched])
    # The valid token landed: slot 5 of page 2, head 0, dequantises close to x.
    got = np.asarray(fp8.dequantize(new_pages, new_scales))[0, 2, 5]
    np.testing.assert_allclose(got, np.asarray(x)[4, 0], atol=np.abs(np.asarray(x)[4, 0]).max() / 8)


def test_write_kv_table_ids_outside_the_pool_write_nothing():
    gen = rng()
    pool = kv.create_page_pool(num_kv_heads=K, num_pages=NUM_PAGES, page_size=P, head_dim=H,
                               dtype=jnp.float32)
    pool = pool.replace(k=randn(gen, pool.k.shape), v=randn(gen, pool.v.shape))
    tables = kv.create_block_tables(batch_size=2, num_kv_heads=K, max_pages=2, page_size=P)
    table = np.array([[[NUM_PAGES, 1], [10**6, -5]], [[-1, NUM_PAGES + 2], [0, 3]]], np.int32)
    tables = tables.replace(table=jnp.asarray(table))
    k_new, v_new = randn(gen, (2, 2 * P, K, H)), randn(gen, (2, 2 * P, K, H))
    run = jax.jit(lambda pool, t: kv.write_kv(pool, t, k_new, v_new, jnp.zeros(2, jnp.int32),
                                              jnp.full(2, 2 * P, jnp.int32)))
    out = run(pool, tables)
    written = np.zeros((K, NUM_PAGES), bool)
    written[0, 1] = written[1, 3] = True  # the only ids inside [1, num_pages)
    for old, new in ((pool.k, out.k), (pool.v, out.v)):
        np.testing.assert_array_equal(np.asarray(new)[~written], np.asarray(old)[~written])
        assert not np.array_equal(np.asarray(new)[written], np.asarray(old)[written])
    with attn.debug_checks(), pytest.raises(RuntimeError, match=r"tables.table=.*\[-1, 3\]"):
        jax.block_until_ready(jax.jit(lambda p, t: kv.write_kv(
            p, t, k_new, v_new, jnp.zeros(2, jnp.int32), jnp.full(2, 2 * P, jnp.int32)))(
                pool, tables))


def test_fp8_write_checked_mode():
    gen = rng()
    pages, scales = fp8.quantize(randn(gen, (K, NUM_PAGES, P, H)), 4)
    x = randn(gen, (1, K, H))
    ids = jnp.asarray([[NUM_PAGES, 1]], jnp.int32)
    with attn.debug_checks(), pytest.raises(RuntimeError, match=r"page_ids=\[\[4, 1\]\]"):
        jax.block_until_ready(jax.jit(lambda *a: fp8.quantize_tokens(*a, implementation="xla"))(
            pages, scales, x, ids, jnp.zeros(1, jnp.int32)))
