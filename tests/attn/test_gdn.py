"""Gated DeltaNet: chunked == recurrent == float64 numpy, state carry, varlen, decode, slot pools.

Shapes are small (H = Hv = 16, a few heads) and reused across tests so each jitted function
compiles once per shape; the float64 numpy recurrence is the independent oracle.
"""

import importlib.util
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import gdn
from tests.utils import assert_close, case_id, poison, rng

H = HV = 16
NK, NV = 2, 4  # GVA ratio 2 unless a test says otherwise
C = 64

_STATIC = ("scale", "use_qk_l2norm", "chunk_size")
chunked = jax.jit(gdn.gdn_chunked, static_argnames=_STATIC)
recurrent = jax.jit(gdn.gdn_recurrent, static_argnames=_STATIC[:2])
decode_step = jax.jit(gdn.gdn_decode_step, static_argnames=_STATIC[:2])
decode_pool = jax.jit(gdn.gdn_decode_pool, static_argnames=_STATIC[:2])
prefill_pool = jax.jit(gdn.gdn_prefill_pool, static_argnames=_STATIC)


def _np(gen, shape, scale=1.0):
    return (gen.standard_normal(shape) * scale).astype(np.float32)


def _inputs(gen, b, t, nk=NK, nv=NV, h=H, hv=HV, dtype=np.float32):
    """Random q, k, v and realistic gates (per-token decay mostly 0.7..0.99, as hf_parity.md).

    numpy arrays: slicing them in tests compiles nothing."""
    q, k, v = (_np(gen, s).astype(dtype) for s in ((b, t, nk, h), (b, t, nk, h), (b, t, nv, hv)))
    x = _np(gen, (b, t, nv)) + gen.uniform(-3.0, 0.0, nv)  # a + dt_bias
    g = -gen.uniform(0.05, 1.0, nv) * np.log1p(np.exp(x))
    beta = 1 / (1 + np.exp(-_np(gen, (b, t, nv))))
    return q, k, v, g.astype(np.float32), beta.astype(np.float32)


def _naive64(q, k, v, g, beta, h0=None, scale=None, use_qk_l2norm=True):
    """Float64 numpy gated delta rule written from the paper's recurrence, one token at a time."""
    q, k, v, g, beta = (np.asarray(x).astype(np.float64) for x in (q, k, v, g, beta))
    b, t, nk, h = q.shape
    nv, hv = v.shape[2:]
    if use_qk_l2norm:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q * (h ** -0.5 if scale is None else scale)
    heads = np.arange(nv) // (nv // nk)  # value head -> key head
    s = np.zeros((b, nv, h, hv)) if h0 is None else np.asarray(h0, np.float64).copy()
    out = np.zeros((b, t, nv, hv))
    for i in range(t):
        qi, ki, vi = q[:, i, heads], k[:, i, heads], v[:, i]
        s = s * np.exp(g[:, i])[..., None, None]
        u = beta[:, i, :, None] * (vi - np.einsum("bnhv,bnh->bnv", s, ki))
        s = s + ki[..., :, None] * u[..., None, :]
        out[:, i] = np.einsum("bnhv,bnh->bnv", s, qi)
    return out, s


def _state(gen, rows, nv=NV):
    return _np(gen, (rows, nv, H, HV), scale=0.5)


def test_gating_and_l2norm():
    gen = rng()
    a = np.concatenate([gen.normal(0, 8, (3, 5)), [[25.0, 20.5, -40, 0, 19.9]]])
    a = a.astype(jnp.bfloat16)  # any float dtype goes in; the gates come out float32
    b, a_log, dt_bias = _np(gen, (4, 5)), _np(gen, (5,)), _np(gen, (5,))
    g, beta = gdn.gdn_gating(a, b, a_log, dt_bias)
    assert g.dtype == beta.dtype == jnp.float32
    x = a.astype(np.float64) + dt_bias
    softplus = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))  # torch's threshold
    assert_close(g, -np.exp(a_log.astype(np.float64)) * softplus)
    assert_close(beta, 1 / (1 + np.exp(-b.astype(np.float64))))
    assert (np.asarray(g) <= 0).all()
    x = _np(gen, (3, 7, 16))
    x64 = x.astype(np.float64)
    assert_close(gdn.l2norm(x), x64 / np.sqrt((x64 ** 2).sum(-1, keepdims=True) + 1e-6))
    assert_close(gdn.l2norm(np.zeros((2, 4), np.float32)), np.zeros((2, 4)))  # eps: 0 stays 0


