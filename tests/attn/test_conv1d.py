"""Causal depthwise conv1d: float64 oracle, prefill == per-step updates, state carry, varlen,
slot pools, HF parity, bad input."""

import importlib.util
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attn import conv1d
from tests.utils import assert_close, poison, rng

CH, W = 24, 4
SLOTS = 8

prefill = jax.jit(conv1d.causal_conv1d, static_argnames=("activation",))
update = jax.jit(conv1d.causal_conv1d_update, static_argnames=("activation",))
update_pool = jax.jit(conv1d.causal_conv1d_update_pool, static_argnames=("activation",))
prefill_pool = jax.jit(conv1d.causal_conv1d_prefill_pool, static_argnames=("activation",))


def _np(gen, shape, dtype=np.float32):
    return gen.standard_normal(shape).astype(dtype)


def _conv64(x, weight, bias=None, state=None, activation=None):
    """Float64 loop over taps: tap j of token t reads position t - (W - 1) + j, negative
    positions come from the state (its last entry is position -1)."""
    x = np.asarray(x).astype(np.float64)
    b, t, c = x.shape
    w = weight.shape[1]
    state = np.zeros((b, c, w - 1)) if state is None else np.asarray(state).astype(np.float64)

    def at(p):  # [B, C] raw input at position p
        return x[:, p] if p >= 0 else state[:, :, w - 1 + p]

    y = np.zeros((b, t, c))
    for i in range(t):
        y[:, i] = sum(weight[:, j].astype(np.float64) * at(i - (w - 1) + j) for j in range(w))
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = y / (1 + np.exp(-y))
    return y, np.stack([at(t - (w - 1) + m) for m in range(w - 1)], axis=-1)


@pytest.mark.parametrize("width,bias,activation,with_state", [
    (4, True, "silu", True), (4, False, None, False), (2, True, None, True)],
    ids=["W4-bias-silu-state", "W4-plain", "W2-bias-state"])
def test_prefill_matches_float64(width, bias, activation, with_state):
    gen = rng()
    x, weight = _np(gen, (2, 9, CH)), _np(gen, (CH, width))
    b = _np(gen, (CH,)) if bias else None
    state = _np(gen, (2, CH, width - 1)) if with_state else None
    y, final = prefill(x, weight, b, initial_state=state, activation=activation)
    y64, final64 = _conv64(x, weight, b, state, activation)
    assert_close(y, y64)
    np.testing.assert_array_equal(np.asarray(final), final64.astype(np.float32))  # raw inputs


def test_prefill_equals_per_step_updates():
    gen = rng()
    x, weight, bias = _np(gen, (2, 9, CH)), _np(gen, (CH, W)), _np(gen, (CH,))
    state0 = _np(gen, (2, CH, W - 1))
    y, final = prefill(x, weight, bias, initial_state=state0, activation="silu")
    state, ys = state0, []
    for t in range(x.shape[1]):
        y_t, state = update(x[:, t], state, weight, bias, "silu")
        ys.append(np.asarray(y_t))
    assert_close(np.stack(ys, axis=1), y)
    np.testing.assert_array_equal(np.asarray(state), np.asarray(final))


@pytest.mark.parametrize("pieces", [(1, 2, 6), (4, 5), (3, 3, 3), (7, 2), (1, 1, 1, 6)],
                         ids=lambda p: "pieces" + "-".join(map(str, p)))
def test_split_prefill_carries_state(pieces):
    """Pieces shorter than W - 1 keep part of the old state; the carry is exact."""
    gen = rng()
    x, weight = _np(gen, (1, sum(pieces), CH)), _np(gen, (CH, W))
    state0 = _np(gen, (1, CH, W - 1))
    y_full, s_full = prefill(x, weight, initial_state=state0, activation="silu")
    state, ys, lo = state0, [], 0
    for n in pieces:
        y, new_state = prefill(x[:, lo : lo + n], weight, initial_state=state, activation="silu")
        # New state = last W - 1 of concat(old state, piece).
        expected = np.concatenate([np.asarray(state), x[:, lo : lo + n].swapaxes(1, 2)], -1)
        np.testing.assert_array_equal(np.asarray(new_state), expected[:, :, -(W - 1):])
        state = new_state
        ys.append(np.asarray(y))
        lo += n
    np.testing.assert_array_equal(np.concatenate(ys, axis=1), np.asarray(y_full))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(s_full))


