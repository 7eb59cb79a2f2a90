"""GDN slot pools: a stale slot (previous occupant, or NaN) and NaN neighbours change a request's
output by exactly nothing, batch reorder keeps each request with its slot; slot allocator."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kv
from tests.utils import rng

SLOTS, CONV, W, NK, NV, H, HV, B, STEPS = 6, 12, 4, 1, 2, 4, 4, 3, 3

_alloc_slots = jax.jit(kv.alloc_slots)
_free_slots = jax.jit(kv.free_slots)
_read = jax.jit(kv.read_slots)
_write = jax.jit(kv.write_slots)


def _bits(x) -> np.ndarray:
    """Raw bytes, so that NaN compares equal to the same NaN."""
    return np.atleast_1d(np.asarray(x)).view(np.uint8)


def _standin_step(pool, slots, x, q, k, v, g, beta, weight):
    """A stand-in GDN decode step through `read_slots` / `write_slots`: a causal conv over the
    last W inputs and one gated delta-rule update of the recurrent state."""
    conv, ssm = kv.read_slots(pool, slots)
    window = jnp.concatenate([conv, x[..., None]], axis=-1)  # [B, C, W]
    y = jax.nn.silu(jnp.einsum("bcw,cw->bc", window, weight))
    k_v = jnp.repeat(k[:, 0], NV // NK, axis=1)  # [B, Nv, H]
    q_v = jnp.repeat(q[:, 0], NV // NK, axis=1)
    decayed = ssm * jnp.exp(g[:, 0])[..., None, None]
    delta = v[:, 0] - jnp.einsum("bnhv,bnh->bnv", decayed, k_v)
    state = decayed + beta[:, 0, :, None, None] * jnp.einsum("bnh,bnv->bnhv", k_v, delta)
    o = jnp.einsum("bnhv,bnh->bnv", state, q_v)
    return kv.write_slots(pool, slots, window[..., 1:], state), (y, o)


def _gdn_step(pool, slots, x, q, k, v, g, beta, weight):
    """The real decode ops of attn/ (conv1d + gated delta rule) on the pool's arrays."""
    from attn.conv1d import causal_conv1d_update_pool
    from attn.gdn import gdn_decode_pool

    y, conv = causal_conv1d_update_pool(x, pool.conv, slots, weight, activation="silu")
    o, ssm = gdn_decode_pool(q, k, v, g, beta, pool.ssm, slots)
    return pool.replace(conv=conv, ssm=ssm), (y, o[:, 0])


def _real_ops_available() -> bool:
    try:
        import attn.conv1d
        import attn.gdn  # noqa: F401
    except ImportError:
        return False
    return True


STEPS_FNS = {"standin": jax.jit(_standin_step), "gdn": jax.jit(_gdn_step)}


def _inputs(gen, rows):
    """Per-request decode inputs for STEPS steps: `rows` requests, each its own stream."""
    f = lambda *shape: gen.standard_normal((STEPS, rows, *shape), dtype=np.float32)
    g = -np.abs(f(1, NV))  # log-decay <= 0
    beta = 1 / (1 + np.exp(-f(1, NV)))
    return dict(x=f(CONV), q=f(1, NK, H), k=f(1, NK, H), v=f(1, NV, HV), g=g, beta=beta)


def _run(step, pool, slots, streams, order, weight):
    """Run STEPS decode steps; batch row i serves stream `order[i]` (-1 = padding, zeros)."""
    outs = []
    for t in range(STEPS):
        args = {}
        for name, x in streams.items():
            pad = np.zeros_like(x[t, :1])
            args[name] = np.concatenate([x[t, j:j + 1] if j >= 0 else pad for j in order])
        pool, out = step(pool, slots, args["x"], args["q"], args["k"], args["v"], args["g"],
                         args["beta"], weight)
        outs.append([np.asarray(o) for o in out])
    return pool, outs


