"""Per-head page allocator: differential property test against a pure-Python model, the seed-001
worked example and bug list, and the 16K half-streaming memory figure."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import kv
from tests.kv.model_allocator import ModelAllocator
from tests.utils import rng

_alloc = jax.jit(kv.alloc)
_alloc_batch = jax.jit(kv.alloc_batch)
_free = jax.jit(kv.free)
_free_batch = jax.jit(kv.free_batch)
_recycle = jax.jit(kv.recycle)

# Property-test geometry: small enough that pools fill up and tables overflow often.
K, NUM_PAGES, B, M, P = 3, 9, 3, 6, 4
OPS = ("alloc", "alloc_batch", "free", "free_batch", "recycle", "grow")
OP_WEIGHTS = np.array([0.25, 0.15, 0.08, 0.05, 0.25, 0.22])
WINDOWS = np.array([0, 1, 3, 4, 5, 8, 13])
SINKS = np.array([0, 1, 4, 6])


def _step(a, t, op, row, n_row, n_batch, rows, lengths, window, sinks):
    need = kv.pages_needed(t, lengths)
    branches = (
        lambda: kv.alloc(a, t, row, n_row),
        lambda: kv.alloc_batch(a, t, n_batch),
        lambda: kv.free(a, t, row),
        lambda: kv.free_batch(a, t, rows),
        lambda: kv.recycle(a, t, lengths, window=window, sinks=sinks),
        lambda: kv.alloc_batch(a, t, need),
    )
    new_a, new_t, ok = lax.switch(op, branches)
    return new_a, new_t, ok, kv.can_alloc(a, t, need), need


_vstep = jax.jit(jax.vmap(_step))


def _leaves(a, t) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves((a, t))]


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def check_invariants(stack, count, owned, table, extent, cursor, num_pages: int, msg: str):
    """QUALITY.md's allocator invariants, for a batch of states `[S, ...]`, model-independent.

    Per sequence and head, the free ids and the ids in the block tables must partition
    `1 .. num_pages - 1` exactly: that is free + used = capacity, no page owned twice, no double
    free, no leak, and the null page never handed out, all at once.
    """
    max_pages = table.shape[-1]
    ids = np.arange(num_pages)
    on_stack = np.arange(num_pages)[None, None, :] < count[..., None]  # [S, K, num_pages]
    in_range = lambda x: (x >= 1) & (x < num_pages)
    bad = (~in_range(stack) & on_stack).any((1, 2))
    assert not bad.any(), f"{msg}: seq {_first(bad)}: null/out-of-range id on a free stack"
    bad = (~in_range(table) & (table != -1)).any((1, 2, 3))
    assert not bad.any(), f"{msg}: seq {_first(bad)}: null/out-of-range id in a block table"
    free_hist = ((stack[..., None] == ids) & on_stack[..., None]).sum(2)  # [S, K, num_pages]
    used_hist = (table.transpose(0, 2, 1, 3)[..., None] == ids).sum((2, 3))  # [S, K, num_pages]
    expect = np.broadcast_to(ids >= 1, free_hist.shape)
    bad = ((free_hist + used_hist) != expect).any((1, 2))
    assert not bad.any(), (f"{msg}: seq {_first(bad)}: free and used ids do not partition the "
                           f"pool (leak, double free or aliasing)")
    bad = (owned != (used_hist == 1)).any((1, 2))
    assert not bad.any(), f"{msg}: seq {_first(bad)}: owned mask disagrees with the tables"
    beyond = np.arange(max_pages) >= extent[..., None]
    bad = ((table != -1) & beyond).any((1, 2, 3))
    assert not bad.any(), f"{msg}: seq {_first(bad)}: entries beyond the extent"
    bad = ((cursor < 0) | (cursor > extent) | (extent > max_pages)).any((1, 2))
    assert not bad.any(), f"{msg}: seq {_first(bad)}: cursor or extent out of range"


def _draw(gen, n_seq, policy):
    """One random operation per sequence (arrays batched over sequences)."""
    op = gen.choice(len(OPS), size=n_seq, p=OP_WEIGHTS)
    row = gen.integers(0, B, n_seq)
    row = np.where(gen.random(n_seq) < 0.05, gen.choice([-1, B], n_seq), row)
    n_row = gen.integers(0, 4, (n_seq, K))
    n_row[gen.random(n_seq) < 0.1, gen.integers(0, K)] = NUM_PAGES  # more than a head holds
    n_row[gen.random(n_seq) < 0.03, 0] = -1
    n_batch = gen.integers(0, 3, (n_seq, B, K))
    rows = gen.random((n_seq, B)) < 0.4
    lengths = gen.integers(0, M * P + P + 1, (n_seq, B))
    window, sinks = policy
    return op, row, n_row, n_batch, rows, lengths, window, sinks


def _apply_model(m: ModelAllocator, op, row, n_row, n_batch, rows, lengths, window, sinks):
    name = OPS[op]
    if name == "alloc":
        return m.alloc(int(row), n_row)
    if name == "alloc_batch":
        return m.alloc_batch(n_batch)
    if name == "free":
        return m.free(int(row))
    if name == "free_batch":
        return m.free_batch(rows)
    if name == "recycle":
        return m.recycle(lengths, window, sinks)
    return m.alloc_batch(m.pages_needed(lengths))


def _model_state(models) -> dict:
    stacks = np.full((len(models), K, NUM_PAGES), -1)
    for s, m in enumerate(models):
        for k, st in enumerate(m.stacks):
            stacks[s, k, :len(st)] = st
    return {"table": np.stack([m.table() for m in models]),
            "extent": np.stack([m.extent() for m in models]),
            "cursor": np.stack([m.cursor for m in models]),
            "count": np.stack([m.free_count() for m in models]),
            "stack": stacks}


def _check_nothing_visible_released(table, extent, high, window, sinks, msg):
    """Every held position a query at >= high - 1 can see still has its page (`high`: the longest
    length each row has been recycled at since its last free). Batched `[S, ...]`."""
    pos = np.arange(M * P)  # [MP]
    held = pos < np.minimum(high, extent.min(-1) * P)[..., None]  # [S, B, MP]
    visible = ((pos < sinks[..., None]) | (pos > (high[..., None] - 1 - window)[..., None]))
    visible &= (window > 0)[..., None] & held[:, :, None, :]  # [S, B, K, MP]
    page = np.take_along_axis(table, np.broadcast_to(pos // P, visible.shape), axis=-1)
    bad = (visible & (page == -1)).any((1, 2, 3))
    assert not bad.any(), f"{msg}: seq {_first(bad)}: released a page that is still visible"


def run_property(n_seq: int, n_steps: int, seed: int) -> dict:
    """Run `n_seq` random operation sequences side by side (vmapped) against the model."""
    gen = rng(seed)
    geometry = dict(num_kv_heads=K, num_pages=NUM_PAGES)
    a0 = kv.create_allocator(**geometry)
    t0 = kv.create_block_tables(batch_size=B, num_kv_heads=K, max_pages=M, page_size=P)
    a, t = jax.tree.map(lambda x: jnp.broadcast_to(x, (n_seq,) + x.shape), (a0, t0))
    models = [ModelAllocator(**geometry, batch_size=B, max_pages=M, page_size=P)
              for _ in range(n_seq)]
    # Window and sinks per (row, head), fixed per sequence: uniform over rows for 70% of the
    # sequences (static per-head policy), per row for the rest (router-chosen per request).
    window = np.repeat(gen.choice(WINDOWS, (n_seq, 1, K)), B, axis=1)
    sinks = np.repeat(gen.choice(SINKS, (n_seq, 1, K)), B, axis=1)
    per_row = gen.random(n_seq) < 0.3
    window[per_row] = gen.choice(WINDOWS, (per_row.sum(), B, K))
    sinks[per_row] = gen.choice(SINKS, (per_row.sum(), B, K))
    stats = {"ok": 0, "failed": 0, "released": 0}
    for step in range(n_steps):
        args = _draw(gen, n_seq, (window, sinks))
        op, lengths = args[0], args[5]
        before = _leaves(a, t)
        a, t, ok, pred, need = _vstep(a, t, *(jnp.asarray(x) for x in args))
        after = _leaves(a, t)
        stack, count, owned, table, extent, cursor = after
        ok, pred, need = np.asarray(ok), np.asarray(pred), np.asarray(need)
        msg = f"seed={seed} step={step}"

        free_before = np.stack([m.free_count() for m in models])
        model_need = np.stack([m.pages_needed(lengths[s]) for s, m in enumerate(models)])
        model_ok = np.array([_apply_model(m, *(x[s] for x in args))
                             for s, m in enumerate(models)])
        bad = ok != model_ok
        assert not bad.any(), f"{msg}: seq {_first(bad)} op {OPS[op[_first(bad)]]}: ok differs"
        check_invariants(stack, count, owned, table, extent, cursor, NUM_PAGES, msg)

        # Exact agreement with the model: tables, extents, cursors, counts, the live stacks.
        model = _model_state(models)
        live = np.where(np.arange(NUM_PAGES) < count[..., None], stack, -1)
        for name, got in (("table", table), ("extent", extent), ("cursor", cursor),
                          ("count", count), ("stack", live)):
            bad = (got != model[name]).reshape(n_seq, -1).any(1)
            if bad.any():
                s = _first(bad)
                np.testing.assert_array_equal(
                    got[s], model[name][s], err_msg=f"{msg}: seq {s} op {OPS[op[s]]}: {name}")

        # A failed call changes nothing, stale stack entries included.
        for x, y in zip(before, after):
            bad = ~ok & (x != y).reshape(n_seq, -1).any(1)
            assert not bad.any(), f"{msg}: seq {_first(bad)} op {OPS[op[_first(bad)]]} failed " \
                                  f"but changed the state"

        # Predicted capacity == what allocation takes.
        bad = (need != model_need).reshape(n_seq, -1).any(1)
        assert not bad.any(), f"{msg}: seq {_first(bad)}: pages_needed differs from the model"
        grow = op == OPS.index("grow")
        bad = grow & (pred != ok)
        assert not bad.any(), f"{msg}: seq {_first(bad)}: can_alloc disagrees with alloc"
        bad = grow & ok & ((free_before - count) != need.sum(1)).any(1)
        assert not bad.any(), f"{msg}: seq {_first(bad)}: took a different number of pages"

        recycled = op == OPS.index("recycle")
        high = np.stack([m.high for m in models])
        _check_nothing_visible_released(table[recycled], extent[recycled], high[recycled],
                                        window[recycled], sinks[recycled], msg)
        stats["released"] += int((count - free_before)[recycled].sum())
        stats["ok"] += int(ok.sum())
        stats["failed"] += int((~ok).sum())
    return stats


def test_property_ci():
    stats = run_property(n_seq=300, n_steps=24, seed=int(rng().integers(2**31)))
    # The generator must exercise both outcomes and real releases, or the test proves little.
    assert stats["ok"] > 1000 and stats["failed"] > 300 and stats["released"] > 100, stats


@pytest.mark.slow
def test_property_slow():
    total = {"ok": 0, "failed": 0, "released": 0}
    for chunk in range(5):  # 5 x 2000 = 10^4 sequences of 40 operations
        stats = run_property(n_seq=2000, n_steps=40, seed=1000 + chunk)
        total = {key: total[key] + stats[key] for key in total}
    print(f"10^4 sequences x 40 ops: {total}")
    assert total["failed"] > 0 and total["released"] > 0


# One geometry for the unit tests below, so each jitted op compiles once: the seed's worked
# example (4 KV heads, P = 16, 512 tokens = 32 pages) plus slack.
UK, UPAGES, UB, UM, UP = 4, 40, 3, 33, 16


def _empty():
    return (kv.create_allocator(num_kv_heads=UK, num_pages=UPAGES),
            kv.create_block_tables(batch_size=UB, num_kv_heads=UK, max_pages=UM, page_size=UP))


def _fill(a, t, row, n):
    a, t, ok = _alloc(a, t, row, jnp.broadcast_to(jnp.asarray(n, jnp.int32), (UK,)))
    assert bool(ok)
    return a, t


def _same(x, y) -> bool:
    return all(np.array_equal(np.asarray(p), np.asarray(q))
               for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y)))


@pytest.mark.parametrize("length,released", [(512, (2, 28)), (511, (2, 27)), (513, (2, 28))],
                         ids=["T512", "T511", "T513"])
def test_worked_example(length, released):
    """seeds_spec §2.4: W=64, S=32, P=16, T=512, 4 heads at ratio 0.5 (heads 0, 1 streaming).

    Our window includes the query (conventions) and the newest token may still query, so page j
    goes iff `(j + 1) * P <= T - W`: [2, 28) at T=512 as in the seed; at T=511 we release [2, 27)
    where the seed's `T % P` gate releases nothing (whole pages only, the tail page never goes).
    The seed's cursor reads [28, 28, 2, 2]; ours stays 0 on full heads (nothing released there).
    """
    window, sinks = jnp.array([64, 64, 0, 0]), jnp.array([32, 32, 32, 32])
    a, t = _empty()
    a, t = _fill(a, t, 1, -(-length // UP))
    before = np.asarray(t.table[1])
    lengths = jnp.array([0, length, 0])
    a, t, ok = _recycle(a, t, lengths, window=window, sinks=sinks)
    assert bool(ok)
    table = np.asarray(t.table[1])
    lo, hi = released
    for k in range(UK):
        gone = np.flatnonzero(table[k] != before[k])
        expect = np.arange(lo, hi) if k < 2 else np.array([], int)
        np.testing.assert_array_equal(gone, expect, err_msg=f"head {k}")
        assert (table[k][gone] == -1).all()
    np.testing.assert_array_equal(np.asarray(t.cursor[1]), [hi, hi, 0, 0])
    np.testing.assert_array_equal(np.asarray(kv.pages_in_use(a)), (table != -1).sum(-1))
    # Monotone: a second call at the same length releases nothing.
    a2, t2, ok = _recycle(a, t, lengths, window=window, sinks=sinks)
    assert bool(ok) and _same((a, t), (a2, t2))


@pytest.mark.parametrize("page_size", [1, 4, 16], ids=lambda p: f"P{p}")
def test_recycle_bounds_host_equals_device(page_size):
    """`recycle_bounds_host` (the engine's host mirror) and `recycle_bounds` are one rule: equal
    on random extents, cursors, lengths, windows (full, 1, within and beyond a page) and sinks,
    row by row with a scalar length as the mirror calls it."""
    g = rng(0)
    b, k, m = 64, 5, 12
    tables = kv.create_block_tables(batch_size=b, num_kv_heads=k, max_pages=m,
                                    page_size=page_size)
    extent = g.integers(0, m + 1, (b, k))
    tables = tables.replace(extent=jnp.asarray(extent, jnp.int32),
                            cursor=jnp.asarray(g.integers(0, extent + 1), jnp.int32))
    lengths = g.integers(0, m * page_size + 1, b)
    window = g.choice([-1, 0, 1, page_size - 1, page_size, 3 * page_size + 1, 40], (b, k))
    sinks = g.choice([0, 1, page_size, 2 * page_size + 3], (b, k))
    lo, hi = jax.jit(kv.recycle_bounds)(tables, lengths, window, sinks)
    host = kv.recycle_bounds_host(np.asarray(tables.extent), np.asarray(tables.cursor),
                                  lengths[:, None], window, sinks, page_size=page_size)
    np.testing.assert_array_equal(host[0], np.asarray(lo))
    np.testing.assert_array_equal(host[1], np.asarray(hi))
    assert (host[1] > host[0]).any() and (host[1] == host[0]).any()  # both cases drawn
    for r in range(b):
        lo_r, hi_r = kv.recycle_bounds_host(np.asarray(tables.extent[r]),
                                            np.asarray(tables.cursor[r]), int(lengths[r]),
                                            window[r], sinks[r], page_size=page_size)
        np.testing.assert_array_equal(lo_r, np.asarray(lo[r]))
        np.testing.assert_array_equal(hi_r, np.asarray(hi[r]))


def _grow_and_recycle(a, t, lengths, window, sinks):
    a, t, ok_alloc = kv.alloc_batch(a, t, kv.pages_needed(t, lengths))
    a, t, ok_recycle = kv.recycle(a, t, lengths, window=window, sinks=sinks)
    return a, t, ok_alloc & ok_recycle


def test_half_streaming_16k_figure():
    """Half the KV heads streaming (sink 128 + window 1024) at 16K: pages in use <= 0.55 of the
    all-full case. Chunked prefill of 1024 tokens, recycling after every chunk, as an engine would.
    """
    heads, context, chunk, size = 8, 16 * 1024, 1024, 64
    max_pages = context // size
    window = jnp.array([1024] * 4 + [0] * 4)
    sinks = jnp.array([128] * 4 + [0] * 4)
    step = jax.jit(_grow_and_recycle)

    def run(window):
        a = kv.create_allocator(num_kv_heads=heads, num_pages=max_pages + 1)
        t = kv.create_block_tables(batch_size=1, num_kv_heads=heads, max_pages=max_pages,
                                   page_size=size)
        for end in range(chunk, context + 1, chunk):
            a, t, ok = step(a, t, jnp.array([end]), window, sinks)
            assert bool(ok)
        return np.asarray(kv.pages_in_use(a))

    streaming, full = run(window), run(jnp.zeros_like(window))
    ratio = streaming.sum() / full.sum()
    print(f"\n16K, P={size}: pages in use {streaming.sum()} vs all-full {full.sum()} "
          f"-> {ratio:.4f} (per head {streaming.tolist()})")
    assert (full == max_pages).all()
    # Streaming head: ceil(128 / P) sink pages + the 1024 / P pages of the window.
    assert (streaming[:4] == -(-128 // size) + 1024 // size).all()
    assert ratio <= 0.55


def test_bug1_bug2_per_head_id_spaces():
    """seeds_spec §2.6 #1, #2: ids are per-head local ids in [1, num_pages); one head never holds
    an id twice; with full pools every head holds the same ids (collisions across heads are
    expected); a released id goes back to its own head's stack only."""
    a, t = _empty()
    a, t = _fill(a, t, 0, [6, 10, 20, 33])
    a, t = _fill(a, t, 2, [33, 29, 19, 6])
    assert (np.asarray(kv.free_pages(a)) == 0).all()
    table = np.asarray(t.table)
    for k in range(UK):
        ids = table[:, k][table[:, k] != -1]
        assert ((ids >= 1) & (ids < UPAGES)).all()  # local ids: pages[k, id] is in bounds
        np.testing.assert_array_equal(np.sort(ids), np.arange(1, UPAGES))  # no aliasing
    # Head 0 streams with window 16: at length 32 its page 0 of row 0 leaves the window.
    a, t, ok = _recycle(a, t, jnp.array([32, 0, 0]), window=jnp.array([16, 0, 0, 0]),
                        sinks=jnp.array([0, 0, 0, 0]))
    assert bool(ok)
    np.testing.assert_array_equal(np.asarray(kv.free_pages(a)), [1, 0, 0, 0])
    # Only head 0 can allocate again, and it gets exactly that id back.
    _, _, ok = _alloc(a, t, 1, jnp.array([0, 1, 0, 0]))
    assert not bool(ok)
    a, t = _fill(a, t, 1, [1, 0, 0, 0])
    assert int(t.table[1, 0, 0]) == table[0, 0, 0]


def test_double_free_and_aliasing_are_refused():
    a, t = _empty()
    a, t = _fill(a, t, 0, 2)
    stale = t
    a, t, ok = _free(a, t, 0)
    assert bool(ok)
    # Freeing the same pages again through a stale table: refused, nothing changes.
    a2, t2, ok = _free(a, stale, 0)
    assert not bool(ok) and _same((a, stale), (a2, t2))
    # Freeing an already empty row is an idempotent no-op.
    a3, t3, ok = _free(a, t, 0)
    assert bool(ok) and _same((a, t), (a3, t3))
    # Two rows listing the same page of one head (aliasing): refused.
    a, t = _fill(a, t, 0, 1)
    aliased = t.replace(table=t.table.at[1].set(t.table[0]), extent=t.extent.at[1].set(1))
    a4, t4, ok = _free_batch(a, aliased, jnp.array([True, True, False]))
    assert not bool(ok) and _same((a, aliased), (a4, t4))
    # A null or out-of-range id in a table: refused.
    for bad in (0, UPAGES, -7):
        corrupt = t.replace(table=t.table.at[0, 1, 0].set(bad))
        a5, t5, ok = _free(a, corrupt, 0)
        assert not bool(ok) and _same((a, corrupt), (a5, t5)), bad
    # Out-of-range rows: refused.
    for row in (-1, UB):
        assert not bool(_free(a, t, row)[2])
        assert not bool(_alloc(a, t, row, jnp.ones(UK, jnp.int32))[2])


def test_uniform_requests_keep_identical_rows():
    """A uniform table is the per-head table with identical rows: per-head stacks fed the same
    requests hand out the same ids in every head."""
    a, t = _empty()
    for row, n in [(0, 2), (1, 3), (0, 1), (2, 2)]:
        a, t = _fill(a, t, row, n)
    a, t, _ = _free(a, t, 1)
    a, t = _fill(a, t, 1, 4)
    table = np.asarray(t.table)
    assert (table == table[:, :1]).all()


def test_errors():
    a = kv.create_allocator(num_kv_heads=2, num_pages=6)
    t = kv.create_block_tables(batch_size=2, num_kv_heads=2, max_pages=4, page_size=4)
    t3 = kv.create_block_tables(batch_size=2, num_kv_heads=3, max_pages=4, page_size=4)
    with pytest.raises(ValueError, match="num_pages=1 must be >= 2"):
        kv.create_allocator(num_kv_heads=2, num_pages=1)
    with pytest.raises(TypeError, match="num_kv_heads=2.0 must be an int"):
        kv.create_allocator(num_kv_heads=2.0, num_pages=4)
    with pytest.raises(ValueError, match="max_pages=0 must be >= 1"):
        kv.create_block_tables(batch_size=2, num_kv_heads=2, max_pages=0, page_size=4)
    with pytest.raises(ValueError, match="K=3 heads but the allocator has K=2"):
        kv.alloc(a, t3, 0, 1)
    with pytest.raises(TypeError, match="allocator must be a PageAllocator"):
        kv.free(t, t, 0)
    with pytest.raises(TypeError, match="tables must be a BlockTables"):
        kv.free(a, a, 0)
    with pytest.raises(ValueError, match=r"n_pages.shape=\(3,\) must broadcast to \[K\]"):
        kv.alloc(a, t, 0, jnp.ones(3, jnp.int32))
    with pytest.raises(TypeError, match="n_pages.dtype=float32 must be an integer"):
        kv.alloc_batch(a, t, jnp.ones((2, 2)))
    with pytest.raises(ValueError, match=r"row must be a scalar batch index; got shape \(2,\)"):
        kv.alloc(a, t, jnp.array([0, 1]), 1)
    with pytest.raises(TypeError, match="rows.dtype=int32 must be bool"):
        kv.free_batch(a, t, jnp.array([1, 0]))
    with pytest.raises(ValueError, match=r"rows.shape=\(3,\) must be \[B\]"):
        kv.free_batch(a, t, jnp.array([True, False, True]))
    with pytest.raises(ValueError, match=r"window.shape=\(3,\) must broadcast to \[B K\]"):
        kv.recycle(a, t, jnp.array([4, 4]), window=jnp.array([1, 2, 3]), sinks=0)
    with pytest.raises(ValueError, match=r"lengths.shape=\(3,\) must broadcast to \[B\]"):
        kv.pages_needed(t, jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match="len\\(pools\\)=1 must equal len\\(allocators\\)=2"):
        kv.kv_usage([kv.create_page_pool(num_kv_heads=2, num_pages=6, page_size=4,
                                         head_dim=8)], [a, a])