@pytest.mark.parametrize("t", [1, C - 1, C, C + 1, 200], ids=lambda t: case_id(T=t))
def test_chunked_recurrent_naive_agree(t):
    gen = rng()
    q, k, v, g, beta = _inputs(gen, 1, t)
    h0 = _state(gen, 1)
    o_c, s_c = chunked(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    o_r, s_r = recurrent(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    o_n, s_n = _naive64(q, k, v, g, beta, h0)
    assert s_c.dtype == s_r.dtype == jnp.float32 and o_c.dtype == jnp.float32
    assert_close(o_c, o_r, err_msg="chunked vs recurrent")
    assert_close(s_c, s_r, err_msg="chunked vs recurrent state")
    assert_close(o_r, o_n, atol=1e-4, rtol=1e-4, err_msg="recurrent vs float64")
    assert_close(s_r, s_n, atol=1e-4, rtol=1e-4, err_msg="recurrent state vs float64")
    assert_close(o_c, o_n, atol=1e-4, rtol=1e-4, err_msg="chunked vs float64")


def test_gva_ratio_1_batch_2_without_initial_state():
    gen = rng()
    q, k, v, g, beta = _inputs(gen, 2, C + 1, nk=NV, nv=NV)
    o_c, s_c = chunked(q, k, v, g, beta, use_qk_l2norm=True)
    o_n, s_n = _naive64(q, k, v, g, beta)
    assert_close(o_c, o_n, atol=1e-4, rtol=1e-4)
    assert_close(s_c, s_n, atol=1e-4, rtol=1e-4)


def test_gva_maps_value_head_to_key_head_by_repeat():
    """Value head h reads key head h // (Nv // Nk): changing key head 1 moves only heads 2, 3."""
    gen = rng()
    q, k, v, g, beta = _inputs(gen, 1, C + 1)
    k2 = k.copy()
    k2[:, :, 1] = _np(gen, k2[:, :, 1].shape)
    h0 = _state(gen, 1)
    o1, _ = chunked(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    o2, _ = chunked(q, k2, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    np.testing.assert_array_equal(np.asarray(o1[:, :, :2]), np.asarray(o2[:, :, :2]))
    assert np.abs(np.asarray(o1[:, :, 2:] - o2[:, :, 2:])).max() > 1e-3


def test_gva_3_odd_dims_custom_scale_without_l2norm():
    """GVA 3, odd head dims, explicit scale, no l2norm, chunk 4 with T not a multiple of it."""
    gen = rng()
    q, k, v, g, beta = _inputs(gen, 2, 11, nk=1, nv=3, h=5, hv=3)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)  # keeps the rule stable without l2norm
    h0 = _np(gen, (2, 3, 5, 3))
    o_n, s_n = _naive64(q, k, v, g, beta, h0, scale=0.3, use_qk_l2norm=False)
    o_c, s_c = chunked(q, k, v, g, beta, scale=0.3, initial_state=h0, chunk_size=4)
    assert_close(o_c, o_n, atol=1e-4, rtol=1e-4)
    assert_close(s_c, s_n, atol=1e-4, rtol=1e-4)


# Piece lengths summing to 200, all among the lengths compiled above: splits inside chunks
# (63, 65, 195, ...), on chunk borders (64, 128, 192) and one-token pieces.
_SPLITS = [(65, 65, 65, 1, 1, 1, 1, 1), (64, 64, 64) + (1,) * 8, (63, 63, 63) + (1,) * 11,
           (1, 63, 1, 65, 1, 64, 1, 1, 1, 1, 1)]


@pytest.mark.parametrize("pieces", _SPLITS, ids=lambda p: "pieces" + "-".join(map(str, p[:4])))
def test_split_prefill_carries_state(pieces):
    """Prefill in pieces, each starting from the previous final state == one prefill."""
    gen = rng()
    xs = _inputs(gen, 1, sum(pieces))
    h0 = _state(gen, 1)
    o_full, s_full = chunked(*xs, initial_state=h0, use_qk_l2norm=True)
    state, outs, lo = h0, [], 0
    for n in pieces:
        o, state = chunked(*(x[:, lo : lo + n] for x in xs), initial_state=state,
                           use_qk_l2norm=True)
        outs.append(np.asarray(o))
        lo += n
    assert_close(np.concatenate(outs, axis=1), o_full)
    assert_close(state, s_full)


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def test_varlen_equals_per_sequence_calls():
    gen = rng()
    cu = _cu([1, C - 1, 0, C, C + 1, 200])
    xs = _inputs(gen, 1, int(cu[-1]))
    h0 = _state(gen, len(cu) - 1)
    o, s = chunked(*xs, initial_state=h0, use_qk_l2norm=True, cu_seqlens=cu)
    for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
        if lo == hi:  # an empty sequence keeps its initial state
            np.testing.assert_array_equal(np.asarray(s[i]), h0[i])
            continue
        o_i, s_i = chunked(*(x[:, lo:hi] for x in xs), initial_state=h0[i : i + 1],
                           use_qk_l2norm=True)
        assert_close(np.asarray(o)[:, lo:hi], o_i, err_msg=f"sequence {i}")
        assert_close(np.asarray(s)[i : i + 1], s_i, err_msg=f"sequence {i} state")


def test_matches_hf_torch_chunk_and_recurrent():
    """Parity target: transformers' torch fallbacks (Qwen3.5), l2norm on, with initial state."""
    if importlib.util.find_spec("fla") is not None:
        pytest.skip("transformers dispatches to fla's CUDA kernels when fla is installed; "
                    "test_matches_fla_triton_kernels_on_gpu covers those")
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = rng()
    xs = _inputs(gen, 1, C + 1)
    h0 = _state(gen, 1)
    o, s = chunked(*xs, initial_state=h0, use_qk_l2norm=True)
    tq, tk, tv, tg, tb, th = (torch.from_numpy(x) for x in (*xs, h0))
    for fn in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        o_hf, s_hf = fn(tq, tk, tv, g=tg, beta=tb, initial_state=th, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)
        assert_close(o, o_hf.numpy(), err_msg=fn.__name__)
        assert_close(s, s_hf.numpy(), err_msg=fn.__name__)


def test_bf16_inputs_output_dtype_and_accuracy():
    gen = rng()
    q, k, v, g, beta = _inputs(gen, 1, C + 1, dtype=jnp.bfloat16)
    h0 = _state(gen, 1)
    o, s = chunked(q, k, v, g, beta, initial_state=h0, use_qk_l2norm=True)
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o32, s32 = chunked(*(x.astype(np.float32) for x in (q, k, v)), g, beta, initial_state=h0,
                       use_qk_l2norm=True)
    assert_close(o, o32)
    assert_close(s, s32, atol=1e-5, rtol=1e-5)  # float32 math inside: only the output is rounded


def test_gradients_match_float64_directional_derivatives():
    """d loss / d input of the chunked form (chunk 4 over 11 tokens: several chunk borders),
    projected on a random direction per input, against central differences of the float64
    recurrence."""
    gen = rng()
    xs = _inputs(gen, 1, 11)
    h0, w = _state(gen, 1), _np(gen, (1, 11, NV, HV))

    def loss(*xs):
        o, s = gdn.gdn_chunked(*xs, initial_state=h0, use_qk_l2norm=True, chunk_size=4)
        return jnp.sum(o * w) + jnp.sum(s)

    def loss64(*xs):
        o, s = _naive64(*xs, h0)
        return (o * w).sum() + s.sum()

    grads = jax.jit(jax.grad(loss, argnums=tuple(range(5))))(*xs)
    eps = 1e-4
    for i, name in enumerate("q k v g beta".split()):
        d = gen.standard_normal(xs[i].shape)
        shifted = [[x.astype(np.float64) for x in xs] for _ in range(2)]
        shifted[0][i] = shifted[0][i] + eps * d
        shifted[1][i] = shifted[1][i] - eps * d
        numeric = (loss64(*shifted[0]) - loss64(*shifted[1])) / (2 * eps)
        analytic = float((np.asarray(grads[i], np.float64) * d).sum())
        assert abs(numeric - analytic) <= 1e-3 * (1 + abs(numeric)), (name, numeric, analytic)


def test_decode_step_equals_recurrent_step_and_continues_prefill():
    gen = rng()
    xs = _inputs(gen, 1, C + 1)
    h0 = _state(gen, 1)
    first = [x[:, :1] for x in xs]
    o_r, s_r = recurrent(*first, initial_state=h0, use_qk_l2norm=True)
    o_d, s_d = decode_step(*first, h0, use_qk_l2norm=True)
    assert_close(o_d, o_r)
    assert_close(s_d, s_r)
    # Prefill C tokens, then decode the last one: same as prefilling all C + 1.
    _, state = chunked(*(x[:, :C] for x in xs), initial_state=h0, use_qk_l2norm=True)
    o_last, state = decode_step(*(x[:, C:] for x in xs), state, use_qk_l2norm=True)
    o_full, s_full = chunked(*xs, initial_state=h0, use_qk_l2norm=True)
    assert_close(o_last, np.asarray(o_full)[:, C:])
    assert_close(state, s_full)


SLOTS = 8


def _pool_case(gen, t):
    """Batch of 4 rows: slots 5, 0 (padding), 2 (a fresh request), 7; every slot holds an old
    state."""
    xs = _inputs(gen, 4, t)
    pool = _np(gen, (SLOTS, NV, H, HV), scale=0.5)
    slot_ids = np.asarray([5, 0, 2, 7], np.int32)
    has_init = np.asarray([True, True, False, True])
    return xs, pool, slot_ids, has_init


def _run_pool(t, xs, pool, slot_ids, has_init):
    fn = decode_pool if t == 1 else prefill_pool
    o, new_pool = fn(*xs, pool, slot_ids, has_initial_state=has_init, use_qk_l2norm=True)
    return np.asarray(o), np.asarray(new_pool)


@pytest.mark.parametrize("t", [1, C + 1], ids=["decode", "prefill"])
def test_pool_matches_per_request(t):
    gen = rng()
    xs, pool, slot_ids, has_init = _pool_case(gen, t)
    o, new_pool = _run_pool(t, xs, pool, slot_ids, has_init)
    for row, (slot, init) in enumerate(zip(slot_ids, has_init)):
        if slot == 0:
            np.testing.assert_array_equal(o[row], 0)  # padding row outputs 0
            continue
        h0 = pool[slot : slot + 1] if init else np.zeros_like(pool[:1])
        o_i, s_i = chunked(*(x[row : row + 1] for x in xs), initial_state=h0, use_qk_l2norm=True)
        assert_close(o[row : row + 1], o_i, err_msg=f"row {row}")
        assert_close(new_pool[slot : slot + 1], s_i, err_msg=f"slot {slot}")
    untouched = [s for s in range(1, SLOTS) if s not in slot_ids]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("t", [1, C + 1], ids=["decode", "prefill"])
@pytest.mark.parametrize("stale", ["old_state", "nan"])
def test_pool_stale_slot_of_a_fresh_request_is_ignored(t, stale):
    """Row 2 starts fresh (has_initial_state False): whatever its slot holds gives bitwise the
    same output and final state as a zeroed slot."""
    gen = rng()
    xs, pool, slot_ids, has_init = _pool_case(gen, t)
    clean, dirty = pool.copy(), pool.copy()
    clean[2] = 0.0
    dirty[2] = np.nan if stale == "nan" else 7.0 * pool[2]
    o_a, p_a = _run_pool(t, xs, clean, slot_ids, has_init)
    o_b, p_b = _run_pool(t, xs, dirty, slot_ids, has_init)
    np.testing.assert_array_equal(o_a, o_b)
    np.testing.assert_array_equal(p_a[1:], p_b[1:])
    assert np.isfinite(o_b).all()


@pytest.mark.parametrize("t", [1, C + 1], ids=["decode", "prefill"])
def test_pool_nan_in_other_slots_changes_nothing(t):
    """Every slot not owned by a live row (the null slot 0 included) is NaN: bitwise no change."""
    gen = rng()
    xs, pool, slot_ids, has_init = _pool_case(gen, t)
    live = slot_ids[slot_ids > 0]
    owned = np.isin(np.arange(SLOTS), live)
    poisoned = np.asarray(poison(pool, owned))
    o_a, p_a = _run_pool(t, xs, pool, slot_ids, has_init)
    o_b, p_b = _run_pool(t, xs, poisoned, slot_ids, has_init)
    np.testing.assert_array_equal(o_a, o_b)
    np.testing.assert_array_equal(p_a[live], p_b[live])
    assert np.isfinite(o_b).all()


@pytest.mark.parametrize("t", [1, C + 1], ids=["decode", "prefill"])
def test_pool_batch_reorder_keeps_request_with_its_slot(t):
    gen = rng()
    xs, pool, slot_ids, has_init = _pool_case(gen, t)
    perm = np.asarray([2, 0, 3, 1])
    o_a, p_a = _run_pool(t, xs, pool, slot_ids, has_init)
    o_b, p_b = _run_pool(t, [x[perm] for x in xs], pool, slot_ids[perm], has_init[perm])
    np.testing.assert_array_equal(o_a[perm], o_b)
    np.testing.assert_array_equal(p_a[1:], p_b[1:])


def test_prefill_pool_varlen():
    """Packed prefill of 3 requests on the pool: a fresh one, a padding sequence, a continuing
    one (a 1-token segment with state, as a decode inside a mixed batch)."""
    gen = rng()
    cu = _cu([C - 1, C + 1, 1])
    xs = _inputs(gen, 1, int(cu[-1]))
    pool = _np(gen, (SLOTS, NV, H, HV), scale=0.5)
    slot_ids = np.asarray([3, 0, 6], np.int32)
    has_init = np.asarray([False, True, True])
    o, new_pool = prefill_pool(*xs, pool, slot_ids, has_initial_state=has_init,
                               use_qk_l2norm=True, cu_seqlens=cu)
    o, new_pool = np.asarray(o), np.asarray(new_pool)
    np.testing.assert_array_equal(o[:, cu[1] : cu[2]], 0)  # the padding sequence
    for i in (0, 2):
        h0 = pool[slot_ids[i]][None] if has_init[i] else np.zeros_like(pool[:1])
        o_i, s_i = chunked(*(x[:, cu[i] : cu[i + 1]] for x in xs), initial_state=h0,
                           use_qk_l2norm=True)
        assert_close(o[:, cu[i] : cu[i + 1]], o_i)
        assert_close(new_pool[slot_ids[i]][None], s_i)
    np.testing.assert_array_equal(new_pool[[1, 2, 4, 5, 7]], pool[[1, 2, 4, 5, 7]])


def _ones(shape, dtype=np.float32):
    return np.ones(shape, dtype)


_GOOD = dict(q=(1, 3, 2, 4), k=(1, 3, 2, 4), v=(1, 3, 4, 5), g=(1, 3, 4), beta=(1, 3, 4))


def _bad(fn, **override):
    args = {name: override.pop(name, _ones(shape, np.float32)) for name, shape in _GOOD.items()}
    return lambda: fn(*args.values(), **override)


@pytest.mark.parametrize("case", [
    ("q rank", ValueError, "q must have shape", _bad(gdn.gdn_chunked, q=_ones((3, 2, 4)))),
    ("k shape", ValueError, "k.shape", _bad(gdn.gdn_chunked, k=_ones((1, 3, 1, 4)))),
    ("v batch", ValueError, "v.shape", _bad(gdn.gdn_recurrent, v=_ones((2, 3, 4, 5)))),
    ("gva", ValueError, "Nv=3 must be divisible by Nk=2",
     _bad(gdn.gdn_chunked, v=_ones((1, 3, 3, 5)), g=_ones((1, 3, 3)),
          beta=_ones((1, 3, 3)))),
    ("g shape", ValueError, "g.shape", _bad(gdn.gdn_chunked, g=_ones((1, 3, 2)))),
    ("beta shape", ValueError, "beta.shape", _bad(gdn.gdn_recurrent, beta=_ones((1, 3)))),
    ("int q", TypeError, "q.dtype", _bad(gdn.gdn_chunked, q=_ones((1, 3, 2, 4), np.int32))),
    ("empty", ValueError, "at least one token",
     lambda: gdn.gdn_chunked(*(_ones((1, 0) + s[2:]) for s in _GOOD.values()))),
    ("scale", ValueError, "scale=0.0", _bad(gdn.gdn_recurrent, scale=0.0)),
    ("chunk size", ValueError, "chunk_size=0", _bad(gdn.gdn_chunked, chunk_size=0)),
    ("chunk type", TypeError, "chunk_size=64.0", _bad(gdn.gdn_chunked, chunk_size=64.0)),
    ("state shape", ValueError, "initial_state.shape",
     _bad(gdn.gdn_chunked, initial_state=_ones((1, 4, 5, 4)))),
    ("state shape rec", ValueError, "initial_state.shape",
     _bad(gdn.gdn_recurrent, initial_state=_ones((2, 4, 4, 5)))),
    ("cu dtype", TypeError, "cu_seqlens.dtype",
     _bad(gdn.gdn_chunked, cu_seqlens=np.asarray([0.0, 3.0]))),
    ("cu rank", ValueError, "cu_seqlens must have shape",
     _bad(gdn.gdn_chunked, cu_seqlens=np.zeros((2, 2), np.int32))),
    ("cu short", ValueError, "at least 2 entries",
     _bad(gdn.gdn_chunked, cu_seqlens=np.zeros((1,), np.int32))),
    ("cu values", ValueError, "rise from 0",
     _bad(gdn.gdn_chunked, cu_seqlens=np.asarray([0, 2, 1, 3], np.int32))),
    ("cu end", ValueError, "token count 3", _bad(gdn.gdn_chunked, cu_seqlens=np.asarray([0, 2]))),
    ("cu batch", ValueError, "batch=2 must be 1",
     lambda: gdn.gdn_chunked(*(_ones((2,) + s[1:]) for s in _GOOD.values()),
                             cu_seqlens=np.asarray([0, 3]))),
    ("cu states", ValueError, "initial_state.shape",
     _bad(gdn.gdn_chunked, cu_seqlens=np.asarray([0, 1, 3]),
          initial_state=_ones((1, 4, 4, 5)))),
    ("decode T", ValueError, "T=1", _bad(gdn.gdn_decode_step, state=_ones((1, 4, 4, 5)))),
    ("impl", ValueError, "implementation=", _bad(gdn.gdn_chunked, implementation="cuda")),
    ("xla only", TypeError, "implementation", _bad(gdn.gdn_recurrent, implementation="xla")),
    ("gating shapes", ValueError, "b.shape",
     lambda: gdn.gdn_gating(_ones((3, 4)), _ones((3, 2)), _ones(4), _ones(4))),
    ("gating A_log", ValueError, "A_log.shape",
     lambda: gdn.gdn_gating(_ones((3, 4)), _ones((3, 4)), _ones(2), _ones(4))),
    ("gating dtype", TypeError, "dt_bias.dtype",
     lambda: gdn.gdn_gating(_ones((3, 4)), _ones((3, 4)), _ones(4),
                            _ones(4, np.int32))),
    ("l2norm dtype", TypeError, "x.dtype", lambda: gdn.l2norm(_ones(4, np.int32))),
    ("l2norm eps", ValueError, "eps=0", lambda: gdn.l2norm(_ones(4), eps=0)),
], ids=lambda case: case[0])
def test_bad_input(case):
    _, error, match, call = case
    with pytest.raises(error, match=match):
        call()


def _one_token(b=2):
    return [_ones((b, 1) + s[2:]) for s in _GOOD.values()]


@pytest.mark.parametrize("case", [
    ("pool shape", ValueError, "ssm_pool.shape",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 5, 4)), np.asarray([1, 2]))),
    ("slot dtype", TypeError, "slot_ids.dtype",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1.0, 2]))),
    ("slot count", ValueError, "slot_ids.shape",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1]))),
    ("slot range", ValueError, r"must lie in \[0, 4\)",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1, 4]))),
    ("slot negative", ValueError, "must lie in",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([-2, 1]))),
    ("slot shared", ValueError, "share a slot",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([3, 3]))),
    ("has_init dtype", TypeError, "has_initial_state.dtype",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1, 2]),
                                 has_initial_state=np.asarray([1, 0]))),
    ("has_init shape", ValueError, "has_initial_state.shape",
     lambda: gdn.gdn_decode_pool(*_one_token(), _ones((4, 4, 4, 5)), np.asarray([1, 2]),
                                 has_initial_state=np.asarray([True]))),
    ("prefill slots per seq", ValueError, "slot_ids.shape",
     lambda: gdn.gdn_prefill_pool(*_bad(lambda *a: a)(), _ones((4, 4, 4, 5)),
                                  np.asarray([1]), cu_seqlens=np.asarray([0, 1, 3]))),
], ids=lambda case: case[0])
def test_bad_pool_input(case):
    _, error, match, call = case
    with pytest.raises(error, match=match):
        call()