def _poison_slots(pool, keep):
    """NaN in every slot not listed in `keep`."""
    mask = np.isin(np.arange(SLOTS), keep)
    return jax.tree.map(lambda x: jnp.where(mask.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.nan),
                        pool)


@pytest.mark.parametrize("kind", ["standin", "gdn"])
def test_stale_and_nan_slots_change_nothing_and_reorder_keeps_slots(kind):
    if kind == "gdn" and not _real_ops_available():
        pytest.skip("attn.gdn / attn.conv1d not available")
    step = STEPS_FNS[kind]
    gen = rng()
    weight = gen.standard_normal((CONV, W), dtype=np.float32)
    make = dict(num_slots=SLOTS, conv_dim=CONV, conv_width=W, num_v_heads=NV, head_k_dim=H,
                head_v_dim=HV, dtype=jnp.float32)
    streams = _inputs(gen, 3)  # requests A (0), B (1), C (2)
    stream_c = {name: x[:, 2:3] for name, x in streams.items()}

    # Reference: C alone in row 0 of a fresh pool.
    alloc = kv.create_slot_allocator(num_slots=SLOTS)
    alloc, pool, slots, ok = _alloc_slots(alloc, kv.create_slot_pool(**make),
                                          np.array([True, False, False]))
    assert bool(ok)
    ref_pool, ref = _run(step, pool, slots, stream_c, [0, -1, -1], weight)
    ref_slot = int(slots[0])

    # A and B run, A finishes, C takes A's slot (LIFO), left with A's state or with NaN.
    alloc = kv.create_slot_allocator(num_slots=SLOTS)
    alloc, pool, slots_ab, ok = _alloc_slots(alloc, kv.create_slot_pool(**make),
                                             np.array([True, True, False]))
    assert bool(ok)
    pool, _ = _run(step, pool, slots_ab, streams, [0, 1, -1], weight)
    alloc, ok = _free_slots(alloc, np.array([int(slots_ab[0]), 0, 0], np.int32))
    assert bool(ok)
    slot_a, slot_b = int(slots_ab[0]), int(slots_ab[1])
    stale = np.asarray(pool.ssm[slot_a])
    assert np.abs(stale).max() > 0  # the previous occupant left a real state behind
    cases = {"previous occupant": pool, "stale NaN": _poison_slots(pool, [slot_b])}
    for case, start in cases.items():
        _, pool_c, slots_c, ok = _alloc_slots(alloc, start, np.array([True, False, False]))
        assert bool(ok) and int(slots_c[0]) == slot_a, case
        batch_slots = np.array([slot_a, slot_b, 0], np.int32)
        out_pool, out = _run(step, pool_c, batch_slots, streams, [2, 1, -1], weight)
        for t in range(STEPS):
            for got, expect in zip(out[t], ref[t]):
                np.testing.assert_array_equal(got[0], expect[0], err_msg=f"{case} step {t}")
        for got, expect in zip(jax.tree.leaves(out_pool), jax.tree.leaves(ref_pool)):
            np.testing.assert_array_equal(np.asarray(got[slot_a]), np.asarray(expect[ref_slot]))

    # NaN in the neighbour's slot (and in every other slot): C's output is bitwise unchanged.
    _, pool_c, _, _ = _alloc_slots(alloc, pool, np.array([True, False, False]))
    poisoned = _poison_slots(pool_c, [slot_a])
    _, out = _run(step, poisoned, batch_slots, streams, [2, 1, -1], weight)
    for t in range(STEPS):
        for got, expect in zip(out[t], ref[t]):
            np.testing.assert_array_equal(got[0], expect[0], err_msg=f"NaN neighbour step {t}")
        assert np.isnan(out[t][1][1]).any()  # the poisoned neighbour itself is garbage

    # Batch reorder: rows move, each request keeps its slot; outputs permute, states agree.
    pool_fwd, out_fwd = _run(step, pool_c, batch_slots, streams, [2, 1, -1], weight)
    pool_rev, out_rev = _run(step, pool_c, batch_slots[::-1].copy(), streams, [-1, 1, 2], weight)
    for t in range(STEPS):
        for fwd, rev in zip(out_fwd[t], out_rev[t]):
            np.testing.assert_array_equal(fwd, rev[::-1], err_msg=f"reorder step {t}")
    for fwd, rev in zip(jax.tree.leaves(pool_fwd), jax.tree.leaves(pool_rev)):
        np.testing.assert_array_equal(np.asarray(fwd)[1:], np.asarray(rev)[1:])  # slot 0: null