def test_short_sequence_keeps_part_of_old_state():
    old = np.arange(3, dtype=np.float32)[None, None, :] + 1.0  # [1, 1, W - 1] = [1, 2, 3]
    _, state = conv1d.causal_conv1d(np.full((1, 1, 1), 9.0, np.float32), np.ones((1, W),
                                    np.float32), initial_state=old)
    np.testing.assert_array_equal(np.asarray(state), [[[2.0, 3.0, 9.0]]])


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def test_varlen_equals_per_sequence_calls():
    gen = rng()
    cu = _cu([2, 0, 7, 1, 5, 3])
    x, weight, bias = _np(gen, (1, int(cu[-1]), CH)), _np(gen, (CH, W)), _np(gen, (CH,))
    state0 = _np(gen, (len(cu) - 1, CH, W - 1))
    y, final = prefill(x, weight, bias, initial_state=state0, activation="silu", cu_seqlens=cu)
    y, final = np.asarray(y), np.asarray(final)
    for i, (lo, hi) in enumerate(itertools.pairwise(cu)):
        if lo == hi:
            np.testing.assert_array_equal(final[i], state0[i])
            continue
        y_i, s_i = _conv64(x[:, lo:hi], weight, bias, state0[i : i + 1], "silu")
        assert_close(y[:, lo:hi], y_i, err_msg=f"sequence {i}")
        np.testing.assert_array_equal(final[i : i + 1], s_i.astype(np.float32))


def test_bf16_keeps_raw_inputs_in_state():
    gen = rng()
    x = _np(gen, (2, 5, CH)).astype(jnp.bfloat16)
    weight = _np(gen, (CH, W)).astype(jnp.bfloat16)
    y, state = prefill(x, weight, activation="silu")
    assert y.dtype == state.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(state), x[:, -(W - 1):].swapaxes(1, 2))
    y64, _ = _conv64(x.astype(np.float32), weight.astype(np.float32), activation="silu")
    assert_close(y, y64)


def _pool_case(gen):
    """Rows use slots 5, 0 (padding), 2 (a fresh request), 7; every slot holds old inputs."""
    x, weight, bias = _np(gen, (4, CH)), _np(gen, (CH, W)), _np(gen, (CH,))
    pool = _np(gen, (SLOTS, CH, W - 1))
    return x, weight, bias, pool, np.asarray([5, 0, 2, 7], np.int32), np.asarray(
        [True, True, False, True])


def _run_pool(x, weight, bias, pool, slot_ids, has_init):
    y, new_pool = update_pool(x, pool, slot_ids, weight, bias, "silu", has_initial_state=has_init)
    return np.asarray(y), np.asarray(new_pool)


def test_update_pool_matches_per_request():
    gen = rng()
    x, weight, bias, pool, slot_ids, has_init = _pool_case(gen)
    y, new_pool = _run_pool(x, weight, bias, pool, slot_ids, has_init)
    for row, (slot, init) in enumerate(zip(slot_ids, has_init)):
        if slot == 0:
            np.testing.assert_array_equal(y[row], 0)
            continue
        state = pool[slot : slot + 1] if init else np.zeros_like(pool[:1])
        y_i, s_i = _conv64(x[row : row + 1, None], weight, bias, state, "silu")
        assert_close(y[row], y_i[0, 0])
        np.testing.assert_array_equal(new_pool[slot], s_i[0].astype(np.float32))
    untouched = [1, 3, 4, 6]
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("stale", ["old_state", "nan"])
def test_update_pool_stale_slot_of_a_fresh_request_is_ignored(stale):
    gen = rng()
    x, weight, bias, pool, slot_ids, has_init = _pool_case(gen)
    clean, dirty = pool.copy(), pool.copy()
    clean[2] = 0.0
    dirty[2] = np.nan if stale == "nan" else 5.0 * pool[2]
    y_a, p_a = _run_pool(x, weight, bias, clean, slot_ids, has_init)
    y_b, p_b = _run_pool(x, weight, bias, dirty, slot_ids, has_init)
    np.testing.assert_array_equal(y_a, y_b)
    np.testing.assert_array_equal(p_a[1:], p_b[1:])
    assert np.isfinite(y_b).all()