def test_padding_slot_minus_one_maps_to_null_slot_under_jit():
    """A stray -1 never wraps to the last slot: it is padding (output 0, writes slot 0 only)."""
    gen = rng()
    xs, pool, _, has_init = _pool_case(gen, 1)
    o, new_pool = _run_pool(1, xs, pool, np.asarray([-1, 3, 0, 5], np.int32), has_init)
    np.testing.assert_array_equal(o[[0, 2]], 0)
    untouched = [1, 2, 4, 6, 7]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.gpu
def test_matches_fla_triton_kernels_on_gpu(tmp_path, monkeypatch):
    """Parity with fla's chunked and fused-recurrent Triton kernels at model dims (GVA 2,
    H = Hv = 128), varlen with per-sequence initial states."""
    torch = pytest.importorskip("torch")
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    import triton

    # fla's autotuner caches on disk: a writable cache folder, or its first compile fails.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path), raising=False)
    gen = rng()
    cu = _cu([1, C - 1, C, C + 1, 700, 1000])
    xs = _inputs(gen, 1, int(cu[-1]), nk=4, nv=8, h=128, hv=128)
    h0 = _np(gen, (len(cu) - 1, 8, 128, 128), scale=0.5)
    o, s = chunked(*xs, initial_state=h0, use_qk_l2norm=True, cu_seqlens=cu)
    tx = [torch.from_numpy(x).cuda() for x in (*xs, h0)]
    kw = dict(initial_state=tx[5], output_final_state=True, use_qk_l2norm_in_kernel=True,
              cu_seqlens=torch.from_numpy(cu).long().cuda())
    # fla's chunk kernel multiplies in TF32 (measured on H100: 2e-4 on o, 1e-3 on the state);
    # its fused recurrent kernel is float32 throughout (7e-8 and 5e-7).
    for fn, tol in ((fla.chunk_gated_delta_rule, 5e-3), (fla.fused_recurrent_gated_delta_rule,
                                                         2e-5)):
        o_f, s_f = fn(*tx[:3], g=tx[3], beta=tx[4], **kw)
        assert_close(o, o_f.cpu().numpy(), atol=tol, rtol=tol, err_msg=fn.__name__)
        assert_close(s, s_f.cpu().numpy(), atol=tol, rtol=tol, err_msg=fn.__name__)