def test_slot_allocator_semantics():
    make = dict(num_slots=SLOTS, conv_dim=CONV, conv_width=W, num_v_heads=NV, head_k_dim=H,
                head_v_dim=HV)
    alloc = kv.create_slot_allocator(num_slots=SLOTS)
    pool = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), kv.create_slot_pool(**make))
    pools = [pool, pool]  # two GDN layers share the slot ids
    alloc, pools, slots, ok = _alloc_slots(alloc, pools, np.array([True, False, True]))
    assert bool(ok)
    np.testing.assert_array_equal(np.asarray(slots), [1, 0, 2])
    for layer in pools:  # fresh slots zeroed in every layer, the rest untouched (NaN)
        for leaf in jax.tree.leaves(layer):
            leaf = np.asarray(leaf, np.float32)
            assert (leaf[[1, 2]] == 0).all() and np.isnan(leaf[[0, 3, 4, 5]]).all()
    # All-or-nothing: 3 free slots, 4 wanted.
    alloc2, pools2, slots2, ok = _alloc_slots(alloc, pools, np.array([True] * 3 + [True]))
    assert not bool(ok) and (np.asarray(slots2) == 0).all()
    for x, y in zip(jax.tree.leaves((alloc, pools)), jax.tree.leaves((alloc2, pools2))):
        np.testing.assert_array_equal(_bits(x), _bits(y))
    # Free ignores 0; double free, duplicates and out-of-range ids are refused, changing nothing.
    alloc, ok = _free_slots(alloc, np.array([0, 2, 0], np.int32))
    assert bool(ok) and int(alloc.free_count) == 4
    for bad in ([2, 0, 0], [1, 1, 0], [SLOTS, 0, 0], [-1, 0, 0]):
        alloc_bad, ok = _free_slots(alloc, np.array(bad, np.int32))
        assert not bool(ok), bad
        for x, y in zip(jax.tree.leaves(alloc), jax.tree.leaves(alloc_bad)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # The freed slot comes back first (LIFO), zeroed again.
    alloc, pools, slots, ok = _alloc_slots(alloc, pools, np.array([False, True, False]))
    assert bool(ok) and int(slots[1]) == 2


def test_read_and_write_never_touch_the_null_slot():
    make = dict(num_slots=SLOTS, conv_dim=CONV, conv_width=W, num_v_heads=NV, head_k_dim=H,
                head_v_dim=HV, dtype=jnp.float32)
    pool = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), kv.create_slot_pool(**make))
    gen = rng()
    conv = gen.standard_normal((B, CONV, W - 1), dtype=np.float32)
    ssm = gen.standard_normal((B, NV, H, HV), dtype=np.float32)
    out = _write(pool, np.array([0, 3, -1], np.int32), conv, ssm)  # 0 and -1: padding
    ids = np.array([0, 3, SLOTS], np.int32)
    got_conv, got_ssm = (np.asarray(x) for x in _read(out, ids))
    assert (got_conv[[0, 2]] == 0).all() and (got_ssm[[0, 2]] == 0).all()  # zeros, not NaN
    np.testing.assert_array_equal(got_conv[1], conv[1])
    np.testing.assert_array_equal(got_ssm[1], ssm[1])
    # has_initial_state=False reads zeros even from a real slot (NaN around it or not).
    fresh = [np.asarray(x) for x in _read(out, ids, np.array([True, False, True]))]
    assert all((x == 0).all() for x in fresh)
    for leaf in jax.tree.leaves(out):
        leaf = np.asarray(leaf)
        assert np.isnan(np.delete(leaf, 3, axis=0)).all()  # only slot 3 was written


