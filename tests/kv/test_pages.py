"""Head-major page pools: KV write (bf16 and FP8) against a dense reference with NaN-poisoned
memory, accounting, and sharding by KV head."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as PS

import kv
from tests.utils import assert_all_finite, rng

K, NUM_PAGES, P, H, HV, B, M, T = 3, 12, 8, 16, 8, 3, 5, 20
SUB = 4  # FP8 sub-block in these tests: two scales per page
DTYPES = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}

# Jit every op once; the tests keep their own arithmetic in numpy (eager jnp ops would each
# compile for every new shape, which dominates CPU time at these sizes).
NO_EXTRA = np.zeros((B, K), np.int32)


@jax.jit
def _grow(a, t, lengths, extra=NO_EXTRA):
    """Allocate what `lengths` needs, plus `extra` pages per row and head."""
    return kv.alloc_batch(a, t, kv.pages_needed(t, lengths) + extra)


_write = jax.jit(kv.write_kv)
_gather = jax.jit(kv.gather_kv)


def _pool(dtype):
    sub = SUB if jnp.dtype(dtype) == kv.fp8.FP8_DTYPE else None
    return kv.create_page_pool(num_kv_heads=K, num_pages=NUM_PAGES, page_size=P, head_dim=H,
                               value_head_dim=HV, dtype=dtype, sub_block=sub)


@jax.jit
def _poison_all(pool):
    """Every page (null page included) and every scale NaN: stale memory of earlier requests."""
    return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), pool)


def _randn(gen, shape) -> np.ndarray:
    return gen.standard_normal(shape, dtype=np.float32)


def _with_entry(t, index, value):
    table = np.array(t.table)
    table[index] = value
    return t.replace(table=jnp.asarray(table))


def _bits(x) -> np.ndarray:
    """Raw bytes of an array, so that NaN compares equal to the same NaN."""
    return np.asarray(x).view(np.uint8)


def _desynced_state():
    """Rows 0 and 1 already hold [2, 1, 3] and [1, 3, 2] pages per head, so one logical page has
    a different physical id in every head (row 1 holds pages ahead of its first token)."""
    a = kv.create_allocator(num_kv_heads=K, num_pages=NUM_PAGES)
    t = kv.create_block_tables(batch_size=B, num_kv_heads=K, max_pages=M, page_size=P)
    a, t, ok = _grow(a, t, np.zeros(B, np.int32), np.array([[2, 1, 3], [1, 3, 2], [0, 0, 0]]))
    assert bool(ok)
    return a, t


@pytest.mark.parametrize("name", list(DTYPES))
def test_write_gather_matches_dense_reference(name):
    """Prefill chunks, decode appends and a late-admitted row, written into NaN-poisoned pages
    with different page ids per head; every stored token reads back, nothing else is touched."""
    dtype = DTYPES[name]
    gen = rng()
    a, t = _desynced_state()
    pool = _poison_all(_pool(dtype))
    ref_k = np.full((B, M * P, K, H), np.nan, np.float32)
    ref_v = np.full((B, M * P, K, HV), np.nan, np.float32)
    lengths = np.zeros(B, np.int32)
    # (num_new per row): row 0 and 2 prefill, decode twice, then row 1 arrives.
    schedule = [(13, 0, 20), (1, 0, 1), (1, 0, 1), (0, 17, 1), (4, 1, 0)]
    for step, num_new in enumerate(np.array(schedule, np.int32)):
        a, t, ok = _grow(a, t, jnp.asarray(lengths + num_new))
        assert bool(ok), step
        k_new, v_new = _randn(gen, (B, T, K, H)), _randn(gen, (B, T, K, HV))
        k_new[0, 0] *= 30.0  # an outlier token: its sub-block's scale grows
        pool = _write(pool, t, k_new, v_new, lengths, num_new)
        for b in range(B):
            span = slice(lengths[b], lengths[b] + num_new[b])
            ref_k[b, span] = k_new[b, :num_new[b]]
            ref_v[b, span] = v_new[b, :num_new[b]]
        lengths = lengths + num_new  # a new array: jax may still read the old one (zero-copy)

    got_k, got_v = (np.asarray(x, np.float32) for x in _gather(pool, t))
    table = np.asarray(t.table)
    for b in range(B):
        held = slice(0, lengths[b])
        for got, ref in ((got_k, ref_k), (got_v, ref_v)):
            if name == "bf16":
                expect = ref[b, held].astype(jnp.bfloat16).astype(np.float32)
                np.testing.assert_array_equal(got[b, held], expect, err_msg=f"row {b}")
            else:
                _check_fp8_error(got[b, held], ref[b, held], f"row {b}")
    # Pages nobody owns (null page included) were never written: still all NaN, bit for bit.
    owned = np.asarray(a.owned)
    assert not owned[:, 0].any()
    for leaf in jax.tree.leaves(pool):
        assert np.isnan(np.asarray(leaf, np.float32)[~owned]).all()
    if name == "fp8":  # the scale of every sub-block holding a token is finite
        for b in range(B):
            for k in range(K):
                pages = table[b, k, :-(-lengths[b] // P)]
                for scales in (np.asarray(pool.k_scale), np.asarray(pool.v_scale)):
                    per_sub = scales[k, pages].reshape(-1)[:-(-lengths[b] // SUB)]
                    assert_all_finite(per_sub, f"row {b} head {k}")


def _check_fp8_error(got, ref, msg):
    """Each value within amax/8 of its sub-block (e4m3 keeps amax/16, once more per re-scale)."""
    n = ref.shape[0]
    pad = -n % SUB
    blocks = np.pad(np.abs(ref), ((0, pad), (0, 0), (0, 0))).reshape(-1, SUB, *ref.shape[1:])
    amax = np.repeat(blocks.max(axis=(1, 3)), SUB, axis=0)[:n, :, None]  # [n, K, 1]
    assert_all_finite(got, msg)
    err = np.abs(got - ref)
    assert (err <= amax / 8).all(), f"{msg}: max error / amax {np.max(err / amax):.3f}"


def test_fp8_whole_sub_blocks_are_exact_quantize():
    """A prefill that fills whole sub-blocks stores exactly `fp8.quantize` of them."""
    gen = rng()
    a, t = _desynced_state()
    a, t, ok = _grow(a, t, np.array([16, 0, 8], np.int32))
    assert bool(ok)
    k_new, v_new = _randn(gen, (B, T, K, H)), _randn(gen, (B, T, K, HV))
    pool = _write(_poison_all(_pool(jnp.float8_e4m3fn)), t, k_new, v_new, np.zeros(B, np.int32),
                  np.array([16, 0, 8], np.int32))
    q, scales = kv.fp8.quantize(k_new[0, :16].transpose(1, 0, 2), SUB)  # [K, 16, H]
    q, scales = _bits(q), np.asarray(scales)
    pages, pool_scales, table = _bits(pool.k), np.asarray(pool.k_scale), np.asarray(t.table)
    for k in range(K):
        ids = table[0, k, :2]
        np.testing.assert_array_equal(pages[k, ids].reshape(16, H), q[k])
        np.testing.assert_array_equal(pool_scales[k, ids].reshape(-1), scales[k])


@pytest.mark.parametrize("name", list(DTYPES))
def test_unallocated_and_out_of_table_writes_are_dropped(name):
    """Tokens whose entry is -1 (never allocated, or released by recycle), beyond the table, or at
    a negative position write nothing at all: a -1 must not wrap to the last page."""
    gen = rng()
    a, t = _desynced_state()
    a, t, ok = _grow(a, t, np.array([24, 0, 8], np.int32))
    assert bool(ok)
    t = _with_entry(t, (0, 1, 1), -1)  # as if head 1 had recycled page 1
    table = np.asarray(t.table)
    pool = _poison_all(_pool(DTYPES[name]))
    k_new, v_new = _randn(gen, (B, T, K, H)), _randn(gen, (B, T, K, HV))
    # Row 0: positions 8..15 only, head 1 of those is -1; row 1: positions 24..28, logical page
    # 3, allocated in no head; row 2: 36..55, unallocated, then beyond the table from 40 on.
    offsets, num_new = np.array([8, 24, 36], np.int32), np.array([8, 5, 20], np.int32)
    out = _write(pool, t, k_new, v_new, offsets, num_new)
    changed = [(_bits(x) != _bits(y)).reshape(K, NUM_PAGES, -1).any(-1)
               for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(pool))]
    touched = np.logical_or.reduce(changed)  # [K, num_pages]
    expect = np.zeros((K, NUM_PAGES), bool)
    for k in (0, 2):
        expect[k, table[0, k, 1]] = True
    np.testing.assert_array_equal(touched, expect)
    # Negative positions: nothing.
    out = _write(pool, t, k_new, v_new, np.full(B, -20, np.int32), np.full(B, 20, np.int32))
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(pool)):
        np.testing.assert_array_equal(_bits(x), _bits(y))


def test_accounting():
    bf16, fp8 = _pool(jnp.bfloat16), _pool(jnp.float8_e4m3fn)
    assert kv.page_bytes(bf16) == P * (H + HV) * 2
    assert kv.page_bytes(fp8) == P * (H + HV) + 4 * 2 * (P // SUB)
    a, t = _desynced_state()  # rows hold [2, 1, 3] and [1, 3, 2] pages
    usage = kv.kv_usage([bf16, fp8], [a, a])
    np.testing.assert_array_equal(usage["pages"], [[3, 4, 5], [3, 4, 5]])
    np.testing.assert_array_equal(usage["bytes"][1], np.array([3, 4, 5]) * kv.page_bytes(fp8))
    assert usage["total_bytes"] == 12 * (kv.page_bytes(bf16) + kv.page_bytes(fp8))
    np.testing.assert_array_equal(usage["capacity_pages"], [NUM_PAGES - 1] * 2)
    np.testing.assert_array_equal(np.asarray(t.pages_per_row()), [[2, 1, 3], [1, 3, 2], [0] * 3])


def test_shard_by_kv_head_on_one_device_mesh():
    mesh = Mesh(np.array(jax.devices()[:1]), ("kv",))
    a, t = _desynced_state()
    slots = kv.create_slot_pool(num_slots=4, conv_dim=12, conv_width=4, num_v_heads=2,
                                head_k_dim=4, head_v_dim=4)
    state = {"pool": _pool(jnp.float8_e4m3fn), "alloc": a, "tables": t, "slots": slots,
             "latent": kv.create_latent_pool(num_pages=4, page_size=P, kv_lora_rank=8, rope_dim=4)}
    placed = kv.shard(state, mesh, "kv")
    expect = {
        "pool": [PS("kv", None, None, None)] * 2 + [PS("kv", None, None)] * 2,
        "alloc": [PS("kv", None), PS("kv"), PS("kv", None)],
        "tables": [PS(None, "kv", None), PS(None, "kv"), PS(None, "kv")],
        "slots": [PS(), PS(None, "kv", None, None)],
        "latent": [PS()],
    }
    for key, specs in expect.items():
        leaves = jax.tree.leaves(placed[key])
        assert [x.sharding.spec for x in leaves] == specs, key
    # The jitted ops run on the sharded state and agree with the unsharded run.
    gen = rng()
    k_new, v_new = _randn(gen, (B, T, K, H)), _randn(gen, (B, T, K, HV))
    args = (np.array([8, 0, 0], np.int32), np.array([3, 0, 9], np.int32))
    lengths = np.array([11, 0, 9], np.int32)
    _, t2, ok = _grow(placed["alloc"], placed["tables"], lengths)
    out = _write(placed["pool"], t2, k_new, v_new, *args)
    _, t3, _ = _grow(a, t, lengths)
    ref = _write(state["pool"], t3, k_new, v_new, *args)
    assert bool(ok)
    for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        np.testing.assert_array_equal(_bits(x), _bits(y))


def test_errors():
    pool = _pool(jnp.bfloat16)
    t = kv.create_block_tables(batch_size=B, num_kv_heads=K, max_pages=M, page_size=P)
    k_new, v_new = jnp.zeros((B, T, K, H)), jnp.zeros((B, T, K, HV))
    zeros = jnp.zeros(B, jnp.int32)
    make = dict(num_kv_heads=K, num_pages=NUM_PAGES, page_size=P, head_dim=H)
    with pytest.raises(ValueError, match="num_pages=1 must be >= 2"):
        kv.create_page_pool(**{**make, "num_pages": 1})
    with pytest.raises(ValueError, match="sub_block=3 must divide page_size=8"):
        kv.create_page_pool(**make, dtype=jnp.float8_e4m3fn, sub_block=3)
    with pytest.raises(ValueError, match="sub_block=4 is only meaningful"):
        kv.create_page_pool(**make, sub_block=4)
    with pytest.raises(TypeError, match="only 8-bit page dtype is float8_e4m3fn"):
        kv.create_page_pool(**make, dtype=jnp.float8_e5m2)
    with pytest.raises(TypeError, match="must be a floating dtype"):
        kv.create_page_pool(**make, dtype=jnp.int8)
    with pytest.raises(ValueError, match="flat slots would overflow int32"):
        kv.create_page_pool(**{**make, "num_pages": 2**27, "page_size": 16})
    with pytest.raises(ValueError, match="tables have K=2 heads but the pool has K=3"):
        kv.write_kv(pool, kv.create_block_tables(batch_size=B, num_kv_heads=2, max_pages=M,
                                                 page_size=P), k_new, v_new, zeros, zeros)
    with pytest.raises(ValueError, match="tables.page_size=4 must equal the pool's P=8"):
        kv.gather_kv(pool, kv.create_block_tables(batch_size=B, num_kv_heads=K, max_pages=M,
                                                  page_size=4))
    with pytest.raises(ValueError, match=r"k.shape=\(3, 20, 3, 8\) must be \[B T K H\]"):
        kv.write_kv(pool, t, jnp.zeros((B, T, K, 8)), v_new, zeros, zeros)
    with pytest.raises(ValueError, match=r"v must have shape \[B T K Hv\]"):
        kv.write_kv(pool, t, k_new, v_new[0], zeros, zeros)
    with pytest.raises(TypeError, match="k.dtype=int32 must be floating point"):
        kv.write_kv(pool, t, k_new.astype(jnp.int32), v_new, zeros, zeros)
    with pytest.raises(ValueError, match=r"num_new.shape=\(2,\) must broadcast to \[B\]"):
        kv.write_kv(pool, t, k_new, v_new, zeros, jnp.zeros(2, jnp.int32))
    with pytest.raises(TypeError, match="pool must be a PagePool"):
        kv.write_kv(t, t, k_new, v_new, zeros, zeros)
    with pytest.raises(TypeError, match="dtype=int32 must be a floating dtype"):
        kv.create_page_pool(num_kv_heads=K, num_pages=4, page_size=P, head_dim=8,
                            dtype=jnp.int32)
    with pytest.raises(ValueError, match="axis='tp' is not an axis of the mesh"):
        kv.shard(pool, Mesh(np.array(jax.devices()[:1]), ("kv",)), "tp")
    two = Mesh(np.array(jax.devices()[:1] * 2), ("kv",))  # size 2 only to reach the check
    with pytest.raises(ValueError, match="PagePool has 3 heads, not divisible by the mesh axis"):
        kv.shard(pool, two)
    with pytest.raises(TypeError, match="no KV sharding rule for ArrayImpl"):
        kv.partition_specs([pool, jnp.zeros(3)])