def test_update_pool_nan_neighbours_and_reorder():
    gen = rng()
    x, weight, bias, pool, slot_ids, has_init = _pool_case(gen)
    live = slot_ids[slot_ids > 0]
    poisoned = np.asarray(poison(pool, np.isin(np.arange(SLOTS), live)))
    y_a, p_a = _run_pool(x, weight, bias, pool, slot_ids, has_init)
    y_b, p_b = _run_pool(x, weight, bias, poisoned, slot_ids, has_init)
    np.testing.assert_array_equal(y_a, y_b)
    np.testing.assert_array_equal(p_a[live], p_b[live])
    perm = np.asarray([3, 1, 0, 2])
    y_c, p_c = _run_pool(x[perm], weight, bias, pool, slot_ids[perm], has_init[perm])
    np.testing.assert_array_equal(y_a[perm], y_c)
    np.testing.assert_array_equal(p_a[1:], p_c[1:])
    y_d, p_d = _run_pool(x, weight, bias, pool, np.asarray([-1, 0, 2, 7], np.int32), has_init)
    np.testing.assert_array_equal(y_d[[0, 1]], 0)  # -1 is padding, never the last slot
    np.testing.assert_array_equal(p_d[[1, 3, 4, 5, 6]], pool[[1, 3, 4, 5, 6]])


def test_prefill_pool_varlen_with_fresh_and_padding_sequences():
    gen = rng()
    cu = _cu([2, 7, 1, 5])
    x, weight, bias = _np(gen, (1, int(cu[-1]), CH)), _np(gen, (CH, W)), _np(gen, (CH,))
    pool = _np(gen, (SLOTS, CH, W - 1))
    pool[4] = np.nan  # the fresh request's stale slot
    slot_ids = np.asarray([3, 4, 0, 6], np.int32)
    has_init = np.asarray([True, False, True, True])
    y, new_pool = prefill_pool(x, pool, slot_ids, weight, bias, activation="silu",
                               has_initial_state=has_init, cu_seqlens=cu)
    y, new_pool = np.asarray(y), np.asarray(new_pool)
    np.testing.assert_array_equal(y[:, cu[2] : cu[3]], 0)  # padding sequence
    for i in (0, 1, 3):
        state = pool[slot_ids[i]][None] if has_init[i] else np.zeros_like(pool[:1])
        y_i, s_i = _conv64(x[:, cu[i] : cu[i + 1]], weight, bias, state, "silu")
        assert_close(y[:, cu[i] : cu[i + 1]], y_i, err_msg=f"sequence {i}")
        np.testing.assert_array_equal(new_pool[slot_ids[i]], s_i[0].astype(np.float32))
    np.testing.assert_array_equal(new_pool[[1, 2, 5, 7]], pool[[1, 2, 5, 7]])


def test_matches_hf_torch_functions():
    """HF's fallbacks take [B, C, T] and weight [C, W]; its update keeps W inputs per state."""
    if importlib.util.find_spec("causal_conv1d") is not None:
        pytest.skip("transformers dispatches to the causal_conv1d CUDA package when installed")
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = rng()
    x, weight, bias = _np(gen, (2, 9, CH)), _np(gen, (CH, W)), _np(gen, (CH,))
    y, _ = prefill(x, weight, bias, activation="silu")
    tw, tb = torch.from_numpy(weight), torch.from_numpy(bias)
    y_hf = hf.causal_conv1d_fn(torch.from_numpy(x.swapaxes(1, 2).copy()), tw, tb,
                               activation="silu")
    assert_close(y, y_hf.numpy().swapaxes(1, 2))
    hf_state = torch.from_numpy(_np(gen, (2, CH, W)))  # HF: W entries, the first one unused
    ours = hf_state.numpy()[:, :, 1:].copy()
    x_t = _np(gen, (2, CH))
    y_hf = hf.causal_conv1d_update(torch.from_numpy(x_t[:, :, None].copy()), hf_state, tw, tb,
                                   "silu")
    y_t, new_state = update(x_t, ours, weight, bias, "silu")
    assert_close(y_t, y_hf.numpy()[:, :, 0])
    np.testing.assert_array_equal(np.asarray(new_state), hf_state.numpy()[:, :, 1:])