def test_slot_allocator_random_sequences_match_a_set_model():
    gen = rng()
    alloc = kv.create_slot_allocator(num_slots=SLOTS)
    free = list(range(SLOTS - 1, 0, -1))
    pool = kv.create_slot_pool(num_slots=SLOTS, conv_dim=2, conv_width=2, num_v_heads=1,
                               head_k_dim=1, head_v_dim=1)
    for _ in range(60):
        if gen.random() < 0.5:
            want = gen.random(B) < 0.5
            alloc, pool, slots, ok = _alloc_slots(alloc, pool, want)
            expect_ok = want.sum() <= len(free)
            assert bool(ok) == expect_ok
            if expect_ok:
                for b in np.flatnonzero(want):
                    assert int(slots[b]) == free.pop()
        else:
            held = [s for s in range(1, SLOTS) if s not in free]
            # Mostly slots in use (or padding 0); sometimes any id: double frees.
            pool_ids = held + [0] if gen.random() < 0.7 else list(range(SLOTS))
            pick = gen.choice(pool_ids, size=B)
            alloc, ok = _free_slots(alloc, pick.astype(np.int32))
            real = [int(s) for s in pick if s]
            expect_ok = len(set(real)) == len(real) and not set(real) & set(free)
            assert bool(ok) == expect_ok, pick
            if expect_ok:
                free.extend(real)
        count = int(alloc.free_count)
        assert count == len(free)
        np.testing.assert_array_equal(np.asarray(alloc.free_stack)[:count], free)
        owned = np.asarray(alloc.owned)
        assert not owned[0] and owned.sum() + count == SLOTS - 1
        assert not owned[free].any()


def test_errors():
    make = dict(num_slots=SLOTS, conv_dim=CONV, conv_width=W, num_v_heads=NV, head_k_dim=H,
                head_v_dim=HV)
    pool, alloc = kv.create_slot_pool(**make), kv.create_slot_allocator(num_slots=SLOTS)
    with pytest.raises(ValueError, match="num_slots=1 must be >= 2"):
        kv.create_slot_pool(**{**make, "num_slots": 1})
    with pytest.raises(ValueError, match="conv_width=1 must be >= 2"):
        kv.create_slot_pool(**{**make, "conv_width": 1})
    with pytest.raises(TypeError, match="must be a floating dtype"):
        kv.create_slot_pool(**make, dtype=jnp.int32)
    with pytest.raises(TypeError, match="want.dtype=int32 must be bool"):
        kv.alloc_slots(alloc, pool, jnp.array([1, 0]))
    with pytest.raises(TypeError, match="allocator must be a SlotAllocator"):
        kv.free_slots(pool, jnp.array([1]))
    with pytest.raises(ValueError, match=r"slots must have shape \[B\]"):
        kv.free_slots(alloc, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(TypeError, match="slots.dtype=float32 must be an integer"):
        kv.read_slots(pool, jnp.zeros(2))
    with pytest.raises(ValueError, match=r"ssm.shape=\(2, 2, 4, 3\) must be \[B Nv H Hv\]"):
        kv.write_slots(pool, jnp.zeros(2, jnp.int32), jnp.zeros((2, CONV, W - 1)),
                       jnp.zeros((2, NV, H, 3)))
    with pytest.raises(TypeError, match="pool must be a SlotPool"):
        kv.read_slots(alloc, jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"has_initial_state.shape=\(3,\) must be \[B\]"):
        kv.read_slots(pool, jnp.zeros(2, jnp.int32), jnp.ones(3, bool))