def _ones(shape, dtype=np.float32):
    return np.ones(shape, dtype)


X, WT = _ones((1, 3, CH)), _ones((CH, W))


@pytest.mark.parametrize("case", [
    ("x rank", ValueError, "x must have shape", lambda: conv1d.causal_conv1d(_ones((3, CH)), WT)),
    ("x dtype", TypeError, "x.dtype", lambda: conv1d.causal_conv1d(X.astype(np.int32), WT)),
    ("empty", ValueError, "at least one token",
     lambda: conv1d.causal_conv1d(_ones((1, 0, CH)), WT)),
    ("hf weight", ValueError, r"pass weight\[:, 0\]",
     lambda: conv1d.causal_conv1d(X, _ones((CH, 1, W)))),
    ("weight rank", ValueError, "weight must have shape",
     lambda: conv1d.causal_conv1d(X, _ones((CH,)))),
    ("weight channels", ValueError, "weight.shape\\[0\\]=5",
     lambda: conv1d.causal_conv1d(X, _ones((5, W)))),
    ("width", ValueError, "W=1 must be >= 2", lambda: conv1d.causal_conv1d(X, _ones((CH, 1)))),
    ("bias", ValueError, "bias.shape", lambda: conv1d.causal_conv1d(X, WT, _ones((3,)))),
    ("activation", ValueError, "activation='gelu'",
     lambda: conv1d.causal_conv1d(X, WT, activation="gelu")),
    ("state", ValueError, "initial_state.shape",
     lambda: conv1d.causal_conv1d(X, WT, initial_state=_ones((1, CH, W)))),
    ("cu batch", ValueError, "batch=2 must be 1",
     lambda: conv1d.causal_conv1d(_ones((2, 3, CH)), WT, cu_seqlens=np.asarray([0, 3]))),
    ("cu values", ValueError, "rise from 0",
     lambda: conv1d.causal_conv1d(X, WT, cu_seqlens=np.asarray([0, 2, 2]))),
    ("cu states", ValueError, "initial_state.shape",
     lambda: conv1d.causal_conv1d(X, WT, cu_seqlens=np.asarray([0, 1, 3]),
                                  initial_state=_ones((1, CH, W - 1)))),
    ("xla only", TypeError, "implementation",
     lambda: conv1d.causal_conv1d_update(X[:, 0], _ones((1, CH, W - 1)), WT,
                                         implementation="xla")),
    ("update x", ValueError, "x must have shape",
     lambda: conv1d.causal_conv1d_update(X, _ones((1, CH, W - 1)), WT)),
    ("update state", ValueError, "conv_state.shape",
     lambda: conv1d.causal_conv1d_update(X[:, 0], _ones((1, CH, W)), WT)),
    ("pool shape", ValueError, "conv_pool.shape",
     lambda: conv1d.causal_conv1d_update_pool(X[:, 0], _ones((4, CH, W)), np.asarray([1]), WT)),
    ("slot range", ValueError, "must lie in",
     lambda: conv1d.causal_conv1d_update_pool(X[:, 0], _ones((4, CH, W - 1)), np.asarray([4]),
                                              WT)),
    ("slot dtype", TypeError, "slot_ids.dtype",
     lambda: conv1d.causal_conv1d_update_pool(X[:, 0], _ones((4, CH, W - 1)),
                                              np.asarray([1.0]), WT)),
    ("slot shared", ValueError, "share a slot",
     lambda: conv1d.causal_conv1d_prefill_pool(_ones((2, 3, CH)), _ones((4, CH, W - 1)),
                                               np.asarray([2, 2]), WT)),
    ("has_init", TypeError, "has_initial_state.dtype",
     lambda: conv1d.causal_conv1d_prefill_pool(X, _ones((4, CH, W - 1)), np.asarray([2]), WT,
                                               has_initial_state=np.asarray([1]))),
    ("prefill slots per seq", ValueError, "slot_ids.shape",
     lambda: conv1d.causal_conv1d_prefill_pool(X, _ones((4, CH, W - 1)), np.asarray([2]), WT,
                                               cu_seqlens=np.asarray([0, 1, 3]))),
], ids=lambda case: case[0])
def test_bad_input(case):
    _, error, match, call = case
    with pytest.raises(error, match=match):
        call()
